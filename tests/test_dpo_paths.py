"""
dpo.py's paths, numerically: the RPO/NLL term of --sft-weight against a hand computation (sign included); the tiny
preset's default path, self-generated pairs through main (too-long filtering, pair counts) and the per-rank sampling
seeds. (The live vs precomputed reference at fp32 tolerance is test_dpo.test_main_tiny_..._live_reference_agrees.)
"""

import argparse
import math

import pytest
import torch

import common
import dpo
import rollout
import tasks
from conftest import ends_turn_sometimes, make_model, make_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def by_hand_logp(model, ids, mask):
    """sum over trained tokens of log softmax(logits at t - 1)[ids[t]], in float64 from the logits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].double()  # (T, V)
    total = 0.0
    for t in range(1, len(ids)):
        if mask[t]:
            row = logits[t - 1].tolist()
            total += row[ids[t]] - math.log(sum(math.exp(v) for v in row))
    return total, sum(mask[1:])


def test_rpo_term_matches_hand_computed_value_and_sign(tokenizer):
    model = make_model(tokenizer)
    preferences = tasks.SyntheticPreferences("train", size=3)
    pairs = [tasks.render_pair(tokenizer, preferences[i], 128) for i in range(3)]
    # A reference that is not the policy, so the DPO term is not log 2 everywhere.
    ref = torch.tensor([[-60.0, -70.0], [-95.0, -80.0], [-75.0, -75.0]])
    beta, alpha = 0.05, 0.7
    args = argparse.Namespace(beta=beta, loss_type="sigmoid", label_smoothing=0.0, gamma=0.5, sft_weight=alpha)
    losses, stats = dpo.preference_losses(model, pairs, ref, args, tokenizer.bos_id, "cpu")

    expected = []
    for (chosen, rejected), (ref_chosen, ref_rejected) in zip(pairs, ref.tolist()):
        logp_chosen, length = by_hand_logp(model, *chosen)
        logp_rejected, _ = by_hand_logp(model, *rejected)
        h = (logp_chosen - ref_chosen) - (logp_rejected - ref_rejected)
        dpo_term = math.log1p(math.exp(-beta * h))  # -log sigma(beta h)
        nll = -logp_chosen / length  # > 0: the mean NLL per token of the chosen answer
        assert nll > 1.0
        expected.append(dpo_term + alpha * nll)
    assert losses.tolist() == pytest.approx(expected, rel=1e-5)
    assert stats["loss"].item() == pytest.approx(sum(expected), rel=1e-5)

    # Its gradient raises the chosen answer's log-prob: with the DPO term off (beta tiny, so sigma' ~ constant),
    # one SGD step on the NLL alone increases log pi(y_w | x).
    nll_only = argparse.Namespace(**{**vars(args), "beta": 1e-8})
    losses, _ = dpo.preference_losses(model, pairs[:1], ref[:1], nll_only, tokenizer.bos_id, "cpu")
    losses.sum().backward()
    before = by_hand_logp(model, *pairs[0][0])[0]
    with torch.no_grad():
        for p in model.parameters():
            p -= 1e-2 * p.grad
    assert by_hand_logp(model, *pairs[0][0])[0] > before + 0.1


class ParityTask:
    """Synthetic prompts (optionally all the same one) with a toy verifier: an even-length answer is correct."""

    def __init__(self, split, size, same_prompt=False):
        self.task = tasks.SyntheticTask(split, size=size)
        self.same_prompt = same_prompt

    def __len__(self):
        return len(self.task)

    def __getitem__(self, i):
        return self.task[0 if self.same_prompt else i]

    def reward(self, conversation, completion):
        return float(len(completion) % 2 == 0)


TINY = ["--preset", "tiny", "--device", "cpu", "--train-pairs", "48", "--eval-pairs", "16", "--samples", "4",
        "--max-new-tokens", "10", "--batch-size", "8", "--device-batch-tokens", "240", "--beta", "0.1",
        "--check-problems", "4", "--check-samples", "1", "--eval-every", "100"]


def test_tiny_preset_default_path_self_generated_pairs_through_main(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    monkeypatch.setattr(dpo, "task_by_name", lambda name, split, size, seed: ParityTask(split, size))
    model = ends_turn_sometimes(make_model(tokenizer), tokenizer)  # only an answer that stops can be chosen
    common.save_checkpoint(tmp_path / "checkpoints" / "sft", 1, model, {"stage": "sft"}, tokenizer=tokenizer)
    # Prompts of 13-14 tokens and of 40-51 (x 11 of 48), answers of <= 10: pairs of the long prompts are too long.
    task = ParityTask("train", 48)
    assert 12 > sum(len(tokenizer.render_for_completion(task[i])) > 30 for i in range(48)) > 5
    max_seq_len = 30
    dpo.main(TINY + ["--max-seq-len", str(max_seq_len)])
    out = capsys.readouterr().out
    assert "pairs: self-generated" in out

    record = common.read_report()[-1]
    counts = record["pairs_train"]
    assert record["pairs"] == "self-generated" and record["loss_type"] == "sigmoid"
    assert counts["too long"] > 0 and counts["paired"] > 0
    # every prompt ends in exactly one outcome; the kept pairs are what was trained on
    assert counts["paired"] + counts["too long"] + counts.get("all correct", 0) + counts.get("all incorrect", 0) == 48
    assert record["train_pairs"] == counts["paired"] and record["steps"] == counts["paired"] // 8
    assert counts.get("verifier errors", 0) == 0
    assert sum(record["pairs_held_out"].get(k, 0) for k in ("paired", "too long", "all correct", "all incorrect")) == 16

    # Cross-check the counts against self_generated_pairs itself: same engine, same seed, same prompts.
    pairs, stats = rollout.self_generated_pairs(dpo.Engine(model.eval(), tokenizer), task, list(range(48)), 4, 10, 1.0,
                                            seed=0)
    too_long = sum(max(len(c[0]), len(r[0])) > max_seq_len for c, r in pairs)
    assert (counts["paired"], counts["too long"]) == (stats["paired"] - too_long, too_long)


def test_ranks_sample_with_their_own_seeds(tokenizer, monkeypatch):
    # Every prompt is the same one: ranks 0 and 1 of 2 hold identical prompts, so only their seeds can make their
    # samples differ (equal seeds would give every rank the same "independent" samples); together the two shares
    # account for every prompt once.
    monkeypatch.setattr(dpo, "task_by_name", lambda name, split, size, seed: ParityTask(split, size, same_prompt=True))
    samples = []

    class RecordingEngine(dpo.Engine):
        def generate(self, *args, **kwargs):
            results = super().generate(*args, **kwargs)
            samples[-1].append([[c.tokens for c in r] for r in results])
            return results

    monkeypatch.setattr(dpo, "Engine", RecordingEngine)
    model = make_model(tokenizer).eval()
    args = argparse.Namespace(pairs="self-generated", task="synthetic", train_pairs=12, eval_pairs=4, samples=4,
                              max_new_tokens=8, temperature=1.0, seed=0, decontaminate=False, preset="tiny",
                              loss_type="sigmoid")
    for rank in (0, 1):
        monkeypatch.setattr(common, "get_dist_info", lambda rank=rank: (True, rank, rank, 2))
        samples.append([])
        pairs, counts, _ = dpo.build_pairs(args, model, tokenizer, "train", 128)
        assert sum(counts[k] for k in ("paired", "too long", "all correct", "all incorrect")) == 6
    (rank_0,), (rank_1,) = samples  # one generate call each: 6 identical prompts x 4 samples
    assert len(rank_0) == len(rank_1) == 6
    assert rank_0 != rank_1

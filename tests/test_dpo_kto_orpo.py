"""
dpo.py's KTO and ORPO: the losses against hand-computed values (each term's sign, z0's clamp), KTO's unpaired data
(verifier labels, mismatched answers for z0), and end-to-end tiny runs (ORPO runs no reference forward) with the
report card's figure of each.
"""

import math
from copy import deepcopy

import pytest
import torch

import common
import dpo
import report
import rollout
import tasks
from conftest import ends_turn_sometimes, make_model, make_tokenizer, torchrun_stage
from engine import Engine, load_model
from eval import completion_text
from model import GPT


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def t(values):
    return torch.tensor(values, dtype=torch.float64)


# -----------------------------------------------------------------------------
# KTO

# Three answers at beta 0.5, z0 0.2, lambda_D 1.5, lambda_U 0.75; implicit rewards r = log pi - log ref:
#   0 desirable,   r = -10 - -11 = +1:  loss = 1.5  (1 - sigma(0.5 (1 - 0.2)))    = 1.5  (1 - sigma(0.4))
#   1 undesirable, r = -9 - -8   = -1:  loss = 0.75 (1 - sigma(0.5 (0.2 - -1)))   = 0.75 (1 - sigma(0.6))
#   2 undesirable, r = -6 - -8   = +2:  loss = 0.75 (1 - sigma(0.5 (0.2 - 2)))    = 0.75 (1 - sigma(-0.9))
KTO_POLICY, KTO_REF, KTO_DESIRABLE = [-10.0, -9.0, -6.0], [-11.0, -8.0, -8.0], [True, False, False]
KTO_BETA, KTO_Z0, LAMBDA_D, LAMBDA_U = 0.5, 0.2, 1.5, 0.75
KTO_HAND = [1.5 * (1 - sigmoid(0.4)), 0.75 * (1 - sigmoid(0.6)), 0.75 * (1 - sigmoid(-0.9))]


def kto_of(policy, z0=KTO_Z0):
    return dpo.kto_loss(policy, t(KTO_REF), torch.tensor(KTO_DESIRABLE), torch.tensor(z0, dtype=torch.float64),
                        KTO_BETA, LAMBDA_D, LAMBDA_U)


def test_kto_loss_matches_hand_computed():
    losses, rewards = kto_of(t(KTO_POLICY))
    assert losses.tolist() == pytest.approx(KTO_HAND, rel=1e-12)
    assert rewards.tolist() == pytest.approx([0.5, -0.5, 1.0], rel=1e-12)  # beta r
    assert not rewards.requires_grad


def test_kto_gradient_signs_and_the_reference_point():
    # d loss / d log pi = -+ lambda beta sigma(x) (1 - sigma(x)): a desirable answer is pushed up, an undesirable one
    # down, wherever it stands relative to z0.
    policy = t(KTO_POLICY).requires_grad_()
    kto_of(policy)[0].sum().backward()
    slope = lambda x: sigmoid(x) * (1 - sigmoid(x))  # noqa: E731
    expected = [-1.5 * 0.5 * slope(0.4), 0.75 * 0.5 * slope(0.6), 0.75 * 0.5 * slope(-0.9)]
    assert policy.grad.tolist() == pytest.approx(expected, rel=1e-12)
    assert policy.grad[0] < 0 < policy.grad[1] and policy.grad[2] > 0
    # A higher reference point asks more of desirable answers and less of undesirable ones.
    low, high = kto_of(t(KTO_POLICY), 0.0)[0], kto_of(t(KTO_POLICY), 1.0)[0]
    assert high[0] > low[0] and high[1] < low[1] and high[2] < low[2]


def test_kto_reference_point_is_the_clamped_detached_mean():
    total = t(2.0).requires_grad_()
    z0 = dpo.kto_reference_point(total, 4)
    assert z0.item() == 0.5 and not z0.requires_grad
    assert dpo.kto_reference_point(t(-3.0), 4).item() == 0.0  # mean -0.75: an estimate below 0 is clamped


def test_kto_rows_pair_each_answer_with_another_prompts_answer(tokenizer):
    preferences = tasks.SyntheticPreferences("train", size=3)
    pairs = [tasks.render_pair(tokenizer, preferences[i], 128) for i in range(3)]
    examples = [example for chosen, rejected in pairs for example in ((chosen, True), (rejected, False))]
    rows, desirable = dpo.kto_rows(examples, seed=0, max_seq_len=128)
    assert sorted(desirable.tolist()) == [False] * 3 + [True] * 3
    for ((ids, mask), (kl_ids, kl_mask)), label in zip(rows, desirable.tolist()):
        assert ((ids, mask), label) in examples
        start = mask.index(1)
        assert kl_ids[:start] == ids[:start] and kl_mask[:start] == [0] * start  # its own prompt ...
        other = next((o_ids, o_mask) for (o_ids, o_mask), _ in examples
                     if o_ids[o_mask.index(1):] == kl_ids[start:])  # ... and an answer to another prompt
        assert other[0][:other[1].index(1)] != ids[:start]
        assert kl_mask[start:] == other[1][other[1].index(1):]
    with pytest.raises(ValueError, match="two different prompts"):
        dpo.kto_rows(examples[:2], seed=0, max_seq_len=128)  # one pair: one prompt


def test_kto_kl_is_z0_on_the_mismatched_answers_over_micro_batches(tokenizer):
    model = make_model(tokenizer)
    preferences = tasks.SyntheticPreferences("train", size=4)
    pairs = [tasks.render_pair(tokenizer, preferences[i], 128) for i in range(4)]
    rows, _ = dpo.kto_rows([(side, k == 0) for pair in pairs for k, side in enumerate(pair)], 0, 128)
    assert len(dpo.pair_micro_batches(rows, 256)[0]) > 1
    with torch.no_grad():  # the policy's log-probs of each mismatched sequence, one at a time
        mismatched = torch.cat([dpo.sequences_logps(model, [kl], tokenizer.bos_id, "cpu")[0] for _, kl in rows])
    # reference 0.3 nats below the policy on average: z0 = 0.3; 0.3 above: the estimate -0.3 is clamped to 0
    spread = torch.linspace(-1, 1, len(rows))
    for shift, z0 in ((-0.3, 0.3), (0.3, 0.0)):
        kl = dpo.kto_kl(model, rows, mismatched + shift + spread, 256, tokenizer.bos_id, "cpu")
        assert kl.item() == pytest.approx(z0, abs=1e-5)


class ParityTask:
    """Synthetic prompts with a toy verifier a random model passes about half the time: an even-length answer;
    an answer of length 3 mod 4 crashes it."""

    def __init__(self, n):
        self.task = tasks.SyntheticTask("train", size=n)

    def __len__(self):
        return len(self.task)

    def __getitem__(self, i):
        return self.task[i]

    def reward(self, conversation, completion):
        if len(completion) % 4 == 3:
            raise RuntimeError("verifier bug")
        return float(len(completion) % 2 == 0)


def test_self_generated_answers_are_labelled_by_the_verifier(tokenizer):
    engine = Engine(ends_turn_sometimes(make_model(tokenizer).eval(), tokenizer), tokenizer)
    task = ParityTask(12)
    examples, stats = rollout.self_generated_pairs(engine, task, list(range(12)), num_samples=4, max_tokens=6,
                                                  temperature=1.0, seed=3, unpaired=True)
    assert stats["desirable"] > 0 and stats["undesirable"] > 0 and stats["verifier errors"] > 0
    assert stats["desirable"] + stats["undesirable"] == len(examples)
    prompts = [tokenizer.render_for_completion(task[i]) for i in range(12)]
    samples = engine.generate(prompts, num_samples=4, max_tokens=6, temperature=1.0, seed=3)
    seen = set()
    for (ids, mask), desirable in examples:
        i = next(i for i, p in enumerate(prompts) if ids[:len(p)] == p)
        completion = next(c for c in samples[i] if prompts[i] + c.tokens == ids)
        reward, error = tasks.completion_reward(task, task[i], completion_text(tokenizer, completion),
                                                completion.finish)
        assert not error and desirable == (reward > 0)  # a verifier error is neither desirable nor undesirable
        assert mask == [0] * len(prompts[i]) + completion.mask
        assert tuple(ids) not in seen  # each distinct answer once
        seen.add(tuple(ids))


def test_kto_answers_skip_problems_that_overlap_an_evaluation_set(tokenizer):
    engine = Engine(ends_turn_sometimes(make_model(tokenizer).eval(), tokenizer), tokenizer)
    task = ParityTask(6)
    index = tasks.NgramIndex([task[2]["messages"][0]["content"]])  # problem 2 is also an evaluation item
    examples, counts, _ = rollout.preference_pairs("self-generated", "train", 6, tokenizer, 128, engine=engine,
                                                   task=task, samples=4, max_new_tokens=6, index=index, unpaired=True)
    assert counts["contaminated"] == 1 and examples
    leaked = tokenizer.render_for_completion(task[2])
    assert all(ids[:len(leaked)] != leaked for (ids, _), _ in examples)


DPO_ARGS = ["--device", "cpu", "--pairs", "synthetic", "--train-pairs", "32", "--eval-pairs", "16",
            "--batch-size", "16", "--device-batch-tokens", "2048", "--epochs", "2", "--lr-frac", "0.3",
            "--check-problems", "4", "--check-samples", "1", "--max-new-tokens", "8", "--eval-every", "2",
            "--sft-weight", "0"]


def test_kto_main_separates_desirable_from_undesirable_and_live_reference_agrees(tokenizer, tmp_path, monkeypatch,
                                                                                capsys):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    common.save_checkpoint(tmp_path / "checkpoints" / "sft", 1, make_model(tokenizer), {"stage": "sft"},
                           tokenizer=tokenizer)
    dpo.main(DPO_ARGS + ["--loss", "kto"])
    out = capsys.readouterr().out
    assert "lambda_D 1, lambda_U 1 (paper default 1, 1); 32 desirable, 32 undesirable" in out
    (record,) = common.read_report()
    assert record["loss_type"] == "kto" and record["steps"] == 8  # 64 answers, 16 a step, 2 epochs
    # A stage of its own: its record and checkpoints/kto, so a KTO run next to DPO's replaces neither.
    assert record["stage"] == "kto" and load_model(tmp_path / "checkpoints" / "kto", "cpu")[2]["stage"] == "kto"
    assert not common.has_checkpoint(tmp_path / "checkpoints" / "dpo")
    assert record["before/kl"] == 0.0  # policy == reference: every log-ratio is 0 (up to batching order)
    assert record["before/rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert record["before/loss"] == pytest.approx(0.5, rel=1e-6)  # 1 - sigma(0) for every answer
    assert record["after/rewards/margins"] > 0 and record["after/loss"] < record["before/loss"]
    assert record["after/kl"] >= 0
    # Its figure: KTO's rewards and z0 in place of the pairwise accuracy and log-probs; 8 steps, held-out every 2.
    points = {line.get_gid(): len(line.get_xdata()) for ax in report.stage_figure("kto", record).axes
              for line in ax.get_lines()}
    assert points == {"train/loss": 8, "val/loss": 4, "train/rewards/margins": 8, "val/rewards/margins": 4,
                      "train/rewards/desirable": 8, "train/rewards/undesirable": 8, "train/kl": 8}

    # A live reference computes the same z0 and rewards as the precomputed one.
    dpo.main(DPO_ARGS + ["--loss", "kto", "--live-reference", "--out", str(tmp_path / "live")])
    live = common.read_report()[-1]
    for key in ("after/loss", "after/kl", "after/rewards/margins"):
        assert live[key] == pytest.approx(record[key], rel=1e-4, abs=1e-6)


# -----------------------------------------------------------------------------
# ORPO

# Two pairs at lambda (beta) 0.5: length-normalised log-probs log P_w = -10/4 = -2.5, log P_l = -12/2 = -6, and
# -8/5 = -1.6, -9/5 = -1.8; log odds = log P - log(1 - P).
def log_odds(log_p):
    return log_p - math.log(1 - math.exp(log_p))


ORPO_HAND = [2.5 - 0.5 * math.log(sigmoid(log_odds(-2.5) - log_odds(-6.0))),
             1.6 - 0.5 * math.log(sigmoid(log_odds(-1.6) - log_odds(-1.8)))]


def orpo_of(chosen, rejected, beta=0.5):
    # The reference log-probs are nonsense on purpose: ORPO must not read them.
    return dpo.dpo_loss(chosen, rejected, t([float("nan")] * 2), t([float("nan")] * 2), beta, "orpo",
                        chosen_lengths=t([4, 5]), rejected_lengths=t([2, 5]))


def test_orpo_loss_matches_hand_computed():
    losses, chosen_rewards, rejected_rewards = orpo_of(t([-10.0, -8.0]), t([-12.0, -9.0]))
    assert losses.tolist() == pytest.approx(ORPO_HAND, rel=1e-12)
    assert chosen_rewards.tolist() == pytest.approx([-1.25, -0.8], rel=1e-12)  # beta log P
    assert rejected_rewards.tolist() == pytest.approx([-3.0, -0.9], rel=1e-12)
    # lambda = 0: the SFT term alone, the mean NLL per token of the chosen answer
    assert orpo_of(t([-10.0, -8.0]), t([-12.0, -9.0]), beta=0.0)[0].tolist() == pytest.approx([2.5, 1.6])


def test_orpo_gradient_signs():
    # Both terms raise the chosen answer; only the odds-ratio term lowers the rejected one.
    chosen, rejected = t([-10.0, -8.0]).requires_grad_(), t([-12.0, -9.0]).requires_grad_()
    orpo_of(chosen, rejected)[0].sum().backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()
    # d/d log pi(y_w) of the SFT term is -1/|y_w|; the odds-ratio term adds more of the same sign.
    assert (chosen.grad < t([-1 / 4, -1 / 5])).all()
    # An answer the model is certain of (P = 1) keeps the loss finite.
    assert torch.isfinite(orpo_of(t([0.0, 0.0]), t([-1.0, -1.0]))[0]).all()


def test_orpo_main_from_base_runs_no_reference_forward(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    base = tmp_path / "checkpoints" / "base"
    common.save_checkpoint(base, 1, make_model(tokenizer), {"stage": "base"}, tokenizer=tokenizer)

    def no_reference(*args, **kwargs):
        raise AssertionError("ORPO ran a reference forward")

    def no_model_copy(obj, *args):
        if isinstance(obj, GPT):
            raise AssertionError("ORPO made a frozen reference copy")
        return deepcopy(obj, *args)

    monkeypatch.setattr(dpo, "reference_logps", no_reference)
    monkeypatch.setattr(dpo.copy, "deepcopy", no_model_copy)
    dpo.main(DPO_ARGS[:-2] + ["--loss", "orpo", "--ckpt", str(base)])
    out = capsys.readouterr().out
    assert "loaded base model" in out and "orpo: no reference model" in out and "paper defaults beta 0.1" in out
    (record,) = common.read_report()
    assert record["loss_type"] == "orpo" and record["stage"] == "orpo"
    assert record["after/loss"] < record["before/loss"] and record["after/rewards/accuracy"] > 0.5
    titles = [ax.get_title() for ax in report.stage_figure("orpo", record).axes]
    assert "preference accuracy" in titles and "log-probabilities of the answers" in titles
    assert "KTO rewards and reference point" not in titles
    _, _, meta = load_model(tmp_path / "checkpoints" / "orpo", "cpu")
    assert meta["stage"] == "orpo" and meta["finished"] and meta["args"]["sft_weight"] == 0.0


# -----------------------------------------------------------------------------
# Under torchrun, 2 ranks, as the README launches them: KTO from SFT, ORPO from base


@pytest.mark.slow
@pytest.mark.parametrize("loss, start", [("kto", "sft"), ("orpo", "base")])
def test_torchrun_two_ranks_end_with_identical_weights(tokenizer, tmp_path, monkeypatch, loss, start):
    ckpt = tmp_path / "home" / "checkpoints" / start
    initial = make_model(tokenizer)
    common.save_checkpoint(ckpt, 1, initial, {"stage": start}, tokenizer=tokenizer)
    result, digests = torchrun_stage(tmp_path, "dpo", ["--preset", "tiny", "--loss", loss, "--ckpt", str(ckpt)]
                                     + DPO_ARGS[2:] + ["--epochs", "1"])
    assert digests[0] == digests[1]
    final, _, meta = load_model(tmp_path / "home" / "checkpoints" / loss, "cpu")
    assert meta["finished"] and meta["args"]["loss_type"] == loss
    assert any(not torch.equal(a, b) for a, b in zip(final.state_dict().values(), initial.state_dict().values()))
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "home"))
    (record,) = common.read_report()
    # Both ranks' shares, 8 rows a rank per step: KTO's 64 labelled answers, ORPO's 32 pairs.
    assert (record["train_pairs"], record["steps"]) == ((64, 4) if loss == "kto" else (32, 2))
    assert f"{record['steps']} steps of 16 pairs (8 per rank" in result.stdout


@pytest.mark.parametrize("flags, message", [
    (["--loss", "orpo", "--sft-weight", "1"], "already contains the NLL"),
    (["--loss", "orpo", "--live-reference"], "uses no reference model"),
    (["--loss", "kto", "--label-smoothing", "0.1"], "does not apply"),
    (["--loss", "sigmoid", "--desirable-weight", "2"], "lambda_D"),
])
def test_flags_a_loss_cannot_use_are_errors(flags, message, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    with pytest.raises(ValueError, match=message):
        dpo.main(["--device", "cpu"] + flags)

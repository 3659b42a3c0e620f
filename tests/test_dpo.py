"""
dpo.py: every loss_type against hand-computed values, the gradient of DPO, sequence log-probs over the answer only,
the precomputed reference, a DPO step on a tiny model, self-generated pairs, skipped rows, and end-to-end tiny runs.
"""

import argparse
import json
import math

import pytest
import torch

import common
import dpo
import rollout
import tasks
from engine import Engine, load_model
import eval as ev
from eval import completion_text
from conftest import EvenLength, ends_turn_sometimes, make_model, make_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def softplus(x):
    """-log sigma(-x) = log(1 + e^x), by hand."""
    return math.log1p(math.exp(x))


# Two pairs. Pair 0: log-ratios +1 (chosen) and -0.5 (rejected): h = 1.5, beta h = 0.75, answers of 4 and 2 tokens.
# Pair 1: log-ratios -1 and +1: h = -2, beta h = -1, answers of 5 and 5 tokens.
POLICY_CHOSEN, POLICY_REJECTED = [-10.0, -8.0], [-12.0, -9.0]
REF_CHOSEN, REF_REJECTED = [-11.0, -7.0], [-11.5, -10.0]
CHOSEN_LEN, REJECTED_LEN = [4, 5], [2, 5]
BETA = 0.5


def loss_of(loss_type, **kwargs):
    t = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    return dpo.dpo_loss(t(POLICY_CHOSEN), t(POLICY_REJECTED), t(REF_CHOSEN), t(REF_REJECTED), BETA, loss_type,
                        chosen_lengths=t(CHOSEN_LEN), rejected_lengths=t(REJECTED_LEN), **kwargs)


EPS = 0.1
HAND = {
    # -log sigma(beta h) = log(1 + e^(-beta h))
    ("sigmoid", 0.0): [softplus(-0.75), softplus(1.0)],
    # cDPO: (1 - eps) * -log sigma(beta h) + eps * -log sigma(-beta h)
    ("sigmoid", EPS): [0.9 * softplus(-0.75) + 0.1 * softplus(0.75), 0.9 * softplus(1.0) + 0.1 * softplus(-1.0)],
    # rDPO: [(1 - eps) * -log sigma(beta h) - eps * -log sigma(-beta h)] / (1 - 2 eps)
    ("robust", EPS): [(0.9 * softplus(-0.75) - 0.1 * softplus(0.75)) / 0.8,
                      (0.9 * softplus(1.0) - 0.1 * softplus(-1.0)) / 0.8],
    ("robust", 0.0): [softplus(-0.75), softplus(1.0)],
    # IPO: (h - 1 / (2 beta))^2 = (h - 1)^2
    ("ipo", 0.0): [0.25, 9.0],
    # hinge: max(0, 1 - beta h)
    ("hinge", 0.0): [0.25, 2.0],
    # normalised log-ratios: 1/4 - (-0.5)/2 = 0.5 and -1/5 - 1/5 = -0.4; times beta: 0.25 and -0.2
    ("sigmoid_norm", 0.0): [softplus(-0.25), softplus(0.2)],
    # SimPO: beta (-10/4 - -12/2) - gamma = 0.5 * 3.5 - 0.5 = 1.25;  beta (-8/5 - -9/5) - 0.5 = -0.4
    ("simpo", 0.0): [softplus(-1.25), softplus(0.4)],
}


@pytest.mark.parametrize("loss_type, eps", sorted(HAND))
def test_dpo_loss_matches_hand_computed(loss_type, eps):
    losses, _, _ = loss_of(loss_type, label_smoothing=eps, gamma=0.5)
    assert losses.tolist() == pytest.approx(HAND[loss_type, eps], rel=1e-12)


def test_hinge_is_zero_past_the_margin():
    losses, _, _ = dpo.dpo_loss(torch.tensor([0.0]), torch.tensor([-5.0]), torch.tensor([0.0]), torch.tensor([0.0]),
                                beta=0.5, loss_type="hinge")
    assert losses.item() == 0.0  # beta h = 2.5 > 1


@pytest.mark.parametrize("loss_type, chosen, rejected", [
    ("sigmoid", [0.5, -0.5], [-0.25, 0.5]),  # beta (log pi - log ref)
    ("ipo", [0.5, -0.5], [-0.25, 0.5]),
    ("sigmoid_norm", [0.125, -0.1], [-0.125, 0.1]),  # divided by the lengths
    ("simpo", [-1.25, -0.8], [-3.0, -0.9]),  # beta log pi / |y|, no reference
])
def test_rewards_are_the_implicit_rewards(loss_type, chosen, rejected):
    _, chosen_rewards, rejected_rewards = loss_of(loss_type)
    assert chosen_rewards.tolist() == pytest.approx(chosen, rel=1e-12)
    assert rejected_rewards.tolist() == pytest.approx(rejected, rel=1e-12)
    assert not chosen_rewards.requires_grad


def test_sigmoid_gradient_with_respect_to_the_margin():
    # d/dh -log sigma(beta h) = -beta sigma(-beta h); h moves one for one with log pi(y_w) and against log pi(y_l).
    policy_chosen = torch.tensor(POLICY_CHOSEN, dtype=torch.float64, requires_grad=True)
    policy_rejected = torch.tensor(POLICY_REJECTED, dtype=torch.float64, requires_grad=True)
    losses, _, _ = dpo.dpo_loss(policy_chosen, policy_rejected, torch.tensor(REF_CHOSEN, dtype=torch.float64),
                                torch.tensor(REF_REJECTED, dtype=torch.float64), BETA)
    losses.sum().backward()
    expected = [-BETA / (1 + math.exp(beta_h)) for beta_h in (0.75, -1.0)]
    assert policy_chosen.grad.tolist() == pytest.approx(expected, rel=1e-12)
    assert policy_rejected.grad.tolist() == pytest.approx([-g for g in expected], rel=1e-12)


def test_dpo_loss_validates():
    one = torch.zeros(1)
    with pytest.raises(ValueError, match="unknown loss_type"):
        dpo.dpo_loss(one, one, one, one, 0.1, "kto")
    with pytest.raises(ValueError, match="lengths"):
        dpo.dpo_loss(one, one, one, one, 0.1, "simpo")
    with pytest.raises(ValueError, match="does not apply"):
        dpo.dpo_loss(one, one, one, one, 0.1, "ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo.dpo_loss(one, one, one, one, 0.1, "robust", label_smoothing=0.5)


# -----------------------------------------------------------------------------
# Pairs as token sequences


def multi_turn_pair():
    shared = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
              {"role": "assistant", "content": "2 + 3 = 5.\n#### 5"}, {"role": "user", "content": "And 4 + 4?"}]
    return tasks.preference_pair(shared + [{"role": "assistant", "content": "4 + 4 = 8.\n#### 8"}],
                                 shared + [{"role": "assistant", "content": "The answer is 9."}])


def test_render_pair_scores_the_final_answer_only(tokenizer):
    pair = multi_turn_pair()
    (chosen_ids, chosen_mask), (rejected_ids, rejected_mask) = tasks.render_pair(tokenizer, pair, 128)
    prompt = tokenizer.render_for_completion(pair["chosen"])
    assert chosen_ids[:len(prompt)] == rejected_ids[:len(prompt)] == prompt
    full_ids, full_mask = tokenizer.render_conversation(pair["chosen"])
    assert chosen_ids == full_ids
    assert sum(full_mask[:len(prompt)]) > 0  # the first answer is trained by SFT ...
    assert chosen_mask == [0] * len(prompt) + full_mask[len(prompt):]  # ... but is prompt for DPO
    scored = tokenizer.decode([t for t, m in zip(rejected_ids, rejected_mask) if m])
    assert scored == "The answer is 9.<|assistant_end|>"

    other = tasks.preference_pair(pair["chosen"]["messages"], pair["rejected"]["messages"])
    other["rejected"]["messages"][1] = {"role": "user", "content": "What is 2 + 4?"}
    with pytest.raises(ValueError, match="different prompts"):
        tasks.render_pair(tokenizer, other, 128)
    with pytest.raises(tasks.RowTooLong):
        tasks.render_pair(tokenizer, pair, len(prompt) + 3)


def test_sequence_logps_sum_the_answer_tokens_only(tokenizer):
    model = make_model(tokenizer)
    (chosen, _), = [tasks.render_pair(tokenizer, multi_turn_pair(), 128)]
    ids, mask = chosen
    logps, lengths = dpo.sequence_logps(model, *tasks.collate([chosen], tokenizer.bos_id))
    with torch.no_grad():
        log_probs = model(torch.tensor([ids])).log_softmax(-1)[0]  # (T, V)
    by_hand = sum(log_probs[t, ids[t + 1]].item() for t in range(len(ids) - 1) if mask[t + 1])
    assert lengths.item() == sum(mask)
    assert logps.item() == pytest.approx(by_hand, rel=1e-5)


def test_precomputed_reference_equals_live(tokenizer):
    model = make_model(tokenizer)
    preferences = tasks.SyntheticPreferences("train", size=7)
    pairs = [tasks.render_pair(tokenizer, preferences[i], 128) for i in range(len(preferences))]
    assert len(dpo.pair_micro_batches(pairs, 256)[0]) > 1  # several micro-batches, in length order, not pair order
    precomputed = dpo.reference_logps(model, pairs, 256, tokenizer.bos_id, "cpu")  # (7, 2)
    with torch.no_grad():
        for i, pair in enumerate(pairs):
            chosen, rejected, _, _ = dpo.pair_logps(model, [pair], tokenizer.bos_id, "cpu")
            assert precomputed[i].tolist() == pytest.approx([chosen.item(), rejected.item()], rel=1e-5)


def step_args(**overrides):
    defaults = dict(beta=0.1, loss_type="sigmoid", label_smoothing=0.0, gamma=0.5, sft_weight=0.0,
                    device_batch_tokens=1024)
    return argparse.Namespace(**{**defaults, **overrides})


@pytest.mark.parametrize("loss_type, sft_weight", [("sigmoid", 0.0), ("sigmoid", 1.0), ("ipo", 0.0), ("simpo", 0.0)])
def test_a_dpo_step_increases_the_margin(tokenizer, loss_type, sft_weight):
    model = make_model(tokenizer)
    preferences = tasks.SyntheticPreferences("train", size=4)
    pairs = [tasks.render_pair(tokenizer, preferences[i], 128) for i in range(4)]
    ref = dpo.reference_logps(model, pairs, 1024, tokenizer.bos_id, "cpu")
    args = step_args(loss_type=loss_type, sft_weight=sft_weight)

    def margin():
        with torch.no_grad():
            chosen, rejected, _, _ = dpo.pair_logps(model, pairs, tokenizer.bos_id, "cpu")
        return ((chosen - ref[:, 0]) - (rejected - ref[:, 1])).mean().item()

    assert margin() == pytest.approx(0.0, abs=1e-5)  # the policy starts as the reference
    optimizers = model.setup_optimizers(matrix_lr=0.002, embedding_lr=0.02, unembedding_lr=0.0004)
    losses, stats = dpo.preference_losses(model, pairs, ref, args, tokenizer.bos_id, "cpu")
    losses.mean().backward()
    for optimizer in optimizers:
        optimizer.step()
    assert margin() > 0.01
    assert set(stats) == set(dpo.STAT_NAMES)


# -----------------------------------------------------------------------------
# Self-generated pairs


class ParityTask(EvenLength):
    """n training problems of the suite's toy task (an even-length answer passes: about half a random model's)."""

    def __init__(self, n):
        super().__init__("train", size=n)


def test_self_generated_pairs_are_engine_tokens_one_correct_one_incorrect(tokenizer):
    model = ends_turn_sometimes(make_model(tokenizer).eval(), tokenizer)  # only an answer that stops is correct
    engine = Engine(model, tokenizer)
    task = ParityTask(12)
    indices = list(range(len(task)))
    pairs, stats = rollout.self_generated_pairs(engine, task, indices, num_samples=4, max_tokens=6, temperature=1.0,
                                            seed=5, prompts_per_batch=5)
    assert stats["paired"] == len(pairs) >= 4
    assert stats["paired"] + stats["all correct"] + stats["all incorrect"] == len(task)

    # The same seeds again: every side of every pair is one of the engine's completions of that prompt, token for token.
    prompts = [tokenizer.render_for_completion(task[i]) for i in indices]
    samples = []
    for start in range(0, len(prompts), 5):
        samples += engine.generate(prompts[start:start + 5], num_samples=4, max_tokens=6, temperature=1.0,
                                   seed=5 + start)
    for (chosen, rejected) in pairs:
        i = next(i for i, p in enumerate(prompts) if chosen[0][:len(p)] == p and rejected[0][:len(p)] == p)
        prompt = prompts[i]
        verdicts = []
        for ids, mask in (chosen, rejected):
            completion = next(c for c in samples[i] if prompt + c.tokens == ids)
            assert mask == [0] * len(prompt) + completion.mask
            verdicts.append(tasks.completion_reward(task, task[i], completion_text(tokenizer, completion),
                                                    completion.finish)[0])
        assert verdicts == [1.0, 0.0]


def test_self_generated_pairs_count_a_crashing_verifier_and_pair_nothing(tokenizer):
    class Crashing(ParityTask):
        def reward(self, conversation, completion):
            raise RuntimeError("verifier bug")

    engine = Engine(ends_turn_sometimes(make_model(tokenizer).eval(), tokenizer), tokenizer)
    pairs, stats = rollout.self_generated_pairs(engine, Crashing(3), [0, 1, 2], num_samples=4, max_tokens=4,
                                            temperature=1.0, seed=0)
    # answers that stop crash the verifier (left out), answers that do not stop are incorrect: no correct answer
    assert pairs == [] and stats["all incorrect"] + stats["unscored"] == 3
    assert stats["verifier errors"] + stats["truncated"] == 12 and stats["verifier errors"] > 0


def test_malformed_preference_rows_are_skipped_and_counted(tokenizer, tmp_path):
    user = {"role": "user", "content": "What is 2 + 3?"}
    good = {"chosen": [user, {"role": "assistant", "content": "5"}],
            "rejected": [user, {"role": "assistant", "content": "6"}]}
    rows = [
        good,
        {"chosen": good["chosen"], "rejected": [{"role": "user", "content": "Other?"}, good["rejected"][1]]},
        {"chosen": good["chosen"], "rejected": good["chosen"]},  # identical answers
        {"chosen": good["chosen"], "rejected": [user]},  # no answer
        {"chosen": good["chosen"], "rejected": [user, {"role": "robot", "content": "6"}]},
        {"chosen": good["chosen"], "rejected": [user, {"role": "assistant", "content": "6 " * 200}]},  # too long
    ]
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    mixture = tasks.TaskMixture([("ultrafeedback", tasks.UltraFeedback(local=path), None)])
    pairs, skipped = tasks.prepare_rows(mixture, lambda pair: tasks.render_pair(tokenizer, pair, 64), range(len(mixture)))
    assert len(pairs) == 1
    assert skipped == {("ultrafeedback", "malformed"): 4, ("ultrafeedback", "too long"): 1}


def answer_text(message):
    """The text parts of an assistant message: what a verifier reads (tool calls and outputs left out)."""
    return "".join(p["text"] for p in message["content"] if p["type"] == "text")


def test_synthetic_rejected_answers_are_all_wrong():
    preferences = tasks.SyntheticPreferences("train", size=200, seed=2)
    task = preferences.task
    kinds = set()
    for i in range(len(preferences)):
        pair = preferences[i]
        chosen, rejected = (answer_text(pair[side]["messages"][-1]) for side in ("chosen", "rejected"))
        assert task.reward(task[i], chosen) == 1.0
        assert task.reward(task[i], rejected) == 0.0
        kinds.add(tasks.extract_final_answer(rejected) is None)
    assert kinds == {True, False}  # both format mistakes and wrong numbers


# -----------------------------------------------------------------------------
# End to end


DPO_ARGS = ["--device", "cpu", "--pairs", "synthetic", "--train-pairs", "32", "--eval-pairs", "16",
            "--batch-size", "16", "--device-batch-tokens", "2048", "--epochs", "2", "--lr-frac", "0.3",
            "--check-problems", "4", "--check-samples", "1", "--max-new-tokens", "8", "--eval-every", "2",
            "--sft-weight", "0"]


def test_main_tiny_improves_held_out_preferences_and_live_reference_agrees(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    common.save_checkpoint(tmp_path / "checkpoints" / "sft", 1, make_model(tokenizer), {"stage": "sft"},
                           tokenizer=tokenizer)
    dpo.main(DPO_ARGS)
    model, _, meta = load_model(tmp_path / "checkpoints" / "dpo", "cpu")
    assert meta["finished"] and meta["step"] == 4
    (record,) = common.read_report()
    assert record["before/rewards/accuracy"] == 0.0  # policy == reference: every margin is exactly 0
    assert record["after/rewards/accuracy"] > 0.5
    assert record["after/loss"] < record["before/loss"] == pytest.approx(math.log(2), rel=1e-6)

    # A live reference and another cut of each step into micro-batches (several of unequal sizes instead of one)
    # train the same model: the loss is the mean over the step's pairs however they are cut.
    dpo.main(DPO_ARGS + ["--live-reference", "--out", str(tmp_path / "live"), "--device-batch-tokens", "400"])
    live = common.read_report()[-1]
    for key in ("after/loss", "after/rewards/margins", "after/logps/chosen"):
        assert live[key] == pytest.approx(record[key], rel=1e-5)  # fp32: only summation order differs
    state, _, _ = common.load_checkpoint(tmp_path / "checkpoints" / "dpo")
    live_state, _, _ = common.load_checkpoint(tmp_path / "live")
    for key in state:
        torch.testing.assert_close(live_state[key], state[key], rtol=1e-5, atol=1e-5, msg=key)


def test_before_reuses_the_sft_checkpoints_own_check_only_when_it_ran_the_same_check(tokenizer, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    stored = {"stop_rate": 1.0, "format_rate": 1.0, "pass@1": 0.123, "pass@1_t1": 0.456, "truncated": 0,
              "verifier_errors": 0}
    check = {"settings": ev.check_settings("synthetic", 4, 1, 8, 0), "metrics": stored}  # DPO_ARGS's check
    common.save_checkpoint(tmp_path / "checkpoints" / "sft", 1, make_model(tokenizer),
                           {"stage": "sft", "check": check}, tokenizer=tokenizer)
    calls = []
    monkeypatch.setattr(dpo, "held_out_check", lambda *a: calls.append(a) or ev.held_out_check(*a))
    args = DPO_ARGS + ["--epochs", "1"]  # the last flag wins: one epoch, 2 steps
    dpo.main(args)
    record = common.read_report()[-1]
    assert len(calls) == 1  # the "after" check only
    assert {key: record[f"before/{key}"] for key in stored} == stored

    dpo.main(args + ["--check-samples", "2", "--out", str(tmp_path / "other")])  # another check: run it
    record = common.read_report()[-1]
    assert len(calls) == 3 and record["before/pass@1"] != 0.123


def test_full_preset_runs_on_stand_in_hub_data(tokenizer, tmp_path, monkeypatch, capsys):
    # The full preset's data path (UltraFeedback pairs, GSM8K accuracy check) end to end, offline, on files of the
    # hub schemas.
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(tasks.write_stand_in_data(tmp_path / "hub", documents=10, rows=16)))
    common.save_checkpoint(tmp_path / "checkpoints" / "sft", 1, make_model(tokenizer), {"stage": "sft"},
                           tokenizer=tokenizer)
    args = ["--preset", "full", "--device", "cpu", "--batch-size", "8", "--device-batch-tokens", "1024",
            "--check-problems", "4", "--max-new-tokens", "16"]
    dpo.main(args + ["--dry-run"])
    assert "dry run" in capsys.readouterr().out
    assert not common.read_report() and not common.has_checkpoint(tmp_path / "checkpoints" / "dpo")
    dpo.main(args)
    out = capsys.readouterr().out
    assert "ultrafeedback                   16 rows" in out and "2 steps of 8 pairs" in out
    record = common.read_report()[-1]
    assert record["pairs"] == "ultrafeedback" and record["pairs_train"] == {"paired": 16}


# -----------------------------------------------------------------------------
# Issue 9: only a finished answer can be chosen, verifier errors are left out, per-loss paper defaults


def test_truncated_answer_is_never_chosen(tokenizer):
    class AcceptsAnything(ParityTask):
        def reward(self, conversation, completion):
            return 1.0

    engine = Engine(ends_turn_sometimes(make_model(tokenizer).eval(), tokenizer), tokenizer)
    end = tokenizer.token_id("<|assistant_end|>")
    pairs, stats = rollout.self_generated_pairs(engine, AcceptsAnything(8), list(range(8)), num_samples=4, max_tokens=6,
                                            temperature=1.0, seed=0)
    # every text is "right": an answer is correct exactly when it stopped, so each pair teaches to stop
    assert pairs and stats["truncated"] > 0
    for (chosen, _), (rejected, _) in pairs:
        assert chosen[-1] == end and rejected[-1] != end


def test_verifier_error_dropped_from_pairs(tokenizer):
    class ErrorsOnOddLengths(ParityTask):
        def reward(self, conversation, completion):
            if len(completion) % 2:
                raise RuntimeError("verifier bug")
            return float(len(completion) % 4 == 0)

    engine = Engine(ends_turn_sometimes(make_model(tokenizer).eval(), tokenizer), tokenizer)
    task = ErrorsOnOddLengths(16)
    pairs, stats = rollout.self_generated_pairs(engine, task, list(range(16)), num_samples=6, max_tokens=6,
                                            temperature=1.0, seed=0)
    assert pairs and stats["verifier errors"] > 0
    end = tokenizer.token_id("<|assistant_end|>")
    for ids, mask in (side for pair in pairs for side in pair):  # no side is an answer the verifier failed on
        answer = [i for i, m in zip(ids, mask) if m]
        if answer[-1] == end:  # a finished answer (a cut one is never verified): its text has an even length
            assert len(tokenizer.decode(answer[:-1])) % 2 == 0


def test_loss_kind_paper_defaults():
    def resolved(loss_type, **flags):
        args = argparse.Namespace(loss_type=loss_type, **{"beta": None, "gamma": None, "desirable_weight": None,
                                                          "undesirable_weight": None, "sft_weight": None,
                                                          "label_smoothing": 0.0, "live_reference": False, **flags})
        dpo.resolve_loss_defaults(args)
        return args.beta, args.gamma

    assert resolved("sigmoid_norm") == (5.0, None)  # Tulu 3's length-normalised DPO
    assert resolved("simpo") == (2.0, 1.0)  # SimPO: beta 2-2.5, gamma / beta ~0.5
    assert resolved("sigmoid") == (None, None)  # the preset's beta (0.1) fills it
    assert resolved("simpo", beta=2.5) == (2.5, 1.0)  # explicit flags win


def test_kto_defaults_drop_the_presets_nll_term_and_warn_outside_the_papers_ratio():
    flags = {"beta": None, "gamma": None, "desirable_weight": None, "undesirable_weight": None, "sft_weight": None,
             "label_smoothing": 0.0, "live_reference": False}
    args = argparse.Namespace(loss_type="kto", **flags)
    dpo.resolve_loss_defaults(args)  # before the preset (tiny: sft_weight 1.0) fills what is left
    assert dpo.PRESETS["tiny"]["sft_weight"] == 1.0 and args.sft_weight == 0.0
    args = argparse.Namespace(loss_type="kto", **{**flags, "sft_weight": 0.5})
    dpo.resolve_loss_defaults(args)
    assert args.sft_weight == 0.5  # an explicit flag still wins
    assert dpo.kto_weight_warning(1.0, 1.0, 100, 90) is None  # 1.11
    low = dpo.kto_weight_warning(1.0, 1.0, 40, 100)  # 0.40: lambda_D 2.5 makes it 1
    assert "0.40" in low and "--desirable-weight 2.5 --undesirable-weight 1" in low
    high = dpo.kto_weight_warning(1.0, 2.0, 300, 100)  # 1.50: lambda_D 0.889 makes it 4/3
    assert "1.50" in high and "--desirable-weight 0.889 " in high and "1.33" in high

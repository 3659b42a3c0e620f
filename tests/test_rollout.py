"""
rollout.py's prompt pipeline and rollout machinery: decontamination (tasks.NgramIndex, the one rule of every stage),
task mixtures with per-source accounting, the difficulty filter's keep rule, the PTGS temperature controller (its
example numbers, its discount, its checkpoint state, and the learner scoring each group at the temperature that
sampled it) and the overlapped rollout worker.
"""

import json
import math
from types import SimpleNamespace

import pytest
import torch

import model as model_module
import objectives
import rl
import rl_systems
import rollout
import tasks
from conftest import grpo_advantages
from engine import Engine, sampling_logprobs
from model import GPT
from tasks import SyntheticTask
from test_rl import (Broken, LengthParity, checkpoint, close, model, one_thread, run_rl,  # noqa: F401 (fixtures)
                     tokenizer)

# -----------------------------------------------------------------------------
# Decontamination

GSM8K_LIKE = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
              "How many clips did Natalia sell altogether in April and May?")


def test_planted_contamination_is_removed():
    test_questions = [GSM8K_LIKE, "What is 17 + 25?"]
    index = tasks.NgramIndex(test_questions)
    planted_doc = "Some homework help.\n" + GSM8K_LIKE.replace("April", "april").replace(",", "") + " The answer: 72."
    clean_doc = "Natalia sold clips to her friends. Everyone bought some and went home happy in May."
    # pretraining text: the planted document is skipped while packing, the clean one is kept
    assert tasks.decontaminate([planted_doc, clean_doc], index) == ([clean_doc], 1)
    # SFT rows: the planted conversation (the eval question as the user turn) is skipped and counted per source
    planted_chat = {"messages": [{"role": "user", "content": "what is 17+25"},
                                 {"role": "assistant", "content": "42\n#### 42"}]}
    other_chat = {"messages": [{"role": "user", "content": "What is 17 * 25?"},
                               {"role": "assistant", "content": "425\n#### 425"}]}
    mixture = tasks.TaskMixture([("planted", [planted_chat], None), ("clean", [other_chat, other_chat], None)])
    rows, skipped = tasks.prepare_rows(mixture, lambda c: c["messages"][0]["content"], range(len(mixture)), index=index)
    assert rows == ["What is 17 * 25?"] * 2 and skipped == {("planted", "contaminated"): 1}
    # DPO pairs: either side overlapping is enough
    pair = tasks.preference_pair([{"role": "user", "content": GSM8K_LIKE}, {"role": "assistant", "content": "72"}],
                                 [{"role": "user", "content": GSM8K_LIKE}, {"role": "assistant", "content": "70"}])
    assert index.contaminated(pair)
    # RL prompts: a training task with the test question planted among its problems
    task = tasks.SyntheticTask("train", size=20)
    task.problems[7] = {**task.problems[7], "question": GSM8K_LIKE}
    mixture = tasks.PromptMixture([("synthetic", task, 1.0)])
    kept, dropped = rollout.decontaminate_prompts(mixture, index)
    assert len(kept) == 19 and dropped == {"synthetic": 1}
    assert all(kept[k]["messages"][0]["content"] != GSM8K_LIKE for k in range(len(kept)))


def test_short_eval_texts_match_as_runs_inside_training_texts():
    index = tasks.NgramIndex(["What is 17 + 25?", "Define entropy."])
    assert index.overlaps("  WHAT is 17+25 ")  # normalised: case, spacing and punctuation do not matter
    assert not index.overlaps("What is 17 * 25?")  # operators are words: another question
    assert not index.overlaps("What is 17 + 250?")  # a run of whole words, not of characters
    assert index.overlaps("What is 17 + 25? Answer briefly.")  # the tiny prompt template around a test question
    assert index.overlaps("Question: What is 17 + 25?\nAnswer: 42")
    assert index.overlaps("define entropy") and not index.overlaps("We define entropy as ...")  # < 5 words: whole


def test_pretraining_batches_skip_rejected_documents_and_keep_indices(tokenizer):  # noqa: F811
    docs = [f"document {i} " * 30 for i in range(6)]
    kept = list(tasks.pretraining_batches(tokenizer, docs, 1, 16, keep=lambda text: not text.startswith("document 2 ")))
    filtered = list(tasks.pretraining_batches(tokenizer, [d for i, d in enumerate(docs) if i != 2], 1, 16))
    assert len(kept) == len(filtered) > 2 and all(torch.equal(a[0], b[0]) for a, b in zip(kept, filtered))
    original = [0, 1, 3, 4, 5, 6]  # positions count the documents of `texts`, the skipped one too: resume stays exact
    assert [a[2] for a in kept] == [(original[b[2][0]], b[2][1]) for b in filtered]


def test_tiny_training_data_is_untouched_by_default():
    for script in ("pretrain", "sft", "dpo", "rl", "rm"):
        module = __import__(script)
        assert module.PRESETS["tiny"]["decontaminate"] is False and module.PRESETS["full"]["decontaminate"] is True


# -----------------------------------------------------------------------------
# Task mixtures and per-source accounting


def test_parse_task_mixture():
    assert rollout.parse_task_mixture("synthetic") == [("synthetic", 1.0)]
    assert rollout.parse_task_mixture("synthetic:1, gsm8k:3") == [("synthetic", 1.0), ("gsm8k", 3.0)]
    for bad in ("mmlu", "synthetic:0", "synthetic:x", "synthetic,synthetic"):
        with pytest.raises(ValueError, match="--task"):
            rollout.parse_task_mixture(bad)


def test_prompt_mixture_shares_and_single_source_identity():
    a, b = LengthParity("train", 64), LengthParity("test", 40)
    mixture = tasks.PromptMixture([("a", a, 1.0), ("b", b, 3.0)])
    assert mixture.counts() == {"a": 13, "b": 40}  # the largest total where no source repeats: b's 40 rows are 3/4
    one = tasks.PromptMixture([("a", a, 1.0)])
    assert len(one) == 64 and all(one[k]["messages"] == a[k]["messages"] for k in range(64))
    assert one[5]["task_id"] == "a/5" and one.reward(one[5], "xx") == a.reward(a[5], "xx")


def test_per_source_counts_on_a_two_source_mixture(monkeypatch, tmp_path, checkpoint, capsys):  # noqa: F811
    # the second source's verifier always fails: its groups are dispatched but never kept
    tasks_by_name = {"synthetic": LengthParity, "gsm8k": Broken}
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(rollout, "task_by_name", lambda name, split, size: tasks_by_name[name](split, size=64))
    rl.main(["--preset", "tiny", "--device", "cpu", "--ckpt", str(checkpoint), "--out", str(tmp_path / "rl"),
             "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "8", "--eval-problems", "8",
             "--eval-samples", "2", "--num-steps", "2", "--eval-every", "2", "--task", "synthetic:1,gsm8k:1"])
    text = capsys.readouterr().out
    assert "mixture: training prompts per source {'synthetic': 64, 'gsm8k': 64}" in text and "sources:" in text
    record = json.loads((tmp_path / "home" / "report.jsonl").read_text().splitlines()[-1])
    s = record["sources"]
    assert s["synthetic/groups_dispatched"] > 0 and s["gsm8k/groups_dispatched"] > 0
    assert s["gsm8k/groups_kept"] == s["gsm8k/valid_tokens"] == s["gsm8k/loss_mass"] == 0
    assert 0 < s["synthetic/groups_kept"] <= 2 * 4 and s["synthetic/valid_tokens"] > 0 and s["synthetic/loss_mass"] > 0
    assert "gsm8k dispatched" in text and "loss share 0.00" in text and "loss share 1.00" in text


def test_account_sources_counts_tokens_and_the_mass_of_the_advantages_trained_on():
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    tally = rollout.source_tally(["x", "y"])
    # GRPO: one advantage per row, on each of its valid tokens
    rollout.account_sources(tally, [{"mask": mask, "advantages": torch.tensor([0.5, -1.0, 0.0]),
                                     "sources": ["x", "y", "x"]}])
    assert (tally["source/x/valid_tokens"], tally["source/y/valid_tokens"]) == (5, 2)
    assert (tally["source/x/loss_mass"], tally["source/y/loss_mass"]) == (1.5, 2.0)
    # PPO: per-token (whitened GAE) advantages, |A_t| summed over the valid tokens only
    gae = torch.tensor([[9.0, 0.5, -0.5, 1.0], [9.0, 9.0, 0.25, -0.25], [9.0, 2.0, -2.0, 9.0]])
    tally = rollout.source_tally(["x", "y"])
    rollout.account_sources(tally, [{"mask": mask, "advantages": gae, "sources": ["x", "y", "x"]}])
    assert (tally["source/x/loss_mass"], tally["source/y/loss_mass"]) == (6.0, 0.5)


# -----------------------------------------------------------------------------
# Difficulty filter


def test_difficulty_keep_rule_on_hand_made_counts():
    counts = [0, 1, 2, 8, 14, 15, 16]
    # n = 16, (0.1, 0.9): 1.6 < c < 14.4, i.e. 2 to 14 successes
    assert rl_systems.difficulty_keep(counts, 16, 0.1, 0.9) == [False, False, True, True, True, False, False]
    # the bounds are strict: 4 of 8 is not inside (0.5, 1)
    assert rl_systems.difficulty_keep([4, 5, 8], 8, 0.5, 1.0) == [False, True, False]
    with pytest.raises(ValueError, match="LOW < HIGH"):
        rl_systems.difficulty_keep(counts, 16, 0.9, 0.1)


def test_difficulty_filter_runs_prints_and_caches(monkeypatch, tmp_path, checkpoint, capsys):  # noqa: F811
    run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "1", "--eval-every", "1",
           "--difficulty-filter", "0.1", "0.9", "--difficulty-samples", "4")
    text = capsys.readouterr().out
    assert "difficulty filter: successes out of 4: 0:" in text and "kept" in text
    caches = list(checkpoint.glob("step_*/difficulty_*.json"))
    assert len(caches) == 1 and len(json.loads(caches[0].read_text())["successes"]) == 64
    run_rl(monkeypatch, tmp_path / "again", checkpoint, "--num-steps", "1", "--eval-every", "1",
           "--difficulty-filter", "0.1", "0.9", "--difficulty-samples", "4")
    assert f"from {caches[0]}" in capsys.readouterr().out
    caches[0].unlink()


def test_difficulty_cache_key_follows_the_prompts_it_counted(monkeypatch):
    monkeypatch.setattr(tasks, "evaluation_texts", lambda preset: [])  # only the held-out problems decontaminate
    sampling = dict(temperature=1.0, top_k=None, top_p=None)
    keys, sizes = [], []
    for flags in (["--eval-problems", "4"], ["--eval-problems", "400"], ["--eval-problems", "400"],
                  ["--eval-problems", "400", "--difficulty-samples", "8"]):
        args = rl.parse_args(["--preset", "tiny", "--decontaminate", *flags])
        train_task = rollout.prepare_prompts(args, 1)[0]
        keys.append(rl_systems.difficulty_cache_key(args, train_task, sampling))
        sizes.append(len(train_task))
    assert sizes[:2] == [5000, 4996]  # 400 held-out problems drop 4 training prompts that share a 13-gram
    assert keys[0] != keys[1] and keys[1] == keys[2] and keys[3] != keys[2]


def test_difficulty_filter_reports_the_mixture_it_leaves(monkeypatch, tmp_path, checkpoint, model, tokenizer, capsys):  # noqa: F811
    args = rl.parse_args(["--preset", "tiny", "--difficulty-filter", "0.1", "0.9",
                          "--difficulty-samples", "4", "--prompts-per-step", "2"])
    mixture = tasks.PromptMixture([("a", LengthParity(size=8), 1.0), ("b", LengthParity(size=8), 1.0)])
    sampling = dict(temperature=1.0, top_k=None, top_p=None)
    key = rl_systems.difficulty_cache_key(args, mixture, sampling)
    cache = rl_systems.resolve_checkpoint(checkpoint) / f"difficulty_{key:016x}.json"
    cache.write_text(json.dumps({"successes": [2] * 6 + [0] * 10}))  # a's first 6 of its 8 in range, none of b's
    try:
        kept = rl_systems.difficulty_prompts(args, Engine(model, tokenizer), mixture, checkpoint, None, sampling)
    finally:
        cache.unlink()
    assert len(kept) == 6 and "training prompts per source {'a': 6, 'b': 0}" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# PTGS


def test_ptgs_example_temperatures():
    controller = rl_systems.TemperatureController(target=0.5, tau=1.5, t_ref=1.0)
    got = [controller.temperature(p) for p in (0.1, 0.5, 0.9)]
    assert got == pytest.approx([1.5 ** 0.8, 1.0, 1.5 ** -0.8])
    assert [round(t, 2) for t in got] == [1.38, 1.00, 0.72]
    # an asymmetric target: the ends still map to T_ref * tau and T_ref / tau
    skewed = rl_systems.TemperatureController(target=0.8, tau=2.0, t_ref=0.7)
    assert [skewed.temperature(p) for p in (0.0, 0.8, 1.0)] == pytest.approx([1.4, 0.7, 0.35])


def test_ptgs_discount_and_posterior():
    controller = rl_systems.TemperatureController(gamma=0.5, seed=0)
    controller.update("t", 3, 1)
    controller.update("t", 0, 4)
    assert controller.counts["t"] == [0.5 * 3 + 0, 0.5 * 1 + 4]
    gamma1 = rl_systems.TemperatureController(gamma=1.0)
    gamma1.update("t", 3, 1)
    gamma1.update("t", 0, 4)
    assert gamma1.counts["t"] == [3, 5]
    # a task it always solves is sampled colder than the pivot, one it never solves hotter
    easy, hard = rl_systems.TemperatureController(seed=1), rl_systems.TemperatureController(seed=1)
    for _ in range(10):
        easy.update("t", 8, 0)
        hard.update("t", 0, 8)
    assert max(easy.draw("t") for _ in range(50)) < 1.0 < min(hard.draw("t") for _ in range(50))


def test_ptgs_state_survives_a_checkpoint(tmp_path):
    controller = rl_systems.TemperatureController(seed=3)
    for i in range(5):
        controller.update(f"t{i % 2}", i, 5 - i)
        controller.draw(f"t{i % 2}")
    torch.save({"ptgs": controller.state_dict()}, tmp_path / "extra.pt")
    restored = rl_systems.TemperatureController(seed=99)
    restored.load_state_dict(torch.load(tmp_path / "extra.pt", weights_only=True)["ptgs"])
    assert restored.counts == controller.counts
    # Each step reseeds the draws from (seed, step, rank) (Rollouts.next_groups): the counts are all a resume needs.
    controller.rng.seed(7)
    restored.rng.seed(7)
    assert [restored.draw("t0") for _ in range(5)] == [controller.draw("t0") for _ in range(5)]


def test_ptgs_groups_are_scored_at_their_own_temperature(model, tokenizer):  # noqa: F811
    engine = Engine(model, tokenizer)
    sampling = dict(temperature=1.0, top_k=None, top_p=None)
    temperature_of = {p: t for p, t in zip(range(4), (0.7, 1.3, 0.7, 1.0))}
    task = tasks.PromptMixture([("p", LengthParity(), 1.0)])
    groups, _ = rollout.sample_groups(engine, task, 4, 3, 8, sampling, seed=0, filter_zero_contrast=False,
                                 temperature_of=lambda c: temperature_of[int(c["task_id"].split("/")[1]) % 4])
    temps = [g["temperature"] for g in groups]
    assert len(groups) == 4 and set(temps) <= {0.7, 1.3, 1.0} and len(set(temps)) > 1
    rows = rollout.learner_rows(groups, grpo_advantages(groups, 3), mask_truncated=False)
    rows = [row + (g["temperature"],) for row, g in zip(rows, (g for g in groups for _ in g["completions"]))]
    batch = rollout.collate_rollouts(rows, pad_id=0, device="cpu")
    with torch.no_grad():
        logp, _ = rollout.token_logprobs(model, batch["inputs"], batch["targets"],
                                    {**sampling, "temperature": batch["temperature"]})
        assert ((logp - batch["behavior"]).abs() * batch["mask"]).max() < 1e-4
        # one temperature for the whole batch is visibly wrong: the check can fail
        flat, _ = rollout.token_logprobs(model, batch["inputs"], batch["targets"], sampling)
        assert ((flat - batch["behavior"]).abs() * batch["mask"]).max() > 1e-2


def test_ptgs_run_resumes_with_its_controller(monkeypatch, tmp_path, checkpoint, capsys):  # noqa: F811
    flags = ["--num-steps", "2", "--save-every", "1", "--eval-every", "2", "--ptgs"]
    out = run_rl(monkeypatch, tmp_path, checkpoint, *flags)
    final, _, _ = rl.load_model(out, "cpu")
    extra = torch.load(out / "step_000002" / "extra.pt", weights_only=True)
    assert extra["ptgs"]["counts"]  # the controller saw the outcomes
    (out / "latest").write_text("step_000001")
    run_rl(monkeypatch, tmp_path, checkpoint, *flags, "--resume")
    assert "resuming at step 1" in capsys.readouterr().out
    resumed, _, _ = rl.load_model(out, "cpu")
    for a, b in zip(resumed.state_dict().values(), final.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert math.isfinite(float(next(iter(resumed.state_dict().values())).sum()))


# -----------------------------------------------------------------------------
# Overlapped rollouts


def test_async_with_zero_delay_reproduces_synchronous_training(monkeypatch, tmp_path, checkpoint, capsys):  # noqa: F811
    flags = ["--num-steps", "3", "--eval-every", "3"]
    sync = run_rl(monkeypatch, tmp_path / "sync", checkpoint, *flags)
    overlapped = run_rl(monkeypatch, tmp_path / "async", checkpoint, *flags, "--async", "--async-delay", "0")
    assert "idle" in capsys.readouterr().out  # the worker process made the batches
    a, _, _ = rl.load_model(sync, "cpu")
    b, _, _ = rl.load_model(overlapped, "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_async_one_step_delay_samples_with_the_previous_weights(monkeypatch, tmp_path, checkpoint, model, capsys):  # noqa: F811
    # The worker on its own: the batch of a job carries the version it was sent and that version's log-probs.
    task = tasks.PromptMixture([("p", LengthParity(), 1.0)])
    kwargs = dict(num_groups=2, group_size=3, max_tokens=6, sampling=dict(temperature=1.0, top_k=None, top_p=None),
                  filter_zero_contrast=False)
    newer = rl.load_model(checkpoint, "cpu")[0]
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    worker = rl_systems.RolloutWorker(checkpoint, "cpu", task, kwargs)
    try:
        worker.submit(5, 4, model.state_dict(), seed=0)  # step 5's groups with the weights after 4 updates
        step, version, groups, _, records, seconds = worker.result()
    finally:
        worker.close()
    assert (step, version) == (5, 4) and all(g["version"] == 4 for g in groups) and len(records) == 2
    rows = rollout.learner_rows(groups, grpo_advantages(groups, 3), mask_truncated=False)
    batch = rollout.collate_rollouts(rows, pad_id=0, device="cpu")
    with torch.no_grad():
        sampler, _ = rollout.token_logprobs(model, batch["inputs"], batch["targets"], kwargs["sampling"])
        learner, _ = rollout.token_logprobs(newer, batch["inputs"], batch["targets"], kwargs["sampling"])
    assert ((sampler - batch["behavior"]).abs() * batch["mask"]).max() < 1e-4  # the behavior log-probs: the sampler's
    assert ((learner - batch["behavior"]).abs() * batch["mask"]).max() > 1e-2
    # The loop: step 1 is sampled by the start weights (age 0), every later step by the weights one update older.
    run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "3", "--eval-every", "3", "--async")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split("age ")[1].split()[0] for line in lines] == ["0", "1", "1"]
    # and the learner sees it: its log-probs differ from the behavior ones once the sampler is a version behind
    gaps = [float(line.split("| gap ")[1].split()[0]) for line in lines]
    assert gaps[0] < 1e-5 and min(gaps[1:]) > 1e-3


def test_groups_older_than_the_max_policy_age_are_dropped_and_counted():
    groups = [{"version": v, "id": i} for i, v in enumerate([4, 3, 2, 4, 1])]
    kept, sources, dropped = rl_systems.fresh_groups(groups, list("abcde"), step=4, max_age=1)
    assert [g["id"] for g in kept] == [0, 1, 3] and sources == list("abd") and dropped == 2
    assert rl_systems.fresh_groups(groups, list("abcde"), step=4, max_age=3)[2] == 0


@pytest.mark.parametrize("flags, message", [
    (["--async", "--mismatch", "none"], "uncorrected"),
    (["--async", "--max-policy-age", "0"], "below --async-delay"),
    (["--max-policy-age", "-1"], ">= 0"),
])
def test_overlapped_rollouts_refuse_uncorrected_or_always_stale_batches(flags, message, capsys):
    with pytest.raises(SystemExit):
        rl.parse_args(flags)
    assert message in capsys.readouterr().err
    rl.parse_args(["--async", "--async-delay", "0", "--mismatch", "none", "--max-policy-age", "0"])  # on-policy


# -----------------------------------------------------------------------------
# Sampling and the learner's view: behavior log-probs, truncation masks, dynamic sampling, oversampling


@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_k=None, top_p=None),
                                      dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_engine_logprobs_match_the_learner(model, tokenizer, sampling):
    engine = Engine(model, tokenizer)
    task = SyntheticTask("train", size=3)
    prompts = [tokenizer.render_for_completion(task[i]) for i in range(3)]
    results = engine.generate(prompts, num_samples=2, max_tokens=12, seed=0, **sampling)
    groups = [{"prompt": p, "completions": c, "rewards": [0.0, 1.0]} for p, c in zip(prompts, results)]
    rows = rollout.learner_rows(groups, grpo_advantages(groups, 2), mask_truncated=False)
    batch = rollout.collate_rollouts(rows, pad_id=0, device="cpu")
    assert batch["mask"].sum() == sum(len(c.tokens) for r in results for c in r)  # every sampled token, nothing else
    with torch.no_grad():
        logp, _ = rollout.token_logprobs(model, batch["inputs"], batch["targets"], sampling)
        gap = ((logp - batch["behavior"]).abs() * batch["mask"]).max()
        assert gap < 1e-4
        # scoring at another temperature than the one that sampled is visibly wrong: the check can fail
        other, _ = rollout.token_logprobs(model, batch["inputs"], batch["targets"], {**sampling, "temperature": 1.5})
        assert ((other - batch["behavior"]).abs() * batch["mask"]).max() > 1e-2
    close(batch["advantages"], [-1, 1, -1, 1, -1, 1])


def test_ptgs_rows_report_the_untempered_entropy_next_to_their_own(model):
    torch.manual_seed(0)
    inputs = torch.randint(0, model.config.vocab_size, (2, 6))
    targets = torch.randint(0, model.config.vocab_size, (2, 6))
    sampling = dict(temperature=torch.tensor([0.7, 1.5]), top_k=None, top_p=None)
    with torch.no_grad():
        logp, entropy = rollout.token_logprobs(model, inputs, targets, sampling)  # (2, 6), (2, 6, 2)
        at = [rollout.token_logprobs(model, inputs[b:b + 1], targets[b:b + 1], {**sampling, "temperature": t})[1][0]
              for b, t in enumerate((0.7, 1.5))]
        base = rollout.token_logprobs(model, inputs, targets, {**sampling, "temperature": 1.0})[1]  # (2, 6)
    assert entropy.shape == (2, 6, 2)
    close(entropy[..., 0], torch.stack(at), atol=1e-5)  # each row's own temperature
    close(entropy[..., 1], base, atol=1e-5)  # the same tokens at temperature 1: comparable across rows
    assert (entropy[0, :, 0] < entropy[0, :, 1]).all() and (entropy[1, :, 0] > entropy[1, :, 1]).all()
    tally = {"gap_sum": 0.0, "gap_max": 0.0, "entropy_sum": 0.0, "entropy_t1_sum": 0.0, "trained_tokens": 0,
             "corrected": 0.0}
    micro = {"mask": torch.ones(2, 6), "behavior": logp}
    rollout.score_old(micro, logp, entropy, tally, SimpleNamespace(mismatch="tis", tis_cap=2.0, mask_window=None))
    assert tally["entropy_sum"] == pytest.approx(float(entropy[..., 0].sum()), rel=1e-5)
    assert tally["entropy_t1_sum"] == pytest.approx(float(base.sum()), rel=1e-5)


def test_learner_logprobs_in_chunks_equal_whole_logits_in_value_and_gradient(model, monkeypatch):
    # Broken once (chunked_logits scoring the chunks against targets shifted by one): the values differed.
    monkeypatch.setattr(model_module, "LOGITS_CHUNK_TOKENS", 7)  # 3 x 10 positions in chunks of 7
    sampling = dict(temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(0)
    x, y = torch.randint(0, 400, (3, 10)), torch.randint(0, 400, (3, 10))
    y[0, :4] = -1
    weights = torch.rand(3, 10)
    chunked, whole = GPT(model.config), GPT(model.config)
    chunked.load_state_dict(model.state_dict())
    whole.load_state_dict(model.state_dict())
    logp, entropy = rollout.token_logprobs(chunked, x, y, sampling)
    (logp * weights).sum().backward()
    logprobs = sampling_logprobs(whole(x), **sampling)  # (3, 10, V): the whole logits
    expected = logprobs.gather(-1, y.clamp(min=0)[..., None]).squeeze(-1).clamp(min=rollout.LOGP_FLOOR)
    (expected * weights).sum().backward()
    torch.testing.assert_close(logp, expected)
    torch.testing.assert_close(entropy, torch.special.entr(logprobs.detach().exp()).sum(-1))
    for (name, p), q in zip(whole.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_mask_truncated_removes_completions_that_hit_the_budget(model, tokenizer):
    engine = Engine(model, tokenizer)
    prompt = tokenizer.render_for_completion(SyntheticTask("train", size=1)[0])
    (completions,) = engine.generate([prompt], num_samples=6, max_tokens=3, seed=0)
    assert {c.finish for c in completions} == {"stop", "length"}  # some stop within 3 tokens, some do not
    group = [{"prompt": prompt, "completions": completions, "rewards": [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]}]
    masked = rollout.learner_rows(group, grpo_advantages(group, 6), mask_truncated=True)
    kept = rollout.learner_rows(group, grpo_advantages(group, 6), mask_truncated=False)
    assert [sum(m) for _, m, _, _ in masked] == [len(c.tokens) * (c.finish == "stop") for c in completions]
    assert [sum(m) for _, m, _, _ in kept] == [len(c.tokens) for c in completions]


def test_dynamic_sampling_never_returns_zero_contrast_groups(model, tokenizer):
    engine = Engine(model, tokenizer)
    sampling = dict(temperature=1.0, top_k=None, top_p=None)
    groups, stats = rollout.sample_groups(engine, LengthParity(), 6, 4, 8, sampling, seed=0, max_rounds=6)
    assert len(groups) == 6
    assert all(len(set(g["rewards"])) > 1 for g in groups)
    assert stats["zero_contrast"] > 0  # some were drawn and dropped, and the logs count them
    assert stats["groups"] == 6 * stats["rounds"] and stats["completions"] == 4 * stats["groups"]
    # without the filter the even-answer groups come through
    unfiltered, _ = rollout.sample_groups(engine, LengthParity(), 6, 4, 8, sampling, seed=0, filter_zero_contrast=False)
    assert any(len(set(g["rewards"])) == 1 for g in unfiltered)


def test_dynamic_sampling_gives_up_after_the_cap_and_counts_verifier_errors(model, tokenizer):
    engine = Engine(model, tokenizer)
    sampling = dict(temperature=1.0, top_k=None, top_p=None)
    groups, stats = rollout.sample_groups(engine, Broken(), 2, 3, 4, sampling, seed=0, max_rounds=3)
    assert groups == []  # every reward is 0: nothing to learn from, and no infinite loop
    assert stats["rounds"] == 3 and stats["completions"] == 3 * 2 * 3
    assert stats["errors"] == stats["completions"] - stats["truncated"] > 0  # an answer that did not stop is not scored
    assert stats["reward_sum"] == stats["correct"] == 0


def test_one_generate_call_per_round_oversampled(model, tokenizer, monkeypatch):
    engine = Engine(model, tokenizer)
    calls = []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda prompts, **kwargs: calls.append(len(prompts)) or
                        generate(prompts, **kwargs))
    sampling = dict(temperature=1.0, top_k=None, top_p=None)
    groups, stats = rollout.sample_groups(engine, LengthParity(), 3, 4, 8, sampling, seed=1, max_rounds=6, oversample=2.5)
    assert calls == [8] * stats["rounds"]  # ceil(2.5 * 3) prompts, all in one call per round
    assert len(groups) == 3 and all(len(set(g["rewards"])) > 1 for g in groups)
    assert stats["groups"] == 8 * stats["rounds"]
    with pytest.raises(ValueError, match="oversample"):
        rollout.sample_groups(engine, LengthParity(), 3, 4, 8, sampling, seed=1, oversample=0.5)


def test_learner_logprobs_detached_are_exactly_the_old_logprobs(model, tokenizer):
    # What skipping the no-grad old-log-prob pass (--epochs 1 --minibatches 1) relies on: before any update, the
    # learner pass's log-probs, detached, equal that pass bit for bit, so the loss and its gradient are the same.
    engine = Engine(model, tokenizer)
    sampling = dict(temperature=1.0, top_k=None, top_p=None)
    groups, _ = rollout.sample_groups(engine, LengthParity(), 2, 4, 8, sampling, seed=3, filter_zero_contrast=False)
    rows = rollout.learner_rows(groups, grpo_advantages(groups, 4), False)
    micro = rollout.collate_rollouts(rows, tokenizer.bos_id, "cpu")
    with torch.no_grad():
        old, _ = rollout.token_logprobs(model, micro["inputs"], micro["targets"], sampling)
    results = []
    for detached in (False, True):
        model.zero_grad(set_to_none=True)
        logp, _ = rollout.token_logprobs(model, micro["inputs"], micro["targets"], sampling)
        loss, _ = objectives.policy_loss(logp, logp.detach() if detached else old, micro["advantages"], micro["mask"])
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_a_step_that_trained_no_token_logs_nan_learner_statistics_not_zeros():
    # Four sampled completions, every group zero-contrast: the learner saw nothing, so entropy, gap and clipping
    # are unmeasured (NaN, a gap in the report's figure), while the rollout's own numbers stay real.
    sampled = {"completions": 4, "reward_sum": 4.0, "reward_sq_sum": 4.0, "correct": 4, "errors": 0,
               "zero_contrast": 1, "groups": 1, "rounds": 1, "length_sum": 12, "length_max": 3, "truncated": 0}
    metrics = rollout.step_metrics(rollout.learner_tally(sampled, [], [0, 0]), 0, [], (1.0, 0.0), {}, [], {})
    for name in ("policy/entropy", "policy/clip_low", "policy/clip_high", "mismatch/logp_gap_mean",
                 "mismatch/corrected_frac"):
        assert math.isnan(metrics[name]), name
    assert metrics["reward/mean"] == 1.0 and metrics["length/mean"] == 3.0 and metrics["batch/zero_contrast_frac"] == 1

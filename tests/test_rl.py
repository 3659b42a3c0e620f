"""
rl.py: the engine's behavior log-probs against the learner's; dynamic sampling; the whole loop in-process and under
torchrun (the objective's math: test_objectives.py).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import objectives
import rl
import rollout
from common import save_checkpoint
from conftest import ends_turn_sometimes, grpo_advantages, scripted_model
from engine import Engine, load_model
from eval import completion_text
from model import GPT, GPTConfig
from tasks import SyntheticTask, synthetic_documents
from tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread beats two (thread hand-offs cost more than the matmuls; 20x on a busy CPU)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# -----------------------------------------------------------------------------
# A real tokenizer, a real (random, 2-layer) model, the real engine


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(synthetic_documents(300, seed=0), vocab_size=400)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)  # PyTorch's default init: a random model whose samples vary
    config = GPTConfig(sequence_len=128, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    return ends_turn_sometimes(GPT(config).eval(), tokenizer)  # only an answer that stops can be correct


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model, tokenizer):
    path = tmp_path_factory.mktemp("ckpt") / "dpo"
    save_checkpoint(path, 0, model, {"stage": "dpo"}, tokenizer=tokenizer)
    return path


class LengthParity:
    """
    Synthetic prompts with a reward a random model can both earn and miss: 1 if the completion's text has an even
    number of characters. For prompts whose answer is even, every completion scores 1 (if it stops: an answer cut
    by max_tokens scores 0 whatever the verifier says).
    """

    def __init__(self, split="train", size=64):
        self.task = SyntheticTask(split, size=size)

    def __len__(self):
        return len(self.task)

    def __getitem__(self, i):
        return self.task[i]

    def reward(self, conversation, completion):
        return 1.0 if int(conversation["answer"]) % 2 == 0 else float(len(completion) % 2 == 0)


class Broken(LengthParity):
    def reward(self, conversation, completion):
        raise RuntimeError("verifier bug")


# -----------------------------------------------------------------------------
# The loop, in-process


def run_rl(monkeypatch, tmp_path, checkpoint, *flags, task=LengthParity, stage=rl):
    """stage.main (rl, or ppo: the same flags) on `task` at test sizes; returns its --out."""
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(rollout, "task_by_name", lambda name, split, size: task(split, size=64))
    base = ["--preset", "tiny", "--device", "cpu", "--ckpt", str(checkpoint), "--out", str(tmp_path / "rl"),
            "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "8", "--eval-problems", "8",
            "--eval-samples", "2", "--device-batch-tokens", "200"]
    stage.main(base + list(flags))
    return tmp_path / "rl"


def test_main_trains_saves_reports_and_resumes(monkeypatch, tmp_path, checkpoint, capsys):
    out = run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "2", "--save-every", "1", "--eval-every", "1",
                 "--epochs", "2", "--minibatches", "2")
    text = capsys.readouterr().out
    assert "step 2/2" in text and "eval step 2" in text
    final, _, meta = load_model(out, "cpu")
    assert meta["finished"] and meta["step"] == 2
    initial, _, _ = load_model(checkpoint, "cpu")
    assert any(not torch.equal(a, b) for a, b in zip(final.state_dict().values(), initial.state_dict().values()))
    report = [json.loads(line) for line in (tmp_path / "home" / "report.jsonl").read_text().splitlines()]
    assert report[-1]["stage"] == "rl" and {"pass@1", "pass@1_before", "pass@2"} <= report[-1].keys()

    # Finished: a re-run with --resume does nothing.
    run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "2", "--resume")
    assert "already finished" in capsys.readouterr().out

    # Interrupted after step 1: --resume continues from there and ends with the same weights.
    (out / "latest").write_text("step_000001")
    run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "2", "--save-every", "1", "--eval-every", "1",
           "--epochs", "2", "--minibatches", "2", "--resume")
    text = capsys.readouterr().out
    assert "resuming at step 1" in text and "step 2/2" in text and "step 1/2" not in text
    resumed, _, _ = load_model(out, "cpu")
    for a, b in zip(resumed.state_dict().values(), final.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_old_logprob_pass_runs_only_when_the_policy_moves_between_updates(monkeypatch, tmp_path, checkpoint):
    # Same seed, same rollouts and micro-batches (M of them): with 1 epoch x 1 minibatch only the learner pass
    # scores them (M calls); with 2 epochs the old-log-prob pass runs first (M + 2 M calls).
    calls = []
    token_logprobs = rollout.token_logprobs
    monkeypatch.setattr(rl, "token_logprobs", lambda model, *args: calls.append(1) or token_logprobs(model, *args))
    counts = []
    for epochs in ("1", "2"):
        calls.clear()
        run_rl(monkeypatch, tmp_path / epochs, checkpoint, "--num-steps", "1", "--eval-every", "1",
               "--epochs", epochs)
        counts.append(len(calls))
    assert counts[0] > 0 and counts[1] == 3 * counts[0]


def test_dry_run_builds_everything_and_stops(monkeypatch, tmp_path, checkpoint, capsys):
    out = run_rl(monkeypatch, tmp_path, checkpoint, "--dry-run")
    text = capsys.readouterr().out
    assert "plan: 20 steps" in text and "dry run" in text and "eval step" not in text
    assert not out.exists()


@pytest.mark.parametrize("flags", [
    ["--loss", "gspo", "--eps-low", "3e-4", "--eps-high", "4e-4", "--loss-agg", "seq-mean-token-mean"],
    ["--loss", "cispo", "--adv-scale", "none", "--loss-agg", "seq-mean-token-sum-norm", "--mismatch", "mask"],
    ["--loss", "pg", "--adv-baseline", "loo", "--kl-coef", "0.1", "--kl-kind", "k3", "--overlong-buffer", "4",
     "--mask-truncated", "--top-k", "50", "--temperature", "0.8"],
])
def test_main_runs_every_variant(monkeypatch, tmp_path, checkpoint, capsys, flags):
    run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "1", "--eval-every", "1", *flags)
    assert "step 1/1" in capsys.readouterr().out


def test_rl_raises_the_reward_of_a_random_model(monkeypatch, tmp_path, checkpoint, capsys):
    # The sign check of the whole loop: on LengthParity a random policy earns ~0.75; 15 steps must raise it.
    run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "15", "--eval-every", "15", "--prompts-per-step", "8",
           "--lr-frac", "1.0")
    report = json.loads((tmp_path / "home" / "report.jsonl").read_text().splitlines()[-1])
    assert report["pass@1"] > report["pass@1_before"] + 0.1, report


# -----------------------------------------------------------------------------
# The loop under torchrun: 2 CPU ranks (gloo) sample different prompts but must end with identical weights


DDP_DRIVER = """
import hashlib, importlib, os, sys
sys.path[:0] = [{repo!r}, {tests!r}]
import {stage} as stage, rollout
from engine import Engine
task = getattr(importlib.import_module({task!r}.rpartition(".")[0]), {task!r}.rpartition(".")[2])
rollout.task_by_name = lambda name, split, size: task(split, size=64)
models, rollouts, Rollouts = [], [], stage.Rollouts
stage.Engine = lambda model, tokenizer: models.append(model) or Engine(model, tokenizer)  # keep each rank's model
stage.Rollouts = lambda *args, **kwargs: rollouts.append(Rollouts(*args, **kwargs)) or rollouts[-1]
if __name__ == "__main__":  # not in the --async worker, which the spawn start method starts from this file
    stage.main(sys.argv[1:])
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in models[0].parameters())).hexdigest()
    with open(os.path.join({out!r}, "rank" + os.environ["RANK"]), "w") as f:
        f.write(digest)
    if rollouts and rollouts[0].ptgs is not None:  # the rank's PTGS counts at the end
        with open(os.path.join({out!r}, "ptgs" + os.environ["RANK"]), "w") as f:
            f.write(repr(sorted(rollouts[0].ptgs.counts.items())))
"""


def torchrun(tmp_path, checkpoint, *flags, stage="rl", task="test_rl.LengthParity"):
    """stage.main under torchrun, 2 gloo ranks, at test sizes; each rank writes its final weights' hash to rank<R>."""
    driver = tmp_path / "driver.py"
    driver.write_text(DDP_DRIVER.format(repo=str(REPO), tests=str(REPO / "tests"), out=str(tmp_path), stage=stage,
                                        task=task))
    env = {**os.environ, "NANOPOST_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(driver),
               "--preset", "tiny", "--device", "cpu", "--ckpt", str(checkpoint), "--out", str(tmp_path / "rl"),
               "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "8", "--eval-problems", "4",
               "--eval-samples", "2", "--device-batch-tokens", "150", *flags]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 rank(s)" in result.stdout
    return result


@pytest.mark.slow
def test_torchrun_two_ranks_end_with_identical_weights(tmp_path, checkpoint):
    result = torchrun(tmp_path, checkpoint, "--num-steps", "2", "--minibatches", "2")
    assert "step 2/2" in result.stdout
    assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text()
    final, _, meta = load_model(tmp_path / "rl", "cpu")
    initial, _, _ = load_model(checkpoint, "cpu")
    assert meta["finished"]
    assert any(not torch.equal(a, b) for a, b in zip(final.state_dict().values(), initial.state_dict().values()))


# -----------------------------------------------------------------------------
# Issue 9: only a finished answer is a success, ratios that cannot overflow, errors are not wrong answers


class AcceptsAnything(LengthParity):
    """A verifier that accepts every text: whatever separates two answers is how they ended."""

    def reward(self, conversation, completion):
        return 1.0


def test_truncated_answer_is_not_correct_in_rollouts(model, tokenizer):
    engine = Engine(model, tokenizer)
    sampling = dict(temperature=1.0, top_k=None, top_p=None)
    groups, stats = rollout.sample_groups(engine, AcceptsAnything(), 4, 4, 6, sampling, seed=0, max_rounds=3)
    assert groups and stats["truncated"] > 0
    for group in groups:  # every text is "right": the reward is 1 exactly for the answers that stopped
        assert group["rewards"] == [float(c.finish == "stop") for c in group["completions"]]


def two_length_model(tokenizer):
    """
    A scripted model whose answers always stop and are always 'right' to AcceptsAnything, in 2 or 3 tokens with
    probability ~1/2 each: <|assistant_start|> -> a -> (<|assistant_end|> | b -> <|assistant_end|>).
    """
    start, end = tokenizer.token_id("<|assistant_start|>"), tokenizer.token_id("<|assistant_end|>")
    a, b = 100, 101
    model = scripted_model(tokenizer, {start: a, a: end, b: end}, scale=2.0)
    with torch.no_grad():
        model.lm_head.weight[b, 2] = 2.0  # a (slot 2) leads to b as strongly as to <|assistant_end|>
    return model


def test_zero_contrast_uses_verifier_outcome(tokenizer):
    engine = Engine(two_length_model(tokenizer), tokenizer)
    sampling = dict(temperature=1.0, top_k=None, top_p=None)
    # max_tokens 4, buffer 2: a 3-token answer loses 0.5, a 2-token one nothing. Every answer is right, so no group
    # has contrast, however the lengths differ.
    groups, stats = rollout.sample_groups(engine, AcceptsAnything(), 4, 4, 4, sampling, seed=0, max_rounds=2,
                                     overlong_buffer=2)
    assert stats["truncated"] == 0 and stats["correct"] == stats["completions"] == 32
    assert groups == [] and stats["zero_contrast"] == stats["groups"] == 8
    # Without the filter the shaped rewards are what the advantages see, length differences included.
    unfiltered, _ = rollout.sample_groups(engine, AcceptsAnything(), 4, 4, 4, sampling, seed=0, filter_zero_contrast=False,
                                     overlong_buffer=2)
    assert {r for g in unfiltered for r in g["rewards"]} == {1.0, 0.5}
    # What the filter prevents: std scaling blows a 1/64 length penalty up to full size.
    close(objectives.group_advantages(torch.tensor([1.0] * 7 + [1 - 1 / 64]), 8), [0.378] * 7 + [-2.6457], atol=1e-3)


def test_kl_reference_untruncated(monkeypatch, tmp_path, checkpoint):
    # --top-k 20 truncates what the engine samples from; the KL compares the untruncated temperature-scaled
    # distributions (a token outside the reference's top-20 would otherwise get ref_logp = LOGP_FLOOR, k2 ~ 5e3).
    scored, compared = [], []
    token_logprobs, kl_penalty = rollout.token_logprobs, objectives.kl_penalty

    def spy_logprobs(model, inputs, targets, sampling):
        if not next(model.parameters()).requires_grad:  # the frozen reference model
            scored.append(dict(sampling))
        return token_logprobs(model, inputs, targets, sampling)

    def spy_kl(logp, ref_logp, kind="k2"):
        compared.append((logp.detach(), ref_logp))
        return kl_penalty(logp, ref_logp, kind)

    monkeypatch.setattr(rl, "token_logprobs", spy_logprobs)
    monkeypatch.setattr(rl, "kl_penalty", spy_kl)
    run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "1", "--eval-every", "1", "--kl-coef", "0.1",
           "--top-k", "20", "--temperature", "0.9")
    assert scored and all(s == {"temperature": 0.9, "top_k": None, "top_p": None} for s in scored)
    assert compared
    for logp, ref_logp in compared:  # before the first update the policy is the reference, scored the same way
        torch.testing.assert_close(logp, ref_logp)


def test_verifier_error_dropped_from_training(model, tokenizer):
    # group_advantages over the valid members: rewards [1, 0, (error), 1] -> mean 2/3, population std sqrt(2) / 3
    rewards, valid = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]), torch.tensor([1, 1, 0, 1, 0, 0, 0, 1])
    s = math.sqrt(2) / 3
    close(objectives.group_advantages(rewards, 4, valid=valid.bool()),
          [1 / 3 / s, -2 / 3 / s, 0, 1 / 3 / s, 0, 0, 0, 0])
    close(objectives.group_advantages(rewards, 4, scale="none", baseline="loo", valid=valid.bool()),
          [1 / 2, -1, 0, 1 / 2, 0, 0, 0, 0])  # loo: against the mean of the other valid members
    # learner_rows: an errored completion is not trained on, and its group's baseline is the others'
    engine = Engine(model, tokenizer)
    prompt = tokenizer.render_for_completion(SyntheticTask("train", size=1)[0])
    (completions,) = engine.generate([prompt], num_samples=4, max_tokens=6, seed=0)
    group = {"prompt": prompt, "completions": completions, "rewards": [1.0, 0.0, 0.0, 1.0],
             "errors": [False, False, True, False]}
    rows = rollout.learner_rows([group], grpo_advantages([group], 4), mask_truncated=False)
    assert [sum(mask) for _, mask, _, _ in rows] == [len(c.tokens) * (j != 2) for j, c in enumerate(completions)]
    close([a for *_, a in rows], [1 / 3 / s, -2 / 3 / s, 0, 1 / 3 / s])

    # sample_groups: contrast among the scored completions only; the errors travel with the group
    class ErrorsOnOddLengths(LengthParity):
        def reward(self, conversation, completion):
            if len(completion) % 2:
                raise RuntimeError("verifier bug")
            return float(len(completion) % 4 == 0)

    sampling = dict(temperature=1.0, top_k=None, top_p=None)
    groups, stats = rollout.sample_groups(engine, ErrorsOnOddLengths(), 4, 6, 8, sampling, seed=0, max_rounds=4)
    assert stats["errors"] > 0 and groups
    for g in groups:
        assert g["errors"] == [c.finish == "stop" and len(completion_text(tokenizer, c)) % 2 == 1
                               for c in g["completions"]]
        assert len({r for r, e in zip(g["rewards"], g["errors"]) if not e}) == 2


def test_loss_kind_paper_defaults(capsys):
    args = rl.parse_args(["--loss", "gspo"])
    assert (args.eps_low, args.eps_high, args.loss_agg) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert "paper defaults eps_low 0.0003, eps_high 0.0004, loss_agg seq-mean-token-mean" in capsys.readouterr().out
    args = rl.parse_args(["--loss", "cispo"])
    assert (args.eps_low, args.eps_high, args.loss_agg) == (1.0, 0.28, "token-mean")  # no lower bound: 1 - 1 = 0
    args = rl.parse_args([])
    assert (args.loss, args.eps_low, args.eps_high, args.loss_agg) == ("ppo", 0.2, 0.28, "token-mean")
    args = rl.parse_args(["--loss", "gspo", "--eps-high", "0.01", "--loss-agg", "token-mean"])  # explicit flags win
    assert (args.eps_low, args.eps_high, args.loss_agg) == (3e-4, 0.01, "token-mean")


def test_step_prompts_without_replacement(model, tokenizer):
    # 12 prompts, 2 ranks x 2 rounds x 3 groups: one step uses each prompt once, on one rank, in one round.
    # max_tokens 1: nothing stops, every group has no contrast, so both rounds run.
    drawn = []
    for rank in range(2):
        engine = Engine(model, tokenizer)
        generate = engine.generate
        engine.generate = lambda prompts, **kw: drawn.extend(map(tuple, prompts)) or generate(prompts, **kw)
        _, stats = rollout.sample_groups(engine, LengthParity(size=12), 3, 2, 1, dict(temperature=1.0), seed=7,
                                    max_rounds=2, rank=rank, world_size=2)
        assert stats["rounds"] == 2
    assert len(drawn) == 12 and len(set(drawn)) == 12


def test_pg_refuses_several_updates_per_batch():
    for flags in (["--epochs", "2"], ["--minibatches", "2"]):
        with pytest.raises(ValueError, match="on-policy"):
            rl.parse_args(["--loss", "pg", *flags])
    rl.parse_args(["--loss", "ppo", "--epochs", "2", "--minibatches", "2"])


def test_dual_clip_must_exceed_one():
    for c in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual"):
            rl.parse_args(["--dual-clip", str(c)])


@pytest.mark.slow
def test_torchrun_ptgs_controller_is_the_same_on_both_ranks_and_after_a_resume(tmp_path, checkpoint):
    # Each rank applies the outcomes of every rank's groups: one controller, saved by rank 0 and restored to all.
    flags = ["--num-steps", "2", "--save-every", "1", "--ptgs", "--ptgs-gamma", "1", "--no-filter-zero-contrast"]
    torchrun(tmp_path, checkpoint, *flags)
    ends = [(tmp_path / f"{name}{rank}").read_text() for name in ("ptgs", "rank") for rank in range(2)]
    assert ends[0] == ends[1] and ends[2] == ends[3]
    assert sum(s + f for _, (s, f) in eval(ends[0])) == 2 * 4 * 4  # both steps' 4 groups of 4 answers each
    (tmp_path / "rl" / "latest").write_text("step_000001")  # interrupted after step 1
    torchrun(tmp_path, checkpoint, *flags, "--resume")
    assert [(tmp_path / f"{name}{rank}").read_text() for name in ("ptgs", "rank") for rank in range(2)] == ends


@pytest.mark.slow
def test_torchrun_async_resume_continues_bit_for_bit_on_both_ranks(tmp_path, checkpoint):
    # The checkpoint keeps the weights the worker was asked to sample the next step with (one update older).
    flags = ["--num-steps", "3", "--save-every", "1", "--eval-every", "3", "--async"]
    torchrun(tmp_path, checkpoint, *flags)
    ends = [(tmp_path / f"rank{rank}").read_text() for rank in range(2)]
    assert ends[0] == ends[1]
    (tmp_path / "rl" / "latest").write_text("step_000002")  # interrupted after step 2
    result = torchrun(tmp_path, checkpoint, *flags, "--resume")
    assert [line.split("age ")[1].split()[0] for line in result.stdout.splitlines() if line.startswith("step ")] == ["1"]
    assert [(tmp_path / f"rank{rank}").read_text() for rank in range(2)] == ends


def test_ptgs_is_refused_with_a_reward_model(capsys):
    with pytest.raises(SystemExit):
        rl.parse_args(["--preset", "tiny", "--ptgs", "--reward", "rm", "--rm-ckpt", "x"])
    assert "--ptgs with --reward rm" in capsys.readouterr().err


@pytest.mark.parametrize("stage, flag, value", [
    (rl, "--num-steps", "0"), (rl, "--prompts-per-step", "0"), (rl, "--group-size", "1"), (rl, "--max-tokens", "0"),
    (rl, "--train-size", "0"), (rl, "--temperature", "0"), (rl, "--eval-temperature", "-1"), (rl, "--top-k", "0"),
    (rl, "--top-p", "1.5"), (rl, "--max-sampling-rounds", "0"), (rl, "--oversample", "0.5"),
    (rl, "--difficulty-samples", "0"), (rl, "--overlong-buffer", "-1"), (rl, "--overlong-buffer", "9"),
    (rl, "--eps-low", "-0.1"), (rl, "--eps-high", "-0.1"), (rl, "--kl-coef", "-1"), (rl, "--tis-cap", "0"),
    (rl, "--epochs", "0"), (rl, "--minibatches", "0"), (rl, "--device-batch-tokens", "0"), (rl, "--lr-frac", "0"),
    (rl, "--warmup-steps", "-1"), (rl, "--max-grad-norm", "-1"), (rl, "--eval-every", "-1"),
    (rl, "--eval-problems", "0"), (rl, "--eval-samples", "0"), (rl, "--save-every", "-1"),
    (rl, "--ptgs-target", "1"), (rl, "--ptgs-tau", "0.5"), (rl, "--ptgs-gamma", "2"), (rl, "--ptgs-prior", "0"),
    ("ppo", "--gamma", "1.5"), ("ppo", "--lam", "-0.5"), ("ppo", "--value-clip", "0"),
    ("ppo", "--critic-lr-frac", "0"),
])
def test_numeric_flags_out_of_range_are_refused_up_front(capsys, stage, flag, value):
    stage = __import__(stage) if isinstance(stage, str) else stage
    with pytest.raises(SystemExit):
        stage.parse_args(["--preset", "tiny", "--max-tokens", "8", flag, value])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in error and "must be" in error or "longer than" in error, error


@pytest.mark.parametrize("flags", [["--mask-window", "2", "1"], ["--difficulty-filter", "0.9", "0.1"]])
def test_numeric_pairs_out_of_order_are_refused_up_front(capsys, flags):
    with pytest.raises(SystemExit):
        rl.parse_args(["--preset", "tiny", *flags])
    assert flags[0] in capsys.readouterr().err


def test_eval_every_zero_evaluates_only_at_the_start_and_the_end(monkeypatch, tmp_path, checkpoint, capsys):
    run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "2", "--eval-every", "0", "--save-every", "0")
    text = capsys.readouterr().out
    assert "eval step 0" in text and "eval step 1" not in text and "eval step 2" in text
    assert rl.plan(rl.parse_args(["--preset", "small", "--eval-every", "0"]), GPTConfig(
        sequence_len=1024, vocab_size=400, n_layer=2, n_head=2, n_kv_head=2, n_embd=64))

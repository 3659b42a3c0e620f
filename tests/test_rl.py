"""
rl.py: advantages, policy losses, KL estimators, mismatch weights and aggregations against hand-computed values;
the engine's behavior log-probs against the learner's; dynamic sampling; the whole loop in-process and under torchrun.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rl
import rollout
from common import save_checkpoint
from conftest import ends_turn_sometimes, scripted_model
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
# group_advantages


def test_grpo_advantages_mean_and_population_std():
    rewards = torch.tensor([1., 0., 0., 1., 3., 1., 0., 0.])
    # group 1: mean 0.5, population std 0.5; group 2: mean 1, population std sqrt((4 + 0 + 1 + 1) / 4) = sqrt(1.5)
    s = math.sqrt(1.5)
    close(rl.group_advantages(rewards, 4), [1, -1, -1, 1, 2 / s, 0, -1 / s, -1 / s])
    close(rl.group_advantages(rewards, 4, scale="none"), [.5, -.5, -.5, .5, 2, 0, -1, -1])  # Dr. GRPO


def test_rloo_leave_one_out_baseline():
    rewards = torch.tensor([1., 0., 0., 1.])
    # r_0 = 1 against the mean of the others (0 + 0 + 1) / 3; r_1 = 0 against (1 + 0 + 1) / 3
    close(rl.group_advantages(rewards, 4, scale="none", baseline="loo"), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    close(rl.group_advantages(rewards, 4, scale="std", baseline="loo"), [4 / 3, -4 / 3, -4 / 3, 4 / 3])  # / std 0.5


@pytest.mark.parametrize("scale", ["std", "none"])
@pytest.mark.parametrize("baseline", ["mean", "loo"])
def test_all_equal_group_has_zero_advantage(scale, baseline):
    rewards = torch.tensor([1., 1., 1., 0., 0., 0., .5, .5, .5])
    assert rl.group_advantages(rewards, 3, scale=scale, baseline=baseline).abs().max() == 0


def test_group_advantages_validates():
    with pytest.raises(ValueError, match="groups of 4"):
        rl.group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="baseline"):
        rl.group_advantages(torch.zeros(4), 4, baseline="median")


# -----------------------------------------------------------------------------
# aggregate and the three aggregations


def test_aggregations_over_variable_lengths():
    values = torch.tensor([[1., 2., 3.], [4., 9., 9.]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    close(rl.aggregate(values, mask, "token-mean"), (1 + 2 + 3 + 4) / 4)
    close(rl.aggregate(values, mask, "seq-mean-token-mean"), (2 + 4) / 2)
    close(rl.aggregate(values, mask, "seq-mean-token-sum-norm", max_len=4), (6 / 4 + 4 / 4) / 2)
    # the count of the whole optimizer batch replaces this micro-batch's own
    close(rl.aggregate(values, mask, "token-mean", count=8), 10 / 8)
    close(rl.aggregate(values, mask, "seq-mean-token-mean", count=4), 6 / 4)
    with pytest.raises(ValueError, match="max_len"):
        rl.aggregate(values, mask, "seq-mean-token-sum-norm")


def test_micro_batches_with_global_count_sum_to_the_whole_batch():
    torch.manual_seed(0)
    values, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).float()
    for agg, count in [("token-mean", mask.sum()), ("seq-mean-token-mean", 6), ("seq-mean-token-sum-norm", 6)]:
        whole = rl.aggregate(values, mask, agg, max_len=5)
        parts = sum(rl.aggregate(values[i:i + 2], mask[i:i + 2], agg, max_len=5, count=float(count)) for i in (0, 2, 4))
        close(parts, whole)


# -----------------------------------------------------------------------------
# policy_loss


def leaf(values):
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_pg_values_gradients_and_aggregations():
    old = torch.full((2, 3), -1.0)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    advantages = torch.tensor([1.0, -2.0])
    # pg's per-token value is -A; its gradient -A d(logp), scaled by the aggregation
    expected = {"token-mean": (-0.25, [[-.25, -.25, -.25], [.5, 0, 0]]),
                "seq-mean-token-mean": (0.5, [[-1 / 6, -1 / 6, -1 / 6], [1, 0, 0]]),
                "seq-mean-token-sum-norm": (-0.125, [[-1 / 8, -1 / 8, -1 / 8], [.25, 0, 0]])}
    for agg, (value, grad) in expected.items():
        logp = leaf([[-1.2, -0.3, -2.0], [-0.7, -5.0, -5.0]])
        loss, stats = rl.policy_loss(logp, old, advantages, mask, kind="pg", agg=agg, max_len=4)
        loss.backward()
        close(loss, value)
        close(logp.grad, grad)
        assert stats["clip_low"] == stats["clip_high"] == 0


def test_ppo_clip_boundaries_on_both_sides():
    #            A     ratio  -> token loss            gradient wrt logp (times 6 tokens)
    cases = [(+1, 1.5),  # above 1 + eps_high with A > 0: clipped at -1.28, no gradient (clip_high)
             (+1, 1.2),  # inside: -1.2, gradient -1.2
             (-1, 0.5),  # below 1 - eps_low with A < 0: clipped at 0.8, no gradient (clip_low)
             (-1, 0.9),  # inside: 0.9, gradient 0.9
             (+1, 0.5),  # below the low bound but A > 0: the pessimistic side is unclipped: -0.5, gradient -0.5
             (-1, 1.5)]  # above the high bound but A < 0: unclipped: 1.5, gradient 1.5
    advantages = torch.tensor([a for a, _ in cases])
    old = torch.zeros(6, 1)
    logp = leaf([[math.log(r)] for _, r in cases])
    loss, stats = rl.policy_loss(logp, old, advantages, torch.ones(6, 1), kind="ppo", eps_low=0.2, eps_high=0.28)
    loss.backward()
    close(loss, (-1.28 - 1.2 + 0.8 + 0.9 - 0.5 + 1.5) / 6)
    close(logp.grad.squeeze(1), [0, -1.2 / 6, 0, 0.9 / 6, -0.5 / 6, 1.5 / 6])
    close([stats["clip_low"], stats["clip_high"]], [1 / 6, 1 / 6])
    close([stats["ratio_min"], stats["ratio_mean"], stats["ratio_max"]], [0.5, 6.1 / 6, 1.5])


def test_ppo_dual_clip_caps_negative_advantages():
    advantages = torch.tensor([-1.0, -1.0, 1.0])
    logp = leaf([[math.log(4.0)], [math.log(1.5)], [math.log(4.0)]])
    loss, _ = rl.policy_loss(logp, torch.zeros(3, 1), advantages, torch.ones(3, 1), kind="ppo", dual_clip=3.0)
    loss.backward()
    # ratio 4, A = -1: max(4, 1.28) = 4, capped at 3 (no gradient); ratio 1.5 is under 3; A > 0: clipped at -1.28
    close(loss, (3 + 1.5 - 1.28) / 3)
    close(logp.grad.squeeze(1), [0, 1.5 / 3, 0])


@pytest.mark.parametrize("agg", rl.AGGREGATIONS)
def test_ppo_equals_pg_on_policy(agg):
    torch.manual_seed(0)
    logp_pg = (-torch.rand(3, 5) * 3).requires_grad_()
    logp_ppo = logp_pg.detach().clone().requires_grad_()
    advantages = torch.randn(3)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 1, 1, 1, 0]])
    pg, _ = rl.policy_loss(logp_pg, logp_pg.detach(), advantages, mask, kind="pg", agg=agg, max_len=5)
    ppo, stats = rl.policy_loss(logp_ppo, logp_ppo.detach(), advantages, mask, kind="ppo", agg=agg, max_len=5)
    pg.backward()
    ppo.backward()
    close(ppo, pg, atol=1e-6)
    close(logp_ppo.grad, logp_pg.grad, atol=1e-6)
    assert stats["ratio_min"] == stats["ratio_max"] == 1.0


def test_gspo_and_cispo_gradients_differ_from_ppo():
    # One sequence, A = +1, token ratios 1.5 and 0.5 (old log-probs -1); sequence ratio s = exp(mean log r) = sqrt(0.75)
    old = torch.full((1, 2), -1.0)
    logp_values = [[-1 + math.log(1.5), -1 + math.log(0.5)]]
    advantages, mask = torch.tensor([1.0]), torch.ones(1, 2)
    grads = {}
    for kind in ("ppo", "gspo", "cispo"):
        logp = leaf(logp_values)
        loss, stats = rl.policy_loss(logp, old, advantages, mask, kind=kind, eps_low=0.2, eps_high=0.28)
        loss.backward()
        grads[kind] = logp.grad[0].tolist()
        if kind == "gspo":
            close(loss, -math.sqrt(0.75))
            assert stats["clip_high"] == stats["clip_low"] == 0  # s = 0.866 is inside [0.8, 1.28]
        if kind == "cispo":  # -(1.28 logp_0 + 0.8 logp_1) / 2 with the clipped weights detached
            close(loss, -(1.28 * logp_values[0][0] + 0.8 * logp_values[0][1]) / 2)
            assert stats["clip_high"] == stats["clip_low"] == 0.5
    s = math.sqrt(0.75)
    close(grads["ppo"], [0, -0.5 / 2])  # ratio 1.5 is clipped: no gradient; ratio 0.5 with A > 0 is not
    close(grads["gspo"], [-s / 2, -s / 2])  # one ratio for the sequence: every token moves together
    close(grads["cispo"], [-1.28 / 2, -0.8 / 2])  # the clipped token keeps a (clipped) gradient


def test_gspo_clips_whole_sequences():
    logp = leaf([[math.log(2.0), math.log(2.0)], [math.log(1.1), math.log(1.1)]])
    loss, stats = rl.policy_loss(logp, torch.zeros(2, 2), torch.tensor([1.0, 1.0]), torch.ones(2, 2), kind="gspo",
                                 eps_low=0.2, eps_high=0.28)
    loss.backward()
    close(loss, (-1.28 * 2 - 1.1 * 2) / 4)
    close(logp.grad, [[0, 0], [-1.1 / 4, -1.1 / 4]])  # d s / d logp_t = s / |y|, then token-mean over 4 tokens
    assert stats["clip_high"] == 0.5


def test_weights_multiply_token_losses():
    logp = leaf([[-1.0, -1.0]])
    weights = torch.tensor([[2.0, 0.5]])
    loss, _ = rl.policy_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2), kind="ppo", weights=weights)
    loss.backward()
    close(loss, -(2.0 + 0.5) / 2)
    close(logp.grad, [[-1.0, -0.25]])


def test_policy_loss_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        rl.policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), kind="trpo")


# -----------------------------------------------------------------------------
# KL, mismatch weights, overlong penalty


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])  # d = log 2
    d = math.log(2)
    close(rl.kl_penalty(logp, ref, "k1"), [d])
    close(rl.kl_penalty(logp, ref, "k2"), [d * d / 2])
    close(rl.kl_penalty(logp, ref, "k3"), [0.5 - 1 + d])
    close(rl.kl_penalty(ref, logp, "k3"), [2 - 1 - d])  # k3 >= 0 on both sides
    close(rl.kl_penalty(logp, logp, "k3"), [0.0])


def test_k2_gradient_is_the_kl_gradient_and_k3_is_not():
    # Exact expectation over a 4-token categorical: sum_x pi(x) grad k(x) against grad KL(pi || pi_ref).
    torch.manual_seed(0)
    theta, ref = torch.randn(4, requires_grad=True), torch.randn(4).log_softmax(0)
    logp = theta.log_softmax(0)
    (kl_grad,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    for kind, matches in (("k2", True), ("k3", False)):
        logp = theta.log_softmax(0)
        (grad,) = torch.autograd.grad((logp.exp().detach() * rl.kl_penalty(logp, ref, kind)).sum(), theta)
        assert torch.allclose(grad, kl_grad, atol=1e-6) == matches


def test_mismatch_weights():
    trainer, engine = torch.tensor([0.5, 0.3, 0.1]).log(), torch.tensor([0.1, 0.3, 0.5]).log()  # rho = 5, 1, 0.2
    close(rl.mismatch_weights(trainer, engine, "tis", cap=2.0), [2.0, 1.0, 0.2])
    close(rl.mismatch_weights(trainer, engine, "mask", window=(0.5, 2.0)), [0, 1, 0])
    close(rl.mismatch_weights(trainer, engine, "none"), [1, 1, 1])


def test_overlong_penalty():
    # budget 10, buffer 4: free up to 6 tokens, then linearly down to -1 at 10
    close(rl.overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), 10, 4), [0, 0, -0.25, -0.5, -1])


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
    close(rl.group_advantages(torch.tensor([1.0] * 7 + [1 - 1 / 64]), 8), [0.378] * 7 + [-2.6457], atol=1e-3)


@pytest.mark.parametrize("kind", rl.LOSS_KINDS)
@pytest.mark.parametrize("advantage", [1.0, -1.0])
@pytest.mark.parametrize("mismatch", ["none", "tis", "mask"])
def test_policy_loss_finite_at_extreme_ratios(kind, advantage, mismatch):
    # old log-prob at the floor, new one at -2: log-ratio 98, exp(98) overflows float32
    logp = leaf([[-2.0], [-1.0]])
    old = torch.tensor([[rollout.LOGP_FLOOR], [-1.0]])
    weights = rl.mismatch_weights(logp, old, mismatch)
    assert torch.isfinite(weights).all()
    loss, stats = rl.policy_loss(logp, old, torch.tensor([advantage, advantage]), torch.ones(2, 1), kind=kind,
                                 weights=weights, dual_clip=3.0 if kind in ("ppo", "gspo") else None)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), (loss, logp.grad)
    assert stats["ratio_max"] <= math.exp(rollout.LOG_RATIO_CLAMP) * (1 + 1e-5)


def test_kl_reference_untruncated(monkeypatch, tmp_path, checkpoint):
    # --top-k 20 truncates what the engine samples from; the KL compares the untruncated temperature-scaled
    # distributions (a token outside the reference's top-20 would otherwise get ref_logp = LOGP_FLOOR, k2 ~ 5e3).
    scored, compared = [], []
    token_logprobs, kl_penalty = rollout.token_logprobs, rl.kl_penalty

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
    close(rl.group_advantages(rewards, 4, valid=valid.bool()), [1 / 3 / s, -2 / 3 / s, 0, 1 / 3 / s, 0, 0, 0, 0])
    close(rl.group_advantages(rewards, 4, scale="none", baseline="loo", valid=valid.bool()),
          [1 / 2, -1, 0, 1 / 2, 0, 0, 0, 0])  # loo: against the mean of the other valid members
    # learner_rows: an errored completion is not trained on, and its group's baseline is the others'
    engine = Engine(model, tokenizer)
    prompt = tokenizer.render_for_completion(SyntheticTask("train", size=1)[0])
    (completions,) = engine.generate([prompt], num_samples=4, max_tokens=6, seed=0)
    group = {"prompt": prompt, "completions": completions, "rewards": [1.0, 0.0, 0.0, 1.0],
             "errors": [False, False, True, False]}
    rows = rollout.learner_rows([group], 4, "std", "mean", mask_truncated=False)
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


def test_dual_clip_must_exceed_one_and_is_counted_as_clipped():
    for c in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual"):
            rl.parse_args(["--dual-clip", str(c)])
        with pytest.raises(ValueError, match="dual_clip"):
            rl.policy_loss(leaf([[0.0]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), dual_clip=c)
    # ratio 4 with A < 0 under dual clip 3: the loss is the constant 3, no gradient: a clipped token
    logp = leaf([[math.log(4.0)], [math.log(1.5)]])
    _, stats = rl.policy_loss(logp, torch.zeros(2, 1), torch.tensor([-1.0, -1.0]), torch.ones(2, 1), dual_clip=3.0)
    assert stats["clip_high"] == 0.5 and stats["clip_low"] == 0.0


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

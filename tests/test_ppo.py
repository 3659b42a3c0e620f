"""
ppo.py, PPO with a critic, and RL from a reward model: per-token rewards (KL placement), GAE against the
hand-computed table, the clipped value loss on both sides, explained variance, score normalisation; ppo.py's loop and
rl.py's with --reward rm in-process on a real tiny model, tokenizer and engine.
"""

import copy
import json
import math
import os

import pytest
import torch

import objectives
import ppo
import rl
import rollout
from common import save_checkpoint
from engine import load_model
from model import ScalarHeadModel
from test_rl import LengthParity, checkpoint, model, run_rl, tokenizer, torchrun  # noqa: F401 (fixtures)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# -----------------------------------------------------------------------------
# GAE


def test_gae_reproduces_the_seed_table():
    rewards = torch.tensor([[0., 0., 0., 0., 1.]])
    values = torch.tensor([[0.50, 0.55, 0.60, 0.70, 0.80]])  # then 0: the episode ends after the last token
    advantages, returns = ppo.gae(rewards, values, torch.ones(1, 5), gamma=1.0, lam=0.95)
    close(advantages, [[0.436389, 0.406725, 0.375500, 0.290000, 0.200000]])
    close(returns, advantages + values)


def test_gae_with_gamma_lambda_one_and_zero_values_is_the_reward_to_go():
    rewards = torch.tensor([[0.5, -1.0, 2.0, 0.25], [1.0, 0.0, 0.0, 3.0]])
    advantages, returns = ppo.gae(rewards, torch.zeros(2, 4), torch.ones(2, 4), gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(1).cumsum(1).flip(1)
    close(advantages, reward_to_go)
    close(returns, reward_to_go)


def test_gae_skips_masked_tokens_and_bootstraps_across_them():
    # prompt (mask 0), two actions, a forced tool output of two tokens (mask 0), two actions, padding (mask 0)
    mask = torch.tensor([[0., 1., 1., 0., 0., 1., 1., 0.]])
    rewards = torch.tensor([[9., 0., 0.3, 9., 9., -0.2, 1.0, 9.]])  # rewards on mask-0 positions are ignored
    values = torch.tensor([[7., 0.1, 0.2, 7., 7., 0.4, 0.5, 7.]])
    advantages, returns = ppo.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # the same episode with the non-actions removed
    compact_adv, compact_ret = ppo.gae(torch.tensor([[0., 0.3, -0.2, 1.0]]), torch.tensor([[0.1, 0.2, 0.4, 0.5]]),
                                      torch.ones(1, 4), gamma=0.9, lam=0.8)
    close(advantages[mask > 0], compact_adv.flatten())
    close(returns[mask > 0], compact_ret.flatten())
    assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()


# -----------------------------------------------------------------------------
# Per-token rewards: the KL on every valid token, the score on the last


def test_token_rewards_put_kl_everywhere_and_the_score_on_the_last_valid_token():
    mask = torch.tensor([[0., 1., 1., 0., 1., 0.],    # prompt, action, action, tool output, <|assistant_end|>, pad
                         [0., 0., 1., 1., 0., 0.],    # shorter row, padded
                         [0., 0., 0., 0., 0., 0.]])   # nothing to train (e.g. masked as truncated)
    kl = torch.tensor([[5., .1, .2, 5., .3, 5.], [5., 5., .4, .5, 5., 5.], [1., 1., 1., 1., 1., 1.]])
    rewards = ppo.token_rewards(torch.tensor([2., -1., 7.]), kl, mask, kl_coef=0.5)
    close(rewards, [[0, -.05, -.1, 0, -.15 + 2, 0], [0, 0, -.2, -.25 - 1, 0, 0], [0, 0, 0, 0, 0, 0]])


# -----------------------------------------------------------------------------
# The clipped value loss


def test_value_loss_clips_on_both_sides():
    old = torch.zeros(1, 4)
    values = torch.tensor([[0.5, -0.5, 0.5, -0.5]], requires_grad=True)
    returns = torch.tensor([[1.0, -1.0, 0.0, 0.0]])
    mask = torch.ones(1, 4)
    loss, clip_frac = ppo.value_loss(values, old, returns, mask, clip_eps=0.2)
    # tokens 0, 1: V moved 0.5 towards R, beyond the 0.2 clip: the clipped error (0.8^2) is the larger -> 0.32 each,
    # and no gradient. Tokens 2, 3: V moved away from R; the unclipped error 0.25 is the larger -> 0.125, gradient V-R.
    assert loss.item() == pytest.approx((0.32 + 0.32 + 0.125 + 0.125) / 4)
    assert clip_frac == 0.5
    loss.backward()
    close(values.grad, [[0.0, 0.0, 0.5 / 4, -0.5 / 4]])


def test_value_loss_ignores_masked_tokens_and_uses_the_given_count():
    values, old, returns = torch.tensor([[1.0, 5.0]]), torch.tensor([[1.0, 5.0]]), torch.tensor([[0.0, 0.0]])
    loss, _ = ppo.value_loss(values, old, returns, torch.tensor([[1.0, 0.0]]), count=4)
    assert loss.item() == pytest.approx(0.5 * 1.0 / 4)


def test_explained_variance():
    returns, ones = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.ones(4)
    assert ppo.explained_variance([(returns, returns, ones)], "cpu") == pytest.approx(1.0)
    assert ppo.explained_variance([(torch.full((4,), 2.5), returns, ones)], "cpu") == pytest.approx(0.0)
    # constant returns: undefined (the variance ratio would divide by ~0), not -1e7
    assert math.isnan(ppo.explained_variance([(torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.full((4,), 2.0), ones)],
                                             "cpu"))


def test_whitening_uses_the_valid_tokens_of_every_micro_batch():
    # mean 2, population std 1 over the four valid entries 1, 1, 3, 3 of two micro-batches; masked entries are 0
    a, b = torch.tensor([[1.0, 3.0, 99.0]]), torch.tensor([[1.0, 3.0]])
    ma, mb = torch.tensor([[1.0, 1.0, 0.0]]), torch.ones(1, 2)
    moments = rollout.global_moments([(a, ma), (b, mb)], "cpu")
    assert moments == pytest.approx((4, 2.0, 1.0))
    close(objectives.whiten(a, ma, moments), [[-1.0, 1.0, 0.0]])
    assert rollout.global_moments([], "cpu") == (0, 0.0, 0.0)  # a rank that kept no group


def normalize(scores):
    """--reward rm's scores z-scored over every rank, as rl_systems.Rollouts does."""
    return objectives.normalize_scores(scores, rollout.global_moments([(scores, torch.ones_like(scores))], "cpu"))


def _two_rank_moments(rank, init_file, results):
    """One of two gloo ranks: rank 0 holds all the data, rank 1 none (a rank that kept no group)."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    advantages = torch.tensor([[1.0, 3.0, 7.0], [0.5, 2.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    scores = torch.tensor([3.0, 5.0, 7.0, 9.0])
    if rank == 0:  # the advantages of row 0 and the scores 3, 5
        pairs, mine = [(advantages[:1], mask[:1])], scores[:2]
    else:  # row 1 with a mask of zeros only, then the scores 7, 9
        pairs, mine = [(advantages[1:], torch.zeros(1, 3)), (advantages[1:], mask[1:])], scores[2:]
    moments = rollout.global_moments(pairs, "cpu")
    whitened = [objectives.whiten(v, m, moments) for v, m in pairs]
    # plain lists: a tensor would travel as shared memory that dies with this process
    results.put((rank, moments, [w.tolist() for w in whitened], normalize(mine).tolist()))
    torch.distributed.destroy_process_group()


def test_whitening_and_score_normalisation_are_the_same_on_one_process_and_two_ranks(tmp_path):
    # The moments are all-reduced: 2 gloo ranks (one of them with a zero-token micro-batch) give what one process
    # gives on the whole batch, and no NaN where a rank has nothing valid.
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_two_rank_moments, args=(rank, str(tmp_path / "init"), results))
                 for rank in range(2)]
    for p in processes:
        p.start()
    got = dict((r[0], r[1:]) for r in (results.get(timeout=120) for _ in processes))
    for p in processes:
        p.join(timeout=60)
    advantages = torch.tensor([[1.0, 3.0, 7.0], [0.5, 2.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    moments = rollout.global_moments([(advantages, mask)], "cpu")
    whole = objectives.whiten(advantages, mask, moments)
    assert got[0][0] == pytest.approx(moments) and got[1][0] == pytest.approx(moments)
    close(got[0][1][0], whole[:1])
    close(got[1][1][0], torch.zeros(1, 3))
    close(got[1][1][1], whole[1:])
    close(got[0][2] + got[1][2], normalize(torch.tensor([3.0, 5.0, 7.0, 9.0])))


# -----------------------------------------------------------------------------
# The loop: PPO with a critic; RL from a reward model


def test_main_ppo_with_gae_trains_policy_and_critic_and_resumes(monkeypatch, tmp_path, checkpoint, capsys):
    out = run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "2", "--kl-coef", "0.1", "--save-every", "1",
                 "--eval-every", "2", "--epochs", "2", stage=ppo)
    text = capsys.readouterr().out
    assert "value loss" in text and "expl var" in text and "step 2/2" in text
    report = json.loads((tmp_path / "home" / "report.jsonl").read_text().splitlines()[-1])
    assert report["stage"] == "ppo"
    final, _, _ = load_model(out, "cpu")
    _, _, extra = ppo.load_checkpoint(out)
    critic = extra["critic"]
    assert critic["head.weight"].abs().sum() > 0  # the zero-initialised head was trained
    initial, _, _ = load_model(checkpoint, "cpu")
    assert any(not torch.equal(a, b) for a, b in zip(final.state_dict().values(), initial.state_dict().values()))
    # interrupted after step 1: the critic comes back with the policy, the result is the same
    (out / "latest").write_text("step_000001")
    run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "2", "--kl-coef", "0.1", "--save-every", "1",
           "--eval-every", "2", "--epochs", "2", "--resume", stage=ppo)
    resumed, _, _ = load_model(out, "cpu")
    for a, b in zip(resumed.state_dict().values(), final.state_dict().values()):
        torch.testing.assert_close(a, b)
    # the curves come back too: the resumed run's record has step 1's points, logged before the interruption
    first, again = [json.loads(line) for line in (tmp_path / "home" / "report.jsonl").read_text().splitlines()[-2:]]
    steps = [{name: group["step"] for group in record["curves"] for name in group if name != "step"}
             for record in (first, again)]
    assert steps[0] == steps[1] and steps[1]["critic/value_loss"] == [1, 2] and steps[1]["eval/pass@1"] == [0, 2]


def test_ppo_counts_each_sources_loss_mass_from_the_gae_advantages_it_trains_on(monkeypatch, tmp_path, checkpoint):
    trained = []  # sum over valid tokens of |A_t| of every policy-loss call: the mass the update really carries
    policy_loss = ppo.policy_loss

    def spy(logp, old_logp, advantages, mask, **kwargs):
        trained.append(float((advantages.abs() * mask).sum()))
        return policy_loss(logp, old_logp, advantages, mask, **kwargs)

    monkeypatch.setattr(ppo, "policy_loss", spy)
    run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "1", "--eval-every", "1", stage=ppo)
    sources = json.loads((tmp_path / "home" / "report.jsonl").read_text().splitlines()[-1])["sources"]
    assert trained and sources["synthetic/loss_mass"] == pytest.approx(sum(trained), rel=1e-5)


@pytest.fixture(scope="module")
def reward_model_checkpoint(tmp_path_factory, model, tokenizer):
    """A 'reward model' that scores the policy's own trunk with a random head: enough to drive the loop."""
    torch.manual_seed(1)
    rm = ScalarHeadModel(model)
    torch.nn.init.normal_(rm.head.weight, std=1.0)
    path = tmp_path_factory.mktemp("rm") / "rm"
    save_checkpoint(path, 0, rm, {"stage": "rm", "reward_model": True}, tokenizer=tokenizer)
    return path


@pytest.mark.parametrize("stage", [rl, ppo])
def test_main_from_a_reward_model_logs_score_and_verifier_side_by_side(monkeypatch, tmp_path, checkpoint, capsys,
                                                                       reward_model_checkpoint, stage):
    run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "1", "--eval-every", "1", "--reward", "rm",
           "--rm-ckpt", str(reward_model_checkpoint), stage=stage)
    text = capsys.readouterr().out
    assert "rm score" in text and "verifier acc" in text and "reward-model score" in text
    assert "KL 0.05" in text  # the KL leash is on by default with a learned reward
    report = json.loads((tmp_path / "home" / "report.jsonl").read_text().splitlines()[-1])
    assert report["stage"] == "rlhf" and {"rm_score", "rm_score_before", "pass@1", "pass@1_before"} <= report.keys()


def test_reward_model_flags_are_checked(monkeypatch, tmp_path, checkpoint, reward_model_checkpoint):
    with pytest.raises(SystemExit):  # --reward rm without a reward model
        run_rl(monkeypatch, tmp_path, checkpoint, "--reward", "rm")
    with pytest.raises(SystemExit):  # KL in the reward needs per-token rewards: ppo.py's flag, not rl.py's
        run_rl(monkeypatch, tmp_path, checkpoint, "--kl-placement", "reward")
    with pytest.raises(ValueError, match="not a reward model"):  # a policy checkpoint is not a reward model
        run_rl(monkeypatch, tmp_path, checkpoint, "--reward", "rm", "--rm-ckpt", str(checkpoint), "--num-steps", "1")


def test_critic_starts_from_the_reward_model_and_warms_up_alone(monkeypatch, tmp_path, checkpoint, capsys,
                                                                reward_model_checkpoint):
    out = run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "1", "--eval-every", "1", "--reward", "rm",
                 "--rm-ckpt", str(reward_model_checkpoint), "--critic-warmup-steps", "1", stage=ppo)
    assert "critic explained variance by step" in capsys.readouterr().out
    final, _, _ = load_model(out, "cpu")
    initial, _, _ = load_model(checkpoint, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(final.state_dict().values(), initial.state_dict().values()))
    critic = ppo.load_checkpoint(out)[2]["critic"]
    rm_head = load_model(reward_model_checkpoint, "cpu")[0].head.weight
    moved = (critic["head.weight"] - rm_head).norm() / rm_head.norm()
    assert 0 < moved < 0.2  # the reward model's head, one critic step later (a zero-started head would be ~100%)


def test_scalar_head_learning_rate_multiplier(model):
    adamw, _ = ScalarHeadModel(copy.deepcopy(model)).setup_optimizers(0.02, 0.2, 0.004, head_lr_mult=10.0)
    assert adamw.param_groups[-1]["lr"] == pytest.approx(10 * adamw.param_groups[0]["lr"])
    assert adamw.param_groups[-1]["initial_lr"] == adamw.param_groups[-1]["lr"]
    assert ppo.parse_args([]).critic_head_lr_mult == 1.0 and ppo.parse_args([]).critic_warmup_steps == 0


class NeverRight(LengthParity):
    """Every answer scores 0: every group lacks contrast, and dynamic sampling keeps none."""

    def reward(self, conversation, completion):
        return 0.0


def test_ppo_step_with_no_kept_group_trains_nothing_and_goes_on(monkeypatch, tmp_path, checkpoint, capsys):
    out = run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "1", "--eval-every", "1",
                 "--max-sampling-rounds", "1", task=NeverRight, stage=ppo)
    text = capsys.readouterr().out
    assert "kept 0" in text and "expl var n/a" in text and "step 1/1" in text
    final, _, _ = load_model(out, "cpu")
    initial, _, _ = load_model(checkpoint, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(final.state_dict().values(), initial.state_dict().values()))


class BrokenOnRankOne(LengthParity):
    """The verifier fails on every answer of rank 1: with --mask-truncated that rank keeps no valid token."""

    def reward(self, conversation, completion):
        if os.environ.get("RANK") == "1":
            raise RuntimeError("verifier down on this rank")
        return super().reward(conversation, completion)


@pytest.mark.slow
def test_torchrun_ppo_with_a_rank_without_valid_tokens_stays_finite_and_identical(tmp_path, checkpoint):
    # Without global whitening rank 1's advantages were (x - NaN) / NaN, and the gradient all-reduce spread the NaN.
    torchrun(tmp_path, checkpoint, "--num-steps", "1", "--no-filter-zero-contrast", "--mask-truncated", stage="ppo",
             task="test_ppo.BrokenOnRankOne")
    assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text()
    final, _, _ = load_model(tmp_path / "rl", "cpu")
    assert all(torch.isfinite(p).all() for p in final.state_dict().values())


def test_rl_from_a_reward_model_does_not_scale_near_ties_to_full_size_advantages():
    # A group scored 1.499-1.502: std scaling makes it +-1.34, as large as a real contrast; Dr. GRPO keeps it tiny.
    scores = torch.tensor([1.499, 1.500, 1.501, 1.502])
    close(objectives.group_advantages(scores, 4, scale="std"), [-1.3416, -0.4472, 0.4472, 1.3416], atol=2e-3)
    args = rl.parse_args(["--preset", "tiny", "--reward", "rm", "--rm-ckpt", "x"])
    assert args.adv_scale == "none" and rl.parse_args(["--preset", "tiny"]).adv_scale == "std"
    close(objectives.group_advantages(scores, 4, scale=args.adv_scale), [-0.0015, -0.0005, 0.0005, 0.0015], atol=1e-5)


def test_scalar_head_scores_in_float32_under_bf16_autocast(model, tokenizer):
    # The reward model's and the critic's head: under autocast a bf16 head rounds scores to ~3 significant digits.
    torch.manual_seed(0)
    head = ScalarHeadModel(model)
    torch.nn.init.normal_(head.head.weight, std=1.0)
    torch.nn.init.normal_(head.head.bias, std=1.0)
    idx = torch.tensor([tokenizer.encode("What is 12 + 30? Answer briefly.")])
    with torch.no_grad(), torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        scores, hidden = head(idx), head.gpt.hidden(idx)
    expected = hidden.float() @ head.head.weight[0] + head.head.bias
    assert scores.dtype == torch.float32
    close(scores, expected, atol=1e-5)

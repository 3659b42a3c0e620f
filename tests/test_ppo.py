"""
ppo.py, PPO with a critic, and RL from a reward model: per-token rewards (KL placement), GAE against the
hand-computed table, the clipped value loss on both sides, explained variance, score normalisation; ppo.py's loop and
rl.py's with --reward rm in-process on a real tiny model, tokenizer and engine.
"""

import json

import pytest
import torch

import ppo
import rl
from common import save_checkpoint
from engine import load_model
from model import ScalarHeadModel
from test_rl import LengthParity, checkpoint, model, run_rl, tokenizer  # noqa: F401 (fixtures)


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


def test_explained_variance_and_score_normalisation():
    returns = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert ppo.explained_variance(returns, returns, torch.ones(4)) == pytest.approx(1.0)
    assert ppo.explained_variance(torch.full((4,), 2.5), returns, torch.ones(4)) == pytest.approx(0.0)
    z = rl.normalize_scores(torch.tensor([3.0, 5.0, 7.0, 9.0]))
    close(z, torch.tensor([-3.0, -1.0, 1.0, 3.0]) / 5 ** 0.5)


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

"""
objectives.py: advantages, policy losses, KL estimators, mismatch weights, aggregations, whitening and score
normalisation against hand-computed values.
"""

import math

import pytest
import torch

import objectives as obj
from rollout import LOGP_FLOOR


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# -----------------------------------------------------------------------------
# group_advantages


def test_grpo_advantages_mean_and_population_std():
    rewards = torch.tensor([1., 0., 0., 1., 3., 1., 0., 0.])
    # group 1: mean 0.5, population std 0.5; group 2: mean 1, population std sqrt((4 + 0 + 1 + 1) / 4) = sqrt(1.5)
    s = math.sqrt(1.5)
    close(obj.group_advantages(rewards, 4), [1, -1, -1, 1, 2 / s, 0, -1 / s, -1 / s])
    close(obj.group_advantages(rewards, 4, scale="none"), [.5, -.5, -.5, .5, 2, 0, -1, -1])  # Dr. GRPO


def test_rloo_leave_one_out_baseline():
    rewards = torch.tensor([1., 0., 0., 1.])
    # r_0 = 1 against the mean of the others (0 + 0 + 1) / 3; r_1 = 0 against (1 + 0 + 1) / 3
    close(obj.group_advantages(rewards, 4, scale="none", baseline="loo"), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    close(obj.group_advantages(rewards, 4, scale="std", baseline="loo"), [4 / 3, -4 / 3, -4 / 3, 4 / 3])  # / std 0.5


@pytest.mark.parametrize("scale", ["std", "none"])
@pytest.mark.parametrize("baseline", ["mean", "loo"])
def test_all_equal_group_has_zero_advantage(scale, baseline):
    rewards = torch.tensor([1., 1., 1., 0., 0., 0., .5, .5, .5])
    assert obj.group_advantages(rewards, 3, scale=scale, baseline=baseline).abs().max() == 0


def test_group_advantages_validates():
    with pytest.raises(ValueError, match="groups of 4"):
        obj.group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="baseline"):
        obj.group_advantages(torch.zeros(4), 4, baseline="median")


# -----------------------------------------------------------------------------
# aggregate and the three aggregations


def test_aggregations_over_variable_lengths():
    values = torch.tensor([[1., 2., 3.], [4., 9., 9.]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    close(obj.aggregate(values, mask, "token-mean"), (1 + 2 + 3 + 4) / 4)
    close(obj.aggregate(values, mask, "seq-mean-token-mean"), (2 + 4) / 2)
    close(obj.aggregate(values, mask, "seq-mean-token-sum-norm", max_len=4), (6 / 4 + 4 / 4) / 2)
    # the count of the whole optimizer batch replaces this micro-batch's own
    close(obj.aggregate(values, mask, "token-mean", count=8), 10 / 8)
    close(obj.aggregate(values, mask, "seq-mean-token-mean", count=4), 6 / 4)
    with pytest.raises(ValueError, match="max_len"):
        obj.aggregate(values, mask, "seq-mean-token-sum-norm")


def test_micro_batches_with_global_count_sum_to_the_whole_batch():
    torch.manual_seed(0)
    values, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).float()
    for agg, count in [("token-mean", mask.sum()), ("seq-mean-token-mean", 6), ("seq-mean-token-sum-norm", 6)]:
        whole = obj.aggregate(values, mask, agg, max_len=5)
        parts = sum(obj.aggregate(values[i:i + 2], mask[i:i + 2], agg, max_len=5, count=float(count))
                    for i in (0, 2, 4))
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
        loss, stats = obj.policy_loss(logp, old, advantages, mask, kind="pg", agg=agg, max_len=4)
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
    loss, stats = obj.policy_loss(logp, old, advantages, torch.ones(6, 1), kind="ppo", eps_low=0.2, eps_high=0.28)
    loss.backward()
    close(loss, (-1.28 - 1.2 + 0.8 + 0.9 - 0.5 + 1.5) / 6)
    close(logp.grad.squeeze(1), [0, -1.2 / 6, 0, 0.9 / 6, -0.5 / 6, 1.5 / 6])
    close([stats["clip_low"], stats["clip_high"]], [1 / 6, 1 / 6])
    close([stats["ratio_min"], stats["ratio_mean"], stats["ratio_max"]], [0.5, 6.1 / 6, 1.5])


def test_ppo_dual_clip_caps_negative_advantages():
    advantages = torch.tensor([-1.0, -1.0, 1.0])
    logp = leaf([[math.log(4.0)], [math.log(1.5)], [math.log(4.0)]])
    loss, _ = obj.policy_loss(logp, torch.zeros(3, 1), advantages, torch.ones(3, 1), kind="ppo", dual_clip=3.0)
    loss.backward()
    # ratio 4, A = -1: max(4, 1.28) = 4, capped at 3 (no gradient); ratio 1.5 is under 3; A > 0: clipped at -1.28
    close(loss, (3 + 1.5 - 1.28) / 3)
    close(logp.grad.squeeze(1), [0, 1.5 / 3, 0])


@pytest.mark.parametrize("agg", obj.AGGREGATIONS)
def test_ppo_equals_pg_on_policy(agg):
    torch.manual_seed(0)
    logp_pg = (-torch.rand(3, 5) * 3).requires_grad_()
    logp_ppo = logp_pg.detach().clone().requires_grad_()
    advantages = torch.randn(3)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 1, 1, 1, 0]])
    pg, _ = obj.policy_loss(logp_pg, logp_pg.detach(), advantages, mask, kind="pg", agg=agg, max_len=5)
    ppo, stats = obj.policy_loss(logp_ppo, logp_ppo.detach(), advantages, mask, kind="ppo", agg=agg, max_len=5)
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
        loss, stats = obj.policy_loss(logp, old, advantages, mask, kind=kind, eps_low=0.2, eps_high=0.28)
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
    loss, stats = obj.policy_loss(logp, torch.zeros(2, 2), torch.tensor([1.0, 1.0]), torch.ones(2, 2), kind="gspo",
                                 eps_low=0.2, eps_high=0.28)
    loss.backward()
    close(loss, (-1.28 * 2 - 1.1 * 2) / 4)
    close(logp.grad, [[0, 0], [-1.1 / 4, -1.1 / 4]])  # d s / d logp_t = s / |y|, then token-mean over 4 tokens
    assert stats["clip_high"] == 0.5


def test_weights_multiply_token_losses():
    logp = leaf([[-1.0, -1.0]])
    weights = torch.tensor([[2.0, 0.5]])
    loss, _ = obj.policy_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2), kind="ppo", weights=weights)
    loss.backward()
    close(loss, -(2.0 + 0.5) / 2)
    close(logp.grad, [[-1.0, -0.25]])


def test_policy_loss_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        obj.policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), kind="trpo")


# -----------------------------------------------------------------------------
# KL, mismatch weights, overlong penalty


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])  # d = log 2
    d = math.log(2)
    close(obj.kl_penalty(logp, ref, "k1"), [d])
    close(obj.kl_penalty(logp, ref, "k2"), [d * d / 2])
    close(obj.kl_penalty(logp, ref, "k3"), [0.5 - 1 + d])
    close(obj.kl_penalty(ref, logp, "k3"), [2 - 1 - d])  # k3 >= 0 on both sides
    close(obj.kl_penalty(logp, logp, "k3"), [0.0])


def test_k2_gradient_is_the_kl_gradient_and_k3_is_not():
    # Exact expectation over a 4-token categorical: sum_x pi(x) grad k(x) against grad KL(pi || pi_ref).
    torch.manual_seed(0)
    theta, ref = torch.randn(4, requires_grad=True), torch.randn(4).log_softmax(0)
    logp = theta.log_softmax(0)
    (kl_grad,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    for kind, matches in (("k2", True), ("k3", False)):
        logp = theta.log_softmax(0)
        (grad,) = torch.autograd.grad((logp.exp().detach() * obj.kl_penalty(logp, ref, kind)).sum(), theta)
        assert torch.allclose(grad, kl_grad, atol=1e-6) == matches


def test_mismatch_weights():
    trainer, engine = torch.tensor([0.5, 0.3, 0.1]).log(), torch.tensor([0.1, 0.3, 0.5]).log()  # rho = 5, 1, 0.2
    close(obj.mismatch_weights(trainer, engine, "tis", cap=2.0), [2.0, 1.0, 0.2])
    close(obj.mismatch_weights(trainer, engine, "mask", window=(0.5, 2.0)), [0, 1, 0])
    close(obj.mismatch_weights(trainer, engine, "none"), [1, 1, 1])


def test_overlong_penalty():
    # budget 10, buffer 4: free up to 6 tokens, then linearly down to -1 at 10
    close(obj.overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), 10, 4), [0, 0, -0.25, -0.5, -1])


@pytest.mark.parametrize("kind", obj.LOSS_KINDS)
@pytest.mark.parametrize("advantage", [1.0, -1.0])
@pytest.mark.parametrize("mismatch", ["none", "tis", "mask"])
def test_policy_loss_finite_at_extreme_ratios(kind, advantage, mismatch):
    # old log-prob at the floor, new one at -2: log-ratio 98, exp(98) overflows float32
    logp = leaf([[-2.0], [-1.0]])
    old = torch.tensor([[LOGP_FLOOR], [-1.0]])
    weights = obj.mismatch_weights(logp, old, mismatch)
    assert torch.isfinite(weights).all()
    loss, stats = obj.policy_loss(logp, old, torch.tensor([advantage, advantage]), torch.ones(2, 1), kind=kind,
                                 weights=weights, dual_clip=3.0 if kind in ("ppo", "gspo") else None)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), (loss, logp.grad)
    assert stats["ratio_max"] <= math.exp(obj.LOG_RATIO_CLAMP) * (1 + 1e-5)


def test_dual_clip_must_exceed_one_and_is_counted_as_clipped():
    for c in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual_clip"):
            obj.policy_loss(leaf([[0.0]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), dual_clip=c)
    # ratio 4 with A < 0 under dual clip 3: the loss is the constant 3, no gradient: a clipped token
    logp = leaf([[math.log(4.0)], [math.log(1.5)]])
    _, stats = obj.policy_loss(logp, torch.zeros(2, 1), torch.tensor([-1.0, -1.0]), torch.ones(2, 1), dual_clip=3.0)
    assert stats["clip_high"] == 0.5 and stats["clip_low"] == 0.0


def test_whiten_and_normalize_scores_use_the_moments_passed_in():
    # mean 2, population std 1 over the four valid entries 1, 1, 3, 3; masked entries are 0
    close(obj.whiten(torch.tensor([[1.0, 3.0, 99.0]]), torch.tensor([[1.0, 1.0, 0.0]]), (4, 2.0, 1.0)),
          [[-1.0, 1.0, 0.0]])
    # scores 3, 5, 7, 9: mean 6, population variance 5
    close(obj.normalize_scores(torch.tensor([3.0, 5.0, 7.0, 9.0]), (4, 6.0, 5.0)),
          torch.tensor([-3.0, -1.0, 1.0, 3.0]) / 5 ** 0.5)

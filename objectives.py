"""
The objective of the RL stages, pure math (verl's core_algos.py is the model): one function per mathematical object,
variants as a kind= switch, each with its equation and paper. No flags, no printing, no I/O; cross-rank moments are
passed in (rollout.global_moments computes them), so a fork can import this file or copy it.

    group_advantages    GRPO / Dr. GRPO / RLOO advantages of a prompt's group of completions
    overlong_penalty    DAPO's soft overlong punishment, added to the reward
    aggregate           verl's loss_agg_mode: token-mean (DAPO), seq-mean-token-mean (GRPO), -token-sum-norm (Dr. GRPO)
    policy_loss         pg (REINFORCE) / ppo (clip-higher, dual-clip) / gspo / cispo
    kl_penalty          Schulman's k1 / k2 / k3 estimators of KL(pi || pi_ref)
    mismatch_weights    truncated importance sampling / masking of the engine/trainer gap
    whiten              PPO's advantage whitening
    normalize_scores    per-batch z-scores of reward-model scores
"""

import math

import torch

LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| and |log pi_trainer/pi_engine| are clamped here before exp(), as in verl:
# with log-probs floored at -100, exp(98) overflows float32 to inf, and inf * 0 (a clipped branch) is a NaN gradient


def group_advantages(rewards, group_size, scale="std", baseline="mean", eps=1e-6, valid=None):
    """
    Advantages of rewards (N,) laid out as N / group_size consecutive groups of completions of one prompt:

        baseline "mean" (GRPO):  b_i = mean_j r_j
        baseline "loo"  (RLOO):  b_i = (sum_j r_j - r_i) / (G - 1)       leave-one-out: b_i is independent of r_i
        A_i = r_i - b_i,   then with scale "std" (GRPO):  A_i / (std_j r_j + eps)   (population std of the group)
                                     scale "none" (Dr. GRPO): A_i unchanged

    valid (N,) bool, optional: the completions that have a reward at all (False: the verifier failed on it, and an
    error is not a wrong answer). The sums, means and std above then run over a group's n valid members only (G = n),
    an invalid completion gets A = 0, and a group with fewer than 2 valid members gets A = 0 throughout.
    A group whose (valid) rewards are all equal gets A = 0 under every option. Returns (N,).
    """
    if baseline not in ("mean", "loo"):
        raise ValueError(f"unknown baseline {baseline!r}; expected 'mean' or 'loo'")
    if scale not in ("std", "none"):
        raise ValueError(f"unknown scale {scale!r}; expected 'std' or 'none'")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size} (need group_size >= 2)")
    r = rewards.float().view(-1, group_size)  # (groups, G)
    v = torch.ones_like(r) if valid is None else valid.view(-1, group_size).float()  # (groups, G)
    n = v.sum(1, keepdim=True)  # (groups, 1) valid members
    total = (r * v).sum(1, keepdim=True)
    mean = total / n.clamp(min=1)
    if baseline == "mean":
        advantages = r - mean
    else:
        advantages = r - (total - r) / (n - 1).clamp(min=1)
    if scale == "std":
        advantages = advantages / ((((r - mean) ** 2 * v).sum(1, keepdim=True) / n.clamp(min=1)).sqrt() + eps)
    return (advantages * v * (n >= 2)).view(-1)


def overlong_penalty(lengths, max_tokens, buffer):
    """
    DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward of completions of `lengths` (N,):

        0                                      if |y| <= max_tokens - buffer
        ((max_tokens - buffer) - |y|) / buffer if max_tokens - buffer < |y| <= max_tokens   (down to -1 at the limit)

    so running into the limit is discouraged smoothly instead of by a cliff. Returns (N,) float.
    """
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"the overlong buffer must be in (0, max_tokens={max_tokens}], got {buffer}")
    return (((max_tokens - buffer) - lengths.float()) / buffer).clamp(-1.0, 0.0)


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(values, mask, agg, max_len=None, count=None):
    """
    Reduce per-token values (B, T) over the tokens where mask (B, T) is 1 (verl's loss_agg_mode names):

        token-mean               sum_{i,t} m v / N_tokens                     (DAPO: every token weighs the same)
        seq-mean-token-mean      sum_i [sum_t m v / sum_t m] / N_seqs         (GRPO: the mean of sequence means)
        seq-mean-token-sum-norm  sum_i [sum_t m v / max_len] / N_seqs         (Dr. GRPO: a constant length normaliser)

    N_tokens (valid tokens) or N_seqs (sequences with at least one valid token) is `count`, default this batch's own.
    Pass the count of the whole optimizer batch when it is split into micro-batches and across ranks: the
    gradients then sum (over micro-batches, and over ranks with a SUM all-reduce) to those of the whole batch.
    """
    mask = mask.float()
    if agg == "token-mean":
        total = (values * mask).sum()
        return total / max(float(mask.sum()) if count is None else count, 1.0)
    if agg == "seq-mean-token-mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    elif agg == "seq-mean-token-sum-norm":
        if max_len is None:
            raise ValueError("seq-mean-token-sum-norm needs max_len (the generation budget, --max-tokens)")
        per_seq = (values * mask).sum(-1) / max_len  # (B,)
    else:
        raise ValueError(f"unknown aggregation {agg!r}; expected one of {AGGREGATIONS}")
    return per_seq.sum() / max(float((mask.sum(-1) > 0).sum()) if count is None else count, 1.0)


LOSS_KINDS = ("pg", "ppo", "gspo", "cispo")
# Each loss kind's defaults from its paper, used for --eps-low / --eps-high / --loss-agg when the flag is not given:
#   pg, ppo  eps 0.2 (PPO, Schulman et al. 2017) / 0.28 (clip-higher, DAPO, Yu et al. 2025), token-mean (DAPO).
#   gspo     eps 3e-4 / 4e-4 (the bounds of the GSPO experiments, Zheng et al. 2025) and seq-mean-token-mean: its
#            objective is the mean over the G sequences of each one's clipped term; token-mean would weigh each
#            sequence by its length.
#   cispo    no lower bound on the importance weight, eps_low = 1 so 1 - eps_low = 0 (MiniMax-M1, 2025, sec. 3.1:
#            "we did not impose a lower bound ... we only tuned eps_high"; 0.28 is DAPO's), and the token-level
#            average 1 / sum_i |o_i| of its eq. 4.
LOSS_DEFAULTS = {
    "pg": dict(eps_low=0.2, eps_high=0.28, loss_agg="token-mean"),
    "ppo": dict(eps_low=0.2, eps_high=0.28, loss_agg="token-mean"),
    "gspo": dict(eps_low=3e-4, eps_high=4e-4, loss_agg="seq-mean-token-mean"),
    "cispo": dict(eps_low=1.0, eps_high=0.28, loss_agg="token-mean"),
}


def policy_loss(logp, old_logp, advantages, mask, kind="ppo", eps_low=0.2, eps_high=0.28, agg="token-mean",
                dual_clip=None, weights=None, max_len=None, count=None):
    """
    The policy-gradient loss of sampled tokens, to minimise. logp (B, T): log-probs of the sampled tokens under the
    current policy (with gradient); old_logp (B, T): under the policy that sampled them, before this batch's
    updates; advantages (B,) or (B, T); mask (B, T): 1 on tokens to train. With r_t = exp(logp_t - old_logp_t),
    sg = stop-gradient and A the advantage, the per-token loss l_t is

        pg     -A exp(logp_t - sg(logp_t))     value -A, gradient -A grad(logp_t): plain on-policy REINFORCE
        ppo    max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))        (PPO, Schulman et al. 2017; separate
               bounds = clip-higher, DAPO). dual_clip c > 1 also caps the loss of A < 0 tokens at -c A (Ye et al.
               2020), so a huge ratio on a bad token cannot dominate.
        gspo   as ppo with the sequence ratio s = exp(mean_t (logp_t - old_logp_t)) on every token (Zheng et al. 2025):
               a whole sequence is clipped or not; use small bounds (the paper: 3e-4 / 4e-4).
        cispo  -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A logp_t    (MiniMax-M1, 2025): the importance weight is
               clipped and detached, so a clipped token keeps its gradient instead of losing it as in ppo.
               (The paper bounds the weight from above only: eps_low = 1.)

    Every log-ratio (the token's, and gspo's sequence mean) is clamped to +-LOG_RATIO_CLAMP before exp(), so
    extreme log-probs give a finite loss and finite gradients (beyond the clamp the token gets no gradient).
    `weights` (B, T), detached, multiply l_t (the engine/trainer mismatch correction, mismatch_weights). The loss
    is aggregate(l, mask, agg, max_len, count). Returns (loss, stats) with stats floats: clip_low / clip_high, the
    fraction of valid tokens whose ratio was cut at the lower / upper bound (for ppo/gspo: where the clipped side
    is active, i.e. the token gets no gradient; clip_high includes the dual-clip region A < 0, r_t > c), and
    ratio_min / ratio_mean / ratio_max over valid tokens.
    """
    if kind not in LOSS_KINDS:
        raise ValueError(f"unknown policy loss kind {kind!r}; expected one of {LOSS_KINDS}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (it caps -c A where the ratio exceeds c), got {dual_clip}")
    mask = mask.float()
    valid = mask > 0
    advantages = advantages[:, None] if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
    log_ratio = (logp - old_logp) * mask  # (B, T), 0 on padding
    if kind == "gspo":
        seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
        log_ratio = seq_log_ratio[:, None].expand_as(logp)
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # (B, T)
    lower, upper = 1 - eps_low, 1 + eps_high
    if kind == "pg":
        token_loss = -advantages * (logp - logp.detach()).exp()
        cut_low = cut_high = torch.zeros_like(valid)
    elif kind == "cispo":
        token_loss = -advantages * ratio.clamp(lower, upper).detach() * logp
        cut_low, cut_high = ratio < lower, ratio > upper
    else:  # ppo, gspo
        token_loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(lower, upper))
        cut_low, cut_high = (advantages < 0) & (ratio < lower), (advantages > 0) & (ratio > upper)
        if dual_clip is not None:
            token_loss = torch.where(advantages < 0, torch.minimum(token_loss, -advantages * dual_clip), token_loss)
            cut_high = cut_high | ((advantages < 0) & (ratio > dual_clip))  # the loss is the constant -c A there
    if weights is not None:
        token_loss = token_loss * weights
    loss = aggregate(token_loss, mask, agg, max_len=max_len, count=count)
    num_valid = max(int(valid.sum()), 1)
    ratio = ratio.detach()
    stats = {"clip_low": float((cut_low & valid).sum()) / num_valid,
             "clip_high": float((cut_high & valid).sum()) / num_valid,
             "ratio_min": float(ratio.masked_fill(~valid, math.inf).min()),
             "ratio_mean": float((ratio * mask).sum()) / num_valid,
             "ratio_max": float(ratio.masked_fill(~valid, -math.inf).max())}
    return loss, stats


KL_KINDS = ("k1", "k2", "k3")


def kl_penalty(logp, ref_logp, kind="k2"):
    """
    Per-token estimates of KL(pi || pi_ref) from tokens sampled from pi (Schulman 2020, "Approximating KL
    divergence"), with d = logp - ref_logp = log pi / pi_ref:

        k1 = d                      unbiased value, high variance, can be negative. As a loss it teaches nothing:
                                    its gradient grad(logp) has expectation sum_y grad pi(y) = 0 under pi
        k2 = d^2 / 2                biased value; as a loss its gradient d grad(logp) equals, in expectation over
                                    the next token y ~ pi(. | prefix), the gradient of KL(pi(. | prefix) || pi_ref(. |
                                    prefix)) for that fixed prefix. It leaves out how changing pi changes which
                                    prefixes are sampled, so it is the per-token KL's gradient, not the sequence KL's
        k3 = exp(-d) - 1 + d        unbiased value, always >= 0 (GRPO's choice); its gradient (1 - exp(-d)) grad(logp)
                                    is not the gradient of KL(pi || pi_ref)

    The default is k2 because the penalty is used as a loss: it is its gradient that must be right. The learner scores
    both logp and ref_logp on the untruncated temperature-scaled distributions (no top-k/top-p cut, see
    rollout.reference_sampling): against a truncated reference a token outside its support would get ref_logp =
    rollout.LOGP_FLOOR and k2 ~ 5e3. Returns (B, T).
    """
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return torch.exp(-d) - 1 + d
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}")


def mismatch_weights(trainer_logp, engine_logp, mode="tis", cap=2.0, window=(0.5, 2.0)):
    """
    Per-token weights (B, T) that correct for the sampler not being the learner: the engine sampled with
    engine_logp, but the loss assumes the trainer's own log-probs trainer_logp at the same weights. With
    rho_t = exp(trainer_logp_t - engine_logp_t):

        none   w_t = 1
        tis    w_t = min(rho_t, cap)                   truncated importance sampling (Yao et al. 2025)
        mask   w_t = 1 if low <= rho_t <= high else 0  tokens the two disagree on are dropped (IcePop / MIS)

    log rho_t is clamped to +-LOG_RATIO_CLAMP first, so the weights are finite. Returns detached weights.
    """
    rho = (trainer_logp - engine_logp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if mode == "none":
        return torch.ones_like(rho)
    if mode == "tis":
        return rho.clamp(max=cap)
    if mode == "mask":
        low, high = window
        return ((rho >= low) & (rho <= high)).float()
    raise ValueError(f"unknown mismatch correction {mode!r}; expected none, tis or mask")


def whiten(values, mask, moments, eps=1e-8):
    """
    PPO's advantage whitening (OpenAI baselines ppo2; Ziegler et al. 2019): (x - mean) / (std + eps) where mask is
    1, 0 elsewhere; moments = rollout.global_moments(...) of the whole batch over every rank (n, mean, var).
    """
    _, mean, var = moments
    return (values - mean) / (math.sqrt(var) + eps) * (mask > 0)


def normalize_scores(scores, moments, eps=1e-6):
    """
    Per-batch normalisation of reward-model scores (N,): z = (s - mean(s)) / (std(s) + eps), population std, over
    the step's completions of every rank: moments = rollout.global_moments([(scores, ones)]) of all of them, so the
    z-scores do not depend on the number of processes.
    A reward model's scale and offset are arbitrary (only differences are trained); fixing them per batch keeps
    the KL coefficient and the critic's targets on one scale. (GRPO's std-scaled group advantages are unchanged by
    it; the KL term's weight relative to the reward is not.)
    """
    _, mean, var = moments
    return ((scores - mean) / (math.sqrt(var) + eps)).to(scores.dtype)


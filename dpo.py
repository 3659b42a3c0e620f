"""
Preference optimisation of the SFT model: DPO and its variants (IPO, SLiC hinge, robust/conservative DPO,
length-normalised DPO, SimPO), from a hub preference set, the synthetic pairs, or on-policy pairs the SFT model
generates itself and the task verifier labels.

    python dpo.py --preset tiny                     # CPU, minutes: self-generated pairs on synthetic problems
    python dpo.py --preset tiny --lora-rank 8       # LoRA adapters (model.LoRA) on a frozen SFT model
    torchrun --nproc_per_node=8 dpo.py --preset full   # full: UltraFeedback-binarized, ~3 min on 8xH100 (estimate)
    torchrun --nproc_per_node=8 dpo.py --preset full --pairs self-generated --task gsm8k   # on-policy GSM8K pairs
    torchrun --nnodes=2 --node-rank=0 --nproc_per_node=8 --rdzv-endpoint=host:29500 dpo.py --preset full   # and node-rank=1

A pair is two token sequences, chosen and rejected, that share one prompt rendering; the sequence log-probability
log pi(y|x) sums the log-probs of the answer's trained tokens only (mask 1: the model's own tokens, not the prompt
and not forced tool outputs). The reference model is the SFT model: its log-probs are computed once over the
dataset before the first update, so no second model is kept in memory (--live-reference keeps a frozen copy and runs
it every step instead). With --lora-rank the base weights are the reference: each step scores its pairs with the same
model, adapters switched off (the SFT model exactly), so there is neither a copy nor a precomputed pass.
"""

import argparse
import copy
import math
import random
import time
from collections import Counter
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import common
from common import autocast_ctx, compute_cleanup, compute_init, format_eta, print0
from engine import Engine, load_model
from eval import check_settings, held_out_check
from judge import JudgedTask, add_judge_flags, judge_from_args
from model import (EMBEDDING_LR, LOGITS_CHUNK_TOKENS, MATRIX_LR, UNEMBEDDING_LR, add_lora_flags, attach_lora,
                   check_lora_flags, lora_checkpoint, trainable_params)
from rollout import preference_pairs
from tasks import collate, decontamination_index, registered_tasks, task_by_name, token_budget_batches

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "sigmoid_norm", "simpo", "orpo", "kto")
PAIRED_LOSSES = LOSS_TYPES[:-1]  # dpo_loss's; kto_loss works on single answers labelled desirable or undesirable
REFERENCE_FREE = ("simpo", "orpo")  # no reference model is loaded, run or precomputed for these
# Losses that are stages of their own (ORPO replaces SFT + DPO, KTO needs no pairs): their checkpoints default to
# checkpoints/<loss> and their report records carry the loss as the stage, so they sit next to DPO's, not over it.
OWN_STAGE = ("orpo", "kto")
# What a DPO step logs (means over the step's pairs), TRL's names.
STAT_NAMES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy", "logps/chosen",
              "logps/rejected")
# What a KTO step logs: the reference point z0 and the mean implicit reward of each kind of answer.
KTO_STAT_NAMES = ("loss", "kl", "rewards/desirable", "rewards/undesirable", "rewards/margins")

# Each loss type's defaults from its paper, for --beta / --gamma when the flag is not given (otherwise the preset's
# beta, DPO's 0.1). A length-normalised margin is ~|y| times smaller than a summed one, so at beta 0.1 beta * h stays
# near 0 and the loss never saturates: these losses need a beta ~|y| times larger.
#   sigmoid_norm  beta 5: Tulu 3 (Lambert et al. 2024), length-normalised DPO.
#   simpo         beta 2, gamma 1: SimPO (Meng et al. 2024) tunes beta in 2-2.5 with gamma / beta around 0.5.
#   orpo          beta (the paper's lambda) 0.1: ORPO (Hong et al. 2024); its loss has its own NLL term, so no RPO term.
#   kto           beta 0.1, lambda_D = lambda_U = 1, no NLL term: KTO (Ethayarajh et al. 2024), for balanced data;
#                 the paper recommends lambda_D n_D / (lambda_U n_U) in [1, 4/3] (kto_weight_warning at start).
LOSS_DEFAULTS = {"sigmoid_norm": dict(beta=5.0), "simpo": dict(beta=2.0, gamma=1.0),
                 "orpo": dict(beta=0.1, sft_weight=0.0),
                 "kto": dict(beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, sft_weight=0.0)}


def resolve_loss_defaults(args):
    """
    Fill args.beta / args.gamma / ... left unset (None) with LOSS_DEFAULTS[args.loss_type]; returns what was filled.
    Raises ValueError for a flag the loss type has no use for.
    """
    if args.loss_type != "kto" and (args.desirable_weight is not None or args.undesirable_weight is not None):
        raise ValueError("--desirable-weight / --undesirable-weight are KTO's lambda_D / lambda_U; use --loss kto")
    if args.loss_type == "orpo" and args.sft_weight:
        raise ValueError("ORPO's loss already contains the NLL of the chosen answer; drop --sft-weight")
    if args.loss_type in ("orpo", "kto") and args.label_smoothing:
        raise ValueError(f"--label-smoothing does not apply to --loss {args.loss_type}")
    if args.loss_type in REFERENCE_FREE and args.live_reference:
        raise ValueError(f"--loss {args.loss_type} uses no reference model; drop --live-reference")
    filled = {key: value for key, value in LOSS_DEFAULTS.get(args.loss_type, {}).items()
              if getattr(args, key) is None}
    for key, value in filled.items():
        setattr(args, key, value)
    return filled


# Defaults per preset; explicit flags win.
# full (8xH100, plan(): ~3 min for a depth-20 model): one epoch of UltraFeedback-binarized train_prefs (61k pairs, ~600
# tokens a side): a reference pass (forward only) plus a policy pass over ~75M tokens; micro-batches of 32,768 padded
# positions (8 pairs of 2,048-token sides at most) need ~50 GiB per GPU with chunked logits (model.training_memory);
# tiny: 1,024 = 2 pairs of the 256-token context at their longest: on a CPU, which pays per padded position and little
# per micro-batch, the stage takes 105 s instead of 124 s at 8,192 on 2 idle cores, with the same metrics.
# --pairs self-generated --task gsm8k instead samples 8 answers to each of the 7.5k GSM8K train problems (the
# generation dominates: ~10 min) and keeps one correct/incorrect pair per problem that has both.
PRESETS = {
    # Measured on the tiny pipeline (held-out greedy pass@1 of the SFT model: 52%): self-generated pairs raise it
    # to 73%; the static synthetic pairs (88% held-out preference accuracy) leave it at 50%: they teach mistakes the
    # model does not make. At 3x this rate without --sft-weight the chosen log-probs drift down and the final
    # '#### <answer>' line degenerates; with it, 94%. The rate is gentle on purpose, so that RL keeps headroom.
    "tiny": dict(pairs="self-generated", task="synthetic", train_pairs=1024, eval_pairs=256, samples=8,
                 temperature=1.0, beta=0.1, sft_weight=1.0, lr_frac=0.03, batch_size=32, device_batch_tokens=1024,
                 epochs=1, eval_every=10, check_problems=256, check_samples=2, max_new_tokens=64, save_every=5,
                 decontaminate=False),
    # small (one 24 GB GPU, ~5 min): 20k UltraFeedback pairs with sides of <= 1,024 tokens, the full preset's batch.
    "small": dict(pairs="ultrafeedback", task="gsm8k", train_pairs=20_000, eval_pairs=500, samples=8,
                  temperature=1.0, beta=0.1, sft_weight=0.0, lr_frac=0.01, batch_size=256, device_batch_tokens=16384,
                  epochs=1, eval_every=25, check_problems=250, check_samples=1, max_new_tokens=512, save_every=25,
                  decontaminate=True),
    "full": dict(pairs="ultrafeedback", task="gsm8k", train_pairs=None, eval_pairs=1000, samples=8,
                 temperature=1.0, beta=0.1, sft_weight=0.0, lr_frac=0.01, batch_size=256, device_batch_tokens=32768,
                 epochs=1, eval_every=50, check_problems=500, check_samples=1, max_new_tokens=512, save_every=100,
                 decontaminate=True),
}
# Tokens of one pass over each GPU preset's pairs (both sides), for the budget (plan); estimates: UltraFeedback's
# sides average ~600 tokens (a dry run reads stand-in files and cannot count them).
PLAN_TOKENS = {"small": 20e6, "full": 75e6}


def plan(args, config):
    """
    The preset's budget (common.stage_plan): `epochs` passes of PLAN_TOKENS at 6N FLOPs per token plus the chunked
    logits' second lm_head forward, plus the reference's forward (2N, precomputed or --live-reference), and the
    accuracy check's answers before and after; memory at the largest micro-batch that fits the planned GPU, chunked
    logits, plus the frozen reference's fp32 weights with --live-reference.
    """
    num_params, flops = common.model_size(config)
    reference = 4 * num_params if getattr(args, "live_reference", False) else 0
    trainable = trainable_params(config, args)  # with --lora-rank: the adapters' gradients and AdamW state only
    micro = common.fit_batch_tokens("dpo", config, common.HARDWARE[args.preset]["memory"], args.device_batch_tokens,
                                    2 * config.sequence_len, LOGITS_CHUNK_TOKENS, reference, trainable=trainable)
    decode = 2 * args.check_problems * (1 + args.check_samples) * args.max_new_tokens
    per_token = flops * 4 / 3 + 2 * config.n_embd * config.vocab_size
    return common.stage_plan("dpo", args.preset, config, micro, LOGITS_CHUNK_TOKENS,
                             args.epochs * PLAN_TOKENS[args.preset], per_token, decode_tokens=decode,
                             extra_bytes=reference, trainable=trainable)


def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta,
             loss_type="sigmoid", label_smoothing=0.0, gamma=0.5, chosen_lengths=None, rejected_lengths=None):
    """
    Per-pair preference losses. Inputs are (B,) sequence log-probs log pi(y|x) of the chosen (w) and rejected (l)
    answers under the policy and the reference, and their lengths |y| in trained tokens. With the log-ratio
    margin
        h = [log pi(y_w|x) - log ref(y_w|x)] - [log pi(y_l|x) - log ref(y_l|x)],   sigma the logistic function,
    and eps = label_smoothing, loss_type selects:

    sigmoid       DPO (Rafailov et al. 2023, eq. 7):      -log sigma(beta h)
                  with eps > 0, conservative DPO (cDPO; Mitchell 2023, "A note on DPO with noisy preferences"):
                                                          -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)
    ipo           IPO (Azar et al. 2023, eq. 17, tau = beta):   (h - 1 / (2 beta))^2
    hinge         SLiC-HF calibration loss (Zhao et al. 2023) on the log-ratio margin:   max(0, 1 - beta h)
    robust        robust DPO (rDPO; Chowdhury et al. 2024, "Provably Robust DPO"), an unbiased loss when a
                  fraction eps < 1/2 of the labels is flipped:
                        [-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)] / (1 - 2 eps)
    sigmoid_norm  DPO on length-normalised log-ratios (the normalisation SimPO applies, with the reference kept):
                        h_n = [log pi(y_w|x) - log ref(y_w|x)] / |y_w| - [log pi(y_l|x) - log ref(y_l|x)] / |y_l|,
                        -(1 - eps) log sigma(beta h_n) - eps log sigma(-beta h_n)
    simpo         SimPO (Meng et al. 2024, eq. 6): reference-free, length-normalised, target margin gamma:
                        -log sigma(beta log pi(y_w|x) / |y_w| - beta log pi(y_l|x) / |y_l| - gamma)
                  (with eps > 0 smoothed like cDPO; the reference log-probs are ignored).
    orpo          ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model";
                  beta is the paper's lambda): reference-free, the SFT loss and an odds-ratio term in one,
                        -log P_w + beta * -log sigma(log odds(y_w|x) - log odds(y_l|x)),
                        log P = log pi(y|x) / |y| (length-normalised),   log odds = log P - log(1 - P)
                  (1 - P is kept >= 1e-6, so an answer the model is certain of stays finite; the reference log-probs
                  are ignored).

    The gradient of DPO with respect to the margin, dL/dh = -beta sigma(-beta h), vanishes once the pair is
    ranked confidently. Returns (losses, chosen_rewards, rejected_rewards), each (B,); the rewards are the implicit
    rewards each loss compares, detached: beta (log pi - log ref), divided by |y| for sigmoid_norm, and
    beta log pi / |y| for simpo and orpo.
    """
    if loss_type not in PAIRED_LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {PAIRED_LOSSES} (kto: kto_loss)")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type in ("ipo", "hinge", "orpo"):
        raise ValueError(f"label_smoothing does not apply to loss_type {loss_type!r}; "
                         "use sigmoid (cDPO), robust, sigmoid_norm or simpo")
    if loss_type in ("sigmoid_norm", "simpo", "orpo") and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(f"loss_type {loss_type!r} divides by answer lengths: pass chosen_lengths and rejected_lengths")
    if loss_type in ("simpo", "orpo"):
        chosen = policy_chosen_logps / chosen_lengths
        rejected = policy_rejected_logps / rejected_lengths
    elif loss_type == "sigmoid_norm":
        chosen = (policy_chosen_logps - ref_chosen_logps) / chosen_lengths
        rejected = (policy_rejected_logps - ref_rejected_logps) / rejected_lengths
    else:
        chosen = policy_chosen_logps - ref_chosen_logps
        rejected = policy_rejected_logps - ref_rejected_logps
    margin = chosen - rejected  # (B,) h, h_n, or SimPO's length-normalised log-prob difference
    logits = beta * margin - (gamma if loss_type == "simpo" else 0.0)
    eps = label_smoothing
    if loss_type == "orpo":
        log_odds = margin - (log1mexp(chosen) - log1mexp(rejected))  # (B,) log odds(y_w|x) - log odds(y_l|x)
        losses = -chosen - beta * F.logsigmoid(log_odds)
    elif loss_type == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = F.relu(1 - logits)
    elif loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)
    else:  # sigmoid, sigmoid_norm, simpo
        losses = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
    return losses, beta * chosen.detach(), beta * rejected.detach()


def log1mexp(x):
    """log(1 - e^x) for x <= 0, with 1 - e^x kept >= 1e-6 (ORPO's log(1 - P))."""
    return torch.log(-torch.expm1(x.clamp(max=math.log1p(-1e-6))))


def kto_weight_warning(desirable_weight, undesirable_weight, n_desirable, n_undesirable):
    """
    None when lambda_D n_D / (lambda_U n_U) lies in [1, 4/3], KTO's recommended range (Ethayarajh et al. 2024,
    section 4.2); else a warning naming the lambda_D that brings it to the nearer end, lambda_U kept.
    """
    ratio = desirable_weight * n_desirable / max(undesirable_weight * n_undesirable, 1)
    if 1 <= ratio <= 4 / 3 or n_desirable == 0:
        return None
    target = 1 if ratio < 1 else 4 / 3
    suggested = target * undesirable_weight * n_undesirable / n_desirable
    return (f"warning: KTO's lambda_D n_D / (lambda_U n_U) = {ratio:.2f} is outside the paper's [1, 4/3]; "
            f"--desirable-weight {suggested:.3g} --undesirable-weight {undesirable_weight:g} makes it {target:.2f}")


def kto_loss(policy_logps, ref_logps, desirable, kl, beta, desirable_weight=1.0, undesirable_weight=1.0):
    """
    Per-example KTO losses (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization"),
    from single answers labelled desirable (D) or undesirable (U) instead of pairs. With the implicit reward
    r = log pi(y|x) - log ref(y|x) and the reference point z0 = kl (kto_reference_point, a detached scalar),
        v(x, y) = lambda_D sigma(beta (r - z0))   if y is desirable,
                  lambda_U sigma(beta (z0 - r))   if y is undesirable,
        loss    = lambda_y - v(x, y)
    so a desirable answer is pushed to a reward above z0 and an undesirable one below it, each with a gradient that
    vanishes once it is far on its side (the value function saturates, as in prospect theory).
    policy_logps, ref_logps: (B,) sequence log-probs; desirable: (B,) bool. Returns (losses, rewards beta r detached).
    """
    rewards = policy_logps - ref_logps  # (B,)
    sign = desirable.to(rewards.dtype) * 2 - 1  # +1 desirable, -1 undesirable
    weights = torch.where(desirable, desirable_weight, undesirable_weight).to(rewards.dtype)
    losses = weights * (1 - torch.sigmoid(sign * beta * (rewards - kl)))
    return losses, beta * rewards.detach()


def kto_reference_point(log_ratio_sum, count):
    """
    KTO's reference point z0 = max(0, (1/m) sum_j [log pi(y'_j|x_j) - log ref(y'_j|x_j)]): a batch estimate of
    KL(pi || ref) on m mismatched answers y'_j (another prompt's answer after prompt x_j), clamped at 0 (a KL is
    never negative; the estimate can be) and detached (the paper backpropagates no gradient through it). Takes the
    sum of the m log-ratios and m, so that DDP ranks can add theirs first.
    """
    return torch.clamp(log_ratio_sum.detach() / count, min=0)


def sequence_logps(model, inputs, targets):
    """
    log pi(y|x) = sum_t log p(y_t | x, y_<t) over each row's target tokens (targets != -1), and the number of those
    tokens. inputs, targets: (B, T). Returns ((B,) log-probs, (B,) lengths).
    """
    token_logps = -model(inputs, targets, loss_reduction="none")  # (B, T), 0 where targets == -1
    return token_logps.sum(-1), (targets >= 0).sum(-1)


def pair_batch(pairs, pad_id):
    """(inputs, targets) of shape (2B, T) for B pairs: the chosen sides in rows 0..B-1, the rejected in B..2B-1."""
    return collate([chosen for chosen, _ in pairs] + [rejected for _, rejected in pairs], pad_id)


def pair_micro_batches(pairs, max_tokens):
    """
    Micro-batches of pairs (lists of indices into `pairs`) of at most max_tokens padded positions each, the two sides
    of a pair in the same one (tasks.token_budget_batches), and the fraction of the positions that are padding.
    """
    return token_budget_batches([[len(chosen) - 1, len(rejected) - 1] for (chosen, _), (rejected, _) in pairs],
                                max_tokens)


def pair_logps(model, pairs, pad_id, device):
    """Policy (or reference) sequence log-probs and lengths of a list of pairs: four (B,) tensors."""
    inputs, targets = pair_batch(pairs, pad_id)
    with autocast_ctx(device):
        logps, lengths = sequence_logps(model, inputs.to(device), targets.to(device))  # (2B,) each
    B = len(pairs)
    return logps[:B], logps[B:], lengths[:B], lengths[B:]


def sequences_logps(model, sequences, pad_id, device):
    """Sequence log-probs and lengths ((B,) each) of a list of (ids, mask) sequences (KTO's answers, one per row)."""
    inputs, targets = collate(sequences, pad_id)
    with autocast_ctx(device):
        return sequence_logps(model, inputs.to(device), targets.to(device))


def kto_rows(examples, seed, max_seq_len):
    """
    KTO's rows from labelled examples ((ids, mask), desirable), shuffled with `seed`: each answer is paired with a
    mismatched sequence, its own prompt followed by the answer of the next example (cyclically) whose prompt differs,
    cut to max_seq_len tokens. Those are the y' ~ pi(.|x'), x' != x, on which the reference point z0 is estimated.
    The prompt is everything before the first trained token (mask 1). Rows have the shape of pairs, so micro-batching
    and the precomputed reference ([answer, mismatched] log-probs) are the pairs' own. Returns (rows, (N,) bool
    tensor: desirable). Raises ValueError when fewer than two distinct prompts leave nothing to mismatch.
    """
    examples = list(examples)
    random.Random(seed).shuffle(examples)
    starts = [mask.index(1) for (_, mask), _ in examples]  # prompt lengths
    prompts = [tuple(ids[:start]) for ((ids, _), _), start in zip(examples, starts)]
    rows = []
    for i, ((ids, mask), _) in enumerate(examples):
        j = next((j % len(examples) for j in range(i + 1, i + len(examples))
                  if prompts[j % len(examples)] != prompts[i]), None)
        if j is None:
            raise ValueError(f"KTO's KL estimate needs answers to two different prompts; these {len(examples)} "
                             "answers share one: train on more prompts")
        (other_ids, other_mask), _ = examples[j]
        mismatched = ((ids[:starts[i]] + other_ids[starts[j]:])[:max_seq_len],
                      (mask[:starts[i]] + other_mask[starts[j]:])[:max_seq_len])
        rows.append(((ids, mask), mismatched))
    return rows, torch.tensor([desirable for _, desirable in examples], dtype=torch.bool)


@torch.no_grad()
def kto_kl(model, rows, ref_kl, batch_tokens, pad_id, device):
    """
    KTO's z0 (kto_reference_point) over `rows` of every rank: the policy's log-probs of the mismatched sequences
    against their reference log-probs ref_kl (N,), summed with the count over DDP ranks before the clamp.
    """
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of log-ratios, count]
    for batch in pair_micro_batches(rows, batch_tokens)[0]:
        logps, _ = sequences_logps(model, [rows[i][1] for i in batch], pad_id, device)
        total[0] += (logps.double() - ref_kl[batch].double()).sum()
        total[1] += len(batch)
    if dist.is_initialized():
        dist.all_reduce(total)
    return kto_reference_point(total[0], total[1].clamp(min=1)).float()


@torch.no_grad()
def reference_logps(model, pairs, batch_tokens, pad_id, device):
    """(N, 2) reference log-probs [chosen, rejected] of every pair, computed once, in micro-batches of batch_tokens."""
    out = torch.zeros(len(pairs), 2, device=device)
    for batch in pair_micro_batches(pairs, batch_tokens)[0]:
        chosen, rejected, _, _ = pair_logps(model, [pairs[i] for i in batch], pad_id, device)
        out[batch] = torch.stack([chosen, rejected], dim=1).float()
    return out


def preference_losses(policy, pairs, ref, args, pad_id, device, desirable=None, kl=None):
    """
    Per-pair training losses (B,) of a micro-batch of B pairs, and the sum over its pairs of each STAT_NAMES
    statistic. `ref` is (B, 2) reference log-probs [chosen, rejected]. With --sft-weight alpha, adds RPO's
    length-normalised NLL of the chosen answer (Pang et al. 2024, "Iterative Reasoning Preference Optimization"),
    alpha * (-log pi(y_w|x) / |y_w|), which keeps the chosen log-probs from drifting down while the margin grows
    (the paper weights the DPO term instead; at its recommended weight 1 the two are the same).
    KTO: `pairs` are kto_rows, `desirable` their (B,) labels and `kl` the step's z0; only the answers run with
    gradients, the RPO term applies to the desirable ones, and the sums are of KTO_STAT_NAMES (kto_stats).
    """
    if args.loss_type == "kto":
        logps, lengths = sequences_logps(policy, [answer for answer, _ in pairs], pad_id, device)
        desirable = desirable.to(logps.device)
        losses, rewards = kto_loss(logps, ref[:, 0], desirable, kl, args.beta, args.desirable_weight,
                                   args.undesirable_weight)
        if args.sft_weight:
            losses = losses + args.sft_weight * desirable * (-logps / lengths)
        stats = {"loss": losses, "kl": kl.expand_as(losses), "rewards/desirable": rewards * desirable,
                 "rewards/undesirable": rewards * ~desirable, "desirable": desirable.double()}
        return losses, {name: value.detach().sum().double() for name, value in stats.items()}
    chosen, rejected, chosen_len, rejected_len = pair_logps(policy, pairs, pad_id, device)
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        chosen, rejected, ref[:, 0], ref[:, 1], args.beta, args.loss_type, args.label_smoothing, args.gamma,
        chosen_len, rejected_len)
    if args.sft_weight:
        losses = losses + args.sft_weight * (-chosen / chosen_len)
    stats = {"loss": losses, "rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
             "rewards/margins": chosen_rewards - rejected_rewards,
             "rewards/accuracy": (chosen_rewards > rejected_rewards).float(),
             "logps/chosen": chosen, "logps/rejected": rejected}
    return losses, {name: value.detach().sum().double() for name, value in stats.items()}


def mean_stats(stat_sums, count, device):
    """Means of summed statistics over `count` pairs on every rank, summed across DDP ranks."""
    names = sorted(stat_sums)
    count = torch.tensor(float(count), dtype=torch.float64, device=device)
    sums = torch.stack([stat_sums[name] for name in names] + [count])
    if dist.is_initialized():
        dist.all_reduce(sums)
    return {name: (sums[i] / sums[-1]).item() for i, name in enumerate(names)}


def kto_stats(means):
    """KTO_STAT_NAMES from mean_stats' means over all answers: each kind's reward averaged over that kind only."""
    share = means["desirable"]  # fraction of desirable answers
    good = means["rewards/desirable"] / share if share > 0 else float("nan")
    bad = means["rewards/undesirable"] / (1 - share) if share < 1 else float("nan")
    return {"loss": means["loss"], "kl": means["kl"], "rewards/desirable": good, "rewards/undesirable": bad,
            "rewards/margins": good - bad}


@torch.no_grad()
def evaluate_preferences(model, pairs, ref, args, pad_id, device, desirable=None):
    """
    Held-out preference statistics (loss, rewards, margins, accuracy, log-probs; KTO: KTO_STAT_NAMES with z0
    estimated on all held-out rows), means over all ranks' pairs.
    """
    kto = args.loss_type == "kto"
    kl = kto_kl(model, pairs, ref[:, 1], args.device_batch_tokens, pad_id, device) if kto else None
    sums = Counter()
    for batch in pair_micro_batches(pairs, args.device_batch_tokens)[0]:
        _, stats = preference_losses(model, [pairs[i] for i in batch], ref[batch], args, pad_id, device,
                                     desirable[batch] if kto else None, kl)
        sums.update(stats)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    names = KTO_STAT_NAMES[:-1] + ("desirable",) if kto else STAT_NAMES
    means = mean_stats({name: sums.get(name, zero) for name in names}, len(pairs), device)
    return kto_stats(means) if kto else means


def preference_summary(stats, short=False):
    """One log line's worth of preference statistics: accuracy and margin, or KTO's z0 and rewards."""
    if "kl" in stats:
        line = f"z0 {stats['kl']:.4f} | reward margin {stats['rewards/margins']:+.3f}"
        return line if short else line + (f" (desirable {stats['rewards/desirable']:+.3f}, undesirable "
                                          f"{stats['rewards/undesirable']:+.3f})")
    line = f"acc {stats['rewards/accuracy']:.1%} margin {stats['rewards/margins']:+.3f}"
    return line if short else line + f" | logp chosen {stats['logps/chosen']:.1f} rejected {stats['logps/rejected']:.1f}"


def build_pairs(args, model, tokenizer, split, max_seq_len, judge=None):
    """
    This rank's share of the --pairs preference pairs of `split` (rollout.preference_pairs; decontaminated with
    --decontaminate), counts of what happened to the rows of all ranks, and (pairs, tokens) held by each rank.
    --loss kto: labelled answers ((ids, mask), desirable) instead of pairs (preference_pairs(unpaired=True)).
    judge (judge.JudgeVerifier): self-generated answers are labelled by it instead of --task's verifier.
    """
    size = args.train_pairs if split == "train" else args.eval_pairs
    index = decontamination_index(args.preset) if args.decontaminate and split == "train" else None
    self_generated = args.pairs == "self-generated"
    task = task_by_name(args.task, split, size, args.seed) if self_generated else None
    return preference_pairs(args.pairs, split, size, tokenizer, max_seq_len,
                            engine=Engine(model, tokenizer) if self_generated else None,
                            task=JudgedTask(task, judge) if judge else task,
                            samples=args.samples, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            seed=args.seed, index=index, unpaired=args.loss_type == "kto")


def main(argv=None):
    parser = argparse.ArgumentParser(description="Preference optimisation (DPO and variants) of the SFT model.")
    common.add_stage_flags(parser, PRESETS, preset="defaults for the flags below", seed="data order and sampling seed",
                           ckpt="SFT checkpoint: the initial policy and the reference (default: checkpoints/sft; "
                                "--loss orpo may start from the base checkpoint)",
                           out="where to save (default: checkpoints/dpo; --loss orpo / kto: checkpoints/orpo / kto)",
                           resume="continue from the latest checkpoint in --out")
    parser.add_argument("--pairs", choices=("ultrafeedback", "synthetic", "self-generated"),
                        help="preference data: the hub set, the synthetic pairs, or pairs sampled from the SFT model "
                             "and labelled by --task's verifier")
    parser.add_argument("--task", choices=registered_tasks("generative"),
                        help="verifiable task: prompts of self-generated pairs, and the held-out accuracy check")
    parser.add_argument("--train-pairs", type=int, help="pairs (self-generated: prompts) to train on")
    parser.add_argument("--eval-pairs", type=int, help="held-out pairs (self-generated: prompts)")
    parser.add_argument("--samples", type=int, help="answers sampled per prompt for self-generated pairs")
    parser.add_argument("--temperature", type=float, help="sampling temperature of self-generated pairs")
    parser.add_argument("--loss-type", "--loss", choices=LOSS_TYPES, default="sigmoid",
                        help="see dpo_loss; kto: kto_loss on single labelled answers; orpo and simpo use no reference "
                             "model (orpo can start from the base checkpoint)")
    parser.add_argument("--beta", type=float, help="inverse temperature of the implicit reward; orpo: the weight "
                        "lambda of the odds-ratio term (default per --loss-type, see LOSS_DEFAULTS: sigmoid_norm 5, "
                        "simpo 2, else the preset's 0.1)")
    parser.add_argument("--desirable-weight", type=float,
                        help="KTO's lambda_D, the weight of desirable answers (default 1, the paper's)")
    parser.add_argument("--undesirable-weight", type=float,
                        help="KTO's lambda_U, the weight of undesirable answers (default 1, the paper's)")
    parser.add_argument("--label-smoothing", type=float, default=0.0,
                        help="assumed fraction of flipped labels (sigmoid: cDPO, robust: rDPO)")
    parser.add_argument("--gamma", type=float, default=None, help="SimPO target margin (default 1, see LOSS_DEFAULTS)")
    parser.add_argument("--sft-weight", type=float, help="weight of the NLL of chosen answers (RPO; 0: plain DPO; "
                        "kto: of desirable answers; orpo: not allowed, its loss has the NLL already)")
    parser.add_argument("--live-reference", action="store_true",
                        help="keep a frozen reference model and run it every step instead of precomputing")
    parser.add_argument("--epochs", type=int, help="passes over the training pairs")
    parser.add_argument("--batch-size", type=int, help="pairs per optimizer step, all ranks together")
    parser.add_argument("--device-batch-tokens", type=int, help="padded positions (rows x longest row, both sides of "
                        "each pair) per micro-batch per rank; at least 2 x --max-seq-len")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="longest side of a pair, in tokens; longer pairs are skipped (default: the model's "
                             "sequence_len)")
    parser.add_argument("--lr-frac", type=float,
                        help="learning rates as a fraction of pretraining's; decays linearly to 0")
    parser.add_argument("--eval-every", type=int, help="held-out preference metrics every this many steps")
    parser.add_argument("--check-problems", type=int, help="held-out problems of --task for the accuracy check")
    parser.add_argument("--check-samples", type=int, help="samples per problem for pass@1 at temperature 1")
    parser.add_argument("--max-new-tokens", type=int, help="longest generated answer")
    parser.add_argument("--save-every", type=int, help="save a resumable checkpoint every this many steps (0: never)")
    parser.add_argument("--decontaminate", action=argparse.BooleanOptionalAction, default=None,
                        help="drop training prompts and pairs that overlap an evaluation set in use (tasks.NgramIndex: "
                             "a shared 13-gram of normalised words or a whole short question); default on for full, "
                             "off for tiny (split by hash)")
    add_judge_flags(parser)
    parser.add_argument("--dry-run", action="store_true", help="build the model, pairs and optimizers, print the plan "
                        "and stop before the reference pass")
    add_lora_flags(parser)
    args = parser.parse_args(argv)
    check_lora_flags(parser, args)
    if args.lora_rank and args.live_reference:
        parser.error("--live-reference keeps a copy of the SFT model; with --lora-rank the reference is the same "
                     "model with its adapters off, live already")
    fit_batch = args.device_batch_tokens is None  # on a GPU: the largest that fits, up to the preset's
    filled = resolve_loss_defaults(args)
    common.fill_preset(args, PRESETS[args.preset])
    common.check_numbers(args, positive=["train_pairs", "eval_pairs", "samples", "beta", "epochs",
                                         "batch_size", "device_batch_tokens", "max_seq_len", "eval_every",
                                         "check_problems", "check_samples", "max_new_tokens"],
                         nonnegative=["save_every", "lr_frac", "sft_weight", "label_smoothing", "temperature"])
    judge = judge_from_args(args, args.pairs == "self-generated", "use it with --pairs self-generated")
    if filled:
        print0(f"{args.loss_type} loss: paper defaults " + ", ".join(f"{k} {v:g}" for k, v in filled.items()))

    stage = args.loss_type if args.loss_type in OWN_STAGE else "dpo"

    ddp, rank, local_rank, world_size, device = compute_init(args.device, seed=args.seed)
    stage_start = time.time()
    out_dir = args.out or common.checkpoint_dir(stage)
    resume = common.resume_or_finish(out_dir, args.resume, stage)  # the step folder to continue from, or None
    if resume is common.FINISHED:
        return

    # The SFT model is both the initial policy and the reference (ORPO and SimPO have none; ORPO may start from base).
    model, tokenizer, sft_meta = load_model(args.ckpt or common.checkpoint_dir("sft"), device)
    lora = attach_lora(model, args)  # None without --lora-rank; then the reference is the model with them off
    max_seq_len = args.max_seq_len or model.config.sequence_len
    args.device_batch_tokens = common.batch_tokens_for_device(
        "dpo", None if fit_batch else args.device_batch_tokens, device, model.config, args.device_batch_tokens,
        2 * max_seq_len, LOGITS_CHUNK_TOKENS, 4 * model.num_params() if args.live_reference else 0)
    pad_id = tokenizer.bos_id
    print0(f"loaded {sft_meta.get('stage', 'SFT')} model: {model.num_params():,} parameters; {args.loss_type} loss, "
           f"beta {args.beta}, pairs: {args.pairs}")

    # Data: each rank builds its own share of the pairs. Everything is deterministic given the SFT model and the
    # seed, so a resumed run rebuilds the same pairs and reference log-probs.
    t0 = time.time()
    train_pairs, train_counts, train_shares = build_pairs(args, model, tokenizer, "train", max_seq_len, judge)
    eval_pairs, eval_counts, eval_shares = build_pairs(args, model, tokenizer, "test", max_seq_len, judge)
    if judge:
        print0(f"judge {args.judge_model} at {args.judge_url}: {judge.requests} requests, {len(judge.cache)} cached")
    print0(f"{'answers' if args.loss_type == 'kto' else 'pairs'}: train {dict(train_counts)} | "
           f"held-out {dict(eval_counts)}")
    train_labels = eval_labels = None
    if args.loss_type == "kto":  # rows (answer, mismatched answer) and their labels
        train_pairs, train_labels = kto_rows(train_pairs, args.seed, max_seq_len)
        eval_pairs, eval_labels = kto_rows(eval_pairs, args.seed, max_seq_len)
        kinds = torch.stack([train_labels.sum(), (~train_labels).sum()]).double().to(device)  # [n_D, n_U]
        if ddp:
            dist.all_reduce(kinds)
        n_d, n_u = kinds.tolist()
        print0(f"kto: lambda_D {args.desirable_weight:g}, lambda_U {args.undesirable_weight:g} (paper default 1, 1); "
               f"{n_d:.0f} desirable, {n_u:.0f} undesirable answers: lambda_D n_D / (lambda_U n_U) = "
               f"{args.desirable_weight * n_d / max(args.undesirable_weight * n_u, 1):.2f} (paper: keep in [1, 4/3])")
        warning = kto_weight_warning(args.desirable_weight, args.undesirable_weight, n_d, n_u)
        if warning:
            print0(warning)

    if args.batch_size % world_size:
        raise ValueError(f"--batch-size {args.batch_size} is not a multiple of the {world_size} ranks")
    if args.device_batch_tokens < 2 * max_seq_len:
        raise ValueError(f"--device-batch-tokens {args.device_batch_tokens} cannot hold a pair of two "
                         f"--max-seq-len {max_seq_len} sides; raise it to {2 * max_seq_len} or lower --max-seq-len")
    pairs_per_rank = args.batch_size // world_size
    min_pairs = min(n for n, _ in train_shares)  # every rank must take the same number of steps
    num_steps = args.epochs * min_pairs // pairs_per_rank
    if num_steps < 1:
        raise ValueError(f"{min_pairs} training pairs per rank are fewer than one step's {pairs_per_rank}; "
                         "generate more (--train-pairs, --samples) or lower --batch-size")
    tokens = sum(t for _, t in train_shares)  # one pass over the training pairs, padding not counted
    print0(f"{num_steps} steps of {args.batch_size} pairs ({pairs_per_rank} per rank in micro-batches of <= "
           f"{args.device_batch_tokens:,} padded tokens) over {min_pairs * world_size} pairs, "
           f"{sum(n for n, _ in eval_shares)} held-out pairs; one pass is {tokens:,} tokens, "
           f"~{model.flops_per_token() * tokens:.1e} FLOPs"
           + ("" if args.loss_type in REFERENCE_FREE else " (+1/3 for the reference pass)"))

    optimizers = lora.optimizers(args.lora_lr) if lora else model.setup_optimizers(
        matrix_lr=MATRIX_LR * args.lr_frac, embedding_lr=EMBEDDING_LR * args.lr_frac,
        unembedding_lr=UNEMBEDDING_LR * args.lr_frac)
    if lora:
        print0(f"{lora.extra_repr()}: {lora.num_trainable():,} trainable parameters, the base frozen")
    if args.dry_run:
        if args.preset in common.HARDWARE:
            common.print_plan(plan(args, model.config))
        print0("dry run: model, pairs and optimizers are built; stopping before the reference pass")
        compute_cleanup()
        return

    reference = copy.deepcopy(model).requires_grad_(False) if args.live_reference else None
    # With LoRA the reference is the same model with its adapters off (the base exactly): no copy, no precomputed pass.
    live_reference = reference is not None or lora is not None
    if args.loss_type in REFERENCE_FREE:  # the losses ignore these zeros
        train_ref, eval_ref = torch.zeros(len(train_pairs), 2, device=device), torch.zeros(len(eval_pairs), 2,
                                                                                          device=device)
        print0(f"{args.loss_type}: no reference model")
    else:
        if not live_reference:
            train_ref = reference_logps(model, train_pairs, args.device_batch_tokens, pad_id, device)  # (N, 2)
            print0("reference log-probs precomputed; the reference model is not kept")
        with lora.disabled() if lora else nullcontext():
            eval_ref = reference_logps(model, eval_pairs, args.device_batch_tokens, pad_id, device)  # (N_eval, 2)
    print0(f"data and reference ready in {time.time() - t0:.0f}s")

    # The SFT model's scores; its preference margins are all 0 (policy = reference), so its accuracy is 0. Its held-out
    # check is the one sft.py ran on these weights at its end, stored in the checkpoint, when it ran the same check.
    check_args = (args.task, args.check_problems, args.check_samples, args.max_new_tokens, args.seed)
    stored = sft_meta.get("check", {})
    check = stored["metrics"] if stored.get("settings") == check_settings(*check_args) else held_out_check(
        model, tokenizer, *check_args)
    before = {**check, **evaluate_preferences(model, eval_pairs, eval_ref, args, pad_id, device, eval_labels)}
    print0(f"before: held-out {args.task} pass@1 greedy {before['pass@1']:.1%}, T=1 {before['pass@1_t1']:.1%} | "
           f"pref loss {before['loss']:.4f}, {preference_summary(before)}")

    start_step = 0
    if resume:
        state, _, extra = common.load_checkpoint(resume, device=device)
        if lora:  # the base is --ckpt's, as at the start; the checkpoint's model is the merged export
            lora.load_state_dict(extra["lora"])
        else:
            model.load_state_dict(state)
        common.load_optimizers(optimizers, extra["optimizers"])
        start_step = extra["step"]
        print0(f"resuming from step {start_step}")
    policy = model
    if ddp:
        policy = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    logger = common.Logger(args.run, vars(args), series=extra.get("curves") if resume else None)

    t0 = time.time()
    for step in range(start_step, num_steps):
        lr_multiplier = 1.0 - step / num_steps  # linear decay to 0
        common.set_lr(optimizers, lr_multiplier)
        positions = [(step * pairs_per_rank + i) % len(train_pairs) for i in range(pairs_per_rank)]
        step_pairs = [train_pairs[p] for p in positions]
        if not live_reference or args.loss_type in REFERENCE_FREE:
            step_ref = train_ref[positions]  # (B_step, 2)
        else:
            with lora.disabled() if lora else nullcontext():
                step_ref = reference_logps(reference or model, step_pairs, args.device_batch_tokens, pad_id, device)
        kl = None
        if args.loss_type == "kto":  # z0 of the whole step (all micro-batches, all ranks), before any update
            kl = kto_kl(model, step_pairs, step_ref[:, 1], args.device_batch_tokens, pad_id, device)
        micro, padding = pair_micro_batches(step_pairs, args.device_batch_tokens)
        sums = Counter()
        for m, batch in enumerate(micro):
            pairs = [step_pairs[i] for i in batch]
            labels = train_labels[[positions[i] for i in batch]] if train_labels is not None else None
            # Gradients are all-reduced once, after the last micro-batch of the step.
            sync = policy.no_sync() if ddp and m < len(micro) - 1 else nullcontext()
            with sync:
                losses, stats = preference_losses(policy, pairs, step_ref[batch], args, pad_id, device, labels, kl)
                # The mean over the step's pairs of this rank (every rank holds pairs_per_rank; DDP averages ranks).
                (losses.sum() / pairs_per_rank).backward()
            sums.update(stats)
        for optimizer in optimizers:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        means = mean_stats(dict(sums), pairs_per_rank, device)
        means = kto_stats(means) if args.loss_type == "kto" else means
        log = {f"train/{name}": value for name, value in means.items()}
        log["train/padding"] = padding
        line = (f"step {step + 1:4d}/{num_steps} | loss {means['loss']:.4f} | {preference_summary(means)}"
                f" | {len(micro)} micro-batch(es), {padding:.0%} padding")
        if (step + 1) % args.eval_every == 0 or step + 1 == num_steps:
            held_out = evaluate_preferences(model, eval_pairs, eval_ref, args, pad_id, device, eval_labels)
            log.update({f"val/{name}": value for name, value in held_out.items()})
            line += f" | val loss {held_out['loss']:.4f} {preference_summary(held_out, short=True)}"
        elapsed = time.time() - t0
        print0(line + f" | eta {format_eta(elapsed / (step + 1 - start_step) * (num_steps - step - 1))}")
        logger.log(log, step + 1)
        preempted = common.preempted(device)  # SIGTERM/SIGINT: keep this step's work, see common.py
        if (preempted or args.save_every and (step + 1) % args.save_every == 0 and step + 1 < num_steps) and rank == 0:
            common.save_checkpoint(out_dir, step + 1, tokenizer=tokenizer, **lora_checkpoint(
                model, lora, {"stage": stage, "finished": False},
                {"step": step + 1, "optimizers": [o.state_dict() for o in optimizers],
                 "curves": logger.series}))
        if preempted:
            common.exit_preempted(out_dir)

    after = {**held_out_check(model, tokenizer, *check_args),
             **evaluate_preferences(model, eval_pairs, eval_ref, args, pad_id, device, eval_labels)}
    print0(f"after:  held-out {args.task} pass@1 greedy {before['pass@1']:.1%} -> {after['pass@1']:.1%}, "
           f"T=1 {before['pass@1_t1']:.1%} -> {after['pass@1_t1']:.1%} | pref loss {after['loss']:.4f}, "
           f"{preference_summary(after)}")
    logger.log({f"final/{k}": v for k, v in after.items()}, num_steps)
    logger.finish()
    common.check_ranks_agree(model, stage)
    if rank == 0:
        meta = {"stage": stage, "finished": True, "preset": args.preset, "args": vars(args), "metrics": after,
                "sft_step": sft_meta.get("step")}
        path = common.save_checkpoint(out_dir, num_steps, tokenizer=tokenizer, **lora_checkpoint(model, lora, meta))
        print0(f"saved {path}")
    common.append_report({"stage": stage, "preset": args.preset, "seconds": time.time() - stage_start,
                          "pairs": args.pairs, "loss_type": args.loss_type,
                          "steps": num_steps, "train_pairs": min_pairs * world_size,
                          **{f"before/{k}": v for k, v in before.items()},
                          **{f"after/{k}": v for k, v in after.items()},
                          "pairs_train": dict(train_counts), "pairs_held_out": dict(eval_counts)}, logger)
    compute_cleanup()


if __name__ == "__main__":
    common.run_cli(main, preemptible=True)

"""
Rollouts for the RL stages (a library, like eval.py): sample groups of answers and score them, and everything that
feeds the learner from there. Used by rl.py (GRPO family), ppo.py (PPO with a critic), distill.py (on-policy
distillation) and by dpo.py / rm.py for their self-generated preference pairs.

    prompts     the --task mixture (tasks.PromptMixture, per-source accounting), decontamination
                (tasks.decontamination_index); entry point: prepare_prompts(args, world_size, judge)
    sampling    sample_groups (one prefill per prompt, dynamic sampling), score_group (the verifier of every answer),
                self_generated_pairs / preference_pairs (a right and a wrong answer of one prompt, for DPO and the
                reward model)
    learner     learner rows and micro-batches exactly as sampled, token_logprobs, reward-model scores, the step's
                tallies and log lines, the held-out evaluation and the report record shared by rl.py and ppo.py

The objective's math (group_advantages, policy_loss, kl_penalty, ...) is objectives.py; the opt-in systems (PTGS,
--async, the difficulty filter) and Rollouts, the step's groups with them, are rl_systems.py. It imports only shared
modules, eval and objectives; every RL stage's flags come from add_flags / finish_args, so rl.py and
ppo.py read the same --task, sampling, loss and evaluation options the same way.
"""

import argparse
import hashlib
import math
import random
from collections import Counter
from functools import partial

import torch
import torch.distributed as dist

import common
from common import autocast_ctx, fill_preset, format_eta, get_dist_info, print0
from engine import load_model, sampling_logprobs
from eval import completion_text, evaluate_generative
from judge import JudgedTask, add_judge_flags, judge_from_args
from objectives import AGGREGATIONS, KL_KINDS, LOSS_DEFAULTS, LOSS_KINDS, mismatch_weights, overlong_penalty
from tasks import (PromptMixture, collate, completion_reward, decontamination_index, pad_sequences, prepare_rows,
                   preference_mixture, registered_tasks, render_pair, row_texts, task_by_name, token_budget_batches)

PRESETS = {  # of both RL stages, rl.py and ppo.py: they sample the same prompts with the same budgets
    # Synthetic arithmetic from the tiny DPO checkpoint: ~2 minutes on 2 idle CPU cores. lr_frac: started from a weak
    # SFT model (7% pass@1), 0.3 collapsed the policy within 30 steps and 0.1 learned too slowly to show in 40.
    # num_steps: held-out pass@1 (T=1) 0.70 -> 0.943 at step 10, 0.966 at 20, 0.972 at 30, 0.979 at 50; the steps
    # after 20 cost ~5 s each (most groups are all correct: dynamic sampling draws up to 4 rounds) for ~0.001 each.
    # device_batch_tokens: the learner's 128 rows sorted into micro-batches of 1,024 positions are ~6% padding instead
    # of ~45% at 8,192 and learn in 1.35 s instead of 2.3 s a step (a CPU pays per position).
    "tiny": dict(task="synthetic", train_size=5000, num_steps=20, prompts_per_step=16, group_size=8, max_tokens=48,
                 device_batch_tokens=1024, lr_frac=0.15, warmup_steps=0, eval_every=10, eval_problems=128,
                 eval_samples=8, save_every=10, oversample=1.0, decontaminate=False),
    # GSM8K on one 24 GB GPU: 32 prompts x 8 samples per step, 2x oversampled; plan(): ~4 sampling rounds per step
    # at the 2% pass@1 assumed for depth 8, so 30 steps of <= 256 tokens (GSM8K's reference answers with calculator
    # calls: median 103, p99 290 tokens at a 4,096-token vocabulary, fewer at 65,536: the longest ~1% may be cut)
    # and held-out pass@1 on 100 problems instead of 200 (its standard error sqrt(2) = 1.4x as large).
    "small": dict(task="gsm8k", train_size=None, num_steps=30, prompts_per_step=32, group_size=8, max_tokens=256,
                  device_batch_tokens=8192, lr_frac=0.05, warmup_steps=4, eval_every=15, eval_problems=100,
                  eval_samples=8, save_every=15, oversample=2.0, decontaminate=True),
    # GSM8K on a GPU node: 64 prompts x 16 samples = 1024 completions per step, global; 2x oversampled. plan(): ~3.7
    # sampling rounds per step at the 5% pass@1 assumed for depth 20, rollout-bound: 100 steps (0.86 of an epoch of
    # GSM8K train, where 200 made 1.7: less of RL's gain, unmeasured) of <= 384 tokens (every reference answer
    # measured above fits) keep the speedrun near 4 hours.
    "full": dict(task="gsm8k", train_size=None, num_steps=100, prompts_per_step=64, group_size=16, max_tokens=384,
                 device_batch_tokens=16384, lr_frac=0.05, warmup_steps=10, eval_every=50, eval_problems=400,
                 eval_samples=8, save_every=50, oversample=2.0, decontaminate=True),
}

LOGP_FLOOR = -100.0  # log-probs are floored here: a token outside a top-k/top-p support (-inf) must not become NaN

# -----------------------------------------------------------------------------
# Cross-rank moments (of advantages to whiten, of reward-model scores to normalise: objectives.py)


def global_moments(pairs, device):
    """
    (n, mean, var) of the entries of every (values, mask) pair of this rank where mask is 1, over all ranks: one
    all-reduce of (n, sum x, sum x^2) in float64, then mean = sum x / n and var = sum x^2 / n - mean^2 (population).
    A rank with no pair or no valid entry contributes zeros and still joins the all-reduce, so every rank gets the
    same moments and the result does not depend on how the entries are split across processes. n = 0: mean 0, var 0.
    """
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for values, mask in pairs:
        x, m = values.detach().double(), (mask > 0).double()
        sums += torch.stack([m.sum(), (x * m).sum(), (x * x * m).sum()])
    if dist.is_initialized():
        dist.all_reduce(sums)
    n, total, squares = sums.tolist()
    mean = total / max(n, 1.0)
    return n, mean, max(squares / max(n, 1.0) - mean * mean, 0.0)


# -----------------------------------------------------------------------------
# Sampling groups and scoring them


def mix_seed(*numbers):
    """A 63-bit seed from several values (base seed, step, rank, round): every call site gets its own stream."""
    digest = hashlib.sha256(",".join(map(str, numbers)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def score_group(task, conversation, completions, tokenizer):
    """
    (rewards, errors) of one prompt's completions, lists of floats and bools (tasks.completion_reward): the
    verifier's reward, 0 for an answer that ran into max_tokens, 0 and error True where the verifier failed.
    """
    scored = [completion_reward(task, conversation, completion_text(tokenizer, c), c.finish) for c in completions]
    return [reward for reward, _ in scored], [error for _, error in scored]


def sample_groups(engine, task, num_groups, group_size, max_tokens, sampling, seed, filter_zero_contrast=True,
                  max_rounds=4, overlong_buffer=0, rank=0, world_size=1, oversample=1.0, temperature_of=None,
                  on_group=None):
    """
    Roll out `num_groups` groups of `group_size` completions on this rank. Each round takes
    ceil(oversample * num_groups) prompts of `task`, generates all their groups in one Engine.generate call, scores
    them, and keeps groups in order until num_groups are kept (oversample > 1: more groups per call, so that fewer
    rounds are needed when most groups have no contrast). The prompts of a whole step are one draw without
    replacement (seeded by `seed`, which must be the same on every rank): round k of rank r takes chunk
    k * world_size + r of it, so a step never holds the same prompt twice, across rounds or ranks; the sampling
    noise differs per rank and round.

    With filter_zero_contrast (DAPO's dynamic sampling), a group without contrast is dropped and sampling
    continues, for at most max_rounds rounds (or until the task has no unseen prompt left): the batch may then come
    back short, never with a zero-contrast group. Contrast is decided on the verifier's rewards of the completions
    it scored without error (DAPO keeps 0 < accuracy < 1), never on shaped rewards: a group whose answers are all
    right must not pass because one ran into the overlong buffer, or std scaling would turn a 1/64 length penalty
    into full-size advantages. overlong_buffer > 0 then adds overlong_penalty to each reward of the kept groups:
    within a group that has contrast, shaping moves each advantage by its penalty / the group's std.

    Returns (groups, stats). A group is {"prompt": ids, "completions": [Completion], "rewards": [float] (shaped),
    "errors": [bool] (the verifier failed: no reward, left out of training by learner_rows)}; stats are sums over
    every sampled group, kept or not: the logs count the outcomes of filtered groups too.

    temperature_of(conversation) -> float, optional (PTGS): each group's sampling temperature, drawn once before
    generation; prompts of equal temperature share one generate call, and a kept group carries "temperature".
    on_group(conversation, rewards, errors, kept), optional: called for every scored group, kept or dropped (the
    per-source accounting and the PTGS posterior see the outcomes before zero-contrast groups are dropped).
    """
    if oversample < 1:
        raise ValueError(f"oversample must be >= 1 (prompts per round = oversample x groups needed), "
                         f"got {oversample}")
    tokenizer = engine.tokenizer
    per_round = math.ceil(oversample * num_groups)
    draws = random.Random(seed).sample(range(len(task)), min(len(task), max_rounds * world_size * per_round))
    groups = []
    stats = dict.fromkeys(["groups", "completions", "reward_sum", "reward_sq_sum", "correct", "errors",
                           "zero_contrast", "length_sum", "truncated", "rounds"], 0)
    stats["length_max"] = 0
    for round_index in range(max_rounds):
        start = (round_index * world_size + rank) * per_round
        indices = draws[start:start + per_round]
        if not indices:  # every prompt of the task is already in this step
            break
        conversations = [task[i] for i in indices]
        prompts = [tokenizer.render_for_completion(c) for c in conversations]
        if temperature_of is None:
            temperatures = [sampling["temperature"]] * len(prompts)
            results = engine.generate(prompts, num_samples=group_size, max_tokens=max_tokens,
                                      seed=mix_seed(seed, rank, round_index), **sampling)
        else:
            temperatures = [temperature_of(c) for c in conversations]
            results = [None] * len(prompts)
            for t in sorted(set(temperatures)):
                same = [i for i, ti in enumerate(temperatures) if ti == t]
                out = engine.generate([prompts[i] for i in same], num_samples=group_size, max_tokens=max_tokens,
                                      seed=mix_seed(seed, rank, round_index, t), **{**sampling, "temperature": t})
                for i, completions in zip(same, out):
                    results[i] = completions
        stats["rounds"] += 1
        for conversation, prompt, completions, temperature in zip(conversations, prompts, results, temperatures):
            rewards, errors = score_group(task, conversation, completions, tokenizer)
            lengths = torch.tensor([len(c.tokens) for c in completions])
            shaped = torch.tensor(rewards)
            if overlong_buffer > 0:
                shaped = shaped + overlong_penalty(lengths, max_tokens, overlong_buffer)
            zero_contrast = len({r for r, error in zip(rewards, errors) if not error}) < 2
            stats["groups"] += 1
            stats["completions"] += len(completions)
            stats["reward_sum"] += sum(rewards)
            stats["reward_sq_sum"] += sum(r * r for r in rewards)
            stats["correct"] += sum(r > 0 for r in rewards)
            stats["errors"] += sum(errors)
            stats["zero_contrast"] += zero_contrast
            stats["length_sum"] += int(lengths.sum())
            stats["length_max"] = max(stats["length_max"], int(lengths.max()))
            stats["truncated"] += sum(c.finish == "length" for c in completions)
            kept = len(groups) < num_groups and not (filter_zero_contrast and zero_contrast)
            if on_group is not None:
                on_group(conversation, rewards, errors, kept)
            if kept:
                groups.append({"prompt": prompt, "completions": completions, "rewards": shaped.tolist(),
                               "errors": errors, **({"temperature": temperature} if temperature_of else {})})
        if len(groups) == num_groups:
            break
    return groups, stats


def self_generated_pairs(engine, task, indices, num_samples, max_tokens, temperature, seed, prompts_per_batch=64,
                         unpaired=False):
    """
    On-policy preference pairs: sample `num_samples` answers to each task[i] with the engine, score each with
    score_group, and pair one correct answer (reward > 0) with one incorrect answer, each drawn at random
    among its kind; a prompt whose answers are all right or all wrong gives no pair. An answer that ran into
    max_tokens is incorrect whatever its text (it may be a rejected answer, never a chosen one: the pair then
    teaches to stop). An answer the verifier failed on (crash, timeout, nonsense) is neither: it is left out of the
    pair, and a prompt whose every answer errored counts as "unscored". The pair is made of the engine's own token
    ids, never re-tokenized: ids = prompt + completion tokens, mask = 0 on the prompt and the completion's mask (1
    where the model sampled the token, 0 on forced tool outputs). Returns (pairs as ((ids, mask), (ids, mask)),
    Counter of outcomes per prompt, plus "verifier errors" and "truncated" counted per answer).
    unpaired=True (KTO's data): no pairing; every distinct scored answer of every prompt is an example
    ((ids, mask), desirable), desirable = correct; the Counter has "desirable" and "undesirable" per answer.
    A task with a prefetch method (judge.JudgedTask) gets each batch's finished answers at once first.
    """
    pairs, stats = [], Counter()
    for start in range(0, len(indices), prompts_per_batch):
        batch = indices[start:start + prompts_per_batch]
        conversations = [task[i] for i in batch]
        prompts = [engine.tokenizer.render_for_completion(c) for c in conversations]
        results = engine.generate(prompts, num_samples=num_samples, max_tokens=max_tokens, temperature=temperature,
                                  seed=seed + start)
        if hasattr(task, "prefetch"):  # a judge: score the batch's finished answers concurrently, then one by one
            task.prefetch([(conversation, completion_text(engine.tokenizer, completion))
                           for conversation, completions in zip(conversations, results)
                           for completion in completions if completion.finish == "stop"])
        for i, conversation, prompt, completions in zip(batch, conversations, prompts, results):
            correct, incorrect = [], []
            for completion, reward, error in zip(completions, *score_group(task, conversation, completions,
                                                                           engine.tokenizer)):
                stats["verifier errors"] += int(error)
                stats["truncated"] += int(completion.finish == "length")
                stats["sampled tokens"] += len(completion.tokens)
                if not error:
                    (correct if reward > 0 else incorrect).append(completion)
            if unpaired:
                for desirable, kind in ((True, correct), (False, incorrect)):
                    distinct = dict.fromkeys((tuple(c.tokens), tuple(c.mask)) for c in kind)  # first-seen order
                    pairs.extend(((prompt + list(tokens), [0] * len(prompt) + list(mask)), desirable)
                                 for tokens, mask in distinct)
                    stats["desirable" if desirable else "undesirable"] += len(distinct)
                continue
            if not correct or not incorrect:
                stats["all correct" if correct else "all incorrect" if incorrect else "unscored"] += 1
                continue
            rng = random.Random(f"{seed}-{i}")
            chosen, rejected = rng.choice(correct), rng.choice(incorrect)
            pairs.append(tuple((prompt + c.tokens, [0] * len(prompt) + c.mask) for c in (chosen, rejected)))
            stats["paired"] += 1
    return pairs, stats


def preference_pairs(source, split, size, tokenizer, max_seq_len, engine=None, task=None, samples=8, max_new_tokens=64,
                     temperature=1.0, seed=0, index=None, unpaired=False):
    """
    This rank's share of the preference pairs of `split` (DPO's and the reward model's data), as
    ((ids, mask), (ids, mask)):
        source "self-generated": `engine` samples `samples` answers to each of this rank's problems of `task`
            (seed + 1_000_003 * rank) and self_generated_pairs pairs a right one with a wrong one; pairs with a side
            longer than max_seq_len are dropped ("too long");
        else the static preference_mixture(source, ...) ("synthetic" or "ultrafeedback"), rendered by render_pair.
    index (tasks.NgramIndex, optional): problems and rows that overlap an evaluation set are skipped ("contaminated").
    Returns (pairs, counts of what happened to the rows of all ranks, [(pairs, tokens of both sides)] per rank).
    unpaired=True (KTO): examples ((ids, mask), desirable) instead of pairs: self-generated, every distinct scored
    answer labelled by the verifier (self_generated_pairs(unpaired=True)); static, each pair split into its chosen
    (desirable) and rejected (undesirable) answer.
    """
    _, rank, _, world_size = common.get_dist_info()
    sides = (lambda item: item[:1]) if unpaired else (lambda item: item)  # the token sequences of a pair or example
    if source == "self-generated":
        indices = list(range(rank, len(task), world_size))
        clean = [i for i in indices if index is None or not index.contaminated(task[i])]
        contaminated, indices = len(indices) - len(clean), clean
        with autocast_ctx(next(engine.model.parameters()).device):
            pairs, counts = self_generated_pairs(engine, task, indices, samples, max_new_tokens, temperature,
                                                 seed=seed + 1_000_003 * rank, unpaired=unpaired)
        fits = [max(len(ids) for ids, _ in sides(item)) <= max_seq_len for item in pairs]
        counts["too long"] = fits.count(False)
        if unpaired:
            for (_, desirable), fit in zip(pairs, fits):
                counts["desirable" if desirable else "undesirable"] -= int(not fit)
        else:
            counts["paired"] -= counts["too long"]
        if index is not None:
            counts["contaminated"] = contaminated
        pairs = [pair for pair, fit in zip(pairs, fits) if fit]
    else:
        mixture = preference_mixture(source, split, size, seed)
        print0(f"{split} mixture:\n{mixture.summary()}")
        pairs, skipped = prepare_rows(mixture, partial(render_pair, tokenizer, max_seq_len=max_seq_len),
                                      range(rank, len(mixture), world_size), index=index)
        counts = Counter({f"{name} {reason}": count for (name, reason), count in skipped.items()})
        counts["paired"] = len(pairs)
        if unpaired:
            pairs = [example for chosen, rejected in pairs for example in ((chosen, True), (rejected, False))]
    share = (counts, len(pairs), sum(len(ids) for item in pairs for ids, _ in sides(item)))
    shares = [share]
    if dist.is_initialized():
        shares = [None] * world_size
        dist.all_gather_object(shares, share)
    return pairs, sum((s[0] for s in shares), Counter()), [s[1:] for s in shares]


# -----------------------------------------------------------------------------
# The learner's view of a rollout


def group_rewards(groups):
    """
    (rewards (N,), valid (N,) bool) of every completion of `groups`, in group order: the shaped rewards, and False
    where the verifier failed (group["errors"], optional): an error has no reward, and is not a wrong answer.
    """
    rewards = torch.tensor([r for g in groups for r in g["rewards"]])
    errors = [error for g in groups for error in g.get("errors", [False] * len(g["rewards"]))]
    return rewards, ~torch.tensor(errors, dtype=torch.bool)


def learner_rows(groups, values, mask_truncated):
    """
    One row per completion: (ids, mask, behavior_logprobs, value), ids = prompt + completion tokens exactly as
    sampled, mask 0 on the prompt and on forced tool output (and on the whole completion if it hit max_tokens and
    mask_truncated is set), behavior_logprobs the engine's log-prob of each token (0 on the prompt), value the
    completion's entry of `values` (a list in group order: its group advantage, or its reward that ppo.py turns into
    per-token ones). A completion the verifier failed on (group["errors"], optional) is not trained: mask 0.
    """
    errors = [error for g in groups for error in g.get("errors", [False] * len(g["rewards"]))]
    rows = []
    for group, completion in ((group, completion) for group in groups for completion in group["completions"]):
        keep = not (mask_truncated and completion.finish == "length") and not errors[len(rows)]
        mask = [0] * len(group["prompt"]) + [m * keep for m in completion.mask]
        behavior = [0.0] * len(group["prompt"]) + completion.logprobs
        rows.append((group["prompt"] + completion.tokens, mask, behavior, values[len(rows)]))
    return rows


def collate_rollouts(rows, pad_id, device):
    """
    Micro-batch tensors of learner rows, aligned for next-token prediction (position t predicts ids[t + 1]):
    inputs, targets (B, T) from tasks.collate (target -1 where not trained), mask (B, T) float,
    behavior (B, T) the engine's log-prob of targets[:, t], advantages (B,); rows with a fifth element, the
    temperature their group was sampled at (PTGS), also give temperature (B,).
    """
    inputs, targets = collate([(ids, mask) for ids, mask, *_ in rows], pad_id)
    behavior = torch.zeros(targets.shape)
    for b, (ids, _, logprobs, *_) in enumerate(rows):
        behavior[b, :len(ids) - 1] = torch.tensor(logprobs[1:])
    micro = {"inputs": inputs.to(device), "targets": targets.to(device), "mask": (targets >= 0).float().to(device),
             "behavior": behavior.to(device), "advantages": torch.tensor([row[3] for row in rows]).to(device)}
    if rows and len(rows[0]) > 4:
        micro["temperature"] = torch.tensor([row[4] for row in rows], dtype=torch.float32).to(device)
    return micro


def reference_sampling(sampling):
    """
    The distributions the KL penalty compares: the sampling temperature without the top-k/top-p cut. Truncation is
    a decoding choice, not part of either model; a truncated reference gives the tokens outside its support
    log-prob LOGP_FLOOR (an infinite KL, floored). Scoring the policy's side the same way keeps the KL 0 at equal
    weights; it costs a second forward pass of the policy when --top-k/--top-p are set.
    """
    return {**sampling, "top_k": None, "top_p": None}


def token_logprobs(model, inputs, targets, sampling):
    """
    (logp, entropy), both (B, T): the log-prob of each target token under the distribution the engine samples
    from (engine.sampling_logprobs: same temperature, top-k, top-p) and that distribution's entropy (no gradient).
    Computed a chunk of positions at a time (GPT.chunked_logits): the (B, T, V) logits never exist whole.
    sampling["temperature"] may be a tensor (B,), one per row (PTGS): the logits are divided by it first, which is
    what sampling_logprobs does with a scalar before its top-k/top-p cut. Entropy is then (B, T, 2): at each row's
    temperature, and of the untempered policy (softmax of the logits): rows drawn at 0.7 and 1.5 have entropies
    that differ by the temperature alone, so only the second compares across rows and runs.
    """
    row_temperature = ()
    if torch.is_tensor(sampling["temperature"]):  # per row: expanded to every position, chunked like the targets
        row_temperature = (sampling["temperature"].to(inputs.device, torch.float32)[:, None].expand(targets.shape),)
        sampling = {**sampling, "temperature": 1.0}

    def score(logits, target, *temperature):  # (N, V), (N,), optionally (N,)
        untempered = logits
        if temperature:
            logits = logits / temperature[0][:, None]
        logprobs = sampling_logprobs(logits, **sampling)  # (N, V)
        logp = logprobs.gather(-1, target.clamp(min=0)[:, None]).squeeze(-1).clamp(min=LOGP_FLOOR)  # (N,)
        entropy = torch.special.entr(logprobs.detach().exp()).sum(-1)  # (N,); entr(0) = 0 where top-k/top-p cut
        if temperature:
            base = torch.special.entr(untempered.detach().float().softmax(-1)).sum(-1)  # (N,)
            entropy = torch.stack([entropy, base], -1)  # (N, 2)
        return logp, entropy

    with autocast_ctx(inputs.device):
        return model.chunked_logits(model.hidden(inputs), score, targets, *row_temperature)


@torch.no_grad()
def reward_model_scores(reward_model, groups, pad_id, device, batch_tokens):
    """
    The reward model's raw score of every completion of `groups` (prompt + completion tokens, as sampled), read at
    the completion's last token (its <|assistant_end|>, or where max_tokens cut it), in group order: (N,) float.
    Scored in micro-batches of at most batch_tokens padded positions (tasks.token_budget_batches).
    """
    sequences = [group["prompt"] + completion.tokens for group in groups for completion in group["completions"]]
    scores = torch.zeros(len(sequences), device=device)
    for batch in token_budget_batches([[len(s)] for s in sequences], batch_tokens)[0]:
        ids, lengths = pad_sequences([sequences[i] for i in batch], pad_id)
        with autocast_ctx(device):
            values = reward_model(ids.to(device))  # (B, T)
        scores[batch] = values.gather(1, (lengths.to(device) - 1)[:, None]).squeeze(1).float()
    return scores


def all_reduce_gradients(model):
    """
    Sum gradients over ranks. Not DistributedDataParallel: dynamic sampling leaves ranks with different numbers
    of micro-batches, and DDP's per-backward all-reduce would have to be paired up across ranks.
    """
    for p in (p for p in model.parameters() if p.requires_grad):  # a LoRA base is frozen: nothing to sum
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)


def reduce_tally(tally, device):
    """
    A step's tally summed over ranks (keys ending in _min / _max: the min / max). Every rank must pass the same
    keys in the same order.
    """
    if not dist.is_initialized():
        return tally
    reduced = {}
    for op, keys in ((dist.ReduceOp.SUM, [k for k in tally if not k.endswith(("_min", "_max"))]),
                     (dist.ReduceOp.MIN, [k for k in tally if k.endswith("_min")]),
                     (dist.ReduceOp.MAX, [k for k in tally if k.endswith("_max")])):
        values = torch.tensor([float(tally[k]) for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(values, op=op)
        reduced.update(zip(keys, values.tolist()))
    return reduced


# -----------------------------------------------------------------------------
# Prompts: task mixtures with per-source accounting, decontamination


def parse_task_mixture(spec):
    """
    '--task' as [(name, weight)]: 'synthetic' -> [('synthetic', 1.0)]; 'synthetic:1,gsm8k:2' -> two sources,
    weights relative. A name is a task of tasks.TASKS that RL can train on (a generative task, with its verifier, or
    prompts for a reward model; a multiple-choice task has no verifier of sampled answers). Raises ValueError on an
    unknown name, a repeated one or a weight that is not > 0.
    """
    sources = []
    for part in spec.split(","):
        name, _, weight = part.strip().partition(":")
        try:
            weight = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"--task {spec!r}: weight {weight!r} of {name!r} is not a number") from None
        trainable = registered_tasks("generative", "prompts")
        if name not in trainable:
            raise ValueError(f"--task {spec!r}: {name!r} is not a task RL can train on; expected one of "
                             f"{', '.join(trainable)} (tasks.TASKS; name:weight, ...)")
        if not weight > 0 or name in dict(sources):
            raise ValueError(f"--task {spec!r}: each task once, with a weight > 0 (got {name!r}: {weight})")
        sources.append((name, weight))
    return sources


def decontaminate_prompts(mixture, index):
    """(the mixture without prompts that overlap an evaluation set, {source: prompts dropped}); see tasks.decontamination_index."""
    dirty = [index.contaminated(mixture[k]) for k in range(len(mixture))]
    dropped = {name: sum(d and mixture.rows[k][0] == name for k, d in enumerate(dirty)) for name in mixture.tasks}
    return mixture.keep([k for k, d in enumerate(dirty) if not d]), dropped


SOURCE_FIELDS = ("groups_dispatched", "groups_kept", "valid_tokens", "loss_mass")


def source_tally(sources):
    """Zeroed per-source counters, one flat key per (source, field): the same keys on every rank (reduce_tally)."""
    return {f"source/{name}/{field}": 0.0 for name in sources for field in SOURCE_FIELDS}


def account_sources(tally, micros):
    """
    Per source, the trained rows' valid tokens (mask 1) and their loss mass: sum over valid tokens of |A_t|, the
    weight each source has in the token-mean policy gradient, from the advantages the loss will use (GRPO's group
    advantage (B,) on every token of its row; PPO's whitened GAE advantages (B, T)). Adds to tally (source_tally
    keys); each micro-batch names the source of each row in micro["sources"] (learner_batches).
    """
    for micro in micros:
        advantages = micro["advantages"] if micro["advantages"].dim() == 2 else micro["advantages"][:, None]
        tokens, mass = micro["mask"].sum(1).tolist(), (advantages.abs() * micro["mask"]).sum(1).tolist()  # (B,)
        for name, n, m in zip(micro["sources"], tokens, mass):
            tally[f"source/{name}/valid_tokens"] += n
            tally[f"source/{name}/loss_mass"] += m


# -----------------------------------------------------------------------------
# The two RL stages' shared flags, and the entry points that keep the systems glue out of their main()


def add_flags(parser, run):
    """
    The flags rl.py and ppo.py share, in titled groups after `run` (add_stage_flags' "run and checkpoint" group):
    data and sizes; the recipe, the default recipe's flags first and the variants after; the reward; the opt-in
    systems. Returns {"data", "recipe", "reward", "systems"}: the groups a stage adds its own flags to.
    """
    run.add_argument("--save-every", type=int, help="checkpoint every N steps, for --resume (0: only the final one)")
    run.add_argument("--dry-run", action="store_true",
                     help="build the model, optimizers and data, print the plan (rl.py: its budget) and stop")
    groups = {name: parser.add_argument_group(title) for name, title in (
        ("data", "data and sizes"), ("recipe", "recipe: loss, advantages, sampling, mismatch, KL, optimization"),
        ("reward", "reward"), ("systems", "opt-in systems (off by default)"))}
    add = groups["data"].add_argument
    add("--task", help="training prompts and verifier: a name of tasks.TASKS (synthetic, gsm8k, ultrafeedback: "
                       "prompts with no verifier, for --reward rm, ...) or a weighted mixture 'synthetic:1,gsm8k:1' "
                       "(weights are shares of the prompts; logs count each source apart); held-out splits evaluated")
    add("--train-size", type=int, help="training problems drawn from (default: tiny 5000, full all of GSM8K)")
    add("--num-steps", type=int, help="optimizer batches (rollout + update rounds)")
    add("--prompts-per-step", type=int, help="groups per step over all ranks (divisible by the world size)")
    add("--group-size", type=int, help="completions sampled per prompt (G)")
    add("--max-tokens", type=int, help="generation budget per completion, forced tool output included")
    add("--device-batch-tokens", type=int, help="padded positions (sequences x longest) per forward/backward; at "
        "least the longest prompt + --max-tokens (tiny 8,192: 64 sequences of <= 128 tokens; full 16,384: "
        "16 sequences of a ~500-token prompt and a 512-token answer)")
    add("--eval-every", type=int,
        help="held-out evaluation every N steps, and at the start and the end (0: only at the start and the end)")
    add("--eval-problems", type=int, help="held-out problems evaluated")
    add("--eval-samples", type=int, help="samples per held-out problem: pass@1 and pass@N")
    add("--eval-temperature", type=float, default=1.0, help="held-out sampling temperature")
    add = groups["recipe"].add_argument
    add("--loss", choices=LOSS_KINDS, default="ppo", help="policy loss kind (see objectives.policy_loss)")
    add("--eps-low", type=float, default=None,
        help="lower clip: ratio >= 1 - eps_low (default per --loss, see LOSS_DEFAULTS: ppo 0.2, gspo 3e-4, cispo 1)")
    add("--eps-high", type=float, default=None,
        help="upper clip: ratio <= 1 + eps_high (default per --loss: ppo 0.28 clip-higher, gspo 4e-4, cispo 0.28)")
    add("--loss-agg", choices=AGGREGATIONS, default=None,
        help="how token losses are averaged (default per --loss: token-mean, gspo seq-mean-token-mean)")
    add("--filter-zero-contrast", action=argparse.BooleanOptionalAction, default=True,
        help="dynamic sampling (DAPO): drop groups whose rewards are all equal and sample more")
    add("--max-sampling-rounds", type=int, default=4, help="cap on generate calls per step under dynamic sampling")
    add("--oversample", type=float,
        help="prompts per sampling round = oversample x the groups needed, all in one generate call; the first "
             "groups with contrast are kept (e.g. 2-3 when most groups have none; 1: off; preset tiny 1, small and "
             "full 2)")
    add("--mismatch", choices=["none", "tis", "mask"], default="tis",
        help="engine/trainer log-prob mismatch correction (see objectives.mismatch_weights)")
    add("--tis-cap", type=float, default=2.0, help="truncation of the importance weight (--mismatch tis)")
    add("--temperature", type=float, default=1.0, help="sampling temperature; the learner scores at the same one")
    add("--epochs", type=int, default=1, help="optimizer passes over each rollout batch")
    add("--minibatches", type=int, default=1, help="optimizer steps per pass (the batch is split by groups)")
    add("--lr-frac", type=float, help="learning rates as a fraction of pretraining's (Muon + AdamW)")
    add("--warmup-steps", type=int, help="linear learning-rate warmup, then constant")
    add("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    add("--kl-coef", type=float, default=None,
        help="KL(pi || pi_ref) penalty weight, on the untruncated temperature-scaled distributions even with "
             "--top-k/--top-p (reference_sampling); 0 loads no reference model (default: 0, or 0.05 with --reward rm: "
             "a learned reward can be exploited, a verifier cannot)")
    add("--kl-kind", choices=KL_KINDS, default="k2", help="KL estimator (see objectives.kl_penalty)")
    add("--dual-clip", type=float, default=None,
        help="cap the loss of negative-advantage tokens at -c A, c > 1 (e.g. 3; ppo and gspo)")
    add("--mask-window", type=float, nargs=2, default=(0.5, 2.0), metavar=("LOW", "HIGH"),
        help="drop tokens whose trainer/engine probability ratio leaves [LOW, HIGH] (--mismatch mask)")
    add("--top-k", type=int, default=None, help="sample from the k most likely tokens (default: all)")
    add("--top-p", type=float, default=None, help="nucleus sampling mass (default: 1, no cut)")
    add("--mask-truncated", action="store_true", help="exclude completions that hit --max-tokens from the loss")
    add("--overlong-buffer", type=int, default=0, help="DAPO soft overlong penalty over the last N tokens (0: off)")
    add = groups["reward"].add_argument
    add("--reward", choices=["verifier", "rm", "judge"], default="verifier",
        help="verifier: the task's exact check; rm: the --rm-ckpt reward model's score of each completion, normalised "
             "per batch (objectives.normalize_scores); judge: the --judge-url LM judge's score / max_score (0 for a "
             "broken hard rule; judge.py); with rm or judge the verifier only measures (reward/accuracy, held-out "
             "pass@1)")
    add("--rm-ckpt", default=None, help="reward model checkpoint of rm.py (--reward rm)")
    add_judge_flags(groups["reward"])
    add = groups["systems"].add_argument
    add("--decontaminate", action=argparse.BooleanOptionalAction, default=None,
        help="drop training prompts that overlap an evaluation set in use or the held-out problems "
             "(tasks.decontamination_index: 13-grams, whole short questions); default on for full, off for tiny "
             "(the synthetic family is split by question hash)")
    add("--difficulty-filter", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
        help="before RL, sample --difficulty-samples answers per training prompt with the start checkpoint and keep "
             "prompts whose success rate is strictly inside (LOW, HIGH), e.g. 0.1 0.9 (cached in the checkpoint)")
    add("--difficulty-samples", type=int, default=16, help="answers per prompt for --difficulty-filter")
    add("--ptgs", action="store_true",
        help="per-task sampling temperature (PTGS, see TemperatureController); the learner scores each group at its "
             "temperature, around the pivot --temperature")
    add("--ptgs-target", type=float, default=0.5, help="PTGS target success rate q (the prior's mean, the pivot)")
    add("--ptgs-tau", type=float, default=1.5, help="PTGS temperature range: T in [T_ref / tau, T_ref * tau]")
    add("--ptgs-gamma", type=float, default=0.9, help="PTGS discount of a task's past successes and failures")
    add("--ptgs-prior", type=float, default=2.0, help="PTGS prior strength k: Beta(k q, k (1 - q))")
    add("--async", dest="async_rollouts", action="store_true",
        help="overlapped rollouts: a worker process generates step k + 1 with the weights of step k while the learner "
             "updates on step k (one step off policy; see RolloutWorker)")
    add("--async-delay", type=int, choices=(0, 1), default=1,
        help="policy versions between sampler and learner under --async (0: no overlap, the synchronous batches)")
    add("--max-policy-age", type=int, default=1,
        help="under --async, groups sampled more than this many updates before the learner's step are dropped and "
             "counted (rollout/stale_groups); at least --async-delay")
    return groups


# Every numeric flag of the RL stages and the values it accepts: (test, what the error says it must be). A value
# outside them would otherwise fail mid-run (a division by zero, an empty batch) or be silently meaningless.
NUMERIC_FLAGS = {
    "num_steps": (lambda v: v >= 1, ">= 1"), "prompts_per_step": (lambda v: v >= 1, ">= 1"),
    "group_size": (lambda v: v >= 2, ">= 2 (a group's advantages compare its answers)"),
    "max_tokens": (lambda v: v >= 1, ">= 1"), "train_size": (lambda v: v is None or v >= 1, ">= 1"),
    "temperature": (lambda v: v > 0, "> 0 (the learner scores at it; --eval-temperature 0 is greedy evaluation)"),
    "eval_temperature": (lambda v: v >= 0, ">= 0 (0: greedy)"),
    "top_k": (lambda v: v is None or v >= 1, ">= 1"), "top_p": (lambda v: v is None or 0 < v <= 1, "in (0, 1]"),
    "max_sampling_rounds": (lambda v: v >= 1, ">= 1"), "oversample": (lambda v: v >= 1, ">= 1"),
    "difficulty_samples": (lambda v: v >= 1, ">= 1"),
    "difficulty_filter": (lambda v: v is None or 0 <= v[0] < v[1] <= 1, "LOW HIGH with 0 <= LOW < HIGH <= 1"),
    "overlong_buffer": (lambda v: v >= 0, ">= 0 (0: off)"),
    "eps_low": (lambda v: 0 <= v <= 1, "in [0, 1]"), "eps_high": (lambda v: v >= 0, ">= 0"),
    "kl_coef": (lambda v: v >= 0, ">= 0 (0: off)"), "tis_cap": (lambda v: v > 0, "> 0"),
    "mask_window": (lambda v: 0 <= v[0] < v[1], "LOW HIGH with 0 <= LOW < HIGH"),
    "epochs": (lambda v: v >= 1, ">= 1"), "minibatches": (lambda v: v >= 1, ">= 1"),
    "device_batch_tokens": (lambda v: v >= 1, ">= 1"), "lr_frac": (lambda v: v > 0, "> 0"),
    "warmup_steps": (lambda v: v >= 0, ">= 0 (0: none)"), "max_grad_norm": (lambda v: v >= 0, ">= 0 (0: off)"),
    "eval_every": (lambda v: v >= 0, ">= 0 (0: only at the start and the end)"),
    "eval_problems": (lambda v: v >= 1, ">= 1"), "eval_samples": (lambda v: v >= 1, ">= 1"),
    "save_every": (lambda v: v >= 0, ">= 0 (0: only the final checkpoint)"),
    "ptgs_target": (lambda v: 0 < v < 1, "in (0, 1)"), "ptgs_tau": (lambda v: v >= 1, ">= 1"),
    "ptgs_gamma": (lambda v: 0 <= v <= 1, "in [0, 1]"), "ptgs_prior": (lambda v: v > 0, "> 0"),
    "max_policy_age": (lambda v: v >= 0, ">= 0"),
}


def check_numeric_flags(parser, args, rules):
    """parser.error (one line, exit 2) on the first flag of `rules` ({dest: (test, text)}) whose value fails."""
    for dest, (ok, must) in rules.items():
        if not ok(getattr(args, dest)):
            parser.error(f"--{dest.replace('_', '-')} must be {must}, got {getattr(args, dest)}")


def finish_args(parser, args):
    """Fill the preset's and the loss kind's defaults, then refuse the values and combinations that cannot run."""
    args.fit_batch = args.device_batch_tokens is None  # on a GPU: the largest that fits, up to the preset's
    fill_preset(args, PRESETS[args.preset])
    filled = {key: value for key, value in LOSS_DEFAULTS[args.loss].items() if getattr(args, key) is None}
    for key, value in filled.items():
        setattr(args, key, value)
    if filled:
        print0(f"loss {args.loss}: paper defaults " + ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                                                                 for k, v in filled.items()))
    if args.loss == "pg" and (args.epochs > 1 or args.minibatches > 1):
        raise ValueError(f"--loss pg is on-policy REINFORCE (no old log-probs, no clipping), but --epochs "
                         f"{args.epochs} / --minibatches {args.minibatches} > 1 update on data from older weights; "
                         "use --loss ppo (or cispo) for several updates per batch")
    if args.dual_clip is not None and not args.dual_clip > 1:
        raise ValueError(f"--dual-clip must be > 1 (the loss of a negative-advantage token is capped at -c A), "
                         f"got {args.dual_clip}")
    if args.kl_coef is None:
        args.kl_coef = 0.05 if args.reward == "rm" else 0.0
    check_numeric_flags(parser, args, NUMERIC_FLAGS)
    if args.overlong_buffer > args.max_tokens:
        parser.error(f"--overlong-buffer {args.overlong_buffer} is longer than --max-tokens {args.max_tokens}")
    if args.reward == "rm" and args.rm_ckpt is None:
        parser.error("--reward rm needs --rm-ckpt PATH (a checkpoint written by rm.py)")
    if args.reward == "rm" and args.overlong_buffer:
        parser.error("--overlong-buffer shapes verifier rewards; it does not apply to --reward rm")
    if args.reward == "judge" and args.judge_url is None:
        parser.error("--reward judge needs --judge-url URL and --judge-rubric FILE (judge.py)")
    if args.reward == "judge" and args.async_rollouts:
        parser.error("--reward judge with --async is not supported: the rollout process would need its own judge "
                     "client; drop --async")
    parse_task_mixture(args.task)  # a bad --task fails before any model is loaded
    if args.ptgs and args.reward == "rm":
        parser.error("--ptgs with --reward rm: the controller learns each task's success rate from the verifier, "
                     "not from the reward model's score that is optimised (with no verifier every task looks "
                     "unsolved and temperatures climb to the cap); use one or the other")
    if args.async_rollouts and args.max_policy_age < args.async_delay:
        parser.error(f"--max-policy-age {args.max_policy_age} is below --async-delay {args.async_delay}: every "
                     "overlapped batch would be dropped as stale")
    if args.async_rollouts and args.async_delay > 0 and args.mismatch == "none":
        parser.error("--async samples with weights one update old; --mismatch none would train on them uncorrected: "
                     "use --mismatch tis or mask (or --async-delay 0)")
    if args.async_rollouts and args.ptgs:
        raise ValueError("--async with --ptgs is not supported: the controller would draw in the worker from a "
                         "posterior the learner updates; use one or the other")
    return args


def load_reward_model(args, tokenizer, device):
    """--reward rm: the frozen reward model of rm.py that scores the rollouts, or None."""
    if args.reward != "rm":
        return None
    reward_model, rm_tokenizer, rm_meta = load_model(args.rm_ckpt, device)
    if not rm_meta.get("reward_model") or rm_tokenizer.encode("a test 123") != tokenizer.encode("a test 123") \
            or rm_tokenizer.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"--rm-ckpt {args.rm_ckpt} is not a reward model of this policy's tokenizer; "
                         "train one with rm.py from the same SFT checkpoint")
    return reward_model.requires_grad_(False)


def reward_judge(args):
    """rl.py/ppo.py --reward judge: the judge.JudgeVerifier of the --judge-* flags; None without them; ValueError for
    a judge the run would not use."""
    return judge_from_args(args, args.reward == "judge", "use it with --reward judge")


def prepare_prompts(args, world_size, judge=None):
    """
    The training prompts and the held-out problems of --task: (train_task, test_task, eval_indices, decontaminated
    {source: prompts dropped}). judge (reward_judge's) scores the training rollouts; the held-out problems keep their
    verifier. With --decontaminate, training prompts that overlap the preset's evaluation sets or
    the held-out problems evaluated here are dropped. The difficulty filter is a second step (difficulty_prompts):
    it samples with the model, so a --dry-run skips it.
    """
    sources = parse_task_mixture(args.task)
    train_task = PromptMixture([(name, task_by_name(name, "train", args.train_size), w) for name, w in sources])
    if judge:
        train_task.tasks = {name: JudgedTask(task, judge, graded=True) for name, task in train_task.tasks.items()}
    test_task = PromptMixture([(name, task_by_name(name, "test", args.eval_problems), w) for name, w in sources])
    eval_indices = list(range(min(args.eval_problems, len(test_task))))
    decontaminated = {}
    if args.decontaminate:
        held_out = [text for i in range(len(test_task)) for text in row_texts(test_task[i])[:1]]
        train_task, decontaminated = decontaminate_prompts(train_task, decontamination_index(args.preset, held_out))
        print0(f"decontamination: dropped training prompts per source {decontaminated}")
    if len(sources) > 1:
        print0(f"mixture: training prompts per source {train_task.counts()}")
    print0(f"task {args.task}: {len(train_task):,} training prompts, {len(eval_indices)} held-out problems; "
           f"{args.prompts_per_step} prompts x {args.group_size} samples per step "
           f"({args.prompts_per_step // world_size} prompts per rank)")
    return train_task, test_task, eval_indices, decontaminated


def learner_batches(groups, values, args, pad_id, device):
    """
    The groups split into --minibatches (by group), each as micro-batches of at most --device-batch-tokens padded
    positions (sorted by length: less padding, same loss). values: one per completion in group order, what each row
    carries (rl.py: its group advantage; ppo.py: its raw reward). PTGS rows carry their group's temperature; every
    micro-batch names each row's source (micro["sources"]). Returns (minibatches, [real, padded] positions).
    """
    minibatches, positions, done = [], [0, 0], 0
    for m in range(args.minibatches):
        part = groups[m * len(groups) // args.minibatches:(m + 1) * len(groups) // args.minibatches]
        size = sum(len(g["completions"]) for g in part)
        rows = learner_rows(part, values[done:done + size], args.mask_truncated)
        done += size
        if args.ptgs:  # each row carries its group's temperature (collate_rollouts)
            rows = [row + (g["temperature"],) for row, g in zip(rows, (g for g in part for _ in g["completions"]))]
        sources = [g["source"] for g in part for _ in g["completions"]]  # of each row (account_sources)
        batches, _ = token_budget_batches([[len(row[0]) - 1] for row in rows], args.device_batch_tokens)
        minibatches.append([{**collate_rollouts([rows[i] for i in batch], pad_id, device),
                             "sources": [sources[i] for i in batch]} for batch in batches])
        positions[0] += sum(len(row[0]) - 1 for row in rows)
        positions[1] += sum(int(micro["inputs"].numel()) for micro in minibatches[-1])
    return minibatches, positions


def learner_tally(rollout_tally, groups, positions):
    """A step's counters, the same keys on every rank (reduce_tally): the rollout's, then the learner's, zeroed."""
    return {**rollout_tally, "groups_kept": len(groups), "trained_tokens": 0, "entropy_sum": 0.0,
            "entropy_t1_sum": 0.0, "gap_sum": 0.0, "gap_max": 0.0, "corrected": 0.0, "loss_sum": 0.0, "kl_sum": 0.0,
            "loss_tokens": 0, "clip_low_sum": 0.0, "clip_high_sum": 0.0, "ratio_sum": 0.0, "ratio_min": math.inf,
            "ratio_max": -math.inf, "positions_real": positions[0], "positions_padded": positions[1],
            "value_loss_sum": 0.0, "value_clip_sum": 0.0}


def score_old(micro, old_logp, entropy, tally, args):
    """
    A micro-batch's old log-probs (the weights that sampled it, as the learner scores them), its mismatch weights
    against the engine's behavior log-probs, and the gap and entropy it adds to the tally (under PTGS also the
    untempered policy's entropy: token_logprobs' entropy (B, T, 2)).
    """
    micro["old_logp"], mask = old_logp, micro["mask"]
    micro["weights"] = mismatch_weights(old_logp, micro["behavior"], args.mismatch, args.tis_cap, args.mask_window)
    gap = (old_logp - micro["behavior"]).abs() * mask
    tally["gap_sum"] += float(gap.sum())
    tally["gap_max"] = max(tally["gap_max"], float(gap.max()))
    if entropy.dim() == 3:
        tally["entropy_t1_sum"] += float((entropy[..., 1] * mask).sum())
        entropy = entropy[..., 0]
    tally["entropy_sum"] += float((entropy * mask).sum())
    tally["trained_tokens"] += int(mask.sum())
    tally["corrected"] += float(((micro["weights"] != 1) * mask).sum())


def row_sampling(sampling, micro):
    """The distribution a micro-batch's rows are scored under: PTGS rows at the temperature their group sampled at."""
    return {**sampling, "temperature": micro["temperature"]} if "temperature" in micro else sampling


def batch_counts(minibatches, loss_agg, device):
    """
    Per minibatch, the global count the loss is averaged over (valid tokens for token-mean, else sequences) and the
    global valid-token count, summed over ranks: ([count], [tokens]).
    """
    per_minibatch = torch.tensor([[sum(float(m["mask"].sum()) for m in mb),
                                   sum(float((m["mask"].sum(-1) > 0).sum()) for m in mb)] for mb in minibatches],
                                 dtype=torch.float64, device=device)  # (minibatches, 2): tokens, sequences
    if dist.is_initialized():
        dist.all_reduce(per_minibatch)
    return per_minibatch[:, 0 if loss_agg == "token-mean" else 1].tolist(), per_minibatch[:, 0].tolist()


def add_loss_stats(tally, loss, stats, num_tokens):
    """A micro-batch's policy loss and clip/ratio statistics, into the step's tally."""
    tally["loss_sum"] += loss.item()  # summed over micro-batches and ranks: the minibatch losses
    tally["loss_tokens"] += num_tokens
    tally["clip_low_sum"] += stats["clip_low"] * num_tokens
    tally["clip_high_sum"] += stats["clip_high"] * num_tokens
    tally["ratio_sum"] += stats["ratio_mean"] * num_tokens
    tally["ratio_min"] = min(tally["ratio_min"], stats["ratio_min"])
    tally["ratio_max"] = max(tally["ratio_max"], stats["ratio_max"])


def evaluate_held_out(engine, test_task, eval_indices, args, step, reward_model=None):
    """
    Held-out pass@1 / pass@k of the policy (eval.evaluate_generative) and, with a reward model, its mean score of
    one sample per problem: the optimised reward's view next to the verifier's, so over-optimisation shows.
    """
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    result = evaluate_generative(engine, test_task, eval_indices, num_samples=args.eval_samples,
                                 ks=(1, args.eval_samples), max_tokens=args.max_tokens,
                                 temperature=args.eval_temperature, top_k=args.top_k, top_p=args.top_p,
                                 seed=mix_seed(args.seed, "eval"))
    k = f"pass@{args.eval_samples}"
    record = {"step": step, "pass@1": result["pass@1"], k: result[k], "errors": result["errors"],
              "truncated": result["truncated"]}
    if reward_model is not None:
        device = next(engine.model.parameters()).device
        with autocast_ctx(device):
            groups, _ = sample_groups(engine, test_task, len(eval_indices), 1, args.max_tokens, sampling,
                                      seed=mix_seed(args.seed, "eval-rm"), filter_zero_contrast=False, max_rounds=1)
        record["rm_score"] = float(reward_model_scores(reward_model, groups, engine.tokenizer.token_id(
            "<|assistant_end|>"), device, args.device_batch_tokens).mean())
    print0(f"eval step {step}: pass@1 {record['pass@1']:.4f}, {k} {record[k]:.4f}"
           + (f", reward-model score {record['rm_score']:+.3f}" if "rm_score" in record else ""))
    return record


def step_metrics(tally, optimizer_steps, grad_norms, seconds, info, sources, source_totals):
    """
    The logged metrics of a step from its reduced tally: rollout outcomes of every sampled group (filtered ones
    included), learner statistics, timings (seconds: rollout, learner), per-source accounting (also added to
    source_totals, the run's sums for the report). A step that trained no token (every group zero-contrast) has
    NaN per-token learner statistics: nothing was measured, and a 0 would read as a collapsed entropy in a figure.
    """
    world_size = get_dist_info()[3]
    n = max(tally["completions"], 1)
    tokens = tally["trained_tokens"] or math.nan
    loss_tokens = tally["loss_tokens"] or math.nan
    reward_mean = tally["reward_sum"] / n
    rollout_s, learner_s = seconds
    metrics = {"reward/mean": reward_mean,
               "reward/std": math.sqrt(max(tally["reward_sq_sum"] / n - reward_mean ** 2, 0.0)),
               "reward/accuracy": tally["correct"] / n,
               "reward/errors": tally["errors"],
               "batch/zero_contrast_frac": tally["zero_contrast"] / max(tally["groups"], 1),
               "batch/groups_kept": tally["groups_kept"], "batch/sampling_rounds": tally["rounds"] / world_size,
               "batch/padding_frac": 1 - tally["positions_real"] / max(tally["positions_padded"], 1),
               "length/mean": tally["length_sum"] / n, "length/max": tally["length_max"],
               "length/truncated_frac": tally["truncated"] / n,
               "policy/entropy": tally["entropy_sum"] / tokens,
               "policy/loss": tally["loss_sum"] / max(optimizer_steps, 1),
               "policy/clip_low": tally["clip_low_sum"] / loss_tokens,
               "policy/clip_high": tally["clip_high_sum"] / loss_tokens,
               "mismatch/logp_gap_mean": tally["gap_sum"] / tokens, "mismatch/logp_gap_max": tally["gap_max"],
               "mismatch/corrected_frac": tally["corrected"] / tokens,
               "optim/steps": optimizer_steps, "time/rollout_s": rollout_s, "time/learner_s": learner_s,
               "time/rollout_tokens_per_s": tally["length_sum"] / max(rollout_s, 1e-9)}
    if "rollout_s" in info:  # --async: rollout is the worker's generation time; idle the learner waiting for it
        metrics.update({"time/rollout_s": info["rollout_s"], "time/idle_s": rollout_s,
                        "time/rollout_tokens_per_s": tally["length_sum"] / max(info["rollout_s"], 1e-9),
                        "policy/age_mean": sum(info["ages"]) / len(info["ages"]), "policy/age_max": max(info["ages"]),
                        "rollout/stale_groups": tally["stale_groups"]})
    if tally["entropy_t1_sum"]:  # PTGS: the untempered policy's entropy, comparable across temperatures
        metrics["policy/entropy_t1"] = tally["entropy_t1_sum"] / tokens
    if tally["loss_tokens"]:
        metrics.update({"policy/ratio_mean": tally["ratio_sum"] / loss_tokens,
                        "policy/ratio_min": tally["ratio_min"], "policy/ratio_max": tally["ratio_max"]})
    if grad_norms:
        metrics["optim/grad_norm"] = sum(grad_norms) / len(grad_norms)
    mass = sum(tally[f"source/{name}/loss_mass"] for name in sources)
    for name in sources:  # per-source accounting: a fast or easy source cannot take over unseen
        for field in SOURCE_FIELDS:
            source_totals[f"{name}/{field}"] += tally[f"source/{name}/{field}"]
            metrics[f"source/{name}/{field}"] = tally[f"source/{name}/{field}"]
        metrics[f"source/{name}/loss_share"] = tally[f"source/{name}/loss_mass"] / max(mass, 1e-12)
    if len(sources) > 1:
        print0("  sources: " + " | ".join(
            f"{name} dispatched {metrics[f'source/{name}/groups_dispatched']:.0f} kept "
            f"{metrics[f'source/{name}/groups_kept']:.0f} tokens {metrics[f'source/{name}/valid_tokens']:.0f} "
            f"loss share {metrics[f'source/{name}/loss_share']:.2f}" for name in sources))
    return metrics


def print_step(step, num_steps, metrics, extra_line, seconds, eta):
    """The step's progress line (rank 0)."""
    idle = f"idle {seconds[0]:.1f}s age {metrics['policy/age_max']:.0f} " if "policy/age_max" in metrics else ""
    print0(f"step {step + 1}/{num_steps} | reward {metrics['reward/mean']:.3f} {extra_line}"
           f"| zero-contrast {metrics['batch/zero_contrast_frac']:.2f} kept {metrics['batch/groups_kept']:.0f} "
           f"| len {metrics['length/mean']:.1f} trunc {metrics['length/truncated_frac']:.2f} "
           f"pad {metrics['batch/padding_frac']:.0%} "
           f"| loss {metrics['policy/loss']:+.4f} "
           f"clip {metrics['policy/clip_low']:.3f}/{metrics['policy/clip_high']:.3f} "
           f"| entropy {metrics['policy/entropy']:.3f} "
           + (f"(T 1: {metrics['policy/entropy_t1']:.3f}) " if "policy/entropy_t1" in metrics else "")
           + f"| gap {metrics['mismatch/logp_gap_mean']:.1e} "
           f"| rollout {metrics['time/rollout_s']:.1f}s {metrics['time/rollout_tokens_per_s']:.0f} tok/s, "
           f"learn {seconds[1]:.1f}s " + idle + f"| ETA {format_eta(eta)}")


def report_record(stage, args, history, eval_count, seconds, source_totals, decontaminated, train_prompts):
    """The stage's row of the report card (common.append_report): held-out results before and after, the run's
    per-source sums; with a reward model (history carries rm_score) its score before and after."""
    before, after = history[0], history[-1]
    k = f"pass@{args.eval_samples}"
    print0(f"held-out pass@1 {before['pass@1']:.4f} -> {after['pass@1']:.4f}, {k} {before[k]:.4f} -> {after[k]:.4f}"
           + (f", reward-model score {before['rm_score']:+.3f} -> {after['rm_score']:+.3f}"
              if "rm_score" in after else ""))
    extra = {}
    if "rm_score" in after:
        extra = {"reward": "rm", "rm_score_before": before["rm_score"], "rm_score": after["rm_score"],
                 "kl_coef": args.kl_coef}
    return {"stage": stage, **extra, "preset": args.preset, "task": args.task, "steps": args.num_steps,
            "seed": args.seed, "pass@1_before": before["pass@1"], "pass@1": after["pass@1"], f"{k}_before": before[k],
            k: after[k], "eval_problems": eval_count, "truncated": after.get("truncated"),
            "verifier_errors": after["errors"], "eval_samples": args.eval_samples, "seconds": seconds,
            "sources": dict(source_totals), "decontaminated": decontaminated, "ptgs": args.ptgs,
            "train_prompts": train_prompts}

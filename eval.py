"""
Evaluate checkpoints; the report card (report.py) is re-rendered after each evaluation.

    python eval.py --stage base                               # tiny preset: validation bits per byte
    python eval.py --stage sft                                # + the synthetic task, greedy pass@1
    python eval.py --stage rl --num-samples 16 --k 1,4,16     # pass@k from 16 samples per problem (temperature 1)
    python eval.py --stage base sft dpo rl                    # several checkpoints in one process (speedrun.sh)
    python eval.py --compare sft rl --num-samples 16          # coverage: did RL buy pass@1 with pass@k?
    python eval.py --report-only                              # re-render $NANOPOST_HOME/report.md (= python report.py)
    NANOPOST_DATA_DIR=data torchrun --nproc_per_node=8 eval.py --preset full --stage sft --tasks gsm8k,arc-easy,mmlu

What is measured (--tasks):
- bpb: bits per byte of the preset's validation text (tasks.pretraining_texts(preset, "val")). Independent of the
  tokenizer; lower is better. Computed for every stage, so it also shows what post-training costs in plain text.
- arc-easy, arc-challenge, mmlu: multiple choice, scored without sampling.
  Base checkpoint (lm-eval-harness style): each choice is a continuation of the prompt and scored by the sum of its
  tokens' log-probs. acc picks the largest sum; acc_norm the largest sum per character of the continuation, which
  stops long answers from losing just for being long. ARC continues "Question: ...\\nAnswer:" with the answer
  text (0-shot by default, like the harness); MMLU lists lettered choices and continues with " A", " B", ...
  (5-shot by default, as in the MMLU paper). Few-shot examples are other items of the same subject from the same
  split, drawn with a seed per item.
  Chat checkpoints: the question and its lettered choices are one user turn; the answer is the letter whose token
  gets the highest log-prob right after <|assistant_start|>, among the choices' letters. No sampling and no parsing,
  so a model that would ramble first is still scored on what it believes.
- core: nanochat's headline number, the DCLM CORE metric (core.py): 22 few-shot tasks of the eval bundle
  (`python tasks.py prepare` downloads it), each task's accuracy centred on its random baseline, then averaged
  (0 = chance, 1 = perfect; GPT-2 1.5B 0.2565). Every item (full), the first 500 per task (small) or
  --max-problems. Any stage can be scored; the GPU presets score the base checkpoint, as nanochat's leaderboard does.
- synthetic, gsm8k: generative. num_samples completions per problem from the engine (calculator on), checked by
  the task's strict verifier. pass@k is the unbiased estimator (report.pass_at_k) averaged over problems. One sample is
  greedy by default; several are sampled at temperature 1, the policy's own distribution. Next to pass@k, maj@k
  (k > 1): is the majority answer of the first k samples the right one (majority_vote: no-answer completions do
  not vote; a tie goes to the answer sampled first)? pass@k asks whether any sample is right, maj@k whether the
  model can tell by voting, without a verifier.
- coverage (from the same per-problem counts, in the report): the pass@k curve k = 1..n averaged over problems,
  the coverage gain A = pass@n - pass@1 and S = A / (1 - pass@1), with bootstrap intervals over problems (report.py).
  RL that sharpens a model raises pass@1 and shrinks A and S: it samples what it could already find more often.
  The Sharpening tax between two stages is the paired change dA, dS (report.paired_coverage_delta): one bootstrap
  resample of the problems scores both stages. Only evaluations with the same n, temperature, top-k, max_tokens
  and problems (recorded with the counts) are compared; others are refused with the reason (report.check_comparable).

Each checkpoint evaluated appends {"stage": "eval", "of": <stage>, "metrics": {...}, "coverage": {...}} to
report.jsonl (common.append_report) and report.md is re-rendered (report.write_report). Under torchrun every rank
takes every world_size-th problem and the exact counts are summed across ranks (at temperature 0 the result is the one a
single process gets; sampled completions depend on how problems are batched, so they agree in distribution).
"""

import argparse
import hashlib
import json
import math
import random
import time
from collections import Counter
from functools import partial
from itertools import islice

import torch
import torch.distributed as dist
import torch.nn.functional as F

import common
import core
import report
from common import autocast_ctx, format_eta, get_dist_info, print0
from engine import Engine, load_model
from tasks import (LETTERS, MultipleChoice, canonical_number, collate, completion_reward, extract_final_answer,
                   pretraining_batches, pretraining_texts, registered_tasks, task_by_name, token_budget_batches)

# The checkpoints eval.py evaluates: the pipeline's, and those the README's alternatives write (dpo.py --loss orpo /
# kto: checkpoints/orpo / kto, sft.py --rft-rounds: checkpoints/rft) and distill.py, so that they share the coverage
# table.
STAGES = ("base", "sft", "dpo", "rl", "ppo", "rlhf", "distill", "merge", "rft", "orpo", "kto")
MC_TASKS = tuple(MultipleChoice.SOURCES)  # arc-easy, arc-challenge, mmlu
MC_STYLE = {"arc-easy": "continuation", "arc-challenge": "continuation", "mmlu": "letter"}
MC_SHOTS = {"arc-easy": 0, "arc-challenge": 0, "mmlu": 5}
# The split a benchmark defines its few-shot examples in (MMLU's 5 per subject: `dev`, as Hendrycks et al. 2021 and
# lm-evaluation-harness); a task without one draws them from the other evaluated items.
MC_SHOT_SPLIT = {"mmlu": "dev"}

PRESETS = {
    # tiny: the synthetic world only (offline, seconds on a CPU). The hub tasks are the small and full presets'.
    # bpb_tokens: the validation tokens of pretrain.py's presets, so the base checkpoint's bpb is its final val_bpb.
    # tiny max_problems: the 128 held-out problems rl.py's own evaluation samples too.
    "tiny": {"base_tasks": "bpb", "chat_tasks": "bpb,synthetic", "core_items": None, "max_problems": 128,
             "max_tokens": 96, "bpb_tokens": 16384, "batch_size": 32},
    # small: one 24 GB GPU; the first 400 problems of each task keep the generative ones to minutes.
    # core (core.py): base checkpoints only. core_items: items per task (None: all, the leaderboard's number; small:
    # the first 500 of each shuffled task, the estimate nanochat's base_train.py prints during training).
    "small": {"base_tasks": "bpb,core,arc-easy,arc-challenge,mmlu",
              "chat_tasks": "bpb,gsm8k,arc-easy,arc-challenge,mmlu", "core_items": 500, "max_problems": 400,
              "max_tokens": 512, "bpb_tokens": 10 * 131072, "batch_size": 32},
    "full": {"base_tasks": "bpb,core,arc-easy,arc-challenge,mmlu",
             "chat_tasks": "bpb,gsm8k,arc-easy,arc-challenge,mmlu", "core_items": None, "max_problems": None,
             "max_tokens": 512, "bpb_tokens": 10 * 524288, "batch_size": 32},
}
common.rehearse(PRESETS, "eval.py")  # at import: sft.py reads these too (its bpb check)


def problem_set_id(task, indices):
    """A short hash of the problems task[i], i in `indices`, in order: equal ids mean the same problems."""
    digest = hashlib.sha256()
    for i in indices:
        digest.update(json.dumps(task[i], sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


# -----------------------------------------------------------------------------
# Bits per byte


@torch.no_grad()
def evaluate_bpb(model, batches, token_bytes, device):
    """
    Bits per byte of the targets in `batches` ((x, y) pairs of (B, T) token ids, y = -1 where ignored):

        bpb = sum_t CE_t / (ln 2 * sum_t bytes(y_t))

    the summed cross-entropy in nats converted to bits and divided by the UTF-8 bytes the targets stand for.
    Unlike the loss it does not depend on the tokenizer, so models with different vocabularies compare.
    Special tokens (0 bytes) are left out of both sums. Sums are all-reduced across DDP ranks.
    """
    token_bytes = token_bytes.to(device)
    total_nats = torch.zeros((), dtype=torch.float64, device=device)
    total_bytes = torch.zeros((), dtype=torch.float64, device=device)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast_ctx(device):
            losses = model(x, y, loss_reduction="none")  # (B, T)
        num_bytes = torch.where(y >= 0, token_bytes[y.clamp(min=0)], 0)  # (B, T)
        total_nats += (losses.float() * (num_bytes > 0)).sum().double()
        total_bytes += num_bytes.sum().double()
    if dist.is_initialized():
        dist.all_reduce(total_nats)
        dist.all_reduce(total_bytes)
    if total_bytes.item() == 0:
        raise ValueError("evaluate_bpb got no target bytes: the validation batches are empty")
    return (total_nats / (math.log(2) * total_bytes)).item()


def validation_batches(tokenizer, preset, batch_size, seq_len, max_tokens):
    """
    This rank's (x, y) batches of the preset's validation text, packed like pretraining; the ranks together read
    about max_tokens target tokens (at least one batch each).
    """
    _, rank, _, world_size = get_dist_info()
    num_batches = max(1, max_tokens // (batch_size * seq_len * world_size))
    # By document (iter() hides FineWeb-Edu's ParquetDocuments, which shard by row group): the validation split's
    # ~10 row groups are fewer than the ranks of a 2-node run, and every rank needs batches.
    texts = iter(pretraining_texts(preset, "val"))
    batches = pretraining_batches(tokenizer, texts, batch_size, seq_len, rank, world_size)
    for x, y, _ in islice(batches, num_batches):
        yield x, y


# -----------------------------------------------------------------------------
# Multiple choice


def base_prompt(item, shots, style):
    """
    (context, continuations) texts for a base model, lm-eval-harness style; `shots` are solved items put first.
    continuation (ARC):  "Question: {question}\\nAnswer:" continued by " {choice text}"
    letter (MMLU):       "{question}\\nA. {choice}\\nB. {choice}...\\nAnswer:" continued by " A", " B", ...
    """
    def block(it):
        if style == "continuation":
            return f"Question: {it['question']}\nAnswer:", [f" {choice}" for choice in it["choices"]]
        listed = "".join(f"\n{LETTERS[j]}. {choice}" for j, choice in enumerate(it["choices"]))
        return f"{it['question']}{listed}\nAnswer:", [f" {LETTERS[j]}" for j in range(len(it["choices"]))]

    header = ""
    if style == "letter":  # MMLU's own prompt header
        subject = item["subject"].replace("_", " ")
        header = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    solved = "".join(question + continuations[shot["answer"]] + "\n\n" for shot in shots
                     for question, continuations in [block(shot)])
    question, continuations = block(item)
    return header + solved + question, continuations


def chat_prompt(item):
    """The conversation that asks a chat model a multiple-choice question (its reply is scored by letter)."""
    listed = "\n".join(f"{LETTERS[j]}. {choice}" for j, choice in enumerate(item["choices"]))
    text = f"{item['question']}\n\n{listed}\n\nAnswer with the letter of the correct choice."
    return {"messages": [{"role": "user", "content": text}]}


@torch.no_grad()
def continuation_logprobs(model, requests, device, batch_tokens=None):
    """
    For each (context_ids, continuation_ids) in `requests` the summed log-prob of the continuation given the context:

        score = sum_{t in continuation} log p(x_t | x_<t)

    Rows are sorted by length and right-padded into micro-batches of at most `batch_tokens` positions (rows x
    longest; default 32 x sequence_len: 32 full-context rows). A row longer than sequence_len + 1 tokens keeps its
    last sequence_len + 1: the context is cut from the left, the continuation is always scored whole.
    Only the continuations' positions go through lm_head (GPT.chunked_logits): float32 logits of every position of
    a micro-batch would be 32 x 1,024 x 65,536 x 4 bytes = 8 GiB, for the few tokens that are scored.
    Returns a list of floats, in the order of `requests`.
    """
    keep = model.config.sequence_len + 1
    rows = []
    for context, continuation in requests:
        if not continuation or len(continuation) >= keep:
            raise ValueError(f"a continuation of {len(continuation)} tokens cannot be scored with a "
                             f"{keep - 1}-token context window")
        ids = (context + continuation)[-keep:]
        mask = ([0] * len(context) + [1] * len(continuation))[-keep:]
        rows.append((ids, mask))
    scores = [0.0] * len(rows)
    batches, _ = token_budget_batches([[len(ids) - 1] for ids, _ in rows], batch_tokens or 32 * (keep - 1))
    for batch in batches:
        x, y = collate([rows[i] for i in batch], pad_id=0)  # (B, L), y = -1 outside the continuations
        x, y = x.to(device), y.to(device)
        scored = y != -1  # (B, L): the continuations' positions, the only logits read
        with autocast_ctx(device):
            h = model.hidden(x)[scored]  # (n, C)
            losses, = model.chunked_logits(h[None], partial(F.cross_entropy, reduction="none"), y[scored][None])
        sums = torch.zeros(len(batch), device=device).index_add_(0, scored.nonzero()[:, 0], losses[0].float())
        for i, score in zip(batch, (-sums).tolist()):
            scores[i] = score
    return scores


def pick_choices(scores, continuations):
    """
    (acc choice, acc_norm choice) from each choice's summed log-prob and its continuation text: the largest sum,
    and the largest sum per character of the continuation (lm-eval-harness's acc_norm). Ties go to the first.
    """
    normalised = [score / len(text) for score, text in zip(scores, continuations)]
    return max(range(len(scores)), key=scores.__getitem__), max(range(len(scores)), key=normalised.__getitem__)


def _my_share(num_items):
    """Indices of the items this rank evaluates: every world_size-th, starting at its rank."""
    _, rank, _, world_size = get_dist_info()
    return list(range(rank, num_items, world_size))


def _sum_over_ranks(values, device):
    """Exact integer totals of per-rank counts."""
    totals = torch.tensor(values, dtype=torch.long, device=device)
    if dist.is_initialized():
        dist.all_reduce(totals)
    return totals.tolist()


def _progress(label, done, total, t0):
    elapsed = time.time() - t0
    print0(f"{label}: {done}/{total} on rank 0 | {elapsed:.0f}s | ETA {format_eta(elapsed / done * (total - done))}")


def evaluate_multiple_choice(model, tokenizer, items, style, num_shots=0, batch_size=32, seed=0, label=None,
                             shot_items=None):
    """
    Base-model multiple choice by log-likelihood (see base_prompt and pick_choices). `items` is a list of
    {"question", "choices", "answer", "subject"}; few-shot examples are drawn from `shot_items` of the same subject
    (the benchmark's own few-shot split, MC_SHOT_SPLIT), else from the other items of the same subject, with
    random.Random(f"{seed}-{i}") for item i, so every rank and every run builds the same prompts.
    `label`: print progress lines under that name. Returns {"acc", "acc_norm", "count"}, summed over DDP ranks.
    """
    if not items:
        raise ValueError("evaluate_multiple_choice got no items")
    device = next(model.parameters()).device
    pool_items = items if shot_items is None else shot_items
    by_subject = {}
    for j, item in enumerate(pool_items):
        by_subject.setdefault(item["subject"], []).append(j)
    mine = _my_share(len(items))
    correct = correct_norm = 0
    t0 = time.time()
    items_per_batch = max(1, batch_size // max(len(item["choices"]) for item in items))
    for start in range(0, len(mine), items_per_batch):
        requests, spans = [], []
        for i in mine[start:start + items_per_batch]:
            pool = by_subject.get(items[i]["subject"], [])
            drawn = random.Random(f"{seed}-{i}").sample(pool, min(num_shots + 1, len(pool)))
            # one spare draw in case item i itself comes up (only when the shots come from the items)
            shots = [j for j in drawn if shot_items is not None or j != i][:num_shots]
            context, continuations = base_prompt(items[i], [pool_items[j] for j in shots], style)
            context_ids = tokenizer.encode(context, prepend="<|bos|>")
            requests += [(context_ids, tokenizer.encode(text)) for text in continuations]
            spans.append((i, continuations))
        scores = continuation_logprobs(model, requests, device, batch_size * model.config.sequence_len)
        offset = 0
        for i, continuations in spans:
            choice, choice_norm = pick_choices(scores[offset:offset + len(continuations)], continuations)
            offset += len(continuations)
            correct += choice == items[i]["answer"]
            correct_norm += choice_norm == items[i]["answer"]
        if label is not None:
            _progress(label, min(start + items_per_batch, len(mine)), len(mine), t0)
    correct, correct_norm, count = _sum_over_ranks([correct, correct_norm, len(mine)], device)
    return {"acc": correct / count, "acc_norm": correct_norm / count, "count": count}


@torch.no_grad()
def evaluate_multiple_choice_chat(model, tokenizer, items, batch_size=32, label=None):
    """
    Chat-model multiple choice by letter: render chat_prompt(item) up to <|assistant_start|>, and answer with the
    choice whose letter token has the highest log-prob there (only the item's own letters compete). Only that last
    position goes through lm_head: (B, V) float32 logits, not (B, L, V).
    `label`: print progress lines under that name. Returns {"acc", "count"}, summed over DDP ranks.
    """
    device = next(model.parameters()).device
    letter_ids = [tokenizer.encode(letter)[0] for letter in LETTERS]  # one ASCII character: one byte-level token
    keep = model.config.sequence_len
    mine = _my_share(len(items))
    correct = 0
    t0 = time.time()
    for start in range(0, len(mine), batch_size):
        batch = [items[i] for i in mine[start:start + batch_size]]
        prompts = [tokenizer.render_for_completion(chat_prompt(item))[-keep:] for item in batch]
        x = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)  # (B, L), right-padded
        for b, ids in enumerate(prompts):
            x[b, :len(ids)] = torch.tensor(ids)
        with autocast_ctx(device):
            h = model.hidden(x.to(device))  # (B, L, C)
            last = model.head(h[torch.arange(len(batch)), torch.tensor([len(ids) - 1 for ids in prompts])])  # (B, V)
        for row, item in zip(last, batch):
            letters = row[letter_ids[:len(item["choices"])]]  # (num_choices,)
            correct += int(letters.argmax()) == item["answer"]
        if label is not None:
            _progress(label, min(start + batch_size, len(mine)), len(mine), t0)
    correct, count = _sum_over_ranks([correct, len(mine)], device)
    return {"acc": correct / count, "count": count}


# -----------------------------------------------------------------------------
# Generative tasks


def completion_text(tokenizer, completion):
    """The text a verifier sees: the completion's tokens decoded, without the closing <|assistant_end|>."""
    tokens = completion.tokens
    if completion.finish == "stop":
        tokens = tokens[:-1]
    return tokenizer.decode(tokens)


def majority_vote(answers):
    """
    maj@k's vote (Wang et al. 2023, "Self-consistency"): the final answer most of `answers` agree on, or None if
    none has one. Completions with no final answer (None) do not vote. A tie goes to the tied answer that was
    sampled first (smallest index of first appearance), so the vote is deterministic and does not depend on the
    answers' values.
    """
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    top = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == top)


def evaluate_generative(engine, task, indices, num_samples=1, ks=(1,), max_tokens=256, temperature=0.0,
                        top_k=None, top_p=None, batch_size=32, seed=0, label=None):
    """
    Sample `num_samples` completions for each problem task[i], i in `indices`, score each with the task's
    verifier (tasks.completion_reward: an answer that ran into max_tokens is not correct), and return exact counts
    and pass@k. Under DDP every rank takes every world_size-th problem and
    the per-problem counts are summed across ranks, so the result is the same as one process would get.
    `label`: print progress lines under that name (rank 0's share).

    maj@k (for each k > 1, on tasks whose items carry a numeric "answer"): the majority_vote of the first k samples'
    final answers (tasks.extract_final_answer; an answer that did not stop has none) is the reference; the fraction
    of problems where it is.

    Returns {"correct": LongTensor (P,), "samples": n, "errors": int (verifier errors), "truncated": int
    (completions that hit max_tokens), "formatted": int (completions with a final answer, tasks.extract_final_answer,
    stopped or not), "pass@k": float and "maj@k" for each k}.
    """
    rank = get_dist_info()[1]
    device = next(engine.model.parameters()).device
    correct = torch.zeros(len(indices), dtype=torch.long, device=device)
    errors = torch.zeros((), dtype=torch.long, device=device)
    truncated = torch.zeros((), dtype=torch.long, device=device)
    formatted = torch.zeros((), dtype=torch.long, device=device)
    maj_ks = [k for k in ks if k > 1]
    majority = torch.zeros(len(indices), len(maj_ks), dtype=torch.long, device=device)  # (P, ks): vote was right
    voted_on = torch.zeros((), dtype=torch.long, device=device)  # problems with a reference answer
    mine = _my_share(len(indices))
    t0 = time.time()
    for start in range(0, len(mine), batch_size):
        positions = mine[start:start + batch_size]
        conversations = [task[indices[p]] for p in positions]
        prompts = [engine.tokenizer.render_for_completion(c) for c in conversations]
        with autocast_ctx(device):
            results = engine.generate(prompts, num_samples=num_samples, max_tokens=max_tokens, temperature=temperature,
                                      top_k=top_k, top_p=top_p, seed=seed + start + rank * 1_000_003)
        for p, conversation, completions in zip(positions, conversations, results):
            texts = [completion_text(engine.tokenizer, completion) for completion in completions]
            for completion, text in zip(completions, texts):
                reward, error = completion_reward(task, conversation, text, completion.finish)
                correct[p] += int(reward > 0)
                errors += int(error)
                truncated += int(completion.finish == "length")
                formatted += int(extract_final_answer(text) is not None)
            reference = canonical_number(str(conversation.get("answer", "")))
            if maj_ks and reference is not None:
                answers = [extract_final_answer(text) if completion.finish == "stop" else None
                           for completion, text in zip(completions, texts)]
                majority[p] = torch.tensor([majority_vote(answers[:k]) == reference for k in maj_ks])
                voted_on += 1
        if label is not None:
            _progress(label, min(start + batch_size, len(mine)), len(mine), t0)
    if dist.is_initialized():
        dist.all_reduce(correct)
        dist.all_reduce(errors)
        dist.all_reduce(truncated)
        dist.all_reduce(formatted)
        dist.all_reduce(majority)
        dist.all_reduce(voted_on)
    correct = correct.cpu()
    result = {"correct": correct, "samples": num_samples, "errors": int(errors), "truncated": int(truncated),
              "formatted": int(formatted)}
    for k in ks:
        result[f"pass@{k}"] = sum(report.pass_at_k(num_samples, int(c), k) for c in correct) / max(len(indices), 1)
    if int(voted_on):
        result.update({f"maj@{k}": float(majority[:, j].sum()) / int(voted_on) for j, k in enumerate(maj_ks)})
    return result


def held_out_check(model, tokenizer, task_name, problems, samples, max_tokens, seed):
    """
    The check SFT and DPO run at their end, on `problems` held-out problems of task_name (tasks.task_by_name, 'test'):
    of the greedy answers the fraction that stop by themselves (emit <|assistant_end|> within max_tokens), the
    fraction in format (a '#### <number>' final answer) and pass@1; pass@1 at temperature 1 over `samples` samples per
    problem (an answer that did not stop is not correct); the truncated samples and verifier errors of both.
    """
    engine = Engine(model, tokenizer)
    task = task_by_name(task_name, "test", problems, seed)
    indices = list(range(len(task)))
    greedy = evaluate_generative(engine, task, indices, max_tokens=max_tokens, temperature=0.0, seed=seed)
    sampled = evaluate_generative(engine, task, indices, num_samples=samples, max_tokens=max_tokens, temperature=1.0,
                                  seed=seed)
    return {"stop_rate": 1 - greedy["truncated"] / len(indices), "format_rate": greedy["formatted"] / len(indices),
            "pass@1": greedy["pass@1"], "pass@1_t1": sampled["pass@1"],
            "truncated": greedy["truncated"] + sampled["truncated"],  # samples that hit the budget: never correct
            "verifier_errors": greedy["errors"] + sampled["errors"]}


def check_settings(task_name, problems, samples, max_tokens, seed):
    """
    What fixes held_out_check's result for given weights: its arguments and the world size (it seeds each rank's
    samples). A checkpoint stores them next to its check's numbers, so that the next stage, starting from the same
    weights, can reuse the numbers instead of checking again (dpo.py's "before").
    """
    return {"task": task_name, "problems": problems, "samples": samples, "max_tokens": max_tokens, "seed": seed,
            "world_size": get_dist_info()[3]}


def main(argv=None):
    parser = argparse.ArgumentParser(description="Evaluate a checkpoint (bpb, multiple choice, pass@k) and render "
                                                 "the report card $NANOPOST_HOME/report.md.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="tiny: synthetic data only, small budgets; small (one GPU) and full: hub tasks")
    parser.add_argument("--stage", nargs="+", choices=STAGES, default=["sft"], metavar="STAGE",
                        help=f"which checkpoints to evaluate, one after the other in one process: some of "
                             f"{', '.join(STAGES)} (default sft)")
    parser.add_argument("--ckpt", default=None, help="checkpoint folder (default: $NANOPOST_HOME/checkpoints/<stage>)")
    parser.add_argument("--compare", nargs="+", default=None, metavar="STAGE",
                        help="evaluate several stages' checkpoints (e.g. --compare sft rl, or sft,rl) and print their "
                             "coverage side by side; needs --num-samples > 1")
    parser.add_argument("--tasks", default=None,
                        help="comma-separated: bpb, core, synthetic, gsm8k, arc-easy, arc-challenge, mmlu (default: "
                             "the preset's list for base or for chat checkpoints)")
    parser.add_argument("--num-samples", type=int, default=1, help="completions per problem for generative tasks")
    parser.add_argument("--k", default=None, help="comma-separated k of pass@k to report (default: 1 and num-samples)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default: 0, greedy, for one sample; 1.0 for several)")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the top-k tokens only (default: all)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="longest completion in tokens (default: tiny 96, full 512)")
    parser.add_argument("--max-problems", type=int, default=None,
                        help="evaluate the first N problems of each task (default: tiny 128, full all)")
    parser.add_argument("--few-shot", type=int, default=None,
                        help="few-shot examples for base-model multiple choice (default: ARC 0, MMLU 5)")
    parser.add_argument("--bpb-tokens", type=int, default=None,
                        help="validation tokens for bpb (default: as pretrain.py, tiny 16384, full 5.2M)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="prompts per generation batch, rows per forward pass (default 32)")
    parser.add_argument("--device", default=None, help="cuda | mps | cpu (default: autodetect)")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling and of few-shot draws")
    parser.add_argument("--wandb-run", dest="run", default="dummy", help="wandb run name ('dummy': no logging)")
    parser.add_argument("--report-only", action="store_true", help="only re-render report.md from report.jsonl "
                        "(as python report.py)")
    args = parser.parse_args(argv)

    if args.report_only:
        print0(f"wrote {report.write_report()}")
        return
    preset = PRESETS[args.preset]
    stages = [s for entry in args.compare for s in entry.split(",") if s] if args.compare else args.stage
    if args.ckpt and len(stages) > 1:
        parser.error("--ckpt names the checkpoint of one stage; give one --stage with it")
    for stage in stages:
        if stage not in STAGES:
            parser.error(f"--compare: unknown stage {stage!r}; expected some of {', '.join(STAGES)}")
    if args.compare and (len(stages) < 2 or args.num_samples < 2 or args.ckpt):
        parser.error("--compare takes two or more stages, their default checkpoints (no --ckpt), and --num-samples > 1")
    common.check_numbers(args, positive=["num_samples", "top_k", "max_tokens", "max_problems", "bpb_tokens",
                                         "batch_size"], nonnegative=["temperature", "few_shot"])
    ks = [int(k) for k in args.k.split(",")] if args.k else sorted({1, args.num_samples})
    if any(not 1 <= k <= args.num_samples for k in ks):
        parser.error(f"--k {args.k}: every k must be between 1 and --num-samples ({args.num_samples})")
    for name in (args.tasks or "").split(","):
        known = ["bpb", "core", *registered_tasks("generative", "multiple-choice")]  # tasks.TASKS
        if name.strip() and name.strip() not in known:
            parser.error(f"--tasks: unknown task {name.strip()!r}; expected {', '.join(known)}")
    temperature = args.temperature if args.temperature is not None else (0.0 if args.num_samples == 1 else 1.0)
    max_tokens = args.max_tokens or preset["max_tokens"]
    max_problems = args.max_problems or preset["max_problems"]
    batch_size = args.batch_size or preset["batch_size"]
    bpb_tokens = args.bpb_tokens or preset["bpb_tokens"]

    _, _, _, world_size, device = common.compute_init(args.device, args.seed)
    logger = common.Logger(args.run, vars(args))
    print0(f"eval: {', '.join(stages)} on {world_size} x {device} | samples {args.num_samples} at temperature "
           f"{temperature} | pass@k for k in {ks} | up to {max_problems or 'all'} problems per task")
    logged = {}
    for stage in stages:
        t_stage = time.time()
        # The step folder with links resolved: what the report uses to tell checkpoints apart.
        ckpt = common.resolve_checkpoint(args.ckpt or common.checkpoint_dir(stage)).resolve()
        model, tokenizer, meta = load_model(ckpt, device)
        engine = Engine(model, tokenizer)
        task_names = [name.strip() for name in (args.tasks or preset["base_tasks" if stage == "base" else "chat_tasks"])
                      .split(",") if name.strip()]
        metrics, coverage, core_tasks = {}, {}, {}
        for name in task_names:
            t0 = time.time()
            label = f"{stage} {name}"
            if name == "bpb":
                token_bytes = torch.tensor(tokenizer.token_bytes(), dtype=torch.long)
                batches = validation_batches(tokenizer, args.preset, batch_size, model.config.sequence_len, bpb_tokens)
                metrics["bpb"] = evaluate_bpb(model, batches, token_bytes, device)
                shown = f"bpb {metrics['bpb']:.4f}"
            elif name == "core":
                bundle = core.load_bundle(core.bundle_root(), args.max_problems or preset["core_items"])
                result = core.evaluate_core(model, tokenizer, bundle, label)
                metrics["core"], core_tasks = result["core"], result["tasks"]
                shown = f"CORE {result['core']:.4f} ({len(core_tasks)} tasks, centred accuracy)"
            elif name in MC_TASKS:
                task = task_by_name(name, "test", max_problems)
                items = [task[i] for i in range(len(task))]
                if stage == "base":
                    shots = MC_SHOTS[name] if args.few_shot is None else args.few_shot
                    shot_items = None
                    if shots and name in MC_SHOT_SPLIT:
                        shot_task = task_by_name(name, MC_SHOT_SPLIT[name])
                        shot_items = [shot_task[j] for j in range(len(shot_task))]
                    result = evaluate_multiple_choice(model, tokenizer, items, MC_STYLE[name], shots, batch_size,
                                                      args.seed, label, shot_items)
                    metrics[f"{name}/acc"], metrics[f"{name}/acc_norm"] = result["acc"], result["acc_norm"]
                    shown = (f"acc {result['acc']:.4f} | acc_norm {result['acc_norm']:.4f} "
                             f"({shots}-shot, {result['count']} items)")
                else:
                    result = evaluate_multiple_choice_chat(model, tokenizer, items, batch_size, label)
                    metrics[f"{name}/acc"] = result["acc"]
                    shown = f"acc {result['acc']:.4f} (letter, {result['count']} items)"
            else:
                task = task_by_name(name, "test", max_problems)
                result = evaluate_generative(engine, task, list(range(len(task))), args.num_samples, ks, max_tokens,
                                             temperature, args.top_k, batch_size=batch_size, seed=args.seed,
                                             label=label)
                metrics.update({f"{name}/{m}@{k}": result[f"{m}@{k}"] for m in ("pass", "maj") for k in ks
                                if f"{m}@{k}" in result})
                metrics[f"{name}/truncated"], metrics[f"{name}/verifier_errors"] = result["truncated"], result["errors"]
                # What a paired comparison of two stages must find equal (report.check_comparable), with the counts.
                coverage[name] = {"samples": args.num_samples, "correct": result["correct"].tolist(),
                                  "temperature": temperature, "top_k": args.top_k, "max_tokens": max_tokens,
                                  "problems": problem_set_id(task, range(len(task)))}
                shown = " | ".join(f"{m}@{k} {result[f'{m}@{k}']:.4f}" for m in ("pass", "maj") for k in ks
                                   if f"{m}@{k}" in result)
                shown += (f" ({len(task)} problems, {result['truncated']} truncated and {result['errors']} verifier "
                          "errors among the samples)")
            print0(f"{label}: {shown} | {time.time() - t0:.1f}s")
        logged.update({f"{stage}/{name}": value for name, value in metrics.items()})
        common.append_report({"stage": "eval", "of": stage, "ckpt": str(ckpt),
                              "step": meta.get("step"), "preset": args.preset, "seconds": time.time() - t_stage,
                              "settings": {"num_samples": args.num_samples, "temperature": temperature,
                                           "top_k": args.top_k, "max_tokens": max_tokens, "max_problems": max_problems},
                              "metrics": metrics, "coverage": coverage, **({"core": core_tasks} if core_tasks else {})})
    logger.log(logged, step=0)
    if get_dist_info()[1] == 0:
        if args.compare:
            evals = report.merged_evals(common.read_report())
            rows = report.coverage_rows({stage: evals[stage] for stage in stages})
            print("\n".join(report.coverage_table(rows)) if rows
                  else "no generative task was evaluated: nothing to compare")
            if rows:
                print("\n".join(report.paired_table(report.paired_rows(evals, stages))))
        print(f"wrote {report.write_report()}")
    logger.finish()
    common.compute_cleanup()


if __name__ == "__main__":
    common.run_cli(main)

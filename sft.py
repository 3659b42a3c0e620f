"""
Supervised fine-tuning: teach the base model the chat format, to answer and to stop.

    python sft.py --preset tiny                     # CPU, minutes: synthetic conversations with calculator calls
    python sft.py --preset tiny --lora-rank 8       # LoRA adapters (model.LoRA) on a frozen base model
    torchrun --nproc_per_node=8 sft.py --preset full   # full: SmolTalk + GSM8K train, ~6 min on 8xH100 (estimate)
    torchrun --nnodes=2 --node-rank=0 --nproc_per_node=8 --rdzv-endpoint=host:29500 sft.py --preset full   # node-rank=1 on the other

Each conversation is rendered with Tokenizer.render_conversation; the loss is the cross-entropy of the tokens
whose mask is 1 (assistant text, tool calls, <|assistant_end|>), nothing else. Conversations are batched whole and
right-padded (tasks.collate): none is ever cut, and one longer than --max-seq-len is skipped and counted instead.
A step's conversations are sorted by length and cut into micro-batches of at most --device-batch-tokens padded
positions (tasks.token_budget_batches), so a micro-batch of long conversations holds fewer of them.
The loss of an optimizer step is the mean over every trained token of the step, across micro-batches and ranks
(see backward_sft_loss). At the end it measures held-out loss and whether the model answers held-out synthetic
problems in format (a single '#### <number>' line), stops by itself, and gets them right, and the bits per byte
of the pretraining validation text (eval.evaluate_bpb, the same text and tokens as the base checkpoint's val bpb).

Replay (--replay-frac): a fraction of every step's rows are pretraining text, trained on every token as in
pretraining (add_replay), so that SFT does not erase what the base model knows about plain text; nanochat's
mid-training mixes in pretraining-style data for the same reason. Measured on the tiny preset (one run each,
seed 0, the same base checkpoint; python sft.py --preset tiny --replay-frac F on 2 shared CPU cores):

    --replay-frac  replay rows per 16 conversations  val bpb (base 0.2787)  held-out loss  greedy pass@1  pass@1 T=1
    0              0                                 2.195 (7.9x the base)  0.0951         0.504          0.535
    0.1 (default)  2                                 0.271 (0.97x)          0.0908         0.539          0.530
    0.25           5                                 0.261 (0.93x)          0.0861         0.539          0.537

The tiny default is 0.1: the smallest fraction measured that keeps bpb within 1.5x of the base's while greedy
pass@1 does not drop (the replayed documents are worked problems in plain text); it costs 2 extra rows per 16
conversations, and 0.25 buys little more for 5. The full preset keeps 0 until measured at that scale (SmolTalk is
itself general text): pass --replay-frac to turn it on.

Rejection-sampling fine-tuning (--rft-rounds R; RFT, Yuan et al. 2023; expert iteration; Llama 3's rejection
sampling): starting from a chat checkpoint (default checkpoints/sft), each round samples --rft-samples answers to
each of --rft-prompts training problems of --rft-task from the current model (rollout.preference_pairs, the
self-generated path: decontaminated with --decontaminate like every stage), keeps the distinct answers that stopped
and that the verifier accepts, at most --rft-keep per problem (rft_keep), and trains one pass over them with the SFT
loss above; the next round samples from the new weights. Each round reports the problems with >= 1 kept answer, the
answers kept, the tokens sampled, and held-out pass@1 / pass@k at temperature 1. Saved to checkpoints/rft.

    python sft.py --preset tiny --rft-rounds 3      # from checkpoints/sft
"""

import argparse
import time
from collections import Counter
from contextlib import nullcontext
from functools import partial
from itertools import islice

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import common
from common import autocast_ctx, compute_cleanup, compute_init, format_eta, print0
from engine import Engine, load_model
from eval import PRESETS as EVAL_PRESETS
from eval import check_settings, evaluate_bpb, evaluate_generative, held_out_check, validation_batches
from model import (EMBEDDING_LR, LOGITS_CHUNK_TOKENS, MATRIX_LR, UNEMBEDDING_LR, add_lora_flags, attach_lora,
                   check_lora_flags, lora_checkpoint, trainable_params)
from rollout import mix_seed, preference_pairs
from tasks import (GSM8K, RowTooLong, SmolTalk, SyntheticCalculatorArithmetic, SyntheticTask, TaskMixture, collate,
                   decontamination_index, prepare_rows, pretraining_batches, pretraining_texts,
                   registered_tasks, row_texts, task_by_name, token_budget_batches)

# Defaults per preset; explicit flags win.
# full (8xH100, plan(): ~6 min for a depth-20 base, ~560M parameters): one pass over smol-smoltalk (~460k
# conversations, ~200M tokens with padding) plus two of GSM8K train (15k); about 6 * N * tokens = 7e17 FLOPs at an
# assumed 25% MFU, plus the final generation check. Micro-batches of 32,768 padded positions (16 rows of
# 2,048) need ~50 GiB per GPU with chunked logits (model.training_memory). tiny: 1,024 = 4 rows of the 256-token
# context at their longest. A CPU pays per position, padding included, and little per micro-batch: the step's 32
# conversations sorted into 2-3 micro-batches are 7% padding instead of ~45% in one of 4,096, and the stage takes
# 117 s instead of 132 s on 2 idle cores, with the same loss and metrics (backward_sft_loss: one mean per step).
PRESETS = {
    "tiny": dict(train_rows=4000, num_steps=None, batch_size=32, device_batch_tokens=1024, lr_frac=0.5, eval_every=50,
                 eval_rows=256, check_problems=256, check_samples=2, max_new_tokens=64, save_every=25, replay_frac=0.1,
                 decontaminate=False),
    # small (one 24 GB GPU, ~10 min): 50k SmolTalk conversations of <= 1,024 tokens + GSM8K, the full preset's
    # optimizer batch; on a GPU each stage's micro-batch is the largest of the preset's, half of it, ... that fits.
    "small": dict(train_rows=50_000, num_steps=None, batch_size=512, device_batch_tokens=16384, lr_frac=0.02,
                  eval_every=50, eval_rows=1000, check_problems=256, check_samples=4, max_new_tokens=512, save_every=50,
                  replay_frac=0.0, decontaminate=True),
    "full": dict(train_rows=None, num_steps=None, batch_size=512, device_batch_tokens=32768, lr_frac=0.02,
                 eval_every=200, eval_rows=2000, check_problems=256, check_samples=4, max_new_tokens=512,
                 save_every=500, replay_frac=0.0, decontaminate=True),
}
# Tokens of one pass over each GPU preset's hub data, for the budget (plan); estimates: smol-smoltalk averages
# ~430 tokens a conversation, GSM8K ~250 (a dry run reads stand-in files and cannot count them).
PLAN_TOKENS = {"small": 27e6, "full": 200e6}


def plan(args, config):
    """
    The preset's budget (common.stage_plan): one pass of PLAN_TOKENS at 6N FLOPs per token plus the chunked
    logits' second lm_head forward (2 n_embd V), and the generation check's greedy and sampled answers; memory at the
    largest micro-batch that fits the planned GPU, chunked logits.
    """
    flops = common.model_size(config)[1] + 2 * config.n_embd * config.vocab_size
    trainable = trainable_params(config, args)  # with --lora-rank: the adapters' gradients and AdamW state only
    micro = common.fit_batch_tokens("sft", config, common.HARDWARE[args.preset]["memory"], args.device_batch_tokens,
                                    config.sequence_len, LOGITS_CHUNK_TOKENS, trainable=trainable)
    decode = args.check_problems * (2 + args.check_samples) * args.max_new_tokens
    return common.stage_plan("sft", args.preset, config, micro, LOGITS_CHUNK_TOKENS, PLAN_TOKENS[args.preset], flops,
                             decode_tokens=decode, trainable=trainable)


def sft_mixture(preset, split, rows, seed=0):
    """
    The SFT data of each preset, in one place. tiny: synthetic conversations (half of them worked with calculator
    calls); the base model has read these problems as plain text, SFT teaches the chat format and the tool. Kept
    small on purpose, so the model learns the format well but not every answer: RL needs room to improve.
    full: SmolTalk (general chat) + GSM8K (math with calculator calls, two epochs) + the synthetic problems.
    `rows`: rows of the main source (None: all).
    """
    if preset == "tiny":
        return TaskMixture([("synthetic", SyntheticTask(split, rows, seed), None),
                            ("synthetic-calculator", SyntheticCalculatorArithmetic(split, rows // 8, seed + 1), None)],
                           seed=seed)
    if split == "train":
        smoltalk, gsm8k = SmolTalk("train", size=rows), GSM8K("train")
        sources = [("smoltalk", smoltalk, None), ("gsm8k", gsm8k, 2 * len(gsm8k)),
                   ("synthetic", SyntheticTask("train", 10_000, seed), None)]
    else:
        sources = [("smoltalk", SmolTalk("test", size=rows), None), ("gsm8k", GSM8K("test", size=rows), None)]
    return TaskMixture(sources, seed=seed)


def render_for_sft(tokenizer, conversation, max_seq_len):
    """(ids, mask) of a conversation; RowTooLong when it does not fit, since cutting it would train on a cut answer."""
    ids, mask = tokenizer.render_conversation(conversation)
    if len(ids) > max_seq_len:
        raise RowTooLong(f"conversation of {len(ids)} tokens is longer than --max-seq-len {max_seq_len}")
    return ids, mask


def backward_sft_loss(model, micro_batches, device):
    """
    Backpropagate one optimizer step's loss: the mean cross-entropy per trained token of the whole step,

        L = sum_{r, m, t} CE_{r,m,t} * [y_{r,m,t} != -1]  /  N,     N = sum_{r, m, t} [y_{r,m,t} != -1]

    over the DDP ranks r, the micro-batches m of each rank, and their tokens t. N is all-reduced before any
    backward, so each token weighs exactly 1/N however the batch is split into micro-batches and ranks (a mean per
    micro-batch would give a token of a short-answer micro-batch more weight than one of a long-answer batch).
    DDP averages gradients over the W ranks, so each rank backpropagates W * (its sum) / N.
    `micro_batches`: this rank's (inputs, targets) pairs of (B, T) tensors. Returns (L, N, tokens in the step)
    with L as a float, the same on every rank.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    counts = torch.tensor([sum(int((y >= 0).sum()) for _, y in micro_batches),
                           sum(int(x.numel()) for x, _ in micro_batches)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    num_targets = counts[0].item()
    if num_targets == 0:
        raise ValueError("this step's batch has no trained tokens: every conversation's mask is 0")
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for m, (x, y) in enumerate(micro_batches):
        x, y = x.to(device), y.to(device)
        last = m == len(micro_batches) - 1
        # Gradients are all-reduced once, after the last micro-batch of the step.
        sync = model.no_sync() if isinstance(model, DistributedDataParallel) and not last else nullcontext()
        with sync, autocast_ctx(device):
            losses = model(x, y, loss_reduction="none")  # (B, T), 0 where y == -1
            total = losses.sum()
        (total * (world_size / num_targets)).backward()
        loss_sum += total.detach().double()
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
    return loss_sum.item() / num_targets, int(num_targets), int(counts[1].item())


@torch.no_grad()
def evaluate_loss(model, batches, device):
    """Mean cross-entropy per trained token over `batches` ((inputs, targets) pairs), summed across DDP ranks."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, trained tokens)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast_ctx(device):
            losses = model(x, y, loss_reduction="none")  # (B, T)
        sums += torch.stack([losses.sum().double(), (y >= 0).sum().double()])
    if dist.is_initialized():
        dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def micro_batches_of(rows, start, num, device_batch_tokens, pad_id, replay_stream=None, replay_frac=0.0):
    """
    The collated micro-batches of one step: rows[start : start + num] (wrapping around the end: another epoch) and,
    with replay (replay_stream from replay_tokens, replay_frac > 0), the step's replay rows (add_replay), sorted by
    length and cut into micro-batches of at most device_batch_tokens padded positions. The replay rows are decided
    per step, not per micro-batch, so how many there are and how long does not depend on the budget (the largest
    micro-batch a GPU fits, or a CPU's smaller one). Returns the micro-batches, the fraction of their positions that
    is padding, and the number of replay rows at the end of each micro-batch.
    """
    take = [rows[(start + i) % len(rows)] for i in range(num)]
    if replay_stream:
        take = add_replay(take, replay_stream, replay_frac)
    # A stable sort by length: the replay rows, as long as the longest conversation and after it in `take`, are the
    # last rows of the step, so they close the micro-batches they fall in.
    batches, padding = token_budget_batches([[len(ids) - 1] for ids, _ in take], device_batch_tokens)
    replay_rows = [sum(i >= num for i in batch) for batch in batches]
    return [collate([take[i] for i in batch], pad_id) for batch in batches], padding, replay_rows


def replay_tokens(tokenizer, preset, rank=0, world_size=1, skip=0):
    """
    Endless token ids of the preset's pretraining documents (tasks.pretraining_texts(preset, "train")), each after
    <|bos|> and packed as pretraining packs them (tasks.pretraining_batches, this rank's share of the documents);
    starts over at the end of the corpus. The first `skip` tokens are dropped: --resume continues where it was.
    """
    while True:
        rows = 0
        for x, y, _ in pretraining_batches(tokenizer, pretraining_texts(preset, "train"), 1, 255, rank, world_size):
            rows += 1
            row = torch.cat([x[0], y[0, -1:]]).tolist()  # the 256 consecutive tokens of this packed row
            if skip >= len(row):
                skip -= len(row)
                continue
            yield from row[skip:]
            skip = 0
        if not rows:
            raise ValueError(f"rank {rank}'s share of the {preset} pretraining text is under 256 tokens: nothing to "
                             f"replay; use --replay-frac 0")


def replay_rows_for(num_rows, replay_frac):
    """Replay rows added to a step of num_rows conversations: round(f / (1 - f) * num_rows), so f of all rows."""
    if not 0 <= replay_frac < 1:
        raise ValueError(f"--replay-frac must be in [0, 1); got {replay_frac}")
    return round(replay_frac / (1 - replay_frac) * num_rows)


def add_replay(rows, stream, replay_frac):
    """
    rows + replay_rows_for(len(rows), replay_frac) rows of pretraining text read from the token iterator `stream`
    (replay_tokens). Each replay row is as long as the longest conversation of `rows`, so it adds no padding to
    the micro-batch it lands in (with the longest conversations), and its mask is all ones: the loss covers every
    token, as in pretraining. The step's loss stays one mean over all trained tokens (backward_sft_loss), replay
    tokens included.
    """
    length = max(len(ids) for ids, _ in rows)
    replay = [list(islice(stream, length)) for _ in range(replay_rows_for(len(rows), replay_frac))]
    return rows + [(ids, [1] * length) for ids in replay]


def rft_keep(examples, max_per_prompt):
    """
    Rejection sampling's filter: of labelled answers ((ids, mask), desirable) (rollout.self_generated_pairs
    unpaired: distinct, desirable = stopped and verified correct), the desirable ones, at most max_per_prompt per
    prompt (the tokens before the first trained one), in their order. Returns [(ids, mask)].
    """
    kept, per_prompt = [], Counter()
    for (ids, mask), desirable in examples:
        prompt = tuple(ids[:mask.index(1)])
        if desirable and per_prompt[prompt] < max_per_prompt:
            per_prompt[prompt] += 1
            kept.append((ids, mask))
    return kept


def held_out_coverage(model, tokenizer, task, args, device):
    """pass@1 and pass@k (k = --rft-eval-samples, temperature 1) and the truncated samples on the held-out problems."""
    k = args.rft_eval_samples
    with autocast_ctx(device):
        result = evaluate_generative(Engine(model, tokenizer), task, list(range(len(task))), num_samples=k,
                                     ks=(1, k), max_tokens=args.max_new_tokens, temperature=1.0, seed=args.seed)
    return {"pass@1": result["pass@1"], f"pass@{k}": result[f"pass@{k}"], "truncated": result["truncated"]}


def rejection_sampling_rounds(args, model, tokenizer, device, ddp, local_rank, out_dir, max_seq_len, logger,
                              resume=None):
    """
    --rft-rounds R of sample -> filter (rft_keep) -> one SFT pass over what was kept (see the docstring). Every rank
    samples its share of the prompts and trains on its own kept answers, the same number of steps on every rank (the
    fewest a rank can fill). Logs each round's numbers at step = round (0: before the first) to `logger`. A stop
    signal ends the run after the round it arrives in, saved as step = rounds done; `resume` (that checkpoint)
    continues with the next round. Returns (the per-round records, held-out metrics before the first round).
    """
    world_size = dist.get_world_size() if ddp else 1
    train_task = task_by_name(args.rft_task, "train", args.rft_prompts, args.seed)
    test_task = task_by_name(args.rft_task, "test", args.check_problems, args.seed)
    held_out = [text for i in range(len(test_task)) for text in row_texts(test_task[i])[:1]]
    index = decontamination_index(args.preset, held_out) if args.decontaminate else None
    optimizers = model.setup_optimizers(matrix_lr=MATRIX_LR * args.lr_frac, embedding_lr=EMBEDDING_LR * args.lr_frac,
                                        unembedding_lr=UNEMBEDDING_LR * args.lr_frac)
    history = []
    if resume:  # the rounds a stopped run finished: their weights, optimizer state, records and curves
        state, _, extra = common.load_checkpoint(resume, device=device)
        model.load_state_dict(state)
        for optimizer, optimizer_state in zip(optimizers, extra["optimizers"]):
            optimizer.load_state_dict(optimizer_state)
        history, before = extra["history"], extra["before"]
        logger.series.update(extra["curves"])
        print0(f"resuming after round {len(history)}")
    train_model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None) \
        if ddp else model
    replay_stream = replay_tokens(tokenizer, args.preset, dist.get_rank() if ddp else 0, world_size) \
        if args.replay_frac else None
    rows_per_rank = args.batch_size // world_size
    k = args.rft_eval_samples
    if not resume:
        before = held_out_coverage(model, tokenizer, test_task, args, device)
        logger.log({"eval/pass@1": before["pass@1"], "eval/pass@k": before[f"pass@{k}"]}, 0)
    print0(f"rft: {args.rft_rounds} rounds of {args.rft_samples} samples x {len(train_task)} {args.rft_task} "
           f"problems, <= {args.rft_keep} kept per problem | held-out pass@1 {before['pass@1']:.1%}, "
           f"pass@{k} {before[f'pass@{k}']:.1%}")
    for round_index in range(len(history), args.rft_rounds):
        t0 = time.time()
        examples, counts, _ = preference_pairs(
            "self-generated", "train", args.rft_prompts, tokenizer, max_seq_len, engine=Engine(model, tokenizer),
            task=train_task, samples=args.rft_samples, max_new_tokens=args.max_new_tokens,
            temperature=args.rft_temperature, seed=mix_seed(args.seed, round_index), index=index, unpaired=True)
        rows = rft_keep(examples, args.rft_keep)
        mine = torch.tensor([len({tuple(ids[:mask.index(1)]) for ids, mask in rows}), len(rows), len(rows)],
                            dtype=torch.long, device=device)  # [prompts kept, answers kept, fewest answers of a rank]
        if ddp:
            dist.all_reduce(mine[:2])
            dist.all_reduce(mine[2:], op=dist.ReduceOp.MIN)
        num_steps = int(mine[2]) // rows_per_rank
        losses = []
        for step in range(num_steps):
            common.set_lr(optimizers, 1.0 - step / num_steps)  # linear decay to 0 each round
            micro, _, _ = micro_batches_of(rows, step * rows_per_rank, rows_per_rank, args.device_batch_tokens,
                                           tokenizer.bos_id, replay_stream, args.replay_frac)
            losses.append(backward_sft_loss(train_model, micro, device)[0])
            for optimizer in optimizers:
                optimizer.step()
            model.zero_grad(set_to_none=True)
        record = {"round": round_index + 1, "prompts_kept": int(mine[0]), "answers_kept": int(mine[1]),
                  "sampled_tokens": counts["sampled tokens"], "steps": num_steps,
                  "train_loss": sum(losses) / len(losses) if losses else None,
                  "sampling": {name: n for name, n in counts.items() if name != "sampled tokens"},
                  **held_out_coverage(model, tokenizer, test_task, args, device)}
        history.append(record)
        logger.log({"eval/pass@1": record["pass@1"], "eval/pass@k": record[f"pass@{k}"],
                    "train/loss": record["train_loss"], "rft/answers_kept": record["answers_kept"],
                    "rft/prompts_kept": record["prompts_kept"]}, round_index + 1)  # a round without a step: no loss
        print0(f"round {round_index + 1}/{args.rft_rounds} | problems with a kept answer {record['prompts_kept']}/"
               f"{args.rft_prompts} | answers kept {record['answers_kept']} | {num_steps} steps"
               + (f", loss {record['train_loss']:.4f}" if losses else " (too few kept answers for a step)")
               + f" | held-out pass@1 {record['pass@1']:.1%}, pass@{k} {record[f'pass@{k}']:.1%} | "
               f"{record['sampled_tokens']:,} tokens sampled | {time.time() - t0:.0f}s")
        if common.preempted(device) and round_index + 1 < args.rft_rounds:  # SIGTERM/SIGINT, see common.py
            if not ddp or dist.get_rank() == 0:
                common.save_checkpoint(out_dir, round_index + 1, model, {"stage": "rft", "finished": False},
                                       tokenizer=tokenizer, extra={"optimizers": [o.state_dict() for o in optimizers],
                                                                   "history": history, "before": before,
                                                                   "curves": logger.series})
            common.exit_preempted(out_dir)
    return history, before


def main(argv=None):
    parser = argparse.ArgumentParser(description="Supervised fine-tuning of the base model on chat conversations; "
                                                 "with --rft-rounds, rejection-sampling fine-tuning of a chat model.")
    common.add_stage_flags(parser, PRESETS, preset="defaults for the flags below", seed="data order and sampling seed",
                           ckpt="base checkpoint to start from (default: checkpoints/base; --rft-rounds: "
                                "checkpoints/sft)",
                           out="where to save (default: checkpoints/sft; --rft-rounds: checkpoints/rft)",
                           resume="continue from the latest checkpoint in --out (--rft-rounds: after the last "
                                  "round it saved)")
    parser.add_argument("--train-rows", type=int, help="rows of the main training source (tiny: synthetic, full: "
                        "SmolTalk; default: the preset's)")
    parser.add_argument("--num-steps", type=int, help="optimizer steps (default: one pass over the data)")
    parser.add_argument("--batch-size", type=int, help="conversations per optimizer step, all ranks together")
    parser.add_argument("--device-batch-tokens", type=int, help="padded positions (rows x longest row) per "
                        "micro-batch per rank; at least --max-seq-len")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="longest conversation trained on, in tokens; longer ones are skipped (default: the "
                             "model's sequence_len)")
    parser.add_argument("--lr-frac", type=float,
                        help="learning rates as a fraction of pretraining's; decays linearly to 0")
    parser.add_argument("--eval-every", type=int, help="held-out loss every this many steps")
    parser.add_argument("--eval-rows", type=int, help="held-out conversations for the loss")
    parser.add_argument("--check-problems", type=int, help="held-out synthetic problems for the generation check")
    parser.add_argument("--check-samples", type=int, help="samples per problem for pass@1 at temperature 1")
    parser.add_argument("--max-new-tokens", type=int, help="longest answer generated in the check")
    parser.add_argument("--save-every", type=int, help="save a resumable checkpoint every this many steps (0: never)")
    parser.add_argument("--replay-frac", type=float,
                        help="fraction of each step's rows that are pretraining text, trained on every token, "
                             "against forgetting it (0: none; default: the preset's, measured, see the docstring)")
    parser.add_argument("--decontaminate", action=argparse.BooleanOptionalAction, default=None,
                        help="drop training rows that overlap an evaluation set in use (tasks.NgramIndex: a shared "
                             "13-gram of normalised words or a whole short question); default on for full, off for "
                             "tiny (split by question hash)")
    parser.add_argument("--dry-run", action="store_true", help="build the model, data and optimizers, print the plan "
                        "and stop before the first forward pass")
    parser.add_argument("--rft-rounds", type=int, default=0, help="rejection-sampling fine-tuning rounds (0: plain "
                        "SFT); --train-rows, --num-steps, --eval-every, --eval-rows and --save-every are SFT's only")
    parser.add_argument("--rft-task", choices=registered_tasks("generative"), default="synthetic",
                        help="verifiable task whose training problems are sampled and whose held-out ones measure")
    parser.add_argument("--rft-prompts", type=int, default=512, help="training problems sampled each round")
    parser.add_argument("--rft-samples", type=int, default=8, help="answers sampled per problem each round (k)")
    parser.add_argument("--rft-keep", type=int, default=2, help="most distinct correct answers kept per problem (m)")
    parser.add_argument("--rft-temperature", type=float, default=1.0, help="sampling temperature of the rounds")
    parser.add_argument("--rft-eval-samples", type=int, default=8,
                        help="samples per held-out problem (--check-problems of them): pass@1 and pass@k, T=1")
    add_lora_flags(parser)
    args = parser.parse_args(argv)
    check_lora_flags(parser, args)
    stage = "rft" if args.rft_rounds else "sft"
    if args.rft_rounds < 0 or args.rft_samples < 1 or args.rft_keep < 1 or args.rft_eval_samples < 1:
        raise ValueError("--rft-rounds must be >= 0 and --rft-samples, --rft-keep, --rft-eval-samples >= 1")
    if args.rft_rounds and args.lora_rank:
        parser.error("--lora-rank trains plain SFT's adapters; --rft-rounds fine-tunes every weight")
    fit_batch = args.device_batch_tokens is None  # on a GPU: the largest that fits, up to the preset's
    common.fill_preset(args, PRESETS[args.preset])
    common.check_numbers(args, positive=["train_rows", "num_steps", "batch_size", "device_batch_tokens", "max_seq_len",
                                         "eval_every", "eval_rows", "check_problems", "check_samples",
                                         "max_new_tokens"],
                         nonnegative=["save_every", "lr_frac"])
    replay_rows_for(1, args.replay_frac)  # checks --replay-frac

    ddp, rank, local_rank, world_size, device = compute_init(args.device, seed=args.seed)
    stage_start = time.time()
    out_dir = args.out or common.checkpoint_dir(stage)
    resume = common.resume_or_finish(out_dir, args.resume, stage)  # the step folder to continue from, or None
    if resume is common.FINISHED:
        return

    model, tokenizer, base_meta = load_model(args.ckpt or common.checkpoint_dir("sft" if args.rft_rounds else "base"),
                                             device)
    lora = attach_lora(model, args)  # None without --lora-rank
    max_seq_len = args.max_seq_len or model.config.sequence_len
    args.device_batch_tokens = common.batch_tokens_for_device("sft", None if fit_batch else args.device_batch_tokens,
                                                              device, model.config, args.device_batch_tokens,
                                                              max_seq_len, LOGITS_CHUNK_TOKENS)
    print0(f"loaded {base_meta.get('stage', 'base')}: {model.num_params():,} parameters, sequence_len "
           f"{model.config.sequence_len}, vocab {tokenizer.vocab_size}; training on conversations of <= {max_seq_len} "
           "tokens")
    if args.rft_rounds:
        logger = common.Logger(args.run, vars(args))
        history, before = rejection_sampling_rounds(args, model, tokenizer, device, ddp, local_rank, out_dir,
                                                    max_seq_len, logger, resume)
        logger.finish()
        if rank == 0:
            meta = {"stage": "rft", "finished": True, "preset": args.preset, "args": vars(args),
                    "metrics": history[-1], "from_step": base_meta.get("step")}
            print0(f"saved {common.save_checkpoint(out_dir, args.rft_rounds, model, meta, tokenizer=tokenizer)}")
        common.append_report({"stage": "rft", "preset": args.preset, "seconds": time.time() - stage_start,
                              "task": args.rft_task, "before": before, "rounds": history}, logger)
        compute_cleanup()
        return

    # Data: this rank renders its share of the mixture; over-long and malformed rows are skipped and counted.
    train_mix = sft_mixture(args.preset, "train", args.train_rows, seed=args.seed)
    val_mix = sft_mixture(args.preset, "test", args.eval_rows, seed=args.seed)
    print0(f"train mixture:\n{train_mix.summary()}\nheld-out mixture:\n{val_mix.summary()}")
    render = partial(render_for_sft, tokenizer, max_seq_len=max_seq_len)
    index = decontamination_index(args.preset) if args.decontaminate else None
    train_rows, skipped = prepare_rows(train_mix, render, range(rank, len(train_mix), world_size), index=index)
    val_rows, val_skipped = prepare_rows(val_mix, render, range(rank, len(val_mix), world_size))
    share = (skipped, val_skipped, len(train_rows), len(val_rows), sum(len(ids) for ids, _ in train_rows))
    shares = [share]  # what each rank prepared
    if ddp:
        shares = [None] * world_size
        dist.all_gather_object(shares, share)
    skipped, val_skipped = sum((s[0] for s in shares), Counter()), sum((s[1] for s in shares), Counter())
    for (name, reason), count in sorted(skipped.items()) + sorted(val_skipped.items()):
        print0(f"skipped {count:,} {reason} rows of {name}")
    if args.batch_size % world_size:
        raise ValueError(f"--batch-size {args.batch_size} is not a multiple of the {world_size} ranks")
    if args.device_batch_tokens < max_seq_len:
        raise ValueError(f"--device-batch-tokens {args.device_batch_tokens} cannot hold a conversation of "
                         f"--max-seq-len {max_seq_len} tokens; raise it or lower --max-seq-len")
    rows_per_rank = args.batch_size // world_size
    min_rows = min(s[2] for s in shares)  # every rank must take the same number of steps
    num_steps = args.num_steps or min_rows // rows_per_rank
    if num_steps < 1:
        raise ValueError(f"{min_rows} training rows per rank are fewer than one step's {rows_per_rank}")
    val_batches, _, _ = micro_batches_of(val_rows, 0, len(val_rows), args.device_batch_tokens, tokenizer.bos_id)
    tokens = sum(s[4] for s in shares)  # one pass over the training rows, padding not counted
    print0(f"{num_steps} steps of {args.batch_size} conversations ({rows_per_rank} per rank in micro-batches of <= "
           f"{args.device_batch_tokens:,} padded tokens), {sum(s[3] for s in shares)} held-out conversations; one pass "
           f"is {tokens:,} tokens, ~{model.flops_per_token() * tokens:.1e} FLOPs")
    if args.replay_frac:
        print0(f"replay: {args.replay_frac:.0%} of each step's rows are pretraining text (--replay-frac), as long as "
               "its longest conversation")
    # bpb of the pretraining validation text, as eval.py and pretrain.py measure it: what SFT costs in plain text.
    token_bytes = torch.tensor(tokenizer.token_bytes(), dtype=torch.long)
    bpb_rows = max(args.device_batch_tokens // model.config.sequence_len, 1)
    bpb_batches = list(validation_batches(tokenizer, args.preset, bpb_rows, model.config.sequence_len,
                                          EVAL_PRESETS[args.preset]["bpb_tokens"]))

    optimizers = lora.optimizers(args.lora_lr) if lora else model.setup_optimizers(
        matrix_lr=MATRIX_LR * args.lr_frac, embedding_lr=EMBEDDING_LR * args.lr_frac,
        unembedding_lr=UNEMBEDDING_LR * args.lr_frac)
    if lora:
        print0(f"{lora.extra_repr()}: {lora.num_trainable():,} trainable parameters, the base frozen")
    if args.dry_run:
        if args.preset in common.HARDWARE:
            common.print_plan(plan(args, model.config))
        print0("dry run: model, data and optimizers are built; stopping before the first forward pass")
        compute_cleanup()
        return
    before = {"val_loss": evaluate_loss(model, val_batches, device),  # the base model's
              "bpb": evaluate_bpb(model, bpb_batches, token_bytes, device)}
    start_step, replay_consumed = 0, 0
    if resume:
        state, _, extra = common.load_checkpoint(resume, device=device)
        if lora:  # the base is --ckpt's, as at the start; the checkpoint's model is the merged export
            lora.load_state_dict(extra["lora"])
        else:
            model.load_state_dict(state)
        common.load_optimizers(optimizers, extra["optimizers"])
        # Replay continues after the tokens rank 0 had read (other ranks' counts differ a little: near enough).
        start_step, replay_consumed = extra["step"], extra.get("replay_tokens", 0)
        print0(f"resuming from step {start_step}")
    train_model = model
    if ddp:
        train_model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    logger = common.Logger(args.run, vars(args), series=extra.get("curves") if resume else None)
    if start_step == 0:  # the base model's held-out loss: where the held-out curve starts
        logger.log({"val/loss": before["val_loss"]}, 0)

    replay_stream = None
    if args.replay_frac:
        replay_stream = replay_tokens(tokenizer, args.preset, rank, world_size, skip=replay_consumed)
    print0(f"step {start_step:5d}/{num_steps} | val loss {before['val_loss']:.4f} | bpb {before['bpb']:.4f} "
           f"(base model)")
    train_loss, t0, tokens_seen = float("nan"), time.time(), 0
    for step in range(start_step, num_steps):
        lr_multiplier = 1.0 - step / num_steps  # linear decay to 0
        common.set_lr(optimizers, lr_multiplier)
        micro, padding, replay_rows = micro_batches_of(train_rows, step * rows_per_rank, rows_per_rank,
                                                       args.device_batch_tokens, tokenizer.bos_id, replay_stream,
                                                       args.replay_frac)
        # The replay rows are the last replay_rows[i] rows of micro-batch i; this rank's share of the targets.
        replay_targets = sum(int((y[len(y) - r:] >= 0).sum()) for (_, y), r in zip(micro, replay_rows) if r)
        replay_consumed += sum(r * (x.shape[1] + 1) for (x, _), r in zip(micro, replay_rows))
        train_loss, num_targets, num_tokens = backward_sft_loss(train_model, micro, device)
        for optimizer in optimizers:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        tokens_seen += num_tokens
        elapsed = time.time() - t0
        eta = format_eta(elapsed / (step + 1 - start_step) * (num_steps - step - 1))
        log = {"train/loss": train_loss, "train/targets": num_targets, "train/padding": padding,
               "lr_multiplier": lr_multiplier, "train/replay_target_share": replay_targets * world_size / num_targets}
        if (step + 1) % args.eval_every == 0 or step + 1 == num_steps:
            log["val/loss"] = evaluate_loss(model, val_batches, device)
        print0(f"step {step + 1:5d}/{num_steps} | loss {train_loss:.4f}"
               + (f" | val loss {log['val/loss']:.4f}" if "val/loss" in log else "")
               + f" | {len(micro)} micro-batch(es), {padding:.0%} padding | {tokens_seen / elapsed:,.0f} tok/s (padded)"
               + f" | eta {eta}")
        logger.log(log, step + 1)
        preempted = common.preempted(device)  # SIGTERM/SIGINT: keep this step's work, see common.py
        if (preempted or args.save_every and (step + 1) % args.save_every == 0 and step + 1 < num_steps) and rank == 0:
            common.save_checkpoint(out_dir, step + 1, tokenizer=tokenizer, **lora_checkpoint(
                model, lora, {"stage": "sft", "finished": False},
                {"step": step + 1, "optimizers": [o.state_dict() for o in optimizers],
                 "replay_tokens": replay_consumed, "curves": logger.series}))
        if preempted:
            common.exit_preempted(out_dir)

    check_args = ("synthetic", args.check_problems, args.check_samples, args.max_new_tokens, args.seed)
    check = held_out_check(model, tokenizer, *check_args)
    final = {"val_loss": evaluate_loss(model, val_batches, device),
             "bpb": evaluate_bpb(model, bpb_batches, token_bytes, device), **check}
    print0(f"held-out loss {before['val_loss']:.4f} -> {final['val_loss']:.4f} | bpb {before['bpb']:.4f} -> "
           f"{final['bpb']:.4f} | format {final['format_rate']:.1%} | "
           f"stop {final['stop_rate']:.1%} | pass@1 greedy {final['pass@1']:.1%} | pass@1 T=1 {final['pass@1_t1']:.1%}")
    logger.log({f"final/{k}": v for k, v in final.items()}, num_steps)
    logger.finish()
    common.check_ranks_agree(model, "sft")
    if rank == 0:
        meta = {"stage": "sft", "finished": True, "preset": args.preset, "args": vars(args), "metrics": final,
                "check": {"settings": check_settings(*check_args), "metrics": check},
                "base_step": base_meta.get("step")}
        path = common.save_checkpoint(out_dir, num_steps, tokenizer=tokenizer, **lora_checkpoint(model, lora, meta))
        print0(f"saved {path}")
    common.append_report({"stage": "sft", "preset": args.preset, "seconds": time.time() - stage_start,
                          "steps": num_steps, "train_loss": train_loss,
                          "val_loss_before": before["val_loss"], "bpb_before": before["bpb"], **final,
                          "skipped": {f"{name}/{reason}": count for (name, reason), count in skipped.items()}}, logger)
    compute_cleanup()


if __name__ == "__main__":
    common.run_cli(main, preemptible=True)

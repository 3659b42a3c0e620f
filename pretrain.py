"""
Pretrain the base model: next-token prediction on packed documents, Muon + AdamW, val bits-per-byte,
samples, resumable checkpoints. `--depth` is the one dial; everything it derives is printed at start.

    python tokenizer.py --preset tiny && python pretrain.py --preset tiny     # CPU, synthetic corpus, minutes
    torchrun --standalone --nproc_per_node=8 pretrain.py --preset full        # one 8-GPU node, FineWeb-Edu
    torchrun --nnodes=2 --node-rank=0 --nproc_per_node=8 --rdzv-endpoint=host:29500 pretrain.py --preset full

    python pretrain.py --preset tiny --resume      # continue a killed run from its last checkpoint (same flags)
    python engine.py --ckpt ~/.cache/nanopost/checkpoints/base --prompt "Question: What is 3 + 4?"

The checkpoint goes to $NANOPOST_HOME/checkpoints/base (default ~/.cache/nanopost), one JSON line of final
metrics to $NANOPOST_HOME/report.jsonl.
"""

import argparse
import math
import time
from contextlib import nullcontext
from dataclasses import asdict
from itertools import islice

import torch
import torch.distributed as dist

import tasks
from common import (ASSUMED_MFU, FINISHED, HARDWARE, Logger, add_stage_flags, append_report, autocast_ctx,
                    batch_tokens_for_device, check_numbers, check_ranks_agree, checkpoint_dir, compute_cleanup,
                    compute_init, exit_preempted, fit_batch_tokens, format_eta, get_base_dir, load_checkpoint,
                    load_optimizers, model_size, peak_flops, preempted, print0, print_plan, resume_or_finish, run_cli,
                    save_checkpoint, set_lr, stage_plan, synchronize)
from engine import Engine
from eval import evaluate_bpb
from model import EMBEDDING_LR, GPT, MATRIX_LR, UNEMBEDDING_LR, GPTConfig
from tokenizer import Tokenizer

PRESETS = {
    # Synthetic corpus (tasks.synthetic_documents, ~2.3M tokens of which a run reads ~0.5M), a 3.5M-parameter model
    # (depth 4: n_embd 256, 4 heads). A few minutes on 2 CPU cores; far from the 20-tokens-per-parameter horizon,
    # so the step count is set directly. Validation every 50 steps: each pass over the 16k validation tokens costs
    # ~1.3 s, ~2 steps' worth.
    "tiny": dict(data="synthetic", depth=4, max_seq_len=256, device_batch_size=8, total_batch_size=2048,
                 num_iterations=250, eval_every=50, eval_tokens=16384, sample_every=125, save_every=100, log_every=5,
                 decontaminate=False),
    # FineWeb-Edu on one 24 GB GPU (plan(): ~75 min on an RTX 4090 at 40% MFU). depth 8: n_embd 512, 8 heads,
    # 92M parameters (59M of them in matmuls; the 65,536-token embedding and lm_head are most of it), 0.40
    # GFLOPs/token. 8 tokens per parameter = 0.74B tokens: compute-limited, below Chinchilla's 20 (which would take
    # ~3 h). device_batch_size is the most rows a micro-batch may hold; on a GPU the largest that fits is chosen.
    "small": dict(data="fineweb", depth=8, max_seq_len=1024, device_batch_size=16, total_batch_size=131072,
                  target_param_data_ratio=8.0, num_iterations=None, eval_every=250, eval_tokens=10 * 131072,
                  sample_every=1000, save_every=1000, log_every=10,
                  decontaminate=True),
    # FineWeb-Edu (sample-10BT, ~10B tokens) on one 8xH100 node (plan(): ~2.6 h of the ~3.9 h speedrun). depth 20:
    # n_embd 1280, 20 heads, 561M parameters with the 65536-token vocabulary, 3.49 GFLOPs/token. 15 tokens per
    # parameter = 8.4B tokens = 16,050 steps of 524,288 tokens = 2.9e19 FLOPs at 40% MFU of 8 x 989 TFLOP/s.
    # (Chinchilla's 20 tokens/param would need 11.2B tokens: more than sample-10BT holds, and 3.4 h.) Rows per
    # micro-batch: the largest of 32, 16, ... that fits the GPU by model.training_memory (eager, whole logits: an
    # upper bound for the compiled step), 8 on an 80 GB GPU (~55 GiB), reaching 524,288 by accumulation.
    "full": dict(data="fineweb", depth=20, max_seq_len=2048, device_batch_size=32, total_batch_size=524288,
                 target_param_data_ratio=15.0, num_iterations=None, eval_every=250, eval_tokens=10 * 524288,
                 sample_every=2000, save_every=2000, log_every=1, decontaminate=True),
}
# Defaults shared by every preset.
DEFAULTS = dict(target_param_data_ratio=20.0, matrix_lr=MATRIX_LR, embedding_lr=EMBEDDING_LR,
                unembedding_lr=UNEMBEDDING_LR, weight_decay=0.0, warmup_frac=0.0, warmdown_frac=0.2)

SAMPLE_PROMPTS = {
    "synthetic": ["Question: What is 17 + 25?\nAnswer:", "Question: What is 6 * 7?\nAnswer:",
                  "Question: Ava has 12 apples. Ava buys 5 more, then gives 3 to a friend. How many apples does Ava "
                  "have now?\nAnswer:", "Table of 7 + n:\n"],
    "fineweb": ["The capital of France is", "The chemical symbol of gold is", "If yesterday was Friday, then tomorrow "
                "will be", "The opposite of hot is", "The planets of the solar system are:"],
}

def lr_multiplier(step, num_iterations, warmup_frac, warmdown_frac):
    """
    Trapezoid schedule over N = num_iterations steps: linear warmup over W = round(warmup_frac N) steps, constant,
    then linear decay to 0 over the last D = round(warmdown_frac N) steps:

        m(s) = (s + 1) / W      for s < W
        m(s) = 1                for W <= s < N - D
        m(s) = (N - s) / D      for s >= N - D
    """
    warmup, warmdown = round(warmup_frac * num_iterations), round(warmdown_frac * num_iterations)
    if step < warmup:
        return (step + 1) / warmup
    if step < num_iterations - warmdown:
        return 1.0
    return (num_iterations - step) / warmdown


def muon_momentum(step, ramp_steps=300):
    """Muon's momentum ramps linearly from 0.85 to 0.95 over the first ramp_steps steps (as in nanochat)."""
    frac = min(step / ramp_steps, 1.0)
    return (1 - frac) * 0.85 + frac * 0.95


def training_texts(data, split, data_files=None):
    """
    The pretraining documents: the synthetic corpus, or FineWeb-Edu from local parquet files (--data-files, else
    $NANOPOST_DATA_DIR as `python tasks.py prepare` fills it), which each rank reads only its own row groups of.
    """
    if data == "synthetic" and not data_files:
        return tasks.pretraining_texts("tiny", split)
    texts = tasks.fineweb_texts(split, local=data_files)
    if not isinstance(texts, tasks.ParquetDocuments):
        raise FileNotFoundError("pretraining reads FineWeb-Edu from local files, so that each rank reads only its "
                                "share and a resume seeks instead of downloading again: run `python tasks.py prepare` "
                                "and set NANOPOST_DATA_DIR=$NANOPOST_HOME/data (speedrun.sh does both), or pass "
                                "--data-files")
    return texts


def horizon(args, num_params):
    """Optimizer steps: --num-iterations, else --target-param-data-ratio tokens per parameter."""
    return args.num_iterations or round(args.target_param_data_ratio * num_params / args.total_batch_size)


def plan(args, config):
    """
    The preset's budget on its planned hardware (common.stage_plan): the horizon's tokens plus the validation
    passes (forward only: 1/3 of a training token's FLOPs) at the compiled step's MFU; memory with whole logits
    (pretraining keeps them, logits_chunk=None) at the largest micro-batch that fits, which is an upper bound:
    model.training_memory counts the tensors eager code keeps, and the compiled step keeps fewer.
    """
    num_params, flops_per_token = model_size(config)
    steps = horizon(args, num_params)
    tokens = steps * args.total_batch_size + (steps // max(args.eval_every, 1) + 1) * args.eval_tokens / 3
    micro = fit_batch_tokens("pretraining", config, HARDWARE[args.preset]["memory"],
                             args.device_batch_size * args.max_seq_len, args.max_seq_len, logits_chunk=None)
    return stage_plan("base", args.preset, config, micro, None, tokens, flops_per_token, ASSUMED_MFU["pretrain"],
                      note=f"{steps:,} steps, {steps * args.total_batch_size / num_params:.1f} tokens/parameter; "
                           "memory: eager bound")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Pretrain the base model (see the module docstring).")
    add_stage_flags(parser, PRESETS, preset="fills the defaults below", seed="seed of the weight initialisation",
                    out="checkpoint folder (default: $NANOPOST_HOME/checkpoints/base)",
                    resume="continue from the latest checkpoint in --out if any")
    parser.add_argument("--depth", type=int, help="number of layers; sets width, heads, lr scale and horizon")
    parser.add_argument("--max-seq-len", type=int, help="tokens per training row (context length)")
    parser.add_argument("--device-batch-size", type=int, help="rows per forward pass on each process (default on a "
                        "GPU: the largest of the preset's, half of it, ... that fits its memory by "
                        "model.training_memory)")
    parser.add_argument("--total-batch-size", type=int, help="tokens per optimizer step over all processes "
                        "(reached by gradient accumulation)")
    parser.add_argument("--num-iterations", type=int, help="optimizer steps (default: from --target-param-data-ratio)")
    parser.add_argument("--target-param-data-ratio", type=float, help="training tokens per parameter when "
                        "--num-iterations is not given (20 = Chinchilla)")
    parser.add_argument("--matrix-lr", type=float, help="Muon lr of the matrices inside the blocks")
    parser.add_argument("--embedding-lr", type=float, help="AdamW lr of the token embedding (at width 768)")
    parser.add_argument("--unembedding-lr", type=float, help="AdamW lr of lm_head (at width 768)")
    parser.add_argument("--weight-decay", type=float, help="decoupled weight decay of every parameter")
    parser.add_argument("--warmup-frac", type=float, help="fraction of the steps with linear lr warmup")
    parser.add_argument("--warmdown-frac", type=float, help="fraction of the steps with linear lr decay to 0")
    parser.add_argument("--data", choices=sorted(SAMPLE_PROMPTS), help="synthetic corpus or FineWeb-Edu")
    parser.add_argument("--data-files", nargs="+", help="local parquet files with a `text` column, read instead of "
                        "the FineWeb-Edu hub download (its first 10,000 documents are the validation split)")
    parser.add_argument("--eval-every", type=int, help="steps between validation bits-per-byte evaluations "
                        "(0: only at the end)")
    parser.add_argument("--eval-tokens", type=int, help="validation tokens per evaluation (over all processes)")
    parser.add_argument("--sample-every", type=int, help="steps between greedy samples of fixed prompts (0: never)")
    parser.add_argument("--save-every", type=int, help="steps between resumable checkpoints (0: only the final one)")
    parser.add_argument("--log-every", type=int, help="steps between progress lines")
    parser.add_argument("--decontaminate", action=argparse.BooleanOptionalAction, default=None,
                        help="skip documents that overlap an evaluation set in use (tasks.NgramIndex: a shared 13-gram "
                             "of normalised words or a whole short question; each rank checks its own documents as "
                             "it reads them); default on for full, off for tiny (the synthetic corpus is built from "
                             "train-split problems only)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, build the model and the data "
                        "pipeline, save the untrained model as a stand-in base checkpoint and stop (no training)")
    args = parser.parse_args(argv)
    args.fit_batch = args.device_batch_size is None  # fit the rows to the GPU, up to the preset's
    for key, value in {**DEFAULTS, **PRESETS[args.preset]}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    check_numbers(args, positive=["depth", "max_seq_len", "device_batch_size", "total_batch_size", "num_iterations",
                                  "target_param_data_ratio", "eval_tokens", "log_every"],
                  nonnegative=["eval_every", "sample_every", "save_every", "weight_decay", "warmup_frac",
                               "warmdown_frac"])
    args.out = args.out or str(checkpoint_dir("base"))
    return args


def main(argv=None):
    args = parse_args(argv)
    is_ddp, rank, _, world_size, device = compute_init(args.device, seed=args.seed)
    master = rank == 0

    # -------------------------------------------------------------------------
    # Model and everything --depth derives, printed
    tokenizer = Tokenizer.load(get_base_dir() / "tokenizer")
    config = GPTConfig.from_depth(args.depth, tokenizer.vocab_size, args.max_seq_len)
    model = GPT(config).to(device)
    model.init_weights()
    num_params, flops_per_token = model.num_params(), model.flops_per_token()
    if args.fit_batch and device.type == "cuda":
        args.device_batch_size = batch_tokens_for_device("pretraining", None, device, config, args.device_batch_size
                                                         * args.max_seq_len, args.max_seq_len, None) // args.max_seq_len
    tokens_per_micro_step = args.device_batch_size * args.max_seq_len * world_size
    if args.total_batch_size % tokens_per_micro_step:
        raise ValueError(f"--total-batch-size {args.total_batch_size} is not a multiple of device batch x seq len x "
                         f"processes = {tokens_per_micro_step}; change one of them")
    grad_accum = args.total_batch_size // tokens_per_micro_step
    num_iterations = horizon(args, num_params)
    total_tokens = num_iterations * args.total_batch_size
    print0(f"model: depth {config.n_layer}, n_embd {config.n_embd}, {config.n_head} heads (kv {config.n_kv_head}), "
           f"vocab {config.vocab_size}, context {config.sequence_len}")
    print0(f"parameters: {num_params:,} | FLOPs/token: {flops_per_token:.3e}")
    print0(f"batch: {args.total_batch_size:,} tokens/step = {args.device_batch_size} rows x {args.max_seq_len} tokens "
           f"x {world_size} processes x {grad_accum} accumulation steps")
    print0(f"horizon: {num_iterations:,} steps, {total_tokens:,} tokens = {total_tokens / num_params:.2f} tokens per "
           f"parameter, {flops_per_token * total_tokens:.3e} FLOPs")
    optimizers = model.setup_optimizers(args.matrix_lr, args.embedding_lr, args.unembedding_lr, args.weight_decay)
    adamw, muon = optimizers
    print0(f"learning rates: Muon {args.matrix_lr} | AdamW embedding {adamw.param_groups[1]['lr']:.5f}, lm_head "
           f"{adamw.param_groups[0]['lr']:.5f} (x (n_embd/768)^-0.5) | warmup {args.warmup_frac}, "
           f"warmdown {args.warmdown_frac}")

    # -------------------------------------------------------------------------
    # Resume: model, optimizers, step, data position and RNG from the latest checkpoint in --out
    start_step, data_position, train_seconds, train_tokens = 0, (0, 0), 0.0, 0
    resume = resume_or_finish(args.out, args.resume, "pretraining")
    if resume is FINISHED:
        return
    if resume:
        model_state, meta, extra = load_checkpoint(resume, device=device)
        if meta["model_config"] != asdict(config) or meta["total_batch_size"] != args.total_batch_size \
                or meta["num_iterations"] != num_iterations or len(extra["data_positions"]) != world_size:
            raise ValueError(f"{args.out} was written by a different run (model, batch, horizon or number of "
                             "processes differ); resume with the same flags or pick another --out")
        model.load_state_dict(model_state)
        load_optimizers(optimizers, extra["optimizers"])
        start_step, data_position = meta["step"], extra["data_positions"][rank]
        train_seconds, train_tokens = extra["train_seconds"], extra["train_tokens"]
        torch.set_rng_state(extra["rng_cpu"].cpu())
        if device.type == "cuda":
            torch.cuda.set_rng_state(extra["rng_cuda"].cpu(), device)
        print0(f"resumed from {args.out} at step {start_step}")
    logger = Logger(args.run, vars(args), series=extra.get("curves") if resume else None)
    orig_model = model  # uncompiled, unwrapped: evaluation, sampling and checkpoints use it
    # DDP first, then compile: compiling the wrapped model lets the compiler split the graph at DDP's gradient
    # buckets, so each bucket's all-reduce overlaps the rest of backward. The rotary tables are buffers but not
    # state (identical on every rank): no per-step broadcast of them.
    if is_ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                                          broadcast_buffers=False)
    if device.type == "cuda":
        model = torch.compile(model, dynamic=False)

    # -------------------------------------------------------------------------
    # Data: this rank's documents packed into (B, T) rows; a fixed validation set
    train_texts = training_texts(args.data, "train", args.data_files)
    index = tasks.decontamination_index(args.preset) if args.decontaminate else None
    contaminated = [0]  # documents skipped by this rank since this process started

    def keep(text):
        dirty = index.overlaps(text)
        contaminated[0] += dirty
        return not dirty

    batches = tasks.pretraining_batches(tokenizer, train_texts, args.device_batch_size, args.max_seq_len, rank,
                                        world_size, start=data_position, keep=keep if index else None)
    if args.dry_run:
        if args.preset in HARDWARE:
            print_plan(plan(args, config))
        x, _, _ = next(batches)
        print0(f"dry run: the training pipeline yields rows of shape {tuple(x.shape)}; saving the untrained model "
               f"as a stand-in base checkpoint in {args.out} and stopping")
        if master:
            save_checkpoint(args.out, 0, orig_model, {"stage": "base", "finished": False, "dry_run": True},
                            tokenizer=tokenizer)
        compute_cleanup()
        return
    eval_steps = max(args.eval_tokens // tokens_per_micro_step, 1)
    # Validation is split by document, not by row group as training is: its 10,000 documents are ~10 row groups,
    # fewer than the ranks of a 2-node run. iter() hides the ParquetDocuments, so every rank reads the split (a few
    # MB) and keeps every world_size-th document.
    val_texts = iter(training_texts(args.data, "val", args.data_files))
    val_batches = [(x, y) for x, y, _ in islice(tasks.pretraining_batches(
        tokenizer, val_texts, args.device_batch_size, args.max_seq_len, rank, world_size), eval_steps)]
    if len(val_batches) < eval_steps:
        raise ValueError(f"the validation split has fewer than --eval-tokens {args.eval_tokens} tokens; lower it")
    token_bytes = torch.tensor(tokenizer.token_bytes(), dtype=torch.long)
    prompts = [tokenizer.encode(p, prepend="<|bos|>") for p in SAMPLE_PROMPTS[args.data]]

    def fetch():
        """The next training batch already on its way to the device (x, y, data position after it), or None at the
        end of the corpus. Called right after a backward, so that the host packs and copies the next batch while
        the device computes (pinned memory makes the copy asynchronous on CUDA)."""
        x, y, position = next(batches, (None, None, None))
        if x is None:
            return None
        if device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True), position

    def save(step, finished):
        """Checkpoint on rank 0; every rank contributes its data position (an all-gather, so all ranks call it)."""
        positions = [data_position]
        if is_ddp:
            positions = [None] * world_size
            dist.all_gather_object(positions, data_position)
        if not all(torch.isfinite(p).all() for p in orig_model.parameters()):
            raise FloatingPointError(f"non-finite weights at step {step}: not saving over the last good checkpoint "
                                     f"in {args.out}; lower the learning rates and rerun (or --resume from it)")
        if finished:
            check_ranks_agree(orig_model, f"pretraining step {step}")
        if not master:
            return
        meta = {"stage": "base", "finished": finished, "num_iterations": num_iterations,
                "total_batch_size": args.total_batch_size, "val_bpb": val_bpb, "args": vars(args)}
        extra = {"optimizers": [o.state_dict() for o in optimizers], "data_positions": positions,
                 "train_seconds": train_seconds, "train_tokens": train_tokens, "rng_cpu": torch.get_rng_state(),
                 "curves": logger.series}
        if device.type == "cuda":
            extra["rng_cuda"] = torch.cuda.get_rng_state(device)
        path = save_checkpoint(args.out, step, orig_model, meta, tokenizer=tokenizer, extra=extra)
        print0(f"saved {path}")

    # -------------------------------------------------------------------------
    # Training loop. Step s: evaluate / sample / save (the state after s updates), then one optimizer update.
    val_bpb, loss_value, peak = None, None, peak_flops(device)
    next_batch = fetch()
    for step in range(start_step, num_iterations + 1):
        last_step = step == num_iterations
        if last_step or args.eval_every and step % args.eval_every == 0:
            orig_model.eval()
            val_bpb = evaluate_bpb(orig_model, val_batches, token_bytes, device)
            orig_model.train()
            print0(f"step {step:05d}/{num_iterations:05d} | val bpb {val_bpb:.4f}")
            logger.log({"val/bpb": val_bpb}, step)
        if master and args.sample_every and step > 0 and (step % args.sample_every == 0 or last_step):
            orig_model.eval()
            # A few short greedy samples: a decode-step compile would cost more than it saves.
            completions = Engine(orig_model, tokenizer, compiled=False).generate(prompts, max_tokens=32,
                                                                                temperature=0.0)
            for prompt, (completion,) in zip(prompts, completions):
                print0(f"  sample: {tokenizer.decode(prompt[1:] + completion.tokens)!r}")
            orig_model.train()
        if last_step:
            break
        if args.save_every and step > start_step and step % args.save_every == 0:
            save(step, finished=False)

        # The host waits for the device (a loss .item(), a synchronize) only on steps it logs; on the others it
        # queues the next step at once. A NaN loss is caught on the next logged step (and at any checkpoint by the
        # finite-weights check in save()).
        host_step = (step % args.log_every == 0 or step % max(num_iterations // 200, 1) == 0
                     or step == num_iterations - 1)
        t0 = time.time()
        lrm = lr_multiplier(step, num_iterations, args.warmup_frac, args.warmdown_frac)
        set_lr(optimizers, lrm)
        for group in muon.param_groups:
            group["momentum"] = muon_momentum(step)
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(grad_accum):
            if next_batch is None:
                raise RuntimeError(f"ran out of training documents at step {step}: the corpus is smaller than "
                                   f"{total_tokens:,} tokens; lower --num-iterations or add data")
            x, y, data_position = next_batch
            # DDP all-reduces gradients only on the last micro-step; the others just accumulate locally.
            accumulate_only = is_ddp and micro_step < grad_accum - 1
            with model.no_sync() if accumulate_only else nullcontext():
                with autocast_ctx(device):
                    # Whole logits: compiled, a full-length micro-batch fits (nanochat's depth-20 setting), and the
                    # chunked path would recompute lm_head's forward in backward (~5% of a depth-20 step).
                    loss = model(x, y, logits_chunk=None)
                (loss / grad_accum).backward()
            next_batch = fetch()  # while the device runs the backward just queued
            loss_sum += loss.detach()
        for optimizer in optimizers:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        if host_step:
            if is_ddp:
                dist.all_reduce(loss_sum)  # every rank sees the same loss, so a NaN stops all of them together
            loss_value = loss_sum.item() / (grad_accum * world_size)
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss is {loss_value} at step {step}: training diverged. The last good "
                                         f"checkpoint in {args.out} is intact; lower the learning rates and rerun, "
                                         "or --resume from it")
            synchronize(device)
        dt = time.time() - t0  # on other steps the time to queue the step; their sum up to a logged step is exact
        if step - start_step >= 3:  # the first steps include compilation and warm-up: not counted in throughput
            train_seconds += dt
            train_tokens += args.total_batch_size
        tokens_per_sec = args.total_batch_size / dt
        mfu = flops_per_token * tokens_per_sec / (peak * world_size) if peak else None
        if step % args.log_every == 0 or step == num_iterations - 1:
            seconds_per_step = train_seconds * args.total_batch_size / train_tokens if train_tokens else dt
            eta = format_eta((num_iterations - step - 1) * seconds_per_step)
            memory = f" | mem {torch.cuda.max_memory_allocated(device) / 2**30:.1f}GiB" if device.type == "cuda" else ""
            print0(f"step {step:05d}/{num_iterations:05d} | loss {loss_value:.6f} | lrm {lrm:.3f} | "
                   f"{tokens_per_sec:,.0f} tok/s" + (f" | mfu {100 * mfu:.1f}%" if mfu else "") + memory +
                   f" | eta {eta}")
        if host_step:  # the other steps' loss is the last one read and their time only the time to queue them
            logger.log({"train/loss": loss_value, "train/lrm": lrm, "train/tokens_per_sec": tokens_per_sec,
                        **({"train/mfu": mfu} if mfu else {})}, step + 1)
        if preempted(device):  # SIGTERM/SIGINT: keep this step's work, see common.py
            save(step + 1, finished=False)
            exit_preempted(args.out)

    # -------------------------------------------------------------------------
    # Final checkpoint and report
    save(num_iterations, finished=True)
    average_tps = train_tokens / train_seconds if train_seconds else None
    record = {"stage": "pretrain", "preset": args.preset, "depth": args.depth, "params": num_params,
              "steps": num_iterations, "tokens": total_tokens, "val_bpb": val_bpb, "train_loss": loss_value,
              "seconds": train_seconds, "tokens_per_sec": average_tps, "world_size": world_size,
              "device": str(device.type)}
    if peak and average_tps:
        record["mfu"] = flops_per_token * average_tps / (peak * world_size)
    if device.type == "cuda":
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if index is not None:
        dropped = torch.tensor(contaminated[0], device=device)
        if is_ddp:
            dist.all_reduce(dropped)
        record["contaminated_docs"] = int(dropped)
        print0(f"decontamination: skipped {int(dropped):,} documents that overlap an evaluation set")
    append_report(record, logger)
    print0(f"done: val bpb {val_bpb:.4f}, train loss {loss_value}, {train_seconds:.0f}s of training")
    logger.finish()
    compute_cleanup()


if __name__ == "__main__":
    run_cli(main, preemptible=True)

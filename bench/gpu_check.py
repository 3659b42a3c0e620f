"""
The acceptance run on one GPU, in under 9 minutes: does every stage the GPU presets run work, how fast, and within how
much memory, against what plan.py assumes? No hub access: stand-in data (tasks.write_stand_in_data) and a tokenizer
trained on it, in a temporary $NANOPOST_HOME. Each phase writes one JSON line to --out/results.jsonl the moment it
ends (a run cut short still returns what it measured); a phase the --deadline no longer allows (its PHASE_SECONDS
estimate) is written as skipped. Exits 1 if any phase failed.

    torchrun --standalone --nproc_per_node=1 bench/gpu_check.py --deadline 540 --out accept   # NCCL and DDP run
    python bench/gpu_check.py --print-command     # the commands for an offline GPU machine (wheels, data, torchrun)
    python bench/gpu_check.py --device cpu --depth 2 --vocab-size 512 --seq-len 64 --rows 1 --accum 2 --steps 4 \
        --engine-rows 8 --engine-tokens 8 --decode-samples 2 --rl-prompts 2 --rl-max-tokens 8   # tests/test_gpu_check.py

Phases, each through the stage's own code:
    env       torch / CUDA / cuDNN versions, the SDPA backend chosen for the training shape, bf16 GEMM TFLOP/s
              (CPU: fp32) and device copy bandwidth
    pretrain  pretrain.main at the production per-rank shape (full preset: depth 20, 8 rows x 2,048, accumulation
              as on one rank of 8 GPUs), a recompile an error: tokens/s, MFU (nanochat's 6N + attention formula over
              the GPU's peak), the first step's extra seconds (compile), peak memory against the plan
    profile   one forward/backward/optimizer step at that shape under torch.profiler, time by kernel kind
    sft, dpo  one optimizer step at the micro-batch the stage fits on this device, full-length rows / pairs
    rm        rm.main for two steps on the stand-in UltraFeedback pairs: the reward model the RL phase scores with
    rl        rl.main for two steps with --reward rm (scores that differ within a group: every group has contrast):
              each step must keep groups and log finite clip, entropy and engine/learner log-prob gap
    eval      eval.evaluate_multiple_choice on items whose prompts fill the preset's context
    engine    Engine.generate of --engine-rows rows x --engine-tokens tokens, timed on the call after a warm-up one
    decode    1 prompt x each of --decode-samples samples, eager and compiled (each timed after its warm-up): tok/s,
              ms per step and the bytes a step must read (weights + KV cache), beside nanochat's infer_bench.py
Checks: a peak more than 15% away from the plan (common.planned_memory), a pretraining MFU outside +-15% of
common.ASSUMED_MFU, a throughput below half of what the plan assumes, on CUDA a CUDA-graph skip or more than 3
decode compiles in the RL phase. Compilation is never inside a timed region.
"""

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import unittest.mock
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import dpo  # noqa: E402
import eval as evaluation  # noqa: E402
import pretrain  # noqa: E402
import rl  # noqa: E402
import rm  # noqa: E402
import sft  # noqa: E402
import tasks  # noqa: E402
from engine import Engine, KVCache, load_model  # noqa: E402
from model import LOGITS_CHUNK_TOKENS, GPTConfig, ScalarHeadModel  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

GIB = common.GIB


PHASE_SECONDS = {  # what each phase costs on one H100/H200 (compiles included), for --deadline
    "env": 15, "pretrain": 150, "profile": 20, "sft": 25, "dpo": 25, "rm": 40, "rl": 120, "eval": 20, "engine": 45,
    "decode": 120}
PHASES = tuple(PHASE_SECONDS)  # in the order they run: the most telling first
MEMORY_TOLERANCE, MFU_TOLERANCE = 0.15, 0.15
MAX_DECODE_COMPILES = 3


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--preset", choices=sorted(common.HARDWARE), default="full",
                        help="the preset whose stages are checked (full: depth 20; small: depth 8)")
    parser.add_argument("--depth", type=int, help="model depth (default: the preset's)")
    parser.add_argument("--seq-len", type=int, help="row length (default: the preset's context)")
    parser.add_argument("--rows", type=int, default=8, help="pretraining rows per micro-batch (production: 8 on an "
                        "80 GB GPU)")
    parser.add_argument("--accum", type=int, help="pretraining micro-batches per step (default: as on one rank of the "
                        "preset's GPUs: total batch / (GPUs x rows x seq-len))")
    parser.add_argument("--vocab-size", type=int, default=65536, help="tokenizer trained on the stand-in text")
    parser.add_argument("--steps", type=int, default=10, help="pretraining steps (the first 3 are not timed)")
    parser.add_argument("--batch-tokens", type=int, help="micro-batch tokens of the SFT and DPO checks (default: the "
                        "largest of the preset's budget, half of it, ... that fits the GPU; CPU: one row or pair)")
    parser.add_argument("--engine-rows", type=int, default=128, help="rows the engine decodes together")
    parser.add_argument("--engine-tokens", type=int, default=256, help="tokens each engine row generates")
    parser.add_argument("--decode-samples", type=int, nargs="*", default=[1, 8, 32, 128],
                        help="samples of one prompt in the decode sweep (none: skip it)")
    parser.add_argument("--rl-prompts", type=int, default=4, help="prompts of each RL step (x the preset's group size)")
    parser.add_argument("--rl-max-tokens", type=int, help="RL generation budget (default: the preset's)")
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds from the start: a phase whose "
                        "PHASE_SECONDS no longer fit is skipped")
    parser.add_argument("--out", default="gpu_check_out", help="folder of results.jsonl")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: autodetect)")
    parser.add_argument("--print-command", action="store_true", help="print the commands for an offline GPU machine "
                        "and exit")
    return parser.parse_args(argv)


def measure(device, fn):
    """(fn(), seconds, peak GiB allocated on CUDA during fn or None)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    common.synchronize(device)
    t0 = time.time()
    result = fn()
    common.synchronize(device)
    return result, time.time() - t0, peak_gib(device)


def peak_gib(device):
    """torch.cuda.max_memory_allocated since the last reset, in GiB; None off CUDA."""
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def quietly(fn, *args):
    """fn(*args) with its stdout captured: (result, the text it printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = fn(*args)
    return result, out.getvalue()


def assumed_rate(device, mfu, flops_per_token, processes=1):
    """Tokens/s the plan assumes: `mfu` of this GPU's peak FLOP/s over every process; None off CUDA or for a GPU whose
    peak is not in pretrain.PEAK_FLOPS."""
    peak = pretrain.peak_flops(device)
    return mfu * peak * processes / flops_per_token if peak else None


def check_env(args, device):
    """Versions, the SDPA backend PyTorch picks for the training shape, bf16 GEMM TFLOP/s and copy bandwidth."""
    config = GPTConfig.from_depth(args.depth or pretrain.PRESETS[args.preset]["depth"], args.vocab_size,
                                  args.seq_len or pretrain.PRESETS[args.preset]["max_seq_len"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head_dim = config.n_embd // config.n_head
    q = torch.randn(args.rows, config.n_head, config.sequence_len, head_dim, device=device, dtype=dtype)
    try:  # the dispatcher's own choice (a private function: its absence is reported, not fatal)
        sdpa = torch.nn.attention.SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name
    except Exception as e:  # noqa: BLE001
        sdpa = f"unknown ({type(e).__name__})"
    n = 8192 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up: cuBLAS picks its kernel
    _, seconds, _ = measure(device, lambda: [a @ b for _ in range(10)])
    gemm = 10 * 2 * n ** 3 / seconds / 1e12
    x = torch.empty(2**28 if device.type == "cuda" else 2**24, device=device, dtype=torch.uint8)
    x.clone()
    _, seconds, _ = measure(device, lambda: [x.clone() for _ in range(10)])
    bandwidth = 10 * 2 * x.numel() / seconds / 1e9  # read + write
    versions = dict(torch=torch.__version__, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version() if device.type == "cuda" else None,
                    python=sys.version.split()[0])
    return dict(check="env", shape=f"SDPA {sdpa}, {str(dtype)[6:]}", seconds=0.0, peak=None, plan=None,
                speed=f"GEMM {gemm:,.1f} TFLOP/s, copy {bandwidth:,.0f} GB/s", sdpa_backend=sdpa,
                gemm_tflops=gemm, copy_gb_s=bandwidth, **versions)


def pretrain_shape(args):
    """(config, rows, accumulation) of the pretraining phase: the production per-rank shape by default."""
    values = pretrain.PRESETS[args.preset]
    seq_len = args.seq_len or values["max_seq_len"]
    config = GPTConfig.from_depth(args.depth or values["depth"], args.vocab_size, seq_len)
    accum = args.accum or max(1, values["total_batch_size"] // (common.HARDWARE[args.preset]["gpus"] * args.rows
                                                                 * seq_len))
    return config, args.rows, accum


STEP_LINE = re.compile(r"^step (\d+)/\d+ \| loss [\d.]+ \| lrm [\d.]+ \| ([\d,]+) tok/s", re.M)


def check_pretrain(args, device, data_files):
    """pretrain.main at the production per-rank shape, as one job over every rank; a recompile after the first
    compile raises (torch._dynamo.config.error_on_recompile)."""
    world_size = common.get_dist_info()[3]
    config, rows, accum = pretrain_shape(args)
    seq_len = config.sequence_len
    tokens = rows * seq_len
    argv = ["--preset", args.preset, "--depth", str(config.n_layer), "--max-seq-len", str(seq_len),
            "--device-batch-size", str(rows), "--total-batch-size", str(tokens * accum * world_size),
            "--num-iterations", str(args.steps), "--eval-every", "0", "--eval-tokens", str(tokens),
            "--sample-every", "0", "--save-every", "0", "--log-every", "1",
            "--data-files", *map(str, data_files), "--device", device.type]
    import torch._dynamo

    with unittest.mock.patch.object(torch._dynamo.config, "error_on_recompile", True):
        (_, out), seconds, peak = measure(device, lambda: quietly(pretrain.main, argv))
    record = common.read_report()[-1]
    step_seconds = [tokens * accum * world_size / float(rate.replace(",", "")) for _, rate in STEP_LINE.findall(out)]
    compile_s = step_seconds[0] - sorted(step_seconds)[len(step_seconds) // 2] if step_seconds else None
    mfu = record.get("mfu")
    return dict(check="pretrain", shape=f"depth {config.n_layer}, {rows} x {seq_len} x {accum} accum x "
                f"{world_size} ranks", speed=f"{record['tokens_per_sec']:,.0f} tok/s"
                + (f", MFU {100 * mfu:.1f}%" if mfu else ""), seconds=seconds, peak=peak,
                plan=common.planned_memory(config, tokens, None) / GIB, rate=record["tokens_per_sec"],
                need=assumed_rate(device, common.ASSUMED_MFU["pretrain"], common.model_size(config)[1], world_size),
                mfu=mfu, assumed_mfu=common.ASSUMED_MFU["pretrain"], compile_s=compile_s, recompiles=0)


KERNEL_KINDS = [  # (kind, pattern of the kernel's name), first match wins
    ("nccl", re.compile(r"nccl", re.I)), ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)),
    ("triton", re.compile(r"triton", re.I)), ("optimizer", re.compile(r"foreach|adam|muon|zeropower|optim", re.I)),
    ("gemm bf16", re.compile(r"(gemm|cutlass|xmma|matmul|\bmm\b|addmm|bmm).*(bf16|bfloat16)|(bf16|bfloat16).*(gemm|"
                             r"cutlass|xmma)", re.I)),
    ("gemm tf32/fp32", re.compile(r"gemm|cutlass|xmma|matmul|aten::mm|aten::addmm|aten::bmm", re.I))]


def kernel_kind(name):
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def check_profile(args, device, model, tokenizer):
    """One forward/backward/optimizer step of the base model at the pretraining micro-batch under torch.profiler,
    self time grouped by kernel kind (device kernels on CUDA, operators on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    _, rows, _ = pretrain_shape(args)
    seq_len = model.config.sequence_len
    x = torch.randint(tokenizer.vocab_size, (rows, seq_len + 1), device=device)
    optimizers = model.setup_optimizers(0.0, 0.0, 0.0)

    def step():
        with common.autocast_ctx(device):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        optimizer_step(model, optimizers)

    step()  # warm-up: the profile shows a steady step
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _, seconds, peak = measure(device, step)
    by_kind = {}
    for event in prof.key_averages():
        us = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if us > 0 and (device.type == "cuda" or event.key.startswith("aten::")):
            by_kind[kernel_kind(event.key)] = by_kind.get(kernel_kind(event.key), 0.0) + us / 1e3
    top = sorted(by_kind.items(), key=lambda item: -item[1])
    return dict(check="profile", shape=f"{rows} x {seq_len}, 1 step", seconds=seconds, peak=peak, plan=None,
                speed=", ".join(f"{kind} {ms:.0f}ms" for kind, ms in top[:4]), ms_by_kind=dict(top))


def micro_batch_tokens(args, device, stage, config, budget, unit):
    """The SFT/DPO check's micro-batch: --batch-tokens, else what the stage would pick on this device (CPU: unit)."""
    if args.batch_tokens or device.type == "cuda":
        return quietly(common.batch_tokens_for_device, stage, args.batch_tokens, device, config, budget, unit,
                       LOGITS_CHUNK_TOKENS)[0]
    return unit


def optimizer_step(model, optimizers):
    for optimizer in optimizers:
        optimizer.step()
    model.zero_grad(set_to_none=True)


def check_sft(args, device, model, tokenizer):
    """One optimizer step of sft.backward_sft_loss on full-length rows filling the micro-batch budget."""
    seq_len = model.config.sequence_len
    tokens = micro_batch_tokens(args, device, "sft", model.config, sft.PRESETS[args.preset]["device_batch_tokens"],
                                seq_len)
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(tokenizer.vocab_size, (seq_len + 1,), generator=g).tolist(), [0] + [1] * seq_len)
            for _ in range(tokens // seq_len)]
    micro = [tasks.collate(rows, tokenizer.bos_id)]
    optimizers = model.setup_optimizers(0.0, 0.0, 0.0)  # lr 0: the step costs what a real one does, changes nothing

    def step():
        loss = sft.backward_sft_loss(model, micro, device)[0]
        optimizer_step(model, optimizers)
        return loss

    _, seconds, peak = measure(device, step)
    return dict(check="sft", shape=f"{len(rows)} x {seq_len} = {tokens:,} tokens",
                speed=f"{tokens / seconds:,.0f} tok/s", seconds=seconds, peak=peak,
                plan=common.planned_memory(model.config, tokens, LOGITS_CHUNK_TOKENS) / GIB, rate=tokens / seconds,
                need=assumed_rate(device, common.ASSUMED_MFU["post-training"], model.flops_per_token()))


def check_dpo(args, device, model, tokenizer):
    """One optimizer step of dpo.preference_losses on pairs of two full-length sides filling the budget."""
    seq_len = model.config.sequence_len
    tokens = micro_batch_tokens(args, device, "dpo", model.config, dpo.PRESETS[args.preset]["device_batch_tokens"],
                                2 * seq_len)
    g = torch.Generator().manual_seed(1)

    def side():
        return torch.randint(tokenizer.vocab_size, (seq_len + 1,), generator=g).tolist(), [0] * 8 + [1] * (seq_len - 7)

    pairs = [(side(), side()) for _ in range(tokens // (2 * seq_len))]
    ref = torch.zeros(len(pairs), 2, device=device)
    loss_args = SimpleNamespace(beta=0.1, loss_type="sigmoid", label_smoothing=0.0, gamma=0.5, sft_weight=0.0)
    optimizers = model.setup_optimizers(0.0, 0.0, 0.0)

    def step():
        losses, _ = dpo.preference_losses(model, pairs, ref, loss_args, tokenizer.bos_id, device)
        losses.mean().backward()
        optimizer_step(model, optimizers)

    _, seconds, peak = measure(device, step)
    return dict(check="dpo", shape=f"{len(pairs)} pairs x 2 x {seq_len} = {tokens:,} tokens",
                speed=f"{tokens / seconds:,.0f} tok/s", seconds=seconds, peak=peak,
                plan=common.planned_memory(model.config, tokens, LOGITS_CHUNK_TOKENS) / GIB, rate=tokens / seconds,
                need=assumed_rate(device, common.ASSUMED_MFU["post-training"], model.flops_per_token()))


def check_rm(args, device, base, home):
    """rm.main for one epoch of two steps of the full preset's micro-batch on the stand-in UltraFeedback pairs (a
    step's worth is left after decontamination drops some), saved for the RL phase."""
    pairs = rm.PRESETS[args.preset]["device_batch_size"] * common.get_dist_info()[3]
    argv = ["--preset", args.preset, "--ckpt", str(base), "--out", str(home / "rm"), "--pairs", "ultrafeedback",
            "--train-pairs", str(2 * pairs), "--eval-pairs", "2", "--batch-size", str(pairs), "--epochs", "1",
            "--eval-every", "1000", "--device", device.type]
    (_, out), seconds, peak = measure(device, lambda: quietly(rm.main, argv))
    record = common.read_report()[-1]
    return dict(check="rm", shape=f"{record['steps']} steps of {pairs} pairs",
                speed=f"held-out pair accuracy {record['pair_accuracy']:.0%}", seconds=seconds, peak=peak, plan=None,
                error=None if record["steps"] >= 1 else "the reward model took no optimizer step")


def check_eval(args, device, model, tokenizer):
    """Multiple choice (letter style, as MMLU) on items whose prompt fills the preset's context, in eval's batches."""
    model.eval()
    seq_len = model.config.sequence_len
    words = " ".join(f"w{i}" for i in range(4 * seq_len))
    question = tokenizer.decode(tokenizer.encode(words)[:seq_len - 32])  # room for the choices and the answer
    items = [{"question": question, "choices": ["1", "2", "3", "4"], "answer": i % 4, "subject": "check"}
             for i in range(2 * evaluation.PRESETS[args.preset]["batch_size"])]
    result, seconds, peak = measure(device, lambda: quietly(evaluation.evaluate_multiple_choice, model, tokenizer,
                                                            items, "letter", 0,
                                                            evaluation.PRESETS[args.preset]["batch_size"])[0])
    model.train()
    return dict(check="eval", shape=f"{result['count']} items x 4 choices, ~{seq_len} tokens each",
                speed=f"{result['count'] / seconds:,.1f} items/s", seconds=seconds, peak=peak, plan=None)


def timed_generate(device, engine, prompts, **sampling):
    """(results, seconds, peak GiB) of engine.generate on the call after an identical warm-up call: compilation and
    CUDA-graph capture happen in the warm-up, never in the timed region."""
    engine.generate(prompts, **sampling)
    return measure(device, lambda: engine.generate(prompts, **sampling))


def check_engine(args, device, model, tokenizer):
    """Engine.generate of --engine-rows rows (8 prompts x rows/8 samples) x --engine-tokens after a warm-up call,
    and the KV dtype."""
    model.eval()
    prompts = [tokenizer.encode(f"Question {i}: what is {i} + {i}?", prepend="<|bos|>") for i in range(8)]
    with common.autocast_ctx(device):
        cache = KVCache(1, len(prompts[0]), model.config.n_layer, device)
        with torch.no_grad():  # one prefill, to see the dtype the cache stores keys and values in
            model(torch.tensor([prompts[0]], device=device), kv_cache=cache)
        results, seconds, peak = timed_generate(device, Engine(model, tokenizer), prompts,
                                                num_samples=max(1, args.engine_rows // 8),
                                                max_tokens=args.engine_tokens, temperature=1.0, seed=0)
    generated = sum(len(c.tokens) for group in results for c in group)
    kv_dtype = str(cache.keys[0].dtype).replace("torch.", "")
    ok = cache.keys[0].dtype == cache.values[0].dtype
    model.train()
    need = common.HARDWARE[args.preset]["decode_tokens_per_s"] if pretrain.peak_flops(device) else None
    return dict(check="engine", shape=f"{args.engine_rows} rows x {args.engine_tokens} tokens, KV {kv_dtype}",
                speed=f"{generated / seconds:,.0f} tok/s", seconds=seconds, peak=peak, plan=None,
                rate=generated / seconds, need=need,
                error=None if ok else f"keys {cache.keys[0].dtype} but values {cache.values[0].dtype}")


def decode_bytes_per_step(model, rows, context, kv_bytes):
    """The bytes one decode step must read at least: every weight once, and each row's keys and values."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = config.n_embd // config.n_head
    return weights + rows * context * config.n_layer * 2 * config.n_kv_head * head_dim * kv_bytes


def check_decode(args, device, model, tokenizer):
    """1 prompt x each of --decode-samples samples, eager and compiled, each timed after its warm-up call."""
    model.eval()
    prompt = tokenizer.encode("Question: what is 12 + 30?", prepend="<|bos|>")
    kv_bytes = 2 if device.type == "cuda" else 4
    sweep = []
    with common.autocast_ctx(device):
        for samples in args.decode_samples:
            for compiled in (False, True):
                results, seconds, _ = timed_generate(device, Engine(model, tokenizer, compiled=compiled), [prompt],
                                                     num_samples=samples, max_tokens=args.engine_tokens,
                                                     temperature=1.0, seed=0)
                steps = max(len(c.tokens) for c in results[0])
                sweep.append(dict(samples=samples, compiled=compiled,
                                  tok_s=sum(len(c.tokens) for c in results[0]) / seconds,
                                  ms_per_step=1e3 * seconds / steps,
                                  bytes_per_step=decode_bytes_per_step(model, samples, len(prompt) + steps // 2,
                                                                       kv_bytes)))
    model.train()
    best = max(sweep, key=lambda row: row["tok_s"])
    return dict(check="decode", shape=f"1 prompt x {args.decode_samples} samples x {args.engine_tokens} tokens",
                speed=f"best {best['tok_s']:,.0f} tok/s ({best['samples']} samples, "
                f"{'compiled' if best['compiled'] else 'eager'})", seconds=0.0, peak=None, plan=None, sweep=sweep)


RL_STEP_LINE = re.compile(r"^step \d+/\d+ \|.*kept (\d+) .*clip (\S+)/(\S+) \| entropy (\S+) .*\| gap (\S+) ", re.M)


def dynamo_counters():
    """(CUDA-graph skips, compiled graphs) so far in this process (torch._dynamo's counters)."""
    from torch._dynamo.utils import counters

    return sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",)), counters["stats"]["unique_graphs"]


def check_rl(args, device, base, home):
    """rl.main for two steps scored by the RM phase's reward model: each step must keep groups and log finite clip,
    entropy and gap; on CUDA no CUDA-graph skip and at most MAX_DECODE_COMPILES compiles."""
    world_size = common.get_dist_info()[3]
    argv = ["--preset", args.preset, "--ckpt", str(base), "--out", str(home / "rl"), "--num-steps", "2",
            "--reward", "rm", "--rm-ckpt", str(home / "rm"),
            "--prompts-per-step", str(args.rl_prompts * world_size), "--eval-every", "1000", "--eval-problems", "2",
            "--eval-samples", "1", "--save-every", "0", "--device", device.type]
    if args.rl_max_tokens:
        argv += ["--max-tokens", str(args.rl_max_tokens)]
    skips0, graphs0 = dynamo_counters()
    (_, out), seconds, peak = measure(device, lambda: quietly(rl.main, argv))
    skips, graphs = (now - then for now, then in zip(dynamo_counters(), (skips0, graphs0)))
    steps = [dict(kept=int(kept), clip_low=float(low), clip_high=float(high), entropy=float(entropy), gap=float(gap))
             for kept, low, high, entropy, gap in RL_STEP_LINE.findall(out)]
    error = None
    if common.get_dist_info()[1] == 0:  # only rank 0 prints the step lines
        trained = [s for s in steps if s["kept"] > 0 and all(math.isfinite(v) for v in s.values())]
        if len(steps) != 2 or len(trained) != 2:
            error = f"RL steps that updated: {len(trained)} of 2 ({steps})"
    if device.type == "cuda" and (skips or graphs > MAX_DECODE_COMPILES):
        error = f"{skips} CUDA-graph skips, {graphs} compiled graphs (at most {MAX_DECODE_COMPILES})"
    group = rl.PRESETS[args.preset]["group_size"]
    return dict(check="rl", shape=f"2 steps, {args.rl_prompts} prompts x {group} per rank, --reward rm",
                speed=" ".join(f"kept {s['kept']} gap {s['gap']:.1e}" for s in steps), seconds=seconds, peak=peak,
                plan=None, steps=steps, cudagraph_skips=skips, compiled_graphs=graphs, error=error)


def verdict(row, gpu_bytes):
    """ "ok", or "FAIL: why" for a phase's row: an error, a peak over the GPU's memory or more than MEMORY_TOLERANCE
    away from its plan, an MFU outside MFU_TOLERANCE of the plan's assumption, or a throughput below half of what the
    plan assumes."""
    if row.get("error"):
        return f"FAIL: {row['error']}"
    if gpu_bytes and row.get("peak") is not None and row["peak"] * GIB > gpu_bytes:
        return "FAIL: over memory"
    if row.get("plan") and row.get("peak") is not None and abs(row["peak"] / row["plan"] - 1) > MEMORY_TOLERANCE:
        return f"FAIL: peak {row['peak']:.1f} GiB is {row['peak'] / row['plan'] - 1:+.0%} off the plan's {row['plan']:.1f}"
    if row.get("mfu") and row.get("assumed_mfu") and abs(row["mfu"] / row["assumed_mfu"] - 1) > MFU_TOLERANCE:
        return f"FAIL: MFU {row['mfu']:.1%} outside the plan's {row['assumed_mfu']:.0%} +- {MFU_TOLERANCE:.0%}"
    if row.get("need") and row["rate"] < 0.5 * row["need"]:
        return f"FAIL: {row['rate']:,.0f} tok/s < half of the plan's {row['need']:,.0f}"
    return "ok"


def print_table(rows, gpu_bytes):
    print(f"\n{'phase':<9}{'shape':<50}{'throughput':<46}{'need':>10}{'seconds':>8}{'peak GiB':>10}{'plan GiB':>10}"
          "  status")
    for row in rows:
        peak = f"{row['peak']:.1f}" if row.get("peak") is not None else "-"
        plan = f"{row['plan']:.1f}" if row.get("plan") is not None else "-"
        need = f"{row['need']:,.0f}" if row.get("need") else "-"
        print(f"{row['check']:<9}{row.get('shape', ''):<50}{row.get('speed', ''):<46}{need:>10}"
              f"{row.get('seconds') or 0:8.1f}{peak:>10}{plan:>10}  {row['status']}")
    if gpu_bytes:
        print(f"(GPU memory {gpu_bytes / GIB:.1f} GiB)")


OFFLINE_COMMAND = """\
# On a machine with internet, in the repository: the only wheel the GPU image lacks is rustbpe (to train the
# stand-in tokenizer); carry it with the working tree.
pip download rustbpe --python-version 3.12 --platform manylinux_2_17_x86_64 --only-binary=:all: --no-deps -d wheels/
# On the GPU machine (Python 3.12, torch 2.11 + CUDA, pyarrow, tiktoken, numpy; no network), in the repository:
python -m pip install --no-index --no-deps --target /tmp/wheels wheels/rustbpe-*.whl && export PYTHONPATH=/tmp/wheels
# The stand-in data and tokenizer are built by the run itself (tasks.write_stand_in_data, in a temporary folder).
mkdir -p $OUT/accept && timeout 570 torchrun --standalone --nproc_per_node=1 bench/gpu_check.py --deadline 540 --out $OUT/accept \\
    2>&1 | tee $OUT/accept/log.txt
# It returns $OUT/accept/results.jsonl (one JSON line per phase, written as each ends) and $OUT/accept/log.txt."""


def main(argv=None):
    args = parse_args(argv)
    if args.print_command:
        print(OFFLINE_COMMAND)
        return
    started = time.time()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # One process group for every phase: the stages' own compute_init/compute_cleanup join it and leave it standing.
    is_ddp, rank, _, world_size, device = common.compute_init(device)
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    common.print0(f"gpu_check: {args.preset} preset on {world_size} x {name}"
                  + (f" ({gpu_bytes / GIB:.1f} GiB)" if gpu_bytes else "") + f", deadline {args.deadline:.0f}s")
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.jsonl").write_text("")
    rows = []

    def write(row):
        rows.append(row)
        if rank == 0:  # at once, so that a run cut short keeps what it measured
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps({"gpu": name, "elapsed_s": round(time.time() - started, 1), **row}) + "\n")

    def run(phase, fn, *fn_args):
        """Run one phase unless the deadline forbids it; a failure is a FAIL row and the phases after it still run
        where they can. Returns the row, or None when the phase did not succeed."""
        left = args.deadline - (time.time() - started)
        if left < PHASE_SECONDS[phase]:
            write(dict(check=phase, status="skipped", reason=f"deadline: {left:.0f}s left, the phase needs "
                       f"~{PHASE_SECONDS[phase]}s"))
            return None
        try:
            row = fn(*fn_args)
        except Exception as e:  # noqa: BLE001 (every failure is reported and makes the exit status 1)
            traceback.print_exc()
            write(dict(check=phase, status=f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:120]}"))
            return None
        row["status"] = verdict(row, gpu_bytes)
        write(row)
        return row if row["status"] == "ok" else None

    folder = [tempfile.mkdtemp(prefix="gpu_check.") if rank == 0 else None]  # rank 0's, shared by every rank
    if is_ddp:
        torch.distributed.broadcast_object_list(folder)
    tmp = Path(folder[0])
    try:
        home = tmp / "home"
        os.environ["NANOPOST_HOME"], os.environ["NANOPOST_DATA_DIR"] = str(home), str(tmp / "data")
        if rank == 0:
            tasks.write_stand_in_data(os.environ["NANOPOST_DATA_DIR"], documents=20_000)
            texts = tasks.first_chars(tasks.fineweb_texts("train"), 5_000_000)
            Tokenizer.train(texts, args.vocab_size).save(home / "tokenizer")
        if is_ddp:
            torch.distributed.barrier()
        data_files = sorted(Path(os.environ["NANOPOST_DATA_DIR"]).rglob("*.parquet"))
        data_files = [f for f in data_files if "fineweb" in str(f)]
        run("env", check_env, args, device)
        base = home / "checkpoints" / "base"
        pretrained = run("pretrain", check_pretrain, args, device, data_files) is not None or base.exists()
        for phase in PHASES[2:]:
            if not pretrained:
                write(dict(check=phase, status="skipped", reason="no base checkpoint (pretrain did not run)"))
        if pretrained:
            model, tokenizer, _ = load_model(base, device)
            model.train()
            run("profile", check_profile, args, device, model, tokenizer)
            run("sft", check_sft, args, device, model, tokenizer)
            run("dpo", check_dpo, args, device, model, tokenizer)
            if run("rm", check_rm, args, device, base, home) is not None:
                run("rl", check_rl, args, device, base, home)
            else:
                write(dict(check="rl", status="skipped", reason="no reward model (rm did not succeed)"))
            run("eval", check_eval, args, device, model, tokenizer)
            run("engine", check_engine, args, device, model, tokenizer)
            if args.decode_samples:
                run("decode", check_decode, args, device, model, tokenizer)
            del model
        mine = [row["check"] for row in rows if row["status"] not in ("ok", "skipped")]
        verdicts = [mine]
        if is_ddp:  # every rank's, so that all ranks exit alike
            verdicts = [None] * world_size
            torch.distributed.all_gather_object(verdicts, mine)
    finally:
        if is_ddp:
            torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    if rank == 0:
        print_table(rows, gpu_bytes)
    failed = sorted({check for checks in verdicts for check in checks})
    common.compute_cleanup()
    skipped = [row["check"] for row in rows if row["status"] == "skipped"]
    if failed:
        common.print0(f"gpu_check: FAILED ({', '.join(failed)})")
        sys.exit(1)
    common.print0("gpu_check: every phase that ran passed" + (f" (skipped: {', '.join(skipped)})" if skipped else ""))


if __name__ == "__main__":
    main()

"""
The acceptance run for one GPU: does the preset's every stage run, how fast, and within how much memory?
No hub access: stand-in data (tasks.write_stand_in_data, as `bash speedrun.sh --dry-run`) and a tokenizer trained on
it, in a temporary $NANOPOST_HOME. A few minutes; prints one table and exits 1 if any check failed or a peak
exceeded the GPU's memory.

    python bench/gpu_check.py                    # full preset: depth 20, 2,048-token rows, RL at 4 prompts
    python bench/gpu_check.py --preset small     # the one-GPU preset (depth 8, 1,024-token rows)
    python bench/gpu_check.py --device cpu --depth 2 --vocab-size 512 --seq-len 64 --steps 2 \
        --engine-rows 8 --engine-tokens 8 --rl-prompts 2 --rl-max-tokens 8      # scaled down (tests/test_gpu_check.py)

Rows of the table, each through the stage's own code:
    pretrain  pretrain.main for --steps steps at the preset's depth (or the deepest below it that fits), the rows
              per micro-batch that fit (common.fit_batch_tokens): tokens/s, MFU, peak memory (its report record)
    sft       one optimizer step of sft.backward_sft_loss on a micro-batch of full-length rows at the token budget
              that fits this GPU (common.batch_tokens_for_device): the worst case of a real micro-batch
    dpo       the same with dpo.preference_losses on pairs of two full-length sides
    engine    Engine.generate of --engine-rows rows x --engine-tokens tokens under autocast: tokens/s, KV-cache dtype
    decode    for each of --decode-rows: Engine.generate's eager step vs its compiled step (StaticKVCache, CUDA
              graphs) at that many rows x --engine-tokens tokens, tokens/s of a call after the first, and the compile
              time (the first compiled call's extra seconds)
    rl        rl.main for one step of the preset at --rl-prompts prompts (no dynamic sampling: a barely trained model
              solves nothing): rollout and learner seconds
"peak" is torch.cuda.max_memory_allocated of the check, "plan" what common.planned_memory predicts for it; "seconds" is
the check's time, except for decode: the compile's.
"""

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import dpo  # noqa: E402
import pretrain  # noqa: E402
import rl  # noqa: E402
import sft  # noqa: E402
import tasks  # noqa: E402
from engine import Engine, KVCache, load_model  # noqa: E402
from model import LOGITS_CHUNK_TOKENS, GPTConfig  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

GIB = common.GIB


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--preset", choices=sorted(common.HARDWARE), default="full",
                        help="the preset whose stages are checked (full: depth 20; small: depth 8)")
    parser.add_argument("--depth", type=int, help="model depth (default: the preset's; lowered by 2 until it fits)")
    parser.add_argument("--seq-len", type=int, help="row length (default: the preset's context)")
    parser.add_argument("--vocab-size", type=int, default=65536, help="tokenizer trained on the stand-in text")
    parser.add_argument("--steps", type=int, default=10, help="pretraining steps (the first 3 are not timed)")
    parser.add_argument("--batch-tokens", type=int, help="micro-batch tokens of the SFT and DPO checks (default: the "
                        "largest of the preset's budget, half of it, ... that fits the GPU; CPU: one row or pair)")
    parser.add_argument("--engine-rows", type=int, default=128, help="rows the engine decodes together")
    parser.add_argument("--engine-tokens", type=int, default=256, help="tokens each engine row generates")
    parser.add_argument("--decode-rows", type=int, nargs="*", default=[32, 256],
                        help="row counts of the eager-vs-compiled decode check (none: skip it)")
    parser.add_argument("--rl-prompts", type=int, default=4, help="prompts of the RL step (x the preset's group size)")
    parser.add_argument("--rl-max-tokens", type=int, help="RL generation budget (default: the preset's)")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: autodetect)")
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
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    return result, time.time() - t0, peak


def quietly(fn, *args):
    """fn(*args) with its stdout captured: (result, the text it printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = fn(*args)
    return result, out.getvalue()


def check_pretrain(args, device, gpu_bytes, data_files):
    """pretrain.main at the deepest depth <= --depth whose smallest micro-batch fits."""
    values = pretrain.PRESETS[args.preset]
    seq_len = args.seq_len or values["max_seq_len"]
    for depth in range(args.depth or values["depth"], 0, -2):
        config = GPTConfig.from_depth(depth, args.vocab_size, seq_len)
        if gpu_bytes:
            try:
                tokens = common.fit_batch_tokens("pretraining", config, gpu_bytes,
                                                 values["device_batch_size"] * seq_len, seq_len, None)
            except common.UserError:
                continue
        else:
            tokens = seq_len
        rows = tokens // seq_len
        argv = ["--preset", args.preset, "--depth", str(depth), "--max-seq-len", str(seq_len), "--device-batch-size",
                str(rows), "--total-batch-size", str(tokens), "--num-iterations", str(args.steps), "--eval-every", "0",
                "--eval-tokens", str(tokens), "--sample-every", "0", "--save-every", "0", "--log-every", "1",
                "--data-files", *map(str, data_files), "--device", device.type]
        _, seconds, peak = measure(device, lambda: quietly(pretrain.main, argv))
        record = common.read_report()[-1]
        plan = common.planned_memory(config, tokens, None) / GIB
        mfu = f", MFU {100 * record['mfu']:.0f}%" if record.get("mfu") else ""
        return dict(check="pretrain", shape=f"depth {depth}, {rows} x {seq_len}",
                    speed=f"{record['tokens_per_sec']:,.0f} tok/s{mfu}", seconds=seconds, peak=peak,
                    plan=plan)
    raise common.UserError(f"no depth <= {args.depth or values['depth']} fits this GPU")


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
                plan=common.planned_memory(model.config, tokens, LOGITS_CHUNK_TOKENS) / GIB)


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
                plan=common.planned_memory(model.config, tokens, LOGITS_CHUNK_TOKENS) / GIB)


def check_engine(args, device, model, tokenizer):
    """Engine.generate of --engine-rows rows (8 prompts x rows/8 samples) x --engine-tokens, and the KV dtype."""
    model.eval()
    prompts = [tokenizer.encode(f"Question {i}: what is {i} + {i}?", prepend="<|bos|>") for i in range(8)]
    with common.autocast_ctx(device):
        cache = KVCache(1, len(prompts[0]), model.config.n_layer, device)
        with torch.no_grad():  # one prefill, to see the dtype the cache stores keys and values in
            model(torch.tensor([prompts[0]], device=device), kv_cache=cache)
        results, seconds, peak = measure(device, lambda: Engine(model, tokenizer).generate(
            prompts, num_samples=args.engine_rows // 8, max_tokens=args.engine_tokens, temperature=1.0, seed=0))
    generated = sum(len(c.tokens) for group in results for c in group)
    kv_dtype = str(cache.keys[0].dtype).replace("torch.", "")
    ok = cache.keys[0].dtype == cache.values[0].dtype
    model.train()
    return dict(check="engine", shape=f"{args.engine_rows} rows x {args.engine_tokens} tokens, KV {kv_dtype}",
                speed=f"{generated / seconds:,.0f} tok/s", seconds=seconds, peak=peak, plan=None,
                error=None if ok else f"keys {cache.keys[0].dtype} but values {cache.values[0].dtype}")


def check_decode(args, device, model, tokenizer, rows):
    """Engine.generate eager vs compiled at `rows` rows (8 prompts x rows/8 samples, or 1 prompt) x --engine-tokens."""
    model.eval()
    prompts = [tokenizer.encode(f"Question {i}: what is {i} + {i}?", prepend="<|bos|>") for i in range(min(8, rows))]
    sampling = dict(num_samples=rows // len(prompts), max_tokens=args.engine_tokens, temperature=1.0, seed=0)
    rates, first_call, peak = {}, None, None
    with common.autocast_ctx(device):
        for compiled in (False, True):
            engine = Engine(model, tokenizer, compiled=compiled)
            _, first, _ = measure(device, lambda: engine.generate(prompts, **sampling))
            results, seconds, peak = measure(device, lambda: engine.generate(prompts, **sampling))
            rates[compiled] = sum(len(c.tokens) for group in results for c in group) / seconds
            first_call = first - seconds
    model.train()
    return dict(check="decode", shape=f"{len(prompts) * sampling['num_samples']} rows x {args.engine_tokens} tokens",
                speed=f"eager {rates[False]:,.0f}, compiled {rates[True]:,.0f} tok/s (x{rates[True] / rates[False]:.2f})",
                seconds=first_call, peak=peak, plan=None)


def check_rl(args, device, ckpt, home):
    """rl.main for one step of the preset at --rl-prompts prompts; rollout and learner seconds from its step line."""
    argv = ["--preset", args.preset, "--ckpt", str(ckpt), "--out", str(home / "rl"), "--num-steps", "1",
            "--prompts-per-step", str(args.rl_prompts), "--no-filter-zero-contrast", "--eval-every", "1000",
            "--eval-problems", "2", "--eval-samples", "1", "--save-every", "0", "--device", device.type]
    if args.rl_max_tokens:
        argv += ["--max-tokens", str(args.rl_max_tokens)]
    (_, out), seconds, peak = measure(device, lambda: quietly(rl.main, argv))
    timing = re.search(r"rollout ([\d.]+)s ([\d,]+) tok/s, learn ([\d.]+)s", out)
    if timing is None:
        raise RuntimeError(f"rl.py printed no step line:\n{out[-2000:]}")
    rollout, rate, learn = timing.groups()
    group = rl.PRESETS[args.preset]["group_size"]
    return dict(check="rl", shape=f"1 step, {args.rl_prompts} prompts x {group}",
                speed=f"rollout {rollout}s ({rate} tok/s), learner {learn}s", seconds=seconds, peak=peak, plan=None)


def print_table(rows, gpu_bytes):
    print(f"\n{'check':<9}{'shape':<40}{'throughput':<42}{'seconds':>8}{'peak GiB':>10}{'plan GiB':>10}  status")
    for row in rows:
        peak = f"{row['peak']:.1f}" if row.get("peak") is not None else "-"
        plan = f"{row['plan']:.1f}" if row.get("plan") is not None else "-"
        print(f"{row['check']:<9}{row.get('shape', ''):<40}{row.get('speed', ''):<42}{row.get('seconds', 0):8.1f}"
              f"{peak:>10}{plan:>10}  {row['status']}")
    if gpu_bytes:
        print(f"(GPU memory {gpu_bytes / GIB:.1f} GiB)")


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_check: {args.preset} preset on {name}" + (f" ({gpu_bytes / GIB:.1f} GiB)" if gpu_bytes else ""))
    rows = []

    def run(check, fn, *fn_args):
        """Run one check; a failure is a FAIL row, and the checks after it still run where they can."""
        try:
            row = fn(*fn_args)
        except Exception as e:  # noqa: BLE001 (every failure is reported in the table and makes the exit status 1)
            traceback.print_exc()
            rows.append(dict(check=check, status=f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:80]}"))
            return None
        over = gpu_bytes and row["peak"] is not None and row["peak"] * GIB > gpu_bytes
        row["status"] = f"FAIL: {row['error']}" if row.get("error") else "FAIL: over memory" if over else "ok"
        rows.append(row)
        return row

    with tempfile.TemporaryDirectory(prefix="gpu_check.") as tmp:
        home = Path(tmp) / "home"
        os.environ["NANOPOST_HOME"], os.environ["NANOPOST_DATA_DIR"] = str(home), str(Path(tmp) / "data")
        tasks.write_stand_in_data(os.environ["NANOPOST_DATA_DIR"], documents=20_000)
        texts = tasks.first_chars(tasks.fineweb_texts("train"), 5_000_000)
        Tokenizer.train(texts, args.vocab_size).save(home / "tokenizer")
        data_files = sorted(Path(os.environ["NANOPOST_DATA_DIR"]).rglob("*.parquet"))
        data_files = [f for f in data_files if "fineweb" in str(f)]
        result = run("pretrain", check_pretrain, args, device, gpu_bytes, data_files)
        if result is not None:
            model, tokenizer, _ = load_model(home / "checkpoints" / "base", device)
            model.train()
            run("sft", check_sft, args, device, model, tokenizer)
            run("dpo", check_dpo, args, device, model, tokenizer)
            run("engine", check_engine, args, device, model, tokenizer)
            for decode_rows in args.decode_rows:
                run("decode", check_decode, args, device, model, tokenizer, decode_rows)
            del model
            run("rl", check_rl, args, device, home / "checkpoints" / "base", home)
    print_table(rows, gpu_bytes)
    failed = [row["check"] for row in rows if row["status"] != "ok"]
    if failed or len(rows) < 5 + len(args.decode_rows):
        print(f"gpu_check: FAILED ({', '.join(failed) or 'checks skipped after the pretraining failure'})")
        sys.exit(1)
    print("gpu_check: every check passed")


if __name__ == "__main__":
    main()

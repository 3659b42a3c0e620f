"""
Training throughput of the model at a given depth: tokens/s of full optimizer steps (forward, backward, Muon +
AdamW), the share of the step spent in the optimizers and in Muon alone, MFU against the GPU's bf16 peak, and peak
memory.
Random tokens: the speed of a step does not depend on the data.

    python bench/train.py --depth 4 --vocab-size 512 --max-seq-len 256 --device-batch-size 8    # CPU, tiny preset
    python bench/train.py --depth 20                                                            # one GPU, full preset
    python bench/train.py --depth 20 --no-compile                                               # what compile buys
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import autocast_ctx, autodetect_device, peak_flops, synchronize  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from pretrain import DEFAULTS  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description="Training tokens/s and MFU of one process at a given depth.")
    parser.add_argument("--depth", type=int, default=4, help="model depth (GPTConfig.from_depth)")
    parser.add_argument("--vocab-size", type=int, default=65536, help="vocabulary size (full preset: 65536)")
    parser.add_argument("--max-seq-len", type=int, default=2048, help="tokens per row")
    parser.add_argument("--device-batch-size", type=int, default=32, help="rows per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup-steps)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile on CUDA")
    parser.add_argument("--device", default=None, help="cuda | mps | cpu (default: autodetect)")
    args = parser.parse_args()
    device = torch.device(args.device or autodetect_device())

    config = GPTConfig.from_depth(args.depth, args.vocab_size, args.max_seq_len)
    model = GPT(config).to(device)
    model.init_weights()
    optimizers = model.setup_optimizers(DEFAULTS["matrix_lr"], DEFAULTS["embedding_lr"], DEFAULTS["unembedding_lr"])
    compiled = torch.compile(model, dynamic=False) if device.type == "cuda" and not args.no_compile else model
    tokens_per_step = args.device_batch_size * args.max_seq_len
    print(f"depth {args.depth}: n_embd {config.n_embd}, {config.n_head} heads, {model.num_params():,} parameters, "
          f"{model.flops_per_token():.3e} FLOPs/token | {args.device_batch_size} x {args.max_seq_len} tokens/step | "
          f"{device.type}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "") +
          f", {torch.get_num_threads()} CPU threads")

    x = torch.randint(0, args.vocab_size, (args.device_batch_size, args.max_seq_len + 1), device=device)
    inputs, targets = x[:, :-1], x[:, 1:]
    step_seconds, optimizer_seconds, muon_seconds = 0.0, 0.0, 0.0
    for step in range(args.warmup_steps + args.steps):
        synchronize(device)
        t0 = time.time()
        with autocast_ctx(device):
            loss = compiled(inputs, targets)
        loss.backward()
        synchronize(device)
        t1 = time.time()
        adamw, muon = optimizers
        adamw.step()
        synchronize(device)
        t_muon = time.time()
        muon.step()
        synchronize(device)
        t2 = time.time()
        model.zero_grad(set_to_none=True)
        if step >= args.warmup_steps:
            step_seconds += t2 - t0
            optimizer_seconds += t2 - t1
            muon_seconds += t2 - t_muon

    tokens_per_sec = args.steps * tokens_per_step / step_seconds
    line = (f"{tokens_per_sec:,.0f} tokens/s | {1000 * step_seconds / args.steps:.1f} ms/step, of which optimizers "
            f"{100 * optimizer_seconds / step_seconds:.0f}% (Muon {100 * muon_seconds / step_seconds:.1f}%)")
    peak = peak_flops(device)
    if peak:
        line += f" | MFU {100 * model.flops_per_token() * tokens_per_sec / peak:.1f}%"
    if device.type == "cuda":
        line += f" | peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
    print(line)


if __name__ == "__main__":
    main()

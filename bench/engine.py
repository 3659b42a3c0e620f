"""
What the engine's two speed-ups buy: the KV cache (each step runs 1 new token per row instead of the whole
sequence) and batched decoding (many prompts share each step's matmuls). A random-init model is enough: speed does
not depend on the weights.

    python bench/engine.py                       # depth 4, vocab 2048, CPU: about a minute on 2 cores
    python bench/engine.py --device cuda --depth 12 --num-prompts 64
    python bench/engine.py --nanochat-shape      # nanochat's engine benchmark shape (parts 3 and 4 only)

Reports tokens/s (generated tokens / wall time) for
    1. one prompt:  Engine.generate (prefill + cached decode)  vs  recomputing the full sequence for every token
    2. N prompts:   Engine.generate(all N prompts, one batch)    vs  Engine.generate once per prompt
    3. one prompt x S samples in one call (the RL case: all rows share one length)
    4. P prompts x S samples: one batched call vs P calls of one prompt x S samples (prompt lengths differ)
--nanochat-shape runs parts 3 and 4 at the shape of nanochat's engine benchmark: 4 layers, width 256, 2 heads,
vocab 8192, 64-token prompts, 16 samples x 128 tokens, fp32; nanochat's Engine.generate takes one prompt, so
part 4's sequential calls are what nanochat does for P prompts.
Rows that sample a stop token end early and are not counted; the mean completion length is printed.
"""

import argparse
import random
import string
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `engine` must not resolve to this file

import common  # noqa: E402
from engine import Engine, sampling_logprobs  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


def random_texts(n, seed=0):
    """Text over a random 3000-word lexicon: plenty of distinct pairs, so BPE fills any vocabulary size quickly."""
    rng = random.Random(seed)
    lexicon = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(3000)]
    return [" ".join(rng.choices(lexicon, k=100)) for _ in range(n)]


@torch.inference_mode()
def recompute_generate(model, prompt, max_tokens, generator):
    """The baseline: no cache, a full forward over prompt + everything generated so far for every new token."""
    ids = torch.tensor([prompt], device=model.lm_head.weight.device)  # (1, T)
    for _ in range(max_tokens):
        logprobs = sampling_logprobs(model(ids)[:, -1])  # (1, V)
        ids = torch.cat([ids, torch.multinomial(logprobs.exp(), 1, generator=generator)], dim=1)
    return max_tokens


def timed(fn, device, repeats=2):
    """(result, seconds): the fastest of `repeats` calls of fn() after a warm-up call (allocations, kernel
    selection). The fastest, because on a shared machine the slower runs measure the neighbours."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        common.synchronize(device)
        t0 = time.perf_counter()
        result = fn()
        common.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return result, best


def generated(results):
    return sum(len(c.tokens) for samples in results for c in samples)


def main():
    parser = argparse.ArgumentParser(description="Engine throughput: KV cache vs recompute, batched vs one at a time.")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | mps")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=None, help="width (default: GPTConfig.from_depth's)")
    parser.add_argument("--n-head", type=int, default=None, help="heads (default: GPTConfig.from_depth's)")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=64,
                        help="prompt tokens (part 2: prompt lengths vary from half this to this)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per row")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts decoded together in part 2")
    parser.add_argument("--num-samples", type=int, default=16, help="samples per prompt in parts 3 and 4")
    parser.add_argument("--sample-prompts", type=int, default=4, help="prompts P in part 4")
    parser.add_argument("--nanochat-shape", action="store_true",
                        help="nanochat's benchmark shape (depth 4, width 256, 2 heads, vocab 8192, 64-token prompt, "
                             "16 samples x 128 tokens); runs parts 3 and 4 only")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (1: steady timings on a shared machine)")
    args = parser.parse_args()
    if args.nanochat_shape:
        args.depth, args.n_embd, args.n_head, args.vocab_size = 4, 256, 2, 8192
        args.prompt_len, args.max_tokens, args.num_samples, args.sample_prompts = 64, 128, 16, 4
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    tokenizer = Tokenizer.train(random_texts(2000), vocab_size=args.vocab_size)
    config = GPTConfig.from_depth(args.depth, tokenizer.vocab_size, sequence_len=args.prompt_len + args.max_tokens)
    if args.n_embd or args.n_head:
        config = GPTConfig(sequence_len=config.sequence_len, vocab_size=config.vocab_size, n_layer=args.depth,
                           n_head=args.n_head or config.n_head, n_kv_head=args.n_head or config.n_head,
                           n_embd=args.n_embd or config.n_embd)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    model.init_weights()
    engine = Engine(model, tokenizer)
    print(f"depth {config.n_layer}, n_embd {config.n_embd}, {config.n_head} heads, vocab {config.vocab_size}, "
          f"{model.num_params():,} parameters, {device}, {args.threads} threads")

    rng = random.Random(0)
    texts = random_texts(args.num_prompts, seed=1)
    prompts = [tokenizer.encode(text, prepend="<|bos|>")[:rng.randint(args.prompt_len // 2, args.prompt_len)]
               for text in texts]
    one = [tokenizer.encode(texts[0], prepend="<|bos|>")[:args.prompt_len]]
    sampling = {"max_tokens": args.max_tokens, "temperature": 1.0, "seed": 0}

    with common.autocast_ctx(device):
        if not args.nanochat_shape:
            one_prompt_and_batching(args, model, engine, one, prompts, sampling, device)
        samples_batched(args, engine, one, prompts[:args.sample_prompts], sampling, device)


def one_prompt_and_batching(args, model, engine, one, prompts, sampling, device):
    """Parts 1 and 2."""
    generator = torch.Generator(device=device).manual_seed(0)
    n_recompute, t_recompute = timed(lambda: recompute_generate(model, one[0], args.max_tokens, generator), device)
    cached, t_cached = timed(lambda: engine.generate(one, **sampling), device)
    recompute_rate, cached_rate = n_recompute / t_recompute, generated(cached) / t_cached
    print(f"\n1. one prompt of {len(one[0])} tokens, up to {args.max_tokens} new tokens")
    print(f"   recompute (no cache) {recompute_rate:8.1f} tok/s")
    print(f"   KV cache             {cached_rate:8.1f} tok/s   (mean length {generated(cached):.1f})")
    print(f"   KV cache speed-up {cached_rate / recompute_rate:.1f}x")

    batched, t_batched = timed(lambda: engine.generate(prompts, **sampling), device)
    sequential, t_sequential = timed(lambda: [engine.generate([p], **sampling)[0] for p in prompts], device)
    print(f"\n2. {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"up to {args.max_tokens} new tokens each")
    sequential_rate, batched_rate = generated(sequential) / t_sequential, generated(batched) / t_batched
    for name, rate, results in (("one at a time", sequential_rate, sequential), ("batched", batched_rate, batched)):
        print(f"   {name:20s} {rate:8.1f} tok/s   (mean length {generated(results) / len(prompts):.1f})")
    print(f"   batching speed-up {batched_rate / sequential_rate:.1f}x")


def samples_batched(args, engine, one, prompts, sampling, device):
    """Parts 3 and 4: several samples per prompt, one call per prompt vs one call for all."""
    sampling = {**sampling, "num_samples": args.num_samples}
    samples, t_samples = timed(lambda: engine.generate(one, **sampling), device)
    print(f"\n3. one prompt of {len(one[0])} tokens x {args.num_samples} samples, up to {args.max_tokens} new tokens")
    print(f"   one call             {generated(samples) / t_samples:8.1f} tok/s")
    batched, t_batched = timed(lambda: engine.generate(prompts, **sampling), device)
    sequential, t_sequential = timed(lambda: [engine.generate([p], **sampling)[0] for p in prompts], device)
    sequential_rate, batched_rate = generated(sequential) / t_sequential, generated(batched) / t_batched
    print(f"\n4. {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens x "
          f"{args.num_samples} samples, up to {args.max_tokens} new tokens each")
    print(f"   {len(prompts)} sequential calls   {sequential_rate:8.1f} tok/s")
    print(f"   one batched call     {batched_rate:8.1f} tok/s")
    print(f"   batched / sequential {batched_rate / sequential_rate:.2f}x")


if __name__ == "__main__":
    main()

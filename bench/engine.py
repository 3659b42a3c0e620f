"""
What the engine's speed-ups buy: the KV cache (each step runs 1 new token per row instead of the whole sequence),
batched decoding (many prompts share each step's matmuls) and the compiled decode step (Engine(compiled=True): a
StaticKVCache holding each prompt once for its samples, and a torch.compile'd one-token forward), side by side with
nanochat's engine. A random-init model is enough: speed does not depend on the weights.

    python bench/engine.py                       # depth 4, vocab 2048, CPU: a few minutes on 2 cores
    python bench/engine.py --device cuda --depth 12 --num-prompts 64
    NANOCHAT_DIR=/tmp/nanochat python bench/engine.py --nanochat-shape      # parts 3 and 4 only, with nanochat

Reports tokens/s (generated tokens / wall time) for
    1. one prompt:  Engine.generate (prefill + cached decode)  vs  recomputing the full sequence for every token
    2. N prompts:   Engine.generate(all N prompts, one batch)    vs  Engine.generate once per prompt
    3. one prompt x S samples in one call (the RL case: all rows share one length)
    4. P prompts x S samples in one batched call (prompt lengths differ); nanochat's Engine.generate takes one
       prompt, so its column is P sequential calls
Parts 3 and 4 print one column per decode path: eager (the reference), compiled (its first call per shape, which
includes the compile, is timed apart as "compile") and nanochat's engine, imported from the folder NANOCHAT_DIR
names (a copy of github.com/karpathy/nanochat holding nanochat/engine.py; the column is skipped without it).
The paths run interleaved, --rounds times, and each prints its median: on a shared machine the neighbours' load
drifts, and interleaving spreads that drift over all columns alike. On CPU each line also gives tokens per second of
this process's CPU time: with one thread, what an idle machine's wall clock would show, less the neighbours' share.
--nanochat-shape runs parts 3 and 4 at the shape of nanochat's engine benchmark: 4 layers, width 256, 2 heads,
vocab 8192, 64-token prompts, 16 samples x 128 tokens, fp32.
Rows that sample a stop token end early and are not counted; the mean completion length is printed.
"""

import argparse
import os
import random
import statistics
import string
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `engine` must not resolve to this file

import common  # noqa: E402
from engine import Engine, sample_tokens, sampling_logprobs  # noqa: E402
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
        uniforms = 1 - torch.rand(1, generator=generator, device=ids.device)
        token, _ = sample_tokens(logprobs, uniforms)
        ids = torch.cat([ids, token[:, None]], dim=1)
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
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds of parts 3 and 4 (median)")
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
    engine = Engine(model, tokenizer, compiled=False)
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
        samples_batched(args, model, tokenizer, one, prompts[:args.sample_prompts], sampling, device)


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


class NanochatTokenizer:
    """The tokenizer calls nanochat's Engine makes, answered by ours (same special tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode_special(self, name):
        return self.tokenizer.token_id(name)

    def get_bos_token_id(self):
        return self.tokenizer.bos_id

    def encode(self, text):
        return self.tokenizer.encode(text)

    def decode(self, ids):
        return self.tokenizer.decode(ids)


def nanochat_generate(tokenizer, config, device):
    """
    generate(prompt, num_samples, max_tokens, seed) -> tokens generated, through nanochat's Engine on a random-init
    nanochat GPT of our model's shape (full attention in every layer), or None when NANOCHAT_DIR is not set.
    """
    folder = os.environ.get("NANOCHAT_DIR")
    if not folder:
        return None
    sys.path.insert(0, folder)
    from nanochat.engine import Engine as NanochatEngine
    from nanochat.gpt import GPT as NanochatGPT, GPTConfig as NanochatConfig

    with torch.device("meta"):
        model = NanochatGPT(NanochatConfig(sequence_len=config.sequence_len, vocab_size=config.vocab_size,
                                           n_layer=config.n_layer, n_head=config.n_head,
                                           n_kv_head=config.n_kv_head, n_embd=config.n_embd, window_pattern="L"))
    model.to_empty(device=device)
    model.init_weights()
    model.eval()
    engine = NanochatEngine(model, NanochatTokenizer(tokenizer))
    stops = {tokenizer.token_id("<|assistant_end|>"), tokenizer.bos_id}

    def generate(prompt, num_samples, max_tokens, seed):
        done, count = [False] * num_samples, 0
        for column, _ in engine.generate(prompt, num_samples=num_samples, max_tokens=max_tokens, seed=seed):
            for i, token in enumerate(column):
                if not done[i]:
                    count += 1
                    done[i] = token in stops
        return count

    return generate


def samples_batched(args, model, tokenizer, one, prompts, sampling, device):
    """
    Parts 3 and 4, one column per decode path, interleaved rounds: one prompt x S samples in one call, and P prompts
    x S samples in one batched call (nanochat: P calls).
    """
    sampling = {**sampling, "num_samples": args.num_samples}
    engines = {"eager": Engine(model, tokenizer, compiled=False), "compiled": Engine(model, tokenizer, compiled=True)}
    nanochat = nanochat_generate(tokenizer, model.config, device)
    n_seed, n_tokens = sampling["seed"], sampling["max_tokens"]
    parts = {  # part -> path -> () -> tokens generated
        "3": {**{name: (lambda e=e: generated(e.generate(one, **sampling))) for name, e in engines.items()},
              **({"nanochat": lambda: nanochat(one[0], args.num_samples, n_tokens, n_seed)} if nanochat else {})},
        "4": {**{name: (lambda e=e: generated(e.generate(prompts, **sampling))) for name, e in engines.items()},
              **({"nanochat": lambda: sum(nanochat(p, args.num_samples, n_tokens, n_seed) for p in prompts)}
                 if nanochat else {})},
    }
    first_call = {}  # (part, path) -> seconds of the first call: the compile happens there
    for part, paths in parts.items():
        for name, fn in paths.items():
            common.synchronize(device)
            t0 = time.perf_counter()
            fn()
            common.synchronize(device)
            first_call[part, name] = time.perf_counter() - t0
    rates = {(part, name): [] for part, paths in parts.items() for name in paths}
    cpu_rates = {key: [] for key in rates}
    counts = {}
    for _ in range(args.rounds):
        for part, paths in parts.items():
            for name, fn in paths.items():
                common.synchronize(device)
                t0, c0 = time.perf_counter(), time.process_time()
                counts[part, name] = fn()
                common.synchronize(device)
                rates[part, name].append(counts[part, name] / (time.perf_counter() - t0))
                cpu_rates[part, name].append(counts[part, name] / (time.process_time() - c0))
    titles = {"3": f"3. one prompt of {len(one[0])} tokens x {args.num_samples} samples, up to {n_tokens} new tokens",
              "4": f"4. {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens x "
                   f"{args.num_samples} samples, up to {n_tokens} new tokens each: one batched call"
                   + (f" (nanochat: {len(prompts)} sequential calls)" if nanochat else "")}
    for part, paths in parts.items():
        print(f"\n{titles[part]}  (median of {args.rounds} interleaved rounds)")
        medians = {name: statistics.median(rates[part, name]) for name in paths}
        cpu = {name: statistics.median(cpu_rates[part, name]) for name in paths}
        for name in paths:
            rows = args.num_samples * (1 if part == "3" else len(prompts))
            line = (f"   {name:9s} {medians[name]:8.1f} tok/s   mean length {counts[part, name] / rows:5.1f}   "
                    f"x{medians[name] / medians['eager']:.2f} eager")
            if nanochat:
                line += f"   x{medians[name] / medians['nanochat']:.2f} nanochat"
            if device.type == "cpu":
                line += f"   | {cpu[name]:8.1f} tok/CPU-s   x{cpu[name] / cpu['eager']:.2f} eager"
                if nanochat:
                    line += f"   x{cpu[name] / cpu['nanochat']:.2f} nanochat"
            print(line)
        steady = counts[part, "compiled"] / medians["compiled"]
        print(f"   compile: first compiled call {first_call[part, 'compiled']:.1f} s, "
              f"{first_call[part, 'compiled'] - steady:.1f} s more than a steady one")


if __name__ == "__main__":
    main()

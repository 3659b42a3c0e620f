"""
The engine/learner log-prob gap of the lm_head under bf16 autocast: the same tokens' log-probs from the engine's
path (prefill + one-token decode steps through a KV cache) and the learner's (one full forward), with the head as a
float32 matmul (float32 inputs), as GPT.head computes it under bf16 autocast (Bf16Linear: bf16 inputs, float32 sums
and output), and, for contrast, as a bf16 matmul with a bf16 output. Prints the mean and max of
|log p_engine - log p_learner| over the decoded positions, the heads side by side. On CPU this is CPU bf16 autocast,
an emulation of CUDA's (matmuls in bf16; CUDA's kernels round otherwise); on a GPU, CUDA's. The model has PyTorch's
default init (every block non-trivial) with lm_head scaled by 40 so the logits spread.

    python bench/head_gap.py                   # CPU
    python bench/head_gap.py --device cuda     # one GPU
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import KVCache  # noqa: E402
from model import GPT, LOGIT_SOFTCAP, GPTConfig  # noqa: E402


def float32_head(model, h):
    z = F.linear(h.float(), model.lm_head.weight.float())
    return LOGIT_SOFTCAP * torch.tanh(z / LOGIT_SOFTCAP)


def bf16_output_head(model, h):
    z = F.linear(h, model.lm_head.weight).float()  # under autocast: a bf16 matmul rounded to a bf16 output
    return LOGIT_SOFTCAP * torch.tanh(z / LOGIT_SOFTCAP)


def main():
    parser = argparse.ArgumentParser(description="Engine/learner log-prob gap of the float32 and the bf16 lm_head.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-len", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    T = args.prompt_len + args.decode_len
    model = GPT(GPTConfig.from_depth(args.depth, args.vocab_size, sequence_len=T)).to(args.device).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    ids = torch.randint(0, args.vocab_size, (args.rows, T), device=args.device)
    with torch.no_grad(), torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16):
        learner = model.hidden(ids)[:, args.prompt_len - 1:-1]  # (rows, decode_len, C): the states predicting each
        cache = KVCache(args.rows, T, model.config.n_layer, args.device)
        steps = [model.hidden(ids[:, :args.prompt_len], kv_cache=cache)[:, -1:]]
        steps += [model.hidden(ids[:, t:t + 1], kv_cache=cache) for t in range(args.prompt_len, T - 1)]
        engine = torch.cat(steps, dim=1)  # (rows, decode_len, C)
        targets = ids[:, args.prompt_len:, None]
        heads = (("float32 head", lambda h: float32_head(model, h)), ("bf16 head (GPT.head)", model.head),
                 ("bf16 output", lambda h: bf16_output_head(model, h)))
        for name, head in heads:
            logp = [head(h).float().log_softmax(-1).gather(-1, targets) for h in (engine, learner)]
            gap = (logp[0] - logp[1]).abs()
            print(f"{name:22s} |log p_engine - log p_learner|: mean {gap.mean():.2e}, max {gap.max():.2e}")


if __name__ == "__main__":
    main()

"""
Weight averaging of checkpoints fine-tuned from one base ("model soups", Wortsman et al. 2022): a weighted linear
average of two or more, or spherical interpolation (SLERP) of two. The result is a checkpoint like any other:
eval.py, engine.py, rl.py and dpo.py load it as they load the inputs.

    python merge.py --ckpts checkpoints/rl checkpoints/dpo --weights 0.9 0.1 --out checkpoints/merge
    python merge.py --ckpts checkpoints/rl checkpoints/sft --weights 0.8 0.2 --method slerp
    python eval.py --stage merge --num-samples 8           # into the same report table as the other stages

linear:  theta = sum_i w_i theta_i, per tensor, with sum_i w_i = 1.
slerp:   per tensor, with t = w_2 and Omega the angle between the flattened tensors a and b,
         theta = sin((1 - t) Omega) / sin(Omega) a + sin(t Omega) / sin(Omega) b
         (Shoemake 1985; as in mergekit). Linear where a and b are (nearly) parallel, where sin(Omega) -> 0.

Checkpoints of different shapes, tokenizers or bases are refused. "Same base" is checked from the weights: every
checkpoint's token embedding must have cosine similarity >= SAME_BASE_MIN_COSINE with the first one's. Fine-tunes
of one base stay close to it (tiny preset: base vs SFT 0.979, SFT vs PPO 0.998), while two independent
initialisations are near-orthogonal (cosine ~ 0 +- 1/sqrt(numel)), and averaging them gives a broken model.
"""

import argparse
import math
from pathlib import Path

import torch

import common
from common import print0
from engine import load_model

SAME_BASE_MIN_COSINE = 0.5


def cosine(a, b):
    a, b = a.flatten().double(), b.flatten().double()
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30))


def slerp(a, b, t, eps=1e-6):
    """Spherical interpolation between tensors a and b at fraction t (t = 0: a, t = 1: b); linear if nearly parallel."""
    a64, b64 = a.flatten().double(), b.flatten().double()
    cos_omega = (a64 @ b64 / (a64.norm() * b64.norm()).clamp(min=1e-30)).clamp(-1, 1)
    omega = torch.arccos(cos_omega)
    if float(torch.sin(omega)) < eps:
        return ((1 - t) * a64 + t * b64).view_as(a).to(a.dtype)
    mixed = (torch.sin((1 - t) * omega) * a64 + torch.sin(t * omega) * b64) / torch.sin(omega)
    return mixed.view_as(a).to(a.dtype)


def merge_state_dicts(states, weights, method="linear"):
    """
    The merged state dict of `states` (a list of state dicts with the same keys and shapes): linear, sum_i w_i s_i
    per tensor (weights summing to 1), or slerp of two at t = weights[1]. Raises ValueError on a mismatch.
    """
    if len(states) != len(weights):
        raise ValueError(f"{len(states)} checkpoints but {len(weights)} weights: give one weight per checkpoint")
    if any(w < 0 for w in weights) or not math.isclose(sum(weights), 1.0, abs_tol=1e-6):
        raise ValueError(f"weights {weights} must be non-negative and sum to 1")
    if method == "slerp" and len(states) != 2:
        raise ValueError(f"slerp interpolates exactly two checkpoints, got {len(states)}; use --method linear")
    first = states[0]
    for i, state in enumerate(states[1:], start=1):
        if state.keys() != first.keys():
            raise ValueError(f"checkpoint {i} has different parameters than checkpoint 0 "
                             f"(e.g. {sorted(state.keys() ^ first.keys())[:3]}): not the same architecture")
        for key, value in state.items():
            if value.shape != first[key].shape:
                raise ValueError(f"checkpoint {i}'s {key} has shape {tuple(value.shape)}, checkpoint 0's "
                                 f"{tuple(first[key].shape)}: not the same model size")
    if method == "slerp":
        return {key: slerp(first[key], states[1][key], weights[1]) for key in first}
    if method != "linear":
        raise ValueError(f"unknown merge method {method!r}; expected 'linear' or 'slerp'")
    return {key: sum(w * state[key].double() for w, state in zip(weights, states)).to(first[key].dtype)
            for key in first}


def check_compatible(paths, metas, tokenizers, states):
    """ValueError unless every checkpoint has the first one's model config, tokenizer, kind of head and base."""
    for i in range(1, len(paths)):
        if metas[i]["model_config"] != metas[0]["model_config"]:
            raise ValueError(f"{paths[i]} has model config {metas[i]['model_config']}, {paths[0]} has "
                             f"{metas[0]['model_config']}: only checkpoints of one architecture can be merged")
        if bool(metas[i].get("reward_model")) != bool(metas[0].get("reward_model")):
            raise ValueError(f"{paths[i]} and {paths[0]}: one is a reward model and the other is not")
        probe = "Merge check: 12 + 30 = 42. <|assistant_end|>"
        if tokenizers[i].vocab_size != tokenizers[0].vocab_size or \
                tokenizers[i].encode(probe) != tokenizers[0].encode(probe):
            raise ValueError(f"{paths[i]} and {paths[0]} have different tokenizers: token ids mean different things")
        key = next(k for k in states[0] if k.endswith("wte.weight"))
        similarity = cosine(states[i][key], states[0][key])
        if similarity < SAME_BASE_MIN_COSINE:
            raise ValueError(f"{paths[i]} and {paths[0]} do not share a base model: their token embeddings have "
                             f"cosine similarity {similarity:.3f} < {SAME_BASE_MIN_COSINE}; merge fine-tunes of one "
                             "base only")


def main(argv=None):
    parser = argparse.ArgumentParser(description="Average checkpoints fine-tuned from one base (linear or SLERP).",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--ckpts", nargs="+", required=True, help="checkpoint folders to merge (two or more)")
    parser.add_argument("--weights", type=float, nargs="+", default=None,
                        help="one weight per checkpoint, non-negative, summing to 1 (default: equal)")
    parser.add_argument("--method", choices=["linear", "slerp"], default="linear",
                        help="linear: weighted average; slerp: spherical interpolation of two at t = second weight")
    parser.add_argument("--out", default=None, help="output folder (default: $NANOPOST_HOME/checkpoints/merge)")
    args = parser.parse_args(argv)
    if len(args.ckpts) < 2:
        parser.error("--ckpts needs two or more checkpoints")
    weights = args.weights or [1.0 / len(args.ckpts)] * len(args.ckpts)

    paths = [common.resolve_checkpoint(path).resolve() for path in args.ckpts]
    loaded = [load_model(path, "cpu") for path in paths]
    models, tokenizers, metas = zip(*loaded)
    states = [model.state_dict() for model in models]
    check_compatible(paths, metas, tokenizers, states)
    merged = merge_state_dicts(states, weights, args.method)
    model = models[0]
    model.load_state_dict(merged)
    out = Path(args.out) if args.out else common.checkpoint_dir("merge")
    meta = {"stage": "merge", "finished": True, "method": args.method, "weights": weights,
            "sources": [str(p) for p in paths], "reward_model": bool(metas[0].get("reward_model"))}
    path = common.save_checkpoint(out, 0, model, meta, tokenizer=tokenizers[0])
    print0(f"merged {len(paths)} checkpoints ({args.method}, weights {weights}) -> {path}")
    common.append_report({"stage": "merge", "method": args.method, "weights": weights,
                          "sources": ", ".join(f"{m.get('stage', '?')}:{p.parent.name}/{p.name}"
                                               for m, p in zip(metas, paths))})


if __name__ == "__main__":
    main()

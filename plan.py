"""
The speedrun's budget and its choice of preset. Every figure is an estimate from each stage's own plan() (the
same one its --dry-run prints: common.stage_plan, model.training_memory): FLOPs at an assumed MFU, decoded tokens
at an assumed rate (common.HARDWARE, common.ASSUMED_MFU), peak memory per GPU at the micro-batch that fits.

    python plan.py --preset full      # per-stage minutes and memory on 8xH100 80GB, and the total
    python plan.py --preset small     # the same on one 24 GB GPU
    python plan.py --choose           # the preset speedrun.sh runs on this machine's GPUs, and why

--choose asks torch for the GPUs, unless NANOPOST_FAKE_GPUS names them: "" or "0" (none), "8x81559" (eight GPUs of
81,559 MiB, what an 80 GB H100 reports), "1x24564": the tests use it to check the choice on any machine.
"""

import argparse
import contextlib
import io
import os
import sys
from functools import cache
from types import SimpleNamespace

import common
import core
import dpo
import eval as evaluation
import pretrain
import rl
import sft
import tokenizer
from common import ASSUMED_MFU, GIB, HARDWARE, MEMORY_MARGIN
from model import LOGITS_CHUNK_TOKENS, GPTConfig

STAGES = ("base", "sft", "dpo", "rl", "eval")
# With 2-7 GPUs the full recipe (gradient accumulation makes up for the missing GPUs) runs when its estimate is at
# most this long; past it the small preset runs with DDP instead.
FULL_MAX_MINUTES = 8 * 60
GSM8K_TEST_PROBLEMS = 1319
# Pretraining MFU the headline's sensitivity line is given at, around the assumed 40%: this model's fp32 residual
# stream, fp32 QK-norm and 8-row micro-batches make ~33% plausible; nanochat's depth-24 run works out to ~50%.
PRETRAIN_MFU_RANGE = (0.33, 0.50)


def preset_config(preset):
    """The model config of a preset: pretrain.py's depth and context, the tokenizer's vocabulary."""
    values = pretrain.PRESETS[preset]
    return GPTConfig.from_depth(values["depth"], tokenizer.PRESETS[preset]["vocab_size"], values["max_seq_len"])


def eval_plan(preset, config):
    """
    speedrun.sh's evaluations: greedy GSM8K on the three chat checkpoints and the 8-sample coverage of SFT and RL
    (generation dominates), plus bits per byte of each checkpoint and CORE of the base checkpoint (forward only: 1/3
    of a training token's FLOPs; CORE's tokens: core.plan_forward_tokens, an estimate); the multiple-choice tasks
    score one forward per choice and are left out. Memory (common.inference_memory): no
    gradients or optimizer; the larger of generation (batch_size prompts x 8 samples decoding, their KV cache) and a
    forward of batch_size full rows (bpb and multiple choice: one layer's tensors at a time, chunked logits).
    """
    values = evaluation.PRESETS[preset]
    problems = min(values["max_problems"] or GSM8K_TEST_PROBLEMS, GSM8K_TEST_PROBLEMS)
    decode = problems * values["max_tokens"] * (3 + 2 * 8)
    rows = values["batch_size"] * 8
    generation = common.inference_memory(config, rows, rl.PLAN_PROMPT_TOKENS + values["max_tokens"], rows)
    forward = common.inference_memory(config, 0, 0, forward_tokens=values["batch_size"] * config.sequence_len,
                                      logits_chunk=LOGITS_CHUNK_TOKENS)
    flops = common.model_size(config)[1]
    core_tokens = core.plan_forward_tokens(values["core_items"]) if "core" in values["base_tasks"].split(",") else 0
    forward_tokens = 4 * values["bpb_tokens"] + core_tokens
    return common.stage_plan("eval", preset, config, 0, LOGITS_CHUNK_TOKENS, forward_tokens / 3, flops,
                             decode_tokens=decode, phase_bytes=max(generation, forward))


@cache
def preset_args(preset):
    """The flags each training stage runs with in the preset (what its plan() reads)."""
    with contextlib.redirect_stdout(io.StringIO()):  # rl.parse_args prints the loss defaults it fills in
        rl_args = rl.parse_args(["--preset", preset])
    return {
        "base": pretrain.parse_args(["--preset", preset]),
        "sft": SimpleNamespace(preset=preset, **sft.PRESETS[preset]),
        "dpo": SimpleNamespace(preset=preset, live_reference=False, **dpo.PRESETS[preset]),
        "rl": rl_args,
    }


@cache
def preset_plan(preset):
    """Every stage's plan (common.stage_plan dicts) of a GPU preset, in speedrun order."""
    config = preset_config(preset)
    stages = {"base": pretrain, "sft": sft, "dpo": dpo, "rl": rl}
    args = preset_args(preset)
    return [stages[name].plan(args[name], config) for name in stages] + [eval_plan(preset, config)]


def total_minutes(preset, hardware=None):
    """The preset's minutes over all stages on `hardware` (default: the one it is planned for)."""
    return sum(common.plan_minutes(p, hardware or HARDWARE[preset]) for p in preset_plan(preset))


def unknowns(preset):
    """
    The two assumptions the total leans on most, and the minutes each moves it by: (text, minutes at the other
    value) pairs. Pretraining's minutes scale as 1 / MFU; RL's rollout minutes as its sampling rounds per step, so
    its plan with the contrast filter off (one round) fixes the minutes of a round.
    """
    plans = {p["stage"]: p for p in preset_plan(preset)}
    base, rl_plan, mfu = plans["base"]["minutes"], plans["rl"], ASSUMED_MFU["pretrain"]
    out = [(f"pretraining MFU {mfu:.0%}", [(f"{m:.0%}", base * (mfu / m - 1)) for m in PRETRAIN_MFU_RANGE])]
    rounds = rl_plan["sampling_rounds"]
    if rounds > 1:
        one = rl.plan(SimpleNamespace(**{**vars(preset_args(preset)["rl"]), "filter_zero_contrast": False}),
                      preset_config(preset))["minutes"]
        per_round = (rl_plan["minutes"] - one) / (rounds - 1)
        args = preset_args(preset)["rl"]
        cap = args.max_sampling_rounds
        pass_rate = common.ASSUMED_PASS_RATE[args.task][preset]
        out.append((f"RL {rounds:.1f} sampling rounds per step ({args.task} pass@1 {pass_rate:.0%} at the start)",
                    [("1", one - rl_plan["minutes"])]
                    + ([(f"{cap} (the cap)", (cap - rounds) * per_round)] if cap - rounds >= 0.05 else [])))
    return out


def header_lines(preset):
    """speedrun.sh's budget table for a preset (tests/test_plan.py checks that the script holds these lines)."""
    plans = preset_plan(preset)
    lines = [f"#   {preset} preset on {HARDWARE[preset]['name']}: minutes, peak GiB per GPU"]
    lines += [f"#     {p['stage']:<6} {p['minutes']:5.0f} min  {p['peak_gib']:5.1f} GiB" for p in plans]
    lines.append(f"#     total  {sum(p['minutes'] for p in plans):5.0f} min")
    for name, others in unknowns(preset):
        lines.append(f"#     unknown: {name} assumed; at " + ", ".join(f"{value}: {minutes:+.0f} min"
                                                                     for value, minutes in others))
    return lines


def detect_gpus():
    """Memory in bytes of each GPU: NANOPOST_FAKE_GPUS ("NxMiB", "" or "0": none) when set, else torch's."""
    fake = os.environ.get("NANOPOST_FAKE_GPUS")
    if fake is None:
        import torch

        return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    if fake.strip() in ("", "0"):
        return []
    count, _, mib = fake.partition("x")
    if not (count.isdigit() and mib.isdigit()):
        raise ValueError(f"NANOPOST_FAKE_GPUS={fake!r}: expected <count>x<MiB per GPU>, e.g. 8x81559, or 0")
    return [int(mib) * 2**20] * int(count)


def choose_preset(gpus):
    """
    (preset, processes, reasons) for GPUs of the given memory (bytes): tiny without a GPU; small on one GPU or on
    GPUs with less memory than the full preset's largest stage plans for; full on 8 or more; with 2-7 the full
    recipe (accumulation) when its estimate is at most FULL_MAX_MINUTES, else small with DDP. The process count is
    a power of two (every preset's batch sizes are), so e.g. 6 GPUs run 4 processes.
    """
    if not gpus:
        return "tiny", 0, ["no GPU found -> tiny preset (offline synthetic data, CPU)"]
    n, memory = len(gpus), min(gpus)
    procs = 1 << (n.bit_length() - 1)
    full_need = max(p["peak_gib"] for p in preset_plan("full")) * GIB / MEMORY_MARGIN
    found = f"{n} GPU(s) of {memory / GIB:.1f} GiB"
    if n == 1:
        return "small", 1, [f"{found} -> small preset (one GPU)"]
    if memory < full_need:
        return "small", procs, [f"{found}: the full preset plans for {full_need / GIB:.0f} GiB per GPU -> small "
                                f"preset with DDP on {procs} GPU(s)"]
    if n >= 8:
        return "full", procs, [f"{found} -> full preset (hub data, torchrun on {procs} processes)"]
    # Same GPUs for both estimates: as fast as the full preset's planned GPU, `procs` of them.
    gpu = {**HARDWARE["full"], "gpus": procs}
    full, small = total_minutes("full", gpu), total_minutes("small", gpu)
    reasons = [f"{found}: estimates on {procs} of them: full (with gradient accumulation) ~{full / 60:.1f} h, "
               f"small (DDP) ~{small / 60:.1f} h"]
    if full <= FULL_MAX_MINUTES:
        return "full", procs, reasons + [f"-> full preset: within {FULL_MAX_MINUTES // 60} h"]
    return "small", procs, reasons + [f"-> small preset: full would take over {FULL_MAX_MINUTES // 60} h"]


def main(argv=None):
    parser = argparse.ArgumentParser(description="The speedrun's per-stage budget, and its choice of preset.")
    parser.add_argument("--preset", choices=sorted(HARDWARE), help="print this preset's per-stage plan")
    parser.add_argument("--choose", action="store_true", help="print 'PRESET PROCESSES' for this machine's GPUs "
                        "on stdout (the reasons on stderr); NANOPOST_FAKE_GPUS stubs the GPUs")
    args = parser.parse_args(argv)
    if args.choose:
        preset, procs, reasons = choose_preset(detect_gpus())
        for line in reasons:
            print(f"speedrun: {line}", file=sys.stderr)
        print(preset, procs)
        return
    if not args.preset:
        parser.error("give --preset or --choose")
    for p in preset_plan(args.preset):
        print(f"{p['stage']}:", end=" ")
        common.print_plan(p)
    print("\n".join(line[4:] for line in header_lines(args.preset)))


if __name__ == "__main__":
    common.run_cli(main)

"""
The report card: $NANOPOST_HOME/report.md rendered from report.jsonl, and the coverage statistics it shows.

    python report.py        # re-render $NANOPOST_HOME/report.md (and report_plots/) from report.jsonl

Every stage appends its record to report.jsonl (common.append_report), with the curves its Logger kept; eval.py
appends one per evaluated checkpoint and re-renders the card. The card: the environment, each stage's time and
metrics, one table of task metrics across the stages, the coverage table (A = pass@n - pass@1, S = A / (1 - pass@1),
bootstrap intervals), the paired Sharpening tax between stages, and matplotlib figures (optional, Agg backend): one
per stage of its training curves (STAGE_PANELS) and the pass@k curves.
"""

import argparse
import hashlib
import io
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

import common
from common import format_eta, print0

# The report card's order of the stages (pretrain.py's record says "pretrain", its checkpoint is "base").
PIPELINE = ("tokenizer", "pretrain", "base", "sft", "dpo", "rl", "ppo", "rm", "rlhf", "merge", "rft", "orpo", "kto")

# -----------------------------------------------------------------------------
# pass@k and coverage


def pass_at_k(n, c, k):
    """
    Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating Large Language Models
    Trained on Code", eq. 1):

        pass@k = 1 - C(n - c, k) / C(n, k)

    the probability that k samples drawn without replacement from the n contain at least one correct one.
    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms the huge binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_curve(correct, n):
    """[pass@1, ..., pass@n] averaged over problems; correct[i] = correct samples of problem i out of n."""
    if not correct:
        raise ValueError("pass_at_k_curve needs at least one problem")
    return [sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in range(1, n + 1)]


def _coverage(p1, pk):
    """A and S from mean pass@1 and mean pass@K; S is nan where pass@1 = 1 (nothing left to gain)."""
    gain = pk - p1
    with np.errstate(divide="ignore", invalid="ignore"):
        normalised = np.where(p1 < 1, gain / (1 - p1), np.nan)
    return gain, normalised


def coverage_gain(correct, n):
    """
    How much more n samples solve than one, from per-problem counts (correct[i] of n samples right):

        A = pass@n - pass@1,    S = A / (1 - pass@1)

    with pass@k averaged over problems. A is the coverage a bigger sampling budget buys; S is the fraction of what
    pass@1 left unsolved that it buys (0: sampling more finds nothing new; 1: everything is found). S is nan when
    pass@1 = 1. Returns (pass@1, pass@n, A, S).
    """
    if not correct:
        raise ValueError("coverage_gain needs at least one problem")
    p1 = sum(c / n for c in correct) / len(correct)
    pn = sum(c > 0 for c in correct) / len(correct)  # pass@n of one problem is 1 if any sample is right
    gain, normalised = _coverage(np.float64(p1), np.float64(pn))
    return p1, pn, float(gain), float(normalised)


def bootstrap_coverage(correct, n, num_resamples=1000, confidence=0.95, seed=0):
    """
    Percentile bootstrap intervals of A and S (coverage_gain) over problems: resample the problems with
    replacement num_resamples times, recompute A and S on each resample, and keep the central `confidence` mass.
    Resamples where S is undefined (pass@1 = 1) are left out of S's interval. Pure and seeded: same inputs, same
    intervals. Returns {"A": (low, high), "S": (low, high)}; an interval is (nan, nan) when nothing is left.
    """
    per_problem = np.array(correct, dtype=np.float64)
    p1, pn = per_problem / n, (per_problem > 0).astype(np.float64)  # (P,) each
    picks = np.random.default_rng(seed).integers(0, len(per_problem), size=(num_resamples, len(per_problem)))
    gain, normalised = _coverage(p1[picks].mean(1), pn[picks].mean(1))  # (num_resamples,) each
    tails = [(1 - confidence) / 2, (1 + confidence) / 2]
    intervals = {}
    for name, values in (("A", gain), ("S", normalised)):
        values = values[np.isfinite(values)]
        intervals[name] = tuple(float(v) for v in np.quantile(values, tails)) if len(values) else (math.nan, math.nan)
    return intervals


def paired_coverage_delta(correct_a, correct_b, n, num_resamples=1000, confidence=0.95, seed=0):
    """
    The change of coverage from stage a to stage b (e.g. SFT -> RL) on the same problems, the Sharpening tax:

        dA = A_b - A_a,    dS = S_b - S_a      (A = pass@n - pass@1, S = A / (1 - pass@1); coverage_gain)

    with paired percentile bootstrap intervals: each resample draws the problems once, with replacement, and both
    stages' A and S are computed on that same draw, dA_r = A_b(I_r) - A_a(I_r). What makes one problem easy for both
    stages cancels in the difference, so the interval is the uncertainty of the change itself (two separate
    intervals, compared by eye, are too wide and not a test of it). correct_a[i], correct_b[i]: correct samples of
    problem i out of n, the same problem i for both. Resamples where dS is undefined (pass@1 = 1 for either stage)
    are left out of dS's interval. Pure and seeded. Returns {"dA", "dS", "dA_interval", "dS_interval"}.
    """
    if len(correct_a) != len(correct_b) or not correct_a:
        raise ValueError(f"a paired comparison needs the same problems for both stages; got {len(correct_a)} and "
                         f"{len(correct_b)} per-problem counts")
    picks = np.random.default_rng(seed).integers(0, len(correct_a), size=(num_resamples, len(correct_a)))
    resampled = []
    for correct in (correct_a, correct_b):
        per_problem = np.array(correct, dtype=np.float64)
        resampled.append(_coverage((per_problem / n)[picks].mean(1), (per_problem > 0)[picks].mean(1)))
    (gain_a, normalised_a), (gain_b, normalised_b) = resampled  # (num_resamples,) each
    _, _, point_gain_a, point_normalised_a = coverage_gain(correct_a, n)
    _, _, point_gain_b, point_normalised_b = coverage_gain(correct_b, n)
    result = {"dA": point_gain_b - point_gain_a, "dS": point_normalised_b - point_normalised_a}
    tails = [(1 - confidence) / 2, (1 + confidence) / 2]
    for name, values in (("dA", gain_b - gain_a), ("dS", normalised_b - normalised_a)):
        values = values[np.isfinite(values)]
        result[f"{name}_interval"] = (tuple(float(v) for v in np.quantile(values, tails)) if len(values)
                                      else (math.nan, math.nan))
    return result


# What two evaluations of a generative task must share to be compared problem by problem (eval records' coverage).
PAIRED_SETTINGS = ("samples", "temperature", "top_k", "max_tokens", "problems")


def check_comparable(task, stage_a, counts_a, stage_b, counts_b):
    """
    Raise ValueError unless the coverage entries of two stages (an eval record's coverage[task]) can be compared
    problem by problem: the same number of samples n, temperature, top-k, max_tokens, and problem set (the hash of
    problem_set_id). Anything else changes pass@k for reasons other than the checkpoint.
    """
    for stage, counts in ((stage_a, counts_a), (stage_b, counts_b)):
        missing = [key for key in PAIRED_SETTINGS if key not in counts]
        if missing:
            raise ValueError(f"cannot compare {stage_a} and {stage_b} on {task}: the evaluation of {stage} does not "
                             f"record {', '.join(missing)} (an older eval.py); evaluate both again, e.g. "
                             f"python eval.py --compare {stage_a} {stage_b} --num-samples N --tasks {task}")
    differ = [f"{key} {counts_a[key]!r} vs {counts_b[key]!r}" for key in PAIRED_SETTINGS
              if counts_a[key] != counts_b[key]]
    if differ:
        raise ValueError(f"cannot compare {stage_a} and {stage_b} on {task}: their evaluations differ in "
                         f"{'; '.join(differ)}; evaluate both with the same settings, e.g. "
                         f"python eval.py --compare {stage_a} {stage_b} --num-samples N --tasks {task}")


def paired_tax(task, stage_a, counts_a, stage_b, counts_b, **bootstrap):
    """paired_coverage_delta of two stages' coverage entries for `task`, after check_comparable."""
    check_comparable(task, stage_a, counts_a, stage_b, counts_b)
    return paired_coverage_delta(counts_a["correct"], counts_b["correct"], counts_a["samples"], **bootstrap)


# -----------------------------------------------------------------------------
# The report card


def environment():
    """What the report was rendered on: git commit, python, torch and devices of this machine."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short=12", "HEAD") or "unknown (not a git checkout)"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " + uncommitted changes"
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        devices = ", ".join(f"{names.count(name)} x {name}" for name in dict.fromkeys(names))
    else:
        devices = f"CPU only ({os.cpu_count()} cores)"
    return {"git commit": commit, "python": platform.python_version(), "torch": torch.__version__,
            "devices": devices, "rendered": time.strftime("%Y-%m-%d %H:%M:%S")}


def curves_of(record):
    """
    {series: (steps, values)} of the training curves in a stage's record: the groups common.Logger.curves wrote
    under "curves", each {"step": [...], series: [...], ...}; a null value (no value at that step) becomes NaN, a gap
    in the figure.
    """
    return {name: (group["step"], [math.nan if v is None else v for v in values])
            for group in record.get("curves", []) for name, values in group.items() if name != "step"}


def scalars_of(record, prefix=""):
    """A record's scalar values as {name: value}, nested dicts flattened to "outer/inner", lists (curves) left out."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update(scalars_of(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float, str, bool)) or value is None:
            flat[prefix + key] = value
    return flat


def format_value(value):
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "" if value is None else str(value)


def latest_stage_records(records):
    """{stage: its latest record} of the training stages (not eval), in pipeline order, then any others as they come."""
    latest = {}
    for record in records:
        if record.get("stage") != "eval":
            latest[record.get("stage")] = record
    order = {stage: i for i, stage in enumerate(PIPELINE)}
    return dict(sorted(latest.items(), key=lambda item: order.get(item[0], len(order))))


def merged_evals(records):
    """
    {stage: {"metrics": {...}, "coverage": {...}, "step": ...}} from the eval records, in file order. A later run on
    the same checkpoint (same ckpt and step) overrides the metrics it measured again and keeps the others (e.g.
    GSM8K evaluated in a separate run); a run on a new checkpoint of the stage starts the stage's entry afresh.
    """
    merged = {}
    for record in records:
        if record.get("stage") != "eval":
            continue
        checkpoint = (record.get("ckpt"), record.get("step"))
        entry = merged.get(record["of"])
        if entry is None or entry["checkpoint"] != checkpoint:
            entry = merged[record["of"]] = {"metrics": {}, "coverage": {}, "core": {}, "step": record.get("step"),
                                            "checkpoint": checkpoint}
        entry["metrics"].update(record.get("metrics", {}))
        entry["coverage"].update(record.get("coverage", {}))
        entry["core"].update(record.get("core", {}))
    order = {stage: i for i, stage in enumerate(PIPELINE)}
    return dict(sorted(merged.items(), key=lambda item: order.get(item[0], len(order))))


def core_table(evals):
    """
    The CORE section (markdown lines; none when no stage has CORE): each task's accuracy and centred accuracy per
    stage that was scored (eval records' "core", core.evaluate_core), and CORE, their mean, in the last row.
    """
    scored = {stage: entry for stage, entry in evals.items() if entry.get("core")}
    if not scored:
        return []
    lines = ["", "## CORE", "", "The DCLM CORE metric as nanochat computes it (core.py): per task, accuracy and "
             "centred accuracy (acc - baseline) / (1 - baseline); CORE is the mean of the centred accuracies "
             "(0 = chance; GPT-2 1.5B: 0.2565).", "",
             "| task | type | shots | items | " + "".join(f"{stage} acc | {stage} centred | " for stage in scored).rstrip(),
             "|---|---|---|---|" + "---|---|" * len(scored)]
    for task, first in next(iter(scored.values()))["core"].items():
        cells = [f"{format_value(e['core'][task]['acc'])} | {format_value(e['core'][task]['centred'])}"
                 if task in e["core"] else " | " for e in scored.values()]
        lines.append(f"| {task} | {first['type']} | {first['num_fewshot']} | {first['count']} | " + " | ".join(cells)
                     + " |")
    lines.append("| **CORE** | | | | " + " | ".join(f" | **{format_value(e['metrics'].get('core'))}**"
                                                      for e in scored.values()) + " |")
    return lines


def coverage_rows(evals):
    """
    One row per (task, stage) with per-problem counts from more than one sample: (task, stage, n, problems,
    pass@1, pass@n, A, S, A interval, S interval).
    """
    rows = []
    tasks = dict.fromkeys(task for entry in evals.values() for task in entry["coverage"])
    for task in tasks:
        for stage, entry in evals.items():
            counts = entry["coverage"].get(task)
            if counts is None or counts["samples"] < 2:
                continue
            n, correct = counts["samples"], counts["correct"]
            intervals = bootstrap_coverage(correct, n)
            rows.append((task, stage, n, len(correct), *coverage_gain(correct, n), intervals["A"], intervals["S"]))
    return rows


def coverage_table(rows):
    """Markdown lines of the coverage table (coverage_rows)."""
    def with_interval(value, interval):
        if math.isnan(value):
            return "n/a"
        return f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"

    lines = ["| task | stage | n | problems | pass@1 | pass@n | A = pass@n - pass@1 [95% CI] "
             "| S = A / (1 - pass@1) [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for task, stage, n, problems, p1, pn, gain, normalised, gain_interval, normalised_interval in rows:
        lines.append(f"| {task} | {stage} | {n} | {problems} | {p1:.3f} | {pn:.3f} | "
                     f"{with_interval(gain, gain_interval)} | {with_interval(normalised, normalised_interval)} |")
    return lines


def paired_rows(evals, stages=None):
    """
    One row per task and pair of stages (earlier, later in pipeline order) with per-problem counts from more than
    one sample: (task, stage_a, stage_b, paired_tax(...) or the ValueError saying why they cannot be compared).
    `stages`: only these (default: every evaluated stage).
    """
    rows = []
    tasks = dict.fromkeys(task for entry in evals.values() for task in entry["coverage"])
    for task in tasks:
        sampled = [(stage, entry["coverage"][task]) for stage, entry in evals.items()
                   if (stages is None or stage in stages) and entry["coverage"].get(task, {}).get("samples", 0) > 1]
        for i, (stage_a, counts_a) in enumerate(sampled):
            for stage_b, counts_b in sampled[i + 1:]:
                try:
                    rows.append((task, stage_a, stage_b, paired_tax(task, stage_a, counts_a, stage_b, counts_b)))
                except ValueError as error:
                    rows.append((task, stage_a, stage_b, error))
    return rows


def paired_table(rows):
    """Markdown lines of the paired comparison (paired_rows); a pair that cannot be compared says why."""
    def with_interval(value, interval):
        return "n/a" if math.isnan(value) else f"{value:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}]"

    lines = ["| task | from | to | dA [95% CI, paired] | dS [95% CI, paired] |", "|---|---|---|---|---|"]
    refused = []
    for task, stage_a, stage_b, result in rows:
        if isinstance(result, Exception):
            refused.append(f"- {task}, {stage_a} -> {stage_b}: not compared. {result}")
            continue
        lines.append(f"| {task} | {stage_a} | {stage_b} | {with_interval(result['dA'], result['dA_interval'])} | "
                     f"{with_interval(result['dS'], result['dS_interval'])} |")
    return lines + ([""] + refused if refused else [])


# -----------------------------------------------------------------------------
# The figures


class Panel(NamedTuple):
    """
    One plot of a stage's figure: `left` series on the left axis and `right` series on a second y-axis, each a
    (series logged by the stage, legend label) pair, with the axes' labels (units). A panel is drawn when the stage
    logged its first series (so GRPO's figure has no reward-model or critic panel), with those of the others it logged
    (no KL without a reference model).
    """

    title: str
    left: tuple
    left_label: str
    right: tuple = ()
    right_label: str = ""


# Series logged on held-out data: drawn as dashed lines with a marker at each evaluation, training series as lines.
HELD_OUT_PREFIXES = ("val/", "eval/")

PRETRAIN_PANELS = [
    Panel("loss", [("train/loss", "training loss")], "cross-entropy (nats/token)",
          [("val/bpb", "held-out bits per byte")], "bits per byte"),
    Panel("schedule and throughput", [("train/lrm", "learning-rate multiplier")], "x initial learning rate",
          [("train/tokens_per_sec", "tokens/s")], "tokens/s"),
]
SFT_PANELS = [
    Panel("loss on assistant tokens", [("train/loss", "training loss"), ("val/loss", "held-out loss")],
          "cross-entropy (nats/target token)"),
]
# Every --loss logs loss and margin; the pairwise losses also accuracy and log-probs, KTO its desirable and
# undesirable rewards and z0 (dpo.preference_losses).
DPO_PANELS = [
    Panel("loss (with its NLL term: --sft-weight, ORPO's)", [("train/loss", "training"), ("val/loss", "held-out")],
          "loss (nats per pair; KTO: per answer)"),
    Panel("implicit reward margin", [("train/rewards/margins", "training"), ("val/rewards/margins", "held-out")],
          "chosen - rejected reward (nats)"),
    Panel("preference accuracy", [("train/rewards/accuracy", "training"), ("val/rewards/accuracy", "held-out")],
          "share of pairs ranked right"),
    Panel("log-probabilities of the answers", [("train/logps/chosen", "chosen"), ("train/logps/rejected", "rejected")],
          "log pi(answer | prompt) (nats)"),
    Panel("KTO rewards and reference point", [("train/rewards/desirable", "desirable answers"),
                                              ("train/rewards/undesirable", "undesirable answers")],
          "implicit reward (nats)", [("train/kl", "z0 (KL estimate)")], "z0 (nats)"),
]
# Rejection-sampling fine-tuning (sft.py --rft-rounds): one point per round, round 0 the model it started from.
RFT_PANELS = [
    Panel("held-out coverage", [("eval/pass@1", "pass@1"), ("eval/pass@k", "pass@k (k = --rft-eval-samples)")],
          "share of held-out problems (T = 1)"),
    Panel("kept answers and loss", [("rft/answers_kept", "answers kept"), ("rft/prompts_kept", "problems kept")],
          "count (all ranks)", [("train/loss", "mean training loss of the round")], "cross-entropy (nats/target token)"),
]
RM_PANELS = [
    Panel("pair accuracy", [("train/accuracy", "training"), ("val/accuracy", "held-out")],
          "share of pairs ranked right"),
    Panel("held-out margin and loss", [("val/margin", "margin r(chosen) - r(rejected)")], "score difference",
          [("train/loss", "training loss"), ("val/loss", "held-out loss")], "loss (nats/pair)"),
]
# GRPO, PPO and RL from a reward model log the same rollout and policy series; each adds its own panel.
RL_PANELS = [
    Panel("reward and held-out pass@1", [("reward/mean", "reward (training rollouts)"),
                                         ("eval/pass@1", "held-out pass@1")], "reward / pass@1"),
    Panel("reward model vs verifier", [("reward/rm_score", "RM score (training rollouts)"),
                                       ("eval/rm_score", "RM score (held-out)")], "reward-model score",
          [("reward/accuracy", "verifier accuracy (training rollouts)"), ("eval/pass@1", "held-out pass@1 (verifier)")],
          "verifier pass rate"),
    Panel("critic", [("critic/value_loss", "value loss")], "value loss (squared reward units)",
          [("critic/explained_variance", "explained variance")], "explained variance of the returns"),
    Panel("entropy and KL", [("policy/entropy", "entropy")], "entropy (nats/token)",
          [("policy/kl", "KL to the reference")], "KL (nats/token)"),
    Panel("response length, truncated and zero-contrast shares", [("length/mean", "mean length")], "tokens",
          [("length/truncated_frac", "truncated"), ("batch/zero_contrast_frac", "zero-contrast groups")], "share"),
    Panel("clipping and engine/learner gap", [("policy/clip_low", "clipped low"), ("policy/clip_high", "clipped high")],
          "share of tokens", [("mismatch/logp_gap_mean", "|engine - learner| log-prob")], "nats/token"),
]
# Which panels a stage's figure has, by the stage name in its record (the script that wrote it does not matter).
STAGE_PANELS = {"pretrain": PRETRAIN_PANELS, "sft": SFT_PANELS, "rft": RFT_PANELS, "dpo": DPO_PANELS, "orpo": DPO_PANELS,
                "kto": DPO_PANELS, "rm": RM_PANELS, "rl": RL_PANELS, "rlhf": RL_PANELS, "ppo": RL_PANELS}
# An RL step is one batch of rollouts and the optimizer steps on it (--epochs x --minibatches); other stages'
# steps are optimizer steps.
STEP_LABELS = {**dict.fromkeys(("rl", "rlhf", "ppo"), "step (one rollout batch and its updates)"),
               "rft": "round (sample, keep the verified, one SFT pass)"}


def stage_panels(stage, curves):
    """The panels of a stage's figure whose first series is in `curves` (curves_of); a stage without its own list of
    panels gets one panel per series, the first six."""
    panels = STAGE_PANELS.get(stage) or [Panel(name, [(name, name)], name) for name in list(curves)[:6]]
    return [panel for panel in panels if panel.left[0][0] in curves]


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def stage_figure(stage, record):
    """
    The figure of one stage's training curves (stage_panels of its record), or None when it logged none. Each drawn
    line's gid is the name of its series. Needs matplotlib.
    """
    plt = pyplot()
    curves = curves_of(record)
    panels = stage_panels(stage, curves)
    if not panels:
        return None
    columns = min(len(panels), 2)
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    for ax, panel in zip(axes.flat, panels):
        handles, color = [], 0
        for axis, series, label in ((ax, panel.left, panel.left_label), (None, panel.right, panel.right_label)):
            series = [(name, legend) for name, legend in series if name in curves]
            if not series:
                continue
            axis = axis or ax.twinx()
            for name, legend in series:
                steps, values = curves[name]
                held_out = name.startswith(HELD_OUT_PREFIXES)
                marker = "o" if held_out else "." if len(steps) <= 20 else None  # a short run's points stay visible
                line, = axis.plot(steps, values, color=f"C{color}", linestyle="--" if held_out else "-",
                                  marker=marker, markersize=4, linewidth=1.2, gid=name,
                                  label=legend + (" (held-out)" if held_out and "held-out" not in legend else ""))
                handles.append(line)
                color += 1
            axis.set_ylabel(label)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(STEP_LABELS.get(stage, "optimizer step"))
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))  # steps are whole numbers, also in a short run
        ax.grid(alpha=0.3)
        ax.legend(handles=handles, fontsize=7)
    fig.suptitle(f"{stage}: training curves (dashed with markers: held-out evaluations)", fontsize=11)
    fig.tight_layout()
    return fig


def save_png(fig, path, dpi):
    """
    Save a figure as a 64-colour PNG: plots of lines use few colours, and the palette keeps a six-panel stage figure
    near 40 KB where matplotlib's RGBA PNG is about 150 KB, with no visible difference. (Pillow comes with
    matplotlib.)
    """
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=dpi)
    Image.open(buffer).convert("RGB").quantize(colors=64).save(path, optimize=True)


def draw_plots(records, out_dir):
    """
    PNG plots for the report, written to out_dir: each stage's training curves (stage_figure, latest run of the
    stage) and, per generative task, the pass@k curves of the evaluated stages. Returns {name: path}, or None when
    matplotlib is not installed (it is optional).
    A plot is drawn again only when what it shows changed: out_dir/drawn.json keeps, per plot, a hash of its data and
    of this file (drawing a figure takes ~0.7 s on a CPU, and every eval.py run re-renders the report).
    """
    plt = pyplot()
    if plt is None:
        return None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn_path = out_dir / "drawn.json"
    drawn = json.loads(drawn_path.read_text()) if drawn_path.exists() else {}
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    plots = {}

    def stale(name, data):
        """Record `name`'s path in plots; True when its PNG must be drawn (missing, or drawn from other data)."""
        plots[name] = out_dir / f"{name}.png"
        key = hashlib.sha256((code + json.dumps(data, sort_keys=True, default=float)).encode()).hexdigest()
        fresh = drawn.get(name) == key and plots[name].exists()
        drawn[name] = key
        return not fresh

    for stage, record in latest_stage_records(records).items():
        if not stage_panels(stage, curves_of(record)) or not stale(stage, record):  # no curves, or drawn already
            continue
        fig = stage_figure(stage, record)
        save_png(fig, plots[stage], dpi=80)
        plt.close(fig)
    evals = merged_evals(records)
    for task in dict.fromkeys(task for entry in evals.values() for task in entry["coverage"]):
        sampled = [(stage, entry["coverage"][task]) for stage, entry in evals.items()
                   if task in entry["coverage"] and entry["coverage"][task]["samples"] > 1]
        if not sampled or not stale(f"coverage-{task}", sampled):  # greedy single samples only: no pass@k curve
            continue
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for stage, counts in sampled:
            curve = pass_at_k_curve(counts["correct"], counts["samples"])
            ax.plot(range(1, len(curve) + 1), curve, marker="o", label=stage)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda k, _: f"{k:g}"))  # 1 2 4 8, not 2^0 ...
        ax.set_xlabel("k (samples)")
        ax.set_ylabel("pass@k")
        ax.set_title(f"{task}: pass@k averaged over problems")
        ax.legend()
        fig.tight_layout()
        save_png(fig, plots[f"coverage-{task}"], dpi=100)
        plt.close(fig)
    drawn_path.write_text(json.dumps(drawn, indent=1))
    return plots


def render_report(records, env, plots=None, plot_root="."):
    """
    The report card (markdown) from report records (common.read_report()): the environment, each stage's time and
    metrics, one table of task metrics across base/SFT/DPO/RL, the coverage table, and links to `plots` (from
    draw_plots: None means matplotlib was missing) made relative to `plot_root`, the folder of report.md.
    """
    lines = ["# nanopost report card", "", "## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in env.items()]

    def image(name, caption):
        if plots and name in plots:
            lines.extend(["", f"![{caption}]({os.path.relpath(plots[name], plot_root)})"])

    stage_records = latest_stage_records(records)
    if stage_records:
        total = sum(r.get("seconds", 0) for r in stage_records.values())
        lines += ["", "## Stages", "", "| stage | finished | time |", "|---|---|---|"]
        lines += [f"| {stage} | {r.get('time', '')} | {format_eta(r['seconds']) if 'seconds' in r else ''} |"
                  for stage, r in stage_records.items()]
        lines.append(f"| total | | {format_eta(total)} |")
    for stage, record in stage_records.items():
        lines += ["", f"### {stage}", "", "| metric | value |", "|---|---|"]
        lines += [f"| {key} | {format_value(value)} |" for key, value in scalars_of(record).items()
                  if key not in ("stage", "time")]
        image(stage, f"{stage} training curves")

    evals = merged_evals(records)
    if evals:
        metric_names = list(dict.fromkeys(name for entry in evals.values() for name in entry["metrics"]))
        lines += ["", "## Task metrics", "", "| metric | " + " | ".join(evals) + " |", "|---" * (len(evals) + 1) + "|"]
        lines.append("| checkpoint step | " + " | ".join(format_value(e["step"]) for e in evals.values()) + " |")
        for name in metric_names:
            cells = [format_value(entry["metrics"].get(name)) for entry in evals.values()]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", "bpb: bits per byte of the validation text (lower is better). Multiple choice (acc): the base "
                  "model by log-likelihood of each choice (acc_norm: per character), chat stages by the log-prob of "
                  "the answer letter. pass@k: unbiased estimate from n samples per problem."]
    lines += core_table(evals)
    rows = coverage_rows(evals)
    if rows:
        lines += ["", "## Coverage", "", "From the same per-problem counts: how much more n samples solve than one. "
                  "A stage that sharpens its policy raises pass@1 and lowers A and S.", ""]
        lines += coverage_table(rows)
        lines += ["", "The Sharpening tax, paired: dA = A(to) - A(from) and dS = S(to) - S(from) on the same problems, "
                  "with intervals from one bootstrap resample of the problems shared by both stages. An interval "
                  "below 0 means the later stage lost coverage.", ""]
        lines += paired_table(paired_rows(evals))
        for task in dict.fromkeys(row[0] for row in rows):
            image(f"coverage-{task}", f"{task} pass@k curves")
    has_curves = any(curves_of(r) for r in stage_records.values())
    if plots is None and (has_curves or rows):
        lines += ["", "(Plots skipped: matplotlib is not installed. `pip install matplotlib` and rerun "
                  "`python report.py`.)"]
    return "\n".join(lines) + "\n"


def write_report():
    """Render $NANOPOST_HOME/report.md (and its plots under report_plots/) from report.jsonl. Returns its path."""
    base_dir = common.get_base_dir()
    records = common.read_report()
    plots = draw_plots(records, base_dir / "report_plots")
    path = base_dir / "report.md"
    path.write_text(render_report(records, environment(), plots, plot_root=base_dir))
    return path


# -----------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description="Re-render the report card $NANOPOST_HOME/report.md (and its plots) "
                                                 "from report.jsonl.")
    parser.parse_args(argv)
    print0(f"wrote {write_report()}")


if __name__ == "__main__":
    common.run_cli(main)

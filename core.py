"""
The CORE metric of the DCLM paper (Li et al. 2024, "DataComp-LM", sec. 3.5 and appendix G), computed the way
nanochat's nanochat/core_eval.py and scripts/base_eval.py compute it, so that a base checkpoint's number here can stand
next to nanochat's leaderboard (GPT-2 1.5B: 0.2565).

    python eval.py --preset full --stage base --tasks core           # needs the bundle: python tasks.py prepare

The data is the eval bundle nanochat downloads (BUNDLE_URL, unzipped to <data dir>/eval_bundle): core.yaml lists the
22 tasks (label, dataset_uri, num_fewshot, icl_task_type, continuation_delimiter), eval_meta_data.csv each task's
"Random baseline" in percent, eval_data/ the items as JSON lines:

    multiple_choice     {"query", "choices", "gold"}             the choices continue the same context
    schema              {"context_options", "continuation", "gold"}  the contexts differ, the continuation is shared
    language_modeling   {"context", "continuation"}              the continuation must be predicted greedily

Per task: the items shuffled with random.Random(SHUFFLE_SEED) (the bundle's files are ordered); item i gets
num_fewshot solved examples drawn from the other items with random.Random(FEWSHOT_SEED + i), rendered before it, each
followed by a blank line. Every prompt is encoded with <|bos|> in front and cut from the left to the model's context.
    multiple choice and schema: the option with the lowest mean cross-entropy over its scored tokens is the answer.
        The scored tokens are those after the options' common token prefix (multiple choice) or the common token
        suffix (schema).
    language modelling: correct when the argmax at every continuation position is the continuation's token.
Then centred accuracy and CORE:

    centred_t = (acc_t - b_t) / (1 - b_t),  b_t = random baseline_t / 100;   CORE = mean_t centred_t

so chance is 0 and a perfect model 1 on every task (a model below chance is negative).

Two differences from nanochat, both deliberate: a row longer than the model's context is cut from the left (nanochat
cuts only for models with a max_seq_len, e.g. GPT-2), and an item nanochat would stop on an assertion for (a
language-modelling prompt whose tokens are not a prefix of the prompt with its continuation) counts as wrong and is
counted in "errors".
"""

import csv
import json
import os
import random
import shutil
import time
import urllib.request
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import UserError, autocast_ctx, format_eta, get_dist_info, print0

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # nanochat's EVAL_BUNDLE_URL
BUNDLE_DIR = "eval_bundle"  # under the data folder ($NANOPOST_DATA_DIR)
SHUFFLE_SEED = 1337  # base_eval.py shuffles each task's items with this seed
FEWSHOT_SEED = 1234  # core_eval.py draws item i's few-shot examples with random.Random(1234 + i)
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
# For plan.py, estimates (not measurements): the bundle's 22 tasks hold ~91k items; an item runs ~2.5 rows of a few
# hundred tokens (10-shot prompts), ~1,300 forward tokens.
PLAN_ITEMS, PLAN_TOKENS_PER_ITEM, NUM_TASKS = 91_000, 1_300, 22


def plan_forward_tokens(max_per_task=None):
    """The forward tokens plan.py assumes for one CORE evaluation with at most max_per_task items per task."""
    return min(PLAN_ITEMS, NUM_TASKS * max_per_task if max_per_task else PLAN_ITEMS) * PLAN_TOKENS_PER_ITEM


# -----------------------------------------------------------------------------
# The bundle


def bundle_missing(root):
    """What <root>/eval_bundle lacks, offline: a list of "eval bundle: why" (empty when every task's file reads)."""
    folder = Path(root) / BUNDLE_DIR
    try:
        tasks = load_bundle(root, max_per_task=1)
    except (FileNotFoundError, UserError, ValueError, KeyError) as e:
        return [f"eval bundle ({folder}): {e}"]
    empty = [task["label"] for task in tasks if not task["items"]]
    return [f"eval bundle ({folder}): no items in {', '.join(empty)}"] if empty else []


def download_bundle(root, url=BUNDLE_URL):
    """
    Download the eval bundle zip to <root>/eval_bundle.zip (resumable: a cut-off eval_bundle.zip.part is continued with
    an HTTP Range request; a server that answers the whole file starts it over) and unzip it to <root>/eval_bundle.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    part = root / "eval_bundle.zip.part"
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    print(f"prepare: {url} -> {root / BUNDLE_DIR}" + (f" (resuming at {have} bytes)" if have else ""), flush=True)
    with urllib.request.urlopen(request, timeout=60) as response:
        with open(part, "ab" if response.status == 206 else "wb") as f:  # 200: the server sent the whole file
            shutil.copyfileobj(response, f, length=1 << 20)
    zipped = part.with_suffix("")  # eval_bundle.zip
    part.replace(zipped)
    unpacked = root / (BUNDLE_DIR + ".tmp")
    shutil.rmtree(unpacked, ignore_errors=True)
    with zipfile.ZipFile(zipped) as z:
        z.extractall(unpacked)
    inner = unpacked / BUNDLE_DIR if (unpacked / BUNDLE_DIR / "core.yaml").exists() else unpacked  # zip's own folder
    shutil.rmtree(root / BUNDLE_DIR, ignore_errors=True)
    inner.replace(root / BUNDLE_DIR)
    shutil.rmtree(unpacked, ignore_errors=True)
    zipped.unlink()
    missing = bundle_missing(root)
    if missing:
        raise UserError(f"the downloaded eval bundle is incomplete: {'; '.join(missing)}")


def load_bundle(root, max_per_task=None):
    """
    The CORE tasks of <root>/eval_bundle, in core.yaml's order: a list of {"label", "type", "num_fewshot",
    "delimiter", "baseline" (a fraction), "items"}, each task's items shuffled with SHUFFLE_SEED and then cut to
    the first max_per_task (as base_eval.py's max_per_task).
    """
    import yaml  # pyyaml, installed with `datasets`

    folder = Path(root) / BUNDLE_DIR
    if not (folder / "core.yaml").is_file():
        raise UserError(f"no CORE eval bundle at {folder} (core.yaml missing): run `python tasks.py prepare` "
                        "(NANOPOST_DATA_DIR names the data folder)")
    config = yaml.safe_load((folder / "core.yaml").read_text())
    with open(folder / "eval_meta_data.csv", encoding="utf-8") as f:
        baselines = {row["Eval Task"]: float(row["Random baseline"]) for row in csv.DictReader(f)}
    tasks = []
    for entry in config["icl_tasks"]:
        label, task_type = entry["label"], entry["icl_task_type"]
        if task_type not in TASK_TYPES:
            raise UserError(f"{folder}/core.yaml: task {label} has icl_task_type {task_type!r}; expected one of "
                            f"{', '.join(TASK_TYPES)}")
        if label not in baselines:
            raise UserError(f"{folder}/eval_meta_data.csv has no random baseline for task {label}")
        with open(folder / "eval_data" / entry["dataset_uri"], encoding="utf-8") as f:
            items = [json.loads(line) for line in f if line.strip()]
        random.Random(SHUFFLE_SEED).shuffle(items)
        shots = entry["num_fewshot"]
        tasks.append({"label": label, "type": task_type, "num_fewshot": shots[0] if isinstance(shots, list) else shots,
                      "delimiter": entry.get("continuation_delimiter", " "), "baseline": baselines[label] / 100,
                      "items": items[:max_per_task] if max_per_task else items})
    return tasks


def write_stand_in_bundle(root, seed=0, items=8):
    """A small bundle of the real one's format under <root>/eval_bundle (one task of each type), for rehearsals."""
    rng = random.Random(seed)
    folder = Path(root) / BUNDLE_DIR
    (folder / "eval_data").mkdir(parents=True, exist_ok=True)
    words = ["red", "blue", "cat", "dog", "sun", "tree", "one", "two", "river", "stone"]
    data = {
        "mc.jsonl": [{"query": f"Question: {' '.join(rng.choices(words, k=5))}?\nAnswer:",
                      "choices": rng.sample(words, 4), "gold": rng.randrange(4)} for _ in range(items)],
        "schema.jsonl": [{"context_options": [f"The {w} was here" for w in rng.sample(words, 2)],
                          "continuation": f"and then {rng.choice(words)}.", "gold": rng.randrange(2)}
                         for _ in range(items)],
        "lm.jsonl": [{"context": " ".join(rng.choices(words, k=6)), "continuation": rng.choice(words)}
                     for _ in range(items)],
    }
    for name, rows in data.items():
        (folder / "eval_data" / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    tasks = [("stand_in_mc", "mc.jsonl", 2, "multiple_choice", 25.0), ("stand_in_schema", "schema.jsonl", 0, "schema",
             50.0), ("stand_in_lm", "lm.jsonl", 2, "language_modeling", 0.0)]
    (folder / "core.yaml").write_text("icl_tasks:\n" + "".join(
        f"- label: {label}\n  dataset_uri: {uri}\n  num_fewshot: [{shots}]\n  icl_task_type: {kind}\n"
        f"  continuation_delimiter: ' '\n" for label, uri, shots, kind, _ in tasks))
    (folder / "eval_meta_data.csv").write_text("Eval Task,Task Category,Task Type,#shots,Random baseline\n" + "".join(
        f"{label},stand-in,{kind},{shots},{baseline}\n" for label, _, shots, kind, baseline in tasks))
    return folder


# -----------------------------------------------------------------------------
# Prompts and the scored positions


def render_prompts(task_type, item, delimiter, shots):
    """
    The texts to score for one item, as nanochat's templates render them (each solved example, then a blank line):
        multiple_choice:   "{query}{delim}{choices[gold]}\\n\\n" per shot, then "{query}{delim}{choice}" per choice
        schema:            "{context_options[gold]}{delim}{continuation}\\n\\n" per shot, then
                           "{context_option}{delim}{continuation}" per context option
        language_modeling: "{context.strip()}{delim}{continuation}\\n\\n" per shot, then [the prompt without the
                           continuation, stripped of trailing whitespace; the prompt with it]
    """
    if task_type == "multiple_choice":
        solved = "".join(f"{s['query']}{delimiter}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{solved}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if task_type == "schema":
        solved = "".join(f"{s['context_options'][s['gold']]}{delimiter}{s['continuation']}\n\n" for s in shots)
        return [f"{solved}{context}{delimiter}{item['continuation']}" for context in item["context_options"]]
    solved = "".join(f"{s['context'].strip()}{delimiter}{s['continuation']}\n\n" for s in shots)
    without = f"{solved}{item['context'].strip()}{delimiter}"
    # Stripped (core_eval.py does too): a trailing space would merge into the continuation's first token.
    return [without.strip(), without + item["continuation"]]


def common_length(sequences, direction):
    """How many leading ("left") or trailing ("right") tokens all of `sequences` share."""
    shortest = min(len(s) for s in sequences)
    for n in range(shortest):
        at = n if direction == "left" else -1 - n
        if any(s[at] != sequences[0][at] for s in sequences):
            return n
    return shortest


def scored_spans(task_type, token_lists):
    """
    (rows, starts, ends): the token rows to run and, per row, the half-open span [start, end) of the tokens scored.
    multiple_choice: after the common prefix; schema: the common suffix; language_modeling: one row (the prompt with
    the continuation), its tokens after the prompt without it, or ValueError when those are not its prefix.
    """
    if task_type == "multiple_choice":
        start = common_length(token_lists, "left")
        return token_lists, [start] * len(token_lists), [len(t) for t in token_lists]
    if task_type == "schema":
        suffix = common_length(token_lists, "right")
        return token_lists, [len(t) - suffix for t in token_lists], [len(t) for t in token_lists]
    without, with_continuation = token_lists
    if with_continuation[:len(without)] != without or len(with_continuation) <= len(without):
        raise ValueError("the prompt's tokens are not a prefix of the prompt with its continuation")
    return [with_continuation], [len(without)], [len(with_continuation)]


def fewshot_examples(items, index, num_fewshot):
    """Item `index`'s few-shot examples: num_fewshot of the other items, drawn with random.Random(1234 + index)."""
    if num_fewshot == 0:
        return []
    others = [i for i in range(len(items)) if i != index]
    return [items[i] for i in random.Random(FEWSHOT_SEED + index).sample(others, num_fewshot)]


def centred_accuracy(accuracy, baseline):
    """(acc - b) / (1 - b) with b the task's random-guess accuracy as a fraction: 0 at chance, 1 when perfect."""
    return (accuracy - baseline) / (1 - baseline)


def core_score(accuracies, baselines):
    """({label: centred accuracy}, CORE = their mean) from {label: accuracy} and {label: baseline fraction}."""
    centred = {label: centred_accuracy(acc, baselines[label]) for label, acc in accuracies.items()}
    return centred, sum(centred.values()) / len(centred)


# -----------------------------------------------------------------------------
# Scoring


@torch.no_grad()
def example_correct(model, tokenizer, task, index):
    """Whether the model answers task["items"][index] right (see the module docstring)."""
    item = task["items"][index]
    shots = fewshot_examples(task["items"], index, task["num_fewshot"])
    prompts = render_prompts(task["type"], item, task["delimiter"], shots)
    rows, starts, ends = scored_spans(task["type"], tokenizer.encode(prompts, prepend="<|bos|>"))
    keep = model.config.sequence_len
    cut = [max(0, len(row) - keep) for row in rows]  # left crop to the context window, as core_eval.py's max_seq_len
    rows = [row[c:] for row, c in zip(rows, cut)]
    starts = [max(1, s - c) for s, c in zip(starts, cut)]  # position 0 (<|bos|> or a cut token) is never predicted
    ends = [e - c for e, c in zip(ends, cut)]
    device = next(model.parameters()).device
    x = torch.full((len(rows), max(map(len, rows))), tokenizer.bos_id, dtype=torch.long)  # (B, T), right-padded
    for b, row in enumerate(rows):
        x[b, :len(row)] = torch.tensor(row)
    x = x.to(device)
    with autocast_ctx(device):
        logits = model(x).float()  # (B, T, V)
    if task["type"] == "language_modeling":
        s, e = starts[0], ends[0]
        return bool((logits[0, s - 1:e - 1].argmax(-1) == x[0, s:e]).all())
    mean_losses = [F.cross_entropy(logits[b, s - 1:e - 1], x[b, s:e]).item()
                   for b, (s, e) in enumerate(zip(starts, ends))]
    return mean_losses.index(min(mean_losses)) == item["gold"]


def evaluate_core(model, tokenizer, tasks, label=None):
    """
    CORE of the model on `tasks` (load_bundle): {"core", "tasks": {label: {"acc", "centred", "count", "type",
    "num_fewshot", "errors"}}}. Under DDP rank r takes items r, r + world_size, ...; the counts are summed. An item
    whose prompts cannot be scored (language modelling: the prompt's tokens are not a prefix of the prompt with its
    continuation) counts as wrong and is counted in "errors".
    """
    _, rank, _, world_size = get_dist_info()
    device = next(model.parameters()).device
    results = {}
    t0 = time.time()
    for t, task in enumerate(tasks):
        correct = errors = 0
        for index in range(rank, len(task["items"]), world_size):
            try:
                correct += example_correct(model, tokenizer, task, index)
            except ValueError:
                errors += 1
        counts = torch.tensor([correct, errors], dtype=torch.long, device=device)
        if dist.is_initialized():
            dist.all_reduce(counts)
        correct, errors = counts.tolist()
        accuracy = correct / len(task["items"])
        results[task["label"]] = {"acc": accuracy, "count": len(task["items"]), "type": task["type"],
                                  "num_fewshot": task["num_fewshot"], "errors": errors}
        if label is not None:
            elapsed = time.time() - t0
            print0(f"{label}: {task['label']} acc {accuracy:.4f} | task {t + 1}/{len(tasks)} | {elapsed:.0f}s | "
                   f"ETA {format_eta(elapsed / (t + 1) * (len(tasks) - t - 1))}")
    centred, core = core_score({name: r["acc"] for name, r in results.items()},
                               {task["label"]: task["baseline"] for task in tasks})
    for name, value in centred.items():
        results[name]["centred"] = value
    return {"core": core, "tasks": results}


def bundle_root():
    """The folder holding eval_bundle: $NANOPOST_DATA_DIR, else $NANOPOST_HOME/data (where tasks.py prepare puts it)."""
    from common import get_base_dir

    return Path(os.environ.get("NANOPOST_DATA_DIR") or get_base_dir() / "data")

"""
Datasets and verifiers. Every dataset is an iterable of conversations (tokenizer.py's format); a task that
can be checked has a verifier that returns a float reward.

The offline **synthetic task family** (the tiny preset's data and the tests') is generated deterministically
from a seed: arithmetic questions and small word problems whose worked answers use the calculator tool and
end, like GSM8K, with a final line "#### <answer>". The same generator writes the pretraining documents, so
a tiny base model has seen the language that SFT, DPO and RL later build on. A problem belongs to the train
or the test split by a hash of its question text, so the held-out split never leaks into any training data.

    python tasks.py prepare                      # download every hub file the GPU presets read (resumable)
    python tasks.py prepare --fineweb-shards 4   # only the first 4 FineWeb-Edu files (a quick small run)
"""

import hashlib
import json
import os
import random
import re
import signal
import socket
import threading
from collections import Counter, deque
from contextlib import contextmanager
from fnmatch import fnmatch
from itertools import islice
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import torch

import core

# -----------------------------------------------------------------------------
# Final answers and the strict verifier shared by GSM8K and the synthetic tasks

MAX_ANSWER_CHARS = 32  # a final answer longer than this is not a number we accept (and costs nothing to reject)


# ASCII digits; commas only as thousands separators ("1,234", not "12,34" or ",42,")
PLAIN_NUMBER = re.compile(r"-?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?", re.ASCII)


def canonical_number(text):
    """'1,234' -> '1234', '$5.' -> '5', '72.0' -> '72', '-3.50' -> '-3.5'; None if `text` is not a plain number."""
    text = text.strip().removeprefix("$").removesuffix(".")
    if len(text) > MAX_ANSWER_CHARS or not PLAIN_NUMBER.fullmatch(text):
        return None
    text = text.replace(",", "")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def extract_final_answer(completion):
    """
    The canonical number after the single '####' marker of a completion, or None. Strict on purpose (RL
    rewards exactly what is checked): no marker, several markers, or a marker not followed by a plain
    number on its line all give None.
    """
    if completion.count("####") != 1:
        return None
    tail = completion.split("####", 1)[1]
    return canonical_number(tail.split("\n", 1)[0])


def exact_match_reward(completion, answer):
    """1.0 if the completion's single final answer equals the reference `answer` after canonicalisation, else 0.0."""
    predicted = extract_final_answer(completion)
    return float(predicted is not None and predicted == canonical_number(str(answer)))


class VerifierTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds):
    # SIGALRM interrupts a runaway verifier; signals only reach the main thread, elsewhere we run unguarded.
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise VerifierTimeout(f"verifier took longer than {seconds}s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def safe_reward(task, conversation, completion, timeout=1.0):
    """
    (reward, error) for one completion. A verifier that raises, times out or returns something that is not a
    finite number scores 0.0 with error=True: a broken check must never count as a success. A task whose verifier
    is slow by nature (judge.JudgedTask: an HTTP request) says how long it may take in `verifier_timeout`.
    """
    timeout = getattr(task, "verifier_timeout", timeout)
    try:
        with _time_limit(timeout):
            reward = float(task.reward(conversation, completion))
    except Exception:  # noqa: BLE001 - any verifier failure is a 0, counted by the caller
        return 0.0, True
    if reward != reward or reward in (float("inf"), float("-inf")):
        return 0.0, True
    return reward, False


def completion_reward(task, conversation, text, finish, timeout=1.0):
    """
    (reward, error) of a sampled completion: its decoded `text` and how it ended, `finish` ("stop": it emitted the
    end of its turn; "length": it ran into the token budget). The one rule every stage scores by: an answer that
    did not stop is never a success, whatever its text says, so it scores 0.0 without asking the verifier.
    Otherwise safe_reward. A '#### 7' written just before the budget runs out is not an answer the model gave:
    rewarding it (RL), choosing it (DPO pairs) or counting it (pass@k) would teach and measure not stopping.
    """
    if finish != "stop":
        return 0.0, False
    return safe_reward(task, conversation, text, timeout)


# -----------------------------------------------------------------------------
# The synthetic task family

NAMES = ["Ava", "Ben", "Cleo", "Dev", "Emma", "Finn", "Gia", "Hugo", "Iris", "Jay", "Kai", "Lena", "Milo", "Nora",
         "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Vik", "Wren", "Yara", "Zoe"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "coins", "cards", "stamps",
         "balloons", "crayons", "beads", "plums", "rocks", "ribbons", "candles", "buttons", "tickets", "cupcakes"]
GAIN = ["buys {n} more", "finds {n} more", "gets {n} more from a friend", "wins {n} more", "picks {n} more"]
LOSS = ["gives {n} to a friend", "loses {n}", "sells {n}", "uses {n}", "gives away {n}"]
OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
KINDS = ("add", "sub", "mul", "story")  # the four problem kinds, drawn with equal probability


def _arithmetic(rng, kind):
    if kind == "add":
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        return f"What is {a} + {b}?", [(f"{a}+{b}", a + b)], f"{a} + {b} = {a + b}."
    if kind == "sub":
        a = rng.randint(0, 60)
        b = rng.randint(0, a)
        return f"What is {a} - {b}?", [(f"{a}-{b}", a - b)], f"{a} - {b} = {a - b}."
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    return f"What is {a} * {b}?", [(f"{a}*{b}", a * b)], f"{a} * {b} = {a * b}."


def _story(rng):
    """A two-step word problem: a start amount, then a gain and a loss (or a loss and a gain)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start = rng.randint(10, 60)
    gain, loss = rng.randint(1, 30), rng.randint(1, 9)
    gain_text = rng.choice(GAIN).format(n=gain)
    loss_text = rng.choice(LOSS).format(n=loss)
    question = f"{name} has {start} {item}. {name} {gain_text}, then {loss_text}. How many {item} does {name} have now?"
    middle = start + gain
    steps = [(f"{start}+{gain}", middle), (f"{middle}-{loss}", middle - loss)]
    return question, steps, None


def _split_of(question):
    """'test' for about one question in ten, chosen by a hash of its text (stable across runs and machines)."""
    return "test" if hashlib.sha256(question.encode()).digest()[0] < 26 else "train"


def synthetic_problems(split, seed=0):
    """
    An endless, deterministic stream of problems of one split: dicts with kind, question, steps
    [(expression, value), ...], answer and a plain-text worked solution.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(seed)
    seen = set()
    while True:
        kind = rng.choice(KINDS)
        question, steps, plain = _story(rng) if kind == "story" else _arithmetic(rng, kind)
        if question in seen or _split_of(question) != split:
            continue
        seen.add(question)
        yield {"kind": kind, "question": question, "steps": steps, "answer": steps[-1][1], "plain": plain}


def synthetic_conversation(problem):
    """
    The SFT-style conversation of a problem. Arithmetic questions are answered directly; stories are worked
    step by step with a calculator call per step, whose output the model then copies into its final answer.
    """
    answer = problem["answer"]
    if problem["kind"] != "story":
        parts = [{"type": "text", "text": f"{problem['plain']}\n#### {answer}"}]
    else:
        parts = [{"type": "text", "text": "First, "}]
        for i, (expr, value) in enumerate(problem["steps"]):
            if i > 0:
                parts.append({"type": "text", "text": ". Then, "})
            parts.append({"type": "python", "text": expr})
            parts.append({"type": "python_output", "text": str(value)})
        parts.append({"type": "text", "text": f".\n#### {answer}"})
    return {"messages": [{"role": "user", "content": problem["question"]},
                         {"role": "assistant", "content": parts}],
            "answer": str(answer)}


def _document(rng, problems):
    """One pretraining document: a few worked problems in plain text, or a small table of arithmetic facts."""
    style = rng.random()
    if style < 0.25:
        op, fn = rng.choice(list(OPERATORS.items()))
        a = rng.randint(0, 12)
        lines = [f"{a} {op} {b} = {fn(a, b)}" for b in range(rng.randint(0, 5), 13)]
        return f"Table of {a} {op} n:\n" + "\n".join(lines) + "\n"
    chunks = []
    for _ in range(rng.randint(1, 4)):
        p = next(problems)
        if p["kind"] == "story":
            work = " ".join(f"{expr.replace('+', ' + ').replace('-', ' - ')} = {value}." for expr, value in p["steps"])
        else:
            work = p["plain"]
        chunks.append(f"Question: {p['question']}\nAnswer: {work}\n#### {p['answer']}\n")
    return "\n".join(chunks)


def synthetic_documents(n, seed=0, split="train"):
    """`n` deterministic pretraining documents (str) built from problems of `split` only."""
    rng = random.Random(f"documents-{seed}")
    problems = synthetic_problems(split, seed=seed + 1)
    return [_document(rng, problems) for _ in range(n)]


class SyntheticTask:
    """
    `size` problems of one split as conversations; `task[i]` ends with the reference assistant answer and
    carries "answer". `reward` is the strict exact match of the completion's single '####' answer.
    """

    def __init__(self, split="train", size=1000, seed=0):
        stream = synthetic_problems(split, seed=seed)
        self.problems = [next(stream) for _ in range(size)]

    def __len__(self):
        return len(self.problems)

    def __getitem__(self, i):
        return synthetic_conversation(self.problems[i])

    def reward(self, conversation, completion):
        return exact_match_reward(completion, conversation["answer"])


# -----------------------------------------------------------------------------
# Decontamination: training rows that share text with an evaluation item are dropped before any stage trains.

DECONTAMINATION_N = 13  # the 13-gram rule of GPT-3 (Brown et al. 2020, appendix C) and most reports since
# An evaluation text shorter than this many words ('Define entropy.') is a phrase any document may say in passing:
# it is matched only when a whole training text equals it, never as a run inside one.
DECONTAMINATION_MIN_RUN = 5
_WORD = re.compile(r"[^\W_]+|[-+*/=]")


def normalized_words(text):
    """Lowercased runs of letters and digits; + - * / = are words of their own ('3 + 4' is not '3 * 4'), other
    punctuation and all whitespace are dropped."""
    return _WORD.findall(text.lower())


def row_texts(row):
    """The strings of a training or evaluation row: a document (str), every message of a conversation, both sides
    of a preference pair, or the question of a multiple-choice item."""
    if isinstance(row, str):
        return [row]
    if "chosen" in row:
        return row_texts(row["chosen"]) + row_texts(row["rejected"])
    if "messages" in row:
        return [m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
                for m in row["messages"]]
    return [row["question"]]


class NgramIndex:
    """
    The evaluation sets' n-grams, built once; `contaminated(row)` tells whether a training row overlaps them.
    Rule: a text overlaps when it contains, as a contiguous run of normalized_words, an n-gram of an evaluation text
    of >= n words, or the whole of an evaluation text of DECONTAMINATION_MIN_RUN to n - 1 words ('What is 3 + 4?' is
    found inside 'Q: what is 3+4? Answer briefly.': a short question copied into a prompt is still a copy); an
    evaluation text of fewer words only when a whole training text equals it. Runs are stored as
    64-bit hashes, one set per run length (n, and each length of a short evaluation text): ~8 bytes per evaluation
    n-gram, and the check of a training text is one hash of each of its words plus a vectorised rolling hash per
    length (bench/decontaminate.py: the cost per word of FineWeb-like text). Python's str hash is salted per
    process: an index is used where it is built.
    """

    def __init__(self, eval_texts, n=DECONTAMINATION_N):
        if n < 1:
            raise ValueError(f"decontamination n-gram length must be >= 1, got {n}")
        self.n, self.runs, self.exact = n, {}, set()  # runs: {run length: hashes of the evaluation runs}
        for text in eval_texts:
            words = normalized_words(text)
            if len(words) < min(n, DECONTAMINATION_MIN_RUN):
                self.exact.add(" ".join(words))
            else:
                length = min(len(words), n)
                self.runs.setdefault(length, set()).update(self._hashes(self._word_hashes(words), length))

    @staticmethod
    def _word_hashes(words):
        return np.fromiter(map(hash, words), dtype=np.int64, count=len(words))  # (W,)

    @staticmethod
    def _hashes(h, length):
        powers = np.cumprod(np.full(length, 1_000_003, dtype=np.int64))[::-1]  # (length,) B^length .. B^1, wrapping
        windows = np.lib.stride_tricks.sliding_window_view(h, length)  # (W - length + 1, length)
        return (windows * powers).sum(1).tolist()  # int64 arithmetic wraps: a polynomial hash mod 2^64

    def overlaps(self, text):
        words = normalized_words(text)
        if " ".join(words) in self.exact:
            return True
        h = self._word_hashes(words)
        return any(len(words) >= length and not runs.isdisjoint(self._hashes(h, length))
                   for length, runs in self.runs.items())

    def contaminated(self, row):
        return any(self.overlaps(text) for text in row_texts(row))


def decontaminate(rows, eval_texts, n=DECONTAMINATION_N):
    """(kept rows, number dropped): `rows` without those that overlap `eval_texts` (a list of str or an
    NgramIndex of them) under NgramIndex's rule."""
    index = eval_texts if isinstance(eval_texts, NgramIndex) else NgramIndex(eval_texts, n)
    kept = [row for row in rows if not index.contaminated(row)]
    return kept, len(rows) - len(kept)


def evaluation_texts(preset):
    """
    The question of every held-out item the preset's evaluation uses (eval.py): tiny, the synthetic test split;
    small and full, GSM8K test, ARC-Easy/Challenge and MMLU test. What no training source may contain.
    """
    if preset == "tiny":
        return [p["question"] for p, _ in zip(synthetic_problems("test", seed=0), range(2000))]
    texts = [row["question"] for row in load_rows("openai/gsm8k", "test", "main")]
    for name in MultipleChoice.SOURCES:
        task = MultipleChoice(name, "test")
        texts.extend(task[i]["question"] for i in range(len(task)))
    return texts



def decontamination_index(preset, held_out=()):
    """
    The one decontamination rule every training stage applies (pretraining documents, SFT rows, preference pairs,
    RL prompts): a training text is dropped when it shares a DECONTAMINATION_N-gram of normalised words with the
    preset's evaluation sets (evaluation_texts) or with `held_out`, further texts the stage itself evaluates on
    (rl.py's held-out problems). Returns the NgramIndex to check rows against.
    """
    return NgramIndex(evaluation_texts(preset) + list(held_out))

# -----------------------------------------------------------------------------
# Batching rendered sequences


def pad_sequences(seqs, pad_id):
    """
    (ids (B, T) right-padded with pad_id, lengths (B,)) of token lists, not shifted: what a scalar-head model
    (reward model, critic) reads, its score at position lengths[b] - 1.
    """
    lengths = torch.tensor([len(s) for s in seqs])
    ids = torch.full((len(seqs), int(lengths.max())), pad_id, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s)
    return ids, lengths


def collate(rows, pad_id):
    """
    Right-pad rendered sequences into next-token-prediction tensors. `rows` is a list of (ids, mask) as from
    Tokenizer.render_conversation (mask[i] == 1: token i is a training target). Returns (inputs, targets), both
    LongTensor (B, L - 1) with L the longest row: inputs[b, t] = ids[t] and targets[b, t] = ids[t + 1] where
    mask[t + 1] == 1, else -1 (ignored by the loss, as is all padding). Nothing is ever cropped.
    """
    length = max(len(ids) for ids, _ in rows)
    inputs = torch.full((len(rows), length - 1), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), length - 1), -1, dtype=torch.long)
    for b, (ids, mask) in enumerate(rows):
        if len(ids) != len(mask):
            raise ValueError(f"row {b}: {len(ids)} ids but {len(mask)} mask entries")
        ids_t, mask_t = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)
        inputs[b, :len(ids) - 1] = ids_t[:-1]
        targets[b, :len(ids) - 1] = torch.where(mask_t[1:], ids_t[1:], -1)
    return inputs, targets


def token_budget_batches(row_lengths, max_tokens):
    """
    Group items into micro-batches whose padded size stays within a token budget: rows x longest row <= max_tokens.
    row_lengths[i] lists the lengths of item i's rows, as they will be padded (collate's L - 1 per row): one row for
    a conversation, two for a preference pair, whose sides must share a micro-batch. Items are sorted by their
    longest row and cut greedily, so rows of similar lengths share a micro-batch and padding stays small.
    Returns (batches, padding): batches, lists of item indices (every item exactly once, shortest first), and the
    fraction of the padded positions that are padding. An item that alone exceeds the budget is a ValueError.
    """
    order = sorted(range(len(row_lengths)), key=lambda i: max(row_lengths[i]))
    batches, batch, rows = [], [], 0
    for i in order:
        n_rows, longest = len(row_lengths[i]), max(row_lengths[i])
        if n_rows * longest > max_tokens:
            raise ValueError(f"item {i} has {n_rows} row(s) of up to {longest} tokens, more than the micro-batch "
                             f"budget of {max_tokens} tokens; raise --device-batch-tokens or lower --max-seq-len")
        if batch and (rows + n_rows) * longest > max_tokens:  # sorted: the new item's rows are the longest so far
            batches.append(batch)
            batch, rows = [], 0
        batch.append(i)
        rows += n_rows
    if batch:
        batches.append(batch)
    padded = sum(sum(len(row_lengths[i]) for i in b) * max(max(row_lengths[i]) for i in b) for b in batches)
    real = sum(sum(lengths) for lengths in row_lengths)
    return batches, (1 - real / padded if padded else 0.0)


# -----------------------------------------------------------------------------
# Pretraining text by preset


def pretraining_texts(preset, split, max_chars=None):
    """
    Text documents for tokenizer training and pretraining: the synthetic corpus for `tiny`, FineWeb-Edu for `small`
    and `full`.
    Stops once `max_chars` characters have been yielded (None: the whole split, as fineweb_texts returns it).
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if preset == "tiny":  # the synthetic 'val' documents are built from the held-out 'test' problems
        texts = synthetic_documents(20_000 if split == "train" else 1_000, seed=0,
                                    split="train" if split == "train" else "test")
    elif preset in ("small", "full"):
        texts = fineweb_texts(split)
    else:
        raise ValueError(f"unknown preset {preset!r}; expected 'tiny', 'small' or 'full'")
    return texts if max_chars is None else first_chars(texts, max_chars)


def first_chars(texts, max_chars):
    """The documents of `texts` up to and including the one that brings the total to `max_chars` characters."""
    total = 0
    for text in texts:
        yield text
        total += len(text)
        if total >= max_chars:
            return


# -----------------------------------------------------------------------------
# Hub datasets. Each loader takes `local`: a path (or list of paths) to .parquet / .jsonl / .json files with the
# hub dataset's schema. Given, the rows come from there through the same `datasets` code path; otherwise they are
# downloaded from the Hugging Face hub. Tests and offline machines use `local`. A whole run is pointed at
# pre-downloaded (or stand-in) files with $NANOPOST_DATA_DIR (`python tasks.py prepare` fills it; see local_files for
# the layouts it accepts). Once it is set, every loader reads from it and a missing file is an error: a run never
# falls back to a download silently.

FINEWEB_REPO, FINEWEB_CONFIG = "HuggingFaceFW/fineweb-edu", "sample-10BT"
FINEWEB_VAL_DOCS = 10_000  # the first documents of the corpus are the fixed validation set; training skips them
# The files of a config whose folder in the hub repo is not named after it (repo, config) -> (folder, glob).
HUB_FOLDERS = {(FINEWEB_REPO, FINEWEB_CONFIG): ("sample/10BT", "*.parquet")}
# The hub's files of sample-10BT, in order (~0.7B tokens each): the full preset reads ~8.4B tokens, all 14 of them.
FINEWEB_FILES = [f"{i:03d}_00000.parquet" for i in range(14)]
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


def local_files(repo, split, config=None, root=None):
    """
    The local files of repo/config/split under `root` (default $NANOPOST_DATA_DIR), in either of two layouts:

        hub snapshot (what `python tasks.py prepare` and huggingface_hub.snapshot_download leave):
            <root>/<repo>/**/<split>-*.parquet, in a folder named after the config when one is given
            (e.g. openai/gsm8k/main/train-00000-of-00001.parquet), or HUB_FOLDERS' folder for configs stored
            elsewhere (FineWeb-Edu sample-10BT: <root>/HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet)
        flat: <root>/<repo>/<config or "default">/<split>.jsonl (or .parquet)

    Raises FileNotFoundError naming the folder when there is none.
    """
    root = Path(root or os.environ["NANOPOST_DATA_DIR"])
    base = root / repo
    if (repo, config) in HUB_FOLDERS:
        folder, pattern = HUB_FOLDERS[repo, config]
        files = sorted((base / folder).glob(pattern))
    else:
        files = sorted(p for p in base.rglob("*") if p.suffix in DATA_SUFFIXES
                       and (p.stem == split or p.name.startswith(f"{split}-"))
                       and (config is None or config in p.relative_to(base).parts[:-1]))
    if not files:
        raise FileNotFoundError(f"no files of {repo} ({config or 'default'}, split {split!r}) under {base} "
                                f"($NANOPOST_DATA_DIR={root}): run `python tasks.py prepare`, or unset "
                                "NANOPOST_DATA_DIR to download from the hub")
    return files


def load_rows(repo, split, config=None, local=None, streaming=False, size=None):
    """
    Rows (dicts) of a hub dataset split, or of local files of the same schema; the first `size` rows if given.
    Local files are read with pyarrow and json alone (LocalRows): `datasets` is imported only to read the hub.
    """
    if local is None and os.environ.get("NANOPOST_DATA_DIR"):
        local = local_files(repo, split, config)
    if local is not None:
        files = [local] if isinstance(local, (str, bytes, Path)) else list(local)
        return LocalRows([Path(f) for f in files], size)
    from datasets import load_dataset  # heavy import, only where the hub is read

    rows = load_dataset(repo, config, split=split, streaming=streaming)
    if size is None:
        return rows
    return rows.take(size) if streaming else rows.select(range(min(size, len(rows))))


class LocalRows:
    """
    The rows of local .parquet / .jsonl / .json files in order, as a sequence of dicts (the first `size` if given).
    Parquet stays an Arrow table, converted one row at a time: a 460k-conversation split costs no Python objects.
    """

    def __init__(self, files, size=None):
        import pyarrow as pa
        import pyarrow.parquet as pq  # pyarrow only where local files are read

        tables = []
        for path in files:
            if path.suffix == ".parquet":
                tables.append(pq.read_table(path))
            elif path.suffix == ".jsonl":
                with open(path, encoding="utf-8") as f:
                    tables.append([json.loads(line) for line in f if line.strip()])
            elif path.suffix == ".json":
                tables.append(json.loads(path.read_text(encoding="utf-8")))
            else:
                raise ValueError(f"{path}: expected a .parquet, .jsonl or .json file")
        if all(isinstance(t, list) for t in tables):
            self.rows, self.table = [row for t in tables for row in t], None
        else:  # the shards of one split share their schema
            self.rows = None
            self.table = pa.concat_tables([pa.Table.from_pylist(t) if isinstance(t, list) else t for t in tables])
        self.length = len(self.rows) if self.rows is not None else self.table.num_rows
        if size is not None:
            self.length = min(size, self.length)

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if not -self.length <= i < self.length:
            raise IndexError(f"row {i} of {self.length}")
        i %= self.length
        return self.rows[i] if self.rows is not None else self.table.slice(i, 1).to_pylist()[0]

    def __iter__(self):
        return (self[i] for i in range(self.length))


class ParquetDocuments:
    """
    The `text` column of parquet files as one numbered sequence of documents (row r of the files in order is document
    r), restricted to the documents [first, last). Read row group by row group, so that under DDP each rank reads only
    its own row groups (row group g belongs to rank g % world_size) and a resumed run seeks to its position through
    the files' metadata instead of reading everything before it.
    """

    def __init__(self, files, first=0, last=None):
        import pyarrow.parquet as pq  # only where parquet files are read

        self.files = [pq.ParquetFile(f) for f in files]
        self.first, self.last = first, last
        self.row_groups = []  # (file, row group, number of its first document, number of rows)
        start = 0
        for parquet in self.files:
            for g in range(parquet.num_row_groups):
                rows = parquet.metadata.row_group(g).num_rows
                self.row_groups.append((parquet, g, start, rows))
                start += rows

    def shard(self, rank=0, world_size=1, start=0):
        """(document number, text) of this rank's row groups, from document max(start, first) up to last."""
        start = max(start, self.first)
        for index, (parquet, g, first_doc, rows) in enumerate(self.row_groups):
            if self.last is not None and first_doc >= self.last:
                return
            if index % world_size != rank or first_doc + rows <= start:
                continue  # another rank's row group, or one already trained on: never read
            texts = parquet.read_row_group(g, columns=["text"]).column("text").to_pylist()
            for i, text in enumerate(texts, start=first_doc):
                if i >= start and (self.last is None or i < self.last):
                    yield i, text

    def __iter__(self):
        return (text for _, text in self.shard())


def fineweb_texts(split, local=None):
    """
    FineWeb-Edu `text` documents: 'val' is the first FINEWEB_VAL_DOCS documents, 'train' the rest. From local parquet
    files (`local`, else $NANOPOST_DATA_DIR) as a ParquetDocuments that DDP ranks read disjointly; with neither, streamed
    from the hub (every reader sees the whole stream: fine for the tokenizer, wasteful for pretraining, which
    therefore asks for `python tasks.py prepare` first).
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if local is None and os.environ.get("NANOPOST_DATA_DIR"):
        local = local_files(FINEWEB_REPO, "train", FINEWEB_CONFIG)
    if local is not None:
        files = [local] if isinstance(local, (str, Path)) else list(local)
        return ParquetDocuments(files, *((0, FINEWEB_VAL_DOCS) if split == "val" else (FINEWEB_VAL_DOCS, None)))
    return streamed_fineweb_texts(split)


def streamed_fineweb_texts(split):
    """FineWeb-Edu documents streamed from the hub (nothing is fetched until the first one is asked for)."""
    rows = load_rows(FINEWEB_REPO, "train", FINEWEB_CONFIG, streaming=True)
    rows = rows.take(FINEWEB_VAL_DOCS) if split == "val" else rows.skip(FINEWEB_VAL_DOCS)
    for row in rows:
        yield row["text"]


GSM8K_CALL = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


def gsm8k_conversation(question, answer):
    """
    A GSM8K row as a conversation. Each calculator annotation <<48/2=24>> becomes a real tool call: a python
    part "48/2" (trained) and its python_output "24" (not trained: at sampling time the engine forces it).
    The final "#### 72" line stays as text; "answer" holds the reference number for the verifier.
    """
    parts = []
    position = 0
    for match in GSM8K_CALL.finditer(answer):
        if match.start() > position:
            parts.append({"type": "text", "text": answer[position:match.start()]})
        parts.append({"type": "python", "text": match.group(1)})
        parts.append({"type": "python_output", "text": match.group(2)})
        position = match.end()
    parts.append({"type": "text", "text": answer[position:]})
    final = answer.rsplit("####", 1)[-1].strip() if "####" in answer else None
    if final is None or canonical_number(final) is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' final line: {answer[-60:]!r}")
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": parts}],
            "answer": final}


class GSM8K:
    """Grade-school math word problems (openai/gsm8k, config 'main'), verified by strict exact match."""

    def __init__(self, split="train", local=None, size=None):
        self.rows = load_rows("openai/gsm8k", split, "main", local=local, size=size)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        return gsm8k_conversation(row["question"], row["answer"])

    def reward(self, conversation, completion):
        return exact_match_reward(completion, conversation["answer"])


class SmolTalk:
    """General chat conversations (HuggingFaceTB/smol-smoltalk, `messages` column) for SFT; no verifier."""

    def __init__(self, split="train", local=None, size=None):
        self.rows = load_rows("HuggingFaceTB/smol-smoltalk", split, local=local, size=size)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"messages": self.rows[i]["messages"]}


def preference_pair(chosen, rejected):
    """
    {"chosen": conversation, "rejected": conversation} from two message lists that must share every message but
    the final assistant answer (the prompt), as in UltraFeedback-binarized. Raises ValueError otherwise.
    """
    if not chosen or not rejected or chosen[-1].get("role") != "assistant" or rejected[-1].get("role") != "assistant":
        raise ValueError("chosen and rejected must both end with an assistant message")
    if chosen[:-1] != rejected[:-1]:
        raise ValueError("chosen and rejected must share the same prompt messages")
    if chosen[-1]["content"] == rejected[-1]["content"]:
        raise ValueError("chosen and rejected answers are identical: nothing to prefer")
    return {"chosen": {"messages": list(chosen)}, "rejected": {"messages": list(rejected)}}


class UltraFeedback:
    """Preference pairs (HuggingFaceH4/ultrafeedback_binarized, `chosen`/`rejected` message lists) for DPO."""

    def __init__(self, split="train_prefs", local=None, size=None):
        self.rows = load_rows("HuggingFaceH4/ultrafeedback_binarized", split, local=local, size=size)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return preference_pair(self.rows[i]["chosen"], self.rows[i]["rejected"])


class UltraFeedbackPrompts:
    """
    The prompts of UltraFeedback-binarized, for RL from a reward model (rl.py --reward rm --task ultrafeedback).
    task[i] is the chosen conversation (render_for_completion drops its final answer). There is no verifier:
    reward() is 0, so pass@1 means nothing here and the reward model's score is the only measure.
    """

    def __init__(self, split="train_prefs", local=None, size=None):
        self.pairs = UltraFeedback(split, local=local, size=size)

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]["chosen"]

    def reward(self, conversation, completion):
        return 0.0


LETTERS = "ABCDEFGHIJ"


class MultipleChoice:
    """
    ARC-Easy, ARC-Challenge (allenai/ai2_arc) and MMLU (cais/mmlu, config 'all') as items
    {"question", "choices": [str], "answer": index of the right choice, "subject"}.
    """

    SOURCES = {"arc-easy": ("allenai/ai2_arc", "ARC-Easy"), "arc-challenge": ("allenai/ai2_arc", "ARC-Challenge"),
               "mmlu": ("cais/mmlu", "all")}

    def __init__(self, name, split="test", local=None, size=None, seed=0):
        """`size` items are drawn from the whole split with random.Random(seed) (kept in the split's order): the
        split is sorted by subject, so its first rows would cover a few subjects only."""
        if name not in self.SOURCES:
            raise ValueError(f"unknown multiple-choice task {name!r}; expected one of {sorted(self.SOURCES)}")
        repo, config = self.SOURCES[name]
        self.name, self.rows = name, load_rows(repo, split, config, local=local)
        self.index = list(range(len(self.rows)))
        if size is not None and size < len(self.index):
            self.index = sorted(random.Random(seed).sample(self.index, size))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        row = self.rows[self.index[i]]
        if self.name == "mmlu":
            return {"question": row["question"], "choices": list(row["choices"]), "answer": int(row["answer"]),
                    "subject": row["subject"]}
        labels = list(row["choices"]["label"])
        return {"question": row["question"], "choices": list(row["choices"]["text"]),
                "answer": labels.index(row["answerKey"]), "subject": self.name}



# The task registry: name -> (kind, factory(split, size, seed)), read by every --task, --rft-task and eval list and by
# rl.py's mixtures. kind "generative": conversations with a verifier (SFT rejection sampling, RL, DPO/RM
# self-generated pairs, eval pass@k / maj@k); "multiple-choice": eval accuracy (ARC, MMLU); "prompts": prompts without
# a verifier, for RL from a reward model. size None: all (synthetic: 1000); seed picks the synthetic family's problems
# and the multiple-choice subset. Adding a task is one entry:
# TASKS["name"] = ("generative", lambda split, size, seed: MyTask(split, size)).
TASKS = {
    "synthetic": ("generative", lambda split, size, seed: SyntheticTask(split, size=size or 1000, seed=seed)),
    "gsm8k": ("generative", lambda split, size, seed: GSM8K(split, size=size)),
    "ultrafeedback": ("prompts", lambda split, size, seed: UltraFeedbackPrompts(
        "train_prefs" if split == "train" else "test_prefs", size=size)),  # its splits: train_prefs / test_prefs
    **{name: ("multiple-choice", lambda split, size, seed, name=name: MultipleChoice(name, split, size=size,
                                                                                     seed=seed))
       for name in MultipleChoice.SOURCES},
}


def registered_tasks(*kinds):
    """The registered task names of the given kinds (tasks.TASKS), in registration order."""
    return [name for name, (kind, _) in TASKS.items() if kind in kinds]


def task_by_name(name, split, size=None, seed=0):
    """`size` problems of `split` (None: all) of the task registered as `name` in TASKS."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASKS)} (tasks.TASKS)")
    _, factory = TASKS[name]
    return factory(split, size, seed)

# -----------------------------------------------------------------------------
# Chat stages: synthetic preference pairs and task mixtures (sft.py, dpo.py)


def _nearby_wrong(value, rng):
    """A plausible wrong number near `value`: an off-by-a-little slip, never `value` itself."""
    return value + rng.choice([-10, -2, -1, 1, 2, 10])


def mistaken_answer(problem, rng):
    """
    The assistant content of a wrong answer to a synthetic problem, with one mistake of a kind a small model
    makes: a slipped result copied into the final line, a wrong calculator call (story problems; its output
    is the calculator's true result, so only the call is wrong), or no '#### <answer>' line at all. The
    verifier scores every one of them 0.
    """
    mistake = rng.choice(["slip", "format"] if problem["kind"] != "story" else ["slip", "call", "format"])
    if mistake == "format":
        return [{"type": "text", "text": f"The answer is {problem['answer']}."}]
    wrong = _nearby_wrong(problem["answer"], rng)
    if problem["kind"] != "story":
        worked = problem["plain"].rsplit("=", 1)[0]  # "12 + 30 " of "12 + 30 = 42."
        mistaken = {**problem, "plain": f"{worked}= {wrong}.", "answer": wrong}
    elif mistake == "slip":
        mistaken = {**problem, "answer": wrong}
    else:  # flip the operator of the second step: adds what was lost (or the reverse)
        expr, _ = problem["steps"][1]
        left, op, right = next(expr.partition(o) for o in "+-" if o in expr)
        flipped = "-" if op == "+" else "+"
        value = OPERATORS[flipped](int(left), int(right))
        mistaken = {**problem, "steps": [problem["steps"][0], (f"{left}{flipped}{right}", value)], "answer": value}
    return synthetic_conversation(mistaken)["messages"][-1]["content"]


class SyntheticPreferences:
    """
    `size` preference pairs over the problems of SyntheticTask(split, size, seed): chosen is the reference
    answer, rejected the same prompt answered with one mistake (mistaken_answer). pairs[i] is
    {"chosen": conversation, "rejected": conversation, "answer": reference}; the mistake is drawn from a seed
    of its own, so a pair is the same whatever order it is read in.
    """

    def __init__(self, split="train", size=1000, seed=0):
        self.task = SyntheticTask(split, size, seed)
        self.seed = seed

    def __len__(self):
        return len(self.task)

    def __getitem__(self, i):
        chosen = self.task[i]
        rng = random.Random(f"mistake-{self.seed}-{i}")
        mistaken = {"role": "assistant", "content": mistaken_answer(self.task.problems[i], rng)}
        rejected = chosen["messages"][:-1] + [mistaken]
        return {**preference_pair(chosen["messages"], rejected), "answer": chosen["answer"]}


class SyntheticCalculatorArithmetic:
    """
    The arithmetic problems (add, sub, mul) of SyntheticTask(split, size, seed) answered with a calculator call
    instead of from memory: "<|python_start|>12+30<|python_end|><|output_start|>42<|output_end|>.\n#### 42".
    A few of these in the SFT mixture teach the model that the tool exists for bare arithmetic too; the SFT
    model then uses it on a minority of samples, the ones that are right, which leaves DPO and RL something to
    discover. len() counts the arithmetic problems only.
    """

    def __init__(self, split="train", size=1000, seed=0):
        self.problems = [p for p in SyntheticTask(split, size, seed).problems if p["kind"] != "story"]

    def __len__(self):
        return len(self.problems)

    def __getitem__(self, i):
        problem = self.problems[i]
        (expr, value), = problem["steps"]
        parts = [{"type": "python", "text": expr}, {"type": "python_output", "text": str(value)},
                 {"type": "text", "text": f".\n#### {value}"}]
        return {"messages": [{"role": "user", "content": problem["question"]}, {"role": "assistant", "content": parts}],
                "answer": str(value)}


class RowTooLong(ValueError):
    """A well-formed row longer than the stage's context: skipped, and counted apart from malformed rows."""


class TaskMixture:
    """
    One stage's training (or held-out) data, declared in one place: `sources` is a list of (name, task, count),
    `count` rows of `task` (None: all of them; more than len(task) repeats it, epoch after epoch), interleaved
    in a seeded random order. mixture[k] -> (name, row). Rows are read lazily, so a malformed row raises
    only when it is read; prepare_rows reads, renders and counts.
    """

    def __init__(self, sources, seed=0):
        self.sources = []
        self.index = []  # (source number, row number) of each mixture position
        for s, (name, task, count) in enumerate(sources):
            count = len(task) if count is None else count
            if count > 0 and len(task) == 0:
                raise ValueError(f"mixture source {name!r} is empty but {count} rows were asked of it")
            self.sources.append((name, task, count))
            self.index.extend((s, i % len(task)) for i in range(count))
        random.Random(seed).shuffle(self.index)

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        s, i = self.index[k]
        name, task, _ = self.sources[s]
        return name, task[i]

    def source(self, k):
        """Name of the source that position k comes from (known without reading the row)."""
        return self.sources[self.index[k][0]][0]

    def summary(self):
        """One line per source: how many rows it contributes, out of how many it has."""
        lines = [f"  {name:<24s} {count:>9,d} rows (of {len(task):,})" for name, task, count in self.sources]
        return "\n".join(lines + [f"  {'total':<24s} {len(self):>9,d} rows"])


class PromptMixture:
    """
    The RL stages' prompts of one or more tasks as one task (TaskMixture is the chat stages' rows): mixture[k] is a
    conversation with "source" (the task's name) and "task_id" ('name/row', the recurring id PTGS keys on); reward()
    asks that source's verifier. Weights are shares of the prompts: source s keeps the first floor(share_s * N) of
    its rows with N the largest total for which no source repeats a row (so a step still never holds one prompt
    twice). One source keeps every row in its own order: position k is row k, as with the task itself.
    """

    def __init__(self, sources):
        self.tasks = {name: task for name, task, _ in sources}
        total = sum(weight for _, _, weight in sources)
        size = min(len(task) * total / weight for _, task, weight in sources)
        self.rows = [(name, i) for name, task, weight in sources
                     for i in range(len(task) if len(sources) == 1 else int(size * weight / total))]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, k):
        name, i = self.rows[k]
        return {**self.tasks[name][i], "source": name, "task_id": f"{name}/{i}"}

    def reward(self, conversation, completion):
        return self.tasks[conversation["source"]].reward(conversation, completion)

    @property
    def verifier_timeout(self):
        """How long tasks.safe_reward lets a verifier run: its slowest source's (a judged one: the judge's budget)."""
        return max(getattr(task, "verifier_timeout", 1.0) for task in self.tasks.values())

    def keep(self, positions):
        """The mixture restricted to `positions` (after decontamination or the difficulty filter)."""
        kept = PromptMixture.__new__(PromptMixture)
        kept.tasks, kept.rows = self.tasks, [self.rows[k] for k in positions]
        return kept

    def counts(self):
        """{source name: prompts}."""
        return {name: sum(source == name for source, _ in self.rows) for name in self.tasks}


def prepare_rows(mixture, render, positions, index=None):
    """
    render(row) for mixture[k], k in `positions` (e.g. one DDP rank's share). A row that fails to load or to
    render is skipped and counted, never trained on: RowTooLong as "too long", ValueError / KeyError / TypeError
    (a missing column, a bad role, no final answer...) as "malformed"; with an NgramIndex `index`, a row that
    overlaps an evaluation set as "contaminated".
    Returns (rendered rows, Counter {(source name, reason): count}).
    """
    rendered, skipped = [], Counter()
    for k in positions:
        name = mixture.source(k)
        try:
            row = mixture[k][1]
            if index is not None and index.contaminated(row):
                skipped[name, "contaminated"] += 1
                continue
            rendered.append(render(row))
        except RowTooLong:
            skipped[name, "too long"] += 1
        except (ValueError, KeyError, TypeError):
            skipped[name, "malformed"] += 1
    return rendered, skipped


def render_pair(tokenizer, pair, max_seq_len):
    """
    A {"chosen", "rejected"} pair of conversations as ((chosen_ids, chosen_mask), (rejected_ids, rejected_mask)).
    Both must render the same prompt (every token before the last <|assistant_start|>); the masks keep the
    renderer's 1s of the final answer only, so earlier assistant turns (part of the prompt) are not scored.
    Raises ValueError for different prompts, RowTooLong when a side exceeds max_seq_len tokens.
    """
    prompt = tokenizer.render_for_completion(pair["chosen"])
    if tokenizer.render_for_completion(pair["rejected"]) != prompt:
        raise ValueError("chosen and rejected render different prompts")
    sides = []
    for side in ("chosen", "rejected"):
        ids, mask = tokenizer.render_conversation(pair[side])
        if len(ids) > max_seq_len:
            raise RowTooLong(f"{side} answer makes {len(ids)} tokens, more than --max-seq-len {max_seq_len}")
        sides.append((ids, [0] * len(prompt) + mask[len(prompt):]))
    return tuple(sides)


def preference_mixture(source, split, size, seed):
    """The preference data of a static --pairs source, in one place: UltraFeedback-binarized or the synthetic pairs."""
    if source == "ultrafeedback":
        return TaskMixture([("ultrafeedback", UltraFeedback("train_prefs" if split == "train" else "test_prefs",
                                                            size=size), None)], seed=seed)
    return TaskMixture([("synthetic", SyntheticPreferences(split, size or 1000, seed), None)], seed=seed)


# -----------------------------------------------------------------------------
# Packing pretraining text into (B, T) rows


def pretraining_batches(tokenizer, texts, batch_size, seq_len, rank=0, world_size=1, start=(0, 0), encode_batch=256,
                        keep=None):
    """
    Yield (inputs, targets, position) batches of the documents in `texts` (an iterable of str), packed greedily:
    each document is tokenized with <|bos|> prepended and the documents are concatenated into one stream, cut into
    rows of seq_len + 1 tokens (a document may span rows and batches: this is pretraining). inputs = row[:-1],
    targets = row[1:], both LongTensor (batch_size, seq_len). The tail that does not fill a batch is dropped.

    DDP: document i belongs to rank i % world_size, so ranks never see the same text; a ParquetDocuments `texts`
    shards by row group instead, so that each rank reads only its own part of the files. `position` = (document
    index, token offset) where the next batch of this rank begins; passing it back as `start` continues the stream
    exactly where it left off (documents before it are skipped without being tokenized, row groups before it without
    being read).
    keep(text) -> bool, optional: documents it rejects are skipped (decontamination); each rank checks only its own
    documents, and document indices, hence resume positions, stay those of `texts`.
    """
    row_tokens = batch_size * (seq_len + 1)
    first_doc, offset = start
    if isinstance(texts, ParquetDocuments):
        mine = texts.shard(rank, world_size, first_doc)
    else:
        mine = ((i, text) for i, text in enumerate(texts) if i >= first_doc and i % world_size == rank)
    if keep is not None:
        mine = ((i, text) for i, text in mine if keep(text))
    queue = deque()  # (document index, token ids) not yet packed; packing resumes at `offset` of queue[0]
    queued = -offset  # tokens in the queue from `offset` on (the first document queued is the one `start` names)
    next_doc = first_doc  # index just past the last document queued: where to resume if the queue runs dry
    while True:
        while queued < row_tokens:
            chunk = list(islice(mine, encode_batch))
            if not chunk:
                return
            for (i, _), ids in zip(chunk, tokenizer.encode([text for _, text in chunk], prepend="<|bos|>")):
                queue.append((i, ids))
                queued += len(ids)
            next_doc = chunk[-1][0] + 1
        row = []
        while len(row) < row_tokens:
            _, ids = queue[0]
            take = ids[offset:offset + row_tokens - len(row)]
            row.extend(take)
            offset += len(take)
            if offset == len(ids):
                queue.popleft()
                offset = 0
        queued -= row_tokens
        rows = torch.tensor(row, dtype=torch.long).view(batch_size, seq_len + 1)
        position = (queue[0][0], offset) if queue else (next_doc, 0)
        yield rows[:, :-1], rows[:, 1:], position


# -----------------------------------------------------------------------------
# Stand-in hub data: small local files with each hub dataset's schema, laid out for $NANOPOST_DATA_DIR. They let
# the full preset's data pipelines run end to end offline (speedrun.sh --dry-run) and in tests.


def write_stand_in_data(root, seed=0, documents=12_000, rows=512, row_group_size=1000):
    """
    Write stand-in files of every hub dataset the GPU presets read under `root`; returns `root`. FineWeb-Edu comes as
    the hub's FINEWEB_FILES (the documents shared among them), in row groups of at most `row_group_size` documents.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    root = Path(root)

    def write_jsonl(repo, config, split, records):
        folder = root / repo / config
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    # FineWeb-Edu: random-word text, varied enough for a 65,536-token BPE; more than FINEWEB_VAL_DOCS documents.
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(60_000)]
    texts = [" ".join(rng.choices(words, k=rng.randint(20, 200))) + "." for _ in range(documents)]
    folder = root / FINEWEB_REPO / HUB_FOLDERS[FINEWEB_REPO, FINEWEB_CONFIG][0]  # the hub's own layout
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(FINEWEB_FILES):
        part = texts[i * documents // len(FINEWEB_FILES):(i + 1) * documents // len(FINEWEB_FILES)]
        pq.write_table(pa.table({"text": part}), folder / name, row_group_size=row_group_size)

    for split in ("train", "test"):
        problems = [p for p, _ in zip(synthetic_problems(split, seed), range(rows))]
        gsm8k = [{"question": p["question"],
                  "answer": "".join(f"{e} = <<{e}={v}>>{v}.\n" for e, v in p["steps"]) + f"#### {p['answer']}"}
                 for p in problems]
        write_jsonl("openai/gsm8k", "main", split, gsm8k)
        chats = [{"messages": [{"role": "user", "content": p["question"]},
                               {"role": "assistant", "content": f"It is {p['answer']}."}]} for p in problems]
        write_jsonl("HuggingFaceTB/smol-smoltalk", "default", split, chats)
        prefs = [{"prompt": p["question"], "chosen": c["messages"],
                  "rejected": c["messages"][:1] + [{"role": "assistant", "content": f"It is {p['answer'] + 1}."}]}
                 for p, c in zip(problems, chats)]
        write_jsonl("HuggingFaceH4/ultrafeedback_binarized", "default", f"{split}_prefs", prefs)
    questions = [(p["question"], p["answer"]) for p, _ in zip(synthetic_problems("test", seed + 1), range(rows))]
    choices = [[str(a), str(a + 1), str(a - 1), str(a + 10)] for _, a in questions]
    arc = [{"id": str(i), "question": q, "choices": {"text": c, "label": list("ABCD")}, "answerKey": "A"}
           for i, ((q, _), c) in enumerate(zip(questions, choices))]
    mmlu = [{"question": q, "subject": "elementary_mathematics", "choices": c, "answer": 0}
            for (q, _), c in zip(questions, choices)]
    for split in ("train", "validation", "test"):
        write_jsonl("allenai/ai2_arc", "ARC-Easy", split, arc)
        write_jsonl("allenai/ai2_arc", "ARC-Challenge", split, arc)
    for split in ("dev", "validation", "test"):
        write_jsonl("cais/mmlu", "all", split, mmlu)
    core.write_stand_in_bundle(root, seed)
    return root


# -----------------------------------------------------------------------------
# Data preparation: `python tasks.py prepare` downloads every hub file the full preset reads, once, into
# $NANOPOST_HOME/data in the hub's own layout (resumable: finished files are skipped). Runs then read them through
# $NANOPOST_DATA_DIR, each rank its own row groups, and a resumed run seeks instead of downloading again.

HUB_DOWNLOADS = {  # repo -> the files of it the full preset reads
    FINEWEB_REPO: ["sample/10BT/*.parquet"],  # ~10B tokens, ~27 GB
    "openai/gsm8k": ["main/*"],
    "HuggingFaceTB/smol-smoltalk": ["data/*"],
    "HuggingFaceH4/ultrafeedback_binarized": ["data/train_prefs-*", "data/test_prefs-*"],
    "allenai/ai2_arc": ["ARC-Easy/*", "ARC-Challenge/*"],
    "cais/mmlu": ["all/*"],
}


# What the GPU presets read of each download, (repo, config, split): prepare checks these offline.
PREPARED_SPLITS = [(FINEWEB_REPO, FINEWEB_CONFIG, "train"), ("openai/gsm8k", "main", "train"),
                   ("openai/gsm8k", "main", "test"), ("HuggingFaceTB/smol-smoltalk", None, "train"),
                   ("HuggingFaceTB/smol-smoltalk", None, "test"),
                   ("HuggingFaceH4/ultrafeedback_binarized", None, "train_prefs"),
                   ("HuggingFaceH4/ultrafeedback_binarized", None, "test_prefs"),
                   ("allenai/ai2_arc", "ARC-Easy", "test"), ("allenai/ai2_arc", "ARC-Challenge", "test"),
                   ("cais/mmlu", "all", "test")]


def _row_count(path):
    """Rows of a data file, from parquet metadata or by counting JSON lines (no `datasets`, no network)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    return len(json.loads(path.read_text()))


def missing_data(dest, fineweb_shards=None):
    """
    What `dest` lacks of PREPARED_SPLITS, offline: a list of "repo (config, split): why" (empty when complete).
    A split needs a file that local_files finds, with at least one row; FineWeb-Edu needs the first `fineweb_shards`
    of FINEWEB_FILES (None: all of them, what the full preset reads), each by name. A file that does not read (cut
    short, damaged) is missing too.
    """
    missing = []
    for repo, config, split in PREPARED_SPLITS:
        name = f"{repo} ({config or 'default'}, {split})"
        try:
            files = local_files(repo, split, config, root=dest)
            rows = sum(_row_count(f) for f in files)
        except FileNotFoundError:
            missing.append(f"{name}: no files")
            continue
        except Exception as e:  # pyarrow and json have many ways to say a file is damaged
            missing.append(f"{name}: unreadable ({type(e).__name__})")
            continue
        if rows == 0:
            missing.append(f"{name}: no rows")
        elif repo == FINEWEB_REPO:
            needed = FINEWEB_FILES[:fineweb_shards]
            absent = [f for f in needed if f not in {path.name for path in files}]
            if absent:
                missing.append(f"{name}: {len(needed) - len(absent)} of {len(needed)} files (missing "
                               f"{', '.join(absent) if len(absent) <= 3 else f'{absent[0]} ... {absent[-1]}'})")
    return missing


def prepare(dest, fineweb_shards=None):
    """
    Make `dest` hold what the GPU presets read. When it already does (missing_data finds nothing) it is kept as it
    is, without contacting the hub: compute nodes often have no internet. Otherwise HUB_DOWNLOADS are downloaded
    (the first `fineweb_shards` FineWeb-Edu files only, if given); with HF_HUB_OFFLINE=1 or the hub unreachable,
    a UserError names what is missing and how to bring it.
    """
    from common import UserError

    missing = missing_data(dest, fineweb_shards) + core.bundle_missing(dest)
    if not missing:
        print(f"prepare: {dest} already holds every split the presets read (checked offline); nothing to download")
        return
    shards = f" --fineweb-shards {fineweb_shards}" if fineweb_shards else ""
    where = (f"{dest} lacks {len(missing)} of what the presets read ({'; '.join(missing)}); run "
             f"`python tasks.py prepare --dest DIR{shards}` on a machine with internet and copy DIR to {dest}")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no"):
        raise UserError(f"HF_HUB_OFFLINE is set and {where}")
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:  # one quick probe: huggingface_hub itself retries a dead connection for minutes, then shows a traceback
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=10).close()
    except OSError as e:
        raise UserError(f"cannot reach the Hugging Face hub at {endpoint.hostname} ({e}) and {where}") from None
    from huggingface_hub import list_repo_files, snapshot_download  # installed with `datasets`

    for repo, patterns in HUB_DOWNLOADS.items():
        if repo == FINEWEB_REPO and fineweb_shards is not None:
            names = sorted(f for f in list_repo_files(repo, repo_type="dataset") if fnmatch(f, patterns[0]))
            patterns = names[:fineweb_shards]
        print(f"prepare: {repo} {patterns} -> {Path(dest) / repo}", flush=True)
        snapshot_download(repo, repo_type="dataset", allow_patterns=patterns, local_dir=Path(dest) / repo)
    if core.bundle_missing(dest):  # CORE's eval bundle (nanochat's download), unzipped to dest/eval_bundle
        core.download_bundle(dest)
    print(f"prepare: done. Runs read these files when NANOPOST_DATA_DIR={dest} (speedrun.sh sets it).")


if __name__ == "__main__":
    import argparse

    from common import check_numbers, get_base_dir, run_cli

    parser = argparse.ArgumentParser(description="Download the GPU presets' hub data once (resumable); data already "
                                     "in --dest is checked offline and kept (HF_HUB_OFFLINE=1: never download).")
    parser.add_argument("command", choices=["prepare"], help="prepare: check --dest, download what it lacks")
    parser.add_argument("--dest", default=None, help="target folder (default: $NANOPOST_HOME/data)")
    parser.add_argument("--fineweb-shards", type=int, default=None, help="download only the first N FineWeb-Edu "
                        "sample-10BT files (default: all, ~27 GB; the full preset reads ~8.4B tokens of ~10B)")
    args = parser.parse_args()

    def main():
        check_numbers(args, positive=["fineweb_shards"])
        prepare(args.dest or get_base_dir() / "data", args.fineweb_shards)

    run_cli(main)

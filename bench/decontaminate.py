"""
What decontamination costs (tasks.NgramIndex): building the evaluation n-gram index once, then checking training
text per word. Random-word stand-in text (speed does not depend on the words), sized like the full preset's
evaluation sets (~30k questions of ~40 words: GSM8K test, ARC, MMLU) and FineWeb-like documents of ~600 words.

    python bench/decontaminate.py                    # about a minute on 2 cores
    python bench/decontaminate.py --docs 20000

Reports the index build time, its n-gram count and the check's cost per word of training text, and what that is
for the full preset's 8.4B pretraining tokens (~0.75 words per token) spread over 8 ranks.
"""

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tasks  # noqa: E402

parser = argparse.ArgumentParser(description="decontamination cost per word")
parser.add_argument("--eval-texts", type=int, default=30_000, help="evaluation questions in the index")
parser.add_argument("--docs", type=int, default=2_000, help="training documents checked")
parser.add_argument("--words-per-doc", type=int, default=600)
args = parser.parse_args()

rng = random.Random(0)
vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(50_000)]
eval_texts = [" ".join(rng.choices(vocabulary, k=rng.randint(8, 80))) + "?" for _ in range(args.eval_texts)]
docs = [" ".join(rng.choices(vocabulary, k=args.words_per_doc)) + "." for _ in range(args.docs)]

t0 = time.time()
index = tasks.NgramIndex(eval_texts)
build = time.time() - t0
t0 = time.time()
flagged = sum(index.overlaps(doc) for doc in docs)
check = time.time() - t0
per_word = check / (args.docs * args.words_per_doc)
words = 8.4e9 * 0.75
print(f"index: {len(eval_texts):,} texts -> {sum(map(len, index.runs.values())):,} run hashes "
      f"({len(index.runs)} run lengths) "
      f"in {build:.1f}s")
print(f"check: {args.docs:,} documents of {args.words_per_doc} words in {check:.1f}s = {per_word * 1e9:.0f} ns/word "
      f"({flagged} flagged)")
print(f"full preset: {words:.2g} words / 8 ranks = {words / 8 * per_word / 60:.0f} min of CPU per rank")

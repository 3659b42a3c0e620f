"""
How long the engine's calculator takes to refuse hostile expressions: huge powers, huge repetitions, deep nesting,
over-long input. A model's tool call runs inside the decode loop, so a refusal must cost microseconds to
milliseconds, never seconds. (The tests check what it answers; this measures how fast.)

    python bench/calculator.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root

from engine import calculator  # noqa: E402

HOSTILE = ["9**9**9", "10**10**10", "2**101", "10**31", "1e308*10", "'1'*10**9", "(1,)*9", "__import__('os')",
           "1" * 10_000, "(" * 1000, "(" * 199 + "1" + ")" * 199, "-" * 150 + "1", "2" * 40, "1/0"]


def main(repeats=5):
    print(f"{'expression':40s} {'result':45s} best of {repeats}")
    worst = 0.0
    for expr in HOSTILE:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = calculator(expr)
            best = min(best, time.perf_counter() - t0)
        worst = max(worst, best)
        shown = expr if len(expr) <= 37 else expr[:34] + "..."
        print(f"{shown:40s} {result[:45]:45s} {best * 1e3:8.3f} ms")
    print(f"slowest refusal: {worst * 1e3:.3f} ms")


if __name__ == "__main__":
    main()

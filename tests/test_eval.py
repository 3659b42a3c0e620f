"""pass@k against the closed form and brute-force enumeration."""

import itertools
import math

import pytest

from eval import pass_at_k


@pytest.mark.parametrize("n, c, k", [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (10, 3, 5), (10, 0, 10), (20, 19, 2), (16, 4, 16)])
def test_pass_at_k_matches_closed_form_and_brute_force(n, c, k):
    closed = 1 - math.comb(n - c, k) / math.comb(n, k)
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_1_is_the_fraction_correct():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)


def test_pass_at_k_large_n_is_stable():
    # math.comb(1000, 500) has ~300 digits; the product form stays exact enough
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)


@pytest.mark.parametrize("n, c, k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)

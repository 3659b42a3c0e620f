"""
Muon: Newton–Schulz orthogonalization, the update rule by hand, the batched update against one matrix at a time,
2 ranks (gloo) sharing the work against 1 rank, and GPT.setup_optimizers' groups and lr scaling.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import GPT, GPTConfig, Muon, orthogonalize


def matrix_with_singular_values(rows, cols, singular_values, seed=0):
    """U diag(s) V^T with random orthonormal U (rows x k), V (cols x k), k = len(s); returns (G, U, V)."""
    generator = torch.Generator().manual_seed(seed)
    k = len(singular_values)
    U, _ = torch.linalg.qr(torch.randn(rows, k, generator=generator))
    V, _ = torch.linalg.qr(torch.randn(cols, k, generator=generator))
    return U @ torch.diag(torch.tensor(singular_values)) @ V.T, U, V


@pytest.mark.parametrize("rows, cols", [(64, 256), (256, 64), (96, 96)])
def test_orthogonalize_keeps_singular_vectors_and_flattens_singular_values(rows, cols):
    # Singular values spread over two orders of magnitude (condition number 100) all come out near 1 ...
    k = min(rows, cols)
    s = torch.logspace(-2, 0, k).tolist()
    G, U, V = matrix_with_singular_values(rows, cols, s)
    O = orthogonalize(G)
    assert O.shape == G.shape and O.dtype == G.dtype
    out = torch.linalg.svdvals(O)
    assert out.min() > 0.6 and out.max() < 1.25
    # ... and the singular vectors are G's: U^T O V is diagonal (O = U p(S) V^T for a scalar polynomial p).
    D = U.T @ O @ V  # (k, k)
    off_diagonal = D - torch.diag(torch.diagonal(D))
    assert off_diagonal.abs().max() < 1e-4
    # The iteration is monotone in s: larger singular values of G never map below much smaller ones.
    assert torch.diagonal(D)[-1] > torch.diagonal(D)[0] - 0.5


def test_orthogonalize_is_scale_invariant_and_zero_safe():
    G = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(orthogonalize(1e-2 * G), orthogonalize(1e3 * G), atol=1e-5)
    assert torch.equal(orthogonalize(torch.zeros(8, 8)), torch.zeros(8, 8))  # no NaN for an all-zero gradient


def test_muon_step_by_hand():
    # Two steps on a tall (12 x 4) matrix: scale sqrt(max(1, 12 / 4)) = sqrt(3), lr 0.1, beta 0.9, weight decay 0.5.
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(12, 4))
    g1, g2 = torch.randn(12, 4), torch.randn(12, 4)
    optimizer = Muon([W], lr=0.1, momentum=0.9, weight_decay=0.5)
    expected = W.detach().clone()
    m = torch.zeros(12, 4)
    for g in (g1, g2):
        W.grad = g.clone()
        optimizer.step()
        m = 0.9 * m + 0.1 * g
        u = 0.1 * g + 0.9 * m  # Nesterov
        expected = expected * (1 - 0.1 * 0.5) - 0.1 * math.sqrt(3) * orthogonalize(u)
        assert torch.allclose(W.detach(), expected, atol=1e-6)
    assert torch.equal(W.grad, g2)  # the gradient is read, never modified


def test_muon_update_has_flat_spectrum_whatever_the_gradient():
    # A rank-3 gradient with singular values 100:10:1 moves W by ~lr in each of its 3 directions and not at all in
    # the others. (Directions much weaker than 1/500 of the strongest stay small: five steps grow a small singular
    # value by at most a^5 = 3.4445^5 ~ 485.)
    G, _, _ = matrix_with_singular_values(32, 32, [100.0, 10.0, 1.0], seed=3)
    W = torch.nn.Parameter(torch.zeros(32, 32))
    W.grad = G
    Muon([W], lr=0.01).step()
    s = torch.linalg.svdvals(W.detach() / 0.01)
    assert s[:3].min() > 0.6 and s[:3].max() < 1.25 and s[3:].max() < 1e-4


def mixed_shape_params(seed=0):
    """3 square, 2 tall and 1 wide matrix: stacks of 3, 2 and 1 (3 is odd: 2 ranks pad it)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(16, 16), (64, 16), (16, 16), (16, 64), (64, 16), (16, 16)]
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for shape in shapes]


def muon_steps(params, optimizers, steps=3, seed=1):
    """`steps` steps with seeded gradients; returns the parameters afterwards."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        for optimizer in optimizers:
            optimizer.step()
    return [p.detach().clone() for p in params]


def test_batched_muon_equals_one_matrix_at_a_time():
    params = mixed_shape_params()
    batched = muon_steps(params, [Muon(params, lr=0.05, weight_decay=0.1)])
    params = mixed_shape_params()
    one_by_one = muon_steps(params, [Muon([p], lr=0.05, weight_decay=0.1) for p in params])  # stacks of 1
    for a, b in zip(batched, one_by_one):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


TWO_RANKS_DRIVER = """
import os, sys
sys.path[:0] = [{repo!r}, {tests!r}]
import torch, torch.distributed as dist
from common import compute_cleanup
from model import Muon
from test_muon import mixed_shape_params, muon_steps
torch.set_num_threads(1)
dist.init_process_group("gloo")
params = mixed_shape_params()
torch.save(muon_steps(params, [Muon(params, lr=0.05, weight_decay=0.1)]),
           os.path.join({out!r}, "rank" + os.environ["RANK"] + ".pt"))
compute_cleanup()  # a barrier first: a rank that leaves gloo while the other still talks to it aborts both
"""


@pytest.mark.slow
def test_two_ranks_sharing_newton_schulz_equal_one_rank(tmp_path):
    repo = Path(__file__).resolve().parent.parent
    driver = tmp_path / "driver.py"
    driver.write_text(TWO_RANKS_DRIVER.format(repo=str(repo), tests=str(repo / "tests"), out=str(tmp_path)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(driver)]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    params = mixed_shape_params()
    single = muon_steps(params, [Muon(params, lr=0.05, weight_decay=0.1)])
    for rank in (0, 1):
        for a, b in zip(torch.load(tmp_path / f"rank{rank}.pt"), single):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_muon_rejects_non_matrices():
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(5))])


def test_setup_optimizers_groups_and_width_scaled_lrs():
    model = GPT(GPTConfig(sequence_len=16, vocab_size=100, n_layer=2, n_head=2, n_kv_head=1, n_embd=192))
    adamw, muon = model.setup_optimizers(matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.004, weight_decay=0.1)
    # AdamW lrs are scaled by (192 / 768)^-0.5 = 2; Muon's is as given.
    assert [g["lr"] for g in adamw.param_groups] == pytest.approx([0.008, 0.4])
    assert [g["initial_lr"] for g in adamw.param_groups] == [g["lr"] for g in adamw.param_groups]
    assert muon.param_groups[0]["lr"] == muon.param_groups[0]["initial_lr"] == 0.02
    assert adamw.param_groups[0]["params"] == [model.lm_head.weight]
    assert adamw.param_groups[1]["params"] == [model.wte.weight]
    muon_params = muon.param_groups[0]["params"]
    assert len(muon_params) == 2 * 6 and all(p.ndim == 2 for p in muon_params)
    owned = {id(p) for o in (adamw, muon) for g in o.param_groups for p in g["params"]}
    assert owned == {id(p) for p in model.parameters()} and len(owned) == len(list(model.parameters()))


def test_optimizers_fit_a_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=64))
    model.init_weights()
    optimizers = model.setup_optimizers(matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.004)
    x = torch.randint(0, 64, (4, 32))
    losses = []
    for _ in range(10):
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(64), abs=0.05)  # lm_head starts near zero: uniform predictions
    assert losses[-1] < 0.3 * losses[0]

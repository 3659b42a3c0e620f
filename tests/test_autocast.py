"""
What the model computes under bf16 autocast, shown without a GPU: the dtypes of a forward on fake CUDA tensors with
CUDA autocast's rules (FakeTensorMode: shapes and dtypes, no data), the bf16 lm_head matmul's values and gradients on
CPU, and the bytes autograd saves for backward (saved_tensors_hooks under CPU bf16 autocast) against
model.training_memory.
"""

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from model import GPT, Bf16Linear, GPTConfig, training_memory

CONFIG = GPTConfig(sequence_len=16, vocab_size=384, n_layer=2, n_head=4, n_kv_head=4, n_embd=64)


class Ops(TorchDispatchMode):
    """Records (op, input dtypes and shapes, output dtypes and shapes) of every op run while the mode is on."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        described = [[(t.dtype, tuple(t.shape)) for t in tree_leaves(x) if isinstance(t, torch.Tensor)]
                     for x in (args, out)]
        self.ops.append((func, *described))
        return out


def on_fake_cuda(fn, *shapes):
    """The ops of fn(*inputs), inputs fake CUDA float32 tensors of these shapes, under CUDA bf16 autocast, and fn's
    output. torch.autocast("cuda") turns itself off without a CUDA build, so autocast's state is set directly (and
    restored). Whole-model forwards cannot run so: indexing a CUDA tensor needs CUDA's device guard."""
    state = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        inputs = [torch.empty(shape, device="cuda") for shape in shapes]
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        try:
            with Ops() as recorded:
                out = fn(*inputs)
        finally:
            torch.set_autocast_enabled("cuda", state[0])
            torch.set_autocast_dtype("cuda", state[1])
    return recorded.ops, out


def fake_cuda_model():
    model = GPT(CONFIG).requires_grad_(False)  # fake CUDA tensors cannot carry autograd without a CUDA build
    with FakeTensorMode(allow_non_fake_inputs=True):
        return model.to_empty(device="cuda")  # fake CUDA weights: shapes and dtypes, no values


def test_under_cuda_autocast_relu_squared_stays_bf16():
    # No float32 tensor of the MLP's width: ReLU(x)^2 computed as r * r stays bf16 (r.square() is pow, which CUDA
    # autocast runs in float32: a float32 copy of r in and a float32 square out, both kept for backward).
    C = CONFIG.n_embd
    ops, out = on_fake_cuda(fake_cuda_model().blocks[0].mlp, (2, 16, C))
    activations = [(str(func), dtype) for func, ins, outs in ops for dtype, shape in ins + outs
                   if shape[-1:] == (4 * C,) and shape != (C, 4 * C)]  # c_proj's float32 weight is cast, as it must
    assert len(activations) > 2 and out.dtype == torch.bfloat16
    assert [(func, dtype) for func, dtype in activations if dtype == torch.float32] == []


def test_under_cuda_autocast_the_head_is_a_bf16_matmul_with_float32_output():
    N, C, V = 32, CONFIG.n_embd, CONFIG.vocab_size
    ops, logits = on_fake_cuda(fake_cuda_model().head, (2, 16, C))
    assert logits.dtype == torch.float32 and logits.shape == (2, 16, V)
    # The lm_head matmul: bf16 inputs (N, C) and (C, V), float32 output; not a float32 (TF32) matmul.
    head = [(str(func), ins, outs) for func, ins, outs in ops if outs and outs[0][1] == (N, V)][0]
    assert head == ("aten.mm.dtype", [(torch.bfloat16, (N, C)), (torch.bfloat16, (C, V))], [(torch.float32, (N, V))])


def test_a_block_casts_each_norm_output_to_bf16_once():
    # Under bf16 autocast (CPU's, which casts a matmul's input as CUDA's does) a block casts the float32 output of
    # each norm once, attention's and the MLP's: without the shared cast, c_q, c_k and c_v would each cast it and keep
    # their copy for backward.
    B, T, C = 2, 16, CONFIG.n_embd
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.init_weights()
    positions = torch.arange(T)[None]
    cos, sin = model.cos[positions][:, :, None], model.sin[positions][:, :, None]
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad(), Ops() as recorded:
        model.blocks[0](torch.randn(B, T, C), cos, sin, None, None)
    casts = [func for func, ins, outs in recorded.ops if ins[:1] == [(torch.float32, (B, T, C))]
             and outs == [(torch.bfloat16, (B, T, C))]]
    assert len(casts) == 2


def test_bf16_linear_is_a_float32_matmul_of_bf16_rounded_inputs_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64, requires_grad=True)
    w = torch.randn(384, 64, requires_grad=True)
    y = Bf16Linear.apply(x, w)
    g = torch.randn(3, 5, 384)
    y.backward(g)
    x16, w16, g16 = (t.detach().bfloat16().double() for t in (x, w, g))
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.float32
    # Products of bf16 numbers are exact in float32; only the order of the float32 sums differs from float64's.
    torch.testing.assert_close(y.double(), x16 @ w16.T, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), g16.flatten(0, 1).T @ x16.flatten(0, 1), rtol=1e-6, atol=1e-4)
    # dx is the bf16 matmul's (rounded to bf16 once, as on CUDA), then returned in x's dtype.
    torch.testing.assert_close(x.grad.double(), (g16 @ w16).bfloat16().double(), rtol=0, atol=0)


def block_saved_bytes(config, B, T):
    """Bytes of the distinct storages autograd saves in one Block's forward under CPU bf16 autocast, with the bf16
    copies of the weights (model.training_memory's autocast term) left out."""
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    block = model.blocks[0]
    x = torch.randn(B, T, config.n_embd, requires_grad=True)
    positions = torch.arange(T)[None]
    cos, sin = model.cos[positions][:, :, None], model.sin[positions][:, :, None]
    weight_shapes = {tuple(p.shape) for p in block.parameters()} | {tuple(p.T.shape) for p in block.parameters()}
    saved = {}

    def pack(t):
        if not (t.dtype == torch.bfloat16 and tuple(t.shape) in weight_shapes and t.shape[0] != B * T):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin, None, None)
    return sum(saved.values())


def test_training_memory_counts_the_bytes_a_block_saves_for_backward():
    # Per row and position: the difference between 3 rows and 2 rows of the same length leaves out what does not grow
    # with rows (the rotary tables' slices). Under CPU autocast, as under CUDA's: matmuls in bf16, the norms' saved
    # inputs in float32, ReLU and its square in bf16.
    # Model widths with B * T unlike any weight dimension, so the weights' bf16 copies are told apart by shape.
    for n_kv_head in (4, 2):
        config = GPTConfig(sequence_len=24, vocab_size=384, n_layer=1, n_head=4, n_kv_head=n_kv_head, n_embd=96)
        T, C, H = 24, config.n_embd, config.n_head
        per_position = (block_saved_bytes(config, 3, T) - block_saved_bytes(config, 2, T)) / T
        f = n_kv_head / H
        model_terms = training_memory(config, 1)["activations"] - 14 * C  # one position, one layer, no embeddings
        assert model_terms == (36 + 8 * f) * C
        # Left out of the model, a few bytes per head: two norms' 1/rms (4 + 4), QK-norm's per head (4 H + 4 H_kv),
        # attention's log-sum-exp (4 H).
        statistics = 8 + 4 * H + 4 * n_kv_head + 4 * H
        assert per_position == model_terms + statistics


def test_the_bf16_head_compiles_into_one_graph_with_its_backward():
    # Pretraining compiles the model: Bf16Linear (an autograd.Function) and autocast_dtype must trace without a graph
    # break, forward and backward (aot_eager: AOTAutograd's joint graph, no inductor kernels on CPU).
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.init_weights()
    x = torch.randint(0, CONFIG.vocab_size, (2, 16))

    def loss_of(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x, x, logits_chunk=None)

    try:
        explained = torch._dynamo.explain(loss_of)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0)
        loss = torch.compile(loss_of, backend="aot_eager")(x)
        loss.backward()
    finally:
        torch._dynamo.reset()
    eager = GPT(CONFIG)
    eager.load_state_dict(model.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager_loss = eager(x, x, logits_chunk=None)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    torch.testing.assert_close(model.lm_head.weight.grad, eager.lm_head.weight.grad)

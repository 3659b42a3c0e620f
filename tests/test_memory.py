"""
Memory the code really holds, measured on CPU by tensor accounting (no torch.cuda): multiple-choice evaluation never
builds float32 logits for every position, and the terms of model.training_memory that do not depend on CUDA autocast
(weights, gradients, optimizer state) equal what a real training step keeps.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import eval as ev
from conftest import make_tokenizer
from model import GPT, GPTConfig, training_memory


class LargestFloat32(TorchDispatchMode):
    """Records the largest float32 tensor any op returns while the mode is on: (elements, shape, op)."""

    def __init__(self):
        super().__init__()
        self.largest = (0, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() > self.largest[0]:
                self.largest = (t.numel(), tuple(t.shape), str(func))
        return out


def test_multiple_choice_never_builds_logits_of_every_position():
    # The small preset's context and vocabulary (L = 1,024, V = 65,536) at width 64: prompts longer than the context
    # fill all 1,024 positions. Logits of every position would be >= L x V floats per row; what is read is one
    # position per row (chat) or the continuation's few positions (base).
    L, V = 1024, 65536
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=L, vocab_size=V, n_layer=1, n_head=1, n_kv_head=1, n_embd=64)).eval()
    question = "Tom has 3 apples and buys 4 more. " * 200
    items = [{"question": question + str(i), "choices": ["one", "two", "three", "four"], "answer": i,
              "subject": "math"} for i in range(2)]
    assert len(tokenizer.render_for_completion(ev.chat_prompt(items[0]))) > L
    for evaluate in (lambda: ev.evaluate_multiple_choice_chat(model, tokenizer, items, batch_size=2),
                     lambda: ev.evaluate_multiple_choice(model, tokenizer, items, "letter", batch_size=8)):
        probe = LargestFloat32()
        with probe:
            evaluate()
        assert probe.largest[0] < L * V, f"a float32 tensor of shape {probe.largest[1]} from {probe.largest[2]}"

"""
Memory the code really holds, measured on CPU by tensor accounting (no torch.cuda): multiple-choice evaluation never
builds float32 logits for every position; the terms of model.training_memory that do not depend on CUDA autocast
(weights, gradients, optimizer state) and the critic's term of common.rl_models_bytes equal what a real training step
keeps; the engine's KV cache is gone when generate returns. The activation terms are not checked here: CPU autocast
casts other ops than CUDA's and CPU attention keeps other tensors (bench/gpu_check.py measures them on a GPU).
"""

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


def tensor_bytes(tensors):
    """Bytes of distinct storages among the tensors (views and shared storage counted once); 0-dim tensors, such as
    AdamW's step counts, are left out."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.dim() > 0}
    return sum(storages.values())


def measured_training_bytes(model, optimizers):
    """Weights, gradients and optimizer state a real training step leaves allocated."""
    return {"weights": tensor_bytes(model.parameters()),
            "grads": tensor_bytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": tensor_bytes(v for o in optimizers for state in o.state.values() for v in state.values()
                                      if isinstance(v, torch.Tensor))}


def one_step(model, loss_of):
    optimizers = model.setup_optimizers(0.02, 0.2, 0.004)
    loss_of(model).backward()
    for optimizer in optimizers:
        optimizer.step()
    return optimizers


CONFIG = GPTConfig(sequence_len=32, vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)  # GQA: f = 1/2


def test_training_memory_terms_equal_a_real_step():
    # What model.training_memory counts without DDP (RL sums gradients in place) against the tensors a real step of
    # a GQA model keeps: fp32 weights, one gradient per parameter, AdamW's two moments and Muon's momentum.
    torch.manual_seed(0)
    model = GPT(CONFIG)
    x = torch.randint(0, 512, (2, 32))
    optimizers = one_step(model, lambda m: m(x, x))
    terms = training_memory(CONFIG, 0, 0, ddp=False)
    assert measured_training_bytes(model, optimizers) == {k: terms[k] for k in ("weights", "grads", "optimizer")}


def test_critic_bytes_equal_a_real_critic_step():
    # PPO's critic: its lm_head gets no gradient and so no AdamW state; the head is a Linear(C, 1) with a bias.
    from common import rl_models_bytes
    from model import ScalarHeadModel

    torch.manual_seed(0)
    critic = ScalarHeadModel(GPT(CONFIG))
    optimizers = one_step(critic, lambda m: m(torch.randint(0, 512, (2, 32))).square().mean())
    assert sum(measured_training_bytes(critic, optimizers).values()) == rl_models_bytes(CONFIG, critic=True)["critic"]


def test_the_kv_cache_is_gone_when_generate_returns():
    # RL's plan never adds the rollout's KV cache to the learner: the engine's cache is local to generate (an engine
    # that kept it across calls must move the cache into RL's learner phase, rl.plan). Every storage an op creates
    # during generate is watched; once it returns, what is still alive is far less than one layer's keys.
    import gc
    import weakref

    from engine import Engine

    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=64, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_kv_head=2,
                          n_embd=64)).eval()

    class Storages(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.refs = {}  # id of a storage -> (weak reference, bytes)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    self.refs[id(storage)] = (weakref.ref(storage), storage.nbytes())
            return out

    engine, watch = Engine(model, tokenizer), Storages()  # the engine lives on, as RL's does across steps
    with watch:
        engine.generate([[tokenizer.bos_id] * 8] * 4, num_samples=8, max_tokens=24, temperature=1.0, seed=0)
    gc.collect()
    layer_keys = 32 * (8 + 24) * 2 * 16 * 4  # 32 rows x 32 slots x 2 heads x 16 dims, fp32: 131,072 bytes
    assert max(nbytes for ref, nbytes in watch.refs.values()) == layer_keys  # the cache was there
    assert sum(nbytes for ref, nbytes in watch.refs.values() if ref() is not None) < layer_keys

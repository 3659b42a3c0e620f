"""
Shared fixtures of the suite. Where a test lives:
    test_<module>.py            the module of that name (test_rl.py: rl.py; test_gpu_check.py: bench/gpu_check.py)
    test_<module>_<concern>.py  one concern of it (test_rl_ddp.py, test_dpo_kto_orpo.py, test_sft_rft.py, ...)
    concerns that cross every stage, one file each: test_checkpoints.py (checksums, damaged checkpoints,
    preemption), test_resume.py (bit-exact resume of the chat stages), test_errors.py (bad input, exact messages),
    test_end_to_end.py (runs that assert outcomes), test_memory.py (what the memory model counts), test_layout.py
    (the import layering), test_gpu.py (only on CUDA).
"""

import socket

import pytest
import torch

import tasks
from model import GPT, GPTConfig
from tokenizer import Tokenizer

# Two cores on CI: one intra-op thread per test process keeps timings predictable (torchrun tests start two).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """
    No test reaches the network: a connection to anything but this machine fails at once with a clear message
    (loopback stays open, for torchrun). Subprocesses are not covered; the tests that start one keep it offline.
    """
    real_connect = socket.socket.connect

    def connect(self, address):
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise OSError(f"a test tried to reach {address}: tests must run offline (use local files)")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


def free_port():
    """A TCP port free right now on localhost, for torchrun's --master-port: a fixed port collides with any other
    run (a parallel CI job, a leftover process) that holds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -----------------------------------------------------------------------------
# Shared tiny building blocks (added by the eval tests; import the plain functions with `from conftest import ...`)


def make_tokenizer():
    """A real BPE tokenizer (vocab 400) trained on 300 synthetic documents: the chat-stage tests' vocabulary."""
    return Tokenizer.train(tasks.synthetic_documents(300, seed=0), vocab_size=400)


def make_model(tokenizer, seed=0):
    """
    A 2-layer GQA GPT with PyTorch's default init (not init_weights, which zeroes the output projections): every
    block is non-trivial, so the tests see real attention.
    """
    torch.manual_seed(seed)
    config = GPTConfig(sequence_len=128, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    return GPT(config)


def scripted_model(tokenizer, transitions, scale=1.0, sequence_len=64):
    """
    A real GPT whose next token depends only on the current token: transitions {token: next_token}.
    init_weights zeroes the blocks' output projections, so every block is the identity and the final hidden state
    is norm(embedding) = sqrt(C) * e_slot = 8 e_slot for a token embedded as the basis vector e_slot (C = 64).
    lm_head row `next` gets `scale` on that slot: the scripted token's logit is 15 tanh(8 scale / 15) (~7.3 at
    scale 1, ~11.8 at scale 2) against 0 for every other token, whose slot-0 embedding gives all-zero logits.
    Greedy decoding follows the script exactly; sampling at temperature 1 follows it with probability
    e^logit / (e^logit + V - 1) per step.
    """
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=sequence_len, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_kv_head=2,
                          n_embd=64))
    model.init_weights()
    with torch.no_grad():
        model.wte.weight.zero_()
        model.wte.weight[:, 0] = 1.0
        model.lm_head.weight.zero_()
        for slot, (token, next_token) in enumerate(transitions.items(), start=1):
            model.wte.weight[token] = 0.0
            model.wte.weight[token, slot] = 1.0
            model.lm_head.weight[next_token, slot] = scale
    return model.eval()


def ends_turn_sometimes(model, tokenizer, weight=0.6):
    """
    A random model that ends its turn now and then (about half its answers stop within 8 tokens at weight 0.6): a
    constant feature in every embedding, read by the <|assistant_end|> row of the output layer. Only an answer that
    stops can be correct (tasks.completion_reward), and a random model almost never emits <|assistant_end|>.
    """
    with torch.no_grad():
        model.wte.weight[:, 0] = 10.0
        end = tokenizer.token_id("<|assistant_end|>")
        model.lm_head.weight[end] = 0.0
        model.lm_head.weight[end, 0] = weight
    return model

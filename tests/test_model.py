import math

import pytest
import torch
import torch.nn.functional as F

from engine import KVCache, StaticKVCache
import model as model_module
from model import GPT, GPTConfig, shared_prefix_attention, training_memory

# A real tiny model: 2 layers, width 64, 4 query heads sharing 2 key/value heads (grouped-query attention).
CONFIG = GPTConfig(sequence_len=32, vocab_size=97, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)


@pytest.fixture(scope="module")
def model():
    # PyTorch's default init (not init_weights, whose zero output projections make every block the identity)
    # so attention and the MLPs actually move the logits and a cache bug would show.
    torch.manual_seed(0)
    return GPT(CONFIG).eval()


def test_from_depth_derives_width_and_heads():
    c = GPTConfig.from_depth(4, vocab_size=1000, sequence_len=256)
    assert (c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.sequence_len) == (4, 256, 4, 4, 256)
    c = GPTConfig.from_depth(20, vocab_size=1000)
    assert (c.n_layer, c.n_embd, c.n_head, c.sequence_len) == (20, 1280, 20, 2048)
    c = GPTConfig.from_depth(3, vocab_size=1000, aspect_ratio=50)  # 150 rounds up to 3 heads of 64
    assert (c.n_embd, c.n_head) == (192, 3)


def test_config_rejects_inconsistent_heads():
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_embd=64, n_head=3, n_kv_head=3)
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        GPTConfig(n_embd=64, n_head=4, n_kv_head=3)


def test_num_params_and_flops(model):
    C, V, L, kv = 64, 97, 2, 2 * 16  # kv: n_kv_head * head_dim
    per_layer = C * C + 2 * C * kv + C * C + 2 * C * 4 * C  # q, k and v, attention out, MLP in and out
    assert model.num_params() == 2 * V * C + L * per_layer == 102528
    assert model.flops_per_token() == 6 * (102528 - V * C) + 12 * L * C * CONFIG.sequence_len


def test_forward_shapes_and_losses(model):
    torch.manual_seed(1)
    idx = torch.randint(0, CONFIG.vocab_size, (3, 10))
    targets = torch.randint(0, CONFIG.vocab_size, (3, 10))
    targets[0, :4] = -1
    targets[2, 7:] = -1
    logits = model(idx)
    assert logits.shape == (3, 10, CONFIG.vocab_size) and logits.dtype == torch.float32
    assert logits.abs().max() < 15  # soft-capped
    per_token = model(idx, targets, loss_reduction="none")
    assert per_token.shape == (3, 10)
    assert (per_token[targets == -1] == 0).all()
    valid = targets != -1
    expected = -logits.log_softmax(-1)[valid].gather(1, targets[valid][:, None]).squeeze(1)
    torch.testing.assert_close(per_token[valid], expected)
    mean = model(idx, targets)
    torch.testing.assert_close(mean, per_token.sum() / valid.sum())
    reference = F.cross_entropy(logits.view(-1, CONFIG.vocab_size), targets.view(-1), ignore_index=-1)
    torch.testing.assert_close(mean, reference)


def test_causal_future_tokens_do_not_change_past_logits(model):
    torch.manual_seed(2)
    a = torch.randint(0, CONFIG.vocab_size, (1, 12))
    b = a.clone()
    b[0, 7:] = (b[0, 7:] + 1) % CONFIG.vocab_size
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :7], lb[:, :7])
    assert not torch.allclose(la[:, 7:], lb[:, 7:])


def test_init_weights_gives_uniform_initial_loss():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.init_weights()
    idx = torch.randint(0, CONFIG.vocab_size, (2, 16))
    loss = model(idx, idx)
    assert abs(loss.item() - math.log(CONFIG.vocab_size)) < 0.01
    assert model.blocks[0].attn.c_proj.weight.abs().sum() == 0


def test_meta_device_build_then_init():
    with torch.device("meta"):
        model = GPT(CONFIG)
    model.to_empty(device="cpu")
    model.init_weights()
    reference = GPT(CONFIG)
    torch.testing.assert_close(model.cos, reference.cos)
    torch.testing.assert_close(model.sin, reference.sin)
    assert model(torch.zeros(1, 4, dtype=torch.long)).isfinite().all()


def test_prefill_then_decode_equals_full_forward(model):
    torch.manual_seed(3)
    seq = torch.randint(0, CONFIG.vocab_size, (1, 12))
    full = model(seq)  # (1, 12, V)
    cache = KVCache(batch_size=1, max_len=12, n_layer=CONFIG.n_layer, device="cpu")
    chunks = [model(seq[:, :5], kv_cache=cache), model(seq[:, 5:8], kv_cache=cache)]  # prefill, then a 3-token chunk
    chunks += [model(seq[:, t:t + 1], kv_cache=cache) for t in range(8, 12)]  # one token at a time
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.lengths.tolist() == [12] and cache.filled == 12


def test_rows_of_different_lengths_decode_at_their_own_positions(model):
    """Prompts of lengths 3 and 7, prefilled separately, copied into 2 rows each, decoded in one batch."""
    torch.manual_seed(4)
    prompts = [torch.randint(0, CONFIG.vocab_size, (1, n)) for n in (3, 7)]
    continuations = torch.randint(0, CONFIG.vocab_size, (4, 4))  # a different continuation per row
    prefills = []
    for prompt in prompts:
        prefills.append(KVCache(batch_size=1, max_len=prompt.size(1), n_layer=CONFIG.n_layer, device="cpu"))
        model(prompt, kv_cache=prefills[-1])
    cache = KVCache.from_prefills(prefills, repeats=2, max_len=7 + 4)
    assert cache.lengths.tolist() == [3, 3, 7, 7]
    steps = [model(continuations[:, t:t + 1], kv_cache=cache)[:, 0] for t in range(4)]  # each (4, V)
    decoded = torch.stack(steps, dim=1)  # (4 rows, 4 steps, V)
    for row in range(4):
        seq = torch.cat([prompts[row // 2], continuations[row:row + 1]], dim=1)
        expected = model(seq)[0, -4:]  # logits after each continuation token
        torch.testing.assert_close(decoded[row], expected, atol=1e-5, rtol=1e-5)


def test_shared_prefix_attention_is_attention_over_prompt_then_own_slots():
    # 2 groups x 3 rows, 4 query heads on 2 kv heads; group 0's prompt has 5 of the 6 prefix slots, group 1's 2 (the
    # rest is garbage, masked); each row has 4 own slots, the last one masked. Reference: SDPA over each row's
    # sequence [its group's prompt tokens; its visible own slots].
    torch.manual_seed(5)
    G, R, P, S, H, n_kv_head, D = 2, 3, 6, 4, 4, 2, 8
    q = torch.randn(G * R, 1, H, D)
    k, v = torch.randn(G * R, S, n_kv_head, D), torch.randn(G * R, S, n_kv_head, D)
    prefix_k, prefix_v = torch.randn(G, P, n_kv_head, D), torch.randn(G, P, n_kv_head, D)
    prompt_len = [5, 2]
    prefix_mask = torch.arange(P) < torch.tensor(prompt_len)[:, None]  # (G, P)
    own_mask = (torch.arange(S) < S - 1)[None, None, None, :]  # (1, 1, 1, S)
    y = shared_prefix_attention(q, k, v, own_mask, prefix_k, prefix_v, prefix_mask)  # (B, 1, H, D)
    for b in range(G * R):
        g, n = b // R, prompt_len[b // R]
        keys = torch.cat([prefix_k[g, :n], k[b, :S - 1]])  # (n + S - 1, n_kv_head, D)
        values = torch.cat([prefix_v[g, :n], v[b, :S - 1]])
        expected = F.scaled_dot_product_attention(q[b].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                                  enable_gqa=True)  # (H, 1, D)
        torch.testing.assert_close(y[b], expected.transpose(0, 1), atol=1e-6, rtol=1e-5)
    assert torch.equal(shared_prefix_attention(q, k[:, :S - 1], v[:, :S - 1], None, prefix_k, prefix_v, prefix_mask),
                       y)  # no mask: every own slot is visible


def test_static_cache_with_shared_prompts_decodes_like_the_full_forward(model):
    # Engine.generate's compiled-path layout for num_samples > 1, run uncompiled: 2 prompts (3 and 7 tokens) stored
    # once each, 2 rows per prompt plus 2 padding groups' rows (4 groups), every row generating its own continuation.
    torch.manual_seed(4)
    prompts = [torch.randint(0, CONFIG.vocab_size, (1, n)) for n in (3, 7)]
    continuations = torch.randint(0, CONFIG.vocab_size, (8, 4))  # rows 4-7: padding groups, outputs unread
    prefills = []
    for prompt in prompts:
        prefills.append(KVCache(batch_size=1, max_len=prompt.size(1), n_layer=CONFIG.n_layer, device="cpu"))
        model(prompt, kv_cache=prefills[-1])
    cache = StaticKVCache(8, 8, prefills[0], groups=4, prefix_len=8)
    with torch.inference_mode():
        cache.prefix_keys[0].fill_(100.0)  # what an earlier call left behind: masked out
        cache.load(prefills, repeats=2)
        assert cache.lengths.tolist() == [3, 3, 7, 7, 0, 0, 0, 0] and cache.prefix_read == 7
        decoded = torch.stack([model(continuations[:, t:t + 1], kv_cache=cache)[:, 0] for t in range(4)], dim=1)
    for row in range(4):
        seq = torch.cat([prompts[row // 2], continuations[row:row + 1]], dim=1)
        torch.testing.assert_close(decoded[row], model(seq)[0, -4:], atol=1e-5, rtol=1e-5)


def test_kv_cache_overflow_is_an_error(model):
    cache = KVCache(batch_size=1, max_len=4, n_layer=CONFIG.n_layer, device="cpu")
    model(torch.zeros(1, 4, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="do not fit"):
        model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)


# -----------------------------------------------------------------------------
# Memory: KV cache dtype, chunked logits, the analytic training-memory model


def test_kv_cache_keys_and_values_share_the_autocast_dtype(model, monkeypatch):
    # CUDA autocast runs rms_norm in float32, so q and k leave QK-norm as float32; CPU autocast does not, so force it.
    # Broken once (the cast after rotary removed): the key cache became float32 next to bf16 values and this failed.
    monkeypatch.setattr(model_module, "norm", lambda x: F.rms_norm(x.float(), (x.size(-1),)))
    cache = KVCache(batch_size=2, max_len=8, n_layer=CONFIG.n_layer, device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, CONFIG.vocab_size, (2, 5)), kv_cache=cache)
        model(torch.randint(0, CONFIG.vocab_size, (2, 1)), kv_cache=cache)
    assert [k.dtype for k in cache.keys] == [torch.bfloat16] * CONFIG.n_layer
    assert [v.dtype for v in cache.values] == [torch.bfloat16] * CONFIG.n_layer


def test_head_is_float32_under_bf16_autocast(model):
    # The engine's sampling distribution and the learner's log-probs both read GPT.head: under autocast its matmul
    # takes bf16 inputs (bf16's tensor-core rate) but sums and returns float32, or every logit sits on bf16's grid.
    # Broken once (lm_head(h).float(), a bf16 output): the logits were bf16 numbers and this failed.
    torch.manual_seed(1)
    h = 4 * torch.randn(3, 5, CONFIG.n_embd)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.head(h)
    z = h.bfloat16().float() @ model.lm_head.weight.bfloat16().float().T  # products of bf16 numbers, float32 sums
    expected = model_module.LOGIT_SOFTCAP * torch.tanh(z / model_module.LOGIT_SOFTCAP)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    assert (z.bfloat16().float() != z).float().mean() > 0.9  # z itself is not on bf16's grid


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_chunked_loss_equals_whole_in_value_and_gradient(reduction):
    # Broken once (chunked_logits paired each chunk's positions with targets shifted by one): value and gradient differ.
    torch.manual_seed(0)
    whole, chunked = GPT(CONFIG), GPT(CONFIG)
    chunked.load_state_dict(whole.state_dict())
    idx = torch.randint(0, CONFIG.vocab_size, (3, 11))
    targets = torch.randint(0, CONFIG.vocab_size, (3, 11))
    targets[0, :5] = -1
    targets[2, 9:] = -1
    weights = torch.rand(3, 11)  # a non-uniform upstream gradient, as RL and DPO give the per-token losses
    losses = []
    for m, chunk in ((whole, None), (chunked, 7)):  # 33 positions in chunks of 7: the last one is short
        loss = m(idx, targets, loss_reduction=reduction, logits_chunk=chunk)
        (loss * weights if reduction == "none" else loss).sum().backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0])
    for (name, p), q in zip(whole.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_chunked_logits_passes_per_token_tensors_and_returns_every_output(model):
    torch.manual_seed(2)
    idx = torch.randint(0, CONFIG.vocab_size, (2, 9))
    targets = torch.randint(0, CONFIG.vocab_size, (2, 9))

    def logp_and_argmax(logits, target):
        return logits.log_softmax(-1).gather(-1, target[:, None]).squeeze(-1), logits.argmax(-1)

    with torch.no_grad():
        h = model.hidden(idx)
        logp, top = model.chunked_logits(h, logp_and_argmax, targets, chunk_tokens=4)
        logits = model(idx)
    assert logp.shape == top.shape == (2, 9)
    torch.testing.assert_close(logp, logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1))
    assert torch.equal(top, logits.argmax(-1))


def test_training_memory_by_hand():
    # C = 64, L = 2, V = 100, f = 2 / 4: blocks 2 * (2 + 1 + 8) * 64^2 = 90112 parameters, embeddings 2 * 6400.
    config = GPTConfig(sequence_len=32, vocab_size=100, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    assert GPT(config).num_params() == 90112 + 12800
    mem = training_memory(config, micro_batch_tokens=50, logits_chunk=8, ddp=False)
    assert mem == {"weights": 4 * 102912, "autocast": 2 * 90112 + 2 * 6400, "grads": 4 * 102912,
                   "optimizer": 8 * 12800 + 4 * 90112,
                   "activations": 50 * (2 * (36 + 4) + 14) * 64,  # 50 * 94 * 64 = 300800
                   "logits": 22 * 100 * 8, "total": mem["total"]}
    assert mem["total"] == 411648 + 193024 + 411648 + 462848 + 300800 + 17600
    assert training_memory(config, 50, logits_chunk=None, ddp=False)["logits"] == 22 * 100 * 50
    assert training_memory(config, 50, logits_chunk=8, ddp=True)["grads"] == 8 * 102912
    assert training_memory(config, 5, logits_chunk=8, ddp=False)["logits"] == 22 * 100 * 5

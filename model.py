"""
A small modern GPT, sized by one dial: `depth` (GPTConfig.from_depth).

Per block (pre-norm residual):  x = x + Attn(norm(x));  x = x + MLP(norm(x))
- norm: RMSNorm without learnable parameters, also applied right after the token embedding and before lm_head.
- Attn: rotary position embeddings (RoPE), RMS-normalised queries and keys (QK-norm), grouped-query attention
  (n_kv_head key/value heads shared by n_head query heads).
- MLP: Linear(d, 4d) -> ReLU(x)^2 -> Linear(4d, d).
- No biases anywhere; token embedding and lm_head are separate matrices; logits are soft-capped: 15 * tanh(z / 15).

Incremental decoding goes through a key/value cache (engine.KVCache) whose rows may hold different numbers of tokens.
forward() only uses its methods positions / attn_mask / insert / shared_prefix / advance and its `max_len`, so this
file does not import engine.py, and engine.StaticKVCache (the compiled decode step's) goes through the same forward.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Learning rates of pretraining (nanochat's, tuned at width 768; setup_optimizers rescales the AdamW ones by width).
# The post-training stages start from them and scale all three by their --lr-frac.
MATRIX_LR, EMBEDDING_LR, UNEMBEDDING_LR = 0.02, 0.2, 0.004
LOGIT_SOFTCAP = 15.0  # logits = cap * tanh(z / cap): bounded in (-15, 15), ~identity for small z
ROTARY_BASE = 10000.0  # RoPE: theta_i = ROTARY_BASE^(-2i / head_dim)
ROTARY_MARGIN = 10  # rotary tables cover sequence_len * 10 positions: generation may run past the training length
# Positions per chunk of the chunked lm_head + loss (GPT.chunked_logits): at a 65,536 vocabulary a float32 chunk of
# logits is 1 GiB, instead of 8.6 GiB for a whole 16 x 2048 micro-batch (and as much again for each saved copy).
LOGITS_CHUNK_TOKENS = 4096


@dataclass
class GPTConfig:
    sequence_len: int = 2048  # training context length
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6  # query heads
    n_kv_head: int = 6  # key/value heads; n_head must be a multiple (n_kv_head < n_head is grouped-query attention)
    n_embd: int = 768

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"head_dim={self.n_embd // self.n_head} is odd; rotary embeddings rotate pairs of dims")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")

    @classmethod
    def from_depth(cls, depth, vocab_size, sequence_len=2048, aspect_ratio=64, head_dim=64):
        """
        The one-dial model family: n_layer = depth, n_embd = depth * aspect_ratio rounded up to a multiple of
        head_dim, n_head = n_kv_head = n_embd / head_dim. Width grows linearly with depth, so parameters grow
        ~ depth^3 (12 * depth * n_embd^2 in the blocks). E.g. depth 4 -> n_embd 256, 4 heads; depth 20 -> 1280,
        20 heads.
        """
        n_embd = math.ceil(depth * aspect_ratio / head_dim) * head_dim
        n_head = n_embd // head_dim
        return cls(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head,
                   n_kv_head=n_head, n_embd=n_embd)


def norm(x):
    """RMSNorm without learnable scale: x / sqrt(mean(x^2) + eps) over the last dim."""
    return F.rms_norm(x, (x.size(-1),))


def autocast_dtype(x):
    """x cast to the dtype autocast runs matmuls in (bf16 on CUDA) when autocast is on for x's device, else x."""
    if not torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(torch.get_autocast_dtype(x.device.type))


class Bf16Linear(torch.autograd.Function):
    """
    y = x W^T with x and W rounded to bf16 and y in float32, forward and backward: the matmul at bf16's tensor-core
    rate, its products exact in float32 (a bf16 product has 16 significant bits) and its sums accumulated and returned
    in float32, so y is not rounded to bf16's grid. Backward: dx = g W and dW = g^T x with g rounded to bf16, dW
    returned in float32 for the float32 weight. On CUDA the matmuls are torch.mm(out_dtype=float32) (cuBLAS's bf16
    GEMM with a float32 output), which has no derivative in torch 2.13, hence this Function; elsewhere the same values
    from a float32 matmul of the rounded inputs.
    """

    @staticmethod
    def forward(ctx, x, weight):
        x16, w16 = x.to(torch.bfloat16), weight.to(torch.bfloat16)
        ctx.save_for_backward(x16, w16)
        ctx.x_dtype = x.dtype
        return mm_float32(x16.reshape(-1, x.size(-1)), w16.t()).view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, grad):
        x16, w16 = ctx.saved_tensors
        g16 = grad.reshape(-1, grad.size(-1)).to(torch.bfloat16)  # (N, V)
        grad_x = (g16 @ w16).view(x16.shape).to(ctx.x_dtype)  # (N, V) @ (V, C)
        grad_w = mm_float32(g16.t(), x16.reshape(-1, x16.size(-1)))  # (V, N) @ (N, C)
        return grad_x, grad_w


def mm_float32(a, b):
    """a @ b of bf16 matrices with float32 sums and output (see Bf16Linear)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def apply_rotary(x, cos, sin):
    """
    Rotate each pair (x1[i], x2[i]) = (x[..., i], x[..., i + D/2]) by the angle pos * theta_i:
        y1 = x1 cos + x2 sin,   y2 = -x1 sin + x2 cos.
    x: (B, T, H, D); cos, sin: (B or 1, T, 1, D/2).
    """
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def shared_prefix_attention(q, k, v, attn_mask, prefix_k, prefix_v, prefix_mask):
    """
    One decode step's attention when each group of R consecutive rows (one prompt's samples) shares its prompt's
    keys and values: row b of group g = b // R attends over the concatenation of the group's prefix keys and its own
    keys,
        y_b = sum_j softmax_j(s_j) v_j   over j in [prefix of g; own slots of b],   s_j = q_b . k_j / sqrt(D),
    which is attention over the row's whole sequence (SDPA over a cache holding the prompt in every row), computed
    with the prompt's keys and values read once per group instead of once per row. That is what makes it faster:
    one-token decoding is bound by reading the cache, and for one prompt x 16 samples the prompt is half of it
    (bench/engine.py). Written as broadcast products and sums, which torch.compile fuses into kernels that read
    each cached key and value once; scores and softmax in float32.
    q (B, 1, H, D); k, v (B, S, n_kv_head, D), the rows' own slots; attn_mask None (every own slot is visible) or
    (B or 1, 1, 1, S) bool; prefix_k, prefix_v (G, P, n_kv_head, D), B = G R; prefix_mask (G, P) bool, True at a
    group's prompt tokens. Returns y (B, 1, H, D). GQA: query head h reads kv head h // (H / n_kv_head).
    """
    B, _, H, D = q.shape
    G, P, n_kv_head, _ = prefix_k.shape
    R, rep = B // G, H // n_kv_head
    q = q.float().view(B, n_kv_head, rep, D) / math.sqrt(D)
    own = (q[:, None] * k.float()[:, :, :, None]).sum(-1)  # (B, S, n_kv_head, rep)
    if attn_mask is not None:
        own = own.masked_fill(~attn_mask.view(-1, own.size(1), 1, 1), float("-inf"))
    shared = (q.view(G, R, 1, n_kv_head, rep, D) * prefix_k.float()[:, None, :, :, None]).sum(-1)  # (G, R, P, ...)
    shared = shared.masked_fill(~prefix_mask[:, None, :, None, None], float("-inf")).view(B, P, n_kv_head, rep)
    weights = torch.cat([shared, own], dim=1).softmax(dim=1)  # (B, P + S, n_kv_head, rep)
    w_shared, w_own = weights[:, :P].view(G, R, P, n_kv_head, rep, 1), weights[:, P:, ..., None]
    y = (w_shared * prefix_v.float()[:, None, :, :, None]).sum(2).view(B, n_kv_head, rep, D) \
        + (w_own * v.float()[:, :, :, None]).sum(1)  # (B, n_kv_head, rep, D)
    return y.view(B, 1, H, D).to(v.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx  # which layer of the KV cache this module reads and writes
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, cos, sin, attn_mask, kv_cache):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        # QK-norm keeps attention logits bounded; normalising then rotating = rotating then normalising.
        q, k = apply_rotary(norm(q), cos, sin), apply_rotary(norm(k), cos, sin)
        # CUDA autocast runs rms_norm in float32 (it is on autocast's fp32 list): back to the values' dtype (bf16), so
        # attention runs in one dtype and the KV cache does not hold float32 keys next to bf16 values.
        q, k = q.to(v.dtype), k.to(v.dtype)
        if kv_cache is not None:
            k, v = kv_cache.insert(self.layer_idx, k, v)  # (B, S, n_kv_head, D): all cached keys, new ones included
            prefix = kv_cache.shared_prefix(self.layer_idx)  # keys and values one prompt's rows share, or None
            if prefix is not None:
                return self.c_proj(shared_prefix_attention(q, k, v, attn_mask, *prefix).view(B, T, C))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T or S, D)
        # attn_mask (B or 1, 1, T, S) says which cached keys each query sees (its row's keys up to its own position);
        # None means plain causal attention among the T tokens (S = T), or, for a single token, attend to all S.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None and T > 1,
                                           enable_gqa=self.n_kv_head != self.n_head)  # (B, n_head, T, D)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        # r * r, not r.square(): CUDA autocast runs pow in float32, which saves float32 copies for backward.
        r = F.relu(self.c_fc(x))  # (B, T, 4C)
        return self.c_proj(r * r)


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, attn_mask, kv_cache):
        # Cast once: c_q, c_k and c_v (and c_fc) would each cast the float32 norm output to bf16 and keep their copy.
        x = x + self.attn(autocast_dtype(norm(x)), cos, sin, attn_mask, kv_cache)
        return x + self.mlp(autocast_dtype(norm(x)))


class GPT(nn.Module):
    def __init__(self, config):
        """
        Builds the modules only; call init_weights() to initialise a model for training. Works under
        `torch.device("meta")`: then move with to_empty(device=...) and call init_weights(), which also
        fills the (non-persistent) rotary tables.
        """
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.rotary_len = config.sequence_len * ROTARY_MARGIN  # longest position the tables cover
        cos, sin = self._rotary_tables()
        # Derived from the config, not learned: kept out of the state dict.
        self.register_buffer("cos", cos, persistent=False)  # (rotary_len, head_dim / 2)
        self.register_buffer("sin", sin, persistent=False)

    def _rotary_tables(self, base=ROTARY_BASE):
        """cos and sin of pos * theta_i with theta_i = base^(-2i / head_dim), for pos < rotary_len."""
        head_dim = self.config.n_embd // self.config.n_head
        device = self.wte.weight.device
        theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        angles = torch.outer(torch.arange(self.rotary_len, dtype=torch.float32, device=device), theta)
        return angles.cos(), angles.sin()

    @torch.no_grad()
    def init_weights(self):
        """
        Embedding ~ N(0, 1) (it is RMS-normalised right away); input projections ~ N(0, 1/fan_in) so activations
        keep unit scale; output projections (attn.c_proj, mlp.c_proj) zero, so every block starts as the identity
        and the residual stream is the normalised embedding; lm_head ~ N(0, 0.001^2) so the first logits are near
        uniform (initial loss ~ ln(vocab_size)).
        """
        nn.init.normal_(self.wte.weight, std=1.0)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        for block in self.blocks:
            for linear in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                nn.init.normal_(linear.weight, std=linear.in_features ** -0.5)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
        self.cos, self.sin = self._rotary_tables()

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self):
        """
        Training FLOPs per token (forward + backward), Chinchilla / nanochat accounting:
            6 * N_matmul + 12 * n_layer * n_embd * sequence_len
        6 * N: each weight of a matmul costs 2 FLOPs (multiply-add) forward and 4 backward. N_matmul excludes the
        embedding table (a lookup, not a matmul) but includes lm_head. Attention scores q.k and the weighted sum of v
        add 2 * 2 * T * n_embd forward per token and layer (T = sequence_len keys, causal masking not discounted),
        times 3 for forward + backward.
        """
        n_matmul = self.num_params() - self.wte.weight.numel()
        c = self.config
        return 6 * n_matmul + 12 * c.n_layer * c.n_embd * c.sequence_len

    def setup_optimizers(self, matrix_lr, embedding_lr, unembedding_lr, weight_decay=0.0, adam_betas=(0.8, 0.95)):
        """
        [AdamW, Muon]: AdamW for the token embedding (embedding_lr) and lm_head (unembedding_lr), Muon (matrix_lr)
        for every matrix inside the blocks; `weight_decay` is decoupled (W <- W (1 - lr wd)) in both. Every param
        group carries "initial_lr", so a training loop sets group["lr"] = group["initial_lr"] * lr_multiplier(step).

        The AdamW learning rates are scaled by (n_embd / 768)^-0.5, as nanochat does (its values were tuned at width
        768). Why: Adam moves every entry by ~lr whatever the gradient's size, so a logit z = h . w, a sum over n_embd
        entries of an RMS-normalised h, changes by ~lr sqrt(n_embd) when the entries' updates are uncorrelated; the
        scale keeps that change the same at every width. Muon needs no such scale: its orthogonalized update has a
        fixed spectral size whatever the width.
        """
        matrix_params = list(self.blocks.parameters())
        embedding_params = list(self.wte.parameters())
        lm_head_params = list(self.lm_head.parameters())
        if len(matrix_params) + len(embedding_params) + len(lm_head_params) != len(list(self.parameters())):
            raise RuntimeError("setup_optimizers does not cover every parameter: a new module needs an optimizer group")
        width_scale = (self.config.n_embd / 768) ** -0.5
        adam_groups = [dict(params=lm_head_params, lr=unembedding_lr * width_scale),
                       dict(params=embedding_params, lr=embedding_lr * width_scale)]
        adamw = torch.optim.AdamW(adam_groups, betas=adam_betas, eps=1e-10, weight_decay=weight_decay,
                                  fused=self.lm_head.weight.is_cuda)
        muon = Muon(matrix_params, lr=matrix_lr, momentum=0.95, weight_decay=weight_decay)
        optimizers = [adamw, muon]
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["initial_lr"] = group["lr"]
        return optimizers

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean", logits_chunk=LOGITS_CHUNK_TOKENS):
        """
        idx: (B, T) token ids. Returns float32 logits (B, T, V) when targets is None, else the cross-entropy of
        targets (B, T) with ignore_index=-1: a scalar for loss_reduction "mean" (over non-ignored tokens) or "sum",
        per-token losses (B, T) for "none" (0 where the target is -1).
        kv_cache (engine.KVCache): the tokens continue each row's cached sequence at that row's own position, their
        keys/values are appended, and the cache advances by T.
        logits_chunk: with targets, when B * T exceeds it the loss is computed logits_chunk positions at a time
        (chunked_logits), so the (B, T, V) float32 logits never exist whole; None: always whole (pretraining's
        compiled step, which fits and is spared the chunks' recomputation).
        """
        B, T = idx.size()
        h = self.hidden(idx, kv_cache)  # (B, T, C)
        if targets is None:
            return self.head(h)
        if loss_reduction not in ("mean", "sum", "none"):
            raise ValueError(f"loss_reduction must be 'mean', 'sum' or 'none', got {loss_reduction!r}")
        if logits_chunk is not None and B * T > logits_chunk:
            losses, = self.chunked_logits(h, partial(F.cross_entropy, ignore_index=-1, reduction="none"), targets,
                                          chunk_tokens=logits_chunk)  # (B, T)
            if loss_reduction == "none":
                return losses
            return losses.sum() / (targets != -1).sum() if loss_reduction == "mean" else losses.sum()
        logits = self.head(h)  # (B, T, V)
        loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-1,
                               reduction=loss_reduction)
        return loss.view(B, T) if loss_reduction == "none" else loss

    def hidden(self, idx, kv_cache=None):
        """
        The final normalised hidden states (B, T, C) of idx (B, T): what lm_head reads, and ScalarHeadModel's head
        too. See forward for kv_cache.
        """
        B, T = idx.size()
        if kv_cache is None:
            if T > self.rotary_len:
                raise ValueError(f"sequence of {T} tokens is longer than the rotary tables ({self.rotary_len})")
            positions = torch.arange(T, device=idx.device)[None]  # (1, T)
            attn_mask = None
        else:
            # A cache never holds more than max_len tokens per row (insert refuses), so every position is below it.
            if kv_cache.max_len > self.rotary_len:
                raise ValueError(f"a KV cache of {kv_cache.max_len} tokens per row reaches beyond the rotary tables "
                                 f"({self.rotary_len} = sequence_len * {ROTARY_MARGIN})")
            positions = kv_cache.positions(T)  # (B, T)
            attn_mask = kv_cache.attn_mask(T)  # (B or 1, 1, T, S) or None
        x = norm(self.wte(idx))  # (B, T, C)
        cos = self.cos[positions][:, :, None]  # (B or 1, T, 1, D/2), broadcast over heads
        sin = self.sin[positions][:, :, None]
        for block in self.blocks:
            x = block(x, cos, sin, attn_mask, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        return norm(x)

    def head(self, h):
        """
        Soft-capped float32 logits (..., V) of hidden states h (..., C): the one head of the engine's sampling
        distribution and of the learner's log-probs (both reach it through forward or chunked_logits).
        The logits are float32 even under bf16 autocast: a bf16 output would put every logit, and so every log-prob,
        on a grid of ~0.03-0.06 at logits of 4-8, and the engine's one-token decode and the learner's full forward
        would land on different grid points. Under bf16 autocast the matmul itself takes bf16 inputs (Bf16Linear:
        bf16's tensor-core rate, float32 sums and output); without autocast it is float32 throughout.
        The soft-cap cap * tanh(z / cap) is computed as 2 cap * sigmoid(2 z / cap) - cap (tanh x = 2 sigmoid(2x) - 1,
        equal up to float rounding): on CPU torch.sigmoid runs ~3.5x faster than torch.tanh, ~1.5 ms of a 64-row
        decode step at vocabulary 8,192 (bench/engine.py).
        """
        bf16 = torch.is_autocast_enabled(h.device.type) and torch.get_autocast_dtype(h.device.type) == torch.bfloat16
        with torch.autocast(h.device.type, enabled=False):
            if bf16:
                logits = Bf16Linear.apply(h, self.lm_head.weight)  # (..., V) float32
            else:
                logits = F.linear(h.float(), self.lm_head.weight.float())
        return torch.sigmoid(logits * (2 / LOGIT_SOFTCAP)) * (2 * LOGIT_SOFTCAP) - LOGIT_SOFTCAP

    def chunked_logits(self, h, fn, *per_token, chunk_tokens=None):
        """
        fn(logits, *per_token) for the B * T positions of h (B, T, C), chunk_tokens (default LOGITS_CHUNK_TOKENS)
        positions at a time: fn gets
        logits (N, V) of N <= chunk_tokens positions and the matching rows of each per_token tensor (B, T, ...)
        flattened to (N, ...), and returns one tensor (N, ...) or a tuple of them. Returns a tuple of the outputs
        reshaped to (B, T, ...).
        Why: the logits of a long micro-batch are the largest tensors of a step (16 x 2048 positions x 65,536 tokens
        = 8.6 GB in float32, several copies kept for backward). With gradients on, each chunk runs under activation
        checkpointing: only its hidden states are kept, and backward recomputes its logits one chunk at a time, at
        the cost of a second lm_head forward (2 * n_embd * V FLOPs per position). Values and gradients are those of
        fn applied to the whole (B, T, V) logits.
        """
        B, T, C = h.shape
        chunk_tokens = chunk_tokens or LOGITS_CHUNK_TOKENS
        flat = h.reshape(B * T, C)
        extras = [t.reshape(B * T, *t.shape[2:]) for t in per_token]

        def piece(h_chunk, *extra_chunks):
            return fn(self.head(h_chunk), *extra_chunks)

        outputs = []
        for start in range(0, B * T, chunk_tokens):
            args = (flat[start:start + chunk_tokens], *(e[start:start + chunk_tokens] for e in extras))
            # preserve_rng_state=False: nothing random runs in the head, no RNG state to stash per chunk.
            out = (checkpoint(piece, *args, use_reentrant=False, preserve_rng_state=False) if torch.is_grad_enabled()
                   else piece(*args))
            outputs.append(out if isinstance(out, tuple) else (out,))
        return tuple(torch.cat(parts).view(B, T, *parts[0].shape[1:]) for parts in zip(*outputs))


def training_memory(config, micro_batch_tokens, logits_chunk=LOGITS_CHUNK_TOKENS, ddp=True, trainable=None):
    """
    Analytic peak memory of one training process in bytes (tensors only, what torch.cuda.max_memory_allocated
    counts: the CUDA context and allocator slack come on top), for a micro-batch of N = micro_batch_tokens padded
    positions, fp32 weights and bf16 autocast, eager (no torch.compile). Returns a dict of the terms and "total":

      weights      4 P                      fp32 parameters, P = 2 V C + L (2 + 2 f + 8) C^2
      autocast     2 P_blocks + 2 V C       bf16 copies of the matmul weights autocast keeps during forward
      grads        4 P                      fp32 gradients (+ 4 P more with ddp: DDP's gradient buckets)
      optimizer    8 (2 V C) + 4 P_blocks   AdamW's two moments for wte and lm_head, Muon's momentum for the blocks
      activations  N (L (36 + 8 f) + 14) C     saved for backward; per layer and position, in bytes per channel:
                   attention 14 + 8 f (fp32 residual into the norm 4, its bf16 copy 2 that c_q/c_k/c_v share,
                   fp32 copies of q and k that QK-norm normalises 4 + 4 f, bf16 rotated q, k and v 2 + 4 f,
                   attention output 2), MLP 22 (residual 4, bf16 norm 2, ReLU output 8, its square 8); outside the
                   blocks at most 14 (embedding 4, final norm's input 4, its output 4 or its bf16 copy 2)
      logits       22 V min(N, logits_chunk)   per live position: bf16 lm_head output 2, its fp32 copy 4, soft-cap 4,
                   log-softmax 4, the logits' gradient 4 and the gradient through the cap 4; all N positions at
                   once when logits_chunk is None (GPT.forward's whole path), one chunk with chunked_logits

    with C = n_embd, L = n_layer, V = vocab_size, f = n_kv_head / n_head. The block's coefficients are the bytes
    autograd saves in Block.forward under bf16 autocast (tests/test_memory.py counts them with saved_tensors_hooks;
    the few bytes per head and position of norms' and attention's statistics are left out); flash attention keeps
    only its output and log-sum-exp, no (T, T) scores.
    trainable: LoRA's adapter parameters (lora_params) when only they train: their fp32 weights come on top,
    gradients are 4 trainable (x2 with ddp) and AdamW's two moments 8 trainable instead of the full model's terms;
    activations are counted as for full fine-tuning (an upper bound: the adapters keep their inputs, the frozen
    weights need none for their own gradients).
    """
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    f = config.n_kv_head / config.n_head
    block_params = L * (2 + 2 * f + 8) * C * C
    params = 2 * V * C + block_params
    N = micro_batch_tokens
    terms = {
        "weights": 4 * (params + (trainable or 0)),
        "autocast": 2 * block_params + 2 * V * C,
        "grads": 4 * (params if trainable is None else trainable) * (2 if ddp else 1),
        "optimizer": 8 * 2 * V * C + 4 * block_params if trainable is None else 8 * trainable,
        "activations": N * (L * (36 + 8 * f) + 14) * C,
        "logits": 22 * V * (N if logits_chunk is None else min(N, logits_chunk)),
    }
    terms = {name: int(value) for name, value in terms.items()}
    terms["total"] = sum(terms.values())
    return terms


# -----------------------------------------------------------------------------
# LoRA: low-rank adapters on the blocks' linear layers, the base weights frozen (Hu et al. 2021)

LORA_TARGETS = ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
LORA_LR = 1e-3  # the adapters' AdamW learning rate unless --lora-lr says otherwise (the LoRA paper's order)


class LoRA(nn.Module):
    """
    Low-rank adapters (Hu et al. 2021, "LoRA"): every target linear layer W (out, in) of every block computes

        y = W x + (alpha / r) B A x,     A (r, in) ~ N(0, 1 / in),  B (out, r) = 0

    with W frozen and only A, B trained. B = 0 makes the adapted model exactly the base at initialisation; alpha / r
    sets the update's scale (default alpha = r: scale 1). The adapters sit in forward hooks of the unchanged
    nn.Linear modules, so the GPT's own parameter names stay those of every checkpoint, and `model.lora` (this
    module, registered on the model) holds A and B: model.parameters() yields them (gradient clipping, all-reduce)
    and .to() moves them. Switched off (`with lora.disabled():`) the model is the base exactly: DPO's and RL's
    reference.
    merged() is a plain GPT with W + (alpha / r) B A, the checkpoint every other script loads unchanged.
    """

    def __init__(self, model, rank, alpha=None, targets=LORA_TARGETS):
        super().__init__()
        unknown = sorted(set(targets) - set(LORA_TARGETS))
        if rank < 1 or unknown:
            raise ValueError(f"LoRA needs rank >= 1 (got {rank}) and targets among {', '.join(LORA_TARGETS)}"
                             + (f" (got {', '.join(unknown)})" if unknown else ""))
        self.rank, self.alpha, self.targets = rank, float(alpha or rank), tuple(targets)
        self.scale = self.alpha / rank
        self.enabled = True
        model.requires_grad_(False)
        self.names = [f"blocks.{i}.{target}" for i in range(len(model.blocks)) for target in self.targets]
        linears = [model.get_submodule(name) for name in self.names]
        device = model.lm_head.weight.device
        self.a = nn.ParameterList([nn.Parameter(torch.randn(rank, m.in_features, device=device) * m.in_features ** -0.5)
                                   for m in linears])
        self.b = nn.ParameterList([nn.Parameter(torch.zeros(m.out_features, rank, device=device)) for m in linears])
        for linear, a, b in zip(linears, self.a, self.b):
            linear.register_forward_hook(partial(self._adapt, a, b))
        model.lora = self

    def _adapt(self, a, b, module, inputs, output):
        if not self.enabled:
            return output
        return output + F.linear(F.linear(inputs[0], a), b) * self.scale  # (..., in) -> (..., r) -> (..., out)

    @contextmanager
    def disabled(self):
        """A context in which the model runs without its adapters: the base model, exactly."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def num_trainable(self):
        return sum(p.numel() for p in self.parameters())

    def optimizers(self, lr):
        """[AdamW] over the adapters (the base is frozen); each group carries "initial_lr" like setup_optimizers'."""
        adamw = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.0)
        for group in adamw.param_groups:
            group["initial_lr"] = group["lr"]
        return [adamw]

    def meta(self):
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "params": self.num_trainable()}

    @torch.no_grad()
    def merged(self, model):
        """A plain GPT (eval mode) with weights W + (alpha / r) B A: the adapted model without hooks."""
        state = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("lora.")}
        for name, a, b in zip(self.names, self.a, self.b):
            state[f"{name}.weight"] += self.scale * (b @ a)
        merged = GPT(model.config).to(model.lm_head.weight.device)
        merged.load_state_dict(state, strict=True)
        return merged.eval()

    def extra_repr(self):
        return f"LoRA rank {self.rank}, alpha {self.alpha:g}, targets {','.join(self.targets)}"


def add_lora_flags(parser):
    """The LoRA flags every chat stage takes (sft, dpo, rl, distill)."""
    add = parser.add_argument
    add("--lora-rank", type=int, default=None,
        help="train rank-r LoRA adapters (model.LoRA) with AdamW instead of every weight; the base stays frozen and "
             "the checkpoint holds the adapters and the merged weights (default: full fine-tuning)")
    add("--lora-alpha", type=float, default=None, help="LoRA scale numerator: updates are (alpha / r) B A (default r)")
    add("--lora-targets", default=None,
        help=f"comma-separated linear layers of every block to adapt (default all: {','.join(LORA_TARGETS)})")
    add("--lora-lr", type=float, default=None,
        help=f"the adapters' AdamW learning rate (default {LORA_LR:g}); with LoRA, --lr-frac does not apply")


def check_lora_flags(parser, args):
    """Refuse LoRA options without --lora-rank and --lr-frac with it; fill the defaults. Call before presets fill."""
    given = [flag for flag in ("lora_alpha", "lora_targets", "lora_lr") if getattr(args, flag) is not None]
    if args.lora_rank is None and given:
        parser.error(f"--{given[0].replace('_', '-')} needs --lora-rank")
    if args.lora_rank is None:
        return
    if getattr(args, "lr_frac", None) is not None:
        parser.error("--lr-frac scales the full fine-tuning learning rates; with --lora-rank use --lora-lr")
    targets = tuple(args.lora_targets.split(",")) if args.lora_targets else LORA_TARGETS
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if args.lora_rank < 1 or unknown:
        parser.error(f"--lora-rank must be >= 1 and --lora-targets among {','.join(LORA_TARGETS)}"
                     + (f" (got {','.join(unknown)})" if unknown else ""))
    args.lora_targets = ",".join(targets)
    args.lora_lr = LORA_LR if args.lora_lr is None else args.lora_lr


def lora_checkpoint(model, lora, meta, extra=None):
    """
    The model, meta and extra keywords of common.save_checkpoint. Without LoRA as given; with it the merged weights
    are the checkpoint's model (every script and merge.py load it unchanged) and the adapters (extra["lora"]) and their
    settings (meta["lora"]) ride along for --resume, which rebuilds the base from --ckpt and loads them back.
    """
    if lora is None:
        return dict(model=model, meta=meta, extra=extra)
    return dict(model=lora.merged(model), meta={**meta, "lora": lora.meta()},
                extra={**(extra or {}), "lora": lora.state_dict()})


def lora_params(config, rank, targets=LORA_TARGETS):
    """The adapter parameters of LoRA(rank, targets) on a GPT of this config: r (in + out) per adapted linear."""
    C, kv = config.n_embd, config.n_kv_head * (config.n_embd // config.n_head)
    sizes = {"attn.c_q": C + C, "attn.c_k": C + kv, "attn.c_v": C + kv, "attn.c_proj": C + C, "mlp.c_fc": C + 4 * C,
             "mlp.c_proj": 4 * C + C}
    return config.n_layer * rank * sum(sizes[target] for target in targets)


def trainable_params(config, args):
    """For a stage's plan(): the parameters --lora-rank/--lora-targets train (lora_params), or None (all of them)."""
    if getattr(args, "lora_rank", None) is None:
        return None
    return lora_params(config, args.lora_rank, args.lora_targets.split(","))


def attach_lora(model, args):
    """LoRA adapters on `model` as --lora-rank/--lora-alpha/--lora-targets say, or None without --lora-rank."""
    if args.lora_rank is None:
        return None
    return LoRA(model, args.lora_rank, args.lora_alpha, args.lora_targets.split(","))


# -----------------------------------------------------------------------------
# A GPT trunk with a scalar head: the reward model (rm.py, read at the answer's last token) and PPO's critic
# (ppo.py's critic, read at every token)


class ScalarHeadModel(nn.Module):
    """
    s_t = w . h_t + b, where h_t = gpt.hidden(idx)[:, t] is the normalised final hidden state after token t.
    The GPT keeps its lm_head (unused here and frozen, so AdamW leaves it alone): the checkpoint is
    then a plain GPT state dict plus `head.*`, and merge.py averages reward models like any other checkpoint.
    The head starts at zero: every score is 0 until training moves it (a critic's neutral first guess).
    """

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt
        # Frozen: DistributedDataParallel waits for a gradient of every parameter that requires one, and lm_head
        # never gets one here (rm.py under torchrun stopped at its second step, with part of the first unaveraged).
        gpt.lm_head.requires_grad_(False)
        self.head = nn.Linear(gpt.config.n_embd, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @property
    def config(self):
        return self.gpt.config

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx):
        """
        idx (B, T) -> scores (B, T) float32: the head read after every token. The head runs in float32 even under
        bf16 autocast: a score is one number whose small differences are the signal (bf16 keeps 8 bits of it).
        """
        hidden = self.gpt.hidden(idx)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return self.head(hidden.float()).squeeze(-1)

    def setup_optimizers(self, matrix_lr, embedding_lr, unembedding_lr, weight_decay=0.0, head_lr_mult=1.0):
        """
        The trunk's [AdamW, Muon] (GPT.setup_optimizers), with the head in the AdamW (its last group) at lm_head's
        learning rate times head_lr_mult: a zero-started head has further to travel than the trunk (rm.py: 10).
        """
        adamw, muon = self.gpt.setup_optimizers(matrix_lr, embedding_lr, unembedding_lr, weight_decay)
        lr = adamw.param_groups[0]["lr"] * head_lr_mult  # lm_head's, already width-scaled: the head is a 1-row lm_head
        adamw.add_param_group(dict(params=list(self.head.parameters()), lr=lr, initial_lr=lr))
        return [adamw, muon]


# -----------------------------------------------------------------------------
# Optimizers: Muon for the hidden 2-D matrices, AdamW for the embedding and lm_head


def orthogonalize(G, steps=5):
    """
    Approximately replace G (rows x cols) by the nearest semi-orthogonal matrix U V^T, where G = U S V^T, with the
    quintic Newton–Schulz iteration of Muon (Keller Jordan, "Muon: An optimizer for hidden layers in neural
    networks", 2024, https://kellerjordan.github.io/posts/muon/; also nanochat/muon.py):

        X_0 = G / ||G||_F,  X_{k+1} = a X_k + (b A + c A^2) X_k,   A = X_k X_k^T;  (a, b, c) = (3.4445, -4.775, 2.0315)

    Each step maps every singular value s of X through p(s) = a s + b s^3 + c s^5, which pushes all of (0, 1] towards 1
    (the coefficients trade exactness for speed: after 5 steps the singular values lie in roughly [0.7, 1.2], which
    works as well as the exact U V^T in training; a singular value below ~1/500 of ||G||_F stays smaller, as five
    steps grow it by at most a^5 ~ 485). Dividing by the Frobenius norm first puts every s in (0, 1].
    Runs in bf16 on CUDA (the iteration is stable there and it is the fast path) and fp32 elsewhere.
    """
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.to(torch.bfloat16 if G.is_cuda else torch.float32)
    transposed = G.size(-2) > G.size(-1)
    if transposed:  # iterate on the wide orientation: A = X X^T is then the smaller (rows x rows) Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    if transposed:
        X = X.mT
    return X.to(G.dtype)


class Muon(torch.optim.Optimizer):
    """
    MomentUm Orthogonalized by Newton–Schulz, for 2-D weight matrices (Keller Jordan 2024; nanochat/muon.py).
    Per matrix W (rows x cols) with gradient g, momentum beta and Nesterov look-ahead:

        m <- beta m + (1 - beta) g
        u <- (1 - beta) g + beta m                         (Nesterov; plain momentum uses u = m)
        W <- W (1 - lr wd) - lr sqrt(max(1, rows / cols)) orthogonalize(u)

    The orthogonalized update has all its singular values near 1: every direction of the update moves by the
    same amount, however ill-conditioned the raw gradient is. sqrt(max(1, rows / cols)) gives tall matrices
    (e.g. the MLP's (4d, d) input projection) the same per-entry update RMS as square ones.
    By the batch: matrices of one shape (e.g. every layer's c_q) are stacked and orthogonalized in one batched
    Newton–Schulz call, not one call per matrix (a depth-20 model has 120 matrices but only 3 shapes).
    Under DDP the gradients arrive already averaged, so every rank would compute the same update: instead each rank
    orthogonalizes its 1/world_size share of every stack and the shares are all-gathered (nanochat's DistMuon shares
    the work the same way). The momentum buffers stay on every rank, so rank 0's state dict is the whole state.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0):
        params = list(params)
        for p in params:
            if p.ndim != 2:
                raise ValueError(f"Muon only updates 2-D matrices; got a parameter of shape {tuple(p.shape)} "
                                 "(give embeddings, norms and vectors to AdamW)")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta = group["momentum"]
            stacks = {}  # shape -> ([params], [Nesterov momenta])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                m = state["momentum_buffer"]
                m.lerp_(p.grad, 1 - beta)
                u = p.grad.lerp(m, beta) if group["nesterov"] else m
                stack = stacks.setdefault(p.shape, ([], []))
                stack[0].append(p)
                stack[1].append(u)
            for (rows, cols), (params, momenta) in stacks.items():
                updates = orthogonalize_shared(torch.stack(momenta), group["ns_steps"])  # (n, rows, cols)
                scale = max(1.0, rows / cols) ** 0.5
                for p, update in zip(params, updates):
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update, alpha=-group["lr"] * scale)


def orthogonalize_shared(U, steps=5):
    """
    orthogonalize() of a stack U (n, rows, cols), shared across the DDP ranks: rank r orthogonalizes matrices
    r * k .. (r + 1) * k - 1, k = ceil(n / world_size), in one batched call, and all-gather gives every rank all n
    (the stack is padded with zero matrices to k * world_size; they orthogonalize to zero). One process: one call.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return orthogonalize(U, steps)
    world, rank = dist.get_world_size(), dist.get_rank()
    n = U.size(0)
    k = -(-n // world)
    padded = torch.cat([U, U.new_zeros(k * world - n, *U.shape[1:])])
    gathered = torch.empty_like(padded)
    shares = list(gathered.chunk(world))  # contiguous views, filled in place by all_gather
    dist.all_gather(shares, orthogonalize(padded[rank * k:(rank + 1) * k], steps).contiguous())
    return gathered[:n]

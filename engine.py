"""
Generation: the KV cache, the sampling distribution, the calculator tool, and a chat CLI.

    python engine.py --ckpt ~/.cache/nanopost/checkpoints/sft                    # chat (streaming, multi-turn)
    python engine.py --ckpt ~/.cache/nanopost/checkpoints/sft --prompt "What is 12*7?"   # answer once and exit

Engine.generate(prompts, num_samples): each prompt is prefilled once (batch 1) and its cache copied into its
num_samples rows; then every row of every prompt decodes together, one token per step, each row at its own
position. A row stops at <|assistant_end|> (or <|bos|>) or after max_tokens tokens; once half of the rows have
stopped, the eager step drops them from its cache (KVCache.keep_rows), so a few long answers do not keep every
finished row in the matmuls. When a row closes a calculator call <|python_start|>expr<|python_end|>, the engine
evaluates expr and forces <|output_start|>result<|output_end|> into that row, one token per step, with mask 0 (the
model never chose them, so RL must not train on them).
DecodeBatch (the end of this file) is the same decoding for requests that join and leave between steps (continuous
batching), each with its own Sampling (settings and seed): serve.py decodes concurrent requests with it.
Each step samples with sample_tokens (inverse CDF, one seeded uniform per row) from sampling_logits's distribution.
Two decode steps compute the same logits: the eager one on a KVCache (the reference), and the compiled one
(Engine(compiled=True), the default on CUDA) on a StaticKVCache the Engine keeps for its next call of the same shape,
with the one-token forward compiled by torch.compile (CUDA graphs on CUDA), and each prompt's keys and values stored
once for all its samples (shared_prefix_attention in model.py). On CPU the compiled step decodes 1.3-1.8x faster
than the eager one once compiled (bench/engine.py), but its compiles take 10-70 s per process, more than a
tiny-preset stage decodes for (the tiny RL stage's rollouts, 20 calls of 16 prompts x 8 samples x 48 tokens: eager
21.5 s; compiled 75 s, of which ~60 s compiling and 10.1 s for the 16 calls eager takes 17.9 s for), so eager stays
the CPU default.
"""

import argparse
import ast
import math
import operator
import re
import sys
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# KV cache

# Where Engine decodes with the compiled step by default (device type -> bool); see bench/engine.py for the numbers.
COMPILED_DEFAULT = {"cuda": True, "cpu": False}
STATIC_LEN_MULTIPLE = 128  # StaticKVCache lengths are rounded up to a multiple of this (powers of two below it)
COMPILED_GRAPH_LIMIT = 64  # graphs of the compiled decode step torch.compile may keep (Engine raises its limit to this)


class KVCache:
    """
    Keys and values of every layer for B rows that may hold different numbers of tokens (prompts of different
    lengths decoding in one batch). Rows are right-aligned: every row's last token sits in slot filled - 1, so row b
    holds its lengths[b] tokens in slots filled - lengths[b] .. filled - 1 and every row writes its next T tokens to
    the same slots filled .. filled + T - 1 (one contiguous in-place copy per layer, no per-row indexing). A token's
    rotary position is its index in its own row (lengths[b] + t), and it sees its row's slots up to its own.
    When all rows hold the same number of tokens (one prompt x num_samples rows, the RL case) there is no padding and
    a one-token step needs no attention mask at all, which lets SDPA take its fused kernels; otherwise the padding
    mask (B, 1, 1, max_len) is built once and each step uses a slice of it.
    Per-layer storage (B, max_len, n_kv_head, head_dim) is allocated on the first insert, in the dtype the model
    computes in (bf16 under autocast). GPT.forward calls positions, attn_mask, insert (per layer) and advance.
    """

    def __init__(self, batch_size, max_len, n_layer, device):
        self.max_len = max_len
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,) tokens cached per row
        self.filled = 0  # slots in use (= max(lengths)), kept on the host so that no step waits on the device
        self.padding = None  # (B, 1, 1, max_len) bool, True at a row's real slots; None: no row is padded
        self.keys = [None] * n_layer  # per layer (B, max_len, n_kv_head, head_dim)
        self.values = [None] * n_layer

    @classmethod
    def from_prefills(cls, prefills, repeats, max_len):
        """
        One cache for len(prefills) * repeats rows: rows i*repeats .. (i+1)*repeats - 1 start as copies of
        prefills[i] (a batch-1 cache holding prompt i), right-aligned, with room for max_len slots per row.
        """
        first = prefills[0]
        cache = cls(len(prefills) * repeats, max_len, len(first.keys), first.lengths.device)
        cache.lengths = torch.cat([p.lengths for p in prefills]).repeat_interleave(repeats)
        cache.filled = max(p.filled for p in prefills)
        if any(p.filled != cache.filled for p in prefills):
            first_slot = cache.filled - cache.lengths  # (B,) where each row's tokens start
            slots = torch.arange(max_len, device=first_slot.device)
            cache.padding = (slots >= first_slot[:, None])[:, None, None, :]  # (B, 1, 1, max_len)
        for layer in range(len(first.keys)):
            for name in ("keys", "values"):
                src = getattr(first, name)[layer]  # (1, len(prompt 0), n_kv_head, head_dim)
                store = src.new_zeros(cache.lengths.size(0), max_len, *src.shape[2:])
                for i, p in enumerate(prefills):
                    store[i * repeats:(i + 1) * repeats, cache.filled - p.filled:cache.filled] = \
                        getattr(p, name)[layer][:, :p.filled]
                getattr(cache, name)[layer] = store
        return cache

    def positions(self, T):
        """(B, T) positions of the next T tokens of each row: lengths[b] + t; (1, T) when no row is padded."""
        if self.padding is None:  # every row holds `filled` tokens: no need to read the lengths on the device
            return torch.arange(self.filled, self.filled + T, device=self.lengths.device)[None]
        return self.lengths[:, None] + torch.arange(T, device=self.lengths.device)

    def attn_mask(self, T):
        """
        The mask of the next T tokens over slots 0 .. S - 1, S = filled + T: True where query t of row b may attend
        to slot j, i.e. the row's own slots (padding) up to slot filled + t (causal). None when nothing is masked
        out (no padding and T = 1) and when plain causal attention is exact (no padding, empty cache): then
        GPT.forward runs SDPA without a mask.
        """
        S = self.filled + T
        if T == 1:
            return None if self.padding is None else self.padding[..., :S]  # (B, 1, 1, S), a view: nothing built
        if self.padding is None and self.filled == 0:
            return None
        slots = torch.arange(S, device=self.lengths.device)
        causal = slots <= torch.arange(self.filled, S, device=self.lengths.device)[:, None]  # (T, S)
        return causal[None, None] if self.padding is None else causal & self.padding[..., :S]  # (1 or B, 1, T, S)

    def insert(self, layer, k, v):
        """
        Write k, v (B, T, n_kv_head, head_dim) into slots filled .. filled + T - 1 of every row; return the layer's
        keys and values (B, S, n_kv_head, head_dim) for slots 0 .. filled + T - 1 (padding slots are masked out).
        """
        B, T = k.shape[:2]
        if self.filled + T > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens per row; {self.filled} + {T} do not fit")
        if self.keys[layer] is None:
            self.keys[layer] = k.new_zeros(B, self.max_len, *k.shape[2:])
            self.values[layer] = v.new_zeros(B, self.max_len, *v.shape[2:])
        S = self.filled + T
        self.keys[layer][:, self.filled:S] = k
        self.values[layer][:, self.filled:S] = v
        return self.keys[layer][:, :S], self.values[layer][:, :S]

    def shared_prefix(self, layer):
        """Keys and values shared by groups of rows (StaticKVCache's): none here, every row holds its own."""
        return None

    def advance(self, T):
        """Called once per forward, after the last layer: every row now holds T more tokens."""
        self.lengths += T
        self.filled += T

    def keep_rows(self, index):
        """Keep only the rows `index` (a LongTensor, in the order given): an index select of every layer's keys and
        values, the lengths and the padding mask."""
        for layer in range(len(self.keys)):
            self.keys[layer], self.values[layer] = self.keys[layer][index], self.values[layer][index]
        self.lengths = self.lengths[index]
        if self.padding is not None:
            self.padding = self.padding[index]


class StaticKVCache:
    """
    KVCache's layout with every shape fixed and every position a tensor, for the compiled one-token decode step:
    rows right-aligned, all writing the same slot. Storage (B, max_len, n_kv_head, head_dim) per layer is allocated
    once, and the Engine keeps the cache for its next generate call (RL generates every step) or DecodeBatch rebuild
    of the same shape, so the compiled step is traced once and on CUDA nothing is reallocated. Positions live on the
    device:
        slot (0-d)   the slot the next token of every row is written to (KVCache.filled)
        lengths (B,) tokens held by each row: its next token's rotary position
        first (B,)   the slot of each row's first token
    Row b's query sees slots first[b] .. slot, so padding, unwritten slots and what an earlier call left behind are
    masked out. Rows beyond the ones a call uses (its row count rounded up to the cache's) start empty at the current
    slot and see only their own tokens.
    With `groups` > 0 (Engine.generate with num_samples > 1) the rows form groups of B / groups consecutive rows, one
    per prompt, and a group's prompt is stored once, in prefix storage (groups, prefix_len, n_kv_head, head_dim) per
    layer with prefix_mask (groups, prefix_len) True at its tokens; the rows' own slots hold only what they generate,
    from slot 0. The model attends over both with shared_prefix_attention (model.py), reading each prompt once per
    step instead of once per sample.
    Which slots a step reads: on CUDA all of them (CUDA graphs replay fixed shapes; as gpt-fast does). On CPU only
    own slots 0 .. slot and the longest prompt's prefix slots, counted on the host too (`filled`, `prefix_read`):
    there decoding is bound by reading the cache, and reading all max_len slots made the compiled step no faster than
    the eager one (bench/engine.py). Those lengths change every step and call; torch.compile's automatic dynamic
    shapes recompile the step the first time each one changes, with it symbolic from then on: a few compiles per
    process, then one graph per layout serves every length.
    """

    def __init__(self, batch_size, max_len, prefill, groups=0, prefix_len=0):
        """Storage shaped and typed like the batch-1 KVCache `prefill` (per layer and head, in its dtype)."""
        device = prefill.lengths.device
        self.max_len = max_len
        self.keys = [k.new_zeros(batch_size, max_len, *k.shape[2:]) for k in prefill.keys]
        self.values = [v.new_zeros(batch_size, max_len, *v.shape[2:]) for v in prefill.values]
        self.slot = torch.zeros((), dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.first = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.slots = torch.arange(max_len, device=device)
        self.filled = None if device.type == "cuda" else 0  # the host's copy of slot; None: read all max_len slots
        self.groups = groups
        self.prefix_keys = [k.new_zeros(groups, prefix_len, *k.shape[2:]) for k in prefill.keys] if groups else None
        self.prefix_values = [v.new_zeros(groups, prefix_len, *v.shape[2:]) for v in prefill.values] if groups else None
        self.prefix_mask = torch.zeros(groups, prefix_len, dtype=torch.bool, device=device)
        self.prefix_read = None if device.type == "cuda" else prefix_len  # prefix slots a step reads; None: all
        if device.type == "cuda":  # CUDA graphs replay on fixed addresses: these tensors are updated in place
            for t in (*self.keys, *self.values, *(self.prefix_keys or []), *(self.prefix_values or []),
                      self.prefix_mask, self.slot, self.lengths, self.first):
                torch._dynamo.mark_static_address(t)

    def fits(self, prefill):
        """Whether this cache can hold the rows of the batch-1 KVCache `prefill` (same heads, dtype, device)."""
        k = prefill.keys[0]
        return (self.keys[0].shape[2:], self.keys[0].dtype, self.keys[0].device) == (k.shape[2:], k.dtype, k.device)

    def start(self, filled, lengths):
        """Every row's next token goes to slot `filled`; rows 0 .. len(lengths) - 1 hold lengths (a (rows,) tensor)
        tokens each, in the slots before it (and their group's prefix), and the rows after them are empty. Their keys
        and values are the caller's to write."""
        self.slot.fill_(filled)
        self.lengths.zero_()
        self.lengths[:lengths.size(0)] = lengths
        torch.sub(filled, self.lengths, out=self.first)  # with a prefix: <= 0, every own slot up to `slot` is seen
        if self.filled is not None:
            self.filled = filled

    def load(self, prefills, repeats):
        """Rows i * repeats .. (i + 1) * repeats - 1 start as copies of prefills[i] (batch-1 KVCaches), as in
        KVCache.from_prefills (with groups: group i's prefix holds prefills[i], its rows' own slots start empty);
        the rows after them start empty."""
        lengths = torch.cat([p.lengths for p in prefills]).repeat_interleave(repeats)
        if self.groups:
            self.prefix_mask.zero_()
            for i, p in enumerate(prefills):
                for layer in range(len(self.keys)):
                    self.prefix_keys[layer][i, :p.filled] = p.keys[layer][0, :p.filled]
                    self.prefix_values[layer][i, :p.filled] = p.values[layer][0, :p.filled]
                self.prefix_mask[i, :p.filled] = True
            if self.prefix_read is not None:
                self.prefix_read = max(p.filled for p in prefills)
            self.start(0, lengths)
            return
        filled = max(p.filled for p in prefills)
        self.start(filled, lengths)
        for store, name in ((self.keys, "keys"), (self.values, "values")):
            for layer in range(len(store)):
                for i, p in enumerate(prefills):
                    store[layer][i * repeats:(i + 1) * repeats, filled - p.filled:filled] = \
                        getattr(p, name)[layer][:, :p.filled]

    def _read(self):
        """How many slots a step reads: 0 .. slot (on the host), or all max_len."""
        return self.max_len if self.filled is None else self.filled + 1

    def positions(self, T):
        return self.lengths[:, None] + torch.arange(T, device=self.slots.device)  # (B, T)

    def attn_mask(self, T):
        if T != 1:
            raise ValueError(f"StaticKVCache decodes one token per step, got {T}")
        slots = self.slots[:self._read()]
        return ((slots >= self.first[:, None]) & (slots <= self.slot))[:, None, None, :]  # (B, 1, 1, S)

    def insert(self, layer, k, v):
        """Write k, v (B, 1, n_kv_head, head_dim) into slot `slot` of every row; return the slots a step reads."""
        self.keys[layer].index_copy_(1, self.slot[None], k)
        self.values[layer].index_copy_(1, self.slot[None], v)
        S = self._read()
        return self.keys[layer][:, :S], self.values[layer][:, :S]

    def shared_prefix(self, layer):
        """The layer's prefix keys and values (groups, P, n_kv_head, head_dim) and prefix_mask (groups, P), P the
        prefix slots a step reads; None without groups."""
        if not self.groups:
            return None
        P = self.prefix_mask.size(1) if self.prefix_read is None else self.prefix_read
        return self.prefix_keys[layer][:, :P], self.prefix_values[layer][:, :P], self.prefix_mask[:, :P]

    def advance(self, T):
        self.lengths += T
        self.slot += T
        if self.filled is not None:
            self.filled += T


# -----------------------------------------------------------------------------
# The sampling distribution


MIN_TEMPERATURE = 1e-4  # below it sampling is greedy: logits / temperature would overflow float32 (1e-38 does), and
# at 1e-4 a token whose logit is 0.001 below the top one is already e^-10 as likely


def is_greedy(temperature):
    """Whether `temperature` samples the argmax (sampling_logprobs's delta distribution): 0, or below MIN_TEMPERATURE."""
    return temperature < MIN_TEMPERATURE


def check_sampling(temperature, top_k, top_p):
    """A clear error for settings that define no distribution."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None for no limit), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (or None for no limit), got {top_p}")


def sampling_logits(logits, temperature=1.0, top_k=None, top_p=None):
    """
    The logits (..., V) of the distribution the engine samples from, given the model's logits (..., V), for
    temperature >= MIN_TEMPERATURE: logits / temperature, with -inf at the tokens top_k / top_p remove:
        p = softmax(logits / temperature) restricted to the kept tokens and renormalised,
    kept tokens = the top_k largest (ties with the k-th are kept too), then of those the nucleus: the smallest
    set of most likely tokens whose probability sums to >= top_p (the most likely token is always kept).
    sampling_logprobs normalises them; sample_tokens samples from them.
    """
    check_sampling(temperature, top_k, top_p)
    if is_greedy(temperature):
        raise ValueError(f"sampling_logits needs temperature >= {MIN_TEMPERATURE} (below it is greedy: the argmax)")
    logits = logits.float()
    if temperature != 1:
        logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # probability of the strictly more likely tokens
        removed = mass_before >= top_p
        removed[..., 0] = False  # the top token is always kept, even where top_p rounds to 0 in float32 (1e-46)
        sorted_logits = sorted_logits.masked_fill(removed, float("-inf"))
        logits = sorted_logits.scatter(-1, order, sorted_logits)  # back to vocabulary order
    return logits


def sampling_logprobs(logits, temperature=1.0, top_k=None, top_p=None):
    """
    Log-probabilities (..., V) of the distribution the engine samples from (sampling_logits), given logits (..., V);
    removed tokens get -inf. temperature=0 (or below MIN_TEMPERATURE) is greedy: the delta distribution on the argmax
    (log-prob 0.0 there, -inf elsewhere), so a greedy token's log-prob is 0.0. The RL learner
    (rollout.token_logprobs) re-scores the engine's samples with it: one definition of the distribution, so the two
    agree to float rounding.
    """
    check_sampling(temperature, top_k, top_p)
    if is_greedy(temperature):
        logits = logits.float()
        greedy = F.one_hot(logits.argmax(-1), logits.size(-1)).bool()
        return torch.zeros_like(logits).masked_fill(~greedy, float("-inf"))
    return sampling_logits(logits, temperature, top_k, top_p).log_softmax(-1)


def sample_tokens(logits, uniforms):
    """
    One token per row of the distributions p = softmax(logits) (B, V), by inverting each row's cumulative
    distribution at uniforms (B,), drawn uniform in (0, 1]; returns the tokens (B,) and their log-probabilities (B,):
        token = the smallest i with c_i >= u c_V,     c_i = w_0 + ... + w_i,   w_i = exp(logits_i - max logits),
        log p_token = logits_token - max logits - log c_V.
    Why this samples p exactly: w_i = c_V p_i, u c_V is uniform on (0, c_V], and token i is chosen exactly when
    c_{i-1} < u c_V <= c_i, an interval of length w_i, so P(token = i) = w_i / c_V = p_i. A token that top-k/top-p
    removed (logit -inf, w_i = 0) has an empty interval and is never chosen, and u > 0 rules out the empty intervals
    before the first kept token. In float32 the interval of token i differs from w_i by the rounding of one
    running-sum addition (relative 2^-24) and by u's resolution (2^-24): far below what 200,000 draws can resolve, as
    for torch.multinomial. Any seeded generator gives the same tokens every run; one uniform per row instead of
    multinomial's per-call overhead (~10x faster here). The running sum's last entry is the softmax normaliser, so
    the log-probabilities need no log_softmax over the vocabulary: they are log_softmax's up to float rounding.
    """
    top = logits.amax(-1, keepdim=True)  # (B, 1): exp never overflows, and the top token's weight is 1
    cdf = (logits - top).exp_().cumsum_(-1)  # (B, V), non-decreasing: float addition of non-negative terms is monotone
    total = cdf[:, -1:]  # (B, 1)
    tokens = torch.searchsorted(cdf, uniforms[:, None] * total)  # (B, 1), first i with c_i >= u c_V
    tokens = tokens.clamp_(max=cdf.size(-1) - 1)  # a row with NaN has no such i: still an index (draw marks the row)
    logprobs = logits.gather(1, tokens) - top - total.log()  # (B, 1)
    return tokens.squeeze(1), logprobs.squeeze(1)


def draw(logits, sampling, uniforms):
    """
    The engine's tokens (B,) for logits (B, V) and their log-probs (B,) under `sampling` (a Sampling): when greedy
    (temperature 0 or below MIN_TEMPERATURE) the argmax, log-prob 0.0 (sampling_logprobs's delta); otherwise
    sample_tokens from sampling_logits at uniforms (B,), drawn in (0, 1] (None when greedy).
    Total: every token is a vocabulary index. A row with no distribution (a NaN or +inf logit, or none finite: a
    broken model or logit_bias) gets token 0 and log-prob NaN, which the caller turns into that row's error.
    """
    if is_greedy(sampling.temperature):
        tokens, logprobs = logits.argmax(-1), torch.zeros(logits.size(0), device=logits.device)
    else:
        logits = sampling_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        tokens, logprobs = sample_tokens(logits, uniforms)
    undefined = ~torch.isfinite(logits.amax(-1))  # (B,): amax is NaN where any logit is
    return tokens.masked_fill(undefined, 0), logprobs.masked_fill(undefined, float("nan"))


# -----------------------------------------------------------------------------
# Calculator tool

MAX_EXPR_CHARS = 200  # longer "expressions" are refused before parsing
MAX_EXPONENT = 100  # |b| in a ** b
MAX_MAGNITUDE = 10**30  # |value| of every literal and intermediate result
_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(Exception):
    pass


def calculator(expr):
    """
    Evaluate an arithmetic expression: int/float literals, + - * / // % **, unary + -, parentheses; nothing else
    (no names, calls, attributes, strings, containers). Returns the result as text ("4", "0.3", "2.5") or
    "error: <reason>"; never raises. Time and memory stay small: the input is at most MAX_EXPR_CHARS characters,
    every literal and intermediate result is at most MAX_MAGNITUDE in absolute value and exponents at most
    MAX_EXPONENT, so the largest number ever built is about 10**3000 (a few kB).
    """
    if not isinstance(expr, str):
        return f"error: expected a str expression, got {type(expr).__name__}"
    if len(expr) > MAX_EXPR_CHARS:
        return f"error: expression longer than {MAX_EXPR_CHARS} characters"
    try:
        tree = ast.parse(expr.strip(), mode="eval")
        return _format_number(_evaluate(tree.body))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "error: invalid expression"
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:
        return "error: result too large"
    except CalculatorError as e:
        return f"error: {e}"


def _evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # type(): bool and complex are refused
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
        return _bounded(_BINARY_OPS[type(node.op)](left, right))
    raise CalculatorError(f"unsupported syntax ({type(node).__name__}); only numbers, + - * / // % ** and parentheses")


def _bounded(value):
    if isinstance(value, complex):  # e.g. (-8) ** 0.5
        raise CalculatorError("complex result")
    if not abs(value) <= MAX_MAGNITUDE:  # `not <=` also catches nan
        raise OverflowError
    return value


def _format_number(value):
    """Integers as integers, floats rounded to 15 significant digits (DBL_DIG), which drops float noise:
    0.1+0.2 -> "0.3", 8/2 -> "4", 1/3 -> "0.333333333333333"."""
    if isinstance(value, float):
        value = float(f"{value:.15g}")
        if value.is_integer() and abs(value) < 2**53:  # exactly representable: print as an integer
            return str(int(value))
        return repr(value)
    return str(value)


# -----------------------------------------------------------------------------
# Engine


@dataclass
class Completion:
    """One generated continuation: one entry per token after the prompt, the closing stop token included."""
    tokens: list = field(default_factory=list)
    mask: list = field(default_factory=list)  # 1: sampled by the model, 0: forced tool output
    logprobs: list = field(default_factory=list)  # sampled: log-prob under sampling_logprobs(...); forced: 0.0
    finish: str | None = None  # "stop" (emitted a stop token) or "length" (hit max_tokens); None while generating;
    # "error" in a DecodeBatch when a row of its request had no distribution to sample (Engine.generate raises)
    # (a caller of DecodeBatch may also set it, to end a row early)


@dataclass
class Sampling:
    """How rows are sampled: sampling_logprobs's settings and the seed of their generator (None: a random seed)."""
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None


@dataclass
class _Row:
    """A row of the decode batch: its Completion plus the calculator state."""
    completion: Completion = field(default_factory=Completion)
    forced: deque = field(default_factory=deque)  # tool-output tokens to force on the next steps
    python: list | None = None  # tokens since an open <|python_start|>; None outside a calculator call


def _one_token_logits(model, ids, kv_cache):
    """The decode step's forward: next-token logits (B, V) of ids (B, 1) continuing kv_cache's rows."""
    return model(ids, kv_cache=kv_cache)[:, -1]


def _bucket(n, multiple):
    """n rounded up to a power of two below `multiple`, to a multiple of it from there: few shapes to compile, at
    most 2x (small n) or `multiple` - 1 (large n) of padding."""
    return 1 << (n - 1).bit_length() if n <= multiple else -(-n // multiple) * multiple


class Engine:
    def __init__(self, model, tokenizer, compiled=None):
        """
        compiled: decode with the compiled one-token step on a StaticKVCache (torch.compile; CUDA graphs on CUDA)
        instead of the eager step on a KVCache. None: where it is faster, COMPILED_DEFAULT of the model's device.
        Both paths sample the same distribution; eager is the reference the tests compare the compiled one against.
        """
        self.model = model
        self.tokenizer = tokenizer
        device = model.lm_head.weight.device
        self.compiled = COMPILED_DEFAULT.get(device.type, False) if compiled is None else compiled
        if self.compiled:
            # One graph per cache layout (prompts shared or not) and, on CUDA, per cache shape; past torch.compile's
            # default of 8 graphs per function it would decode eagerly from then on, with only a log line to say so.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_GRAPH_LIMIT)
            # CUDA: static shapes and CUDA graphs. CPU: automatic dynamic shapes, for StaticKVCache's read length.
            cuda = device.type == "cuda"
            self._step = torch.compile(_one_token_logits, dynamic=False if cuda else None,
                                       mode="reduce-overhead" if cuda else None)
        self._static_cache = None  # the compiled path's StaticKVCache, kept for the next call of the same shape
        self.stop_ids = {tokenizer.token_id("<|assistant_end|>"), tokenizer.bos_id}
        self.python_start = tokenizer.token_id("<|python_start|>")
        self.python_end = tokenizer.token_id("<|python_end|>")
        self.output_start = tokenizer.token_id("<|output_start|>")
        self.output_end = tokenizer.token_id("<|output_end|>")

    def generate(self, prompts, num_samples=1, max_tokens=256, temperature=1.0, top_k=None, top_p=None, seed=None):
        """
        Sample num_samples completions of each prompt (a list of token ids). Returns one list of num_samples
        Completions per prompt. temperature=0 is greedy. Same seed, same prompts and settings -> same completions.
        """
        sampling = Sampling(temperature, top_k, top_p, seed)
        for rows in self._decode(prompts, num_samples, max_tokens, sampling):
            pass  # rows are filled in place; the last step leaves them all finished
        return [rows[i * num_samples:(i + 1) * num_samples] for i in range(len(prompts))]

    def generate_stream(self, prompt, max_tokens=256, temperature=1.0, top_k=None, top_p=None, seed=None):
        """Yield the token ids of one completion of `prompt` as they are generated (forced tool tokens included)."""
        emitted = 0
        for (completion,) in self._decode([prompt], 1, max_tokens, Sampling(temperature, top_k, top_p, seed)):
            yield from completion.tokens[emitted:]
            emitted = len(completion.tokens)

    @torch.inference_mode()
    def _decode(self, prompts, num_samples, max_tokens, sampling):
        """The decoding loop of generate and generate_stream: yields all rows' Completions after each step."""
        model = self.model
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("got an empty prompt list or an empty prompt; every prompt needs at least one token "
                             "(usually <|bos|>)")
        if num_samples < 1 or max_tokens < 1:
            raise ValueError(f"num_samples and max_tokens must be >= 1, got {num_samples} and {max_tokens}")
        check_sampling(sampling.temperature, sampling.top_k, sampling.top_p)
        max_len = max(map(len, prompts)) + max_tokens
        if max_len > model.rotary_len:
            raise ValueError(f"longest prompt + max_tokens = {max_len} tokens exceeds the model's "
                             f"{model.rotary_len} positions")
        device = model.lm_head.weight.device
        generator = torch.Generator(device=device)
        if sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(sampling.seed)

        # Prefill each prompt once; its num_samples rows share the cache and the next-token logits.
        prefills, last_logits = [], []
        for prompt in prompts:
            cache = KVCache(1, len(prompt), model.config.n_layer, device)
            last_logits.append(model(torch.tensor([prompt], device=device), kv_cache=cache)[:, -1])  # (1, V)
            prefills.append(cache)
        logits = torch.cat(last_logits).repeat_interleave(num_samples, dim=0)  # (B, V)
        if self.compiled:
            kv_cache = self._load_static_cache(prefills, num_samples, max_len)
            pad_rows = kv_cache.lengths.size(0) - logits.size(0)  # the cache's extra rows decode a dummy token
        else:
            kv_cache = KVCache.from_prefills(prefills, num_samples, max_len)

        rows = [_Row() for _ in range(len(prompts) * num_samples)]
        decoding = list(range(len(rows)))  # the rows the eager step's cache holds, in its order
        while True:
            uniforms = None if is_greedy(sampling.temperature) else \
                1 - torch.rand(logits.size(0), generator=generator, device=device)  # (B,) in (0, 1]
            sampled, sampled_logprobs = draw(logits, sampling, uniforms)  # (B,), (B,)
            # One device-to-host transfer per step: token ids (exact in float32 below 2^24) and log-probs together.
            tokens, token_logprobs = torch.stack([sampled.float(), sampled_logprobs]).tolist()
            forced = []  # (row index, token) of rows that took a tool-output token instead of the sampled one
            for i, (row, token, logprob) in enumerate(zip(rows, tokens, token_logprobs)):
                if row.completion.finish is None:
                    self._step_row(row, int(token), logprob, max_tokens)
                    if row.completion.finish == "error":
                        raise RuntimeError(f"row {i}'s next-token logits are not finite (NaN or inf): the model's "
                                           "weights or activations are broken")
                    if row.completion.mask[-1] == 0:
                        forced.append((i, row.completion.tokens[-1]))
            yield [row.completion for row in rows]
            if all(row.completion.finish is not None for row in rows):
                return
            # The sampled tokens stay on the device as the next input; only forced tool tokens come from the host.
            # A finished row's outputs are never read, so it feeds whatever it sampled: the batch keeps its shape until
            # the eager step drops finished rows (below; the compiled one keeps its shape throughout).
            next_ids = sampled[:, None]  # (B, 1)
            if forced:
                index, values = zip(*forced)
                next_ids = next_ids.index_put((torch.tensor(index, device=device),),
                                              torch.tensor(values, device=device)[:, None])
            if self.compiled:
                logits = self._step(model, F.pad(next_ids, (0, 0, 0, pad_rows)), kv_cache)[:len(rows)]  # (B, V)
                continue
            # The eager step drops finished rows from its cache once they are half of it: answers of very different
            # lengths (a few run to max_tokens) would otherwise keep every finished row in each step's matmuls.
            # Every row still gets logits and a uniform (a finished row keeps its last logits), so the draws, and
            # the tokens of the rows still decoding, are those of the full batch.
            keep = [position for position, i in enumerate(decoding) if rows[i].completion.finish is None]
            if 2 * len(keep) <= len(decoding):
                kv_cache.keep_rows(torch.tensor(keep, device=device))
                decoding = [decoding[position] for position in keep]
            if len(decoding) == len(rows):
                logits = _one_token_logits(model, next_ids, kv_cache)  # (B, V)
            else:
                index = torch.tensor(decoding, device=device)
                logits = logits.index_copy(0, index, _one_token_logits(model, next_ids[index], kv_cache))

    def _load_static_cache(self, prefills, repeats, max_len):
        """
        The compiled path's cache holding the prefills (StaticKVCache.load), rows and lengths rounded up. With
        repeats > 1 each prompt is stored once for its rows (StaticKVCache groups; prompt counts rounded up too), and
        the rows' own slots need only room for what they generate.
        """
        def rounded(n):
            return min(_bucket(n, STATIC_LEN_MULTIPLE), self.model.rotary_len)

        if repeats == 1:
            cache = self._kept_static_cache(_bucket(len(prefills), 8), rounded(max_len), prefills[0])
        else:
            longest = max(p.filled for p in prefills)
            groups = _bucket(len(prefills), 8)
            cache = self._kept_static_cache(groups * repeats, rounded(max_len - longest), prefills[0], groups,
                                            rounded(longest))
        cache.load(prefills, repeats)
        return cache

    def _kept_static_cache(self, rows, max_len, prefill, groups=0, prefix_len=0):
        """
        A StaticKVCache of this shape for the rows of KVCache `prefill`: the kept one when it has that shape, else a
        new one, which replaces it (the old one is freed first: one cache's memory at a time). Its contents are the
        caller's to set.
        """
        cache = self._static_cache
        shape = (rows, max_len, groups, prefix_len)
        if cache is None or (cache.lengths.size(0), cache.max_len, cache.groups, cache.prefix_mask.size(1)) != shape \
                or not cache.fits(prefill):
            self._static_cache = cache = None
            self._static_cache = cache = StaticKVCache(rows, max_len, prefill, groups, prefix_len)
        return cache

    def _step_row(self, row, sampled, logprob, max_tokens):
        """
        Append one token to an unfinished row: the next forced tool-output token if any is queued (mask 0,
        log-prob 0.0), else the sampled one. Closing a calculator call queues its output; a stop token or
        max_tokens finishes the row; a NaN log-prob (draw's undefined row) finishes it as "error".
        """
        c = row.completion
        if row.forced:
            token, mask, logprob = row.forced.popleft(), 0, 0.0
        elif math.isnan(logprob):  # draw found no distribution in the row's logits: the row fails, nothing appended
            c.finish = "error"
            return
        else:
            token, mask = sampled, 1
        c.tokens.append(token)
        c.mask.append(mask)
        c.logprobs.append(logprob)
        if token == self.python_start:
            row.python = []
        elif token == self.python_end and row.python is not None:
            result = calculator(self.tokenizer.decode(row.python))
            row.forced.extend([self.output_start, *self.tokenizer.encode(result), self.output_end])
            row.python = None
        elif row.python is not None:
            row.python.append(token)
        if token in self.stop_ids:
            c.finish = "stop"
        elif len(c.tokens) >= max_tokens:
            c.finish = "length"


# -----------------------------------------------------------------------------
# Loading a checkpoint: the model and the tokenizer saved with it


def load_model(ckpt_dir, device, step=None):
    """
    Rebuild the model and its tokenizer from a checkpoint folder: (model, tokenizer, meta), model in eval mode.
    The model is a GPT, or a ScalarHeadModel (GPT trunk + scalar head) when meta["reward_model"] is set (rm.py).
    """
    # Imported here, so that importing engine.py needs only torch. It lives here, not in common.py, because
    # tokenizer.py's CLI imports common, and common.py imports only model (inside the functions that plan memory).
    from common import load_checkpoint, resolve_checkpoint
    from model import GPT, GPTConfig, ScalarHeadModel
    from tokenizer import Tokenizer

    model_state, meta, _ = load_checkpoint(ckpt_dir, step, device=device)
    path = resolve_checkpoint(ckpt_dir, step)
    model = GPT(GPTConfig(**meta["model_config"]))
    if meta.get("reward_model"):
        model = ScalarHeadModel(model)
    model = model.to(device)
    model.load_state_dict(model_state, strict=True)
    model.eval()
    tokenizer = Tokenizer.load(path / "tokenizer")
    return model, tokenizer, meta


# -----------------------------------------------------------------------------
# Chat CLI


def assistant_content(tokenizer, tokens):
    """
    The assistant message of generated tokens, as content parts for the conversation: text, python (between
    <|python_start|> and <|python_end|>) and python_output (between <|output_start|> and <|output_end|>); the
    stop token is dropped.
    """
    openers = {tokenizer.token_id("<|python_start|>"): "python",
               tokenizer.token_id("<|output_start|>"): "python_output"}
    boundaries = set(openers) | {tokenizer.token_id(name) for name in
                                 ("<|python_end|>", "<|output_end|>", "<|assistant_end|>", "<|bos|>")}
    parts, kind, run = [], "text", []
    for token in [*tokens, None]:  # None flushes the last run
        if token is not None and token not in boundaries:
            run.append(token)
            continue
        if run:
            parts.append({"type": kind, "text": tokenizer.decode(run)})
        kind, run = openers.get(token, "text"), []
    return parts or [{"type": "text", "text": ""}]


TOOL_MARKS = {"<|python_start|>": "[calculator: ", "<|python_end|>": "", "<|output_start|>": " → ",
              "<|output_end|>": "]"}


def readable_reply(tokenizer, tokens):
    """
    The reply text of generated tokens for people: a calculator call shows as `[calculator: 17+25 → 42]` instead of
    <|python_start|>17+25<|python_end|><|output_start|>42<|output_end|>; the stop token is dropped. Built token by
    token, so the text of a prefix of `tokens` is a prefix of the text (a stream prints the difference), except
    that a multi-byte character cut between tokens shows as U+FFFD until its last byte arrives.
    """
    marks = {tokenizer.token_id(name): text for name, text in TOOL_MARKS.items()}
    marks.update({tokenizer.token_id("<|assistant_end|>"): "", tokenizer.bos_id: ""})
    pieces, run = [], []
    for token in [*tokens, None]:  # None flushes the last run
        if token is not None and token not in marks:
            run.append(token)
            continue
        pieces.append(tokenizer.decode(run))
        pieces.append(marks.get(token, ""))
        run = []
    return "".join(pieces)



_CALL = re.compile(r"\[calculator: (.*?) → ([^\]]*)\]|<\|python_start\|>(.*?)<\|python_end\|>"
                   r"(?:<\|output_start\|>(.*?)<\|output_end\|>)?", re.DOTALL)


def reply_parts(text):
    """
    The content parts of a reply's text, the inverse of readable_reply (and of the raw special-token form): each
    `[calculator: expr → result]`, and each <|python_start|>expr<|python_end|><|output_start|>result<|output_end|>,
    becomes a python part and a python_output part; the rest stays text. A client that sends a reply back as a plain
    string thereby gives the model the tool tokens it wrote, not a description of them.
    """
    parts, start = [], 0
    for call in _CALL.finditer(text):
        if call.start() > start:
            parts.append({"type": "text", "text": text[start:call.start()]})
        readable = call.group(1) is not None
        parts.append({"type": "python", "text": call.group(1) if readable else call.group(3)})
        output = call.group(2) if readable else call.group(4)
        if output is not None:
            parts.append({"type": "python_output", "text": output})
        start = call.end()
    if start < len(text) or not parts:
        parts.append({"type": "text", "text": text[start:]})
    return parts


def main():
    import common  # here, so that importing engine.py needs only torch

    parser = argparse.ArgumentParser(description="Chat with a checkpoint (streaming). "
                                                 "Type 'clear' to start over, 'quit' to leave.")
    parser.add_argument("--ckpt", required=True, help="checkpoint folder, e.g. ~/.cache/nanopost/checkpoints/sft")
    parser.add_argument("--prompt", default=None, help="answer this one message and exit")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default=None, help="cuda | mps | cpu (default: autodetect)")
    parser.add_argument("--eager", action="store_true",
                        help="decode with the eager step even where the compiled one is the default (CUDA): the "
                             "compiled step makes the first reply wait for its compile")
    args = parser.parse_args()

    device = torch.device(args.device or common.autodetect_device())
    model, tokenizer, meta = load_model(args.ckpt, device)
    print(f"loaded {args.ckpt} (step {meta.get('step')}, {model.num_params():,} parameters) on {device}",
          file=sys.stderr)
    engine = Engine(model, tokenizer, compiled=False if args.eager else None)
    conversation = {"messages": []}
    while True:
        if args.prompt is not None:
            text = args.prompt
        else:
            try:
                text = input("\nUser: ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return
            if text in ("quit", "exit"):
                return
            if text == "clear":
                conversation = {"messages": []}
                continue
            if not text:
                continue
        conversation["messages"].append({"role": "user", "content": text})
        prompt = tokenizer.render_for_completion(conversation)
        print("" if args.prompt is not None else "Assistant: ", end="", flush=True)
        tokens, shown = [], ""
        with common.autocast_ctx(device):
            stream = engine.generate_stream(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
            for token in stream:
                tokens.append(token)
                reply = readable_reply(tokenizer, tokens)
                if not reply.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                    print(reply[len(shown):], end="", flush=True)
                    shown = reply
        print()
        if args.prompt is not None:
            return
        conversation["messages"].append({"role": "assistant", "content": assistant_content(tokenizer, tokens)})


# -----------------------------------------------------------------------------
# Continuous batching: requests join and leave a running batch between decoding steps


@dataclass
class Request:
    """
    One request's rows in a DecodeBatch: num_samples completions of `prompt`, each ending at a stop token or after
    max_tokens tokens, sampled with the request's own Sampling and generator (so a seeded request draws the same
    whatever shares its batch). Before sampling_logprobs, its logits get logit_bias added and OpenAI's penalties
    subtracted: presence_penalty once for every token already generated in that row, frequency_penalty per
    occurrence. top_logprobs > 0 records, for each sampled token, the most likely tokens of the distribution it was
    sampled from.
    """
    prompt: list
    num_samples: int = 1
    max_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)  # {token id: added to its logit}
    top_logprobs: int = 0
    rows: list = field(default_factory=list)  # its _Rows, by sample, filled in by DecodeBatch.add
    top: list = field(default_factory=list)  # per sample, per token: [(token, log-prob)], most likely first;
    # empty for a forced tool-output token (the model did not choose it)
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)  # set by DecodeBatch.add
    _bias: torch.Tensor | None = field(default=None, init=False, repr=False)  # (V,) logit_bias; None: none
    _counts: torch.Tensor | None = field(default=None, init=False, repr=False)  # (num_samples, V); None: no penalty

    @property
    def completions(self):
        return [row.completion for row in self.rows]

    @property
    def failed(self):
        """Whether a row had no distribution to sample (draw's NaN): then every row of the request ends "error"."""
        return any(c.finish == "error" for c in self.completions)


class DecodeBatch:
    """
    The rows of many requests decoding together, one token per step, while requests join and leave between steps
    (continuous batching). add() prefills the new prompts together (right-padded in one forward; their num_samples
    rows share it) and their rows join the batch at the next step(). A row whose Completion has finished (a stop
    token, its request's max_tokens, or the caller setting finish) is not stepped again and frees its cache row,
    which the next joining row reuses in place: only that row's prompt is written. A freed row still rides along in
    the forward until it is reused (cheaper than moving every other row's keys and values to drop it); on the eager
    path, once more rows are free than busy, the busy ones are packed together.
    Rows are right-aligned as in KVCache (every row writes slot `filled` each step). A joining prompt longer than
    `filled`, more joining rows than free ones, or too few slots left for its max_tokens rebuilds the cache: the busy
    rows and the new ones, right-aligned anew, which also drops the slots no row uses, with room for twice the
    longest remaining budget so that later joins fit in place.
    The step is the Engine's: eager on a KVCache, or (Engine(compiled=True)) the compiled one on the Engine's kept
    StaticKVCache, rows and slots rounded up as in Engine.generate (_bucket), so an Engine decodes one DecodeBatch
    or generate call at a time; there the rows beyond the busy ones are free from the start, and nothing is packed
    (a smaller shape is one more compile).
    """

    def __init__(self, engine):
        self.engine, self.model = engine, engine.model
        self.device = engine.model.lm_head.weight.device
        self.slots = []  # per cache row: its (request, sample), or None when free
        self.cache = None  # KVCache or StaticKVCache of the rows: prompt + every generated token but the last
        self.filled = 0  # slots written in every row (KVCache.filled; a StaticKVCache keeps it on the device)
        self.next_ids = None  # (B, 1) each row's last generated token: the next step's input
        self.joining = []  # (requests, their prefill KVCache, prompt lengths, last-token logits (P, V))

    @property
    def rows(self):
        """Unfinished rows: decoding now or joining at the next step."""
        decoding = sum(slot is not None and slot[0].rows[slot[1]].completion.finish is None for slot in self.slots)
        return decoding + sum(r.num_samples for requests, *_ in self.joining for r in requests)

    @torch.inference_mode()
    def add(self, requests):
        """Prefill the requests' prompts together; their rows join at the next step()."""
        model = self.model
        for r in requests:
            if not r.prompt or r.num_samples < 1 or r.max_tokens < 1:
                raise ValueError("every request needs a non-empty prompt, num_samples >= 1 and max_tokens >= 1")
            if len(r.prompt) + r.max_tokens > model.rotary_len:
                raise ValueError(f"prompt + max_tokens = {len(r.prompt) + r.max_tokens} tokens exceeds the model's "
                                 f"{model.rotary_len} positions")
            check_sampling(r.sampling.temperature, r.sampling.top_k, r.sampling.top_p)
        lengths = [len(r.prompt) for r in requests]
        # Right-padded: causal attention never lets a prompt token see the padding after it, so one unmasked forward
        # is exact for every prompt; the padding slots are never copied into the running cache.
        ids = torch.zeros(len(requests), max(lengths), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, :len(r.prompt)] = torch.tensor(r.prompt)
        cache = KVCache(len(requests), max(lengths), model.config.n_layer, self.device)
        h = model.hidden(ids.to(self.device), kv_cache=cache)  # (P, T, C)
        logits = model.head(h[torch.arange(len(requests)), torch.tensor(lengths) - 1])  # (P, V)
        vocab = logits.size(-1)
        for r in requests:
            r.rows = [_Row() for _ in range(r.num_samples)]
            r.top = [[] for _ in range(r.num_samples)]
            r._generator = torch.Generator(device=self.device)
            if r.sampling.seed is None:
                r._generator.seed()
            else:
                r._generator.manual_seed(r.sampling.seed)
            if r.logit_bias:
                r._bias = torch.zeros(vocab, device=self.device)
                r._bias[torch.tensor(list(r.logit_bias), device=self.device)] = \
                    torch.tensor(list(r.logit_bias.values()), dtype=torch.float, device=self.device)
            if r.presence_penalty != 0 or r.frequency_penalty != 0:
                r._counts = torch.zeros(r.num_samples, vocab, device=self.device)
        self.joining.append((requests, cache, lengths, logits))

    @torch.inference_mode()
    def step(self):
        """
        Decode one token for every unfinished row (joining rows included); rows update their Completions (and
        Request.top) in place.
        """
        self.slots = [slot if slot is not None and slot[0].rows[slot[1]].completion.finish is None else None
                      for slot in self.slots]
        busy = [i for i, slot in enumerate(self.slots) if slot is not None]
        if not busy:
            self.slots, self.cache, self.next_ids = [], None, None
        elif 2 * len(busy) < len(self.slots) and not self.engine.compiled:
            self._pack(busy)
        logits = None
        if self.slots:
            step = self.engine._step if self.engine.compiled else _one_token_logits
            logits = step(self.model, self.next_ids, self.cache)  # (B, V)
            self.filled += 1
        for requests, prefill, lengths, prompt_logits in self.joining:
            logits = self._join(requests, prefill, lengths, prompt_logits, logits)
        self.joining = []
        if not self.slots:
            return

        requests = {}  # each request's (sample, row) in the cache, sample order: its generator's draw order
        for row, slot in enumerate(self.slots):
            if slot is not None:
                requests.setdefault(id(slot[0]), (slot[0], []))[1].append((slot[1], row))
        sampled, chosen, order, tops = [], [], [], []
        for request, rows in requests.values():
            rows.sort()
            samples = [s for s, _ in rows]
            index = torch.tensor([row for _, row in rows], device=self.device)
            lg = logits[index]  # (rows of this request, V)
            if request._bias is not None:
                lg = lg + request._bias
            if request._counts is not None:
                counts = request._counts[samples]
                lg = lg - request.presence_penalty * (counts > 0) - request.frequency_penalty * counts
            s = request.sampling
            uniforms = None  # one per sample every step, finished ones too: Engine.generate's draws, seed for seed
            if s.temperature > 0:
                uniforms = 1 - torch.rand(request.num_samples, generator=request._generator, device=self.device)
            tokens, logprobs = draw(lg, s, None if uniforms is None else uniforms[samples])
            if request.top_logprobs:  # the whole distribution; the sampled token's log-prob read from it too, so
                # that it is one of its top_logprobs exactly, not only to float rounding
                distribution = sampling_logprobs(lg, s.temperature, s.top_k, s.top_p)  # (rows, V)
                logprobs = distribution.gather(1, tokens[:, None]).squeeze(1)
                tops.append((request, samples, torch.topk(distribution, min(request.top_logprobs, lg.size(-1)))))
            sampled.append(tokens)
            chosen.append(logprobs)
            order.append(index)
        order = torch.cat(order)
        # Free rows feed token 0: their outputs are never read.
        step_ids = torch.zeros(len(self.slots), dtype=torch.long, device=self.device).index_put((order,),
                                                                                               torch.cat(sampled))
        step_logprobs = torch.zeros(len(self.slots), device=self.device).index_put((order,), torch.cat(chosen))
        # One device-to-host transfer for the step (plus one per request that asked for top_logprobs).
        tokens, token_logprobs = torch.stack([step_ids.float(), step_logprobs]).tolist()
        forced = []
        for row, (slot, token, logprob) in enumerate(zip(self.slots, tokens, token_logprobs)):
            if slot is None or slot[0].failed:
                continue
            request, s = slot
            completion = request.rows[s].completion
            self.engine._step_row(request.rows[s], int(token), logprob, request.max_tokens)
            if completion.finish == "error":  # the whole request fails (Request.failed); its rows stop here
                for other in request.completions:
                    other.finish = other.finish or "error"
                continue
            if completion.mask[-1] == 0:
                forced.append((row, completion.tokens[-1]))
            if request._counts is not None:
                request._counts[s, completion.tokens[-1]] += 1
        for request, samples, top in tops:
            if request.failed:
                continue
            for s, values, indices in zip(samples, top.values.tolist(), top.indices.tolist()):
                sampled_here = request.rows[s].completion.mask[-1] == 1
                request.top[s].append([(t, v) for t, v in zip(indices, values) if v > float("-inf")]
                                      if sampled_here else [])
        self.next_ids = step_ids[:, None]  # (B, 1); forced tool tokens replace what those rows sampled
        if forced:
            index, values = zip(*forced)
            self.next_ids = self.next_ids.index_put((torch.tensor(index, device=self.device),),
                                                    torch.tensor(values, device=self.device)[:, None])

    def _cached(self, request, s):
        """Tokens row (request, s) holds in the cache before a step: its prompt and every generated token but the
        last (a row is stepped once when it joins, before any forward)."""
        return len(request.prompt) + len(request.rows[s].completion.tokens) - 1

    def _pack(self, busy):
        """Keep only the busy rows (an index select of every layer's keys and values)."""
        index = torch.tensor(busy, device=self.device)
        c = self.cache
        for layer in range(len(c.keys)):
            c.keys[layer], c.values[layer] = c.keys[layer][index], c.values[layer][index]
        c.lengths, self.next_ids = c.lengths[index], self.next_ids[index]
        self.slots = [self.slots[i] for i in busy]
        # No padding left when every busy row reaches back to slot 0: the unmasked (fused) path is exact.
        full = all(self._cached(r, s) == c.filled for r, s in self.slots)
        c.padding = None if full else c.padding[index]

    def _join(self, requests, prefill, lengths, prompt_logits, logits):
        """
        Put the prefilled rows (slots 0 .. length - 1 of prefill, num_samples copies each) into free rows of the
        cache, or rebuild it; returns the step's logits (B, V) with the new rows' next-token logits in their rows.
        """
        new = [(r, s, length, j) for j, (r, length) in enumerate(zip(requests, lengths)) for s in range(r.num_samples)]
        source = torch.tensor([j for *_, j in new], device=self.device)
        free = [i for i, slot in enumerate(self.slots) if slot is None]
        c, filled = self.cache, self.filled
        if (c is None or len(new) > len(free) or max(lengths) > filled
                or filled + max(r.max_tokens for r in requests) > c.max_len):
            return self._rebuild(new, prefill, prompt_logits[source], logits)
        rows = free[:len(new)]
        for layer in range(len(c.keys)):
            for name in ("keys", "values"):
                store, prompt = getattr(c, name)[layer], getattr(prefill, name)[layer]
                for row, (_, _, length, j) in zip(rows, new):
                    store[row, filled - length:filled] = prompt[j, :length]
        index = torch.tensor(rows, device=self.device)
        c.lengths[index] = torch.tensor([length for _, _, length, _ in new], device=self.device)
        if self.engine.compiled:
            c.first[index] = filled - c.lengths[index]
        else:
            slots = torch.arange(c.max_len, device=self.device)
            if c.padding is None:  # until now every row held `filled` tokens
                c.padding = (slots >= (filled - c.lengths)[:, None])[:, None, None, :]
            else:
                c.padding[index] = (slots >= (filled - c.lengths[index])[:, None])[:, None, None, :]
        for row, (r, s, _, _) in zip(rows, new):
            self.slots[row] = (r, s)
        return logits.index_put((index,), prompt_logits[source])

    def _rebuild(self, new, prefill, new_logits, logits):
        """A new cache: the busy rows, then the new ones, right-aligned; returns the logits in the new row order."""
        busy = [i for i, slot in enumerate(self.slots) if slot is not None]
        old, old_filled, old_slots = self.cache, self.filled, [self.slots[i] for i in busy]
        # a busy row holds its prompt and all its tokens: this step's forward fed the last one (or it has none yet)
        old_lengths = [len(r.prompt) + len(r.rows[s].completion.tokens) for r, s in old_slots]
        all_lengths = old_lengths + [length for _, _, length, _ in new]
        filled = max(all_lengths)
        # a row with k tokens left needs at most k - 1 more forwards; twice that leaves room for later joins, within
        # the rotary tables (GPT.forward refuses a longer cache)
        remaining = [r.max_tokens - len(r.rows[s].completion.tokens) for r, s in old_slots]
        max_len = min(filled + 2 * max(remaining + [r.max_tokens for r, *_ in new]), self.model.rotary_len)
        lengths = torch.tensor(all_lengths, device=self.device)
        if self.engine.compiled:  # the rows after the busy and new ones are free: empty, at the current slot
            slots = min(_bucket(max_len, STATIC_LEN_MULTIPLE), self.model.rotary_len)
            cache = self.engine._kept_static_cache(_bucket(len(all_lengths), 8), slots, prefill)
            cache.start(filled, lengths)
        else:
            cache = KVCache(len(all_lengths), max_len, self.model.config.n_layer, self.device)
            cache.lengths, cache.filled = lengths, filled
            if any(length != filled for length in all_lengths):
                first_slot = filled - lengths  # (B,)
                cache.padding = (torch.arange(max_len, device=self.device) >= first_slot[:, None])[:, None, None, :]
            cache.keys = [k.new_zeros(len(all_lengths), max_len, *k.shape[2:]) for k in prefill.keys]
            cache.values = [v.new_zeros(len(all_lengths), max_len, *v.shape[2:]) for v in prefill.values]
        index = torch.tensor(busy, dtype=torch.long, device=self.device)
        for layer in range(len(prefill.keys)):
            for name in ("keys", "values"):
                prompt, store = getattr(prefill, name)[layer], getattr(cache, name)[layer]  # (P, T, ...), (B, S, ...)
                if busy:  # the busy rows' tokens all lie in their last `width` slots (read out before any write:
                    # the compiled path may rebuild within the same StaticKVCache)
                    width = min(old_filled, filled)
                    store[:len(busy), filled - width:filled] = \
                        getattr(old, name)[layer][index, old_filled - width:old_filled]
                for row, (_, _, length, j) in enumerate(new, start=len(busy)):
                    store[row, filled - length:filled] = prompt[j, :length]
        self.cache, self.filled = cache, filled
        free = cache.lengths.size(0) - len(all_lengths)
        self.slots = old_slots + [(r, s) for r, s, _, _ in new] + [None] * free
        return F.pad(torch.cat(([logits[index]] if busy else []) + [new_logits]), (0, 0, 0, free))


if __name__ == "__main__":
    from common import run_cli  # here, like main's import

    run_cli(main)

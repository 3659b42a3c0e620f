"""
To and from the Hugging Face `NanoChat` format (transformers' native `nanochat` model type: no remote code).

    python export.py --ckpt $NANOPOST_HOME/checkpoints/sft --out hf/nanopost-sft              # checkpoint -> HF folder
    python export.py --import hf/nanopost-sft --out $NANOPOST_HOME/checkpoints/imported     # HF folder -> checkpoint
    python export.py --ckpt $NANOPOST_HOME/checkpoints/sft --out mlx/nanopost-sft --format mlx  # for mlx-lm

Export writes config.json (model_type nanochat), model.safetensors (float32), generation_config.json (generation
stops at <|assistant_end|> or <|bos|>, where engine.py stops), tokenizer.json (byte-level BPE: the same split regex,
merges and special tokens as tokenizer.py) and tokenizer_config.json with a chat template that renders a conversation
to exactly the ids of Tokenizer.render_conversation (with add_generation_prompt: render_for_completion). Import writes
an ordinary checkpoint (step 0, stage "import", its tokenizer inside) that every stage takes with --ckpt.

The architectures are the same function, parameter for parameter:

    this repo (model.py)                      NanoChatForCausalLM
    wte                                       model.embed_tokens
    blocks.i.attn.c_q / c_k / c_v / c_proj    model.layers.i.self_attn.q_proj / k_proj / v_proj / o_proj
    blocks.i.mlp.c_fc / c_proj                model.layers.i.mlp.fc1 / fc2 (hidden_act relu2, intermediate 4 n_embd)
    lm_head (untied)                          lm_head, tie_word_embeddings false
    norm(): F.rms_norm, no weight             NanoChatRMSNorm (no weight), rms_norm_eps = float32's epsilon
    norm after wte and after the last block   model.norm, applied at both places
    QK-norm, then RoPE                        RoPE, then QK-norm: equal, as the rotation keeps each head's RMS
    RoPE (x1 cos + x2 sin, x2 cos - x1 sin)   the same: NanoChat's rotate_half is (x2, -x1)
    LOGIT_SOFTCAP 15, ROTARY_BASE             final_logit_softcapping, rope_parameters.rope_theta

--format mlx writes the same folder for mlx-lm, whose models/nanochat.py loads nanochat's own names strictly
(transformer.wte, transformer.h.i.attn.c_q, ..., lm_head: model.py's names under `transformer.`) and reads rope_theta
from the top of config.json. Its RMSNorm epsilon is fixed at 1e-5 (here float32's): logits differ by ~1e-5.

Anything else (a config field, a parameter, a tokenizer setting the other side cannot hold) is refused with a one-line
error naming it. Both directions then run the two models on a probe batch and refuse to write a model whose logits
differ by more than PROBE_TOLERANCE, and encode probe texts with both tokenizers and refuse on any difference.

The calculator tool in a conversation: an assistant message's content is a list of parts, {"type": "python", "text":
"12*7"} renders as <|python_start|>12*7<|python_end|> and {"type": "python_output", "text": "84"} as
<|output_start|>84<|output_end|>. transformers' generate() does not run the calculator: where engine.py forces the
result after <|python_end|>, generate() lets the model go on by itself.

transformers, tokenizers and safetensors are needed here and in its tests only; no training stage imports them.
"""

import argparse
import json
from dataclasses import fields
from pathlib import Path

import torch

import common
from common import UserError
from engine import load_model
from model import LOGIT_SOFTCAP, ROTARY_BASE, GPT, GPTConfig
from tokenizer import SPECIAL_TOKENS, Tokenizer

PROBE_TOLERANCE = 1e-3  # max |logit difference| (float32) a converted model may show on the probe batch
PROBE_TEXTS = [  # checked through both tokenizers on every export and import
    "Hello world! It's 2024: we'll see.\n\n  Indented,\ttabbed   and trailing   ",
    "1234567 + 89 = 1234656; 3.14159, -0.5e10",
    "naïve café — Straße, 日本語のテキスト, привет мир, emoji 🙂👍🏽",
    "<|bos| <|notatoken|> <|user_end |> </s> [INST] {{x}}",
    "don't I'LL WE'VE you're   \r\n\r\nx\n \n",
]
# F.rms_norm without eps (model.norm) uses the epsilon of the input's dtype: float32 in every forward that matters
# (CUDA autocast runs rms_norm in float32).
RMS_NORM_EPS = torch.finfo(torch.float32).eps
EOS_NAMES = ("<|assistant_end|>", "<|bos|>")  # engine.Engine's stop tokens (its stop_ids)


# -----------------------------------------------------------------------------
# Weights


BLOCK_NAMES = {  # a block's linear layers: model.py's (module, layer) -> NanoChatDecoderLayer's name
    ("attn", "c_q"): "self_attn.q_proj", ("attn", "c_k"): "self_attn.k_proj", ("attn", "c_v"): "self_attn.v_proj",
    ("attn", "c_proj"): "self_attn.o_proj", ("mlp", "c_fc"): "mlp.fc1", ("mlp", "c_proj"): "mlp.fc2",
}


def hf_key(key):
    """The NanoChatForCausalLM name of a GPT state-dict key, or None when that model has no such parameter."""
    if key == "wte.weight":
        return "model.embed_tokens.weight"
    if key == "lm_head.weight":
        return key
    parts = key.split(".")  # blocks.{i}.{module}.{layer}.weight
    if len(parts) == 5 and parts[0] == "blocks" and parts[4] == "weight" and (parts[2], parts[3]) in BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2], parts[3]]}.weight"
    return None


def nanochat_key(key):
    """The name nanochat itself (and mlx-lm's models/nanochat.py) gives a GPT state-dict key: transformer.wte,
    transformer.h.{i}.attn.c_q, ..., lm_head: model.py's names under nanochat's `transformer.` module dict."""
    if key == "lm_head.weight":
        return key
    if key.startswith("blocks.") and hf_key(key) is not None:
        return "transformer.h." + key[len("blocks."):]
    if key == "wte.weight":
        return "transformer.wte.weight"
    raise UserError(f"parameter {key} has no counterpart in nanochat's naming: this model cannot be exported")


def to_hf_state(state):
    """A GPT state dict as NanoChatForCausalLM's; a parameter it has no place for is a UserError naming it."""
    out = {}
    for key, tensor in state.items():
        name = hf_key(key)
        if name is None:
            raise UserError(f"parameter {key} has no counterpart in NanoChat: this model cannot be exported")
        out[name] = tensor
    return out


def from_hf_state(hf_state, config):
    """NanoChatForCausalLM's state dict as a GPT's for `config`; a missing or extra parameter is a UserError."""
    with torch.device("meta"):  # only the names: no memory, no initialisation
        names = {hf_key(key): key for key in GPT(config).state_dict()}
    extra = sorted(set(hf_state) - set(names))
    missing = sorted(set(names) - set(hf_state))
    if extra:
        raise UserError(f"NanoChat parameter {extra[0]} has no counterpart in model.py ({len(extra)} such)")
    if missing:
        raise UserError(f"the NanoChat weights lack {missing[0]} ({len(missing)} missing)")
    return {names[key]: tensor.float() for key, tensor in hf_state.items()}


# -----------------------------------------------------------------------------
# Config


def hf_config(config, tokenizer):
    """The NanoChatConfig of a GPTConfig (refusing a field NanoChat has no place for) and its tokenizer."""
    from transformers import NanoChatConfig

    known = {"sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"}
    for field in fields(config):
        if field.name not in known:
            raise UserError(f"model config field {field.name}={getattr(config, field.name)!r} has no NanoChat "
                            "counterpart: this model cannot be exported")
    if config.vocab_size != tokenizer.vocab_size:
        raise UserError(f"the model has vocab_size {config.vocab_size} but its tokenizer {tokenizer.vocab_size} tokens")
    return NanoChatConfig(
        vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=4 * config.n_embd,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
        max_position_embeddings=config.sequence_len, hidden_act="relu2", attention_bias=False,
        rms_norm_eps=RMS_NORM_EPS, rope_parameters={"rope_type": "default", "rope_theta": ROTARY_BASE},
        final_logit_softcapping=LOGIT_SOFTCAP, tie_word_embeddings=False, bos_token_id=tokenizer.bos_id,
        eos_token_id=[tokenizer.token_id(name) for name in EOS_NAMES],
        # None: NanoChatModel makes the pad token's embedding row a padding_idx, which never gets a gradient.
        pad_token_id=None, dtype="float32")


def gpt_config(hf):
    """
    The GPTConfig of a NanoChatConfig, or a UserError naming the first setting model.py cannot reproduce.
    rms_norm_eps may differ (NanoChatConfig's default is 1e-6): import prints it, and the probe measures it.
    """
    if hf.model_type != "nanochat":
        raise UserError(f"config.json has model_type {hf.model_type!r}; only 'nanochat' can be imported")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope = hf.rope_parameters or {}
    checks = [
        ("hidden_act", hf.hidden_act, "relu2"),
        ("intermediate_size", hf.intermediate_size, 4 * hf.hidden_size),
        ("attention_bias", hf.attention_bias, False),
        ("tie_word_embeddings", hf.tie_word_embeddings, False),
        ("final_logit_softcapping", hf.final_logit_softcapping, LOGIT_SOFTCAP),
        ("rope_parameters.rope_type", rope.get("rope_type"), "default"),
        ("rope_parameters.rope_theta", rope.get("rope_theta"), ROTARY_BASE),
        ("head_dim", head_dim, hf.hidden_size // hf.num_attention_heads),
    ]
    for name, value, expected in checks:
        if value != expected:
            raise UserError(f"config.json has {name}={value!r}; model.py can only hold {expected!r}")
    try:
        return GPTConfig(sequence_len=hf.max_position_embeddings, vocab_size=hf.vocab_size,
                         n_layer=hf.num_hidden_layers, n_head=hf.num_attention_heads,
                         n_kv_head=hf.num_key_value_heads, n_embd=hf.hidden_size)
    except ValueError as e:
        raise UserError(f"config.json: {e}") from None


# -----------------------------------------------------------------------------
# Tokenizer


def bytes_to_unicode():
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies (tokenizer.json) are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_CHARS = bytes_to_unicode()
CHAR_BYTES = {char: b for b, char in BYTE_CHARS.items()}


def as_chars(token):
    """A token's bytes as tokenizer.json writes them: one BYTE_CHARS character per byte."""
    return "".join(BYTE_CHARS[b] for b in token)


def bpe_merges(ranks):
    """
    The merge list of a byte-level BPE with tiktoken's ranks {token bytes: rank}. tiktoken merges the adjacent pair
    whose concatenation has the lowest rank; HF's BPE the pair listed first. So every split of a token into two
    tokens is listed, in the order of the token's rank: both then merge the same pair at every step. (The splits of
    one token all make that token; their order among themselves changed no encoding in the tests.)
    """
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        merges.extend((as_chars(token[:i]), as_chars(token[i:])) for i in range(1, len(token))
                      if token[:i] in ranks and token[i:] in ranks)
    return merges


def chat_template():
    """
    The Jinja chat template of Tokenizer._render: <|bos|>, the system text merged into the first user turn as
    "system\\n\\nuser", user turns <|user_start|>text<|user_end|>, assistant turns <|assistant_start|>parts
    <|assistant_end|>, add_generation_prompt -> <|assistant_start|>. Encoding the rendered string gives this repo's
    ids because each special token starts a new piece of text, as each encode() call does in the renderer. Two
    inputs cannot give them, and raise instead: a special token's name inside a message (the renderer encodes it as
    text; the template's output would hold the token), and two adjacent text parts (encoded one by one there).
    The structural errors of tokenizer._parse_conversation raise too.
    """
    specials = "[" + ", ".join(repr(name) for name in SPECIAL_TOKENS) + "]"
    lines = [
        "{%- set ns = namespace(system='', turns=0, previous='') -%}",
        "{{- '<|bos|>' -}}",
        "{%- for message in messages -%}",
        "{%- set i = loop.index0 -%}",
        "{%- set parts = [{'type': 'text', 'text': message['content']}] if message['content'] is string "
        "else message['content'] -%}",
        "{%- for part in parts -%}{%- for name in " + specials + " -%}{%- if name in part['text'] -%}"
        "{{- raise_exception('message ' ~ i ~ ' contains the special token ' ~ name ~ ' as text, which this "
        "template cannot encode as text') -}}{%- endif -%}{%- endfor -%}"
        "{%- if message['role'] != 'assistant' and part['type'] != 'text' -%}"
        "{{- raise_exception('message ' ~ i ~ ' (' ~ message['role'] ~ ') has a ' ~ part['type'] ~ ' part; only "
        "assistant messages hold tool calls') -}}{%- endif -%}{%- endfor -%}",
        "{%- if message['role'] == 'system' -%}",
        "{%- if i != 0 -%}{{- raise_exception('message ' ~ i ~ ' has role system; only message 0 may be a system "
        "message') -}}{%- endif -%}",
        "{%- set ns.system = parts | map(attribute='text') | join -%}",
        "{%- elif message['role'] in ['user', 'assistant'] -%}",
        "{%- if message['role'] != (['user', 'assistant'][ns.turns % 2]) -%}{{- raise_exception('message ' ~ i ~ "
        "' has role ' ~ message['role'] ~ '; after any system message, user and assistant turns must alternate "
        "starting with user') -}}{%- endif -%}",
        "{%- if message['role'] == 'user' -%}",
        "{{- '<|user_start|>' -}}",
        "{%- if ns.turns == 0 and messages[0]['role'] == 'system' -%}{{- ns.system ~ '\\n\\n' -}}{%- endif -%}",
        "{{- parts | map(attribute='text') | join -}}{{- '<|user_end|>' -}}",
        "{%- else -%}",
        "{{- '<|assistant_start|>' -}}{%- set ns.previous = '' -%}",
        "{%- for part in parts -%}",
        "{%- if part['type'] == 'text' -%}",
        "{%- if ns.previous == 'text' -%}{{- raise_exception('message ' ~ i ~ ' has two adjacent text parts; join "
        "them into one') -}}{%- endif -%}{{- part['text'] -}}",
        "{%- elif part['type'] == 'python' -%}{{- '<|python_start|>' ~ part['text'] ~ '<|python_end|>' -}}",
        "{%- elif part['type'] == 'python_output' -%}{{- '<|output_start|>' ~ part['text'] ~ '<|output_end|>' -}}",
        "{%- else -%}{{- raise_exception('message ' ~ i ~ ' has a part of type ' ~ part['type'] ~ '; expected "
        "text/python/python_output') -}}",
        "{%- endif -%}{%- set ns.previous = part['type'] -%}",
        "{%- endfor -%}",
        "{{- '<|assistant_end|>' -}}",
        "{%- endif -%}",
        "{%- set ns.turns = ns.turns + 1 -%}",
        "{%- else -%}",
        "{{- raise_exception('message ' ~ i ~ ' has role ' ~ message['role'] ~ '; expected system/user/assistant') -}}",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}{{- '<|assistant_start|>' -}}{%- endif -%}",
    ]
    return "\n".join(lines)


def hf_tokenizer(tokenizer):
    """A `tokenizers` Tokenizer that encodes exactly as `tokenizer` (tiktoken): same split regex, merges, specials."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    ranks = tokenizer.mergeable_ranks
    hf = HFTokenizer(models.BPE(vocab={as_chars(token): rank for token, rank in ranks.items()},
                                merges=bpe_merges(ranks), fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tokenizer.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])  # bytes -> BYTE_CHARS only
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in SPECIAL_TOKENS])
    got = {name: hf.token_to_id(name) for name in SPECIAL_TOKENS}
    if got != tokenizer.special_tokens:
        raise UserError(f"special token ids {got} differ from the tokenizer's {tokenizer.special_tokens}")
    return hf


def tokenizer_config(sequence_len):
    """tokenizer_config.json: the special tokens' roles, the chat template."""
    return {"tokenizer_class": "TokenizersBackend", "backend": "tokenizers", "bos_token": "<|bos|>",
            "eos_token": "<|assistant_end|>", "pad_token": "<|assistant_end|>", "model_max_length": sequence_len,
            "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "chat_template": chat_template()}


def save_tokenizer(tokenizer, out, sequence_len):
    """Write tokenizer.json and tokenizer_config.json of `tokenizer` into the folder `out`, probe texts checked first."""
    hf = hf_tokenizer(tokenizer)
    check_tokenizers(tokenizer, hf)
    hf.save(str(Path(out) / "tokenizer.json"))
    config = tokenizer_config(sequence_len)
    (Path(out) / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def tokenizer_from_hf(path):
    """
    This repo's Tokenizer from a tokenizer.json, or a UserError naming what it cannot hold: a model other than
    byte-level BPE, a pre-tokenizer other than one split regex + byte-level, a normalizer, special tokens other than
    SPECIAL_TOKENS right after the merges (missing ones are named).
    """
    data = json.loads(Path(path).read_text())
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"{path}: tokenizer model {model.get('type')!r}; only byte-level BPE can be imported")
    if data.get("normalizer") is not None:
        raise UserError(f"{path}: has a normalizer ({data['normalizer'].get('type')}); tokenizer.py has none")
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if ([step.get("type") for step in steps] != ["Split", "ByteLevel"] or "Regex" not in steps[0].get("pattern", {})
            or steps[0].get("behavior") != "Isolated" or steps[0].get("invert") or steps[1].get("use_regex")
            or steps[1].get("add_prefix_space")):
        raise UserError(f"{path}: pre-tokenizer {json.dumps(pre)[:200]} is not one split regex followed by "
                        "byte-level (use_regex false, no prefix space), the only kind tokenizer.py has")
    vocab = model["vocab"]
    try:
        ranks = {bytes(CHAR_BYTES[char] for char in token): rank for token, rank in vocab.items()}
    except KeyError as e:
        raise UserError(f"{path}: vocabulary token with character {e} is not byte-level") from None
    n = len(ranks)
    added = {token["content"]: token["id"] for token in data.get("added_tokens", [])}
    missing = [name for name in SPECIAL_TOKENS if name not in added]
    if missing:
        raise UserError(f"{path}: the special tokens {', '.join(missing)} are missing; the chat format needs all of "
                        f"{', '.join(SPECIAL_TOKENS)}")
    extra = sorted(set(added) - set(SPECIAL_TOKENS))
    if extra:
        raise UserError(f"{path}: added tokens {', '.join(extra)} have no place in tokenizer.py's vocabulary")
    expected = {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
    if added != expected:
        raise UserError(f"{path}: special token ids {added}; tokenizer.py needs them right after the {n} merges, "
                        f"in its order: {expected}")
    try:
        return Tokenizer(ranks, steps[0]["pattern"]["Regex"])
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None


def check_tokenizers(ours, hf):
    """UserError unless both encode every probe text to the same ids (special-token names as text included)."""
    for text in PROBE_TEXTS:
        a, b = ours.encode(text), hf.encode(text, add_special_tokens=False).ids
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise UserError(f"the converted tokenizer encodes {text!r} differently from token {i} on: "
                            f"{a[i:i + 8]} vs {b[i:i + 8]}")


# -----------------------------------------------------------------------------
# The probe: both models on the same ids


@torch.no_grad()
def probe_difference(gpt, hf_model, vocab_size, seed=0):
    """Max |logit difference| of the two models (float32, CPU) on 2 rows x 32 random tokens."""
    ids = torch.randint(0, vocab_size, (2, min(32, gpt.config.sequence_len)),
                        generator=torch.Generator().manual_seed(seed))
    return float((gpt(ids) - hf_model(input_ids=ids).logits.float()).abs().max())


def check_probe(gpt, hf_model, vocab_size):
    """The probe's max |logit difference|, or a UserError when it exceeds PROBE_TOLERANCE (nothing is written)."""
    diff = probe_difference(gpt, hf_model, vocab_size)
    if not diff <= PROBE_TOLERANCE:
        raise UserError(f"the converted model's logits differ by {diff:.3g} (> {PROBE_TOLERANCE}) from the original's "
                        "on the probe batch: not written")
    return diff


# -----------------------------------------------------------------------------
# The two directions


def export(ckpt, out, format="hf"):
    """
    Write the HF NanoChat folder `out` from the checkpoint folder `ckpt`; returns the probe's max |logit diff|.
    format "mlx": the same folder with the weights under nanochat's own names (nanochat_key) and config.json's
    rope_theta at the top level, which mlx-lm's nanochat model reads; transformers does not load that folder.
    """
    model, tokenizer, meta = load_model(ckpt, "cpu")
    if meta.get("reward_model"):
        raise UserError(f"{ckpt} is a reward model: its scalar head has no counterpart in NanoChatForCausalLM")
    from transformers import GenerationConfig, NanoChatForCausalLM  # seconds to import: refusals above answer first

    config = hf_config(model.config, tokenizer)
    hf_state = to_hf_state(model.state_dict())
    hf_model = NanoChatForCausalLM(config).eval()
    hf_model.load_state_dict(hf_state, strict=True)
    diff = check_probe(model, hf_model, tokenizer.vocab_size)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, out, model.config.sequence_len)
    eos = [tokenizer.token_id(name) for name in EOS_NAMES]
    hf_model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_id, eos_token_id=eos,
                                                  pad_token_id=tokenizer.token_id("<|assistant_end|>"))
    hf_model.save_pretrained(out)
    if format == "mlx":
        from safetensors.torch import save_file

        state = {nanochat_key(key): tensor.contiguous() for key, tensor in model.state_dict().items()}
        for extra in out.glob("model*.safetensors*"):  # save_pretrained's HF-named weights (and index, if sharded)
            extra.unlink()
        save_file(state, out / "model.safetensors", metadata={"format": "mlx"})
        config_path = out / "config.json"
        written = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**written, "rope_theta": ROTARY_BASE}, indent=2) + "\n")
    return diff


def import_(hf_dir, out):
    """Write a checkpoint to `out` from the HF NanoChat folder `hf_dir`; returns (step folder, probe diff)."""
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import AutoConfig, NanoChatForCausalLM

    hf_dir = Path(hf_dir)
    for name in ("config.json", "tokenizer.json"):
        if not (hf_dir / name).is_file():
            raise UserError(f"{hf_dir} has no {name}: not a Hugging Face model folder with its tokenizer")
    if not any(hf_dir.glob("*.safetensors")):
        raise UserError(f"{hf_dir} has no *.safetensors weights; save the model with save_pretrained first")
    hf_cfg = AutoConfig.from_pretrained(hf_dir)
    config = gpt_config(hf_cfg)
    tokenizer = tokenizer_from_hf(hf_dir / "tokenizer.json")
    if tokenizer.vocab_size != config.vocab_size:
        raise UserError(f"config.json has vocab_size {config.vocab_size} but tokenizer.json {tokenizer.vocab_size} "
                        "tokens; model.py needs them equal")
    check_tokenizers(tokenizer, HFTokenizer.from_file(str(hf_dir / "tokenizer.json")))
    if hf_cfg.rms_norm_eps != RMS_NORM_EPS:
        common.print0(f"note: rms_norm_eps {hf_cfg.rms_norm_eps:g} becomes model.py's {RMS_NORM_EPS:g} (float32's "
                      "epsilon); the probe below measures what that changes")
    hf_model = NanoChatForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    state = from_hf_state(hf_model.state_dict(), config)
    model = GPT(config)
    model.load_state_dict(state, strict=True)
    model.eval()
    diff = check_probe(model, hf_model, tokenizer.vocab_size)
    meta = {"stage": "import", "finished": True, "source": str(hf_dir.resolve())}
    return common.save_checkpoint(out, 0, model, meta, tokenizer=tokenizer), diff


def main(argv=None):
    parser = argparse.ArgumentParser(description="Export a checkpoint to the Hugging Face NanoChat format, or import "
                                     "one.", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="export: the checkpoint folder (a stage folder or one step_* folder in it)")
    source.add_argument("--import", dest="import_dir", metavar="HF_DIR",
                        help="import: a Hugging Face folder with config.json (model_type nanochat), its weights and "
                        "tokenizer.json")
    parser.add_argument("--format", choices=["hf", "mlx"], default="hf",
                        help="export: hf (transformers, lm-evaluation-harness) or mlx (mlx-lm: nanochat's own weight "
                        "names, which its models/nanochat.py loads)")
    parser.add_argument("--out", required=True, help="export: the Hugging Face folder to write; import: the "
                        "checkpoint folder to write (step_000000 inside, tokenizer included)")
    args = parser.parse_args(argv)
    if args.ckpt:
        diff = export(args.ckpt, args.out, args.format)
        print(f"exported {args.ckpt} -> {args.out} (probe: max |logit difference| {diff:.2g})")
    else:
        path, diff = import_(args.import_dir, args.out)
        print(f"imported {args.import_dir} -> {path} (probe: max |logit difference| {diff:.2g}); "
              f"post-train it with e.g. `python sft.py --ckpt {args.out}`")


if __name__ == "__main__":
    common.run_cli(main)

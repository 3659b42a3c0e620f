"""
export.py: a checkpoint exported to the Hugging Face NanoChat format loads in transformers (no remote code) as the
same model and tokenizer, a NanoChat folder imports as a checkpoint the stages train on, and what the format cannot
hold is refused in one line. Everything local: the models are built in-process.

    python -m pytest -q tests/test_export.py
"""

import json
import random
import subprocess
import sys
from dataclasses import make_dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, NanoChatConfig, NanoChatForCausalLM

import common
import export
import sft
import tasks
from common import UserError
from conftest import make_tokenizer, tiny_preset_model
from engine import Engine, load_model
from model import GPT, GPTConfig
from tokenizer import SPECIAL_TOKENS, Tokenizer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def exported(tokenizer, tmp_path_factory):
    """conftest.tiny_preset_model saved as a checkpoint and exported: (model, checkpoint folder, HF folder)."""
    model = tiny_preset_model(tokenizer)
    root = tmp_path_factory.mktemp("export")
    common.save_checkpoint(root / "ckpt", 1, model, {"stage": "sft"}, tokenizer=tokenizer)
    export.main(["--ckpt", str(root / "ckpt"), "--out", str(root / "hf")])
    return model, root / "ckpt", root / "hf"


def conversations(n):
    """n conversations: synthetic problems (several with calculator calls), plus system, multi-turn and list forms."""
    task = tasks.SyntheticTask("train", size=n, seed=0)
    convs = [task[i] for i in range(n - 4)]
    calc = [{"type": "text", "text": "Let me compute: "}, {"type": "python", "text": "12*7"},
            {"type": "python_output", "text": "84"}, {"type": "text", "text": " so 84.\n#### 84"}]
    convs += [
        {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 12*7?"},
                      {"role": "assistant", "content": calc}]},
        {"messages": [{"role": "user", "content": "Hi!  "}, {"role": "assistant", "content": "Hello.\n\n"},
                      {"role": "user", "content": "Count: 1 22 333 4444"},
                      {"role": "assistant", "content": [{"type": "python", "text": "1+22"},
                                                        {"type": "python_output", "text": "23"}]}]},
        {"messages": [{"role": "system", "content": [{"type": "text", "text": "Sys "}, {"type": "text", "text": "two"}]},
                      {"role": "user", "content": [{"type": "text", "text": "naïve "}, {"type": "text", "text": "日本"}]},
                      {"role": "assistant", "content": "  spaced\tout  "}]},
        {"messages": [{"role": "user", "content": "<|notatoken|> and <|bos| and {{ jinja }}"},
                      {"role": "assistant", "content": "ok 🙂"}]},
    ]
    return convs


def mixed_texts(n, seed):
    """n texts mixing letters of several scripts, digits, whitespace runs, punctuation, emoji, special-looking strings."""
    rng = random.Random(seed)
    pieces = ["Hello", " world", "don't", " I'LL", " we've", "123", "4567890", " 3.14", "\n", "\n\n", "\r\n", "\t",
              "   ", "    \n", "café", " naïve", " Straße", "日本語", "привет", " مرحبا", "🙂", "👍🏽", "—", "!!", "?",
              "<|", "|>", "<|notatoken|>", "<|bos", "</s>", "[INST]", "{{ x }}", " ", "x", "ÿ", "\u00a0", "\u200b"]
    fixed = ["", " ", "  leading and trailing  ", "12345678901234567890", "a\n\n\nb", "\t\t tabs\t",
             "ALL CAPS SHOUTING", "it's 2024's year; they'd've", "emoji🙂🙂🙂run", "<|bos|>", "a <|user_end|> b"]
    texts = fixed + ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 24))) for _ in range(n - len(fixed))]
    return texts[:n]


# -----------------------------------------------------------------------------
# The model


def test_exported_model_gives_the_same_logits_on_padded_rows(exported, tokenizer):
    model, _, hf_dir = exported
    hf = AutoModelForCausalLM.from_pretrained(hf_dir)  # no trust_remote_code: transformers' own NanoChat
    assert type(hf) is NanoChatForCausalLM and hf.dtype == torch.float32
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "nanochat" and config["num_key_value_heads"] == model.config.n_kv_head

    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, tokenizer.vocab_size, (n,), generator=generator) for n in (7, 40, 1, 23)]
    T = max(len(r) for r in rows)
    worst = 0.0
    for side in ("right", "left"):
        ids = torch.full((len(rows), T), tokenizer.token_id("<|assistant_end|>"))
        mask = torch.zeros(len(rows), T, dtype=torch.long)
        for b, row in enumerate(rows):
            where = slice(0, len(row)) if side == "right" else slice(T - len(row), T)
            ids[b, where], mask[b, where] = row, 1
        with torch.no_grad():
            theirs = hf(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
            for b, row in enumerate(rows):
                ours = model(row[None])[0]  # (len, V): the row alone, no padding
                got = theirs[b][mask[b].bool()]
                worst = max(worst, float((got - ours).abs().max()))
    print(f"max |logit difference| over {len(rows)} rows, both padding sides: {worst:.2e}")
    assert worst < 1e-4


def test_greedy_generate_matches_the_engine_and_stops_at_the_same_token(exported, tokenizer):
    model, _, hf_dir = exported
    convs = conversations(8)[:3]
    prompts = [tokenizer.render_for_completion(c) for c in convs]
    ours = [row[0] for row in Engine(model, tokenizer).generate(prompts, max_tokens=32, temperature=0)]
    # The test means something only if every answer stops, after a few tokens, and without calling the calculator.
    assert [c.finish for c in ours] == ["stop"] * 3 and min(len(c.tokens) for c in ours) > 2
    assert tokenizer.token_id("<|python_end|>") not in sum((c.tokens for c in ours), [])

    hf = AutoModelForCausalLM.from_pretrained(hf_dir)
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    hf_tok.padding_side = "left"  # one batch: the prompts end together, the answers start together
    batch = hf_tok.apply_chat_template([c["messages"][:-1] for c in convs], add_generation_prompt=True,
                                       padding=True, return_tensors="pt", return_dict=True)
    out = hf.generate(**batch, max_new_tokens=32, do_sample=False)[:, batch["input_ids"].shape[1]:]
    eos = set(hf.generation_config.eos_token_id)
    assert eos == {tokenizer.token_id("<|assistant_end|>"), tokenizer.bos_id}
    for completion, row in zip(ours, out.tolist()):
        stop = next(i for i, token in enumerate(row) if token in eos)
        assert row[:stop + 1] == completion.tokens  # the same tokens, the same closing stop token


# -----------------------------------------------------------------------------
# The tokenizer


@pytest.fixture(scope="module")
def mixed_tokenizer(tmp_path_factory):
    """A tokenizer trained on mixed text (merges inside multi-byte characters, digits, whitespace runs), exported."""
    tokenizer = Tokenizer.train(mixed_texts(400, seed=1) * 3, vocab_size=700)
    out = tmp_path_factory.mktemp("mixed_tokenizer")
    export.save_tokenizer(tokenizer, out, sequence_len=256)
    return tokenizer, out


@pytest.mark.parametrize("which", ["synthetic", "mixed"])
def test_exported_tokenizer_encodes_50_mixed_texts_identically(which, exported, tokenizer, mixed_tokenizer):
    ours, folder = (tokenizer, exported[2]) if which == "synthetic" else mixed_tokenizer
    theirs = AutoTokenizer.from_pretrained(folder)
    texts = mixed_texts(50, seed=0)
    for text in texts:
        ids = ours.encode(text)
        # split_special_tokens: a special token's name in text is text, as in tokenizer.py.
        assert theirs(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] == ids, text
        if not any(name in text for name in SPECIAL_TOKENS):
            assert theirs(text)["input_ids"] == ids, text  # the default call adds nothing
        assert theirs.decode(ids) == text
    # transformers' default, as for every HF tokenizer: an exact special token's name becomes that token.
    assert theirs("<|bos|>")["input_ids"] == [ours.bos_id]
    assert sum(len(ours.encode(t)) for t in texts) > 500


def test_chat_template_renders_20_conversations_to_the_renderers_ids(exported, tokenizer):
    theirs = AutoTokenizer.from_pretrained(exported[2])
    convs = conversations(20)
    for conversation in convs:
        messages = conversation["messages"]
        ids, _ = tokenizer.render_conversation(conversation)
        assert theirs.apply_chat_template(messages, return_dict=False) == ids
        prompt = theirs.apply_chat_template(messages[:-1], add_generation_prompt=True, return_dict=False)
        assert prompt == tokenizer.render_for_completion(conversation)
    tool = tokenizer.token_id("<|python_start|>"), tokenizer.token_id("<|output_start|>")
    assert sum(all(t in tokenizer.render_conversation(c)[0] for t in tool) for c in convs) >= 4


@pytest.mark.parametrize("messages, error", [
    ([{"role": "user", "content": "say <|assistant_end|> now"}], "contains the special token <|assistant_end|>"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]}],
     "two adjacent text parts"),
    ([{"role": "assistant", "content": "hi"}], "must alternate starting with user"),
    ([{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}], "only message 0"),
    ([{"role": "user", "content": [{"type": "python", "text": "1+1"}]}], "only assistant messages hold tool calls"),
    ([{"role": "robot", "content": "hi"}], "expected system/user/assistant"),
])
def test_chat_template_refuses_what_it_cannot_render_as_the_renderer_does(exported, messages, error):
    theirs = AutoTokenizer.from_pretrained(exported[2])
    with pytest.raises(Exception, match=error.replace("|", r"\|")):
        theirs.apply_chat_template(messages, add_generation_prompt=True)


# -----------------------------------------------------------------------------
# Import


def random_nanochat(folder, tokenizer, **overrides):
    """A randomly initialised NanoChatForCausalLM (GQA, weights of std 0.2: every part matters) saved with its tokenizer."""
    settings = dict(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
                    bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.token_id("<|assistant_end|>"),
                    pad_token_id=None)
    torch.manual_seed(0)
    hf = NanoChatForCausalLM(NanoChatConfig(**{**settings, **overrides})).eval()
    hf.save_pretrained(folder)
    export.save_tokenizer(tokenizer, folder, sequence_len=128)
    return hf


def test_import_of_a_random_nanochat_gives_the_same_forward_and_sft_trains_on_it(tokenizer, tmp_path, monkeypatch,
                                                                                 capsys):
    ids = torch.randint(0, tokenizer.vocab_size, (3, 50), generator=torch.Generator().manual_seed(1))
    diffs = {}
    # NanoChatConfig's default rms_norm_eps (1e-6) is not model.py's (float32's epsilon, 1.2e-7): said and measured.
    for eps in (1e-6, export.RMS_NORM_EPS):
        hf = random_nanochat(tmp_path / f"hf{eps}", tokenizer, rms_norm_eps=eps)
        export.main(["--import", str(tmp_path / f"hf{eps}"), "--out", str(tmp_path / f"imported{eps}")])
        assert ("rms_norm_eps 1e-06 becomes" in capsys.readouterr().out) == (eps == 1e-6)
        model, loaded, meta = load_model(tmp_path / f"imported{eps}", "cpu")
        assert meta["stage"] == "import" and loaded.mergeable_ranks == tokenizer.mergeable_ranks
        assert model.config.n_kv_head == 2 and model.config.sequence_len == 128
        with torch.no_grad():
            diffs[eps] = float((model(ids) - hf(input_ids=ids).logits).abs().max())
            assert float(model(ids).std()) > 0.5  # logits that vary: the comparison means something
    print(f"imported vs transformers, max |logit difference|: {diffs}")
    assert diffs[1e-6] < 1e-4 and diffs[export.RMS_NORM_EPS] < 1e-5

    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "home"))
    sft.main(["--preset", "tiny", "--device", "cpu", "--ckpt", str(tmp_path / "imported1e-06"), "--out",
              str(tmp_path / "sft"), "--train-rows", "8", "--batch-size", "8", "--num-steps", "1",
              "--device-batch-tokens", "1024", "--eval-rows", "8", "--check-problems", "2", "--check-samples", "1",
              "--max-new-tokens", "8", "--eval-every", "1"])
    tuned, _, tuned_meta = load_model(tmp_path / "sft", "cpu")
    assert tuned_meta["stage"] == "sft" and tuned_meta["step"] == 1
    imported, _, _ = load_model(tmp_path / "imported1e-06", "cpu")
    assert not torch.equal(tuned.lm_head.weight, imported.lm_head.weight)  # the step moved the weights


def test_export_then_import_gives_the_same_weights_and_tokenizer(exported, tokenizer, tmp_path):
    model, _, hf_dir = exported
    export.main(["--import", str(hf_dir), "--out", str(tmp_path / "back")])
    back, back_tokenizer, _ = load_model(tmp_path / "back", "cpu")
    state, back_state = model.state_dict(), back.state_dict()
    assert state.keys() == back_state.keys()
    assert all(torch.equal(state[key], back_state[key]) for key in state)
    assert back_tokenizer.mergeable_ranks == tokenizer.mergeable_ranks and back_tokenizer.pattern == tokenizer.pattern
    assert back_tokenizer.special_tokens == tokenizer.special_tokens


# -----------------------------------------------------------------------------
# Refusals: one line, naming what the format (or model.py) cannot hold


def edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("key, value, error", [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("tie_word_embeddings", True, "tie_word_embeddings=True"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
    ("attention_bias", True, "attention_bias=True"),
    ("intermediate_size", 192, "intermediate_size=192"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 500000.0}, "rope_theta=500000.0"),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, "rope_type='linear'"),
    ("rms_norm_eps", 0.5, "logits differ by"),  # representable by neither side's checks: the probe catches it
])
def test_import_refuses_a_config_model_py_cannot_hold(tokenizer, tmp_path, key, value, error):
    random_nanochat(tmp_path / "hf", tokenizer)
    edit_json(tmp_path / "hf" / "config.json", lambda c: c.update({key: value}))
    with pytest.raises(UserError, match=error.replace("(", r"\(").replace(".", r"\.")) as caught:
        export.main(["--import", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")])
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "imported").exists()  # nothing written


def drop_specials(data):
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in ("<|python_start|>", "<|python_end|>")]


@pytest.mark.parametrize("change, error", [
    (drop_specials, "special tokens <|python_start|>, <|python_end|> are missing"),
    (lambda d: d.update(normalizer={"type": "NFC"}), "has a normalizer (NFC)"),
    (lambda d: d.update(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                       "use_regex": True}), "is not one split regex followed by byte-level"),
    (lambda d: d["added_tokens"].append({"id": 400, "content": "<|extra|>", "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": True}),
     "added tokens <|extra|> have no place"),
])
def test_import_refuses_a_tokenizer_tokenizer_py_cannot_hold(tokenizer, tmp_path, change, error):
    random_nanochat(tmp_path / "hf", tokenizer)
    edit_json(tmp_path / "hf" / "tokenizer.json", change)
    with pytest.raises(UserError, match=error.replace("|", r"\|").replace("(", r"\(").replace(")", r"\)")) as caught:
        export.main(["--import", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")])
    assert "\n" not in str(caught.value)


def test_export_refuses_what_nanochat_cannot_hold(tokenizer, tmp_path):
    config = GPTConfig(sequence_len=64, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    with pytest.raises(UserError, match="parameter blocks.0.attn.ve_gate.weight has no counterpart in NanoChat"):
        export.to_hf_state({**GPT(config).state_dict(), "blocks.0.attn.ve_gate.weight": torch.zeros(2, 2)})
    # A model config field that model.py might grow (a sliding window, say) is named, not dropped.
    windowed = make_dataclass("Windowed", [("window_size", int, 128)], bases=(GPTConfig,))
    with pytest.raises(UserError, match="model config field window_size=128 has no NanoChat counterpart"):
        export.hf_config(windowed(**vars(config)), tokenizer)
    with pytest.raises(UserError, match="vocab_size 512 but its tokenizer 400"):
        export.hf_config(GPTConfig(sequence_len=64, vocab_size=512, n_layer=1, n_head=2, n_kv_head=2, n_embd=32),
                         tokenizer)


def test_cli_refuses_a_reward_model_in_one_line(tokenizer, tmp_path):
    from model import ScalarHeadModel

    config = GPTConfig(sequence_len=64, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    common.save_checkpoint(tmp_path / "rm", 1, ScalarHeadModel(GPT(config)), {"stage": "rm", "reward_model": True},
                           tokenizer=tokenizer)
    result = subprocess.run([sys.executable, "export.py", "--ckpt", str(tmp_path / "rm"), "--out", str(tmp_path / "hf")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"export.py: error: {tmp_path / 'rm'} is a reward model: its scalar head has no counterpart in NanoChatForCausalLM"]
    assert not (tmp_path / "hf").exists()

"""Tokenizer: byte-level round trips, save/load, and the chat rendering (mask rules, prefix stability, validation)."""

import json
import os
import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tokenizer import SPECIAL_TOKENS, Tokenizer

REPO = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 400

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split text into pieces, and models predict the next piece.",
    "def add(a, b):\n    return a + b\n",
    "In 2024, 1234 + 5678 = 6912 and 3.14159 is close to pi.",
    "Café, naïve, façade, résumé: accents everywhere.",
    "日本語のテキストも少し含めます。",
    "Emoji: 😀👍🏽🎉 and symbols ∑ √ ∞ ≠ ≤.",
    "Привет, мир! Γειά σου Κόσμε!",
    "Question: What is 12 * 7?\nAnswer: 12 * 7 = 84.\n#### 84",
    "She said: 'I'll be there at 10:30, don't wait.'",
    "\tIndented\ttabs\tand   multiple   spaces\n\n",
]


def strip_ansi(text):
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


@pytest.fixture(scope="module")
def tok():
    rng = random.Random(0)
    corpus = [" ".join(rng.choices(SENTENCES, k=4)) for _ in range(60)]  # ~20 KB
    return Tokenizer.train(corpus, VOCAB_SIZE)


# -----------------------------------------------------------------------------
# Vocabulary, encode, decode


def test_vocab_layout(tok):
    assert tok.vocab_size == VOCAB_SIZE
    # the special tokens are the last ids, in SPECIAL_TOKENS order
    assert [tok.token_id(name) for name in SPECIAL_TOKENS] == list(range(VOCAB_SIZE - len(SPECIAL_TOKENS), VOCAB_SIZE))
    assert tok.bos_id == tok.token_id("<|bos|>")
    assert tok.decode([tok.bos_id]) == "<|bos|>"
    with pytest.raises(KeyError, match="not a special token"):
        tok.token_id("<|eos|>")


def test_train_validates_and_warns():
    with pytest.raises(ValueError, match="at least 265"):
        Tokenizer.train(["hello"], 264)
    # Two distinct words support only a handful of merges: the smaller vocabulary is reported, not hidden.
    with pytest.warns(UserWarning, match="only supports"):
        small = Tokenizer.train(["hello world"] * 3, 300)
    assert small.vocab_size < 300
    assert small.encode("hello world") == [small.encode("hello")[0], small.encode(" world")[0]]


def _random_strings(n):
    rng = random.Random(1)
    for _ in range(n):
        yield bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))).decode("utf-8", errors="replace")
        code_points = [rng.randrange(0x110000) for _ in range(rng.randrange(1, 16))]
        yield "".join(chr(c) for c in code_points if not 0xD800 <= c < 0xE000)  # any non-surrogate character


ROUND_TRIP = [
    "",
    "hello world",
    "family: 👨‍👩‍👧‍👦, skin tone: 👍🏽, flag: 🇫🇷",
    "中文和日本語と한국어",
    "combining marks: e\u0301 a\u0308 n\u0303, zero width: a\u200bb",
    "control chars: \x00\x01\x07\x1b[31m\r\n\t\x7f\x85",
    "   leading and trailing whitespace \n\n\n  ",
    "12345678901234567890 3.14159e-10",
    "<|bos|> and <|assistant_end|> typed as text",
]


@pytest.mark.parametrize("text", ROUND_TRIP + list(_random_strings(10)))
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_batch_encode_matches_single(tok):
    texts = ROUND_TRIP + SENTENCES
    assert tok.encode(texts) == [tok.encode(text) for text in texts]
    assert tok.encode(texts, prepend="<|bos|>") == [[tok.bos_id] + tok.encode(text) for text in texts]


def test_prepend_append(tok):
    body = tok.encode("Hi there")
    end = tok.token_id("<|assistant_end|>")
    assert tok.encode("Hi there", prepend="<|bos|>", append=end) == [tok.bos_id] + body + [end]
    assert tok.encode("Hi there", prepend=tok.bos_id) == [tok.bos_id] + body
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.encode("Hi", prepend=VOCAB_SIZE)


def test_special_token_text_is_ordinary(tok):
    text = "<|bos|>hi<|assistant_end|>"
    ids = tok.encode(text)
    assert not set(ids) & set(tok.token_id(name) for name in SPECIAL_TOKENS)
    assert tok.decode(ids) == text


# -----------------------------------------------------------------------------
# Save and load


def test_save_load_round_trip(tok, tmp_path):
    tok.save(tmp_path / "tok")
    loaded = Tokenizer.load(tmp_path / "tok")
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.special_tokens == tok.special_tokens
    texts = ROUND_TRIP + SENTENCES
    assert loaded.encode(texts) == tok.encode(texts)
    conversation = TOOL_CONVERSATION
    assert loaded.render_conversation(conversation) == tok.render_conversation(conversation)


def test_load_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="python tokenizer.py"):
        Tokenizer.load(tmp_path / "nowhere")


def test_cli_trains_saves_and_reports(tmp_path):
    # Offline on purpose: the CLI compares against gpt2/cl100k_base only when tiktoken can fetch them. An empty
    # tiktoken cache and a proxy that refuses every connection make that fetch fail at once, so it is skipped.
    proxies = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy")
    env = {**{k: v for k, v in os.environ.items() if k not in proxies}, "NANOPOST_HOME": str(tmp_path),
           "TIKTOKEN_CACHE_DIR": str(tmp_path / "tiktoken-cache"),
           **dict.fromkeys(("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"), "http://127.0.0.1:9")}
    command = [sys.executable, str(REPO / "tokenizer.py"), "--preset", "tiny", "--max-chars", "100000", "--vocab-size", "300"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert "bytes/token" in result.stdout
    assert "gpt2" not in result.stdout and "cl100k" not in result.stdout  # nothing was downloaded
    tok = Tokenizer.load(tmp_path / "tokenizer")
    assert tok.vocab_size == 300
    assert tok.decode(tok.encode("What is 12 + 7?")) == "What is 12 + 7?"
    record = json.loads((tmp_path / "report.jsonl").read_text().splitlines()[-1])
    assert record["stage"] == "tokenizer" and record["vocab_size"] == 300 and record["val_bytes_per_token"] > 1


# -----------------------------------------------------------------------------
# Chat rendering

TOOL_CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me compute. "},
            {"type": "python", "text": "2+3"},
            {"type": "python_output", "text": "5"},
            {"type": "text", "text": "It is 5 🎉."},
        ]},
        {"role": "user", "content": "And doubled?"},
        {"role": "assistant", "content": "10."},
    ]
}


def test_render_mask_rules(tok):
    """The expected (token, flag) stream written out by hand, piece by piece."""
    S = lambda name: [tok.token_id(name)]  # noqa: E731
    pieces = [
        (S("<|bos|>"), 0),
        (S("<|user_start|>") + tok.encode("You are terse.\n\nWhat is 2+3?") + S("<|user_end|>"), 0),
        (S("<|assistant_start|>"), 0),
        (tok.encode("Let me compute. "), 1),
        (S("<|python_start|>") + tok.encode("2+3") + S("<|python_end|>"), 1),
        (S("<|output_start|>") + tok.encode("5") + S("<|output_end|>"), 0),
        (tok.encode("It is 5 🎉."), 1),
        (S("<|assistant_end|>"), 1),
        (S("<|user_start|>") + tok.encode("And doubled?") + S("<|user_end|>"), 0),
        (S("<|assistant_start|>"), 0),
        (tok.encode("10.") + S("<|assistant_end|>"), 1),
    ]
    expected = [(token, flag) for ids, flag in pieces for token in ids]
    ids, mask = tok.render_conversation(TOOL_CONVERSATION)
    assert list(zip(ids, mask)) == expected
    assert tok.decode(ids) == (
        "<|bos|><|user_start|>You are terse.\n\nWhat is 2+3?<|user_end|><|assistant_start|>Let me compute. "
        "<|python_start|>2+3<|python_end|><|output_start|>5<|output_end|>It is 5 🎉.<|assistant_end|>"
        "<|user_start|>And doubled?<|user_end|><|assistant_start|>10.<|assistant_end|>"
    )
    trained = [token for token, flag in zip(ids, mask) if flag]
    assert tok.decode(trained) == ("Let me compute. <|python_start|>2+3<|python_end|>It is 5 🎉.<|assistant_end|>"
                                   "10.<|assistant_end|>")


PREFIX_CASES = {
    "single": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    "system": {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello, friend."}]},
    "tools_multi_turn": TOOL_CONVERSATION,
    "parts_in_user": {"messages": [{"role": "user", "content": [{"type": "text", "text": "Part one, "},
                                                                 {"type": "text", "text": "part two."}]},
                                   {"role": "assistant", "content": [{"type": "python", "text": "6*7"},
                                                                     {"type": "python_output", "text": "42"}]}]},
    "three_turns": {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                 {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
                                 {"role": "user", "content": "日本"}, {"role": "assistant", "content": "語"}]},
}


@pytest.mark.parametrize("name", PREFIX_CASES)
def test_render_for_completion_is_prefix(tok, name):
    conversation = PREFIX_CASES[name]
    ids, _ = tok.render_conversation(conversation)
    prompt = tok.render_for_completion(conversation)
    assistant_start = tok.token_id("<|assistant_start|>")
    last_start = len(ids) - 1 - ids[::-1].index(assistant_start)
    assert prompt == ids[:last_start + 1]  # everything up to and including the last <|assistant_start|>
    # Dropping the last assistant turn leaves a conversation ending with a user turn: same prompt.
    without_reply = {"messages": conversation["messages"][:-1]}
    assert tok.render_for_completion(without_reply) == prompt
    with pytest.raises(ValueError, match="ends with a user message"):
        tok.render_conversation(without_reply)


MALFORMED = [
    ([{"role": "user", "content": "hi"}], "must be a dict with a 'messages' list; got list"),
    ({"conversation": []}, "must be a dict with a 'messages' list; got keys ['conversation']"),
    ({"messages": []}, "no messages"),
    ({"messages": ["hi"]}, "message 0 is a str"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]},
     "message 1 has role 'robot'; expected system/user/assistant"),
    ({"messages": [{"role": "user"}]}, "message 0 (user) has no 'content'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
     "message 1 has role 'system'; only message 0"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
     "message 1 has role 'assistant'; the first turn"),
    ({"messages": [{"role": "system", "content": "s"}]}, "only a system message"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
     "message 1 has role 'user' like message 0"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "assistant", "content": "c"}]}, "message 2 has role 'assistant' like message 1"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}, "message 1 has empty content"),
    ({"messages": [{"role": "user", "content": 42}]}, "message 0 content is int"),
    ({"messages": [{"role": "user", "content": []}]}, "message 0 has an empty content list"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "image", "text": "x"}]}]},
     "message 1 part 0 has type 'image'"),
    ({"messages": [{"role": "user", "content": "a"},
                   {"role": "assistant", "content": [{"type": "text", "text": "x"}, {"type": "python", "text": None}]}]},
     "message 1 part 1 text is NoneType"),
    ({"messages": [{"role": "user", "content": [{"type": "python", "text": "1+1"}]}]},
     "message 0 (user) has a 'python' part"),
    ({"messages": [{"role": "system", "content": [{"type": "python_output", "text": "2"}]}]},
     "message 0 (system) has a 'python_output' part"),
]


@pytest.mark.parametrize("conversation, message", MALFORMED)
def test_malformed_conversations(tok, conversation, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tok.render_conversation(conversation)
    with pytest.raises(ValueError, match=re.escape(message)):
        tok.render_for_completion(conversation)


@pytest.mark.parametrize("where", ["inside", "at the start of"])
def test_truncation_warns(tok, where):
    ids, mask = tok.render_conversation(TOOL_CONVERSATION)
    user_start = tok.token_id("<|user_start|>")
    second_user = len(ids) - 1 - ids[::-1].index(user_start)  # message 3 begins here
    if where == "inside":  # drop the last two tokens of message 2: its final text token and <|assistant_end|>
        max_tokens, label = second_user - 2, "message 2 (assistant)"
    else:
        max_tokens, label = second_user, "message 3 (user)"
    with pytest.warns(UserWarning, match=re.escape(f"is {len(ids)} tokens, longer than max_tokens={max_tokens}: "
                                                   f"truncated {where} {label}")):
        cut_ids, cut_mask = tok.render_conversation(TOOL_CONVERSATION, max_tokens=max_tokens)
    assert len(cut_ids) == len(cut_mask) == max_tokens
    assert (cut_ids, cut_mask) == (ids[:max_tokens], mask[:max_tokens])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a conversation that fits is returned whole and without a warning
        assert tok.render_conversation(TOOL_CONVERSATION, max_tokens=len(ids)) == (ids, mask)


def test_visualize(tok):
    ids, mask = tok.render_conversation(TOOL_CONVERSATION)
    shown = tok.visualize(ids, mask)
    assert strip_ansi(shown) == tok.decode(ids)  # emoji split over several tokens still comes out whole
    assert "\033[32m10.\033[0m" in shown  # trained text is green
    assert "\033[90mAnd doubled?\033[0m" in shown  # prompt text is grey
    assert "\033[32m\033[1m<|assistant_end|>" in shown  # special tokens are bold, coloured by their flag
    with pytest.raises(ValueError, match="differ in length"):
        tok.visualize(ids, mask[:-1])

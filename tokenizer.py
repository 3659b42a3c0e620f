"""
Byte-level BPE tokenizer (GPT-4 style) and the chat format every post-training stage trains on.

Training uses rustbpe (fast BPE merges in Rust); encoding uses tiktoken (fast inference) built from the same
merges. The special tokens take the last ids of the vocabulary, after the merges.

    python tokenizer.py                   # tiny preset: synthetic corpus, seconds on a laptop CPU
    python tokenizer.py --preset full     # FineWeb-Edu, 65536 tokens (needs the data; CPU only, no torchrun)

A chat is rendered as one token stream with a 0/1 training mask (see Tokenizer.render_conversation):

    <|bos|><|user_start|>system\\n\\nuser<|user_end|><|assistant_start|>text<|python_start|>1+2<|python_end|>
    <|output_start|>3<|output_end|>text<|assistant_end|>
"""

import argparse
import base64
import json
import time
import warnings
from pathlib import Path

import tiktoken

SPECIAL_TOKENS = [
    "<|bos|>",  # starts every document and every conversation
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",  # the model emits it to stop
    "<|python_start|>",  # assistant's calculator call ...
    "<|python_end|>",
    "<|output_start|>",  # ... and the tool's result, forced into the stream by the engine
    "<|output_end|>",
]

# GPT-4's (cl100k) pre-tokenizer split, except numbers are split into chunks of 1-2 digits instead of 1-3 (as in
# nanochat): with a small vocabulary, up to 1000 three-digit number tokens would crowd out words.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)

MERGES_FILE = "tokenizer.tiktoken"  # one "base64(token bytes) rank" line per token, tiktoken's own format
CONFIG_FILE = "tokenizer.json"  # split pattern and special-token ids

ROLES = ("system", "user", "assistant")
PART_TYPES = ("text", "python", "python_output")

# ANSI styles of Tokenizer.visualize
GREEN, GREY, BOLD, RESET = "\033[32m", "\033[90m", "\033[1m", "\033[0m"


def _parse_conversation(conversation):
    """
    Check a conversation's structure and return its turns as (message_index, role, content) with role user or
    assistant, alternating and starting with user. The system text is merged into the first user turn as
    "system\\n\\nuser". A user turn's content is one str; an assistant turn's is a list of (type, text) parts.
    Raises ValueError naming the message at fault.
    """
    if not isinstance(conversation, dict) or not isinstance(conversation.get("messages"), list):
        got = type(conversation).__name__ if not isinstance(conversation, dict) else f"keys {sorted(conversation)}"
        raise ValueError(f"a conversation must be a dict with a 'messages' list; got {got}")
    messages = conversation["messages"]
    if not messages:
        raise ValueError("conversation has no messages; expected a user message and usually an assistant reply")
    system_text = None
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} is a {type(message).__name__}; expected a dict with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i} has role {role!r}; expected system/user/assistant")
        if "content" not in message:
            raise ValueError(f"message {i} ({role}) has no 'content'")
        parts = _parse_content(message["content"], i)
        if role != "assistant":
            for kind, _ in parts:
                if kind != "text":
                    raise ValueError(f"message {i} ({role}) has a {kind!r} part; only assistant messages hold tool calls")
        if role == "system":
            if i != 0:
                raise ValueError(f"message {i} has role 'system'; only message 0 may be a system message")
            system_text = "".join(text for _, text in parts)
            continue
        expected = "user" if len(turns) % 2 == 0 else "assistant"
        if role != expected:
            if not turns:
                raise ValueError(f"message {i} has role {role!r}; the first turn (after any system message) must be 'user'")
            raise ValueError(f"message {i} has role {role!r} like message {i - 1}; user and assistant turns must alternate")
        if role == "user":
            text = "".join(text for _, text in parts)
            if system_text is not None and not turns:
                text = system_text + "\n\n" + text
            turns.append((i, role, text))
        else:
            turns.append((i, role, parts))
    if not turns:
        raise ValueError("conversation has only a system message; expected a user message after it")
    return turns


def _parse_content(content, i):
    """A message's content as a list of (type, text) parts; a plain str is one text part."""
    if isinstance(content, str):
        if not content:
            raise ValueError(f"message {i} has empty content")
        return [("text", content)]
    if not isinstance(content, list):
        raise ValueError(f"message {i} content is {type(content).__name__}; expected a str or a list of "
                         "{'type': 'text'|'python'|'python_output', 'text': str} parts")
    if not content:
        raise ValueError(f"message {i} has an empty content list")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"message {i} part {j} is a {type(part).__name__}; expected a dict with 'type' and 'text'")
        kind, text = part.get("type"), part.get("text")
        if kind not in PART_TYPES:
            raise ValueError(f"message {i} part {j} has type {kind!r}; expected text/python/python_output")
        if not isinstance(text, str):
            raise ValueError(f"message {i} part {j} text is {type(text).__name__}; expected str")
        parts.append((kind, text))
    return parts


class Tokenizer:
    """A trained BPE (`mergeable_ranks` + split `pattern`) with tiktoken doing the encoding, and the chat format."""

    def __init__(self, mergeable_ranks, pattern):
        """`mergeable_ranks`: {token bytes: rank} with ranks 0..n-1; the special tokens get ids n..n+8."""
        if sorted(mergeable_ranks.values()) != list(range(len(mergeable_ranks))):
            raise ValueError("mergeable ranks must be exactly 0..n-1 so the special tokens can follow them")
        self.mergeable_ranks = mergeable_ranks
        self.pattern = pattern
        n = len(mergeable_ranks)
        self.special_tokens = {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.enc = tiktoken.Encoding(name="nanopost", pat_str=pattern, mergeable_ranks=mergeable_ranks,
                                     special_tokens=self.special_tokens)
        self.bos_id = self.special_tokens["<|bos|>"]

    @classmethod
    def train(cls, texts, vocab_size):
        """
        Learn byte-level BPE merges from an iterable of str. `vocab_size` counts the 256 byte tokens, the merges
        and the special tokens. A corpus with fewer distinct pairs than merges asked for stops early (warned):
        the vocabulary is then smaller than `vocab_size`.
        """
        min_size = 256 + len(SPECIAL_TOKENS)
        if vocab_size < min_size:
            raise ValueError(f"vocab_size={vocab_size} is too small: the 256 byte tokens and {len(SPECIAL_TOKENS)} "
                             f"special tokens need at least {min_size}")
        import rustbpe  # only where a tokenizer is trained: loading and encoding need tiktoken alone

        bpe = rustbpe.Tokenizer()
        bpe.train_from_iterator(iter(texts), vocab_size - len(SPECIAL_TOKENS), buffer_size=8192, pattern=SPLIT_PATTERN)
        tokenizer = cls({bytes(token): rank for token, rank in bpe.get_mergeable_ranks()}, bpe.get_pattern())
        if tokenizer.vocab_size < vocab_size:
            warnings.warn(f"asked for vocab_size={vocab_size} but the corpus only supports {tokenizer.vocab_size}: "
                          "every pre-token is already a single token. Train on more varied text for a larger vocabulary.",
                          stacklevel=2)
        return tokenizer

    def save(self, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        lines = (f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in
                 sorted(self.mergeable_ranks.items(), key=lambda item: item[1]))
        (directory / MERGES_FILE).write_text("".join(lines))
        config = {"pattern": self.pattern, "special_tokens": self.special_tokens}
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, directory):
        directory = Path(directory)
        if not (directory / MERGES_FILE).exists() or not (directory / CONFIG_FILE).exists():
            raise FileNotFoundError(f"no tokenizer in {directory} (expected {MERGES_FILE} and {CONFIG_FILE}); "
                                    "train one first with `python tokenizer.py`")
        ranks = {}
        for line in (directory / MERGES_FILE).read_text().splitlines():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        config = json.loads((directory / CONFIG_FILE).read_text())
        tokenizer = cls(ranks, config["pattern"])
        if config["special_tokens"] != tokenizer.special_tokens:
            raise ValueError(f"{directory / CONFIG_FILE} lists special tokens {config['special_tokens']}, but this "
                             f"tokenizer.py assigns {tokenizer.special_tokens}; retrain with `python tokenizer.py`")
        return tokenizer

    @property
    def vocab_size(self):
        return self.enc.n_vocab

    def token_id(self, name):
        """Id of a special token, e.g. token_id("<|assistant_end|>")."""
        if name not in self.special_tokens:
            raise KeyError(f"{name!r} is not a special token; expected one of {SPECIAL_TOKENS}")
        return self.special_tokens[name]

    def _as_id(self, token):
        """A special token given by name or by id, as an id."""
        if isinstance(token, str):
            return self.token_id(token)
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
        return token

    def encode(self, text, prepend=None, append=None, num_threads=8):
        """
        Token ids of `text` (a str -> list[int]), or of each str of a list (-> list[list[int]], encoded in
        `num_threads` threads). Special-token strings in the text are ordinary text: "<|bos|>" typed by a user
        never becomes the bos token. `prepend`/`append`: a special token (name or id) to add to each sequence.
        """
        prefix = [] if prepend is None else [self._as_id(prepend)]
        suffix = [] if append is None else [self._as_id(append)]
        if isinstance(text, str):
            return prefix + self.enc.encode_ordinary(text) + suffix
        if isinstance(text, list):
            return [prefix + ids + suffix for ids in self.enc.encode_ordinary_batch(text, num_threads=num_threads)]
        raise TypeError(f"encode takes a str or a list of str, got {type(text).__name__}")

    def decode(self, ids):
        """Text of `ids`; special tokens appear as their names, invalid UTF-8 as U+FFFD."""
        return self.enc.decode(ids)

    def token_bytes(self):
        """
        UTF-8 byte length of every token id (list of vocab_size ints), 0 for the special tokens: the
        denominator of bits-per-byte, which thereby counts only the bytes of real text.
        """
        specials = set(self.special_tokens.values())
        return [0 if i in specials else len(self.enc.decode_single_token_bytes(i)) for i in range(self.vocab_size)]

    # -------------------------------------------------------------------------
    # Chat format

    def _render(self, turns):
        """
        Tokens and training mask of parsed turns, plus where each turn starts: (ids, mask, starts) with
        starts[k] = (first token index, message index, role) of turns[k]. Appending each token together with
        its flag keeps ids and mask aligned by construction.
        """
        ids, mask, starts = [], [], []

        def add(token_ids, flag):
            ids.extend(token_ids)
            mask.extend([flag] * len(token_ids))

        special = self.special_tokens
        add([self.bos_id], 0)
        for message_index, role, content in turns:
            starts.append((len(ids), message_index, role))
            if role == "user":
                add([special["<|user_start|>"]] + self.encode(content) + [special["<|user_end|>"]], 0)
                continue
            add([special["<|assistant_start|>"]], 0)  # a prompt token: the engine forces it
            for kind, text in content:
                if kind == "text":
                    add(self.encode(text), 1)
                elif kind == "python":  # the model decides to call the tool and writes the call
                    add([special["<|python_start|>"]] + self.encode(text) + [special["<|python_end|>"]], 1)
                else:  # the tool's output is forced by the engine, never predicted
                    add([special["<|output_start|>"]] + self.encode(text) + [special["<|output_end|>"]], 0)
            add([special["<|assistant_end|>"]], 1)  # trained: the model must learn to stop
        return ids, mask, starts

    def render_conversation(self, conversation, max_tokens=None):
        """
        (ids, mask) of a conversation that ends with an assistant reply; mask[i] == 1 marks token i as a
        training target. 0: <|bos|>, user turns (with the system text merged into the first), <|assistant_start|>,
        tool outputs <|output_start|>...<|output_end|>. 1: assistant text, tool calls <|python_start|>...<|python_end|>,
        <|assistant_end|>.
        Longer than `max_tokens`: truncated to max_tokens with a warning naming the message that was cut. sft.py
        skips over-long conversations rather than train on a reply cut mid-way.
        """
        turns = _parse_conversation(conversation)
        last_index, last_role, _ = turns[-1]
        if last_role != "assistant":
            raise ValueError(f"conversation ends with a user message (message {last_index}); render_conversation needs "
                             "an assistant reply to train on (use render_for_completion to prompt for one)")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        ids, mask, starts = self._render(turns)
        if max_tokens is None or len(ids) <= max_tokens:
            return ids, mask
        start, message_index, role = next(s for s in reversed(starts) if s[0] <= max_tokens)
        where = "at the start of" if start == max_tokens else "inside"
        warnings.warn(f"conversation is {len(ids)} tokens, longer than max_tokens={max_tokens}: truncated {where} "
                      f"message {message_index} ({role}), dropping {len(ids) - max_tokens} tokens of which "
                      f"{sum(mask[max_tokens:])} were training targets", stacklevel=2)
        return ids[:max_tokens], mask[:max_tokens]

    def render_for_completion(self, conversation):
        """
        The prompt to sample an assistant reply from: everything before the last assistant turn, ending with
        <|assistant_start|> (a conversation ending with a user turn is rendered whole, then <|assistant_start|>).
        It is sliced from the same rendering as render_conversation, so it is always a prefix of its ids.
        """
        turns = _parse_conversation(conversation)
        ids, _, starts = self._render(turns)
        start, _, role = starts[-1]
        if role == "assistant":
            return ids[:start + 1]  # ids[start] is the last turn's <|assistant_start|>
        return ids + [self.special_tokens["<|assistant_start|>"]]

    def visualize(self, ids, mask):
        """
        `ids` as text, green where mask is 1 (trained) and grey where 0, special tokens in bold. Without the ANSI
        codes the string equals decode(ids).
        """
        if len(ids) != len(mask):
            raise ValueError(f"ids and mask differ in length: {len(ids)} vs {len(mask)}")
        special_ids = set(self.special_tokens.values())
        out = []
        run_start = 0
        for i in range(1, len(ids) + 1):
            # Decode runs of same-style tokens together so a character split over two tokens stays whole.
            if i < len(ids) and mask[i] == mask[run_start] and (ids[i] in special_ids) == (ids[run_start] in special_ids):
                continue
            style = (GREEN if mask[run_start] else GREY) + (BOLD if ids[run_start] in special_ids else "")
            out.append(style + self.decode(ids[run_start:i]) + RESET)
            run_start = i
        return "".join(out)


# -----------------------------------------------------------------------------
# Train the tokenizer of a preset and report its compression

PRESETS = {
    # The synthetic corpus has a small vocabulary of words: it saturates near 600 tokens (train() warns if asked for more).
    "tiny": {"vocab_size": 512, "max_chars": 10_000_000},
    "small": {"vocab_size": 65536, "max_chars": 2_000_000_000},  # the full preset's tokenizer: same data, same cost
    "full": {"vocab_size": 65536, "max_chars": 2_000_000_000},
}
EVAL_CHARS = 10_000_000  # held-out text for bytes/token: plenty for a stable estimate, seconds to encode


def bytes_per_token(encode_batch, texts):
    """Compression of a tokenizer on `texts`: UTF-8 bytes / tokens (higher is better)."""
    n_tokens = sum(len(ids) for ids in encode_batch(texts))
    return sum(len(text.encode("utf-8")) for text in texts) / n_tokens


def main():
    # Imported here: common.py imports this module (checkpoints carry a tokenizer), tasks.py is only needed to train.
    import common
    import tasks

    parser = argparse.ArgumentParser(description="Train the BPE tokenizer of a preset and report its compression.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="tiny: offline synthetic corpus; full: FineWeb-Edu")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="tokens including the special ones (default: tiny 512, full 65536)")
    parser.add_argument("--max-chars", type=int, default=None,
                        help="training text budget in characters (default: tiny 10M, full 2B)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: $NANOPOST_HOME/tokenizer)")
    args = parser.parse_args()
    common.rehearse(PRESETS, parser.prog)
    vocab_size = args.vocab_size or PRESETS[args.preset]["vocab_size"]
    max_chars = args.max_chars or PRESETS[args.preset]["max_chars"]
    out = args.out or common.get_base_dir() / "tokenizer"

    print(f"training a {vocab_size}-token BPE on up to {max_chars:,} characters of the {args.preset} corpus")
    t0 = time.time()
    tokenizer = Tokenizer.train(tasks.pretraining_texts(args.preset, "train", max_chars=max_chars), vocab_size)
    train_seconds = time.time() - t0
    print(f"trained in {train_seconds:.1f}s: vocab_size {tokenizer.vocab_size}")
    tokenizer.save(out)
    print(f"saved to {out}")

    val_texts = list(tasks.pretraining_texts(args.preset, "val", max_chars=EVAL_CHARS))
    ours = bytes_per_token(tokenizer.encode, val_texts)
    print(f"held-out compression ({sum(map(len, val_texts)):,} chars): {ours:.3f} bytes/token")
    for name in ("gpt2", "cl100k_base"):
        try:  # downloads its merges on first use: skipped offline
            reference = tiktoken.get_encoding(name)
        except Exception:
            continue
        theirs = bytes_per_token(reference.encode_ordinary_batch, val_texts)
        print(f"  {name:12s} vocab {reference.n_vocab:6d}: {theirs:.3f} bytes/token (ours {ours / theirs - 1:+.1%})")
    common.append_report({"stage": "tokenizer", "preset": args.preset, "vocab_size": tokenizer.vocab_size,
                          "seconds": train_seconds, "val_bytes_per_token": ours})


if __name__ == "__main__":
    from common import run_cli  # here, like main's import

    run_cli(main)

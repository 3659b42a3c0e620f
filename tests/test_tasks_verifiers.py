"""
The verifiers as RL sees them: hostile completions never score and never crash, a broken verifier scores 0 and is
counted, and the scoring path of rollout.py (token ids -> completion text -> safe_reward) gives what the task says.
"""

import json
import time

import pytest

import rollout
import tasks
from engine import Completion
from eval import completion_text
from tasks import GSM8K, SyntheticTask, canonical_number, exact_match_reward, safe_reward
from tokenizer import Tokenizer

# A calculator call as the verifier sees it in a completion's text
SPAM = "<|python_start|>6*7<|python_end|><|output_start|>42<|output_end|>"


@pytest.mark.parametrize("completion", [
    "#### 42\n" * 1000,  # the right answer, many times: several final answers score 0
    "####" * 10_000,
    "#### 42\n#### 42",
    "#### 41\n#### 42",
    "#### 42 #### 42",
    "#### " + "4" * 100_000,  # a huge number
    "#### 42" + "0" * 40,
    "#### 42 43",
    "#### 42 or 43",
    "#### 4,2",  # commas only as thousands separators
    "#### ,42,",
    "#### 42....",
    "#### $$42",
    "#### ４２",  # fullwidth digits are not ASCII digits
    "#### 4.2e1", "#### 1e400", "#### inf", "#### nan", "#### 0x2A", "#### +42", "#### forty-two",
    SPAM * 500,  # tool-call spam: the answer only in tool outputs
    SPAM * 50 + "\n#### " + SPAM,  # the final answer left to the tool's output
    "<|python_start|>#### 42<|python_end|><|output_start|>error: invalid expression<|output_end|>\n#### 42",
    "",
    "#### ",
    "####\n42",
])
def test_hostile_completions_do_not_score(completion):
    start = time.perf_counter()
    assert exact_match_reward(completion, 42) == 0.0
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("completion, answer", [
    ("6 * 7 = 42.\n#### 42", "42"),
    ("####42", 42),
    ("#### 42.", 42),
    ("#### 42\nThat is all.", 42),
    ("#### 1,234", "1234"),
    ("#### 1234", "1,234"),  # references are canonicalised the same way
    ("#### 1,234,567.50", "1234567.5"),
    ("#### 72.0", 72),
    ("#### -0.0", 0),
    ("#### $5", 5),
    (SPAM * 50 + "\n#### 42", 42),  # spam is not penalised by the verifier: only the single final answer counts
    ("x" * 1_000_000 + "\n#### 42", 42),
])
def test_canonical_answers_score(completion, answer):
    assert exact_match_reward(completion, answer) == 1.0


def test_canonical_number_refuses_what_is_not_a_plain_number():
    assert canonical_number("12,34") is None and canonical_number("1234,567") is None
    assert canonical_number("٤٢") is None  # Arabic-Indic digits
    assert canonical_number("-3.50") == "-3.5" and canonical_number("$5.") == "5"


class FlakyTask:
    """A task whose verifier crashes on completions containing 'boom', hangs on 'hang', else checks exactly."""

    def reward(self, conversation, completion):
        if "boom" in completion:
            raise RuntimeError("verifier bug")
        if "hang" in completion:
            time.sleep(10)
        return exact_match_reward(completion, conversation["answer"])


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(["#### 42 boom hang the answer is"] * 20, vocab_size=270)


def completion_of(tokenizer, text):
    """A Completion as the engine returns it: the text's tokens and the closing <|assistant_end|>."""
    tokens = tokenizer.encode(text) + [tokenizer.token_id("<|assistant_end|>")]
    return Completion(tokens=tokens, mask=[1] * len(tokens), logprobs=[0.0] * len(tokens), finish="stop")


def test_a_crashing_verifier_scores_zero_and_is_counted(tokenizer):
    texts = ["#### 42", "boom #### 42", "the answer is #### 41", "boom"]
    completions = [completion_of(tokenizer, t) for t in texts]
    rewards, errors = rollout.score_group(FlakyTask(), {"answer": "42"}, completions, tokenizer)
    assert rewards == [1.0, 0.0, 0.0, 0.0]
    assert errors == [False, True, False, True]


def test_a_hanging_verifier_times_out_scores_zero_and_is_counted():
    start = time.perf_counter()
    assert safe_reward(FlakyTask(), {"answer": "42"}, "hang #### 42", timeout=0.2) == (0.0, True)
    assert time.perf_counter() - start < 2


def test_a_verifier_returning_nonsense_is_an_error():
    class ReturnsNone:
        def reward(self, conversation, completion):
            return None

    assert safe_reward(ReturnsNone(), {}, "#### 1") == (0.0, True)
    assert safe_reward(SyntheticTask("train", size=1), {"answer": "1"}, None) == (0.0, True)  # not even text


def test_synthetic_task_verifier_on_its_reference_and_on_hostile_answers():
    task = SyntheticTask("test", size=20)
    for i in range(len(task)):
        conversation = task[i]
        answer = conversation["answer"]
        assert task.reward(conversation, f"#### {answer}") == 1.0
        assert task.reward(conversation, f"#### {answer}\n#### {answer}") == 0.0
        assert task.reward(conversation, f"#### {int(answer) + 1}") == 0.0
        assert task.reward(conversation, SPAM * 20) == 0.0


def test_gsm8k_verifier_from_a_local_file(tmp_path):
    rows = [{"question": "Tom has 3 boxes of 4 pens and buys 1,000 more. How many pens?",
             "answer": "3 boxes of 4 is <<3*4=12>>12 pens. Plus 1,000 is <<12+1000=1012>>1,012.\n#### 1,012"}]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    task = GSM8K("test", local=path)
    conversation = task[0]
    assert task.reward(conversation, "So 12 + 1000 = 1012.\n#### 1012") == 1.0
    assert task.reward(conversation, "#### 1,012") == 1.0
    assert task.reward(conversation, "#### 1012\n#### 1012") == 0.0
    assert task.reward(conversation, "The answer is 1012.") == 0.0
    assert task.reward(conversation, "#### 101,2") == 0.0


# -----------------------------------------------------------------------------
# Only a finished answer is a success (tasks.completion_reward, the one rule every stage scores by)


def test_truncated_answer_is_not_correct(tokenizer):
    stopped = completion_of(tokenizer, "#### 42")
    # the same text, written just before the budget ran out: it never ended its turn
    cut = Completion(tokens=stopped.tokens[:-1], mask=stopped.mask[:-1], logprobs=stopped.logprobs[:-1],
                     finish="length")
    assert completion_text(tokenizer, cut) == completion_text(tokenizer, stopped) == "#### 42"
    rewards, errors = rollout.score_group(FlakyTask(), {"answer": "42"}, [stopped, cut], tokenizer)
    assert rewards == [1.0, 0.0] and errors == [False, False]
    assert tasks.completion_reward(FlakyTask(), {"answer": "42"}, "#### 42", "stop") == (1.0, False)
    assert tasks.completion_reward(FlakyTask(), {"answer": "42"}, "#### 42", "length") == (0.0, False)
    # the verifier is not even asked about a cut answer: it cannot crash on it either
    assert tasks.completion_reward(FlakyTask(), {"answer": "42"}, "boom #### 42", "length") == (0.0, False)

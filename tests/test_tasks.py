"""The synthetic task family, the GSM8K conversion on local files of the hub schema, answer extraction, collate."""

import json

import pytest
import torch

import tasks


def test_synthetic_is_deterministic_and_splits_are_disjoint():
    a = tasks.SyntheticTask("train", size=400, seed=3)
    b = tasks.SyntheticTask("train", size=400, seed=3)
    assert [a[i] for i in range(len(a))] == [b[i] for i in range(len(b))]
    train = {p["question"] for p in tasks.SyntheticTask("train", size=3000, seed=0).problems}
    test = {p["question"] for p in tasks.SyntheticTask("test", size=300, seed=0).problems}
    assert len(test) == 300 and not train & test
    assert {p["kind"] for p in tasks.SyntheticTask("test", size=300).problems} == set(tasks.KINDS)


def test_synthetic_documents_never_contain_test_questions():
    test = {p["question"] for p in tasks.SyntheticTask("test", size=300, seed=0).problems}
    corpus = "\n".join(tasks.synthetic_documents(3000, seed=0, split="train"))
    assert not [q for q in test if q in corpus]


def test_reference_answers_are_correct_and_tool_calls_agree():
    task = tasks.SyntheticTask("train", size=200)
    for i in range(len(task)):
        conversation = task[i]
        parts = conversation["messages"][1]["content"]
        text = "".join(p["text"] for p in parts if p["type"] == "text")
        assert task.reward(conversation, text) == 1.0
        calls = [p["text"] for p in parts if p["type"] == "python"]
        outputs = [p["text"] for p in parts if p["type"] == "python_output"]
        for call, output in zip(calls, outputs):
            a, op, b = next((call.partition(o) for o in "+-*" if o in call))
            assert str(tasks.OPERATORS[op](int(a), int(b))) == output


@pytest.mark.parametrize("completion, expected", [
    ("so 3 + 4 = 7.\n#### 7", "7"),
    ("#### 1,234", "1234"),
    ("#### 72.0", "72"),
    ("#### $5.", "5"),
    ("#### -3.50\n", "-3.5"),
    ("no marker 7", None),
    ("#### 7\n#### 8", None),
    ("#### seven", None),
    ("#### 7 apples", None),
    ("#### " + "9" * 100, None),
])
def test_extract_final_answer(completion, expected):
    assert tasks.extract_final_answer(completion) == expected


def test_safe_reward_counts_crashes_and_nan_as_errors():
    class Crashing:
        def reward(self, conversation, completion):
            raise RuntimeError("boom")

    class NotANumber:
        def reward(self, conversation, completion):
            return float("nan")

    assert tasks.safe_reward(Crashing(), {}, "#### 1") == (0.0, True)
    assert tasks.safe_reward(NotANumber(), {}, "#### 1") == (0.0, True)


def test_safe_reward_times_out_a_hanging_verifier():
    class Hanging:
        def reward(self, conversation, completion):
            while True:
                pass

    assert tasks.safe_reward(Hanging(), {}, "x", timeout=0.2) == (0.0, True)


def test_gsm8k_from_local_file_of_hub_schema(tmp_path):
    rows = [
        {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
         "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn total 48+24 = <<48+24=72>>72 clips.\n#### 72"},
        {"question": "A shirt costs $1,200. What is 3 shirts?", "answer": "3*1200 = <<3*1200=3600>>3600\n#### 3,600"},
    ]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    task = tasks.GSM8K(local=str(path))
    assert len(task) == 2
    conversation = task[0]
    assert conversation["answer"] == "72"
    assert conversation["messages"][1]["content"] == [
        {"type": "text", "text": "In May she sold 48/2 = "},
        {"type": "python", "text": "48/2"},
        {"type": "python_output", "text": "24"},
        {"type": "text", "text": "24 clips.\nIn total 48+24 = "},
        {"type": "python", "text": "48+24"},
        {"type": "python_output", "text": "72"},
        {"type": "text", "text": "72 clips.\n#### 72"},
    ]
    assert task.reward(task[1], "It is 3600.\n#### 3600") == 1.0
    assert task.reward(task[1], "#### 3600\n#### 3600") == 0.0


def test_gsm8k_row_without_final_answer_is_an_error():
    with pytest.raises(ValueError, match="####"):
        tasks.gsm8k_conversation("q", "no final line")


def test_preference_pair_validation():
    prompt = [{"role": "user", "content": "hi"}]
    pair = tasks.preference_pair(prompt + [{"role": "assistant", "content": "hello"}],
                                 prompt + [{"role": "assistant", "content": "go away"}])
    assert pair["chosen"]["messages"][-1]["content"] == "hello"
    with pytest.raises(ValueError, match="same prompt"):
        tasks.preference_pair(prompt + [{"role": "assistant", "content": "a"}],
                              [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(ValueError, match="identical"):
        tasks.preference_pair(prompt + [{"role": "assistant", "content": "a"}], prompt + [{"role": "assistant", "content": "a"}])


def test_token_budget_batches_keep_the_budget_and_count_padding():
    # Items 0-4 of one row each, item 5 a pair of rows (both sides must share a micro-batch).
    lengths = [[5], [2], [9], [3], [4], [6, 3]]
    batches, padding = tasks.token_budget_batches(lengths, max_tokens=18)
    # Sorted by longest row: 1 (2), 3 (3), 4 (4), 0 (5), 5 (6), 2 (9); cut where rows x longest would pass 18:
    # 4 rows x 5 = 20 after item 4, (3 + 1) x 9 = 36 after item 5.
    assert batches == [[1, 3, 4], [0, 5], [2]]
    assert padding == pytest.approx(1 - 32 / (3 * 4 + 3 * 6 + 1 * 9))  # 32 real positions of 39 padded
    with pytest.raises(ValueError, match="item 5 has 2 row.* budget of 10 tokens"):
        tasks.token_budget_batches(lengths, max_tokens=10)  # the pair alone needs 2 x 6
    assert tasks.token_budget_batches([], 10) == ([], 0.0)


def test_collate_shifts_masks_and_pads_without_cropping():
    inputs, targets = tasks.collate([([5, 6, 7, 8], [0, 0, 1, 1]), ([5, 9], [0, 1])], pad_id=0)
    assert inputs.tolist() == [[5, 6, 7], [5, 0, 0]]
    assert targets.tolist() == [[-1, 7, 8], [9, -1, -1]]
    assert inputs.dtype == targets.dtype == torch.long
    with pytest.raises(ValueError, match="mask"):
        tasks.collate([([1, 2], [0])], pad_id=0)


def test_stand_in_data_routes_every_hub_loader_through_nanopost_data_dir(tmp_path, monkeypatch):
    tasks.write_stand_in_data(tmp_path, documents=30, rows=8)
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(tasks, "FINEWEB_VAL_DOCS", 10)
    assert len(list(tasks.fineweb_texts("val"))) == 10 and len(list(tasks.fineweb_texts("train"))) == 20
    gsm8k = tasks.GSM8K("test")
    assert len(gsm8k) == 8 and gsm8k[0]["messages"][1]["content"][1]["type"] == "python"
    assert len(tasks.SmolTalk("train")) == 8
    assert tasks.UltraFeedback("test_prefs")[0]["chosen"]["messages"][0]["role"] == "user"
    for name in ("arc-easy", "arc-challenge", "mmlu"):
        item = tasks.MultipleChoice(name, "test")[0]
        assert item["choices"][item["answer"]] == item["choices"][0]

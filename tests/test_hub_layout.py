"""A data folder exactly as `python tasks.py prepare` (huggingface_hub.snapshot_download) leaves it: the hub's file
names (split-00000-of-0000N.parquet, FineWeb-Edu's sample/10BT/0NN_00000.parquet), the .cache/huggingface metadata
beside them, and splits the presets do not read. Every loader reads it through $NANOPOST_DATA_DIR; MMLU's few-shot
examples come from `dev`, and a subset of MMLU's test split spans its subjects."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import eval as evaluation
import tasks
from conftest import make_model, make_tokenizer

SUBJECTS = [f"subject_{k:02d}" for k in range(20)]  # MMLU's test split: sorted by subject, as on the hub


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    metadata = path.parent / ".cache/huggingface/download" / (path.name + ".metadata")  # what hf_hub leaves
    metadata.parent.mkdir(parents=True, exist_ok=True)
    metadata.write_text("0123456789abcdef0123456789abcdef01234567\netag\n1700000000.0\n")
    (path.parent / f".cache/huggingface/download/{path.name}.incomplete").write_text("half a download")


def chat(question, answer):
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / ".cache/huggingface").mkdir(parents=True)
    (root / ".cache/huggingface/.gitignore").write_text("*\n")
    for i, name in enumerate(tasks.FINEWEB_FILES):
        write(root / "HuggingFaceFW/fineweb-edu/sample/10BT" / name,
              [{"text": f"document {i}-{j}.", "id": f"<urn:{i}-{j}>", "dump": "CC-MAIN-2024-10", "url": "http://x",
                "score": 3.1, "int_score": 3, "token_count": 4} for j in range(800)])
    for split in ("train", "test"):
        write(root / f"openai/gsm8k/main/{split}-00000-of-00001.parquet",
              [{"question": f"{split} {k}: 2 + {k}?", "answer": f"2+{k} = <<2+{k}={2 + k}>>{2 + k}\n#### {2 + k}"}
               for k in range(6)])
        write(root / f"HuggingFaceTB/smol-smoltalk/data/{split}-00000-of-00001.parquet",
              [{"messages": chat(f"hi {k}", f"hello {k}"), "source": "smol-magpie-ultra"} for k in range(5)])
    for split in ("train_prefs", "test_prefs", "train_sft"):  # train_sft: on the hub, not read by the presets
        write(root / f"HuggingFaceH4/ultrafeedback_binarized/data/{split}-00000-of-00001.parquet",
              [{"prompt": f"q{k}", "prompt_id": str(k), "chosen": chat(f"q{k}", "good"),
                "rejected": chat(f"q{k}", "bad"), "messages": chat(f"q{k}", "good"), "score_chosen": 8.0,
                "score_rejected": 3.0} for k in range(4)])
    for config, count in (("ARC-Easy", 4), ("ARC-Challenge", 3)):
        for split in ("train", "validation", "test"):
            write(root / f"allenai/ai2_arc/{config}/{split}-00000-of-00001.parquet",
                  [{"id": f"{config}-{k}", "question": f"{config} {split} {k}?",
                    "choices": {"text": [f"c{j}" for j in range(count)], "label": [str(j + 1) for j in range(count)]},
                    "answerKey": "2"} for k in range(5)])
    for split, per_subject in (("test", 10), ("dev", 5), ("validation", 2), ("auxiliary_train", 1)):
        write(root / f"cais/mmlu/all/{split}-00000-of-00001.parquet",
              [{"question": f"{split} {subject} {k}?", "subject": subject, "choices": ["w", "x", "y", "z"],
                "answer": k % 4} for subject in SUBJECTS for k in range(per_subject)])
    return root


def test_every_loader_reads_the_hub_layout(hub, monkeypatch):
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(hub))
    assert tasks.missing_data(hub) == []
    train = list(tasks.fineweb_texts("train"))
    assert len(train) == 14 * 800 - tasks.FINEWEB_VAL_DOCS and train[-1] == "document 13-799."
    assert len(list(tasks.fineweb_texts("val"))) == tasks.FINEWEB_VAL_DOCS
    for split in ("train", "test"):
        gsm8k = tasks.GSM8K(split)
        assert len(gsm8k) == 6 and gsm8k[5]["answer"] == "7" and gsm8k[5]["messages"][0]["content"] == f"{split} 5: 2 + 5?"
        assert tasks.SmolTalk(split)[4]["messages"][1]["content"] == "hello 4"
    for split in ("train_prefs", "test_prefs"):
        pair = tasks.UltraFeedback(split)[3]
        assert pair["chosen"]["messages"][-1]["content"] == "good" and len(tasks.UltraFeedback(split)) == 4
    assert tasks.UltraFeedbackPrompts("test_prefs")[0]["messages"][0]["content"] == "q0"
    easy, challenge = tasks.MultipleChoice("arc-easy"), tasks.MultipleChoice("arc-challenge")
    assert len(easy) == 5 and easy[0]["answer"] == 1 and len(easy[0]["choices"]) == 4
    assert len(challenge[0]["choices"]) == 3 and challenge[0]["question"] == "ARC-Challenge test 0?"
    mmlu = tasks.MultipleChoice("mmlu")
    assert len(mmlu) == 200 and mmlu[13] == {"question": "test subject_01 3?", "choices": ["w", "x", "y", "z"],
                                             "answer": 3, "subject": "subject_01"}
    assert len(tasks.MultipleChoice("mmlu", "dev")) == 100


def test_a_multiple_choice_subset_spans_the_subjects_with_a_fixed_seed(hub, monkeypatch):
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(hub))
    subset = tasks.task_by_name("mmlu", "test", size=40)
    items = [subset[i] for i in range(len(subset))]
    assert len(items) == 40 and len({item["subject"] for item in items}) >= 15  # the first 40 rows: 4 subjects
    again = tasks.task_by_name("mmlu", "test", size=40)
    assert [again[i] for i in range(40)] == items
    other = tasks.task_by_name("mmlu", "test", size=40, seed=1)
    assert [other[i] for i in range(40)] != items


def test_mmlu_few_shot_examples_come_from_dev(hub, monkeypatch):
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(hub))
    prompts = []
    real_prompt = evaluation.base_prompt

    def recording(item, shots, style):
        prompts.append((item, shots))
        return real_prompt(item, shots, style)

    monkeypatch.setattr(evaluation, "base_prompt", recording)
    test = tasks.task_by_name("mmlu", "test", size=6)
    dev = tasks.task_by_name("mmlu", evaluation.MC_SHOT_SPLIT["mmlu"])
    tokenizer = make_tokenizer()
    evaluation.evaluate_multiple_choice(make_model(tokenizer), tokenizer, [test[i] for i in range(6)], "letter", 5,
                                        shot_items=[dev[j] for j in range(len(dev))])
    assert len(prompts) == 6
    for item, shots in prompts:
        assert len(shots) == 5 and all(s["question"].startswith("dev ") and s["subject"] == item["subject"]
                                       for s in shots), (item, shots)

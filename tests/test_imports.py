"""The GPU image has torch, pyarrow, tiktoken and numpy but no rustbpe, datasets or wandb: every module of the GPU
path imports without them, and local data reads through pyarrow alone (a subprocess whose import system refuses
them)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MISSING = ("rustbpe", "datasets", "wandb", "huggingface_hub")

HIDE = f"""
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {MISSING!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)
sys.meta_path.insert(0, Refuse())
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "bench")!r}]
"""


def run_hidden(code, tmp_path):
    result = subprocess.run([sys.executable, "-c", HIDE + code], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "NANOPOST_HOME": str(tmp_path / "home")})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def test_gpu_path_imports_and_reads_local_data_without_rustbpe_datasets_wandb(tmp_path):
    out = run_hidden(f"""
import tokenizer, tasks, model, engine, common, eval, rollout, pretrain, sft, dpo, rm, rl, gpu_check
import os
from pathlib import Path
for name in {MISSING!r}:
    assert name not in sys.modules, name
try:
    import datasets
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("the finder did not hide datasets")
root = tasks.write_stand_in_data(Path("data"), documents=200, rows=8, row_group_size=50)
os.environ["NANOPOST_DATA_DIR"] = str(root)
gsm8k = tasks.GSM8K("train")
assert len(gsm8k) == 8 and gsm8k[0]["answer"], gsm8k[0]
assert len(tasks.UltraFeedback("test_prefs", size=3)) == 3
assert tasks.MultipleChoice("mmlu", "test")[1]["choices"]
assert sum(1 for _ in tasks.fineweb_texts("train")) == 0  # 200 documents, all inside the validation set
assert sum(1 for _ in tasks.fineweb_texts("val")) == 200
try:
    tokenizer.Tokenizer.train(["a b c"], 300)
except ModuleNotFoundError as e:
    assert e.name == "rustbpe", e
else:
    raise AssertionError("trained a tokenizer without rustbpe")
logger = common.Logger("dummy", {{}})
print("ok", sorted(m for m in {MISSING!r} if m in sys.modules))
""", tmp_path)
    assert out.strip() == "ok []"


def test_local_parquet_rows_match_the_jsonl_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import tasks

    rows = [{"question": f"q{i}", "answer": f"{i} = <<{i}+0={i}>>{i}.\n#### {i}"} for i in range(5)]
    pq.write_table(pa.table({"question": [r["question"] for r in rows[:3]], "answer": [r["answer"] for r in rows[:3]]}),
                   tmp_path / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"question": [r["question"] for r in rows[3:]], "answer": [r["answer"] for r in rows[3:]]}),
                   tmp_path / "train-00001-of-00002.parquet")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shards = tasks.load_rows("openai/gsm8k", "train", "main", local=sorted(tmp_path.glob("*.parquet")))
    assert list(shards) == rows and shards[-1] == rows[-1] and len(shards) == 5
    assert list(tasks.load_rows("openai/gsm8k", "train", "main", local=tmp_path / "train.jsonl", size=2)) == rows[:2]

"""
The report card from real records: one $NANOPOST_HOME through tiny runs of pretrain -> sft -> dpo -> rl (-> a
greedy-only eval), each stage writing the record it really writes (stage "pretrain", nested "skipped" and
"pairs_*" counts, curves), then report.write_report. test_report.py covers the rendering on hand-written records.
"""

import importlib.util

import common
import dpo
import eval as ev
import pretrain
import report
import rl
import rollout
import sft
import tasks
from test_rl import LengthParity
from tokenizer import Tokenizer


def test_report_from_the_records_the_tiny_stages_write(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    Tokenizer.train(tasks.synthetic_documents(300, seed=0), 400).save(tmp_path / "tokenizer")
    pretrain.main(["--depth", "1", "--max-seq-len", "96", "--device-batch-size", "2", "--total-batch-size", "192",
                   "--eval-tokens", "192", "--sample-every", "0", "--num-iterations", "4", "--eval-every", "2",
                   "--device", "cpu"])
    # --max-seq-len 64: the longer SFT conversations are skipped (the record's nested "skipped" counts).
    sft.main(["--preset", "tiny", "--device", "cpu", "--train-rows", "40", "--batch-size", "8",
              "--device-batch-tokens", "512", "--num-steps", "1", "--max-seq-len", "64", "--eval-rows", "8",
              "--check-problems", "2", "--check-samples", "1", "--max-new-tokens", "4"])
    dpo.main(["--device", "cpu", "--pairs", "synthetic", "--train-pairs", "8", "--eval-pairs", "4", "--batch-size", "8",
              "--device-batch-tokens", "2048", "--beta", "0.1", "--check-problems", "2", "--check-samples", "1",
              "--max-new-tokens", "4"])
    monkeypatch.setattr(rollout, "task_by_name", lambda name, split, size: LengthParity(split, size=16))
    rl.main(["--preset", "tiny", "--device", "cpu", "--num-steps", "1", "--prompts-per-step", "2", "--group-size", "2",
             "--max-tokens", "4", "--eval-problems", "2", "--eval-samples", "2"])
    ev.main(["--stage", "rl", "--tasks", "synthetic", "--num-samples", "1", "--max-problems", "4", "--max-tokens", "4",
             "--device", "cpu"])  # greedy only: one sample per problem, no pass@k curve

    records = common.read_report()
    assert [r["stage"] for r in records] == ["pretrain", "sft", "dpo", "rl", "eval"]
    assert records[1]["skipped"] and all("/" in key for key in records[1]["skipped"])  # {"synthetic/too long": n}
    assert records[2]["pairs_train"] == {"paired": 8}
    card = (tmp_path / "report.md").read_text()
    lines = card.splitlines()

    stage_rows = [line.split(" | ")[0][2:] for line in lines[lines.index("## Stages") + 4:] if line.startswith("| ")]
    assert stage_rows[:5] == ["pretrain", "sft", "dpo", "rl", "total"]  # pipeline order, pretrain.py's stage name
    for stage in ("pretrain", "sft", "dpo", "rl"):
        assert f"### {stage}" in lines
    assert f"| val_bpb | {report.format_value(records[0]['val_bpb'])} |" in lines
    skipped_key, skipped_count = next(iter(records[1]["skipped"].items()))
    assert f"| skipped/{skipped_key} | {skipped_count} |" in lines  # nested counts flattened, not dropped
    assert "| pairs_train/paired | 8 |" in lines and "| pairs_held_out/paired | 4 |" in lines
    assert "| curve | " not in card  # curves are plots, not table cells
    assert "## Task metrics" in lines and any(line.startswith("| synthetic/pass@1 | ") for line in lines)
    assert "## Coverage" not in lines  # one greedy sample per problem: nothing to compare

    plots = sorted(p.name for p in (tmp_path / "report_plots").glob("*.png")) \
        if (tmp_path / "report_plots").exists() else []
    if importlib.util.find_spec("matplotlib"):
        assert "pretrain.png" in plots and "![pretrain training curves](report_plots/pretrain.png)" in card
        assert not any(name.startswith("coverage-") for name in plots)
    else:
        assert "Plots skipped" in card

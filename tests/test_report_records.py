"""
The report card from real records: one $NANOPOST_HOME through tiny runs of pretrain -> sft -> dpo -> rl (-> a
greedy-only eval), each stage writing the record it really writes (stage "pretrain", nested "skipped" and
"pairs_*" counts, curves), then report.write_report: its tables, and one figure per stage with the series that stage
logged, every point of them. test_report.py covers the rendering on hand-written records.
"""

import importlib.util
import os

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
              "--device-batch-tokens", "512", "--num-steps", "2", "--max-seq-len", "64", "--eval-rows", "8",
              "--check-problems", "2", "--check-samples", "1", "--max-new-tokens", "4"])
    dpo.main(["--device", "cpu", "--pairs", "synthetic", "--train-pairs", "16", "--eval-pairs", "4", "--batch-size",
              "8", "--device-batch-tokens", "2048", "--beta", "0.1", "--check-problems", "2", "--check-samples", "1",
              "--max-new-tokens", "4", "--eval-every", "1"])
    monkeypatch.setattr(rollout, "task_by_name", lambda name, split, size: LengthParity(split, size=16))
    rl.main(["--preset", "tiny", "--device", "cpu", "--num-steps", "2", "--prompts-per-step", "2", "--group-size", "2",
             "--max-tokens", "4", "--eval-problems", "2", "--eval-samples", "2", "--eval-every", "1"])
    ev.main(["--stage", "rl", "--tasks", "synthetic", "--num-samples", "1", "--max-problems", "4", "--max-tokens", "4",
             "--device", "cpu"])  # greedy only: one sample per problem, no pass@k curve

    records = common.read_report()
    assert [r["stage"] for r in records] == ["pretrain", "sft", "dpo", "rl", "eval"]
    assert records[1]["skipped"] and all("/" in key for key in records[1]["skipped"])  # {"synthetic/too long": n}
    assert records[2]["pairs_train"] == {"paired": 16}
    card = (tmp_path / "report.md").read_text()
    lines = card.splitlines()

    stage_rows = [line.split(" | ")[0][2:] for line in lines[lines.index("## Stages") + 4:] if line.startswith("| ")]
    assert stage_rows[:5] == ["pretrain", "sft", "dpo", "rl", "total"]  # pipeline order, pretrain.py's stage name
    for stage in ("pretrain", "sft", "dpo", "rl"):
        assert f"### {stage}" in lines
    assert f"| val_bpb | {report.format_value(records[0]['val_bpb'])} |" in lines
    skipped_key, skipped_count = next(iter(records[1]["skipped"].items()))
    assert f"| skipped/{skipped_key} | {skipped_count} |" in lines  # nested counts flattened, not dropped
    assert "| pairs_train/paired | 16 |" in lines and "| pairs_held_out/paired | 4 |" in lines
    assert "| curve | " not in card  # curves are plots, not table cells
    assert "## Task metrics" in lines and any(line.startswith("| synthetic/pass@1 | ") for line in lines)
    assert "## Coverage" not in lines  # one greedy sample per problem: nothing to compare

    if not importlib.util.find_spec("matplotlib"):
        assert "Plots skipped" in card
        return
    assert not any(name.startswith("coverage-") for name in os.listdir(tmp_path / "report_plots"))
    # Each stage's figure: every point each series was logged with (few enough here that none is thinned away).
    # pretrain: 4 steps, each a logged one (num_iterations // 200 < 1), held-out bpb at steps 0, 2 and 4. sft: 2 steps,
    # held-out loss of the base model (step 0) and at the last step. dpo: 16 pairs / 8 = 2 steps, both evaluated.
    # rl: 2 steps of rollouts, held-out pass@1 at steps 0, 1 and 2; no reference model (KL) at the tiny preset.
    expected = {
        "pretrain": {"train/loss": 4, "val/bpb": 3, "train/lrm": 4, "train/tokens_per_sec": 4},
        "sft": {"train/loss": 2, "val/loss": 2},
        "dpo": {"train/loss": 2, "val/loss": 2, "train/rewards/margins": 2, "val/rewards/margins": 2,
                "train/rewards/accuracy": 2, "val/rewards/accuracy": 2, "train/logps/chosen": 2,
                "train/logps/rejected": 2},
        "rl": {"reward/mean": 2, "eval/pass@1": 3, "policy/entropy": 2, "length/mean": 2, "length/truncated_frac": 2,
               "batch/zero_contrast_frac": 2, "policy/clip_low": 2, "policy/clip_high": 2,
               "mismatch/logp_gap_mean": 2},
    }
    for record in records[:4]:
        stage = record["stage"]
        png = tmp_path / "report_plots" / f"{stage}.png"
        assert f"![{stage} training curves](report_plots/{stage}.png)" in card
        assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size < 100_000
        fig = report.stage_figure(stage, record)
        assert {line.get_gid(): len(line.get_xdata()) for ax in fig.axes for line in ax.get_lines()} == \
            expected[stage], stage

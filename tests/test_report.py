"""The report card: report.md rendered from a hand-written report.jsonl, with and without matplotlib."""

import json
import sys

import pytest
import torch

import common
import eval as ev
import report

RECORDS = [
    {"time": "2025-01-01 10:00:00", "stage": "tokenizer", "vocab_size": 2048, "val_bytes_per_token": 3.14159},
    {"time": "2025-01-01 10:05:00", "stage": "base", "seconds": 125.0, "val_bpb": 1.25,
     "curves": [{"step": [1, 100, 200], "train/loss": [7.5, 3.0, 2.25]}]},
    {"time": "2025-01-01 10:06:00", "stage": "sft", "seconds": 60.0, "metrics": {"val_loss": 0.8},
     "curves": [{"step": [1, 2, 3], "train/loss": [1.5, 1.0, 0.75], "lr_multiplier": [1.0, 0.67, 0.33]},
                {"step": [0, 3], "val/loss": [2.0, 0.8]}]},
    {"time": "2025-01-01 10:09:00", "stage": "base", "seconds": 130.0, "val_bpb": 1.2,  # a re-run replaces the first
     "curves": [{"step": [1, 100, 200], "train/loss": [7.5, 2.9, 2.0]}, {"step": [0, 200], "val/bpb": [3.0, 1.2]}]},
    {"time": "2025-01-01 10:10:00", "stage": "eval", "of": "sft", "step": 50,
     "metrics": {"bpb": 1.3, "synthetic/pass@1": 0.4375, "synthetic/pass@4": 0.75},
     "coverage": {"synthetic": {"samples": 4, "correct": [0, 1, 4, 2]}}},
    {"time": "2025-01-01 10:11:00", "stage": "eval", "of": "rl", "step": 30,
     "metrics": {"synthetic/pass@1": 0.5, "synthetic/pass@4": 0.5},
     "coverage": {"synthetic": {"samples": 4, "correct": [4, 4, 0, 0]}}},
    {"time": "2025-01-01 10:07:00", "stage": "eval", "of": "base", "step": 100,  # superseded by step 200 below
     "metrics": {"bpb": 1.4, "arc-easy/acc": 0.25}},
    {"time": "2025-01-01 10:12:00", "stage": "eval", "of": "base", "step": 200, "metrics": {"bpb": 1.2}},
    {"time": "2025-01-01 10:13:00", "stage": "eval", "of": "sft", "step": 50, "metrics": {"gsm8k/pass@1": 0.125}},
]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    (tmp_path / "report.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return tmp_path


def test_report_tables(home, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    ev.main(["--report-only"])
    card = (home / "report.md").read_text()
    lines = card.splitlines()
    assert f"| torch | {torch.__version__} |" in lines
    # stages in pipeline order, the re-run base replacing the first; times from "seconds"; total 130 + 60 s
    stages = lines[lines.index("| stage | finished | time |") + 2:][:4]
    assert stages == ["| tokenizer | 2025-01-01 10:00:00 |  |", "| base | 2025-01-01 10:09:00 | 2m10s |",
                      "| sft | 2025-01-01 10:06:00 | 1m00s |", "| total | | 3m10s |"]
    assert "| val_bpb | 1.2 |" in lines and "| val_bpb | 1.25 |" not in lines
    assert "| seconds | 130 |" in lines and "| val_bytes_per_token | 3.142 |" in lines
    assert "| metrics/val_loss | 0.8 |" in lines  # nested metrics are flattened
    # one table across stages, in pipeline order; the later sft run (same checkpoint) added gsm8k and kept the
    # rest; base's step-100 evaluation is replaced by the step-200 one, arc-easy included
    table = lines[lines.index("| metric | base | sft | rl |"):][:7]
    assert table == ["| metric | base | sft | rl |", "|---|---|---|---|",
                     "| checkpoint step | 200 | 50 | 30 |",
                     "| bpb | 1.2 | 1.3 |  |",
                     "| synthetic/pass@1 |  | 0.4375 | 0.5 |",
                     "| synthetic/pass@4 |  | 0.75 | 0.5 |",
                     "| gsm8k/pass@1 |  | 0.125 |  |"]
    assert "arc-easy" not in card
    # coverage, hand-computed: sft pass@1 7/16, pass@4 3/4, A = 5/16, S = 5/9. rl solves two problems always and
    # two never: A = 0 on every resample, so its interval is [0, 0] (S as well; resamples with pass@1 = 1 are left out).
    sft_row = next(line for line in lines if line.startswith("| synthetic | sft |"))
    assert sft_row.startswith("| synthetic | sft | 4 | 4 | 0.438 | 0.750 | 0.312 [") and "| 0.556 [" in sft_row
    assert "| synthetic | rl | 4 | 4 | 0.500 | 0.500 | 0.000 [0.000, 0.000] | 0.000 [0.000, 0.000] |" in lines
    assert "Plots skipped: matplotlib is not installed" in card and "![" not in card


def test_report_plots(home):
    pytest.importorskip("matplotlib")
    report.main([])  # python report.py
    card = (home / "report.md").read_text()
    for name in ("base", "sft", "coverage-synthetic"):
        assert (home / "report_plots" / f"{name}.png").read_bytes().startswith(b"\x89PNG")
    assert "![base training curves](report_plots/base.png)" in card
    assert "![synthetic pass@k curves](report_plots/coverage-synthetic.png)" in card
    assert "Plots skipped" not in card


def test_report_draws_a_plot_again_only_when_its_data_changed(home, monkeypatch):
    pytest.importorskip("matplotlib")
    saved = []
    real_save = report.save_png
    monkeypatch.setattr(report, "save_png", lambda fig, path, dpi: saved.append(path.name) or real_save(fig, path, dpi))
    report.write_report()
    assert sorted(saved) == ["base.png", "coverage-synthetic.png", "sft.png"]
    saved.clear()
    report.write_report()  # nothing new: every PNG is kept
    assert saved == []
    with open(home / "report.jsonl", "a") as f:  # a new SFT run and a new sampled evaluation of rl
        f.write(json.dumps({**RECORDS[2], "time": "2025-01-01 11:00:00"}) + "\n")
        f.write(json.dumps({**RECORDS[5], "coverage": {"synthetic": {"samples": 4, "correct": [4, 4, 4, 0]}}}) + "\n")
    report.write_report()
    assert sorted(saved) == ["coverage-synthetic.png", "sft.png"]
    saved.clear()
    (home / "report_plots" / "base.png").unlink()  # a PNG that went missing is drawn again
    report.write_report()
    assert saved == ["base.png"]


def test_curves_and_scalars_of_a_record():
    record = RECORDS[3]
    assert report.curves_of(record) == {"train/loss": ([1, 100, 200], [7.5, 2.9, 2.0]),
                                        "val/bpb": ([0, 200], [3.0, 1.2])}
    assert report.curves_of(RECORDS[2]) == {"train/loss": ([1, 2, 3], [1.5, 1.0, 0.75]),
                                            "lr_multiplier": ([1, 2, 3], [1.0, 0.67, 0.33]),
                                            "val/loss": ([0, 3], [2.0, 0.8])}
    assert report.scalars_of(RECORDS[2]) == {"time": "2025-01-01 10:06:00", "stage": "sft", "seconds": 60.0,
                                             "metrics/val_loss": 0.8}


def test_report_of_an_empty_run(home):
    (home / "report.jsonl").unlink()
    assert common.read_report() == []
    text = report.render_report([], {"git commit": "abc"}, plots=None)
    assert text == "# nanopost report card\n\n## Environment\n\n| | |\n|---|---|\n| git commit | abc |\n"


def test_a_stage_figure_has_its_stages_panels_and_marks_held_out_points():
    pytest.importorskip("matplotlib")
    fig = report.stage_figure("sft", RECORDS[2])
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines()}
    assert set(lines) == {"train/loss", "val/loss"}  # SFT's panel: lr_multiplier is logged but not drawn
    assert list(lines["val/loss"].get_xdata()) == [0, 3] and list(lines["val/loss"].get_ydata()) == [2.0, 0.8]
    assert (lines["val/loss"].get_marker(), lines["val/loss"].get_linestyle()) == ("o", "--")  # held-out
    assert (lines["train/loss"].get_marker(), lines["train/loss"].get_linestyle()) == (".", "-")  # a short run's dots
    long_run = {"stage": "sft", "curves": [{"step": list(range(1, 22)), "train/loss": [1.0] * 21}]}
    assert report.stage_figure("sft", long_run).axes[0].get_lines()[0].get_marker() == "None"
    assert fig.axes[0].get_xlabel() == "optimizer step" and "nats" in fig.axes[0].get_ylabel()
    # a stage without panels of its own ("base" is not a stage name the scripts write): one panel per series
    fig = report.stage_figure("base", RECORDS[3])
    assert [ax.get_title() for ax in fig.axes] == ["train/loss", "val/bpb"]
    assert report.stage_figure("tokenizer", RECORDS[0]) is None

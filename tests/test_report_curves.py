"""
The training curves in report records: common.Logger keeps what a stage logs, thins it evenly and append_report puts
it into the stage's record; rm.py and PPO from a reward model (rlhf) get the figures report.py draws for them.
test_report_records.py checks the figures of pretrain -> sft -> dpo -> rl, test_sft_rft.py and test_dpo_kto_orpo.py
those of sft.py --rft-rounds and dpo.py --loss kto/orpo.
"""

import json

import pytest

import common
import ppo
import report
import rm
from common import Logger
from conftest import make_model
from test_ppo import reward_model_checkpoint  # noqa: F401 (fixture)
from test_rl import checkpoint, model, run_rl, tokenizer  # noqa: F401 (fixtures)


def test_logger_thins_each_series_evenly_and_groups_those_with_the_same_steps():
    logger = Logger("dummy", {})
    for step in range(1, 1001):
        logger.log({"train/loss": 1 / step, "train/lr": 1.0}, step)
        if step % 100 == 0:
            logger.log({"val/loss": 2 / step}, step)
    logger.log({"note": "a label", "final/loss": 0.123456789}, 1000)  # not a number: kept out
    train, val, final = logger.curves()
    assert len(train["step"]) == len(train["train/loss"]) == len(train["train/lr"]) == common.CURVE_POINTS
    assert train["step"][0] == 1 and train["step"][-1] == 1000  # the first and the last point kept
    gaps = {b - a for a, b in zip(train["step"], train["step"][1:])}
    assert gaps <= {5, 6}, gaps  # evenly: 999 / 199 = 5.02 steps apart
    assert train["train/loss"] == [float(f"{1 / s:.5g}") for s in train["step"]]  # 5 significant digits
    steps = list(range(100, 1001, 100))
    assert val == {"step": steps, "val/loss": [float(f"{2 / s:.5g}") for s in steps]}  # few enough: all kept
    assert final == {"step": [1000], "final/loss": [0.12346]}


def test_a_resumed_logger_keeps_the_history_and_replaces_a_step_logged_again():
    first = Logger("dummy", {})
    for step in range(4):
        first.log({"val/loss": 10.0 - step}, step)
    saved = json.loads(json.dumps(first.series))  # what a checkpoint holds
    resumed = Logger("dummy", {}, series=saved)
    resumed.log({"val/loss": 6.5}, 3)  # the checkpoint's step, evaluated again after the resume
    resumed.log({"val/loss": 6.0}, 4)
    assert resumed.curves() == [{"step": [0, 1, 2, 3, 4], "val/loss": [10.0, 9.0, 8.0, 6.5, 6.0]}]


def test_a_step_without_a_value_is_null_in_the_record_and_a_gap_in_the_figure():
    # A step that trained on nothing logs its entropy as NaN: strict JSON has no NaN, and check_report refuses one.
    logger = Logger("dummy", {})
    for step, value in enumerate([1.5, float("nan"), 0.5], start=1):
        logger.log({"policy/entropy": value}, step=step)
    group, = json.loads(json.dumps(logger.curves(), allow_nan=False))
    assert group == {"step": [1, 2, 3], "policy/entropy": [1.5, None, 0.5]}
    steps, values = report.curves_of({"curves": [group]})["policy/entropy"]
    assert steps == [1, 2, 3] and values[0] == 1.5 and values[1] != values[1] and values[2] == 0.5


def test_append_report_puts_the_stage_loggers_curves_into_its_record(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    logger = Logger("dummy", {})
    logger.log({"train/loss": 2.0}, 1)
    logger.log({"train/loss": 1.0}, 2)
    common.append_report({"stage": "sft"}, logger)
    common.append_report({"stage": "merge"})  # a later stage of the same process that logs nothing
    sft, merge = common.read_report()
    assert sft["curves"] == [{"step": [1, 2], "train/loss": [2.0, 1.0]}]
    assert "curves" not in merge


def series_points(fig):
    """{series: number of points} of the lines a stage figure drew (their gid is the series name)."""
    return {line.get_gid(): len(line.get_xdata()) for ax in fig.axes for line in ax.get_lines()}


def test_reward_model_and_ppo_from_it_get_their_figures(monkeypatch, tmp_path, tokenizer, checkpoint,
                                                               reward_model_checkpoint):
    pytest.importorskip("matplotlib")
    home = tmp_path / "home"
    monkeypatch.setenv("NANOPOST_HOME", str(home))
    sft_dir = tmp_path / "sft"
    common.save_checkpoint(sft_dir, 0, make_model(tokenizer), {"stage": "sft"}, tokenizer=tokenizer)
    rm.main(["--device", "cpu", "--ckpt", str(sft_dir), "--out", str(tmp_path / "rm"), "--pairs", "synthetic",
             "--train-pairs", "32", "--eval-pairs", "16", "--batch-size", "16", "--device-batch-size", "8",
             "--epochs", "1", "--eval-every", "1"])
    # PPO from the reward model: the RLHF panel (reward-model score against the verifier) and the critic's panel
    run_rl(monkeypatch, tmp_path, checkpoint, "--num-steps", "2", "--eval-every", "1", "--reward", "rm",
           "--rm-ckpt", str(reward_model_checkpoint), stage=ppo)
    rm_record, rlhf_record = common.read_report()
    assert (rm_record["stage"], rlhf_record["stage"]) == ("rm", "rlhf")
    report.write_report()
    card = (home / "report.md").read_text()
    for stage in ("rm", "rlhf"):
        assert f"![{stage} training curves](report_plots/{stage}.png)" in card
        png = home / "report_plots" / f"{stage}.png"
        assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size < 100_000  # six panels for rlhf

    # rm: 32 pairs / 16 = 2 steps, every one evaluated, and the zero head's evaluation at step 0
    points = series_points(report.stage_figure("rm", rm_record))
    assert points == {"train/accuracy": 2, "val/accuracy": 3, "val/margin": 3, "train/loss": 2, "val/loss": 3}
    fig = report.stage_figure("rlhf", rlhf_record)
    assert "reward model vs verifier" in [ax.get_title() for ax in fig.axes] and "critic" in [ax.get_title()
                                                                                              for ax in fig.axes]
    points = series_points(fig)
    # 2 steps; held-out evaluations at steps 0, 1 and 2
    assert {name: points[name] for name in ("reward/rm_score", "reward/accuracy", "critic/value_loss",
                                            "critic/explained_variance", "policy/kl", "reward/mean")} == \
        dict.fromkeys(("reward/rm_score", "reward/accuracy", "critic/value_loss", "critic/explained_variance",
                       "policy/kl", "reward/mean"), 2)
    assert points["eval/rm_score"] == points["eval/pass@1"] == 3

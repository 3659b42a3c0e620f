"""
The rehearsal: `bash speedrun.sh --rehearse` runs the small and full presets' own chain under torchrun (2 gloo ranks)
with only sizes shrunk, and its checks (report completeness, finite numbers, ranks that agree) catch what they must.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common
from conftest import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_rehearsal_runs_both_gpu_presets_under_torchrun(rehearsal):
    folder, result = rehearsal
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for preset in ("small", "full"):
        assert f"speedrun --rehearse: preset {preset} passed" in result.stdout
        report = (folder / preset / "report.md").read_text()
        for stage in ("pretrain", "sft", "dpo", "rl"):
            assert stage in report
    # Every stage said it rehearses, and ran as speedrun launches it: 2 ranks, the renamed wandb flag.
    for script in ("tokenizer.py", "pretrain.py", "sft.py", "dpo.py", "rl.py", "eval.py"):
        assert f"{script}: REHEARSAL (NANOPOST_REHEARSAL=1)" in result.stdout
    assert "--nproc_per_node=2 STAGE.py --preset full --wandb-run dummy --resume" in result.stdout
    print(f"rehearsal: {result.seconds:.0f} s wall time, {result.cpu_seconds:.0f} s of CPU time")


def test_rehearse_replaces_only_the_listed_sizes(monkeypatch, capsys):
    presets = {"small": {"depth": 8, "lr_frac": 0.02, "num_steps": None}}
    common.rehearse(presets, "x.py")
    assert presets == {"small": {"depth": 8, "lr_frac": 0.02, "num_steps": None}}  # off unless asked for
    monkeypatch.setenv("NANOPOST_REHEARSAL", "1")
    common.rehearse(presets, "x.py")
    assert presets == {"small": {"depth": common.REHEARSAL["depth"], "lr_frac": 0.02,
                                 "num_steps": common.REHEARSAL["num_steps"]}}
    out = capsys.readouterr().out
    assert "x.py: REHEARSAL (NANOPOST_REHEARSAL=1): preset sizes replaced: depth 2, num_steps 2" in out
    monkeypatch.setenv("NANOPOST_REHEARSAL", "yes")
    with pytest.raises(common.UserError, match="NANOPOST_REHEARSAL must be 0 or 1"):
        common.rehearse(presets, "x.py")


def test_check_report_names_a_missing_stage_and_a_non_finite_number(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    common.append_report({"stage": "pretrain", "val_bpb": 1.5})
    common.append_report({"stage": "eval", "of": "sft", "metrics": {"bpb": 1.0}, "coverage": {"gsm8k": {}},
                          "settings": {"num_samples": 1}})
    (tmp_path / "report.md").write_text("card")
    common.check_report(["pretrain", "eval:sft"])
    with pytest.raises(common.UserError, match="lacks sft, coverage:sft"):
        common.check_report(["pretrain", "sft", "coverage:sft"])
    common.append_report({"stage": "sft", "val_loss": float("nan")})
    with pytest.raises(common.UserError, match="non-finite numbers in the report: sft.val_loss"):
        common.check_report(["pretrain", "sft"])


def test_check_ranks_agree_refuses_non_finite_weights():
    model = torch.nn.Linear(2, 2)
    common.check_ranks_agree(model, "x")
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="x: non-finite weights in weight"):
        common.check_ranks_agree(model, "x")


AGREE_DRIVER = """
import os, sys
sys.path.insert(0, {repo!r})
import torch
import common
common.compute_init("cpu")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
if sys.argv[1] == "drift" and os.environ["RANK"] == "1":
    with torch.no_grad():
        model[1].bias += 1e-7
try:
    common.check_ranks_agree(model, "test stage")
    print("agree", flush=True)
finally:
    common.compute_cleanup()
"""


@pytest.mark.parametrize("mode", ["same", "drift"])
def test_check_ranks_agree_under_torchrun(tmp_path, mode):
    driver = tmp_path / "driver.py"
    driver.write_text(AGREE_DRIVER.format(repo=str(REPO)))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--master-port={free_port()}", str(driver), mode],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=180)
    if mode == "same":
        assert result.returncode == 0 and result.stdout.count("agree") == 2, result.stderr[-3000:]
    else:
        assert result.returncode != 0
        assert "test stage: rank 1's weights differ from rank 0's (1 tensors, first 1.bias)" in result.stderr

"""bench/gpu_check.py, scaled down to run on CPU in seconds (and under torchrun with 2 gloo ranks), so that the
GPU acceptance run cannot rot; its verdicts on hand-made rows."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402
import sft  # noqa: E402

SCALED_DOWN = ["--device", "cpu", "--depth", "2", "--vocab-size", "512", "--seq-len", "64", "--steps", "4",
               "--engine-rows", "8", "--engine-tokens", "8", "--decode-rows", "2", "--rl-prompts", "2",
               "--rl-max-tokens", "8"]


@pytest.fixture
def isolated_env(monkeypatch, tmp_path):
    # gpu_check points both at its own temporary folder; monkeypatch puts the originals back afterwards.
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(tmp_path / "data"))


def test_gpu_check_scaled_down_runs_every_stage(isolated_env, capsys):
    gpu_check.main(SCALED_DOWN)
    out = capsys.readouterr().out
    table = out[out.index("check    shape"):]
    for check in gpu_check.CHECKS:
        line = next(line for line in table.splitlines() if line.startswith(check))
        assert line.rstrip().endswith("ok"), line
    assert "depth 2, 1 x 64" in table and "KV float32" in table and "rollout" in table and "learner" in table
    assert "gpu_check: every check passed" in out


def test_gpu_check_exits_nonzero_when_a_check_fails(isolated_env, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(sft, "backward_sft_loss", broken)
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(SCALED_DOWN)
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "FAIL: RuntimeError: CUDA out of memory (simulated)" in out and "gpu_check: FAILED (sft)" in out


def test_gpu_check_help_documents_it(capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--engine-rows" in out and "--preset" in out and "rollout and learner seconds" in out


@pytest.mark.slow
def test_gpu_check_scaled_down_under_torchrun_two_ranks(tmp_path):
    env = {**os.environ, "NANOPOST_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(script), *SCALED_DOWN], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "gpu_check: full preset on 2 x cpu" in result.stdout and "x 2 ranks" in result.stdout
    assert "per rank" in result.stdout and result.stdout.count("gpu_check: every check passed") == 1


def test_verdicts_on_memory_and_throughput():
    row = dict(peak=11.0, plan=10.0, rate=600.0, need=1000.0)
    assert gpu_check.verdict(row, 80 * gpu_check.GIB) == "ok"
    assert gpu_check.verdict({**row, "peak": 11.1}, 80 * gpu_check.GIB) == "FAIL: peak 11.1 GiB > plan 10.0 GiB + 10%"
    assert gpu_check.verdict({**row, "rate": 499.0}, None) == "FAIL: 499 tok/s < half of the plan's 1,000"
    assert gpu_check.verdict({**row, "plan": None, "peak": 81.0}, 80 * gpu_check.GIB) == "FAIL: over memory"
    assert gpu_check.verdict({**row, "need": None, "rate": 1.0}, None) == "ok"
    assert gpu_check.verdict({**row, "error": "keys bf16"}, None) == "FAIL: keys bf16"

"""bench/gpu_check.py, scaled down to run on CPU in seconds, so that the one-GPU acceptance run cannot rot."""

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
    for check in ("pretrain", "sft", "dpo", "engine", "decode", "rl"):
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

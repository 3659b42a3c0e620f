"""bench/gpu_check.py, scaled down to run on CPU in seconds (and under torchrun with 2 gloo ranks), so that the
GPU acceptance run cannot rot; its verdicts on hand-made rows."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402
import sft  # noqa: E402

SCALED_DOWN = ["--device", "cpu", "--depth", "2", "--vocab-size", "512", "--seq-len", "64", "--rows", "1",
               "--accum", "2", "--steps", "4", "--engine-rows", "8", "--engine-tokens", "8", "--decode-samples", "2",
               "--rl-prompts", "2", "--rl-max-tokens", "8"]


@pytest.fixture
def isolated_env(monkeypatch, tmp_path):
    # gpu_check points both at its own temporary folder; monkeypatch puts the originals back afterwards.
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(tmp_path / "data"))


def results(tmp_path):
    return [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]


def only(monkeypatch, *phases):
    """Let the deadline allow only `phases` (the others' estimates exceed any deadline)."""
    monkeypatch.setattr(gpu_check, "PHASE_SECONDS", {p: 0 if p in phases else 10**9 for p in gpu_check.PHASES})


@pytest.mark.slow
def test_gpu_check_scaled_down_writes_every_phase(isolated_env, tmp_path, capsys):
    gpu_check.main(SCALED_DOWN + ["--out", str(tmp_path / "out")])
    rows = {row["check"]: row for row in results(tmp_path)}
    assert list(rows) == list(gpu_check.PHASES)
    assert all(row["status"] == "ok" for row in rows.values()), rows
    assert rows["pretrain"]["shape"] == "depth 2, 1 x 64 x 2 accum x 1 ranks" and rows["pretrain"]["recompiles"] == 0
    assert rows["env"]["torch"] and rows["env"]["gemm_tflops"] > 0 and rows["env"]["sdpa_backend"]
    assert sum(rows["profile"]["ms_by_kind"].values()) > 0 and "gemm tf32/fp32" in rows["profile"]["ms_by_kind"]
    assert [s["kept"] > 0 for s in rows["rl"]["steps"]] == [True, True], rows["rl"]  # the RL steps learned
    assert [(r["samples"], r["compiled"]) for r in rows["decode"]["sweep"]] == [(2, False), (2, True)]
    assert all(r["bytes_per_step"] > 0 and r["tok_s"] > 0 for r in rows["decode"]["sweep"])
    assert "gpu_check: every phase that ran passed" in capsys.readouterr().out


def test_gpu_check_deadline_skips_phases_and_each_writes_its_line(isolated_env, tmp_path, monkeypatch, capsys):
    only(monkeypatch, "env")
    gpu_check.main(SCALED_DOWN + ["--out", str(tmp_path / "out")])
    rows = results(tmp_path)
    assert [row["check"] for row in rows] == list(gpu_check.PHASES)
    assert rows[0]["status"] == "ok" and all(row["status"] == "skipped" for row in rows[1:]), rows
    assert rows[1]["reason"].startswith("deadline:") and rows[2]["reason"].startswith("no base checkpoint")
    assert "every phase that ran passed (skipped: pretrain, profile" in capsys.readouterr().out


def test_gpu_check_fails_on_a_memory_plan_20_percent_off(isolated_env, tmp_path, monkeypatch, capsys):
    # The GPU measures exactly the true plan (10 GiB); the plan the script checks against says 20% less.
    only(monkeypatch, "pretrain", "sft")
    monkeypatch.setattr(gpu_check, "peak_gib", lambda device: 10.0)
    monkeypatch.setattr(gpu_check.common, "planned_memory", lambda *args, **kwargs: 0.8 * 10.0 * gpu_check.GIB)
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(SCALED_DOWN + ["--out", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    rows = {row["check"]: row for row in results(tmp_path)}
    assert rows["pretrain"]["status"] == "FAIL: peak 10.0 GiB is +25% off the plan's 8.0"
    assert rows["sft"]["status"].startswith("FAIL: peak 10.0 GiB")  # later phases still ran
    assert "gpu_check: FAILED (pretrain, sft)" in capsys.readouterr().out


def test_gpu_check_passes_when_the_memory_plan_is_right(isolated_env, tmp_path, monkeypatch):
    only(monkeypatch, "pretrain")
    monkeypatch.setattr(gpu_check, "peak_gib", lambda device: 10.0)
    monkeypatch.setattr(gpu_check.common, "planned_memory", lambda *args, **kwargs: 1.1 * 10.0 * gpu_check.GIB)
    gpu_check.main(SCALED_DOWN + ["--out", str(tmp_path / "out")])
    assert {row["check"]: row["status"] for row in results(tmp_path)}["pretrain"] == "ok"


def test_engine_phase_times_only_after_the_warm_up_call(isolated_env, tmp_path, monkeypatch):
    # A first call that costs 3 s (as a compile and CUDA-graph capture would) must stay outside the timed region.
    only(monkeypatch, "pretrain", "engine")
    real_generate, calls = gpu_check.Engine.generate, []

    def slow_first_call(self, *args, **kwargs):
        if not any(engine is self for engine in calls):
            calls.append(self)
            time.sleep(3.0)
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(gpu_check.Engine, "generate", slow_first_call)
    gpu_check.main(SCALED_DOWN + ["--out", str(tmp_path / "out")])
    engine = {row["check"]: row for row in results(tmp_path)}["engine"]
    assert engine["status"] == "ok" and len(calls) == 1 and engine["seconds"] < 3.0, engine


def test_gpu_check_exits_nonzero_when_a_phase_raises(isolated_env, tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    only(monkeypatch, "pretrain", "sft")
    monkeypatch.setattr(sft, "backward_sft_loss", broken)
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(SCALED_DOWN + ["--out", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    rows = {row["check"]: row for row in results(tmp_path)}
    assert rows["sft"]["status"] == "FAIL: RuntimeError: CUDA out of memory (simulated)"
    assert "gpu_check: FAILED (sft)" in capsys.readouterr().out


def test_gpu_check_help_and_offline_command(capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--deadline" in out and "--preset" in out and "timed on the call after a warm-up" in out
    gpu_check.main(["--print-command"])
    command = capsys.readouterr().out
    assert "torchrun --standalone --nproc_per_node=1 bench/gpu_check.py --deadline 540" in command
    assert "--python-version 3.12 --platform manylinux_2_17_x86_64" in command and "results.jsonl" in command


@pytest.mark.slow
def test_gpu_check_scaled_down_under_torchrun_one_rank(tmp_path):
    env = {**os.environ, "NANOPOST_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                             str(script), *SCALED_DOWN, "--decode-samples", "--out", str(tmp_path / "out")],
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "gpu_check: full preset on 1 x cpu" in result.stdout and "x 1 ranks" in result.stdout
    rows = results(tmp_path)
    assert [row["check"] for row in rows] == [p for p in gpu_check.PHASES if p != "decode"]


def test_verdicts_on_memory_mfu_and_throughput():
    row = dict(peak=11.0, plan=10.0, rate=600.0, need=1000.0, mfu=0.45, assumed_mfu=0.40)
    assert gpu_check.verdict(row, 80 * gpu_check.GIB) == "ok"
    assert gpu_check.verdict({**row, "peak": 11.6}, None) == "FAIL: peak 11.6 GiB is +16% off the plan's 10.0"
    assert gpu_check.verdict({**row, "peak": 8.4}, None) == "FAIL: peak 8.4 GiB is -16% off the plan's 10.0"
    assert gpu_check.verdict({**row, "mfu": 0.47}, None) == "FAIL: MFU 47.0% outside the plan's 40% +- 15%"
    assert gpu_check.verdict({**row, "mfu": 0.33}, None) == "FAIL: MFU 33.0% outside the plan's 40% +- 15%"
    assert gpu_check.verdict({**row, "rate": 499.0}, None) == "FAIL: 499 tok/s < half of the plan's 1,000"
    assert gpu_check.verdict({**row, "plan": None, "peak": 81.0}, 80 * gpu_check.GIB) == "FAIL: over memory"
    assert gpu_check.verdict({**row, "need": None, "rate": 1.0}, None) == "ok"
    assert gpu_check.verdict({**row, "error": "keys bf16"}, None) == "FAIL: keys bf16"


def test_kernel_kinds_of_typical_names():
    kinds = {name: gpu_check.kernel_kind(name) for name in [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "ampere_sgemm_128x64_tn", "flash_fwd_kernel",
        "triton_poi_fused_add_0", "ncclDevKernel_AllReduce_Sum_f32", "multi_tensor_apply_kernel foreach", "aten::mm"]}
    assert list(kinds.values()) == ["gemm bf16", "gemm tf32/fp32", "attention", "triton", "nccl", "optimizer",
                                    "gemm tf32/fp32"]

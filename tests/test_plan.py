"""
The budget (issues 10 and 18): the micro-batch that fits a GPU by model.training_memory, checked against
hand-computed values; the preset speedrun.sh chooses for 0, 1, 2 and 8 stubbed GPUs; speedrun.sh's budget table
against plan.py; each preset fits its GPU and the full speedrun its 4 hours.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common
import plan
from model import LOGITS_CHUNK_TOKENS, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
H100 = 81559 * 2**20  # what torch reports for an 80 GB H100
RTX_24GB = 24564 * 2**20

# By hand, for vocab V = 65,536 (model.training_memory's terms):
# depth 20 (C 1280, 20 layers, P = 2 V C + 20 * 12 C^2 = 560,988,160): weights, autocast copies, DDP grads and
# optimizer state = 2,243,952,640 + 954,204,160 + 4,487,905,280 + 2,915,041,280 = 10,601,103,360 bytes; activations
# (20 * 58 + 14) * 1280 = 1,502,720 bytes per token; whole logits 22 V = 1,441,792 per token, chunked 22 V * 4096 =
# 5,905,580,032 in all.
# depth 8 (C 512, P = 92,274,688): 369,098,752 + 117,440,512 + 738,197,504 + 637,534,208 = 1,862,270,976 bytes;
# activations (8 * 58 + 14) * 512 = 244,736 per token.
# Usable: 90% of 85,521,661,952 = 76,969,495,756.8 (H100); 90% of 25,757,220,864 = 23,181,498,777.6 (24 GB).
FIT_CASES = [
    # (depth, seq len, GPU bytes, logits_chunk, max tokens, expected): why
    # whole logits: (76,969,495,756.8 - 10,601,103,360) / (1,502,720 + 1,441,792) = 22,539 tokens -> 16,384
    (20, 2048, H100, None, 65536, 16384),
    # chunked: (76,969,495,756.8 - 10,601,103,360 - 5,905,580,032) / 1,502,720 = 40,235 tokens -> 32,768
    (20, 2048, H100, LOGITS_CHUNK_TOKENS, 32768, 32768),
    # chunked on 24 GB: 16,506,683,392 + 4096 * 1,502,720 = 22,661,824,512 fits; 8192 tokens: 28,816,965,632 does not
    (20, 2048, RTX_24GB, LOGITS_CHUNK_TOKENS, 32768, 4096),
    # whole logits on 24 GB: (23,181,498,777.6 - 1,862,270,976) / (244,736 + 1,441,792) = 12,640 tokens -> 8,192
    (8, 1024, RTX_24GB, None, 16384, 8192),
]


@pytest.mark.parametrize("depth, seq_len, gpu_bytes, chunk, max_tokens, expected", FIT_CASES)
def test_fit_batch_tokens_matches_hand_computed(depth, seq_len, gpu_bytes, chunk, max_tokens, expected):
    config = GPTConfig.from_depth(depth, 65536, seq_len)
    assert common.fit_batch_tokens("stage", config, gpu_bytes, max_tokens, seq_len, chunk) == expected


def test_fit_batch_tokens_that_cannot_fit_names_stage_and_memory():
    config = GPTConfig.from_depth(20, 65536, 2048)
    # 2,048 tokens: one chunk of 2,048 logits, 10,601,103,360 + 22 * 65,536 * 2048 + 2048 * 1,502,720 =
    # 16,631,463,936 bytes = 15.5 GiB > 10.8 GiB (90% of 12 GiB)
    with pytest.raises(common.UserError, match=r"sft does not fit .*2,048 tokens\) needs 15\.5 GiB .* 10\.8 GiB"):
        common.fit_batch_tokens("sft", config, 12 * 2**30, 32768, 2048, LOGITS_CHUNK_TOKENS)


def test_batch_tokens_for_device_fits_the_gpu_it_finds(monkeypatch, capsys):
    config = GPTConfig.from_depth(20, 65536, 2048)
    props = type("Props", (), {"total_memory": RTX_24GB})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    cuda = torch.device("cuda", 0)
    assert common.batch_tokens_for_device("sft", None, cuda, config, 32768, 2048, LOGITS_CHUNK_TOKENS) == 4096
    assert "sft: micro-batches of 4,096 tokens fit this GPU" in capsys.readouterr().out
    assert common.batch_tokens_for_device("sft", 8192, cuda, config, 32768, 2048, LOGITS_CHUNK_TOKENS) == 8192
    assert common.batch_tokens_for_device("sft", None, "cpu", config, 32768, 2048, LOGITS_CHUNK_TOKENS) == 32768


def speedrun_choice(gpus, tmp_path, preset=None):
    env = {**os.environ, "NANOPOST_FAKE_GPUS": gpus, "NANOPOST_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("PRESET", None)
    if preset:
        env["PRESET"] = preset
    result = subprocess.run(["bash", "speedrun.sh", "--choose"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


@pytest.mark.parametrize("gpus, expected", [
    ("0", "preset tiny, launch: python"),
    ("1x24564", "preset small, launch: torchrun --standalone --nproc_per_node=1"),
    ("2x24564", "preset small, launch: torchrun --standalone --nproc_per_node=2"),
    ("8x81559", "preset full, launch: torchrun --standalone --nproc_per_node=8"),
])
def test_speedrun_chooses_the_preset_for_the_gpus(gpus, expected, tmp_path):
    out = speedrun_choice(gpus, tmp_path)
    assert expected in out
    if gpus == "2x24564":
        assert "the full preset plans for" in out  # the reason is printed


def test_speedrun_preset_override(tmp_path):
    out = speedrun_choice("8x81559", tmp_path, preset="small")
    assert "PRESET=small overrides the choice (full)" in out and "preset small" in out


def test_choice_with_two_to_seven_gpus_prints_both_estimates():
    preset, procs, reasons = plan.choose_preset([H100] * 6)
    assert (preset, procs) == ("full", 4)  # powers of two: 4 of the 6; full on 4 H100s ~7.3 h <= 8 h
    assert "full (with gradient accumulation) ~" in reasons[0] and "small (DDP) ~" in reasons[0]
    assert plan.choose_preset([H100] * 2)[0] == "small"  # full would take ~15 h


def test_speedrun_header_is_the_plan_and_fits():
    script = (ROOT / "speedrun.sh").read_text().splitlines()
    for preset in ("full", "small"):
        for line in plan.header_lines(preset):
            assert line in script, f"speedrun.sh's budget table is stale: {line!r} (regenerate: python plan.py)"
    full, small = plan.preset_plan("full"), plan.preset_plan("small")
    assert sum(p["minutes"] for p in full) <= 4 * 60
    assert all(p["fits"] and p["peak_gib"] <= 75 for p in full)
    assert all(p["fits"] for p in small) and sum(p["minutes"] for p in small) <= 135  # ~2 h on one 24 GB GPU


def test_plan_cli_prints_every_stage(tmp_path):
    env = {**os.environ, "NANOPOST_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "plan.py", "--preset", "small"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    for stage in plan.STAGES:
        assert f"{stage}: plan on 1x RTX 4090 24GB" in out

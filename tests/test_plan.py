"""
The budget: the micro-batch that fits a GPU by model.training_memory, checked against
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
# (20 * 44 + 14) * 1280 = 1,144,320 bytes per token; whole logits 22 V = 1,441,792 per token, chunked 22 V * 4096 =
# 5,905,580,032 in all.
# depth 8 (C 512, P = 92,274,688): 369,098,752 + 117,440,512 + 738,197,504 + 637,534,208 = 1,862,270,976 bytes;
# activations (8 * 44 + 14) * 512 = 187,392 per token.
# Usable: 90% of 85,521,661,952 = 76,969,495,756.8 (H100); 90% of 25,757,220,864 = 23,181,498,777.6 (24 GB).
FIT_CASES = [
    # (depth, seq len, GPU bytes, logits_chunk, max tokens, expected): why
    # whole logits: (76,969,495,756.8 - 10,601,103,360) / (1,144,320 + 1,441,792) = 25,663 tokens -> 16,384
    (20, 2048, H100, None, 65536, 16384),
    # chunked: (76,969,495,756.8 - 10,601,103,360 - 5,905,580,032) / 1,144,320 = 52,837 tokens -> 32,768
    (20, 2048, H100, LOGITS_CHUNK_TOKENS, 32768, 32768),
    # chunked on 24 GB: 16,506,683,392 + 4096 * 1,144,320 = 21,193,818,112 fits; 8192 tokens: 25,880,952,832 does not
    (20, 2048, RTX_24GB, LOGITS_CHUNK_TOKENS, 32768, 4096),
    # whole logits on 24 GB: (23,181,498,777.6 - 1,862,270,976) / (187,392 + 1,441,792) = 13,086 tokens -> 8,192
    (8, 1024, RTX_24GB, None, 16384, 8192),
]


@pytest.mark.parametrize("depth, seq_len, gpu_bytes, chunk, max_tokens, expected", FIT_CASES)
def test_fit_batch_tokens_matches_hand_computed(depth, seq_len, gpu_bytes, chunk, max_tokens, expected):
    config = GPTConfig.from_depth(depth, 65536, seq_len)
    assert common.fit_batch_tokens("stage", config, gpu_bytes, max_tokens, seq_len, chunk) == expected


def test_fit_batch_tokens_that_cannot_fit_names_stage_and_memory():
    config = GPTConfig.from_depth(20, 65536, 2048)
    # 2,048 tokens: one chunk of 2,048 logits, 10,601,103,360 + 22 * 65,536 * 2048 + 2048 * 1,144,320 =
    # 15,897,460,736 bytes = 14.8 GiB > 10.8 GiB (90% of 12 GiB)
    with pytest.raises(common.UserError, match=r"sft does not fit .*2,048 tokens\) needs 14\.8 GiB .* 10\.8 GiB"):
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
    env = {**os.environ, "NANOPOST_FAKE_GPUS": gpus, "NANOPOST_HOME": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PYTHON": sys.executable}
    env.pop("PRESET", None)
    if preset:
        env["PRESET"] = preset
    result = subprocess.run(["bash", "speedrun.sh", "--choose"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


@pytest.mark.parametrize("gpus, expected", [
    ("0", "preset tiny, launch: PYTHON"),
    ("1x24564", "preset small, launch: PYTHON -m torch.distributed.run --standalone --nproc_per_node=1"),
    ("2x24564", "preset small, launch: PYTHON -m torch.distributed.run --standalone --nproc_per_node=2"),
    ("8x81559", "preset full, launch: PYTHON -m torch.distributed.run --standalone --nproc_per_node=8"),
])
def test_speedrun_chooses_the_preset_for_the_gpus(gpus, expected, tmp_path):
    out = speedrun_choice(gpus, tmp_path)
    assert expected.replace("PYTHON", sys.executable) + "\n" in out
    if gpus == "2x24564":
        assert "the full preset plans for" in out  # the reason is printed


def test_speedrun_preset_override(tmp_path):
    out = speedrun_choice("8x81559", tmp_path, preset="small")
    assert "PRESET=small overrides the choice (full)" in out and "preset small" in out


def test_choice_with_two_to_seven_gpus_prints_both_estimates():
    preset, procs, reasons = plan.choose_preset([H100] * 6)
    assert (preset, procs) == ("full", 4)  # powers of two: 4 of the 6; full on 4 H100s ~7.8 h <= 8 h
    assert "full (with gradient accumulation) ~" in reasons[0] and "small (DDP) ~" in reasons[0]
    assert plan.choose_preset([H100] * 2)[0] == "small"  # full would take ~15.5 h


def test_speedrun_header_is_the_plan_and_fits():
    script = (ROOT / "speedrun.sh").read_text().splitlines()
    for preset in ("full", "small"):
        for line in plan.header_lines(preset):
            assert line in script, f"speedrun.sh's budget table is stale: {line!r} (regenerate: python plan.py)"
    full, small = plan.preset_plan("full"), plan.preset_plan("small")
    assert sum(p["minutes"] for p in full) <= 4 * 60
    assert all(p["fits"] and p["peak_gib"] <= 75 for p in full)
    assert all(p["fits"] for p in small) and sum(p["minutes"] for p in small) <= 135  # ~2 h on one 24 GB GPU


def test_readme_quotes_the_plan():
    readme = (ROOT / "README.md").read_text()
    full, small = (sum(p["minutes"] for p in plan.preset_plan(preset)) for preset in ("full", "small"))
    assert f"~{full / 60:.1f} h (`speedrun.sh`'s table)" in readme and f"~{small / 60:.1f} h on a 4090" in readme
    assert f"the full preset's {full:.0f} minutes" in readme and f"the small preset ({small:.0f} min)" in readme


def test_plan_cli_prints_every_stage(tmp_path):
    env = {**os.environ, "NANOPOST_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "plan.py", "--preset", "small"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    for stage in plan.STAGES:
        assert f"{stage}: plan on 1x RTX 4090 24GB" in out


# -----------------------------------------------------------------------------
# RL's sampling rounds, the models RL holds besides the policy, and what each phase keeps at once


def test_contrast_probability_matches_the_beta_moments():
    # mu 1/2, kappa 2: p uniform; two completions disagree with probability 1 - E[(1-p)^2] - E[p^2] = 1 - 1/3 - 1/3
    assert common.contrast_probability(0.5, 2) == pytest.approx(1 / 3)
    # mu 1/2, G 16: E[p^16] = E[(1-p)^16] = 1/17 -> 15/17
    assert common.contrast_probability(0.5, 16) == pytest.approx(15 / 17)
    # GSM8K at depth 20: mu 5%, a = 0.1, b = 1.9: prod_{i<16} (1.9 + i)/(2 + i) = 0.78117, prod (0.1 + i)/(2 + i) =
    # 0.00051 -> 0.21832; were every prompt solved 5% of the time (no spread) it would be 1 - 0.95^16 = 0.56
    assert common.contrast_probability(0.05, 16) == pytest.approx(0.2183221, abs=1e-6)


def test_expected_sampling_rounds_hand_computed():
    # q = 1/3 (mu 1/2, G 2), one group needed, one prompt per round, 3 rounds at most:
    # one rank: 1 + P(R > 1) + P(R > 2) = 1 + 2/3 + 4/9; two ranks: 1 + (1 - 1/9) + (1 - (5/9)^2) = 209/81
    assert common.expected_sampling_rounds(0.5, 2, 1, 1, 1, max_rounds=3) == pytest.approx(19 / 9)
    assert common.expected_sampling_rounds(0.5, 2, 1, 1, 2, max_rounds=3) == pytest.approx(209 / 81)
    # Plenty of contrast (pass@1 1/2, groups of 16: q = 15/17): one round, even waiting for the slowest of 8 ranks
    assert common.expected_sampling_rounds(0.5, 16, 8, 2, 8) == pytest.approx(1.0, abs=1e-3)
    # The full preset at 5% pass@1 (q = 0.21832): 8 groups per rank, 16 prompts per round, 8 ranks, 4 rounds at most.
    # P(R <= 1) = P(Bin(16, q) >= 8) = 0.01208, P(R <= 2) = P(Bin(32, q) >= 8) = 0.39822, P(R <= 3) = 0.85214:
    # 1 + (1 - 0.01208^8) + (1 - 0.39822^8) + (1 - 0.85214^8) = 3.7213
    assert common.expected_sampling_rounds(0.05, 16, 8, 2, 8) == pytest.approx(3.72133, abs=1e-4)
    # One rank alone waits less than the slowest of eight
    assert common.expected_sampling_rounds(0.05, 16, 8, 2, 1) < 3.0


def test_rl_models_bytes_hand_computed():
    # depth 20, V 65,536, C 1280: P = 560,988,160, V C = 83,886,080, P_blocks = 393,216,000, a head of C + 1 = 1281
    config = GPTConfig.from_depth(20, 65536, 2048)
    assert common.rl_models_bytes(config) == {}
    assert common.rl_models_bytes(config, reference=True, reward_model=True, critic=True) == {
        "reference": 2_243_952_640,  # 4 P
        "reward_model": 2_243_957_764,  # 4 (P + 1281)
        # 4 (P + 1281) + 4 (P - V C + 1281) + 8 (V C + 1281) + 4 P_blocks
        # = 2,243,957,764 + 1,908,413,444 + 671,098,888 + 1,572,864,000
        "critic": 6_396_334_096,
    }


def rl_plan(*flags):
    args = plan.rl.parse_args(["--preset", "full", *flags])
    return plan.rl.plan(args, plan.preset_config("full"))


def test_rl_plan_rounds_and_residency():
    p = rl_plan()
    # The rounds of the test above; decoded tokens: 100 steps x 3.7213 rounds x (64 x 16 x 2 rows) x 384 tokens,
    # plus 3 evaluations of 400 problems x 8 samples x 384 tokens
    assert p["sampling_rounds"] == pytest.approx(3.72133, abs=1e-4)
    assert p["decode_tokens"] == pytest.approx(100 * 3.721334630836652 * 2048 * 384 + 3 * 400 * 8 * 384)
    # Peak: the learner, at 16,384 tokens without DDP buckets: weights 2,243,952,640 + autocast 954,204,160 + grads
    # 2,243,952,640 + optimizer 2,915,041,280 + activations 16,384 x 1,144,320 + one logits chunk 22 V 4096 =
    # 33,011,269,632. The rollout holds less: weights, autocast, optimizer, 256 rows x 640 positions of KV cache
    # (102,400 bytes each: 16,777,216,000) and their sampling logits 16 V 256 = 23,158,849,536; the two never coexist.
    assert p["micro_batch_tokens"] == 16384
    assert p["peak_gib"] == pytest.approx(33_011_269_632 / 2**30)
    # From a reward model: no contrast filter (one round), the reward model and the reference (KL 0.05 by default)
    rm = rl_plan("--reward", "rm", "--rm-ckpt", "unused")
    assert rm["sampling_rounds"] == 1.0
    assert rm["peak_gib"] == pytest.approx((33_011_269_632 + 2_243_957_764 + 2_243_952_640) / 2**30)


def test_eval_plan_peak_is_generation_not_training():
    # Generation holds the most: weights 2,243,952,640 + autocast 954,204,160 + 32 prompts x 8 samples x 768
    # positions of KV cache (20,132,659,200) + their sampling logits (268,435,456); no gradients, no optimizer
    p = plan.eval_plan("full", plan.preset_config("full"))
    assert p["peak_gib"] == pytest.approx(23_599_251_456 / 2**30)


def test_headline_names_its_two_unknowns():
    (mfu, mfu_moves), (rounds, rounds_moves) = plan.unknowns("full")
    assert mfu == "pretraining MFU 40%" and rounds.startswith("RL 3.7 sampling rounds per step")
    base = plan.preset_plan("full")[0]["minutes"]
    assert mfu_moves == [("33%", pytest.approx(base * (0.40 / 0.33 - 1))), ("50%", pytest.approx(-0.2 * base))]
    assert rounds_moves[0][0] == "1" and rounds_moves[0][1] < 0 and rounds_moves[1][0] == "4 (the cap)"

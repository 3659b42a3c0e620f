"""
Resume is bit-exact in every chat stage: a run killed after a mid-run checkpoint (--save-every 1) and resumed with
--resume ends with weights torch.equal to an uninterrupted run's, and the two report records agree, curves included
(all but the time stamp, the wall-clock seconds and timings). Pretraining's own check is
test_pretrain.test_resume_is_bit_exact.

The kill: the stage's Logger raises when it is handed the metrics of step `kill_at`, after that step's update and
before its checkpoint, so the last checkpoint on disk is step kill_at - 1 and the resumed run redoes step kill_at.
"""

import pytest
import torch

import common
import distill
import dpo
import rl
import rollout
import sft
from conftest import make_model, make_tokenizer
from test_rl import LengthParity


class Killed(Exception):
    pass


def killing_logger(kill_at):
    class KillingLogger(common.Logger):
        def log(self, metrics, step):
            if step == kill_at:
                raise Killed(f"killed at step {step}")
            super().log(metrics, step)

    return KillingLogger


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def run_killed_and_resumed(main, argv, out, kill_at, monkeypatch, module):
    """Run main(argv) killed at step kill_at, then main(argv + --resume); returns the resumed run's output dir."""
    logger = module.Logger
    monkeypatch.setattr(module, "Logger", killing_logger(kill_at))
    with pytest.raises(Killed):
        main(argv)
    latest = common.load_checkpoint(out)[1]
    assert latest["step"] == kill_at - 1 and not latest["finished"]  # a mid-run checkpoint exists, the end does not
    monkeypatch.setattr(module, "Logger", logger)
    main(argv + ["--resume"])


def assert_same_run(out_a, out_b):
    state_a, meta_a, _ = common.load_checkpoint(out_a)
    state_b, meta_b, _ = common.load_checkpoint(out_b)
    assert meta_a["finished"] and meta_b["finished"] and meta_a["step"] == meta_b["step"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key
    record_a, record_b = common.read_report()[-2:]  # the uninterrupted run's, then the resumed run's
    assert without_clock(record_a) == without_clock(record_b)


def without_clock(record):
    """A report record less what the wall clock decides: its time stamp, its seconds and the timing series (time/...)
    of its curves. The curves themselves must survive the resume: a resumed stage's Logger restarts from the
    checkpoint's series."""
    curves = [{name: values for name, values in group.items() if not name.startswith("time/")}
              for group in record["curves"]]
    return {**{k: v for k, v in record.items() if k not in ("time", "seconds")}, "curves": curves}


SFT_ARGS = ["--preset", "tiny", "--device", "cpu", "--train-rows", "48", "--batch-size", "16",
            "--device-batch-tokens", "1024", "--eval-rows", "16", "--check-problems", "4", "--check-samples", "2",
            "--max-new-tokens", "16", "--eval-every", "2", "--save-every", "1"]


def test_sft_resume_is_bit_exact(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    base = tmp_path / "base"
    common.save_checkpoint(base, 1, make_model(tokenizer), {"stage": "base"}, tokenizer=tokenizer)
    argv = SFT_ARGS + ["--ckpt", str(base)]
    sft.main(argv + ["--out", str(tmp_path / "a")])
    run_killed_and_resumed(sft.main, argv + ["--out", str(tmp_path / "b")], tmp_path / "b", 2, monkeypatch, common)
    assert "resuming from step 1" in capsys.readouterr().out
    assert_same_run(tmp_path / "a", tmp_path / "b")


DPO_ARGS = ["--device", "cpu", "--pairs", "synthetic", "--train-pairs", "32", "--eval-pairs", "16",
            "--batch-size", "16", "--device-batch-tokens", "2048", "--epochs", "2", "--lr-frac", "0.3", "--beta", "0.1",
            "--check-problems", "4", "--check-samples", "1", "--max-new-tokens", "8", "--eval-every", "2",
            "--sft-weight", "0.5", "--save-every", "1"]


def test_dpo_resume_is_bit_exact(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    ckpt = tmp_path / "sft"
    common.save_checkpoint(ckpt, 1, make_model(tokenizer), {"stage": "sft"}, tokenizer=tokenizer)
    argv = DPO_ARGS + ["--ckpt", str(ckpt)]
    dpo.main(argv + ["--out", str(tmp_path / "a")])
    run_killed_and_resumed(dpo.main, argv + ["--out", str(tmp_path / "b")], tmp_path / "b", 2, monkeypatch, common)
    assert "resuming from step 1" in capsys.readouterr().out
    assert_same_run(tmp_path / "a", tmp_path / "b")


RL_ARGS = ["--preset", "tiny", "--device", "cpu", "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "8",
           "--eval-problems", "4", "--eval-samples", "2", "--device-batch-tokens", "330", "--num-steps", "3",
           "--save-every", "1", "--eval-every", "2", "--epochs", "2", "--minibatches", "2"]


@pytest.mark.parametrize("flags", [[], ["--async"], ["--lora-rank", "2", "--lora-lr", "1e-2", "--kl-coef", "0.1"]],
                         ids=["sync", "async", "lora"])
def test_rl_resume_is_bit_exact(tokenizer, tmp_path, monkeypatch, capsys, flags):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    monkeypatch.setattr(rollout, "task_by_name", lambda name, split, size: LengthParity(split, size=64))
    ckpt = tmp_path / "dpo"
    common.save_checkpoint(ckpt, 0, make_model(tokenizer).eval(), {"stage": "dpo"}, tokenizer=tokenizer)
    argv = RL_ARGS + flags + ["--ckpt", str(ckpt)]
    rl.main(argv + ["--out", str(tmp_path / "a")])
    run_killed_and_resumed(rl.main, argv + ["--out", str(tmp_path / "b")], tmp_path / "b", 2, monkeypatch, rl)
    out = capsys.readouterr().out
    assert "resuming at step 1" in out
    if "--async" in flags:  # the resumed step 2 is sampled by the weights one update old, as in the uninterrupted run
        ages = [line.split("age ")[1].split()[0] for line in out.splitlines() if line.startswith("step ")]
        assert ages == ["0", "1", "1", "0", "1", "1"], ages
    assert_same_run(tmp_path / "a", tmp_path / "b")
    extra_a, extra_b = common.load_checkpoint(tmp_path / "a")[2], common.load_checkpoint(tmp_path / "b")[2]
    assert extra_a["tokens_sampled"] == extra_b["tokens_sampled"] > 0  # the rollout budget counts on across a resume
    assert extra_a["history"] == extra_b["history"]
    if "--lora-rank" in flags:  # the adapters are checkpointed too, and resumed exactly
        assert extra_a["lora"].keys() == extra_b["lora"].keys()
        assert all(torch.equal(extra_a["lora"][k], extra_b["lora"][k]) for k in extra_a["lora"])


DISTILL_ARGS = ["--preset", "tiny", "--device", "cpu", "--train-size", "64", "--prompts-per-step", "4",
                "--group-size", "2", "--max-tokens", "8", "--eval-problems", "4", "--eval-samples", "2",
                "--device-batch-tokens", "512", "--num-steps", "3", "--save-every", "1", "--eval-every", "2"]


@pytest.mark.parametrize("flags", [[], ["--full-vocab", "--lora-rank", "2"]], ids=["full-finetune", "lora"])
def test_distill_resume_is_bit_exact(tokenizer, tmp_path, monkeypatch, capsys, flags):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    common.save_checkpoint(tmp_path / "sft", 0, make_model(tokenizer).eval(), {"stage": "sft"}, tokenizer=tokenizer)
    common.save_checkpoint(tmp_path / "rl", 0, make_model(tokenizer, seed=1).eval(), {"stage": "rl"},
                           tokenizer=tokenizer)
    argv = DISTILL_ARGS + flags + ["--ckpt", str(tmp_path / "sft"), "--teacher", str(tmp_path / "rl")]
    distill.main(argv + ["--out", str(tmp_path / "a")])
    run_killed_and_resumed(distill.main, argv + ["--out", str(tmp_path / "b")], tmp_path / "b", 2, monkeypatch,
                           distill)
    assert "resuming at step 1" in capsys.readouterr().out
    assert_same_run(tmp_path / "a", tmp_path / "b")
    extra_a, extra_b = common.load_checkpoint(tmp_path / "a")[2], common.load_checkpoint(tmp_path / "b")[2]
    assert extra_a["tokens_sampled"] == extra_b["tokens_sampled"] > 0  # the rollout budget counts on across a resume
    assert extra_a["history"] == extra_b["history"]
    if "--lora-rank" in flags:  # the adapters are checkpointed too, and resumed exactly
        assert extra_a["lora"].keys() == extra_b["lora"].keys()
        assert all(torch.equal(extra_a["lora"][k], extra_b["lora"][k]) for k in extra_a["lora"])


def signalling_logger(at):
    """A Logger that sends this process SIGTERM when handed the metrics of step `at` (after its update)."""
    import os
    import signal

    class SignallingLogger(common.Logger):
        def log(self, metrics, step):
            if step == at:
                os.kill(os.getpid(), signal.SIGTERM)
            super().log(metrics, step)

    return SignallingLogger


@pytest.mark.parametrize("stage", ["dpo", "rl", "distill"])
def test_sigterm_mid_run_exits_75_with_a_checkpoint_the_resume_finishes_identically(tokenizer, tmp_path,
                                                                                     monkeypatch, stage,
                                                                                     stop_signals):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    common.save_checkpoint(tmp_path / "start", 0, make_model(tokenizer).eval(), {"stage": "sft"}, tokenizer=tokenizer)
    common.save_checkpoint(tmp_path / "teacher", 0, make_model(tokenizer, seed=1).eval(), {"stage": "rl"},
                           tokenizer=tokenizer)
    main, module, argv = {"dpo": (dpo.main, common, DPO_ARGS), "rl": (rl.main, rl, RL_ARGS),
                          "distill": (distill.main, distill, DISTILL_ARGS + ["--teacher", str(tmp_path / "teacher")])
                          }[stage]
    if stage == "rl":
        monkeypatch.setattr(rollout, "task_by_name", lambda name, split, size: LengthParity(split, size=64))
    at = argv.index("--save-every") if "--save-every" in argv else None
    argv = (argv if at is None else argv[:at] + argv[at + 2:]) + ["--ckpt", str(tmp_path / "start")]
    main(argv + ["--out", str(tmp_path / "a")])
    logger = module.Logger
    monkeypatch.setattr(module, "Logger", signalling_logger(2))
    with pytest.raises(SystemExit) as stop:
        main(argv + ["--out", str(tmp_path / "b")])
    assert stop.value.code == common.PREEMPTED_EXIT
    meta = common.load_checkpoint(tmp_path / "b")[1]
    assert meta["step"] == 2 and not meta["finished"]  # no --save-every: the stop signal's checkpoint
    monkeypatch.setattr(module, "Logger", logger)
    monkeypatch.setattr(common, "_stop_signal", None)
    main(argv + ["--out", str(tmp_path / "b"), "--resume"])
    assert_same_run(tmp_path / "a", tmp_path / "b")

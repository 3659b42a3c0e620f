"""
sft.py --rft-rounds (rejection-sampling fine-tuning): the filter (verified answers only, at most m per problem) and
end-to-end rounds on a tiny real model whose samples a toy verifier accepts about half the time, and the figure of
those rounds in the report card.
"""

import importlib.util

import pytest
import torch

import common
import report
import sft
import tasks
from conftest import EvenLength, ends_turn_sometimes, make_model, make_tokenizer, sigterm_on_call, torchrun_stage


def test_rft_keep_takes_verified_answers_at_most_m_per_prompt():
    a, b = [1, 2, 3], [1, 2, 4]  # two prompts (token ids), answers after them
    examples = [((a + [10], [0, 0, 0, 1]), True), ((a + [11], [0, 0, 0, 1]), False), ((a + [12], [0, 0, 0, 1]), True),
                ((a + [13, 14], [0, 0, 0, 1, 1]), True), ((b + [10], [0, 0, 0, 1]), False),
                ((b + [15], [0, 0, 0, 1]), True)]
    assert sft.rft_keep(examples, 2) == [(a + [10], [0, 0, 0, 1]), (a + [12], [0, 0, 0, 1]),
                                         (b + [15], [0, 0, 0, 1])]
    assert len(sft.rft_keep(examples, 1)) == 2 and len(sft.rft_keep(examples, 5)) == 4


class EvenLengthTask(EvenLength):
    """
    The suite's toy task (an even-length answer passes: about half a random model's). leak > 0 makes the held-out
    split's first `leak` problems copies of training problems: what decontamination must drop.
    """

    def __init__(self, split, size, leak=0):
        super().__init__(split, size=size)
        if split == "test" and leak:
            train = tasks.SyntheticTask("train", size=leak)
            self.task = [train[i] for i in range(leak)] + [self.task[i] for i in range(leak, size)]


def test_rft_rounds_sample_filter_and_train(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    tokenizer = make_tokenizer()
    model = ends_turn_sometimes(make_model(tokenizer), tokenizer)
    common.save_checkpoint(tmp_path / "checkpoints" / "sft", 1, model, {"stage": "sft"}, tokenizer=tokenizer)
    monkeypatch.setattr(sft, "task_by_name", lambda name, split, size, seed: EvenLengthTask(split, size))
    sft.main(["--device", "cpu", "--rft-rounds", "2", "--rft-prompts", "24", "--rft-samples", "4", "--rft-keep", "2",
              "--batch-size", "8", "--device-batch-tokens", "1024", "--max-new-tokens", "8", "--check-problems", "8",
              "--rft-eval-samples", "4", "--replay-frac", "0"])
    out = capsys.readouterr().out
    assert "round 2/2" in out
    (record,) = common.read_report()
    assert record["stage"] == "rft" and len(record["rounds"]) == 2
    for r in record["rounds"]:
        assert 0 < r["prompts_kept"] <= 24 and r["prompts_kept"] <= r["answers_kept"] <= 2 * r["prompts_kept"]
        assert r["steps"] == r["answers_kept"] // 8 > 0 and r["train_loss"] > 0
        assert r["sampled_tokens"] > 0 and set(r) >= {"pass@1", "pass@4", "truncated"}
        assert r["sampling"]["desirable"] >= r["answers_kept"]  # the kept ones are among the verified ones
    # Round 2 sampled from the weights round 1 trained: the rounds differ, and the saved model is not the start.
    assert record["rounds"][0]["sampling"] != record["rounds"][1]["sampling"]
    state, meta, _ = common.load_checkpoint(tmp_path / "checkpoints" / "rft")
    assert meta["stage"] == "rft" and meta["finished"]
    assert not torch.equal(state["lm_head.weight"], model.state_dict()["lm_head.weight"])
    # Its figure: held-out coverage before (round 0) and after each round, kept answers and loss of each round.
    if importlib.util.find_spec("matplotlib"):
        fig = report.stage_figure("rft", record)
        assert {line.get_gid(): list(line.get_xdata()) for ax in fig.axes for line in ax.get_lines()} == {
            "eval/pass@1": [0, 1, 2], "eval/pass@k": [0, 1, 2], "rft/answers_kept": [1, 2], "rft/prompts_kept": [1, 2],
            "train/loss": [1, 2]}
        assert fig.axes[0].get_xlabel().startswith("round")


RFT_ARGS = ["--rft-rounds", "2", "--rft-prompts", "24", "--rft-samples", "4", "--rft-keep", "2", "--batch-size", "8",
            "--device-batch-tokens", "1024", "--max-new-tokens", "8", "--check-problems", "8",
            "--rft-eval-samples", "4", "--replay-frac", "0"]


def test_rft_rounds_never_sample_a_held_out_problem(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    tokenizer = make_tokenizer()
    common.save_checkpoint(tmp_path / "checkpoints" / "sft", 1, ends_turn_sometimes(make_model(tokenizer), tokenizer),
                           {"stage": "sft"}, tokenizer=tokenizer)
    monkeypatch.setattr(sft, "task_by_name", lambda name, split, size, seed: EvenLengthTask(split, size, leak=5))
    sft.main(["--device", "cpu", "--decontaminate"] + RFT_ARGS)
    (record,) = common.read_report()
    for r in record["rounds"]:  # the 5 training problems copied into the held-out split are dropped every round
        assert r["sampling"]["contaminated"] == 5 and r["prompts_kept"] <= 24 - 5


@pytest.mark.slow
def test_torchrun_two_ranks_end_with_identical_weights(tmp_path):
    tokenizer = make_tokenizer()
    ckpt = tmp_path / "home" / "checkpoints" / "sft"
    initial = ends_turn_sometimes(make_model(tokenizer), tokenizer)
    common.save_checkpoint(ckpt, 1, initial, {"stage": "sft"}, tokenizer=tokenizer)
    setup = ("import test_sft_rft\n"
             "sft.task_by_name = lambda name, split, size, seed: test_sft_rft.EvenLengthTask(split, size)")
    result, digests = torchrun_stage(tmp_path, "sft", ["--preset", "tiny"] + RFT_ARGS, setup)
    assert "round 2/2" in result.stdout and digests[0] == digests[1]
    final, meta, _ = common.load_checkpoint(tmp_path / "home" / "checkpoints" / "rft")
    assert meta["stage"] == "rft" and meta["finished"]
    assert not torch.equal(final["lm_head.weight"], initial.state_dict()["lm_head.weight"])


def test_sigterm_mid_rounds_saves_the_rounds_done_exits_75_and_resumes(tmp_path, monkeypatch, capsys, stop_signals):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    tokenizer = make_tokenizer()
    common.save_checkpoint(tmp_path / "checkpoints" / "sft", 1, ends_turn_sometimes(make_model(tokenizer), tokenizer),
                           {"stage": "sft"}, tokenizer=tokenizer)
    monkeypatch.setattr(sft, "task_by_name", lambda name, split, size, seed: EvenLengthTask(split, size))
    argv = ["--device", "cpu", "--check-problems", "4", *RFT_ARGS[:1], "3", *RFT_ARGS[2:]]
    sft.main(argv + ["--out", str(tmp_path / "a")])

    real_keep, calls = sigterm_on_call(monkeypatch, sft, "rft_keep", 2)  # SIGTERM arrives in the middle of round 2
    with pytest.raises(SystemExit) as stop:
        sft.main(argv + ["--out", str(tmp_path / "b")])
    assert stop.value.code == common.PREEMPTED_EXIT and len(calls) == 2  # round 3 never started
    _, meta, extra = common.load_checkpoint(tmp_path / "b")
    assert meta["step"] == 2 and not meta["finished"] and len(extra["history"]) == 2

    monkeypatch.setattr(sft, "rft_keep", real_keep)
    monkeypatch.setattr(common, "_stop_signal", None)
    capsys.readouterr()
    sft.main(argv + ["--out", str(tmp_path / "b"), "--resume"])
    assert "resuming after round 2" in capsys.readouterr().out and len(calls) == 2
    a, b = (common.load_checkpoint(tmp_path / name) for name in ("a", "b"))
    assert b[1]["finished"] and b[1]["step"] == 3
    assert all(torch.equal(a[0][name], b[0][name]) for name in a[0])  # the same as the run never stopped
    first, resumed = (record["rounds"] for record in common.read_report()[-2:] if record["stage"] == "rft")
    assert resumed == first

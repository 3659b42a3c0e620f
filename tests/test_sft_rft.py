"""
sft.py --rft-rounds (rejection-sampling fine-tuning): the filter (verified answers only, at most m per problem) and
end-to-end rounds on a tiny real model whose samples a toy verifier accepts about half the time.
"""

import pytest
import torch

import common
import sft
import tasks
from conftest import ends_turn_sometimes, make_model, make_tokenizer


def test_rft_keep_takes_verified_answers_at_most_m_per_prompt():
    a, b = [1, 2, 3], [1, 2, 4]  # two prompts (token ids), answers after them
    examples = [((a + [10], [0, 0, 0, 1]), True), ((a + [11], [0, 0, 0, 1]), False), ((a + [12], [0, 0, 0, 1]), True),
                ((a + [13, 14], [0, 0, 0, 1, 1]), True), ((b + [10], [0, 0, 0, 1]), False),
                ((b + [15], [0, 0, 0, 1]), True)]
    assert sft.rft_keep(examples, 2) == [(a + [10], [0, 0, 0, 1]), (a + [12], [0, 0, 0, 1]),
                                         (b + [15], [0, 0, 0, 1])]
    assert len(sft.rft_keep(examples, 1)) == 2 and len(sft.rft_keep(examples, 5)) == 4


class EvenLengthTask:
    """Synthetic problems whose toy verifier accepts an answer of even length (a random model: about half)."""

    def __init__(self, split, size):
        self.task = tasks.SyntheticTask(split, size=size)

    def __len__(self):
        return len(self.task)

    def __getitem__(self, i):
        return self.task[i]

    def reward(self, conversation, completion):
        return float(len(completion) % 2 == 0)


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

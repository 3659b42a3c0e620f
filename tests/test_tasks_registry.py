"""
One task registry, tasks.TASKS: a task registered there (conftest's even-length, one entry) is a name every stage
reads with no other edit: sft.py --rft-task trains on it, rl.py --task trains on it (alone or in a mixture), eval.py
--tasks evaluates it.
"""

import pytest

import common
import eval as ev
import rl
import rollout
import sft
import tasks
from conftest import ends_turn_sometimes, make_model, make_tokenizer


def test_every_registered_name_is_read_through_the_registry(even_length_task):
    assert len(tasks.task_by_name(even_length_task, "test", 8)) == 8
    assert even_length_task in tasks.registered_tasks("generative")
    assert rollout.parse_task_mixture(f"synthetic:1,{even_length_task}:2") == [("synthetic", 1.0),
                                                                               (even_length_task, 2.0)]
    assert rl.parse_args(["--task", even_length_task]).task == even_length_task
    with pytest.raises(ValueError, match="tasks.TASKS"):
        tasks.task_by_name("no-such-task", "test")
    with pytest.raises(ValueError, match="not a task RL can train on"):  # registered, but no verifier of answers
        rollout.parse_task_mixture("arc-easy")


def test_unregistered_name_is_refused_by_the_stages(capsys):
    with pytest.raises(SystemExit):
        sft.main(["--rft-rounds", "1", "--rft-task", "even-length"])
    assert "invalid choice: 'even-length'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a task RL can train on"):
        rl.parse_args(["--task", "even-length"])


def test_a_new_task_trains_with_sft_and_rl_and_is_evaluated(even_length_task, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    tokenizer = make_tokenizer()
    common.save_checkpoint(common.checkpoint_dir("sft"), 1, ends_turn_sometimes(make_model(tokenizer), tokenizer),
                           {"stage": "sft"}, tokenizer=tokenizer)
    sft.main(["--device", "cpu", "--rft-rounds", "1", "--rft-task", even_length_task, "--rft-prompts", "16",
              "--rft-samples", "4", "--rft-keep", "2", "--batch-size", "8", "--device-batch-tokens", "1024",
              "--max-new-tokens", "8", "--check-problems", "8", "--rft-eval-samples", "2", "--replay-frac", "0"])
    rl.main(["--preset", "tiny", "--device", "cpu", "--task", even_length_task, "--ckpt", str(common.checkpoint_dir(
        "rft")), "--num-steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "8",
        "--eval-problems", "8", "--eval-samples", "2", "--device-batch-tokens", "200"])
    ev.main(["--stage", "rl", "--tasks", even_length_task, "--num-samples", "2", "--max-problems", "8",
             "--max-tokens", "8", "--device", "cpu"])
    rft, rl_record, eval_record = common.read_report()
    assert rft["stage"] == "rft" and rft["rounds"][0]["answers_kept"] > 0
    assert rl_record["stage"] == "rl" and rl_record["task"] == even_length_task and rl_record["steps"] == 2
    assert eval_record["of"] == "rl" and f"{even_length_task}/pass@1" in eval_record["metrics"]
    assert len(eval_record["coverage"][even_length_task]["correct"]) == 8

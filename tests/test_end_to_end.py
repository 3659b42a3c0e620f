"""
End-to-end runs that assert outcomes, not that something printed: RL with a KL penalty logs KL = 0 and no clipping
at step 1 (policy = reference) and KL > 0 once the policy has moved; SFT's generation check on a model that always
answers '#### 5' gives stop and format rates of exactly 1 and the pass@1 known from the answers; the chat CLI's
--prompt reply is the decoded greedy completion.
"""

import sys

import pytest
import torch

import common
import engine
import eval as ev
import rl
import rollout
import tasks
from conftest import make_model, make_tokenizer, scripted_model
from test_rl import LengthParity
from test_rollout_tool_tokens import tool_model  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def test_rl_kl_is_zero_at_step_1_and_positive_after(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    monkeypatch.setattr(rollout, "task_by_name", lambda name, split, size: LengthParity(split, size=64))
    logged = {}

    class Recorder(common.Logger):
        def log(self, metrics, step):
            logged.setdefault(step, {}).update(metrics)

    monkeypatch.setattr(rl, "Logger", Recorder)
    ckpt = tmp_path / "dpo"
    common.save_checkpoint(ckpt, 0, make_model(tokenizer).eval(), {"stage": "dpo"}, tokenizer=tokenizer)
    rl.main(["--preset", "tiny", "--device", "cpu", "--ckpt", str(ckpt), "--out", str(tmp_path / "rl"),
             "--num-steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "8",
             "--eval-problems", "2", "--eval-samples", "2", "--eval-every", "2", "--kl-coef", "0.1",
             "--kl-kind", "k2", "--lr-frac", "1.0"])
    first, second = logged[1], logged[2]
    assert first["batch/groups_kept"] > 0
    assert first["policy/kl"] == 0.0  # the reference is the starting policy
    assert first["policy/clip_low"] == first["policy/clip_high"] == 0.0
    assert first["policy/ratio_min"] == first["policy/ratio_max"] == 1.0  # on-policy: one epoch, one minibatch
    assert first["mismatch/logp_gap_max"] < 1e-4
    assert second["policy/kl"] > 1e-6  # the policy moved; the reference did not


class AnswersAlternate:
    """SyntheticTask test problems whose reference answer is 5 for even i and 6 for odd i."""

    def __init__(self, split, size, seed):
        self.task = tasks.SyntheticTask(split, size=size, seed=seed)

    def __len__(self):
        return len(self.task)

    def __getitem__(self, i):
        return {**self.task[i], "answer": "5" if i % 2 == 0 else "6"}

    def reward(self, conversation, completion):
        return tasks.exact_match_reward(completion, conversation["answer"])


def test_held_out_check_on_a_model_that_always_answers_5(tokenizer, monkeypatch):
    t = tokenizer.token_id
    hashes, space, five = tokenizer.encode("#### 5")
    script = [t("<|assistant_start|>"), hashes, space, five, t("<|assistant_end|>")]
    model = scripted_model(tokenizer, dict(zip(script, script[1:])), scale=3.0)  # p(script) > 0.999 per token
    monkeypatch.setattr(ev, "task_by_name", lambda name, split, size, seed: AnswersAlternate(split, size, seed))
    metrics = ev.held_out_check(model, tokenizer, "synthetic", 8, 4, 8, 0)
    assert metrics["stop_rate"] == metrics["format_rate"] == 1.0
    assert metrics["pass@1"] == 0.5  # greedy: right on the 4 problems whose answer is 5
    assert metrics["pass@1_t1"] == pytest.approx(0.5, abs=0.05)
    assert metrics["verifier_errors"] == 0


def test_chat_cli_prompt_prints_the_greedy_completion(tokenizer, tool_model, tmp_path, monkeypatch,  # noqa: F811
                                                     capsys):
    common.save_checkpoint(tmp_path, 1, tool_model, {"stage": "sft"}, tokenizer=tokenizer)
    monkeypatch.setattr(sys, "argv", ["engine.py", "--ckpt", str(tmp_path), "--prompt", "What is 2+3?",
                                      "--temperature", "0", "--device", "cpu", "--max-tokens", "32"])
    engine.main()
    printed = capsys.readouterr().out

    loaded, _, _ = engine.load_model(tmp_path, "cpu")
    chat = engine.Engine(loaded, tokenizer)
    prompt = tokenizer.render_for_completion({"messages": [{"role": "user", "content": "What is 2+3?"}]})
    ((completion,),) = chat.generate([prompt], max_tokens=32, temperature=0.0)
    expected = tokenizer.decode([tok for tok in completion.tokens if tok not in chat.stop_ids])
    assert expected == "<|python_start|>2+3<|python_end|><|output_start|>5<|output_end|>#### 5"
    # The CLI shows the calculator call as what it is (engine.readable_reply), not as raw special tokens.
    assert printed == engine.readable_reply(tokenizer, completion.tokens) + "\n" == "[calculator: 2+3 → 5]#### 5\n"
    assert torch.equal(loaded.lm_head.weight, tool_model.lm_head.weight)

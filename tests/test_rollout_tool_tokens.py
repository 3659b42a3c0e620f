"""
Forced tool tokens under sampling, through the RL data path: a model that makes a calculator call at temperature 1,
Engine.generate -> rollout.learner_rows -> rollout.collate_rollouts -> rollout.token_logprobs. The forced
<|output_start|> ... <|output_end|> span is never a target; every sampled token is, once; and the engine's
behavior log-probs equal the learner's on every trained position, the token right after <|output_end|> included
(the one a stale-logits bug after forcing would get wrong).
"""

import pytest
import torch

import rollout
from conftest import grpo_advantages, make_tokenizer, scripted_model
from engine import Engine
from tasks import SyntheticTask

SAMPLING = dict(temperature=1.0, top_k=None, top_p=None)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def tool_model(tokenizer):
    """
    Scripted (conftest.scripted_model): <|assistant_start|> <|python_start|> 2 + 3 <|python_end|>, then the engine
    forces <|output_start|> 5 <|output_end|>, then '#### 5' <|assistant_end|>. At scale 2 each scripted token has
    probability ~0.997 at temperature 1, so most samples make the call and a few wander off. Small random
    perturbations of every output projection and of lm_head make the log-probs depend on the whole context through
    attention: the engine's cached decode and the learner's full forward must really agree.
    """
    t = tokenizer.token_id
    two, plus, three = tokenizer.encode("2+3")
    hashes, space, five = tokenizer.encode("#### 5")
    script = [t("<|assistant_start|>"), t("<|python_start|>"), two, plus, three, t("<|python_end|>")]
    script_after = [t("<|output_end|>"), hashes, space, five, t("<|assistant_end|>")]
    transitions = dict(zip(script, script[1:])) | dict(zip(script_after, script_after[1:]))
    model = scripted_model(tokenizer, transitions, scale=2.0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight") or name == "lm_head.weight":
                p.add_(0.02 * torch.randn(p.shape, generator=generator))
    return model


def test_forced_tool_output_is_never_trained_and_logprobs_match(tokenizer, tool_model):
    t = tokenizer.token_id
    output_start, output_end = t("<|output_start|>"), t("<|output_end|>")
    task = SyntheticTask("train", size=2)
    prompts = [tokenizer.render_for_completion(task[i]) for i in range(2)]
    results = Engine(tool_model, tokenizer).generate(prompts, num_samples=8, max_tokens=16, seed=0, **SAMPLING)
    completions = [c for r in results for c in r]
    forced_span = [output_start, *tokenizer.encode("5"), output_end]
    calls = [c for c in completions if c.tokens[5:8] == forced_span]
    called = {id(c) for c in calls}
    assert len(calls) >= 12 and any(c.finish == "stop" for c in calls)  # the calculator was called and answered
    assert all(c.mask[5:8] == [0, 0, 0] and c.mask[8] == 1 for c in calls)

    groups = [{"prompt": p, "completions": r, "rewards": [float(j % 2) for j in range(8)]}
              for p, r in zip(prompts, results)]
    rows = rollout.learner_rows(groups, grpo_advantages(groups, 8), mask_truncated=False)
    batch = rollout.collate_rollouts(rows, pad_id=0, device="cpu")
    targets, mask = batch["targets"], batch["mask"]
    assert mask.sum() == sum(sum(c.mask) for c in completions)  # every sampled token, once; nothing else

    # Position t predicts ids[t + 1]: the expected target row is -1 on the prompt and on forced tokens.
    for b, (prompt, completion) in enumerate((p, c) for p, r in zip(prompts, results) for c in r):
        expected = [-1] * (len(prompt) - 1) + [tok if m else -1 for tok, m in zip(completion.tokens, completion.mask)]
        assert targets[b, :len(expected)].tolist() == expected
        assert (targets[b, len(expected):] == -1).all()  # padding
        if id(completion) in called:
            start = len(prompt) - 1 + 5  # the position that predicts <|output_start|>
            assert targets[b, start:start + 3].tolist() == [-1, -1, -1]  # exactly the forced span ...
            assert targets[b, start - 1] == t("<|python_end|>") and targets[b, start + 3] >= 0  # ... and no more

    with torch.no_grad():
        logp, _ = rollout.token_logprobs(tool_model, batch["inputs"], targets, SAMPLING)
    gap = (logp - batch["behavior"]).abs() * mask
    assert gap.max() < 1e-4
    # The token right after <|output_end|>: trained, and its engine log-prob is the learner's.
    for b, (prompt, completion) in enumerate((p, c) for p, r in zip(prompts, results) for c in r):
        if id(completion) in called:
            after = len(prompt) - 1 + 8
            assert mask[b, after] == 1 and batch["behavior"][b, after] < 0
            assert abs(logp[b, after] - batch["behavior"][b, after]) < 1e-4

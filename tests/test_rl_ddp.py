"""
DDP equals one process, for the RL learner: two torchrun ranks holding an uneven split of fixed rollout groups
(3 groups on rank 0, 1 on rank 1) compute the same optimizer-step gradient as one process holding all 4, and the
ranks draw different prompts. (Pretraining's 1-vs-2-process check, weights and val bpb, is in test_pretrain.py.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rl
import rl_systems
from common import save_checkpoint
from conftest import free_port, make_model, make_tokenizer
from engine import Completion, Engine
from tasks import SyntheticTask

REPO = Path(__file__).resolve().parents[1]
SPLIT = {0: slice(0, 3), 1: slice(3, 4)}  # rank -> its groups: uneven on purpose (tokens and micro-batches differ)
FLAGS = ["--preset", "tiny", "--device", "cpu", "--num-steps", "1", "--prompts-per-step", "4", "--group-size", "4",
         "--max-tokens", "8", "--train-size", "64", "--eval-problems", "2", "--eval-samples", "2",
         "--device-batch-tokens", "330", "--max-sampling-rounds", "1"]


def write_groups(path, tokenizer, model):
    """4 fixed groups of 4 engine completions with contrasting rewards, as JSON (the ranks rebuild them)."""
    task = SyntheticTask("train", size=4)
    prompts = [tokenizer.render_for_completion(task[i]) for i in range(4)]
    results = Engine(model, tokenizer).generate(prompts, num_samples=4, max_tokens=8, seed=0)
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.5, 1.0]]
    groups = [{"prompt": p, "source": "synthetic", "rewards": r, "completions": [vars(c) for c in cs]}
              for p, r, cs in zip(prompts, rewards, results)]
    path.write_text(json.dumps(groups))


def install(groups_path, which, record):
    """
    Patch rl for a run on fixed groups: sample_groups still draws (and records) this rank's prompts with the seed
    main passes, then returns the fixed groups `which` instead; the gradient of each optimizer step (after the
    all-reduce, before clipping) is recorded.
    """
    groups = json.loads(Path(groups_path).read_text())[which]
    for group in groups:
        group["completions"] = [Completion(**c) for c in group["completions"]]
    real_sample_groups, real_clip = rl_systems.sample_groups, torch.nn.utils.clip_grad_norm_

    def sample_groups(engine, task, num_groups, group_size, max_tokens, sampling, seed, **kwargs):
        drawn, stats = real_sample_groups(engine, task, num_groups, group_size, max_tokens, sampling, seed,
                                          filter_zero_contrast=False, max_rounds=1, rank=kwargs.get("rank", 0),
                                          world_size=kwargs.get("world_size", 1))
        record["prompts"] = [g["prompt"] for g in drawn]
        return groups, stats

    def clip_grad_norm_(parameters, max_norm):
        parameters = list(parameters)
        record.setdefault("grads", []).append(torch.cat([p.grad.flatten() for p in parameters]).clone())
        return real_clip(parameters, max_norm)

    rl_systems.sample_groups = sample_groups  # what rl_systems.Rollouts calls
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    return real_sample_groups, real_clip


DRIVER = """
import os, sys
sys.path[:0] = [{repo!r}, {tests!r}]
import torch
import rl, test_rl_ddp as t
rank = int(os.environ["RANK"])
record = {{}}
t.install({groups!r}, t.SPLIT[rank], record)
rl.main(sys.argv[1:])
torch.save(record, os.path.join({out!r}, f"rank{{rank}}.pt"))
"""


@pytest.mark.slow
def test_rl_two_uneven_ranks_equal_one_process(tmp_path, monkeypatch):
    tokenizer = make_tokenizer()
    model = make_model(tokenizer).eval()
    checkpoint = tmp_path / "dpo"
    save_checkpoint(checkpoint, 0, model, {"stage": "dpo"}, tokenizer=tokenizer)
    groups = tmp_path / "groups.json"
    write_groups(groups, tokenizer, model)

    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO), tests=str(REPO / "tests"), groups=str(groups), out=str(tmp_path)))
    env = {**os.environ, "NANOPOST_HOME": str(tmp_path / "home-ddp"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
               str(driver), *FLAGS, "--ckpt", str(checkpoint), "--out", str(tmp_path / "rl-ddp")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]

    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "home-single"))
    single = {}
    real = install(groups, slice(0, 4), single)
    try:
        rl.main(FLAGS + ["--ckpt", str(checkpoint), "--out", str(tmp_path / "rl-single")])
    finally:
        rl_systems.sample_groups, torch.nn.utils.clip_grad_norm_ = real

    assert len(ranks[0]["prompts"]) == len(ranks[1]["prompts"]) == 2
    assert not set(map(tuple, ranks[0]["prompts"])) & set(map(tuple, ranks[1]["prompts"]))  # each rank its own
    (grad_0,), (grad_1,), (expected,) = ranks[0]["grads"], ranks[1]["grads"], single["grads"]
    assert torch.equal(grad_0, grad_1)  # the all-reduce leaves every rank with the same gradient
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(grad_0, expected, rtol=1e-4, atol=1e-7)

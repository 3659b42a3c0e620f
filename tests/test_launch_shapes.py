"""
The launch shapes users have besides the speedrun's chain, on the rehearsal's checkpoints (conftest.rehearsal) with
its sizes (NANOPOST_REHEARSAL=1), each under torchrun with 2 gloo ranks: the RLHF path (rm.py, then rl.py and ppo.py
--reward rm), ppo.py, --async, --ptgs, --difficulty-filter, a task mixture, --eval-every 0; merge.py on two rehearsal
checkpoints and serve.py on the result; the README's 2-node line on localhost (two torchrun agents, c10d rendezvous)
for pretraining, SFT, RL and evaluation; pretraining at world size 4 with fewer validation row groups than ranks.

A launch passes when it exits 0 with every logged loss finite; the ranks' weights are compared by the stage itself
(common.check_ranks_agree, at its final checkpoint).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 600  # seconds per launch: a hang is a failure (a guard, not a budget: see conftest)

# The RL launch lines, one table: script and its flags.
RL_LAUNCHES = {
    # Every group kept on both ranks (no dynamic sampling), and the default, where a rank may keep no group in a step.
    "ppo-every-group": ["ppo.py", "--no-filter-zero-contrast"],
    "ppo": ["ppo.py"],
    "async": ["rl.py", "--async"],
    "ptgs": ["rl.py", "--ptgs"],
    "mixture": ["rl.py", "--task", "gsm8k:1,synthetic:1"],
}


@pytest.fixture(scope="module")
def chain(rehearsal, tmp_path_factory):
    """(checkpoints of the rehearsal's full preset, env for a launch: its sizes, its data, a home of our own)."""
    folder, result = rehearsal
    if result.returncode != 0:
        pytest.fail("the rehearsal failed (test_speedrun_rehearsal.py shows why); its checkpoints are needed here")
    home = tmp_path_factory.mktemp("launch-home")
    shutil.copytree(folder / "full" / "tokenizer", home / "tokenizer")
    env = {**os.environ, "NANOPOST_HOME": str(home), "NANOPOST_DATA_DIR": str(folder / "data"),
           "NANOPOST_REHEARSAL": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return folder / "full" / "checkpoints", env


def torchrun(env, *args, nproc=2):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master-port", str(free_port()), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT)


def assert_healthy(result):
    """Exit 0, and no logged loss that is NaN or inf (stages print 'loss <value>')."""
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    bad = re.findall(r"loss [+-]?(?:nan|inf)", output, flags=re.IGNORECASE)
    assert not bad, f"non-finite losses logged: {bad}"


def rl_flags(ckpts, out):
    return ["--preset", "full", "--wandb-run", "dummy", "--ckpt", str(ckpts / "dpo"), "--out", str(out)]


@pytest.mark.parametrize("name", RL_LAUNCHES)
def test_rl_launch_shape(chain, tmp_path, name):
    ckpts, env = chain
    script, *flags = RL_LAUNCHES[name]
    assert_healthy(torchrun(env, script, *rl_flags(ckpts, tmp_path / "out"), *flags))


def test_rlhf_path_reward_model_then_rl_and_ppo_from_it(chain, tmp_path):
    """rm.py under DDP (the reward model's unused lm_head once stopped it at step 2), then GRPO and PPO from its
    scores. The scores are what give PPO's critic and policy non-zero gradients here (the rehearsal's model solves
    nothing, so verifier rewards are all 0): its end-of-stage check then sees a rank that skips the critic's gradient
    all-reduce."""
    ckpts, env = chain
    result = torchrun(env, "rm.py", "--preset", "full", "--ckpt", str(ckpts / "sft"), "--out", str(tmp_path / "rm"))
    assert_healthy(result)
    assert "step    4/4" in result.stdout  # 32 pairs, 8 a step: several steps, 2 micro-batches each per rank
    for script in ("rl.py", "ppo.py"):
        result = torchrun(env, script, "--preset", "full", "--wandb-run", "dummy", "--ckpt", str(ckpts / "sft"),
                          "--out", str(tmp_path / script), "--reward", "rm", "--rm-ckpt", str(tmp_path / "rm"),
                          "--task", "ultrafeedback")
        assert_healthy(result)
        assert "reward-model score" in result.stdout


def test_difficulty_filter_samples_on_both_ranks_and_refuses_an_empty_band(chain, tmp_path):
    """The rehearsal's model solves nothing, so no prompt is strictly inside (0, 1): both ranks sample their share of
    the prompts, agree on the count, and stop with one line each (the keep rule itself: tests/test_rollout.py)."""
    ckpts, env = chain
    result = torchrun(env, "rl.py", *rl_flags(ckpts, tmp_path / "out"), "--difficulty-filter", "0", "1",
                      "--difficulty-samples", "2")
    assert result.returncode != 0
    assert "difficulty filter: 32/32 on rank 0" in result.stdout
    refusal = "rl.py: error: the difficulty filter kept 0 prompts, fewer than --prompts-per-step 4"
    assert result.stderr.count(refusal) == 2


def test_rl_eval_every_zero_means_never_or_is_refused(chain, tmp_path):
    ckpts, env = chain
    result = subprocess.run([sys.executable, "rl.py", *rl_flags(ckpts, tmp_path / "out"), "--eval-every", "0"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    refused = result.returncode == 1 and "--eval-every" in result.stderr and "Traceback" not in result.stderr
    assert result.returncode == 0 or refused, result.stderr[-3000:]


PTGS_DRIVER = """
import json, os, sys
sys.path.insert(0, {repo!r})
import rl
import rl_systems
controllers = []


class Recorded(rl_systems.TemperatureController):  # each rank's controller, to compare with what the checkpoint keeps
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        controllers.append(self)


rl_systems.TemperatureController = Recorded
rl.main(sys.argv[1:])
with open(os.path.join({out!r}, "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(controllers[-1].state_dict(), f)
"""


def test_ptgs_checkpoint_restores_each_ranks_controller(chain, tmp_path):
    """What a resume gives rank r (the saved state, or its entry when saved per rank) is what rank r had."""
    ckpts, env = chain
    driver = tmp_path / "driver.py"
    driver.write_text(PTGS_DRIVER.format(repo=str(REPO), out=str(tmp_path)))
    assert_healthy(torchrun(env, str(driver), *rl_flags(ckpts, tmp_path / "out"), "--ptgs"))
    saved = torch.load(tmp_path / "out" / (tmp_path / "out" / "latest").read_text().strip() / "extra.pt",
                       weights_only=True)["ptgs"]
    for rank in (0, 1):
        restored = saved[rank] if isinstance(saved, list) else saved
        assert json.loads(json.dumps(restored)) == json.loads((tmp_path / f"rank{rank}.json").read_text()), rank


def test_merge_two_rehearsal_checkpoints_and_serve_the_result(chain, tmp_path):
    ckpts, env = chain
    result = subprocess.run([sys.executable, "merge.py", "--ckpts", str(ckpts / "sft"), str(ckpts / "dpo"), "--out",
                             str(tmp_path / "merge")], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=LAUNCH_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    server = subprocess.Popen([sys.executable, "serve.py", "--ckpt", str(tmp_path / "merge"), "--port", "0",
                               "--quiet"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        deadline = time.time() + 120
        while "http://" not in line and time.time() < deadline:
            line = server.stderr.readline()
        url = re.search(r"http://[\d.]+:\d+", line).group(0)
        body = json.dumps({"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["message"]["role"] == "assistant"
    finally:
        server.terminate()
        server.wait(timeout=60)


def readme_two_node_launcher():
    """The README's two-node torchrun line, up to its script: [torchrun, options...]."""
    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("torchrun --nnodes=2"))
    words = line.split()
    return words[:words.index("pretrain.py")]


def two_node_launch(env, *args):
    """The README's two-node line on this machine: two torchrun agents (node-rank 0 and 1), 1 process each instead
    of 8, meeting at a free local port instead of HOST:29500."""
    port = free_port()
    launcher = readme_two_node_launcher()
    assert "--nproc_per_node=8" in launcher and "--node-rank=0" in launcher and "--rdzv-endpoint=HOST:29500" in launcher
    agents = []
    for node in (0, 1):
        local = {"--nproc_per_node=8": "--nproc_per_node=1", "--node-rank=0": f"--node-rank={node}",
                 "--rdzv-endpoint=HOST:29500": f"--rdzv-endpoint=localhost:{port}"}
        options = [local.get(word, word) for word in launcher[1:]]
        agents.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *options, *args], cwd=REPO,
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [agent.communicate(timeout=LAUNCH_TIMEOUT)[0] for agent in agents]
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-4000:]
    return outputs


def test_two_nodes_pretrain_sft_rl_eval(chain, tmp_path):
    _, env = chain
    out = {stage: str(tmp_path / stage) for stage in ("base", "sft", "rl")}
    two_node_launch(env, "pretrain.py", "--preset", "small", "--out", out["base"])
    two_node_launch(env, "sft.py", "--preset", "small", "--ckpt", out["base"], "--out", out["sft"])
    two_node_launch(env, "rl.py", "--preset", "small", "--ckpt", out["sft"], "--out", out["rl"])
    outputs = two_node_launch(env, "eval.py", "--preset", "small", "--stage", "rl", "--ckpt", out["rl"], "--tasks",
                              "bpb,gsm8k,arc-easy")
    assert "on 2 x cpu" in outputs[0] + outputs[1]


def test_pretraining_at_world_size_4_with_3_validation_row_groups(chain, tmp_path):
    """Row groups of 4,000 documents: validation (the first 10,000) spans 3 of them, fewer than the 4 ranks; the
    7 row groups of 28,000 documents give every rank some training text (rank r reads row groups r, r + 4)."""
    _, env = chain
    fineweb = Path(env["NANOPOST_DATA_DIR"]) / "HuggingFaceFW/fineweb-edu/sample/10BT"
    texts = [t for f in sorted(fineweb.glob("*.parquet")) for t in pq.read_table(f)["text"].to_pylist()]
    texts = (texts * 3)[:28_000]
    data = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": texts}), data, row_group_size=4000)
    result = torchrun(env, "pretrain.py", "--preset", "small", "--data-files", str(data), "--out",
                      str(tmp_path / "base"), "--total-batch-size", "1024", nproc=4)
    assert_healthy(result)
    assert "4 processes" in result.stdout

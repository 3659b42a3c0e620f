"""
Shared fixtures of the suite. Where a test lives:
    test_<module>.py            the module of that name (test_rl.py: rl.py; test_gpu_check.py: bench/gpu_check.py)
    test_<module>_<concern>.py  one concern of it (test_rl_ddp.py, test_dpo_kto_orpo.py, test_sft_rft.py, ...)
    concerns that cross every stage, one file each: test_checkpoints.py (checksums, damaged checkpoints,
    preemption), test_resume.py (bit-exact resume of the chat stages), test_errors.py (bad input, exact messages),
    test_end_to_end.py (runs that assert outcomes), test_memory.py (what the memory model counts), test_layout.py
    (the import layering), test_gpu.py (only on CUDA), test_launch.py (every script's flags against torchrun's
    options, speedrun.sh's launch line, numeric flags refused up front), test_launch_shapes.py (each launch shape
    under torchrun from the rehearsal's checkpoints: RLHF, PPO, --async, --ptgs, 2 nodes, world size 4, merge,
    serve).
"""

import os
import resource
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

import tasks
from model import GPT, GPTConfig
from tokenizer import Tokenizer

# A compiled engine test that outgrew torch.compile's graph limit would decode eagerly and pass without testing the
# compiled step: fail it instead.
torch._dynamo.config.fail_on_recompile_limit_hit = True

# Two cores on CI: one intra-op thread per test process keeps timings predictable (torchrun tests start two).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """
    No test reaches the network: a connection to anything but this machine fails at once with a clear message
    (loopback stays open, for torchrun). Subprocesses are not covered; the tests that start one keep it offline.
    """
    real_connect = socket.socket.connect

    def connect(self, address):
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise OSError(f"a test tried to reach {address}: tests must run offline (use local files)")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


def free_port():
    """A TCP port free right now on localhost, for torchrun's --master-port: a fixed port collides with any other
    run (a parallel CI job, a leftover process) that holds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -----------------------------------------------------------------------------
# Shared tiny building blocks (added by the eval tests; import the plain functions with `from conftest import ...`)


def make_tokenizer():
    """A real BPE tokenizer (vocab 400) trained on 300 synthetic documents: the chat-stage tests' vocabulary."""
    return Tokenizer.train(tasks.synthetic_documents(300, seed=0), vocab_size=400)


def make_model(tokenizer, seed=0):
    """
    A 2-layer GQA GPT with PyTorch's default init (not init_weights, which zeroes the output projections): every
    block is non-trivial, so the tests see real attention.
    """
    torch.manual_seed(seed)
    config = GPTConfig(sequence_len=128, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    return GPT(config)


def scripted_model(tokenizer, transitions, scale=1.0, sequence_len=64):
    """
    A real GPT whose next token depends only on the current token: transitions {token: next_token}.
    init_weights zeroes the blocks' output projections, so every block is the identity and the final hidden state
    is norm(embedding) = sqrt(C) * e_slot = 8 e_slot for a token embedded as the basis vector e_slot (C = 64).
    lm_head row `next` gets `scale` on that slot: the scripted token's logit is 15 tanh(8 scale / 15) (~7.3 at
    scale 1, ~11.8 at scale 2) against 0 for every other token, whose slot-0 embedding gives all-zero logits.
    Greedy decoding follows the script exactly; sampling at temperature 1 follows it with probability
    e^logit / (e^logit + V - 1) per step.
    """
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=sequence_len, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_kv_head=2,
                          n_embd=64))
    model.init_weights()
    with torch.no_grad():
        model.wte.weight.zero_()
        model.wte.weight[:, 0] = 1.0
        model.lm_head.weight.zero_()
        for slot, (token, next_token) in enumerate(transitions.items(), start=1):
            model.wte.weight[token] = 0.0
            model.wte.weight[token, slot] = 1.0
            model.lm_head.weight[next_token, slot] = scale
    return model.eval()


def ends_turn_sometimes(model, tokenizer, weight=0.6):
    """
    A random model that ends its turn now and then (about half its answers stop within 8 tokens at weight 0.6): a
    constant feature in every embedding, read by the <|assistant_end|> row of the output layer. Only an answer that
    stops can be correct (tasks.completion_reward), and a random model almost never emits <|assistant_end|>.
    """
    with torch.no_grad():
        model.wte.weight[:, 0] = 10.0
        end = tokenizer.token_id("<|assistant_end|>")
        model.lm_head.weight[end] = 0.0
        model.lm_head.weight[end, 0] = weight
    return model


# -----------------------------------------------------------------------------
# The rehearsal (bash speedrun.sh --rehearse), run once per test session: test_speedrun_rehearsal.py checks it,
# test_launch_shapes.py starts from its checkpoints.

# Hang guards, not budgets: the rehearsal took 352 s of CPU time (at most about that on CI's 2 idle cores) and
# 19m49s on a 2-core machine shared with other jobs.
REHEARSAL_TIMEOUT = 2400  # seconds for the whole rehearsal
LAUNCH_TIMEOUT = 600  # seconds for each launch inside it (speedrun.sh's REHEARSAL_TIMEOUT)


@pytest.fixture(scope="session")
def rehearsal(tmp_path_factory):
    """(folder, finished process) of `bash speedrun.sh --rehearse` kept in a temporary folder: <folder>/small and
    <folder>/full are the presets' NANOPOST_HOMEs, <folder>/data the stand-in hub data. The process also carries
    `seconds` (wall time) and `cpu_seconds` (user + system time of every process it started)."""
    folder = tmp_path_factory.mktemp("rehearsal")
    env = {**os.environ, "REHEARSAL_DIR": str(folder), "REHEARSAL_TIMEOUT": str(LAUNCH_TIMEOUT)}
    env.pop("NANOPOST_HOME", None)
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    result = subprocess.run(["bash", str(Path(__file__).resolve().parents[1] / "speedrun.sh"), "--rehearse"], env=env,
                            capture_output=True, text=True, timeout=REHEARSAL_TIMEOUT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result.seconds = time.time() - t0
    result.cpu_seconds = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return folder, result


# -----------------------------------------------------------------------------
# A stage script under torchrun, 2 CPU ranks (gloo), as a user launches it

STAGE_DRIVER = """
import hashlib, os, sys
sys.path[:0] = [{repo!r}, {tests!r}]
import common, {module}
{setup}
models = []
real_load_model = {module}.load_model
{module}.load_model = lambda *a, **k: models.append(real_load_model(*a, **k)) or models[-1]  # keep this rank's model
common.run_cli({module}.main, preemptible=True)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in models[0][0].parameters())).hexdigest()
with open(os.path.join({out!r}, "rank" + os.environ["RANK"]), "w") as f:
    f.write(digest)
"""


def torchrun_stage(tmp_path, module, argv, setup=""):
    """
    Run `module`.py's command line `argv` under `torchrun --standalone --nproc_per_node=2` (2 CPU ranks, gloo),
    the way a user launches the stage; the driver runs the script's own entry point (common.run_cli(main)) after
    the Python lines `setup` (a test's stand-in task), and each rank writes a digest of its model's final weights.
    NANOPOST_HOME is tmp_path / "home". Returns (the CompletedProcess, [rank 0's digest, rank 1's digest]).
    """
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    driver = tmp_path / f"{module}_driver.py"
    driver.write_text(STAGE_DRIVER.format(repo=str(repo), tests=str(repo / "tests"), module=module, setup=setup,
                                          out=str(tmp_path)))
    env = {**os.environ, "NANOPOST_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(driver),
               *argv]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, [(tmp_path / f"rank{r}").read_text() for r in range(2)]

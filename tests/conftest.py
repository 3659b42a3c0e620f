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
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import common
import tasks
from model import GPT, GPTConfig
from tokenizer import Tokenizer

# A compiled engine test that outgrew torch.compile's graph limit would decode eagerly and pass without testing the
# compiled step: fail it instead.
torch._dynamo.config.fail_on_recompile_limit_hit = True

# Two cores on CI: one intra-op thread per test process keeps timings predictable (torchrun tests start two).
torch.set_num_threads(1)


# -----------------------------------------------------------------------------
# Process-wide state a test must leave as it found it. A leak (a patched torch.cuda.is_available, an env var, a
# signal handler) would otherwise change every later test: the test that leaked fails by name instead, and the state
# is put back so the next test starts clean.

GUARDED_SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM,
                   signal.SIGCHLD]
GUARDED_ENV_PREFIXES = ("NANOPOST_", "WANDB_", "HF_")
GUARDED_ENV = {"PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK", "WORLD_SIZE",
               "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "NANOCHAT_DIR"}
# name -> (owner, attribute): functions a test may patch, compared by identity.
GUARDED_ATTRIBUTES = {
    **{f"torch.cuda.{name}": (torch.cuda, name) for name in ("is_available", "set_device", "device_count",
                                                              "current_device", "synchronize")},
    **{f"torch.{name}": (torch, name) for name in ("save", "load", "compile")},
    **{f"torch.distributed.{name}": (torch.distributed, name) for name in dir(torch.distributed)
       if not name.startswith("_") and callable(getattr(torch.distributed, name))},
}
# name -> (read, restore): settings read through a getter and put back through a setter.
GUARDED_VALUES = {
    "torch.backends.cuda.matmul.allow_tf32": (lambda: torch.backends.cuda.matmul.allow_tf32,
                                              lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v)),
    "torch.backends.cudnn.allow_tf32": (lambda: torch.backends.cudnn.allow_tf32,
                                        lambda v: setattr(torch.backends.cudnn, "allow_tf32", v)),
    "torch.backends.cudnn.benchmark": (lambda: torch.backends.cudnn.benchmark,
                                       lambda v: setattr(torch.backends.cudnn, "benchmark", v)),
    "torch.backends.cudnn.deterministic": (lambda: torch.backends.cudnn.deterministic,
                                           lambda v: setattr(torch.backends.cudnn, "deterministic", v)),
    "torch.get_float32_matmul_precision()": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "torch.get_default_dtype()": (torch.get_default_dtype, torch.set_default_dtype),
    "torch.get_default_device()": (torch.get_default_device, torch.set_default_device),
    "torch.get_num_threads()": (torch.get_num_threads, torch.set_num_threads),
    "torch.are_deterministic_algorithms_enabled()": (torch.are_deterministic_algorithms_enabled,
                                                     torch.use_deterministic_algorithms),
    "os.getcwd()": (os.getcwd, os.chdir),
    **{f"signal handler {signal.Signals(number).name}": (lambda number=number: signal.getsignal(number),
                                                         lambda v, number=number: signal.signal(number, v))
       for number in GUARDED_SIGNALS},
}


def guarded_environment():
    return {key: value for key, value in os.environ.items()
            if key in GUARDED_ENV or key.startswith(GUARDED_ENV_PREFIXES)}


def global_state():
    """A snapshot of every piece of guarded state: {name: value}."""
    state = {name: getattr(owner, attr) for name, (owner, attr) in GUARDED_ATTRIBUTES.items()}
    state.update({name: read() for name, (read, _) in GUARDED_VALUES.items()})
    state["torch.distributed.is_initialized() (a process group left open)"] = torch.distributed.is_initialized()
    state["os.environ"] = guarded_environment()
    return state


def restore_global_state(before, after):
    """Put back what differs from `before`; returns the names that differed."""
    changed = [name for name in before if before[name] != after[name]]
    for name in changed:
        if name in GUARDED_ATTRIBUTES:
            owner, attr = GUARDED_ATTRIBUTES[name]
            setattr(owner, attr, before[name])
        elif name in GUARDED_VALUES:
            GUARDED_VALUES[name][1](before[name])
        elif name == "os.environ":
            for key in set(after[name]) - set(before[name]):
                del os.environ[key]
            os.environ.update(before[name])
        elif torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return changed


def describe_value(value):
    """A function by where it was defined (a test's lambda names the test), anything else by its repr."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return repr(value)


def describe_leak(name, before, after):
    if name != "os.environ":
        return f"{name} was {describe_value(before[name])}, left {describe_value(after[name])}"
    was, left = before[name], after[name]
    keys = sorted(key for key in set(was) | set(left) if was.get(key) != left.get(key))
    return "environment variables " + ", ".join(f"{key} was {was.get(key)!r}, left {left.get(key)!r}" for key in keys)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[STATE_BEFORE] = global_state()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the test's own fixtures are torn down (even if one of them raised), compare with the state before its
    setup; a test that left something behind fails with the list of what it left, and the state is restored."""
    try:
        return (yield)
    finally:
        before = item.stash.get(STATE_BEFORE, None)
        if before is not None:
            after = global_state()
            changed = restore_global_state(before, after)
            if changed:
                item.stash[LEAKED] = True
                raise AssertionError(f"{item.nodeid} left process-wide state changed (restored now): "
                                     + "; ".join(describe_leak(name, before, after) for name in changed))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "teardown" and item.stash.get(LEAKED, False):
        report.leaked_global_state = True
    return report


def pytest_report_teststatus(report, config):
    """A leak is the test's own failure, counted as `failed` (not as an error of the fixtures)."""
    if getattr(report, "leaked_global_state", False) and report.failed:
        return "failed", "F", "FAILED"


STATE_BEFORE = pytest.StashKey[dict]()
LEAKED = pytest.StashKey[bool]()


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


@pytest.fixture
def stop_signals(monkeypatch):
    """SIGTERM/SIGINT handled as run_cli(main, preemptible=True) handles them, for this test only."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(common, "_stop_signal", None)
    common.catch_preemption()
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def sigterm_on_call(monkeypatch, owner, name, at):
    """
    Replace owner.name by a wrapper whose `at`-th call first sends this process SIGTERM: a preemption in the middle
    of a run, at a point the test chooses. Returns (the real function, to put back before a resume; the list that
    counts the wrapper's calls).
    """
    real, calls = getattr(owner, name), []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, signalled)
    return real, calls


def free_port():
    """A TCP port free right now on localhost, for torchrun's --master-port: a fixed port collides with any other
    run (a parallel CI job, a leftover process) that holds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -----------------------------------------------------------------------------
# Shared tiny building blocks (added by the eval tests; import the plain functions with `from conftest import ...`)


def grpo_advantages(groups, group_size):
    """The group advantages rl.py gives the completions of `groups` (GRPO: mean baseline, std scaling), as a list."""
    import objectives
    import rollout
    rewards, valid = rollout.group_rewards(groups)
    return objectives.group_advantages(rewards, group_size, valid=valid).tolist()


class EvenLength:
    """
    The toy task of the tests: synthetic problems whose verifier accepts an answer of even length, so a random model
    earns and misses it about half the time. Registered as "even-length" in tasks.TASKS by the even_length_task
    fixture: the one line a new task needs.
    """

    def __init__(self, split, size=None, seed=0):
        self.task = tasks.SyntheticTask(split, size=size or 64, seed=seed)

    def __len__(self):
        return len(self.task)

    def __getitem__(self, i):
        return self.task[i]

    def reward(self, conversation, completion):
        return float(len(completion) % 2 == 0)


@pytest.fixture
def even_length_task(monkeypatch):
    """"even-length" (EvenLength) registered in tasks.TASKS for one test, removed after it."""
    monkeypatch.setitem(tasks.TASKS, "even-length", ("generative", lambda split, size, seed: EvenLength(split, size,
                                                                                                      seed)))
    return "even-length"


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


def tiny_preset_model(tokenizer):
    """
    The tiny preset's model (depth 4, PyTorch's default init: every block does something) with a constant feature
    read by <|assistant_end|> (ends_turn_sometimes): seed and weight are chosen so that greedy answers stop after a
    few tokens. In eval mode.
    """
    import pretrain

    preset = pretrain.PRESETS["tiny"]
    torch.manual_seed(1)
    model = GPT(GPTConfig.from_depth(preset["depth"], tokenizer.vocab_size, preset["max_seq_len"])).eval()
    return ends_turn_sometimes(model, tokenizer, weight=0.195)


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
    env = {**os.environ, "REHEARSAL_DIR": str(folder), "REHEARSAL_TIMEOUT": str(LAUNCH_TIMEOUT),
           "PYTHON": sys.executable}
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

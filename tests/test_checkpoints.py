"""
Reliability: checkpoints carry checksums and a damaged one is a one-line error that names the file, the step and
the newest whole checkpoint; --resume falls back to that one (and deletes nothing); SIGTERM makes a training stage
save and exit with PREEMPTED_EXIT, and the resumed run ends bit-identical to one never stopped (pretraining, SFT);
expected failures end a script with one line on stderr; a save that cannot fit or fails midway leaves the previous
checkpoint loadable.
"""

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import common
from engine import load_model
import pretrain
import sft
import tasks
from conftest import make_model, make_tokenizer, sigterm_on_call

REPO = Path(__file__).resolve().parents[1]
# pretrain.py on a 1-layer model (n_embd 64), rows of 32 tokens: each step takes milliseconds.
SMALL = ["--depth", "1", "--max-seq-len", "32", "--device-batch-size", "2", "--total-batch-size", "128",
         "--eval-tokens", "128", "--sample-every", "0", "--log-every", "1", "--device", "cpu"]
# Eight steps with checkpoints at 2, 4, 6 (two kept) and the final one at 8.
RUN = SMALL + ["--num-iterations", "8", "--eval-every", "4", "--save-every", "2"]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def home(tmp_path, monkeypatch, tokenizer):
    """A fresh $NANOPOST_HOME holding the test tokenizer."""
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    tokenizer.save(tmp_path / "tokenizer")
    return tmp_path


class Killed(Exception):
    pass


def crash():
    raise Killed  # the process dies mid-run


def die_at_step(monkeypatch, module, name, at, effect):
    """Make module.name(step, ...) call effect() when step == at: a crash in the middle of a run."""
    real = getattr(module, name)

    def wrapper(step, *args, **kwargs):
        if step == at:
            effect()
        return real(step, *args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return real


def snapshot(folder):
    """{relative path: bytes} of every file under folder: to show that nothing was deleted or changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def weights(ckpt):
    return common.load_checkpoint(ckpt)[0]


def assert_same_weights(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def killed_run(home, monkeypatch):
    """A pretraining run that died at step 5: its folder holds step_000002 and step_000004 (latest)."""
    real = die_at_step(monkeypatch, pretrain, "lr_multiplier", 5, crash)
    with pytest.raises(Killed):
        pretrain.main(RUN + ["--out", str(home / "b")])
    monkeypatch.setattr(pretrain, "lr_multiplier", real)
    assert sorted(p.name for p in (home / "b").glob("step_*")) == ["step_000002", "step_000004"]
    return home / "b"


# -----------------------------------------------------------------------------
# Checksums


def test_meta_records_size_and_sha256_of_every_file(tmp_path, tokenizer):
    extra = {"optimizer": {"m": torch.randn(300)}, "step": 3}
    path = common.save_checkpoint(tmp_path, 3, make_model(tokenizer), {"stage": "x"}, tokenizer=tokenizer, extra=extra)
    files = json.loads((path / "meta.json").read_text())["files"]
    assert {"model.pt", "extra.pt"} <= files.keys() and any(name.startswith("tokenizer/") for name in files)
    on_disk = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - {"meta.json"}
    assert files.keys() == on_disk
    for name, recorded in files.items():
        data = (path / name).read_bytes()
        assert recorded == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert common.load_checkpoint(tmp_path)[2]["step"] == 3

    # Damaged after it was checked once (in this process): caught all the same, the file's mtime has changed.
    stat = (path / "model.pt").stat()
    flip_byte(path)
    os.utime(path / "model.pt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a later write, whatever the clock
    with pytest.raises(common.CheckpointError, match="model.pt does not match its SHA-256"):
        common.load_checkpoint(tmp_path)


# -----------------------------------------------------------------------------
# Fault injection: each damage is a one-line error naming what is wrong, and --resume falls back past it


def truncate(step_dir):
    data = (step_dir / "model.pt").read_bytes()
    (step_dir / "model.pt").write_bytes(data[:len(data) // 2])


def flip_byte(step_dir):
    data = bytearray((step_dir / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (step_dir / "model.pt").write_bytes(bytes(data))


DAMAGES = {  # damage applied to step_000004 -> words the error must contain
    "truncated": (truncate, ["model.pt", "step 4", "bytes"]),
    "flipped byte": (flip_byte, ["model.pt", "step 4", "SHA-256"]),
    "missing meta.json": (lambda d: (d / "meta.json").unlink(), ["step_000004", "no meta.json"]),
    "latest names a deleted folder": (shutil.rmtree, ["latest", "step_000004", "does not exist"]),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_checkpoint_is_one_line_error_and_resume_falls_back(killed_run, damage, capsys):
    damage_fn, words = DAMAGES[damage]
    damage_fn(killed_run / "step_000004")
    before = snapshot(killed_run)

    # Inference never falls back silently: one line naming the problem and the newest whole checkpoint.
    with pytest.raises(common.CheckpointError) as error:
        load_model(killed_run, "cpu")
    message = str(error.value)
    assert "\n" not in message and all(word in message for word in words), message
    assert f"newest whole checkpoint is {killed_run / 'step_000002'}" in message

    # --resume skips it (and says so) and continues from step 2.
    assert common.resume_checkpoint(killed_run) == killed_run / "step_000002"
    out = capsys.readouterr().out
    assert f"falling back to {killed_run / 'step_000002'}" in out
    assert "resume: skipping step_000004" in out
    assert snapshot(killed_run) == before  # nothing deleted, nothing rewritten


def test_resume_past_a_corrupt_checkpoint_ends_bit_identical(home, killed_run, capsys):
    pretrain.main(RUN + ["--out", str(home / "a")])  # never interrupted
    flip_byte(killed_run / "step_000004")
    capsys.readouterr()
    pretrain.main(RUN + ["--out", str(killed_run), "--resume"])
    out = capsys.readouterr().out
    assert "resume: skipping step_000004" in out and "resumed from" in out and "at step 2" in out
    assert_same_weights(weights(home / "a"), weights(killed_run))


def test_resume_with_no_whole_checkpoint_stops_and_deletes_nothing(killed_run):
    truncate(killed_run / "step_000002")
    flip_byte(killed_run / "step_000004")
    before = snapshot(killed_run)
    with pytest.raises(common.CheckpointError, match="no whole checkpoint to resume from .* nothing was deleted"):
        pretrain.main(RUN + ["--out", str(killed_run), "--resume"])
    assert snapshot(killed_run) == before


# -----------------------------------------------------------------------------
# Preemption: SIGTERM -> finish the step, save, exit PREEMPTED_EXIT; the resumed run equals an uninterrupted one

# pretrain.py as its CLI runs it (run_cli, preemptible), with steps slowed to 0.2 s so that the test's SIGTERM
# lands in the middle of the run; the arithmetic is untouched.
SLOW_PRETRAIN = """
import sys, time
import common, pretrain
real = pretrain.lr_multiplier
pretrain.lr_multiplier = lambda *args: (time.sleep(0.2), real(*args))[1]
sys.argv[0] = "pretrain.py"
common.run_cli(lambda: pretrain.main(sys.argv[1:]), preemptible=True)
"""


def test_sigterm_mid_pretraining_then_resume_is_bit_identical(home, capsys):
    argv = SMALL + ["--num-iterations", "20", "--eval-every", "10", "--save-every", "0"]
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-c", SLOW_PRETRAIN, *argv, "--out", str(home / "b")], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
        if line.startswith("step 00002/00020 | loss"):
            process.send_signal(signal.SIGTERM)
            break
    out, err = process.communicate(timeout=300)
    assert process.returncode == common.PREEMPTED_EXIT, err[-2000:]
    assert "received SIGTERM" in err and "preempted: resumable checkpoint saved" in out
    meta = json.loads((common.resolve_checkpoint(home / "b") / "meta.json").read_text())
    assert not meta["finished"] and 3 <= meta["step"] < 20  # stopped after the step it was in, not at the end

    pretrain.main(argv + ["--out", str(home / "b"), "--resume"])
    assert f"resumed from {home / 'b'} at step {meta['step']}" in capsys.readouterr().out
    pretrain.main(argv + ["--out", str(home / "a")])
    assert_same_weights(weights(home / "a"), weights(home / "b"))
    assert common.load_checkpoint(home / "b")[1]["finished"]


SFT_ARGS = ["--preset", "tiny", "--train-rows", "48", "--batch-size", "16", "--device-batch-tokens", "1024",
            "--eval-rows", "16", "--check-problems", "4", "--check-samples", "2", "--max-new-tokens", "16",
            "--eval-every", "2", "--device", "cpu"]  # 3 steps, no periodic checkpoint


def test_sigterm_mid_sft_then_resume_is_bit_identical(home, tokenizer, monkeypatch, stop_signals, capsys):
    common.save_checkpoint(home / "checkpoints" / "base", 1, make_model(tokenizer), {"stage": "base"},
                           tokenizer=tokenizer)
    sft.main(SFT_ARGS + ["--out", str(home / "a")])

    # SIGTERM arrives during the second step (from the 2nd backward): the step completes, is saved, the run exits.
    real, _ = sigterm_on_call(monkeypatch, sft, "backward_sft_loss", 2)
    with pytest.raises(SystemExit) as stop:
        sft.main(SFT_ARGS + ["--out", str(home / "b")])
    assert stop.value.code == common.PREEMPTED_EXIT
    state, meta, extra = common.load_checkpoint(home / "b")
    assert meta["step"] == extra["step"] == 2 and not meta["finished"]

    monkeypatch.setattr(sft, "backward_sft_loss", real)
    monkeypatch.setattr(common, "_stop_signal", None)
    sft.main(SFT_ARGS + ["--out", str(home / "b"), "--resume"])
    assert "resuming from step 2" in capsys.readouterr().out
    assert common.load_checkpoint(home / "b")[1]["finished"]
    assert_same_weights(weights(home / "a"), weights(home / "b"))


def agree_on_preemption(rank, port, out_dir):
    """One of two gloo ranks; only rank 0 has received the signal. Writes what preempted() answered on this rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    answers = [common.preempted("cpu")]  # nobody signalled yet
    common._stop_signal = signal.SIGTERM if rank == 0 else None
    answers.append(common.preempted("cpu"))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(answers))
    common.compute_cleanup()  # barrier, then destroy: no rank leaves gloo while the other still talks to it


@pytest.mark.slow
def test_ranks_agree_when_only_one_was_signalled(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(agree_on_preemption, args=(port, str(tmp_path)), nprocs=2)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [[False, True], [False, True]]


def test_ranks_agree_about_every_ten_seconds_not_every_step(monkeypatch):
    # One gloo rank in this process, steps of 1 s on a fake clock, a signal arriving during step 5. The ranks agree at
    # the 1st and 2nd call (which measures a step: 1 s, so the next agreement is 10 calls later) and at the 12th,
    # which is the first to answer True; no collective and no host sync in between.
    monkeypatch.setattr(common, "_stop_signal", None)
    monkeypatch.setattr(common, "_checks", dict(common._FRESH_CHECKS))
    clock = iter(range(100))
    monkeypatch.setattr(common.time, "monotonic", lambda: float(next(clock)))
    reduces = []
    real_all_reduce = torch.distributed.all_reduce
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, **kw: reduces.append(1) or real_all_reduce(t, **kw))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=torch.distributed.HashStore())
    try:
        answers = []
        for call in range(1, 16):
            if call == 5:
                common._stop_signal = signal.SIGTERM
            answers.append(common.preempted("cpu"))
    finally:
        torch.distributed.destroy_process_group()
    assert answers.index(True) + 1 == 12 and len(reduces) == 3
    assert common.preemption_check_interval(0.6) == 16 and common.preemption_check_interval(30.0) == 1


def test_cuda_gets_expandable_segments_unless_the_user_chose(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # records the user's value (or its absence) for the undo
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    # compute_init("cuda") turns TF32 on; the flags are restored by value (cuBLASModule serves allow_tf32 through
    # __getattr__, which monkeypatch cannot undo: pytest 9.2's teardown delattr()s it and stops there).
    matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        common.compute_init("cuda")
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
        common.compute_init("cuda")
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    common.compute_init("cpu")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


# -----------------------------------------------------------------------------
# Errors a user can read: one line on stderr, no traceback; a bug keeps its traceback


def run_script(args, home):
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_scripts_turn_expected_failures_into_one_line(killed_run, tmp_path):
    truncate(killed_run / "step_000004")
    home = killed_run.parent
    cases = {  # command -> words of the one line
        ("engine.py", "--ckpt", str(killed_run), "--prompt", "hi"): ["engine.py: error:", "model.pt", "step_000002"],
        ("pretrain.py", *SMALL, "--total-batch-size", "100"): ["pretrain.py: error:", "--total-batch-size 100"],
        ("pretrain.py", *SMALL, "--data-files", str(tmp_path / "gone.parquet")): ["pretrain.py: error:",
                                                                                 "gone.parquet"],
    }
    for command, words in cases.items():
        result = run_script(command, home)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        line = result.stderr.strip()
        assert "\n" not in line and all(word in line for word in words), result.stderr[-2000:]
    missing_tokenizer = run_script(["pretrain.py", *SMALL], tmp_path / "empty")
    assert missing_tokenizer.returncode == 1 and "Traceback" not in missing_tokenizer.stderr
    assert "no tokenizer in" in missing_tokenizer.stderr and "python tokenizer.py" in missing_tokenizer.stderr


def test_data_dir_without_the_files_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"no files of openai/gsm8k (main, split 'test') under {tmp_path / 'openai/gsm8k'}")):
        tasks.GSM8K("test")


def test_run_cli_keeps_the_traceback_of_a_bug(capsys):
    def bad_flags():
        raise ValueError("--batch-size 30 is not a multiple of --device-batch-size 8\nchange one of them")

    with pytest.raises(SystemExit) as stop:
        common.run_cli(bad_flags)
    assert stop.value.code.endswith("error: --batch-size 30 is not a multiple of --device-batch-size 8 change one "
                                    "of them")

    def bug():
        return {}["missing"]

    with pytest.raises(KeyError):  # not an expected failure: the traceback is the developer's
        common.run_cli(bug)


# -----------------------------------------------------------------------------
# Disk: a save that cannot fit fails first; one that fails midway cleans up; the previous checkpoint stays whole


def test_save_checks_free_space_first_and_keeps_the_previous_checkpoint(tmp_path, tokenizer, monkeypatch):
    model = make_model(tokenizer)
    common.save_checkpoint(tmp_path, 1, model, {"stage": "x"}, tokenizer=tokenizer)
    before = snapshot(tmp_path)
    monkeypatch.setattr(common.shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=10**9, free=10**6))
    with pytest.raises(common.UserError, match="not enough disk space to save step 2 .* 0.00 GB are free"):
        common.save_checkpoint(tmp_path, 2, model, {"stage": "x"}, tokenizer=tokenizer)
    assert snapshot(tmp_path) == before
    assert common.load_checkpoint(tmp_path)[1]["step"] == 1


def test_disk_full_midway_removes_the_partial_save(tmp_path, tokenizer, monkeypatch):
    model = make_model(tokenizer)
    common.save_checkpoint(tmp_path, 1, model, {"stage": "x"}, tokenizer=tokenizer)
    before = snapshot(tmp_path)
    real_save = torch.save

    def disk_fills(obj, f, *args, **kwargs):
        if Path(f.name).name == "extra.pt":
            f.write(b"half a file")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_fills)
    with pytest.raises(common.UserError, match="ran out of disk space while saving step 2 .* previous checkpoint is"):
        common.save_checkpoint(tmp_path, 2, model, {"stage": "x"}, tokenizer=tokenizer, extra={"step": 2})
    assert snapshot(tmp_path) == before
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["step_000001"]  # no half-written temporary folder
    assert common.load_checkpoint(tmp_path)[1]["step"] == 1

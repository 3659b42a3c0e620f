"""
Shared plumbing for every stage: device and dtype, torchrun/DDP set-up, rank-0 printing, wandb-or-nothing
logging, one-line errors (run_cli), preemption on SIGTERM/SIGINT, atomic checksummed checkpoints and the resume
that falls back past a damaged one, the run directory and the report.

Run directory ($NANOPOST_HOME, default ~/.cache/nanopost):
    tokenizer/                  the trained tokenizer (tokenizer.py)
    data/                       hub datasets in the hub's layout (`python tasks.py prepare`)
    checkpoints/<stage>/        base, sft, dpo, rl, rm, rlhf, ppo, ...: one folder per saved step plus a `latest` pointer
    report.jsonl                one JSON line of final metrics per stage run (append_report)
    report.md                   the report card rendered by report.py
"""

import errno
import hashlib
import json
import math
import numbers
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

# -----------------------------------------------------------------------------
# Distributed set-up. torchrun sets RANK / LOCAL_RANK / WORLD_SIZE; plain `python X.py` sets none of them.


def get_dist_info():
    """(is_ddp, rank, local_rank, world_size) from the torchrun environment; a single process is (False, 0, 0, 1)."""
    if "RANK" not in os.environ:
        return False, 0, 0, 1
    return True, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


def print0(*args, **kwargs):
    """print() on rank 0 only, so an 8-GPU run prints each line once."""
    if get_dist_info()[1] == 0:
        print(*args, **kwargs, flush=True)


def autodetect_device():
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


# compute_init calls not yet matched by a compute_cleanup: a driver that runs stages in its own process group
# (bench/gpu_check.py under torchrun) keeps it across them, since a destroyed group cannot be created again.
_users = [0]


def compute_init(device=None, seed=0):
    """
    Pick the device, join the process group if launched by torchrun, seed every RNG.
    Returns (is_ddp, rank, local_rank, world_size, device) where device is a torch.device.
    Each process drives the GPU named by LOCAL_RANK, so the same code runs on one node or many (--nnodes).
    """
    device_type = device or autodetect_device()
    is_ddp, rank, local_rank, world_size = get_dist_info()
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
        # Before the first allocation, which reads it: RL allocates and frees a KV cache of up to ~20 GB every step,
        # and expandable segments map that memory again instead of fragmenting the cache. A user's setting is kept.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device(device_type)
    if is_ddp and not dist.is_initialized():
        # nccl is the fast path between GPUs; gloo lets the same torchrun command run on CPU (and in tests).
        backend = "nccl" if device_type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device_type == "cuda" else {}
        dist.init_process_group(backend=backend, **kwargs)
    if is_ddp:
        _users[0] += 1
    _checks.update(_FRESH_CHECKS)
    torch.manual_seed(seed)
    return is_ddp, rank, local_rank, world_size, device


def compute_cleanup():
    """Wait for every rank; the call matching the first compute_init destroys the process group (stages run inside a
    driver's group leave it standing)."""
    if dist.is_initialized():
        dist.barrier()
        _users[0] -= 1
        if _users[0] <= 0:
            _users[0] = 0
            dist.destroy_process_group()


def autocast_ctx(device):
    """bf16 autocast on CUDA (weights stay fp32, matmuls run in bf16); full fp32 on CPU and MPS."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return nullcontext()


def synchronize(device):
    """Wait for queued GPU work so wall-clock timings are honest."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def format_eta(seconds):
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


# -----------------------------------------------------------------------------
# The run directory


def get_base_dir():
    base = Path(os.environ.get("NANOPOST_HOME", Path.home() / ".cache" / "nanopost"))
    base.mkdir(parents=True, exist_ok=True)
    return base


def checkpoint_dir(stage):
    """Default checkpoint folder of a stage (base, sft, dpo, rl, ...)."""
    return get_base_dir() / "checkpoints" / stage


# -----------------------------------------------------------------------------
# Errors a user can read. Expected failures (a missing or corrupt checkpoint, no tokenizer, bad flags, missing data
# files, a full disk) end a script with one line on stderr; anything else is a bug and keeps its traceback.


class UserError(Exception):
    """A failure the user can fix from the message alone; run_cli prints it as one line, without a traceback."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or corrupt."""


# ValueError is this project's bad-input error (a wrong flag, a malformed row) and FileNotFoundError a missing
# tokenizer or data file: both are the user's to fix, like UserError. FloatingPointError is a diverged run.
EXPECTED_ERRORS = (UserError, ValueError, FileNotFoundError, FloatingPointError)


def run_cli(main, preemptible=False):
    """
    What each script's `if __name__ == "__main__":` calls. Runs main(); an expected error prints
    `<script>: error: <message>` on one line of stderr and exits with status 1; any other exception propagates with
    its traceback. preemptible=True (the training stages) first catches SIGTERM/SIGINT, see catch_preemption.
    """
    if preemptible:
        catch_preemption()
    prog = Path(sys.argv[0]).name
    try:
        main()
    except EXPECTED_ERRORS as e:
        sys.exit(f"{prog}: error: {' '.join(str(e).split())}")
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        sys.exit(f"{prog}: error: out of disk space: {e}")
    except KeyboardInterrupt:
        sys.exit(f"{prog}: interrupted")


# -----------------------------------------------------------------------------
# Preemption. Cluster schedulers stop a job with SIGTERM (Ctrl-C sends SIGINT) and kill it a grace period later.
# A training stage then finishes its optimizer step, saves a resumable checkpoint and exits with PREEMPTED_EXIT;
# the same command with --resume (or `bash speedrun.sh` again) continues from there, bit-identical to a run that
# was never stopped. Only the flag is set in the handler; the stage polls it once per step:
#
#     if preempted(device):
#         save(step + 1); exit_preempted(out_dir)

PREEMPTED_EXIT = 75  # EX_TEMPFAIL of sysexits.h, "try again later": speedrun.sh stops on it and a rerun resumes
_stop_signal = None  # the signal received, once one is


def _on_stop_signal(signum, frame):
    global _stop_signal
    if _stop_signal is None:  # repeats are ignored: torchrun forwards the signal to workers that already got it
        os.write(2, f"\nreceived {signal.Signals(signum).name}: finishing this step, saving a checkpoint and "
                    f"exiting ({PREEMPTED_EXIT}); `kill -9` stops at once\n".encode())
    _stop_signal = signum


def catch_preemption():
    """Make SIGTERM and SIGINT ask the training loop to stop after the current step (run_cli does it)."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _on_stop_signal)


PREEMPTION_CHECK_SECONDS = 10.0  # how often, in training time, the ranks agree on a stop signal (one host sync)
_FRESH_CHECKS = {"calls": 0, "next": 1, "time": None, "at": 0}
_checks = dict(_FRESH_CHECKS)  # preempted()'s schedule: the same on every rank; compute_init starts it afresh


def preemption_check_interval(seconds_per_call, target=PREEMPTION_CHECK_SECONDS):
    """Calls of preempted() until the next agreement: about `target` seconds of training, at least every call
    (and every call while the duration of one is not known yet, seconds_per_call 0)."""
    return max(1, int(target / seconds_per_call)) if seconds_per_call > 0 else 1


def preempted(device):
    """
    Whether a stop signal has arrived, agreed by all ranks: a signal that reached only some of them stops every one
    at the same step. Call it once per optimizer step on every rank. Under DDP the ranks agree with an all-reduce and
    a host sync, so not at every call: about every PREEMPTION_CHECK_SECONDS of training (the 1st and 2nd call, then
    preemption_check_interval of the slowest rank's seconds per call, all-reduced with the flag so that every rank
    keeps the same schedule); between agreements it answers False. A signal then stops training within ~10 s plus a
    step, well inside the grace period before the scheduler's kill (torchrun: TORCH_ELASTIC_SHUTDOWN_TIMEOUT).
    """
    if not dist.is_initialized():
        return _stop_signal is not None
    _checks["calls"] += 1
    if _checks["calls"] < _checks["next"]:
        return False
    now = time.monotonic()
    calls = _checks["calls"] - _checks["at"]
    per_call = (now - _checks["time"]) / calls if _checks["time"] is not None else 0.0
    flag = torch.tensor([float(_stop_signal is not None), per_call], dtype=torch.float64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    stop, per_call = flag.tolist()
    _checks.update(time=now, at=_checks["calls"], next=_checks["calls"] + preemption_check_interval(per_call))
    return bool(stop)


def exit_preempted(ckpt_dir):
    """After the preemption checkpoint: wait for rank 0 to finish writing it (torchrun kills the other workers as
    soon as one exits), then exit with PREEMPTED_EXIT."""
    compute_cleanup()
    print0(f"preempted: resumable checkpoint saved in {ckpt_dir}; run the same command with --resume "
           "(or bash speedrun.sh) to continue")
    sys.exit(PREEMPTED_EXIT)


# -----------------------------------------------------------------------------
# Checkpoints. A checkpoint is a folder step_000123/ holding model.pt, meta.json, an optional extra.pt
# (optimizer, data position, RNG: whatever a resume needs) and an optional tokenizer/ copy, so that
# `python engine.py --ckpt DIR` needs nothing else. Writes are atomic: the step folder is built under a
# temporary name and renamed into place, then the `latest` pointer file is replaced with os.replace.
# A crash at any moment leaves either the old pointer (previous checkpoint intact) or the new one (complete).
# meta.json records the size and SHA-256 of every other file, hashed as it is written; loading checks them, so a
# file cut short or altered by a copy, a full disk or a bad sector is an error that names it, never a bad model.


def _unwrap(model):
    """The bare GPT under DDP and torch.compile wrappers, so state-dict keys never carry their prefixes."""
    model = getattr(model, "module", model)  # DDP
    return getattr(model, "_orig_mod", model)  # torch.compile


def _atomic_write_text(path, text):
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _HashingWriter:
    """The file torch.save writes into: every byte also goes through SHA-256, so the checksum needs no second read."""

    def __init__(self, f):
        self.f, self.name, self.sha256, self.size = f, f.name, hashlib.sha256(), 0

    def write(self, data):
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def _save_hashed(obj, path):
    """torch.save(obj, path); returns {"bytes", "sha256"} of the file written."""
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": writer.size, "sha256": writer.sha256.hexdigest()}


def _file_digest(path):
    sha256 = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha256.update(block)
    return {"bytes": path.stat().st_size, "sha256": sha256.hexdigest()}


def _tensor_bytes(obj):
    """Bytes of the tensors in a nest of dicts, lists and tuples: what torch.save will write, less pickle overhead."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def check_disk_space(ckpt_dir, step, expected_bytes):
    """UserError, before anything is written, when the disk holding ckpt_dir cannot take expected_bytes (+5%, 64 MB)."""
    need = int(expected_bytes * 1.05) + (64 << 20)
    free = shutil.disk_usage(ckpt_dir).free
    if free < need:
        raise UserError(f"not enough disk space to save step {step} in {ckpt_dir}: the checkpoint needs about "
                        f"{need / 1e9:.2f} GB and {free / 1e9:.2f} GB are free; free some space or point --out at "
                        "another disk, then --resume (the previous checkpoint is intact)")


def save_checkpoint(ckpt_dir, step, model, meta, tokenizer=None, extra=None, keep=2):
    """
    Save `model`'s weights, `meta` (a JSON-able dict; the model config and the files' sizes and SHA-256 are added)
    and `extra` (any torch-saveable dict for resuming) as ckpt_dir/step_{step:06d}, point `latest` at it, and keep
    only the newest `keep` step folders. Checks the free disk space first. Call it on rank 0 only. Returns the
    step folder. Whatever fails, the previous checkpoint stays as it was.
    """
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    model = _unwrap(model)
    state = model.state_dict()
    check_disk_space(ckpt_dir, step, _tensor_bytes(state) + _tensor_bytes(extra))
    files = {}
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=ckpt_dir))
    try:
        files["model.pt"] = _save_hashed(state, tmp / "model.pt")
        if extra is not None:
            files["extra.pt"] = _save_hashed(extra, tmp / "extra.pt")
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer")
            for path in sorted((tmp / "tokenizer").iterdir()):  # small files: hashed by reading them back
                files[f"tokenizer/{path.name}"] = _file_digest(path)
        meta = {**meta, "step": step, "model_config": asdict(model.config), "files": files}
        _atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=2, default=str))
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise UserError(f"ran out of disk space while saving step {step} in {ckpt_dir}; the partial save was "
                            "removed and the previous checkpoint is intact: free some space and --resume") from e
        raise
    final = ckpt_dir / name
    if final.exists():  # re-saving the same step (e.g. a resumed run ending where it was killed)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(ckpt_dir / "latest", name)
    for old in _step_folders(ckpt_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def check_ranks_agree(model, what):
    """
    Call on every rank at the end of a stage, before rank 0 saves: FloatingPointError when a weight is NaN or inf,
    RuntimeError naming the first tensor that differs when the ranks' weights are not bit-identical (DDP keeps them
    so; a gradient some rank did not average, or a rank-dependent update, makes them drift and rank 0 would save one
    rank's model as everyone's). Hashes each tensor's bytes on the host: a few seconds for a 561M model.
    """
    state = _unwrap(model).state_dict()
    bad = [name for name, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise FloatingPointError(f"{what}: non-finite weights in {', '.join(bad[:3])}: training diverged; not saving")
    if not dist.is_initialized():
        return
    digests = [hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()[:16]
               for t in state.values()]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, digests)
    for rank, theirs in enumerate(gathered):
        differ = [name for name, a, b in zip(state, gathered[0], theirs) if a != b]
        if differ:
            raise RuntimeError(f"{what}: rank {rank}'s weights differ from rank 0's ({len(differ)} tensors, first "
                               f"{differ[0]}): the ranks drifted apart, a distributed-training bug")


def _step_folders(ckpt_dir):
    """The step_* folders of ckpt_dir, newest (highest step) first."""
    folders = [p for p in Path(ckpt_dir).glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(folders, key=lambda p: int(p.name[5:]), reverse=True)


def resolve_checkpoint(ckpt_dir, step=None):
    """
    The step folder to load: ckpt_dir itself if it is one, else the given step, else the one `latest` names.
    Raises CheckpointError (a FileNotFoundError's message: which stage to run) when there is nothing there.
    """
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / "meta.json").exists():
        return ckpt_dir
    if (ckpt_dir / "model.pt").exists():
        raise _no_fallback(f"checkpoint {ckpt_dir} is incomplete: it has no meta.json", ckpt_dir.parent)
    if step is not None:
        path = ckpt_dir / f"step_{step:06d}"
    elif (ckpt_dir / "latest").exists():
        path = ckpt_dir / (ckpt_dir / "latest").read_text().strip()
        if not path.is_dir():
            raise _no_fallback(f"{ckpt_dir / 'latest'} names {path.name}, which does not exist", ckpt_dir)
    else:
        raise CheckpointError(
            f"no checkpoint in {ckpt_dir}: run the stage that writes it first "
            f"(pretrain.py -> checkpoints/base, sft.py -> sft, dpo.py -> dpo, rl.py -> rl) or pass --ckpt")
    if not (path / "meta.json").exists():
        raise _no_fallback(f"checkpoint {path} is missing or incomplete (no meta.json)", ckpt_dir)
    return path


def _no_fallback(error, stage_dir):
    """The error of a checkpoint that was asked for by name, with the newest whole one to use instead: never used."""
    whole = newest_whole_checkpoint(stage_dir)
    return CheckpointError(f"{error}; " + (f"the newest whole checkpoint is {whole}" if whole else
                                           f"there is no whole checkpoint in {stage_dir}"))


def has_checkpoint(ckpt_dir):
    ckpt_dir = Path(ckpt_dir)
    return (ckpt_dir / "meta.json").exists() or (ckpt_dir / "latest").exists() or bool(_step_folders(ckpt_dir))


# Step folders whose files this process has hashed, with their modification times then: a resume that checks a
# checkpoint and then loads it reads every file once, not twice (SHA-256 runs at ~0.1-2 GB/s, by CPU).
_VERIFIED = set()


def verify_checkpoint(path):
    """
    The meta of the step folder `path` after checking that every file it lists has its recorded size and SHA-256.
    CheckpointError naming the file and the step otherwise. (A checkpoint saved before checksums has no list.)
    """
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no meta.json") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: meta.json is unreadable ({e})") from None
    files = meta.get("files", {})
    where = f"checkpoint {path} (step {meta.get('step')}):"
    for name, expected in files.items():
        if not (path / name).is_file():
            raise CheckpointError(f"{where} {name} is missing")
        size = (path / name).stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{where} {name} has {size:,} bytes, {expected['bytes']:,} were saved: the file is "
                                  "cut short or damaged")
    stamp = (path.resolve(), tuple((path / name).stat().st_mtime_ns for name in ["meta.json", *files]))
    if stamp in _VERIFIED:
        return meta
    for name, expected in files.items():
        if _file_digest(path / name)["sha256"] != expected["sha256"]:
            raise CheckpointError(f"{where} {name} does not match its SHA-256 checksum: the file is damaged")
    _VERIFIED.add(stamp)
    return meta


def newest_whole_checkpoint(ckpt_dir, skip_report=None):
    """
    The newest step folder of ckpt_dir that verifies, or None. It starts at the folder `latest` names (a pointer moved
    back on purpose is obeyed), or at the newest folder when `latest` is missing or names none. skip_report(path,
    error) is called for each one that does not verify. Reads every file of each candidate; changes nothing.
    """
    folders = _step_folders(ckpt_dir)
    latest = Path(ckpt_dir) / "latest"
    named = latest.read_text().strip() if latest.exists() else ""
    if named.startswith("step_") and named[5:].isdigit() and (Path(ckpt_dir) / named).is_dir():
        folders = [p for p in folders if int(p.name[5:]) <= int(named[5:])]
    for path in folders:
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            if skip_report is not None:
                skip_report(path, e)
    return None


def resume_checkpoint(ckpt_dir):
    """
    The step folder a --resume continues from: the newest whole one in ckpt_dir, reporting each newer one it skips.
    CheckpointError when there are checkpoints but none is whole: the run stops and leaves them all as they are.
    """
    skipped = []

    def report(path, error):
        skipped.append(path)
        print0(f"resume: skipping {path.name}: {error}")

    ckpt_dir, latest = Path(ckpt_dir), Path(ckpt_dir) / "latest"
    named = latest.read_text().strip() if latest.exists() else None
    if named and not (ckpt_dir / named).is_dir():
        print0(f"resume: skipping {named}: {latest} names it, but it does not exist")
    path = newest_whole_checkpoint(ckpt_dir, report)
    if path is None:
        raise CheckpointError(f"no whole checkpoint to resume from in {ckpt_dir} (every step folder failed its "
                              "check; nothing was deleted): move the folder aside to start over, or pick another --out")
    if skipped or named and named != path.name:
        print0(f"resume: falling back to {path}")
    return path


# -----------------------------------------------------------------------------
# What every training stage (pretrain, sft, dpo, rl, rm) shares: the common flags, and the start of a --resume.


# A rehearsal (NANOPOST_REHEARSAL=1, what `bash speedrun.sh --rehearse` sets) runs a GPU preset's exact path on CPU
# in minutes: every stage, launched as speedrun.sh launches it, with only these sizes of its preset replaced. The
# keys are preset keys; each script's presets take those they have. Nothing else changes: same data pipelines,
# same code, same flags. A stage's size flags still win over the preset, rehearsal or not.
REHEARSAL = dict(
    vocab_size=1024, max_chars=2_000_000,  # tokenizer
    depth=2, max_seq_len=128, device_batch_size=2, total_batch_size=512, num_iterations=4, eval_tokens=512,
    sample_every=4, log_every=1,  # pretraining: 2 rows x 128 tokens x 2 ranks = one micro-batch a step
    train_rows=32, eval_rows=16, train_pairs=32, eval_pairs=16, samples=2, train_size=64, batch_size=8,
    device_batch_tokens=1024, check_problems=8, check_samples=2, max_new_tokens=16, eval_every=2, save_every=2,
    num_steps=2, prompts_per_step=4, group_size=4, max_tokens=16, warmup_steps=1, eval_problems=8, eval_samples=2,
    max_problems=8, bpb_tokens=512,  # RL and evaluation
)


def rehearsal():
    """Whether this process is part of a rehearsal (NANOPOST_REHEARSAL=1)."""
    value = os.environ.get("NANOPOST_REHEARSAL", "0")
    if value not in ("0", "1"):
        raise UserError(f"NANOPOST_REHEARSAL must be 0 or 1, got {value!r}")
    return value == "1"


def rehearse(presets, script):
    """
    In a rehearsal, replace the REHEARSAL sizes in every preset of `presets` (a script's PRESETS, changed in place,
    before its flags fill in from it) and print which; otherwise do nothing. Every script that reads a preset calls
    it once, at start (add_stage_flags does for the training stages).
    """
    if not rehearsal():
        return
    changed = {}
    for values in presets.values():
        for key in values.keys() & REHEARSAL.keys():
            values[key] = changed[key] = REHEARSAL[key]
    print0(f"{script}: REHEARSAL (NANOPOST_REHEARSAL=1): preset sizes replaced: "
           + ", ".join(f"{key} {value}" for key, value in sorted(changed.items())))


def add_stage_flags(parser, presets, preset, seed, out, resume, ckpt=None, run="wandb run name ('dummy': no logging)"):
    """
    Add the flags every training stage has: --preset (the keys of `presets`, default tiny), --device, --seed (default
    0), --wandb-run (default dummy), --ckpt (only when its help is given: pretrain starts from scratch), --out and
    --resume, in the argument group "run and checkpoint" it returns (a stage adds its own run flags there). The
    other arguments are the stage's own help texts of those flags. In a rehearsal, shrinks `presets` first
    (rehearse).
    """
    rehearse(presets, parser.prog)
    group = parser.add_argument_group("run and checkpoint")
    group.add_argument("--preset", choices=sorted(presets), default="tiny", help=preset)
    group.add_argument("--device", default=None, help="cuda | mps | cpu (default: autodetect)")
    group.add_argument("--seed", type=int, default=0, help=seed)
    # Not `--run`: torchrun parses the flags after the script too, and takes `--run` for an ambiguous abbreviation of
    # its own --run-path/--run_path. No stage flag may be a prefix of a torchrun option (tests/test_launch.py).
    group.add_argument("--wandb-run", dest="run", default="dummy", help=run)
    if ckpt is not None:
        group.add_argument("--ckpt", default=None, help=ckpt)
    group.add_argument("--out", default=None, help=out)
    group.add_argument("--resume", action="store_true", help=resume)
    return group


def fill_preset(args, preset):
    """Every flag left unset (None) takes the preset's value: explicit flags win."""
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def set_lr(optimizers, multiplier):
    """This step's learning rates: every parameter group's initial_lr x the schedule's multiplier."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * multiplier


def load_optimizers(optimizers, states):
    """On resume, each optimizer's state from the checkpoint's list, in order."""
    for optimizer, state in zip(optimizers, states):
        optimizer.load_state_dict(state)


def check_numbers(args, positive=(), nonnegative=()):
    """
    ValueError naming the flag when a numeric flag is out of range: each name in `positive` must be > 0 and each in
    `nonnegative` >= 0 (where the stage's help gives 0 a meaning, such as "never"); None (unset: the preset's or
    the stage's own default) passes. Stages call it right after their flags are filled in, before any work, so a
    loop never divides by a zero interval.
    """
    for names, ok, need in ((positive, lambda v: v > 0, "> 0"), (nonnegative, lambda v: v >= 0, ">= 0")):
        for name in names:
            value = getattr(args, name)
            if value is not None and not ok(value):
                raise ValueError(f"--{name.replace('_', '-')} must be {need}, got {value}")


FINISHED = "finished"  # resume_or_finish: the stage's checkpoint is final, nothing is left to do


def resume_or_finish(out_dir, resume, stage):
    """
    The step folder a stage's --resume continues from (resume_checkpoint: the newest whole one in out_dir), or None
    when --resume is off or out_dir holds no checkpoint. When that checkpoint is marked finished it says so, calls
    compute_cleanup() and returns FINISHED, and the stage's main returns: speedrun.sh reruns every stage with
    --resume, and a finished one has nothing left to do.
    """
    if not resume or not has_checkpoint(out_dir):
        return None
    path = resume_checkpoint(out_dir)
    meta = verify_checkpoint(path)  # cached: loading the checkpoint after this does not hash its files again
    if meta.get("finished"):
        print0(f"{stage} already finished ({out_dir}, step {meta['step']}); nothing to do")
        compute_cleanup()
        return FINISHED
    return path


def load_checkpoint(ckpt_dir, step=None, device="cpu"):
    """
    (model_state_dict, meta, extra_or_None) of a checkpoint, files verified; tensors are mapped to `device`.
    Never falls back to another checkpoint: a bad one is a CheckpointError that names the newest whole one, if any.
    """
    path = resolve_checkpoint(ckpt_dir, step)
    try:
        meta = verify_checkpoint(path)
        model_state = _torch_load(path / "model.pt", meta, device)
        extra = _torch_load(path / "extra.pt", meta, device) if (path / "extra.pt").exists() else None
    except CheckpointError as e:
        raise _no_fallback(e, path.parent) from None
    return model_state, meta, extra


def _torch_load(file, meta, device):
    try:
        return torch.load(file, map_location=device, weights_only=True)
    except Exception as e:  # a damaged zip or pickle: torch's reader has many ways to say so
        raise CheckpointError(f"checkpoint {file.parent} (step {meta.get('step')}): {file.name} does not load "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


# -----------------------------------------------------------------------------
# Logging and the report


# A stage's curves in its report record: each series evenly thinned to at most this many points (the first and the
# last kept), enough for a figure and small enough that report.jsonl stays a file one can read.
CURVE_POINTS = 200


class Logger:
    """
    wandb when --wandb-run names a run, otherwise nothing leaves the machine ('dummy', the default). Either way it keeps
    every number it is given, series[name] = {"step": [...], "value": [...]}, and append_report(record, logger) adds
    them to the stage's record (curves()), so the report card draws the training of every stage without wandb. A stage saves
    `series` in its checkpoints and passes it back on --resume, so that its curves survive an interruption.
    """

    def __init__(self, run, config, project="nanopost", series=None):
        self.wandb = None
        if run != "dummy" and get_dist_info()[1] == 0:
            import wandb

            self.wandb = wandb.init(project=project, name=run, config=config)
        self.series = series or {}

    def log(self, metrics, step):
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        for name, value in metrics.items():
            if not isinstance(value, numbers.Real):  # a label or a tensor: not a point of a curve
                continue
            series = self.series.setdefault(name, {"step": [], "value": []})
            while series["step"] and series["step"][-1] >= step:  # a resumed run logs its checkpoint's step again
                series["step"].pop()
                series["value"].pop()
            series["step"].append(step)
            series["value"].append(float(value))

    def curves(self):
        """
        The series for a report record: each thinned evenly to at most CURVE_POINTS points (thin), values rounded
        to 5 significant digits, a step with no value (NaN: e.g. the entropy of a step that trained on nothing) as
        null, so that report.jsonl stays strict JSON; series left with the same steps share one group
        {"step": [...], name: [...], ...}. Returns the list of groups.
        """
        groups = {}
        for name, series in self.series.items():
            keep = thin(len(series["step"]), CURVE_POINTS)
            steps = [series["step"][i] for i in keep]
            group = groups.setdefault(tuple(steps), {"step": steps})
            values = (series["value"][i] for i in keep)
            group[name] = [float(f"{v:.5g}") if math.isfinite(v) else None for v in values]
        return list(groups.values())

    def finish(self):
        if self.wandb is not None:
            self.wandb.finish()


def thin(n, points):
    """Indices of `points` evenly spaced items of n (all of them when n <= points), the first and the last included."""
    if n <= points:
        return list(range(n))
    return [round(i * (n - 1) / (points - 1)) for i in range(points)]


def append_report(record, logger=None):
    """
    Append one stage's final metrics as a JSON line to $NANOPOST_HOME/report.jsonl (rank 0 only), with the curves the
    stage's `logger` kept (Logger.curves) under "curves": what report.py draws the stage's figure from.
    """
    if get_dist_info()[1] != 0:
        return
    record = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), **record}
    if logger is not None and logger.series:
        record["curves"] = logger.curves()
    with open(get_base_dir() / "report.jsonl", "a") as f:
        f.write(json.dumps(record, default=float) + "\n")


def check_report(required):
    """
    The rehearsal's last check of a run's report: UserError unless report.jsonl holds a record of every entry of
    `required` ("<stage>", "eval:<stage>" for an evaluation of that checkpoint, "coverage:<stage>" for one that sampled
    several answers per problem: the coverage view), every number in it is finite, and report.md was written.
    """
    records = read_report()
    found = {r["stage"] for r in records} | {f"eval:{r['of']}" for r in records if r["stage"] == "eval"} \
        | {f"coverage:{r['of']}" for r in records
           if r["stage"] == "eval" and r.get("coverage") and r.get("settings", {}).get("num_samples", 1) > 1}
    missing = [name for name in required if name not in found]
    if missing:
        raise UserError(f"the report of {get_base_dir()} lacks {', '.join(missing)}")

    def numbers(obj, where):
        if isinstance(obj, dict):
            for key, value in obj.items():
                yield from numbers(value, f"{where}.{key}")
        elif isinstance(obj, list):
            for value in obj:
                yield from numbers(value, where)
        elif isinstance(obj, float):
            yield where, obj

    bad = [where for r in records for where, x in numbers(r, r["stage"]) if not math.isfinite(x)]
    if bad:
        raise UserError(f"non-finite numbers in the report: {', '.join(bad[:5])}")
    if not (get_base_dir() / "report.md").exists():
        raise UserError(f"no report card {get_base_dir() / 'report.md'}")
    print0(f"report: {len(records)} records, every one of {', '.join(required)} present, all numbers finite")


def read_report():
    path = get_base_dir() / "report.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -----------------------------------------------------------------------------
# The budget: what a stage costs on the hardware its preset is planned for, and the micro-batch that fits a GPU.
# Each stage's --dry-run prints its plan (stage_plan + print_plan) from its own numbers; plan.py adds them up into
# the speedrun's table. A real run on CUDA fits its micro-batch to the GPU it finds (batch_tokens_for_device).

GIB = 2**30
# Dense bf16 tensor-core peak of one GPU, FLOP/s (vendor datasheets): the plans below and the MFU a run measures.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2.25e15, "L40S": 362e12, "4090": 165e12}
# The hardware each GPU preset is planned for. memory: what torch.cuda.get_device_properties reports (bytes);
# peak_flops: PEAK_FLOPS of its GPU; decode_tokens_per_s: what one GPU's engine is
# assumed to generate (tokens/s, >= 128 rows decoding together, bf16, eager): an assumption until
# bench/gpu_check.py measures it (its "engine decode" row).
HARDWARE = {
    "full": dict(name="8xH100 80GB", gpus=8, memory=81559 * 2**20, peak_flops=PEAK_FLOPS["H100"],
                 decode_tokens_per_s=10_000),
    "small": dict(name="1x RTX 4090 24GB", gpus=1, memory=24564 * 2**20, peak_flops=PEAK_FLOPS["4090"],
                  decode_tokens_per_s=8_000),
}


def peak_flops(device):
    """Peak bf16 FLOP/s of a CUDA device by its name (PEAK_FLOPS), or None (CPU, MPS, an unlisted GPU): no MFU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)
# Assumed model FLOPs utilisation: compiled pretraining at large matmuls (nanochat reports ~40-50% on H100), eager
# post-training with variable shapes and chunked logits lower. Assumptions, checked by bench/gpu_check.py's MFU.
ASSUMED_MFU = {"pretrain": 0.40, "post-training": 0.25}
# Share of a GPU's memory a micro-batch may plan for: model.training_memory counts tensors only; the CUDA context,
# allocator fragmentation and NCCL buffers come on top. 0.9 x 79.6 GiB (an 80 GB H100) = 71.7 GiB <= 75 GiB.
MEMORY_MARGIN = 0.9


def planned_memory(config, micro_batch_tokens, logits_chunk, extra_bytes=0, ddp=True, trainable=None):
    """Peak bytes per GPU of a training process (model.training_memory; ddp: DistributedDataParallel's gradient
    buckets too; trainable: LoRA's adapter parameters when only they train) plus what the stage holds besides."""
    from model import training_memory

    return training_memory(config, micro_batch_tokens, logits_chunk, ddp, trainable)["total"] + extra_bytes


def fit_batch_tokens(stage, config, gpu_bytes, max_tokens, min_tokens, logits_chunk, extra_bytes=0, ddp=True,
                     trainable=None):
    """
    The largest micro-batch, in tokens, of max_tokens, max_tokens / 2, max_tokens / 4, ... (and min_tokens itself,
    the smallest one that holds a row) whose planned_memory fits MEMORY_MARGIN * gpu_bytes. UserError naming the
    stage and the memory it needs when not even min_tokens fits.
    """
    usable = MEMORY_MARGIN * gpu_bytes
    candidates = [max_tokens >> k for k in range(64) if max_tokens >> k >= min_tokens]
    for tokens in candidates + ([min_tokens] if candidates[-1:] != [min_tokens] else []):
        if planned_memory(config, tokens, logits_chunk, extra_bytes, ddp, trainable) <= usable:
            return tokens
    need = planned_memory(config, min_tokens, logits_chunk, extra_bytes, ddp, trainable)
    raise UserError(f"{stage} does not fit this GPU: its smallest micro-batch ({min_tokens:,} tokens) needs "
                    f"{need / GIB:.1f} GiB per GPU (model.training_memory), more than {usable / GIB:.1f} GiB "
                    f"({MEMORY_MARGIN:.0%} of {gpu_bytes / GIB:.1f} GiB); use a smaller preset (--preset small), "
                    "a shorter --max-seq-len or a GPU with more memory")


def batch_tokens_for_device(stage, given, device, config, max_tokens, min_tokens, logits_chunk, extra_bytes=0):
    """
    A stage's micro-batch in tokens: `given` (its --device-batch-tokens flag) when set; on CUDA the largest that fits
    this GPU (fit_batch_tokens, up to the preset's max_tokens); elsewhere max_tokens. Prints the choice.
    """
    if given:
        print0(f"{stage}: micro-batches of {given:,} tokens (as given)")
        return given
    if torch.device(device).type != "cuda":
        return max_tokens
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory
    tokens = fit_batch_tokens(stage, config, gpu_bytes, max_tokens, min_tokens, logits_chunk, extra_bytes)
    print0(f"{stage}: micro-batches of {tokens:,} tokens fit this GPU: ~"
           f"{planned_memory(config, tokens, logits_chunk, extra_bytes) / GIB:.1f} GiB of {gpu_bytes / GIB:.1f} GiB "
           "planned (model.training_memory; --device-batch-tokens overrides)")
    return tokens


def model_size(config):
    """(parameters, training FLOPs per token) of a GPT of this config (GPT.flops_per_token), built on the meta
    device: shapes only, no memory."""
    from model import GPT

    with torch.device("meta"):
        model = GPT(config)
    return model.num_params(), model.flops_per_token()


def kv_cache_bytes(config, rows, positions, dtype_bytes=2):
    """Bytes of the engine's KV cache (engine.KVCache) for `rows` rows of `positions` slots: keys and values of every
    layer, (rows, positions, n_kv_head, head_dim) each, in the compute dtype (bf16 under autocast: 2 bytes)."""
    head_dim = config.n_embd // config.n_head
    return 2 * config.n_layer * rows * positions * config.n_kv_head * head_dim * dtype_bytes


def inference_memory(config, kv_rows, kv_positions, logits_rows=0, forward_tokens=0, logits_chunk=0, optimizer=False):
    """
    Peak bytes per GPU of a no-grad phase (generation, evaluation): what it keeps at once, bf16 autocast, no gradients
    (a training stage sets them to None after each step); optimizer=True: a training stage's rollouts, whose
    optimizer state stays (model.training_memory's term):

      weights      4 P                        fp32 parameters
      autocast     2 P_blocks + 2 V C         bf16 copies of the matmul weights (model.training_memory)
      kv cache     kv_cache_bytes(kv_rows, kv_positions)
      sampling     16 V logits_rows           per decoding row: fp32 logits, scaled by the temperature, less
                                              their max, and its exp (engine.sample_tokens), 4 bytes each
      forward      30 C forward_tokens        a no-grad forward of forward_tokens positions keeps one layer's tensors
                                              at a time: the fp32 residual 4, its bf16 norm 2, the MLP's c_fc output,
                                              ReLU and square 8 each (bf16, 4 C wide)
                   + 14 V logits_chunk        and its lm_head chunk: bf16 output 2, fp32 copy 4, soft-cap 4,
                                              log-softmax 4
    """
    from model import training_memory

    terms = training_memory(config, 0, 0)
    return (terms["weights"] + terms["autocast"] + kv_cache_bytes(config, kv_rows, kv_positions)
            + 16 * config.vocab_size * logits_rows + 30 * config.n_embd * forward_tokens
            + 14 * config.vocab_size * logits_chunk + (terms["optimizer"] if optimizer else 0))


# -----------------------------------------------------------------------------
# RL's sampling rounds and its other models. Under dynamic sampling (rl.sample_groups) a step samples rounds of
# prompts until it holds enough groups whose completions disagree (contrast); a round costs the same whatever it
# finds, so rollout time is rounds x one round. The rounds depend on the policy's pass rate, which nothing measures
# before the run: the plan assumes one per task and preset.

# Starting pass@1 (after SFT and DPO) of the RL task at each GPU preset's depth. GSM8K at depth 20: nanochat's d20
# chat model scores 4.5% before RL; depth 8 (92M parameters) is not measured anywhere: 2% is a guess.
ASSUMED_PASS_RATE = {"gsm8k": {"full": 0.05, "small": 0.02}}
# The spread of the per-prompt pass rates p around that mean: p ~ Beta(mu kappa, (1 - mu) kappa). A weak model
# solves a few problems often and most never; kappa = 2 gives half of the groups of 16 contrast at 15% pass@1
# (0.53), where 15% of every completion right, spread evenly over the prompts (kappa -> infinity), would give 0.93.
PASS_RATE_CONCENTRATION = 2.0


def contrast_probability(pass_rate, group_size, concentration=PASS_RATE_CONCENTRATION):
    """
    The probability that a group of G = group_size completions of one prompt holds both a right and a wrong answer,
    when the prompts' pass rates p are Beta(a, b) around the mean mu = pass_rate, a = mu kappa, b = (1 - mu) kappa
    (kappa = concentration):

        P(contrast) = 1 - E[(1 - p)^G] - E[p^G],   E[(1 - p)^G] = prod_{i<G} (b + i) / (kappa + i),
                                                    E[p^G]       = prod_{i<G} (a + i) / (kappa + i)

    (the Beta distribution's moments). E.g. mu 1/2 and kappa 2 (p uniform), G 2: 1 - 1/3 - 1/3 = 1/3.
    """
    a, b = pass_rate * concentration, (1 - pass_rate) * concentration
    all_wrong = all_right = 1.0
    for i in range(group_size):
        all_wrong *= (b + i) / (concentration + i)
        all_right *= (a + i) / (concentration + i)
    return 1 - all_wrong - all_right


def expected_sampling_rounds(pass_rate, group_size, groups_needed, oversample, ranks, max_rounds=4,
                             concentration=PASS_RATE_CONCENTRATION):
    """
    Expected sampling rounds of one RL step with dynamic sampling (rl.sample_groups), the slowest rank gating it.
    Each round a rank samples m = ceil(oversample g) new prompts (g = groups_needed, this rank's share), keeps the
    groups with contrast, and stops once it holds g of them, or after max_rounds rounds (then short). A group has
    contrast with q = contrast_probability(pass_rate, group_size, concentration), independently of the others, so
    after r rounds a rank has kept Binomial(r m, q) groups:

        P(R <= r) = P(Binomial(r m, q) >= g)   for 1 <= r < max_rounds;   P(R <= max_rounds) = 1

    The step waits for its slowest rank (the gradient all-reduce); the ranks sample independently, so

        E[max_k R_k] = sum_{r=0}^{max_rounds-1} P(max_k R_k > r) = sum_r (1 - P(R <= r)^ranks)

    E.g. mu 1/2, kappa 2, G 2 (q = 1/3), g = m = 1, 3 rounds at most: one rank 1 + 2/3 + 4/9 = 19/9; two ranks
    1 + 8/9 + 56/81 = 209/81.
    """
    q = contrast_probability(pass_rate, group_size, concentration)
    m = math.ceil(oversample * groups_needed)

    def done_within(r):  # P(R <= r) on one rank
        n = r * m
        return sum(math.comb(n, j) * q ** j * (1 - q) ** (n - j) for j in range(groups_needed, n + 1))

    return sum(1 - (done_within(r) if r else 0.0) ** ranks for r in range(max_rounds))


def rl_models_bytes(config, reference=False, reward_model=False, critic=False):
    """
    Bytes per GPU RL holds beside the policy's own, for the models its flags load (a dict of the terms used):

      reference     4 P                   the frozen reference's fp32 weights (--kl-coef > 0)
      reward_model  4 (P + C + 1)         the reward model's fp32 weights: a trunk with a scalar head (--reward rm)
      critic        4 (P + C + 1)         PPO's critic (model.ScalarHeadModel, the policy's trunk with its unused
                    + 4 (P - V C + C + 1) lm_head): fp32 weights, gradients of all but lm_head (summed over ranks
                    + 8 (V C + C + 1)     in place: no DDP buckets), AdamW's two moments for wte and the head and
                    + 4 P_blocks          Muon's momentum for the blocks
                                          (--advantage gae)

    P = 2 V C + P_blocks, the policy's parameters. The critic's activations and autocast copies are left out: its
    forward and backward run after the policy's backward of the same micro-batch has freed the policy's, and need
    less (no logits). The scoring passes of the reference and the reward model are no-grad and as short-lived.
    """
    from model import training_memory

    terms = training_memory(config, 0, 0)
    C, V = config.n_embd, config.vocab_size
    params = terms["weights"] // 4
    head = C + 1
    out = {}
    if reference:
        out["reference"] = 4 * params
    if reward_model:
        out["reward_model"] = 4 * (params + head)
    if critic:
        blocks = params - 2 * V * C
        out["critic"] = 4 * (params + head) + 4 * (params - V * C + head) + 8 * (V * C + head) + 4 * blocks
    return out


def stage_plan(stage, preset, config, micro_batch_tokens, logits_chunk, train_tokens=0, flops_per_token=0.0,
               mfu=ASSUMED_MFU["post-training"], decode_tokens=0, extra_bytes=0, note="", ddp=True, phase_bytes=0,
               trainable=None):
    """
    One stage's budget on HARDWARE[preset]: training FLOPs = train_tokens x flops_per_token at `mfu` of every GPU's
    peak, plus decode_tokens generated at the assumed decode rate, over all the GPUs; peak memory per GPU = the
    larger of planned_memory at the micro-batch (0 tokens: no learner) and phase_bytes, the peak of a phase that
    never coexists with the learner (RL's rollouts, eval's generation); trainable: LoRA's adapter parameters when only
    they train (model.training_memory). Returns a dict (minutes, peak_gib, fits, ...)
    for print_plan and plan.py.
    """
    hw = HARDWARE[preset]
    learner = (planned_memory(config, micro_batch_tokens, logits_chunk, extra_bytes, ddp, trainable)
               if micro_batch_tokens else 0)
    peak = max(learner, phase_bytes)
    plan = dict(stage=stage, preset=preset, hardware=hw["name"], tokens=train_tokens, flops=train_tokens *
                flops_per_token, mfu=mfu, decode_tokens=decode_tokens, micro_batch_tokens=micro_batch_tokens,
                peak_gib=peak / GIB, fits=peak <= MEMORY_MARGIN * hw["memory"], note=note)
    plan["minutes"] = plan_minutes(plan, hw)
    return plan


def plan_minutes(plan, hardware):
    """Minutes of a stage_plan on `hardware` (a HARDWARE-like dict): FLOPs at the plan's MFU of every GPU's peak,
    plus its decoded tokens at the assumed decode rate, the work split evenly over the GPUs."""
    seconds = plan["flops"] / (hardware["gpus"] * hardware["peak_flops"] * plan["mfu"])
    return (seconds + plan["decode_tokens"] / (hardware["gpus"] * hardware["decode_tokens_per_s"])) / 60


def print_plan(plan):
    """The budget line of a stage's --dry-run."""
    rate = HARDWARE[plan["preset"]]["decode_tokens_per_s"]
    decode = (f" + {plan['decode_tokens'] / 1e6:,.1f}M tokens decoded at {rate:,} tok/s/GPU (assumed)"
              if plan["decode_tokens"] else "")
    print0(f"plan on {plan['hardware']}: {plan['tokens'] / 1e6:,.1f}M tokens, {plan['flops']:.2e} FLOPs at "
           f"{plan['mfu']:.0%} MFU (assumed){decode} = ~{plan['minutes']:.0f} min | peak "
           f"{plan['peak_gib']:.1f} GiB per GPU"
           + (f" at {plan['micro_batch_tokens']:,}-token micro-batches" if plan["micro_batch_tokens"] else "") + " "
           f"({'fits' if plan['fits'] else 'DOES NOT FIT'} {MEMORY_MARGIN:.0%} of "
           f"{HARDWARE[plan['preset']]['memory'] / GIB:.1f} GiB)" + (f" | {plan['note']}" if plan["note"] else ""))

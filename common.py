"""
Shared plumbing for every stage: device and dtype, torchrun/DDP set-up, rank-0 printing, wandb-or-nothing
logging, atomic checkpoints, the run directory and the report.

Run directory ($NANOPOST_HOME, default ~/.cache/nanopost):
    tokenizer/                  the trained tokenizer (tokenizer.py)
    checkpoints/<stage>/        base, sft, dpo, rl: one folder per saved step plus a `latest` pointer
    report.jsonl                one JSON line of final metrics per stage run (append_report)
    report.md                   the report card rendered by eval.py
"""

import json
import os
import shutil
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
            raise RuntimeError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
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
    torch.manual_seed(seed)
    return is_ddp, rank, local_rank, world_size, device


def compute_cleanup():
    if dist.is_initialized():
        dist.barrier()
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
    """Default checkpoint folder of a stage: base, sft, dpo or rl."""
    return get_base_dir() / "checkpoints" / stage


# -----------------------------------------------------------------------------
# Checkpoints. A checkpoint is a folder step_000123/ holding model.pt, meta.json, an optional extra.pt
# (optimizer, data position, RNG: whatever a resume needs) and an optional tokenizer/ copy, so that
# `python engine.py --ckpt DIR` needs nothing else. Writes are atomic: the step folder is built under a
# temporary name and renamed into place, then the `latest` pointer file is replaced with os.replace.
# A crash at any moment leaves either the old pointer (previous checkpoint intact) or the new one (complete).


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


def save_checkpoint(ckpt_dir, step, model, meta, tokenizer=None, extra=None, keep=2):
    """
    Save `model`'s weights, `meta` (a JSON-able dict; the model config is added) and `extra` (any
    torch-saveable dict for resuming) as ckpt_dir/step_{step:06d}, point `latest` at it, and keep only the
    newest `keep` step folders. Call it on rank 0 only. Returns the step folder.
    """
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    model = _unwrap(model)
    meta = {**meta, "step": step, "model_config": asdict(model.config)}
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=ckpt_dir))
    torch.save(model.state_dict(), tmp / "model.pt")
    if extra is not None:
        torch.save(extra, tmp / "extra.pt")
    if tokenizer is not None:
        tokenizer.save(tmp / "tokenizer")
    _atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=2, default=str))
    final = ckpt_dir / name
    if final.exists():  # re-saving the same step (e.g. a resumed run ending where it was killed)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(ckpt_dir / "latest", name)
    steps = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve_checkpoint(ckpt_dir, step=None):
    """
    The step folder to load: ckpt_dir itself if it is one, else the given step, else the one `latest` names.
    Raises FileNotFoundError saying which stage to run when there is nothing there.
    """
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / "meta.json").exists():
        return ckpt_dir
    if step is not None:
        path = ckpt_dir / f"step_{step:06d}"
    elif (ckpt_dir / "latest").exists():
        path = ckpt_dir / (ckpt_dir / "latest").read_text().strip()
    else:
        raise FileNotFoundError(
            f"no checkpoint in {ckpt_dir}: run the stage that writes it first "
            f"(pretrain.py -> checkpoints/base, sft.py -> sft, dpo.py -> dpo, rl.py -> rl) or pass --ckpt")
    if not (path / "meta.json").exists():
        raise FileNotFoundError(f"checkpoint {path} is missing or incomplete (no meta.json)")
    return path


def has_checkpoint(ckpt_dir):
    ckpt_dir = Path(ckpt_dir)
    return (ckpt_dir / "meta.json").exists() or (ckpt_dir / "latest").exists()


def load_checkpoint(ckpt_dir, step=None, device="cpu"):
    """(model_state_dict, meta, extra_or_None) of a checkpoint; tensors are mapped to `device`."""
    path = resolve_checkpoint(ckpt_dir, step)
    meta = json.loads((path / "meta.json").read_text())
    model_state = torch.load(path / "model.pt", map_location=device, weights_only=True)
    extra = None
    if (path / "extra.pt").exists():
        extra = torch.load(path / "extra.pt", map_location=device, weights_only=True)
    return model_state, meta, extra


def load_model(ckpt_dir, device, step=None):
    """
    Rebuild the model and its tokenizer from a checkpoint folder: (model, tokenizer, meta), model in eval mode.
    The model is a GPT, or a ScalarHeadModel (GPT trunk + scalar head) when meta["reward_model"] is set (rm.py).
    """
    # Imported here: model.py and tokenizer.py are leaves that never import common.py, and keeping it that
    # way means any of them can be read (and forked) on its own.
    from model import GPT, GPTConfig, ScalarHeadModel
    from tokenizer import Tokenizer

    path = resolve_checkpoint(ckpt_dir, step)
    model_state, meta, _ = load_checkpoint(path, device=device)
    model = GPT(GPTConfig(**meta["model_config"]))
    if meta.get("reward_model"):
        model = ScalarHeadModel(model)
    model = model.to(device)
    model.load_state_dict(model_state, strict=True)
    model.eval()
    tokenizer = Tokenizer.load(path / "tokenizer")
    return model, tokenizer, meta


# -----------------------------------------------------------------------------
# Logging and the report


class Logger:
    """wandb when --run names a run, otherwise nothing leaves the machine ('dummy', the default)."""

    def __init__(self, run, config, project="nanopost"):
        self.wandb = None
        if run != "dummy" and get_dist_info()[1] == 0:
            import wandb

            self.wandb = wandb.init(project=project, name=run, config=config)

    def log(self, metrics, step):
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def finish(self):
        if self.wandb is not None:
            self.wandb.finish()


def append_report(record):
    """Append one stage's final metrics as a JSON line to $NANOPOST_HOME/report.jsonl (rank 0 only)."""
    if get_dist_info()[1] != 0:
        return
    record = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), **record}
    with open(get_base_dir() / "report.jsonl", "a") as f:
        f.write(json.dumps(record, default=float) + "\n")


def read_report():
    path = get_base_dir() / "report.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

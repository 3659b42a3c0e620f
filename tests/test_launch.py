"""
Launch lines: every flag of every script survives torchrun's own argument parser, and speedrun.sh's launch line
(the one it builds, not a copy) reaches the stage intact.

torchrun parses the words after the training script too: a script flag that is a prefix of two of its options
(`--run` of `--run-path` and `--run_path`) stops it with "ambiguous option" before any process starts.
"""

import argparse
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

import dpo
import eval as evaluation
import pretrain
import rm
import sft

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for p in [*ROOT.glob("*.py"), *ROOT.glob("bench/*.py")]
                 if 'if __name__ == "__main__":' in p.read_text() and "ArgumentParser(" in p.read_text())


class _Parsed(BaseException):
    """Raised from a patched parse_args to hand the script's parser back (a BaseException: run_cli lets it through)."""

    def __init__(self, parser):
        self.parser = parser


def script_parser(script, monkeypatch):
    """The argparse parser `python <script>` builds: the script runs as __main__ until it parses its arguments."""

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}  # run_cli catches them
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        m.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        m.setattr(sys, "argv", [script])
        m.syspath_prepend(str(ROOT / Path(script).parent))
        try:
            runpy.run_path(str(ROOT / script), run_name="__main__")
        except _Parsed as parsed:
            return parsed.parser
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
    raise AssertionError(f"{script} never parsed its arguments")


def torchrun_options():
    return [o for action in get_args_parser()._actions for o in action.option_strings]


def test_every_script_parses_arguments():
    assert {"pretrain.py", "sft.py", "dpo.py", "rl.py", "ppo.py", "rm.py", "eval.py", "merge.py", "serve.py",
            "bench/gpu_check.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_flag_is_a_prefix_of_a_torchrun_option(script, monkeypatch):
    """Stricter than torchrun's own rule (it refuses only a prefix of two options): a prefix of one option today is
    ambiguous as soon as torch adds its underscore spelling. --help is exempt: torchrun hands it to the script."""
    options = torchrun_options()
    flags = [f for action in script_parser(script, monkeypatch)._actions for f in action.option_strings
             if f not in ("-h", "--help")]
    clashes = {f: [o for o in options if o.startswith(f)] for f in flags}
    assert not {f: o for f, o in clashes.items() if o}, f"{script}: flags that torchrun may take for its own"
    for flag in flags:  # and torchrun's real parser hands each one to the script untouched
        parsed = get_args_parser().parse_args(["--nproc_per_node=2", script, flag, "1"])
        assert parsed.training_script_args == [flag, "1"]


def speedrun_launch(preset, nproc, tmp_path, path=None):
    """The launch line `speedrun.sh --choose` prints for a stage: (its output, launcher words, stage flags), run with
    this interpreter as $PYTHON; `path` replaces PATH and unsets $PYTHON, so speedrun.sh looks for one there."""
    env = {**os.environ, "PRESET": preset, "NANOPOST_FAKE_GPUS": f"{nproc}x81559",
           "NANOPOST_HOME": str(tmp_path), "PYTHON": sys.executable}
    if path is not None:
        env["PATH"] = path
        env.pop("PYTHON", None)
    out = subprocess.run(["bash", str(ROOT / "speedrun.sh"), "--choose"], env=env, capture_output=True, text=True,
                         check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("speedrun: stage launch: "))
    words = line.removeprefix("speedrun: stage launch: ").split()
    at = words.index("STAGE.py")
    return out, words[:at], words[at + 1:]


def test_speedrun_launch_line_reaches_the_stage(tmp_path):
    """The words speedrun.sh puts after `python -m torch.distributed.run` (torchrun) parse as torchrun's, and every
    stage gets its flags untouched."""
    _, launcher, flags = speedrun_launch("small", 1, tmp_path)
    assert launcher[1:3] == ["-m", "torch.distributed.run"] and "--wandb-run" in flags
    for script in ("pretrain.py", "sft.py", "dpo.py", "rl.py", "eval.py"):
        parsed = get_args_parser().parse_args(launcher[3:] + [script] + flags)
        assert parsed.training_script == script and parsed.training_script_args == flags


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_speedrun_runs_where_only_python3_exists(preset, tmp_path):
    """A stock Debian/Ubuntu has python3 and no `python`: speedrun.sh takes python3, says so, and launches every
    stage (and torchrun) with it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"  # this interpreter under the only name on PATH (a link would lose the venv)
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    for tool in ("bash", "dirname", "nproc", "cat"):
        (bin_dir / tool).symlink_to(subprocess.run(["which", tool], capture_output=True, text=True,
                                                   check=True).stdout.strip())
    out, launcher, _ = speedrun_launch(preset, 1 if preset == "small" else 0, tmp_path, path=str(bin_dir))
    assert f"speedrun: python: {python3} (" in out
    assert launcher[0] == str(python3)


# -----------------------------------------------------------------------------
# Numeric flags are checked before any work: an interval of 0 never reaches a `step % every`.


@pytest.mark.parametrize("entry, flag, value, need", [
    (pretrain.parse_args, "--log-every", "0", "> 0"), (pretrain.parse_args, "--eval-every", "-1", ">= 0"),
    (pretrain.parse_args, "--total-batch-size", "0", "> 0"), (sft.main, "--eval-every", "0", "> 0"),
    (sft.main, "--batch-size", "0", "> 0"), (sft.main, "--save-every", "-2", ">= 0"),
    (dpo.main, "--eval-every", "0", "> 0"), (dpo.main, "--epochs", "0", "> 0"), (rm.main, "--eval-every", "0", "> 0"),
    (rm.main, "--device-batch-size", "0", "> 0"), (evaluation.main, "--max-problems", "0", "> 0"),
    (evaluation.main, "--batch-size", "0", "> 0")])
def test_numeric_flags_are_refused_up_front(entry, flag, value, need, monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))  # empty: any stage that got past its flags would stop later
    with pytest.raises(ValueError, match=f"^{flag} must be {need}, got {value}$"):
        entry([flag, value])

"""
`python tasks.py prepare` on a machine without internet: data already in --dest is checked offline and kept; data
that is missing is named in one line, with how to bring it, whether HF_HUB_OFFLINE=1 says so or the hub is
unreachable. And validation reads by document, so every rank of a 2-node run gets some (row groups are too few).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import eval as evaluation
import tasks
from conftest import make_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    return tasks.write_stand_in_data(tmp_path_factory.mktemp("hub"), documents=12_000, rows=16)


def prepare_cli(dest, *flags, **env):
    """`python tasks.py prepare --dest dest`, with the hub's address pointed at a closed local port (offline)."""
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", **env}
    return subprocess.run([sys.executable, str(REPO / "tasks.py"), "prepare", "--dest", str(dest), *flags],
                          env=env, capture_output=True, text=True, timeout=120)


def test_complete_data_is_checked_offline_and_kept(stand_in):
    assert tasks.missing_data(stand_in, fineweb_shards=2) == []
    result = prepare_cli(stand_in, "--fineweb-shards", "2", HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stderr
    assert "already holds every split the presets read (checked offline)" in result.stdout


def test_missing_data_offline_is_one_line_naming_it(stand_in, tmp_path):
    dest = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(stand_in), str(dest)], check=True)
    (dest / "cais/mmlu/all/test.jsonl").unlink()
    (dest / "openai/gsm8k/main/train.jsonl").write_text("")
    for name in tasks.FINEWEB_FILES[2:]:  # what a small-preset run leaves: 2 of the 14 files
        (dest / tasks.FINEWEB_REPO / "sample/10BT" / name).unlink()
    assert tasks.missing_data(dest, fineweb_shards=2) == ["openai/gsm8k (main, train): no rows",
                                                          "cais/mmlu (all, test): no files"]
    for env in ({"HF_HUB_OFFLINE": "1"}, {}):  # said offline, or the hub unreachable
        result = prepare_cli(dest, **env)  # the full preset: every FineWeb-Edu file
        assert result.returncode == 1 and "Traceback" not in result.stderr
        line, = result.stderr.splitlines()
        assert line.startswith("tasks.py: error: ")
        for missing in ("cais/mmlu (all, test): no files", "openai/gsm8k (main, train): no rows",
                        "HuggingFaceFW/fineweb-edu (sample-10BT, train): 2 of 14 files (missing 002_00000.parquet "
                        "... 013_00000.parquet)",
                        "on a machine with internet and copy DIR"):
            assert missing in line
        assert ("HF_HUB_OFFLINE is set" in line) == bool(env) and ("cannot reach" in line) != bool(env)


def test_prepare_refuses_a_zero_shard_count(tmp_path):
    result = prepare_cli(tmp_path, "--fineweb-shards", "0")
    assert result.returncode == 1 and "--fineweb-shards must be > 0, got 0" in result.stderr


def test_validation_reaches_every_rank_of_sixteen(stand_in, monkeypatch):
    """12 row groups of 1,000 documents, 10 of them validation: by row group, ranks 10-15 would get none."""
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(stand_in))
    tokenizer = make_tokenizer()
    for rank in (0, 15):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "16")
        assert len(list(evaluation.validation_batches(tokenizer, "small", 1, 32, 16 * 32))) == 1

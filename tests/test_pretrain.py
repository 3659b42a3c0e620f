"""
Pretraining: the packing loader (BOS per document, exact restart, disjoint DDP shards, local parquet files), the
schedule, and pretrain.main run in-process on a 1-layer model: resume is bit-exact, a crash mid-save leaves the
previous checkpoint loadable, a NaN stops the run; torchrun with 2 processes matches 1 process (slow).
"""

import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import common
from engine import load_model
import pretrain
import tasks
from model import GPT, GPTConfig
from tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
# A 1-layer model (n_embd 64) on rows of 32 tokens: each step takes milliseconds.
SMALL = ["--depth", "1", "--max-seq-len", "32", "--device-batch-size", "2", "--total-batch-size", "128",
         "--eval-tokens", "128", "--sample-every", "0", "--log-every", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    Tokenizer.train(tasks.synthetic_documents(300, seed=0), 400).save(directory)
    return directory


@pytest.fixture
def home(tmp_path, monkeypatch, tokenizer_dir):
    """A fresh $NANOPOST_HOME holding the test tokenizer."""
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    shutil.copytree(tokenizer_dir, tmp_path / "tokenizer")
    return tmp_path


@pytest.fixture
def parquet_docs(tmp_path, monkeypatch):
    """A FineWeb-schema parquet file of 200 synthetic documents whose first 20 are the validation split."""
    monkeypatch.setattr(tasks, "FINEWEB_VAL_DOCS", 20)
    path = tmp_path / "docs.parquet"
    write_parquet(path, tasks.synthetic_documents(200, seed=1))
    return path


def write_parquet(path, texts, row_group_size=None):
    pq.write_table(pa.table({"text": texts, "id": [f"doc-{i}" for i in range(len(texts))]}), path,
                   row_group_size=row_group_size)


def run_main(argv, out):
    pretrain.main(SMALL + argv + ["--out", str(out)])
    return common.read_report()[-1]


def losses(output):
    """{step: training loss} from pretrain's progress lines."""
    return {int(s): float(v) for s, v in re.findall(r"step (\d+)/\d+ \| loss ([\d.]+)", output)}


# -----------------------------------------------------------------------------
# The packing loader


def test_batches_pack_documents_with_bos_and_shift_targets(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    docs = tasks.synthetic_documents(40, seed=0)
    stream = [t for ids in tok.encode(docs, prepend="<|bos|>") for t in ids]
    batches = list(tasks.pretraining_batches(tok, docs, batch_size=3, seq_len=16))
    rows_per_batch = 3 * 17
    assert len(batches) == len(stream) // rows_per_batch  # the tail that does not fill a batch is dropped
    for k, (x, y, _) in enumerate(batches):
        assert x.shape == y.shape == (3, 16)
        rows = torch.cat([x, y[:, -1:]], dim=1).flatten().tolist()
        assert rows == stream[k * rows_per_batch:(k + 1) * rows_per_batch]  # greedy: documents span rows
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert stream[0] == tok.bos_id and stream.count(tok.bos_id) == len(docs)


def test_batches_restart_exactly_from_position(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    docs = tasks.synthetic_documents(60, seed=0)
    full = list(tasks.pretraining_batches(tok, docs, 2, 24, encode_batch=7))
    for k in (0, 3, 10):
        resumed = list(tasks.pretraining_batches(tok, docs, 2, 24, start=full[k][2], encode_batch=5))
        assert len(resumed) == len(full) - k - 1
        for (x, y, position), (rx, ry, rposition) in zip(full[k + 1:], resumed):
            assert torch.equal(x, rx) and torch.equal(y, ry) and position == rposition


def test_ddp_shards_are_disjoint_documents(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    docs = [f"document {i}: " + text for i, text in enumerate(tasks.synthetic_documents(50, seed=2))]
    seen = []
    for rank in range(2):
        batches = tasks.pretraining_batches(tok, docs, 2, 32, rank=rank, world_size=2)
        text = tok.decode([t for x, y, _ in batches for row in torch.cat([x, y[:, -1:]], 1).tolist() for t in row])
        ids = [int(i) for i in re.findall(r"<\|bos\|>document (\d+):", text)]
        assert ids and all(i % 2 == rank for i in ids)
        assert ids == list(range(rank, 2 * len(ids), 2))  # in order, none skipped
        seen.append(set(ids))
    assert not seen[0] & seen[1]


def test_hub_loader_reads_local_parquet(tokenizer_dir, parquet_docs):
    tok = Tokenizer.load(tokenizer_dir)
    docs = tasks.synthetic_documents(200, seed=1)
    assert list(tasks.fineweb_texts("val", local=parquet_docs)) == docs[:20]
    x, _, _ = next(tasks.pretraining_batches(tok, tasks.fineweb_texts("train", local=parquet_docs), 1, 64))
    assert x[0].tolist() == tok.encode(docs[20], prepend="<|bos|>")[:64]


# -----------------------------------------------------------------------------
# The schedule


def test_lr_multiplier_trapezoid():
    # N = 10, warmup 2 steps, warmdown 4 steps: 1/2, 2/2, 1, 1, then (10 - s) / 4 for s = 6..9.
    assert [pretrain.lr_multiplier(s, 10, 0.2, 0.4) for s in range(10)] == [0.5, 1, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25]
    assert pretrain.lr_multiplier(0, 10, 0.0, 0.2) == 1.0
    assert pretrain.muon_momentum(0) == 0.85 and pretrain.muon_momentum(150) == pytest.approx(0.9)
    assert pretrain.muon_momentum(1000) == 0.95


# -----------------------------------------------------------------------------
# pretrain.main in-process


def test_tiny_run_learns_and_saves_a_loadable_checkpoint(home, capsys):
    record = run_main(["--num-iterations", "20", "--eval-every", "10", "--sample-every", "20"], home / "base")
    output = capsys.readouterr().out
    bpb = [float(v) for v in re.findall(r"\| val bpb ([\d.]+)", output)]
    assert len(bpb) == 3 and bpb[0] > bpb[1] > bpb[2] and bpb[2] < 0.6 * bpb[0]
    assert "sample: 'Question: What is 17 + 25?" in output
    assert record["stage"] == "pretrain" and record["tokens"] == 20 * 128
    assert record["val_bpb"] == pytest.approx(bpb[-1], abs=1e-4)
    model, tokenizer, meta = load_model(home / "base", "cpu")
    assert meta["finished"] and meta["step"] == 20 and tokenizer.vocab_size == model.config.vocab_size
    assert model.config.n_layer == 1 and model.config.n_embd == 64


class Killed(Exception):
    pass


def test_resume_is_bit_exact(home, parquet_docs, monkeypatch, capsys):
    argv = ["--data-files", str(parquet_docs), "--num-iterations", "8", "--eval-every", "4", "--save-every", "3"]
    uninterrupted = run_main(argv, home / "a")

    real_lr_multiplier = pretrain.lr_multiplier

    def dies_at_step_5(step, *args):
        if step == 5:
            raise Killed  # the process dies mid-run, two steps after the checkpoint of step 3
        return real_lr_multiplier(step, *args)

    monkeypatch.setattr(pretrain, "lr_multiplier", dies_at_step_5)
    with pytest.raises(Killed):
        run_main(argv, home / "b")
    monkeypatch.setattr(pretrain, "lr_multiplier", real_lr_multiplier)
    capsys.readouterr()
    resumed = run_main(argv + ["--resume"], home / "b")
    assert "resumed from" in capsys.readouterr().out

    assert resumed["train_loss"] == uninterrupted["train_loss"] and resumed["val_bpb"] == uninterrupted["val_bpb"]
    state_a, _, _ = common.load_checkpoint(home / "a")
    state_b, meta_b, _ = common.load_checkpoint(home / "b")
    assert meta_b["finished"] and all(torch.equal(state_a[k], state_b[k]) for k in state_a)

    run_main(argv + ["--resume"], home / "b")  # already finished: says so, trains nothing, reports nothing
    assert "already finished" in capsys.readouterr().out and len(common.read_report()) == 2


def test_crash_during_save_leaves_previous_checkpoint_loadable(home, parquet_docs, monkeypatch):
    argv = ["--data-files", str(parquet_docs), "--num-iterations", "6", "--eval-every", "6", "--save-every", "2"]
    real_save = torch.save

    def save_dies_in_step_4(obj, f, *args, **kwargs):
        path = Path(getattr(f, "name", f))  # common saves through a hashing file wrapper that knows its path
        if "step_000004" in str(path) and path.name == "extra.pt":
            f.write(b"half a checkpoint")
            raise OSError("No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_dies_in_step_4)
    with pytest.raises(OSError, match="No space left"):
        run_main(argv, home / "base")
    model_state, meta, extra = common.load_checkpoint(home / "base")
    assert meta["step"] == 2 and extra["data_positions"]
    GPT(GPTConfig(**meta["model_config"])).load_state_dict(model_state)
    assert not (home / "base" / "step_000004").exists()

    monkeypatch.setattr(torch, "save", real_save)
    assert run_main(argv + ["--resume"], home / "base")["steps"] == 6


@pytest.mark.parametrize("save_every", [1, 2])
def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(home, parquet_docs, monkeypatch, save_every):
    # From step 4 on the lr is NaN: the update of step 4 makes the weights NaN, so step 5 finds either NaN weights
    # when saving (save_every 1) or a NaN loss (save_every 2). Either way the run stops and step 4 stays the latest.
    real_lr_multiplier = pretrain.lr_multiplier
    monkeypatch.setattr(pretrain, "lr_multiplier",
                        lambda step, *args: float("nan") if step >= 4 else real_lr_multiplier(step, *args))
    argv = ["--data-files", str(parquet_docs), "--num-iterations", "8", "--eval-every", "8",
            "--save-every", str(save_every)]
    message = "non-finite weights at step 5" if save_every == 1 else "loss is nan at step 5"
    with pytest.raises(FloatingPointError, match=message):
        run_main(argv, home / "base")
    model_state, meta, _ = common.load_checkpoint(home / "base")
    assert meta["step"] == 4 and not meta["finished"]
    assert all(torch.isfinite(t).all() for t in model_state.values())
    assert not common.read_report()


# -----------------------------------------------------------------------------
# DDP: 2 processes (gloo) against 1 process with twice the gradient accumulation


def single_token_documents(tokenizer, count, length, seed=0):
    """Documents that encode to exactly `length` tokens: words that are single tokens, with a leading space."""
    words = [f" {w}" for w in tasks.NAMES + tasks.ITEMS + ["has", "more", "What", "Answer", "How", "many"]]
    words = [w for w in words if len(tokenizer.encode(w)) == 1]
    rng = random.Random(seed)
    docs = ["".join(rng.choice(words[:8]) if i % 2 else rng.choice(words) for i in range(length)) for _ in range(count)]
    assert all(len(ids) == length for ids in tokenizer.encode(docs))
    return docs


@pytest.mark.slow
def test_torchrun_two_processes_match_one_process_with_accumulation(home):
    # With every document exactly one row long (BOS + 32 tokens) and one row group per document, document i is row
    # i, so the 2 ranks together (rank r reads row groups r, r+2, ...) see the same rows per step as one process with
    # 2 accumulation steps. Only the order of the floating-point sums differs.
    tokenizer = Tokenizer.load(home / "tokenizer")
    path = home / "docs.parquet"
    write_parquet(path, single_token_documents(tokenizer, tasks.FINEWEB_VAL_DOCS + 200, 32), row_group_size=1)
    argv = [*SMALL, "--data-files", str(path), "--num-iterations", "6", "--eval-every", "6", "--save-every", "0"]
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    runs = {}
    for name, launcher in {"single": [], "ddp": ["-m", "torch.distributed.run", "--standalone",
                                                 "--nproc_per_node=2"]}.items():
        result = subprocess.run([sys.executable, *launcher, str(REPO / "pretrain.py"), *argv, "--out",
                                 str(home / name)], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = result.stdout
    assert "1 processes x 2 accumulation steps" in runs["single"]
    assert "2 processes x 1 accumulation steps" in runs["ddp"]
    single, ddp = losses(runs["single"]), losses(runs["ddp"])
    assert sorted(single) == list(range(6)) and single[5] < single[0] - 1.0
    assert ddp.keys() == single.keys()
    assert all(ddp[s] == pytest.approx(single[s], rel=1e-4) for s in single)
    # Not just the printed losses: the final weights, tensor by tensor, and the validation bits-per-byte (each rank
    # evaluates its half of the validation rows; the all-reduce must add up to the single process's number).
    state_single, meta_single, _ = common.load_checkpoint(home / "single")
    state_ddp, meta_ddp, _ = common.load_checkpoint(home / "ddp")
    assert state_single.keys() == state_ddp.keys()
    for key in state_single:
        torch.testing.assert_close(state_ddp[key], state_single[key], rtol=1e-4, atol=1e-5, msg=key)
    record_single, record_ddp = common.read_report()[-2:]
    assert (record_single["world_size"], record_ddp["world_size"]) == (1, 2)
    assert record_ddp["val_bpb"] == pytest.approx(record_single["val_bpb"], rel=1e-5)
    assert meta_ddp["val_bpb"] == record_ddp["val_bpb"]


# -----------------------------------------------------------------------------
# Pretraining data read once, by the rank that needs it


def test_ranks_read_disjoint_row_groups_and_resume_seeks(tmp_path, monkeypatch):
    docs = [f"document {i}" for i in range(50)]
    path = tmp_path / "docs.parquet"
    write_parquet(path, docs, row_group_size=5)  # 10 row groups
    reads = []
    real_read = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, g, **kw: reads.append(g) or real_read(self, g, **kw))
    train = tasks.ParquetDocuments([path], first=10)  # documents 0-9 are the validation split
    shards = [list(train.shard(rank, 2)) for rank in range(2)]
    assert [i for i, _ in shards[0]] == [10, 11, 12, 13, 14, 20, 21, 22, 23, 24, 30, 31, 32, 33, 34, 40, 41, 42, 43, 44]
    assert sorted(i for shard in shards for i, _ in shard) == list(range(10, 50))  # disjoint, and nothing lost
    assert all(text == docs[i] for shard in shards for i, text in shard)
    assert sorted(reads) == list(range(2, 10))  # the validation row groups were never read for training
    reads.clear()
    assert [i for i, _ in train.shard(1, 2, start=37)] == [37, 38, 39, 45, 46, 47, 48, 49]
    assert reads == [7, 9]  # a resume seeks: the row groups before its position are not read


def test_data_dir_accepts_the_hub_snapshot_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(tmp_path))
    fineweb = tmp_path / tasks.FINEWEB_REPO / "sample" / "10BT"
    fineweb.mkdir(parents=True)
    write_parquet(fineweb / "000_00000.parquet", [f"a{i}" for i in range(6)])
    write_parquet(fineweb / "001_00000.parquet", [f"b{i}" for i in range(6)])
    gsm8k = tmp_path / "openai" / "gsm8k" / "main"
    gsm8k.mkdir(parents=True)
    for split in ("train", "test"):
        pq.write_table(pa.table({"question": [f"{split} q"], "answer": ["1 + 1 = <<1+1=2>>2.\n#### 2"]}),
                       gsm8k / f"{split}-00000-of-00001.parquet")
    monkeypatch.setattr(tasks, "FINEWEB_VAL_DOCS", 4)
    assert list(tasks.fineweb_texts("val")) == ["a0", "a1", "a2", "a3"]
    assert list(tasks.fineweb_texts("train")) == ["a4", "a5"] + [f"b{i}" for i in range(6)]
    assert tasks.GSM8K("test")[0]["messages"][0]["content"] == "test q"


def test_empty_data_dir_is_a_clear_error_not_a_download(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"NANOPOST_DATA_DIR={tmp_path}.*tasks.py prepare"):
        tasks.fineweb_texts("train")
    with pytest.raises(FileNotFoundError, match="openai/gsm8k"):
        tasks.GSM8K("train")


def test_pretraining_fineweb_without_local_files_asks_for_prepare(monkeypatch):
    monkeypatch.delenv("NANOPOST_DATA_DIR", raising=False)
    monkeypatch.setattr(tasks, "load_rows", lambda *a, **k: pytest.fail("must not stream from the hub"))
    with pytest.raises(FileNotFoundError, match="tasks.py prepare"):
        pretrain.training_texts("fineweb", "train")

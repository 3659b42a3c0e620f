"""
Bad input gets a clear error, checked by its exact message: pretraining resumed with other flags, a batch that is
not a multiple, running out of data, a too-small validation split; SFT with nothing to train; the DPO and RL flag
combinations that cannot run; an odd head dim; a sequence past the rotary tables; a tokenizer whose special tokens
do not match; an incomplete checkpoint; and checkpoint pruning (keep=2 keeps exactly the two newest).
"""

import json
import re

import pytest
import torch

import common
from engine import load_model
import dpo
import pretrain
import rl
import rollout
import sft
import tasks
from conftest import make_model, make_tokenizer
from model import GPTConfig
from test_pretrain import SMALL, home, parquet_docs, tokenizer_dir, write_parquet  # noqa: F401 (fixtures)
from test_rl import LengthParity
from tokenizer import CONFIG_FILE, Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def pretrain_main(argv, out):
    pretrain.main(SMALL + argv + ["--out", str(out)])


# -----------------------------------------------------------------------------
# Pretraining


def test_pretrain_resume_with_other_flags(home, parquet_docs, monkeypatch):
    argv = ["--data-files", str(parquet_docs), "--num-iterations", "6", "--eval-every", "6", "--save-every", "2"]
    real = pretrain.lr_multiplier

    def dies_at_step_3(step, *args):
        if step == 3:
            raise KeyboardInterrupt
        return real(step, *args)

    monkeypatch.setattr(pretrain, "lr_multiplier", dies_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        pretrain_main(argv, home / "base")
    monkeypatch.setattr(pretrain, "lr_multiplier", real)
    message = (f"{home / 'base'} was written by a different run (model, batch, horizon or number of processes "
               "differ); resume with the same flags or pick another --out")
    for changed in (["--num-iterations", "8"], ["--total-batch-size", "256"], ["--depth", "2"]):
        with pytest.raises(ValueError, match=re.escape(message)):
            pretrain_main([*argv, *changed, "--resume"], home / "base")


def test_pretrain_batch_not_a_multiple(home):
    with pytest.raises(ValueError, match=re.escape(
            "--total-batch-size 100 is not a multiple of device batch x seq len x processes = 64; change one of them")):
        pretrain_main(["--total-batch-size", "100", "--num-iterations", "2"], home / "base")


def test_pretrain_runs_out_of_data(home, monkeypatch):
    monkeypatch.setattr(tasks, "FINEWEB_VAL_DOCS", 20)
    path = home / "docs.parquet"
    write_parquet(path, tasks.synthetic_documents(30, seed=1))  # 10 training documents: a few steps' worth
    with pytest.raises(RuntimeError, match=r"ran out of training documents at step \d+: the corpus is smaller than "
                                           r"12,800,000 tokens; lower --num-iterations or add data"):
        pretrain_main(["--data-files", str(path), "--num-iterations", "100000", "--eval-every", "0"], home / "base")


def test_pretrain_validation_split_too_small(home, parquet_docs):
    with pytest.raises(ValueError, match=re.escape(
            "the validation split has fewer than --eval-tokens 1000000 tokens; lower it")):
        pretrain_main(["--data-files", str(parquet_docs), "--num-iterations", "2", "--eval-tokens", "1000000"],
                      home / "base")


# -----------------------------------------------------------------------------
# SFT, DPO, RL


def test_sft_batch_with_no_trained_tokens(tokenizer):
    ids = tokenizer.encode("no answer here", prepend="<|bos|>")
    batch = tasks.collate([(ids, [0] * len(ids))], tokenizer.bos_id)
    with pytest.raises(ValueError, match=re.escape(
            "this step's batch has no trained tokens: every conversation's mask is 0")):
        sft.backward_sft_loss(make_model(tokenizer), [batch], "cpu")


DPO_ARGS = ["--device", "cpu", "--pairs", "synthetic", "--train-pairs", "16", "--eval-pairs", "8", "--beta", "0.1",
            "--check-problems", "2", "--check-samples", "1", "--max-new-tokens", "4", "--sft-weight", "0"]


@pytest.fixture
def sft_checkpoint(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    path = tmp_path / "sft"
    common.save_checkpoint(path, 1, make_model(tokenizer), {"stage": "sft"}, tokenizer=tokenizer)
    return path


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "8", "--device-batch-tokens", "100"],
     "--device-batch-tokens 100 cannot hold a pair of two --max-seq-len 128 sides; raise it to 256 or lower "
     "--max-seq-len"),
    (["--batch-size", "32", "--device-batch-tokens", "2048"],
     "16 training pairs per rank are fewer than one step's 32; generate more (--train-pairs, --samples) or lower "
     "--batch-size"),
    (["--batch-size", "8", "--device-batch-tokens", "2048", "--loss-type", "hinge", "--label-smoothing", "0.1"],
     "label_smoothing does not apply to loss_type 'hinge'; use sigmoid (cDPO), robust, sigmoid_norm or simpo"),
    (["--batch-size", "8", "--device-batch-tokens", "2048", "--label-smoothing", "0.5"],
     "label_smoothing must be in [0, 0.5), got 0.5"),
])
def test_dpo_flag_combinations(sft_checkpoint, tmp_path, flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        dpo.main(DPO_ARGS + ["--ckpt", str(sft_checkpoint), "--out", str(tmp_path / "dpo")] + flags)


RL_ARGS = ["--preset", "tiny", "--device", "cpu", "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "8",
           "--eval-problems", "2", "--eval-samples", "2", "--num-steps", "1"]


def test_rl_prompts_not_divisible_by_ranks(sft_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(rl, "compute_init", lambda device, seed: (True, 0, 0, 3, torch.device("cpu")))
    with pytest.raises(ValueError, match=re.escape("--prompts-per-step 4 is not divisible by the 3 ranks")):
        rl.main(RL_ARGS + ["--ckpt", str(sft_checkpoint), "--out", str(tmp_path / "rl")])


def test_rl_overlong_buffer_longer_than_the_budget(sft_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(rollout, "task_by_name", lambda name, split, size: LengthParity(split, size=16))
    with pytest.raises(ValueError, match=re.escape("the overlong buffer must be in (0, max_tokens=8], got 9")):
        rl.main(RL_ARGS + ["--ckpt", str(sft_checkpoint), "--out", str(tmp_path / "rl"), "--overlong-buffer", "9"])


# -----------------------------------------------------------------------------
# Model, tokenizer, checkpoints


def test_odd_head_dim():
    with pytest.raises(ValueError, match=re.escape("head_dim=15 is odd; rotary embeddings rotate pairs of dims")):
        GPTConfig(sequence_len=32, vocab_size=300, n_layer=1, n_head=4, n_kv_head=4, n_embd=60)


def test_sequence_longer_than_the_rotary_tables(tokenizer):
    model = make_model(tokenizer)
    T = model.rotary_len + 1
    with pytest.raises(ValueError, match=re.escape(
            f"sequence of {T} tokens is longer than the rotary tables ({model.rotary_len})")):
        model(torch.zeros(1, T, dtype=torch.long))


def test_tokenizer_with_mismatched_special_tokens(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / CONFIG_FILE).read_text())
    special = config["special_tokens"]
    special["<|python_start|>"], special["<|output_start|>"] = special["<|output_start|>"], special["<|python_start|>"]
    swapped = special  # an older tokenizer.py that numbered two special tokens the other way round
    (tmp_path / "tok" / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(
            f"{tmp_path / 'tok' / CONFIG_FILE} lists special tokens {swapped}, but this tokenizer.py assigns "
            f"{tokenizer.special_tokens}; retrain with `python tokenizer.py`")):
        Tokenizer.load(tmp_path / "tok")


def test_incomplete_checkpoint(tokenizer, tmp_path):
    model = make_model(tokenizer)
    common.save_checkpoint(tmp_path, 1, model, {"stage": "base"})
    (tmp_path / "step_000002").mkdir()  # a crash left a step folder without meta.json, and `latest` points at it
    torch.save(model.state_dict(), tmp_path / "step_000002" / "model.pt")
    (tmp_path / "latest").write_text("step_000002")
    with pytest.raises(common.CheckpointError, match=re.escape(
            f"checkpoint {tmp_path / 'step_000002'} is missing or incomplete (no meta.json); the newest whole "
            f"checkpoint is {tmp_path / 'step_000001'}")):
        common.load_checkpoint(tmp_path)
    with pytest.raises(common.CheckpointError,
                       match=re.escape(f"no checkpoint in {tmp_path / 'empty'}: run the stage")):
        load_model(tmp_path / "empty", "cpu")


def test_keep_two_prunes_all_but_the_two_newest(tokenizer, tmp_path):
    model = make_model(tokenizer)
    for step in (1, 2, 3, 4):
        common.save_checkpoint(tmp_path, step, model, {"stage": "base"}, keep=2)
        assert len(list(tmp_path.glob("step_*"))) == min(step, 2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000003", "step_000004"]
    assert (tmp_path / "latest").read_text() == "step_000004"
    assert common.load_checkpoint(tmp_path, step=3)[1]["step"] == 3
    assert not list(tmp_path.glob(".step_*"))  # no temporary folder left behind

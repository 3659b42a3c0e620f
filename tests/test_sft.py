"""
sft.py: the masked loss against a hand computation, its normalisation across micro-batches (and, under torchrun,
across ranks), skipped rows, and an end-to-end tiny run from a base checkpoint.

    python -m pytest -q tests/test_sft.py
    torchrun --nproc_per_node=2 tests/test_sft.py      # the DDP check on its own (test_ddp_... runs it)
"""

import json
import math
import os
import subprocess
import sys
from functools import partial
from itertools import islice
from pathlib import Path

import pytest
import torch

import common
from engine import load_model
import sft
import tasks
from conftest import free_port, make_model, make_tokenizer




@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def conversations(n, seed=0):
    task = tasks.SyntheticTask("train", size=n, seed=seed)
    return [task[i] for i in range(n)]


def test_masked_loss_equals_hand_computed(tokenizer):
    model = make_model(tokenizer)
    conversation = conversations(8)[3]  # a story: text, two calculator calls and their (untrained) outputs
    ids, mask = tokenizer.render_conversation(conversation)
    assert 0 in mask[1:] and 1 in mask
    loss, num_targets, _ = sft.backward_sft_loss(model, [tasks.collate([(ids, mask)], tokenizer.bos_id)], "cpu")

    # By hand: -log softmax(logits at t)[ids[t + 1]] for every t whose next token is a training target.
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]  # (T, V)
    terms = []
    for t in range(len(ids) - 1):
        if mask[t + 1]:
            row = logits[t].double().tolist()
            log_z = math.log(sum(math.exp(v) for v in row))
            terms.append(log_z - row[ids[t + 1]])
    assert num_targets == len(terms) == sum(mask[1:])
    assert loss == pytest.approx(sum(terms) / len(terms), rel=1e-5)


def gradients(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("split", [[1, 5], [3, 3], [4, 1, 1]])
def test_loss_normalisation_is_invariant_to_micro_batch_split(tokenizer, split):
    rows = [tokenizer.render_conversation(c) for c in conversations(6)]
    assert len({sum(m) for _, m in rows}) > 2  # answers of different lengths: the weighting matters

    model = make_model(tokenizer)
    whole, count, _ = sft.backward_sft_loss(model, [tasks.collate(rows, tokenizer.bos_id)], "cpu")
    expected = gradients(model)

    model.zero_grad()
    bounds = [sum(split[:i]) for i in range(len(split) + 1)]
    micro = [tasks.collate(rows[a:b], tokenizer.bos_id) for a, b in zip(bounds, bounds[1:])]
    loss, count_split, _ = sft.backward_sft_loss(model, micro, "cpu")
    assert count_split == count
    assert loss == pytest.approx(whole, rel=1e-6)
    torch.testing.assert_close(gradients(model), expected, rtol=1e-4, atol=1e-7)

    # The per-micro-batch mean (averaged over micro-batches) weights tokens differently: it would not match.
    naive = sum(model(x, y).item() for x, y in micro) / len(micro)
    assert abs(naive - whole) > 1e-3


def test_too_long_and_malformed_rows_are_skipped_and_counted(tokenizer, tmp_path):
    good = conversations(4)
    bad = [
        {"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "hi"}]},  # nothing to train on
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
        {"text": "not a conversation"},
    ]
    long = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    gsm8k_file = tmp_path / "gsm8k.jsonl"
    gsm8k_file.write_text("\n".join(json.dumps(row) for row in [
        {"question": "What is 2+3?", "answer": "2+3=<<2+3=5>>5\n#### 5"},
        {"question": "No final line?", "answer": "it is 5"},
        {"question": "No answer column"},
    ]) + "\n")
    mixture = tasks.TaskMixture([("chat", good + bad + [long], None),
                                 ("gsm8k", tasks.GSM8K(local=gsm8k_file), None)], seed=0)
    assert "chat" in mixture.summary() and "gsm8k" in mixture.summary()
    rows, skipped = tasks.prepare_rows(mixture, lambda c: sft.render_for_sft(tokenizer, c, 128), range(len(mixture)))
    assert skipped == {("chat", "malformed"): 4, ("chat", "too long"): 1, ("gsm8k", "malformed"): 2}
    assert len(rows) == len(good) + 1
    assert all(len(ids) <= 128 and sum(mask) > 0 for ids, mask in rows)


def test_mixture_counts_repeat_and_interleave():
    a, b = conversations(3), conversations(2, seed=1)
    mixture = tasks.TaskMixture([("a", a, 7), ("b", b, None)], seed=1)
    names = [mixture[k][0] for k in range(len(mixture))]
    assert names.count("a") == 7 and names.count("b") == 2
    assert [mixture.source(k) for k in range(len(mixture))] == names
    assert names != sorted(names)  # shuffled together, not source after source
    assert tasks.TaskMixture([("a", a, 7), ("b", b, None)], seed=1).index == mixture.index


def test_sft_replay_mixes_pretraining_text(tokenizer):
    rows = [tokenizer.render_conversation(c) for c in conversations(4)]
    length = max(len(ids) for ids, _ in rows)
    # A budget of 8 rows: with --replay-frac 0.5 the 4 conversations get half of it, the replay rows the other half.
    micro, _, replay_rows = sft.micro_batches_of(rows, 0, 4, 8 * (length - 1), tokenizer.bos_id,
                                                 sft.replay_tokens(tokenizer, "tiny"), 0.5)
    (x, y), = micro
    assert x.shape == (8, length - 1) and replay_rows == [4]  # 4 conversations + 4 replay rows, as long as the longest

    # The replay rows are the pretraining corpus itself, packed from its first document on (<|bos|> + text, ...),
    # and every one of their tokens is a target (mask all ones); the conversations keep their masks.
    documents = tasks.pretraining_texts("tiny", "train")
    stream = [t for _, text in zip(range(40), documents) for t in tokenizer.encode(text, prepend="<|bos|>")]
    replayed = torch.cat([x[4:], y[4:, -1:]], dim=1).flatten().tolist()
    assert replayed == stream[:4 * length]
    assert bool((y[4:] == x[4:].roll(-1, dims=1))[:, :-1].all()) and bool((y[4:] >= 0).all())
    assert bool((y[:4] == -1).any())
    (conversation_only,), _, _ = sft.micro_batches_of(rows, 0, 4, 4 * (length - 1), tokenizer.bos_id)
    assert torch.equal(conversation_only[1], y[:4])

    # The loss is one mean over all trained tokens, replay tokens included.
    _, num_targets, _ = sft.backward_sft_loss(make_model(tokenizer), [(x, y)], "cpu")
    assert num_targets == int((conversation_only[1] >= 0).sum()) + 4 * (length - 1)

    # --resume continues the stream where it stopped; the row count makes f of all rows replay.
    assert list(islice(sft.replay_tokens(tokenizer, "tiny", skip=4 * length), 50)) == stream[4 * length:4 * length + 50]
    assert [sft.replay_rows_for(16, f) for f in (0.0, 0.1, 0.25, 0.5)] == [0, 2, 5, 16]
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="--replay-frac"):
            sft.replay_rows_for(16, bad)


def test_sft_replay_is_per_step_whatever_the_micro_batch_budget(tokenizer):
    """A GPU's largest micro-batch and a CPU's small one replay the same rows: f of the step's rows, each as long as
    the step's longest conversation, closing the step's last micro-batches."""
    rows = [tokenizer.render_conversation(c) for c in conversations(16)]
    length = max(len(ids) for ids, _ in rows)

    def replayed(budget):
        micro, _, replay_rows = sft.micro_batches_of(rows, 0, 16, budget, tokenizer.bos_id,
                                                     sft.replay_tokens(tokenizer, "tiny"), 0.25)
        assert sum(x.size(0) for x, _ in micro) == 16 + sft.replay_rows_for(16, 0.25) == 21
        assert all(x.numel() <= budget for x, _ in micro)
        assert replay_rows[-1] > 0 and all(r == 0 for r in replay_rows[:len(replay_rows) - sum(map(bool, replay_rows))])
        return torch.cat([x[x.size(0) - r:] for (x, _), r in zip(micro, replay_rows) if r]), len(micro)

    whole, one = replayed(21 * (length - 1))
    small, many = replayed(2 * (length - 1))
    assert one == 1 and many > 5
    assert whole.shape == (5, length - 1) and torch.equal(whole, small)


def save_base(home, tokenizer):
    model = make_model(tokenizer)
    common.save_checkpoint(home / "checkpoints" / "base", 1, model, {"stage": "base"}, tokenizer=tokenizer)


TINY_ARGS = ["--preset", "tiny", "--train-rows", "48", "--batch-size", "16", "--device-batch-tokens", "1024",
             "--eval-rows", "16", "--check-problems", "4", "--check-samples", "2", "--max-new-tokens", "16",
             "--eval-every", "2"]


def test_main_tiny_trains_saves_reports_and_resumes(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    save_base(tmp_path, tokenizer)
    sft.main(TINY_ARGS + ["--device", "cpu"])
    out = capsys.readouterr().out
    assert "synthetic" in out and "3 steps" in out
    assert "micro-batches of <= 1,024 padded tokens" in out and "% padding" in out

    model, loaded_tokenizer, meta = load_model(tmp_path / "checkpoints" / "sft", "cpu")
    assert meta["finished"] and meta["stage"] == "sft" and meta["step"] == 3
    assert loaded_tokenizer.vocab_size == tokenizer.vocab_size
    (record,) = common.read_report()
    assert record["stage"] == "sft"
    assert record["val_loss"] < record["val_loss_before"]  # 3 steps at a high rate already fit the format a little
    for key in ("format_rate", "stop_rate", "pass@1", "pass@1_t1"):
        assert 0.0 <= record[key] <= 1.0
    assert record["bpb_before"] > 0 and record["bpb"] > 0  # the pretraining validation text, before and after

    sft.main(TINY_ARGS + ["--device", "cpu", "--resume"])
    assert "already finished" in capsys.readouterr().out
    assert len(common.read_report()) == 1


def test_full_preset_mixture_runs_on_stand_in_hub_data(tokenizer, tmp_path, monkeypatch, capsys):
    # The full preset's data path (SmolTalk + GSM8K + synthetic) end to end, offline, on files of the hub schemas.
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(tasks.write_stand_in_data(tmp_path / "hub", documents=10, rows=16)))
    save_base(tmp_path, tokenizer)
    args = ["--preset", "full", "--device", "cpu", "--batch-size", "16", "--device-batch-tokens", "1024",
            "--num-steps", "2", "--eval-rows", "8", "--check-problems", "4", "--check-samples", "1",
            "--max-new-tokens", "16"]
    sft.main(args + ["--dry-run"])
    assert "dry run" in capsys.readouterr().out
    assert not common.read_report() and not common.has_checkpoint(tmp_path / "checkpoints" / "sft")
    sft.main(args)
    out = capsys.readouterr().out
    for line in ("smoltalk                        16 rows", "gsm8k                           32 rows (of 16)",
                 "synthetic                   10,000 rows", "2 steps of 16 conversations"):
        assert line in out
    assert common.read_report()[-1]["stage"] == "sft"


def test_micro_batches_keep_the_token_budget_and_report_padding(tokenizer):
    rows = [tokenizer.render_conversation(c) for c in conversations(12)]
    micro, padding, _ = sft.micro_batches_of(rows, 5, 12, 150, tokenizer.bos_id)
    assert len(micro) > 1 and all(x.numel() <= 150 for x, _ in micro)
    assert sum(x.size(0) for x, _ in micro) == 12
    real = sum(len(ids) - 1 for ids, _ in rows)
    assert padding == pytest.approx(1 - real / sum(x.numel() for x, _ in micro))
    # The loss of the step does not depend on how it is cut: one micro-batch of all 12 rows gives the same.
    model = make_model(tokenizer)
    loss, count, _ = sft.backward_sft_loss(model, micro, "cpu")
    whole, whole_count, _ = sft.backward_sft_loss(model, [tasks.collate(rows, tokenizer.bos_id)], "cpu")
    assert count == whole_count and loss == pytest.approx(whole, rel=1e-6)


# -----------------------------------------------------------------------------
# DDP: two ranks holding different micro-batches give the gradients of the whole batch in one process.


def ddp_check(out_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    _, rank, _, world_size, device = common.compute_init("cpu")
    tokenizer = make_tokenizer()
    rows = [tokenizer.render_conversation(c) for c in conversations(6)]
    model = make_model(tokenizer)
    # The loss in chunks of 16 positions (GPT.chunked_logits under activation checkpointing), checked under DDP against
    # the single process's whole logits below.
    model.forward = partial(model.forward, logits_chunk=16)
    # Rank 0 takes rows 0-3 in micro-batches of 1 and 3; rank 1 takes rows 4-5 in one micro-batch.
    mine = [rows[0:1], rows[1:4]] if rank == 0 else [rows[4:6]]
    micro = [tasks.collate(r, tokenizer.bos_id) for r in mine]
    loss, count, _ = sft.backward_sft_loss(DistributedDataParallel(model), micro, device)
    if rank == 0:
        torch.save({"loss": loss, "count": count, "grad": gradients(model)}, out_path)
    dist.barrier()
    common.compute_cleanup()


@pytest.mark.slow
def test_ddp_normalisation_matches_single_process(tokenizer, tmp_path):
    out = tmp_path / "ddp.pt"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
                    str(Path(__file__).resolve()), str(out)], check=True, env=env, timeout=300, cwd=root)
    result = torch.load(out, weights_only=True)

    model = make_model(tokenizer)  # the same tokenizer and weights: training and init are deterministic
    rows = [tokenizer.render_conversation(c) for c in conversations(6)]
    loss, count, _ = sft.backward_sft_loss(model, [tasks.collate(rows, tokenizer.bos_id)], "cpu")
    assert result["count"] == count
    assert result["loss"] == pytest.approx(loss, rel=1e-6)
    torch.testing.assert_close(result["grad"], gradients(model), rtol=1e-4, atol=1e-7)


if __name__ == "__main__":
    torch.set_num_threads(1)
    ddp_check(sys.argv[1])



"""
rm.py: the Bradley–Terry loss against hand-computed numbers, the scalar head read at each row's last token, and
the stage in-process on a real tiny model and tokenizer (trains, logs, saves a checkpoint load_model recognises).
"""

import argparse
import json

import pytest
import torch

import rm
from common import save_checkpoint
from engine import load_model
from conftest import make_model, make_tokenizer, sigterm_on_call
from model import ScalarHeadModel
from tasks import SyntheticTask, pad_sequences

# (chosen, rejected) scores and the Bradley–Terry loss -log sigma(margin) = log(1 + exp(-margin)) of each pair
SCORES = [(2.10, 0.40), (1.25, 0.90), (0.80, -0.60), (1.40, 0.55)]
LOSSES = [0.1678, 0.5334, 0.2204, 0.3559]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def test_bradley_terry_hand_numbers():
    chosen, rejected = torch.tensor(SCORES).T
    losses = rm.reward_model_loss(chosen, rejected, center_coef=0.0)
    torch.testing.assert_close(losses, torch.tensor(LOSSES), atol=5e-5, rtol=0)
    assert losses.sum().item() == pytest.approx(1.2775, abs=1e-4)
    # the last pair reversed: its loss grows by exactly its margin, 1.40 - 0.55 = 0.85
    reversed_losses = rm.reward_model_loss(torch.tensor([2.10, 1.25, 0.80, 0.55]),
                                           torch.tensor([0.40, 0.90, -0.60, 1.40]), center_coef=0.0)
    assert reversed_losses.sum().item() == pytest.approx(2.1275, abs=1e-4)
    assert (reversed_losses.sum() - losses.sum()).item() == pytest.approx(0.85, abs=1e-6)


def test_centring_term_adds_c_times_the_squared_sum():
    chosen, rejected = torch.tensor(SCORES).T
    centred = rm.reward_model_loss(chosen, rejected, center_coef=1e-2)
    torch.testing.assert_close(centred - rm.reward_model_loss(chosen, rejected, center_coef=0.0),
                               1e-2 * (chosen + rejected) ** 2)
    # it is symmetric in the pair: a swap still costs exactly the margin
    swapped = rm.reward_model_loss(rejected, chosen, center_coef=1e-2)
    torch.testing.assert_close(swapped - centred, chosen - rejected)


def test_scores_are_read_at_each_rows_last_token(tokenizer):
    torch.manual_seed(0)
    model = ScalarHeadModel(make_model(tokenizer)).eval()
    torch.nn.init.normal_(model.head.weight)
    task = SyntheticTask("train", size=3)
    seqs = [tokenizer.render_conversation(task[i])[0] for i in range(3)]
    pair = ((seqs[0], None), (seqs[1], None))
    with torch.no_grad():
        chosen, rejected = rm.pair_scores(model, [pair], tokenizer.bos_id, "cpu")
        alone = [model(torch.tensor([s]))[0, -1] for s in seqs[:2]]  # unpadded, the last position
    torch.testing.assert_close(torch.stack([chosen[0], rejected[0]]), torch.stack(alone))
    ids, lengths = pad_sequences(seqs, pad_id=0)
    assert lengths.tolist() == [len(s) for s in seqs] and ids.shape == (3, max(lengths))


def test_rm_stage_trains_logs_and_saves_a_reward_model(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "home"))
    sft = tmp_path / "sft"
    save_checkpoint(sft, 0, make_model(tokenizer), {"stage": "sft"}, tokenizer=tokenizer)
    out = tmp_path / "rm"
    # static synthetic pairs: reference answer vs. one scripted mistake (no sampling: fast and deterministic)
    flags = ["--device", "cpu", "--ckpt", str(sft), "--out", str(out), "--pairs", "synthetic", "--train-pairs", "96",
             "--eval-pairs", "64", "--batch-size", "16", "--device-batch-size", "8", "--epochs", "2",
             "--eval-every", "6", "--lr-frac", "0.5"]
    rm.main(flags)
    text = capsys.readouterr().out
    assert "held-out pair accuracy" in text and "step   12/12" in text
    model, _, meta = load_model(out, "cpu")
    assert isinstance(model, ScalarHeadModel) and meta["reward_model"] and meta["finished"]
    record = json.loads((tmp_path / "home" / "report.jsonl").read_text().splitlines()[-1])
    assert record["stage"] == "rm" and {"pair_accuracy", "margin", "mean_score"} <= record.keys()
    assert record["pair_accuracy"] > 0.75, record  # the zero head starts at 0 (every pair tied)
    rm.main(flags + ["--resume"])
    assert "already finished" in capsys.readouterr().out


def test_ties_count_as_half_a_correct_pair(tokenizer):
    assert rm.pair_accuracy_sum(torch.tensor([2.0, 1.0, 0.5]), torch.tensor([1.0, 1.0, 0.7])).item() == 1.5
    model = ScalarHeadModel(make_model(tokenizer)).eval()  # the zero head: every pair tied
    task = SyntheticTask("train", size=4)
    seqs = [tokenizer.render_conversation(task[i]) for i in range(4)]
    metrics = rm.evaluate_pairs(model, [(seqs[0], seqs[1]), (seqs[2], seqs[3])], 2, 0.0, tokenizer.bos_id, "cpu")
    assert metrics["accuracy"] == 0.5


def test_rm_decontaminates_its_pairs_like_dpo(tokenizer, monkeypatch):
    import dpo
    import tasks
    pairs = tasks.preference_mixture("synthetic", "train", 40, 0)
    planted = [pairs[i][1]["chosen"]["messages"][0]["content"] for i in (3, 17)]  # two training prompts, as eval items
    monkeypatch.setattr(tasks, "evaluation_texts", lambda preset: planted)
    model = ScalarHeadModel(make_model(tokenizer))
    args = argparse.Namespace(preset="tiny", pairs="synthetic", task="synthetic", train_pairs=40, eval_pairs=8,
                              samples=2, max_new_tokens=8, temperature=1.0, seed=0, loss_type="sigmoid",
                              decontaminate=True)
    kept, counts, _ = rm.build_pairs(args, model, tokenizer, "train", 256)
    dpo_kept, dpo_counts, _ = dpo.build_pairs(args, model.gpt, tokenizer, "train", 256)
    assert counts == dpo_counts and counts["synthetic contaminated"] == 2 and len(kept) == len(dpo_kept) == 38
    planted_ids = [tokenizer.render_conversation(pairs[i][1]["chosen"])[0] for i in (3, 17)]
    assert not any(chosen[0] == ids for (chosen, _) in kept for ids in planted_ids)
    args.decontaminate = False
    assert len(rm.build_pairs(args, model, tokenizer, "train", 256)[0]) == 40


def test_sigterm_mid_training_exits_75_with_a_checkpoint_the_resume_finishes_identically(tokenizer, tmp_path,
                                                                                          monkeypatch, capsys,
                                                                                          stop_signals):
    import common

    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "home"))
    save_checkpoint(tmp_path / "sft", 0, make_model(tokenizer), {"stage": "sft"}, tokenizer=tokenizer)
    flags = ["--device", "cpu", "--ckpt", str(tmp_path / "sft"), "--pairs", "synthetic", "--train-pairs", "48",
             "--eval-pairs", "16", "--batch-size", "16", "--device-batch-size", "8", "--epochs", "1",
             "--eval-every", "2"]  # 3 steps
    rm.main(flags + ["--out", str(tmp_path / "a")])
    # SIGTERM arrives during step 2: the 6th loss, after the held-out evaluation's 2 and step 1's
    real, _ = sigterm_on_call(monkeypatch, rm, "reward_model_loss", 6)
    with pytest.raises(SystemExit) as stop:
        rm.main(flags + ["--out", str(tmp_path / "b")])
    assert stop.value.code == common.PREEMPTED_EXIT
    _, meta, extra = common.load_checkpoint(tmp_path / "b")
    assert meta["step"] == extra["step"] == 2 and not meta["finished"]
    monkeypatch.setattr(rm, "reward_model_loss", real)
    monkeypatch.setattr(common, "_stop_signal", None)
    rm.main(flags + ["--out", str(tmp_path / "b"), "--resume"])
    assert "resuming from step 2" in capsys.readouterr().out
    (a, meta_a, _), (b, meta_b, _) = (common.load_checkpoint(tmp_path / name) for name in ("a", "b"))
    assert meta_b["finished"] and meta_a["metrics"] == meta_b["metrics"]
    assert all(torch.equal(a[name], b[name]) for name in a)

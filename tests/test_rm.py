"""
rm.py: the Bradley–Terry loss against hand-computed numbers, the scalar head read at each row's last token, and
the stage in-process on a real tiny model and tokenizer (trains, logs, saves a checkpoint load_model recognises).
"""

import json

import pytest
import torch

import rm
from common import save_checkpoint
from engine import load_model
from conftest import make_model, make_tokenizer
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

"""
merge.py on real tiny checkpoints: a checkpoint merged with itself comes back unchanged (linear and SLERP), a linear
merge is the weighted sum, and checkpoints of other shapes, tokenizers or bases are refused with a clear error.
"""

import json

import pytest
import torch

import merge
from common import save_checkpoint
from engine import load_model
from conftest import make_model, make_tokenizer
from model import GPT, GPTConfig
from tokenizer import Tokenizer
from tasks import synthetic_documents


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def base_and_finetune(tokenizer, tmp_path_factory):
    """A base checkpoint and a 'fine-tune' of it (small perturbation of every weight)."""
    root = tmp_path_factory.mktemp("ckpts")
    base = make_model(tokenizer, seed=0)
    save_checkpoint(root / "base", 0, base, {"stage": "sft"}, tokenizer=tokenizer)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.05 * p.std() * torch.randn_like(p))
    save_checkpoint(root / "tuned", 0, base, {"stage": "rl"}, tokenizer=tokenizer)
    return root / "base", root / "tuned"


def states(*paths):
    return [load_model(p, "cpu")[0].state_dict() for p in paths]


@pytest.mark.parametrize("method", ["linear", "slerp"])
def test_merging_a_checkpoint_with_itself_gives_it_back(base_and_finetune, tmp_path, monkeypatch, method):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "home"))
    base, _ = base_and_finetune
    merge.main(["--ckpts", str(base), str(base), "--weights", "0.3", "0.7", "--method", method,
                "--out", str(tmp_path / "merged")])
    (original,), (merged,) = states(base), states(tmp_path / "merged")
    for key in original:
        torch.testing.assert_close(merged[key], original[key], atol=1e-6, rtol=0)
    record = json.loads((tmp_path / "home" / "report.jsonl").read_text().splitlines()[-1])
    assert record["stage"] == "merge" and record["method"] == method


def test_linear_merge_is_the_weighted_sum(base_and_finetune, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "home"))
    base, tuned = base_and_finetune
    merge.main(["--ckpts", str(base), str(tuned), "--weights", "0.25", "0.75", "--out", str(tmp_path / "merged")])
    a, b = states(base, tuned)
    (merged,) = states(tmp_path / "merged")
    for key in a:
        torch.testing.assert_close(merged[key], 0.25 * a[key] + 0.75 * b[key])
    model, _, meta = load_model(tmp_path / "merged", "cpu")  # loadable like any checkpoint
    assert meta["stage"] == "merge" and isinstance(model, GPT)


def test_slerp_ends_are_the_inputs_and_the_middle_keeps_the_norm():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    torch.testing.assert_close(merge.slerp(a, b, 0.0), a)
    torch.testing.assert_close(merge.slerp(a, b, 1.0), b)
    torch.testing.assert_close(merge.slerp(a, b, 0.5), torch.tensor([2 ** -0.5, 2 ** -0.5]))  # linear gives norm 0.71


def test_refuses_bad_weights_and_incompatible_checkpoints(base_and_finetune, tokenizer, tmp_path):
    base, tuned = base_and_finetune
    a, b = states(base, tuned)
    with pytest.raises(ValueError, match="sum to 1"):
        merge.merge_state_dicts([a, b], [0.5, 0.6])
    with pytest.raises(ValueError, match="exactly two"):
        merge.merge_state_dicts([a, b, a], [0.2, 0.3, 0.5], method="slerp")

    # another base: same shapes and tokenizer, independent initialisation
    save_checkpoint(tmp_path / "other_base", 0, make_model(tokenizer, seed=123), {"stage": "sft"}, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="do not share a base"):
        merge.main(["--ckpts", str(base), str(tmp_path / "other_base"), "--out", str(tmp_path / "m")])

    # another shape
    wide = GPT(GPTConfig(sequence_len=128, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_kv_head=2,
                         n_embd=128))
    save_checkpoint(tmp_path / "wide", 0, wide, {"stage": "sft"}, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="model config"):
        merge.main(["--ckpts", str(base), str(tmp_path / "wide"), "--out", str(tmp_path / "m")])

    # another tokenizer of the same vocabulary size
    other_tok = Tokenizer.train(synthetic_documents(300, seed=7)[::-1], vocab_size=tokenizer.vocab_size)
    save_checkpoint(tmp_path / "other_tok", 0, load_model(base, "cpu")[0], {"stage": "sft"}, tokenizer=other_tok)
    with pytest.raises(ValueError, match="different tokenizers"):
        merge.main(["--ckpts", str(base), str(tmp_path / "other_tok"), "--out", str(tmp_path / "m")])
    assert not (tmp_path / "m").exists()

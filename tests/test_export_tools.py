"""
The export in the tools people run small models with: mlx-lm loads `export.py --format mlx` and decodes greedily the
engine's tokens; lm-evaluation-harness scores `export.py`'s HF folder with the log-likelihoods eval.py computes.
Both packages are test-only dependencies (README's set-up); each test is skipped, saying why, where its package cannot
be imported.
"""

import json
import math
import sys

import pytest
import torch

import common
import eval as evaluation
import export
import pretrain
from conftest import ends_turn_sometimes, make_tokenizer
from engine import Engine
from model import GPT, GPTConfig


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny preset's model (default init, ends its turn now and then) saved as a checkpoint: (model, tok, folder)."""
    tokenizer = make_tokenizer()
    preset = pretrain.PRESETS["tiny"]
    torch.manual_seed(1)
    model = GPT(GPTConfig.from_depth(preset["depth"], tokenizer.vocab_size, preset["max_seq_len"])).eval()
    ends_turn_sometimes(model, tokenizer, weight=0.195)
    root = tmp_path_factory.mktemp("tools")
    common.save_checkpoint(root / "ckpt", 1, model, {"stage": "sft"}, tokenizer=tokenizer)
    return model, tokenizer, root


PROMPTS = ["What is 12 + 7?", "Tell me about cats.", "Count: 1 2 3", "Hi"]


def test_mlx_lm_loads_the_export_and_decodes_the_engines_greedy_tokens(checkpoint):
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx[cpu]' mlx-lm; the mlx-cpu "
                             "package alone has no mlx.core)")
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
    from mlx_lm.generate import generate_step

    model, tokenizer, root = checkpoint
    export.main(["--ckpt", str(root / "ckpt"), "--out", str(root / "mlx"), "--format", "mlx"])
    mlx_model, mlx_tokenizer = mlx_lm.load(str(root / "mlx"))
    export.main(["--ckpt", str(root / "ckpt"), "--out", str(root / "hf")])
    with pytest.raises(ValueError, match="parameters not in model"):  # the HF names: what --format mlx is for
        mlx_lm.load(str(root / "hf"))
    engine = Engine(model, tokenizer)
    stopped = 0
    for text in PROMPTS:
        prompt = tokenizer.render_for_completion({"messages": [{"role": "user", "content": text}]})
        assert mlx_tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True) \
            == prompt
        ours = engine.generate([prompt], max_tokens=24, temperature=0.0)[0][0]
        theirs = [int(token) for token, _ in zip(
            (t for t, _ in generate_step(mx.array(prompt), mlx_model, max_tokens=len(ours.tokens))), ours.tokens)]
        assert theirs == ours.tokens, text
        stopped += ours.finish == "stop"
        with torch.no_grad():
            logits = model(torch.tensor([prompt]))[0]
        diff = float((torch.tensor(mlx_model(mx.array([prompt]))[0].tolist()) - logits).abs().max())
        print(f"mlx-lm vs model.py on {text!r}: max |logit difference| {diff:.2g}")
        assert diff < 1e-2  # mlx-lm's RMSNorm epsilon is 1e-5, model.py's float32's (1.2e-7)
    assert stopped  # at least one answer ends with <|assistant_end|> in both

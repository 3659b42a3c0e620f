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
from conftest import make_tokenizer, tiny_preset_model
from engine import Engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """conftest.tiny_preset_model as a checkpoint: (model, tokenizer, root)."""
    tokenizer = make_tokenizer()
    model = tiny_preset_model(tokenizer)
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


MC_ITEMS = [  # eval.py's multiple-choice items (tasks.MultipleChoice's schema)
    {"question": "What is 3 + 4?", "choices": ["7", "8", "12", "1"], "answer": 0, "subject": "math"},
    {"question": "Which animal barks?", "choices": ["a cat", "a dog", "a fish"], "answer": 1, "subject": "animals"},
    {"question": "The sky on a clear day is", "choices": ["green", "blue", "red", "loud"], "answer": 1,
     "subject": "nature"},
    {"question": "Count: 1 2 3 ...", "choices": ["4", "five", "3 2 1"], "answer": 0, "subject": "math"},
    {"question": "naïve café? 日本", "choices": ["yes", "no"], "answer": 1, "subject": "misc"},
]


@pytest.mark.slow
def test_lm_eval_on_the_export_gives_eval_pys_log_likelihoods(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_XET_HIGH_PERFORMANCE", "0")  # lm_eval sets it unless set: removed again after the test
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'lm-eval[hf]')")
    pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate (pip install 'lm-eval[hf]')")
    import lm_eval
    from lm_eval.tasks import TaskManager

    model, tokenizer, root = checkpoint
    export.main(["--ckpt", str(root / "ckpt"), "--out", str(root / "hf-lm-eval")])
    data = tmp_path / "toy_mc.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in MC_ITEMS))
    # The harness's multiple-choice format; the context starts with <|bos|> as eval.py's does (the exported
    # tokenizer adds none by itself, and the harness encodes a leading "<|bos|>" as that special token).
    (tmp_path / "toy_mc.yaml").write_text(
        "task: toy_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"<|bos|>Question: {{question}}\\nAnswer:\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\ntarget_delimiter: \" \"\nmetric_list:\n  - metric: acc\n")
    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={root / 'hf-lm-eval'},dtype=float32",
                                      tasks=["toy_mc"], batch_size=4, device="cpu", log_samples=True,
                                      task_manager=TaskManager(include_path=str(tmp_path)))
    samples = sorted(results["samples"]["toy_mc"], key=lambda s: s["doc_id"])
    theirs = [[float(ll) for ll, _ in sample["filtered_resps"]] for sample in samples]

    requests = []
    for item in MC_ITEMS:
        context, continuations = evaluation.base_prompt(item, [], "continuation")
        requests += [(tokenizer.encode(context, prepend="<|bos|>"), tokenizer.encode(text)) for text in continuations]
    scores = evaluation.continuation_logprobs(model, requests, "cpu")
    ours, at = [], 0
    for item in MC_ITEMS:
        ours.append(scores[at:at + len(item["choices"])])
        at += len(item["choices"])
    diff = max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y))
    print(f"lm-eval vs eval.py: max |log-likelihood difference| {diff:.2g} over {len(requests)} choices")
    assert [len(x) for x in theirs] == [len(x) for x in ours] and diff < 1e-4
    acc = evaluation.evaluate_multiple_choice(model, tokenizer, MC_ITEMS, "continuation")["acc"]
    assert results["results"]["toy_mc"]["acc,none"] == pytest.approx(acc)

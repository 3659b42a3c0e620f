"""
CORE (core.py): the prompts, the scored spans, the centred average against hand computations; a bundle of the real
format written here, scored end to end by eval.py and shown on the report card; the bundle's download resumed from
a local server.
"""

import http.server
import io
import json
import os
import random
import threading
import zipfile

import pytest
import torch

import common
import core
import eval as evaluation
import tasks
from conftest import make_model, make_tokenizer, scripted_model


def test_centred_accuracy_and_core_by_hand():
    assert core.centred_accuracy(0.5, 0.25) == pytest.approx(1 / 3)
    assert core.centred_accuracy(0.25, 0.25) == 0 and core.centred_accuracy(0.1, 0.0) == pytest.approx(0.1)
    centred, score = core.core_score({"a": 0.5, "b": 0.75, "c": 0.2}, {"a": 0.25, "b": 0.5, "c": 0.0})
    assert centred == pytest.approx({"a": 1 / 3, "b": 0.5, "c": 0.2})
    assert score == pytest.approx((1 / 3 + 0.5 + 0.2) / 3)


def test_prompts_are_nanochats_templates():
    shot = {"query": "Q1", "choices": ["x", "y"], "gold": 1}
    assert core.render_prompts("multiple_choice", {"query": "Q2", "choices": ["a", "b"], "gold": 0}, " ", [shot]) == \
        ["Q1 y\n\nQ2 a", "Q1 y\n\nQ2 b"]
    shot = {"context_options": ["C1", "C2"], "continuation": "end.", "gold": 0}
    assert core.render_prompts("schema", {"context_options": ["D1", "D2"], "continuation": "fin.", "gold": 1}, " ",
                               [shot]) == ["C1 end.\n\nD1 fin.", "C1 end.\n\nD2 fin."]
    shot = {"context": " ctx one  ", "continuation": "one"}
    assert core.render_prompts("language_modeling", {"context": "ctx two ", "continuation": "two"}, " ", [shot]) == \
        ["ctx one one\n\nctx two", "ctx one one\n\nctx two two"]
    assert core.render_prompts("language_modeling", {"context": "c", "continuation": "d"}, "\nAnswer:", []) == \
        ["c\nAnswer:", "c\nAnswer:d"]


def test_scored_spans_by_hand():
    assert core.common_length([[1, 2, 3], [1, 2, 4, 5]], "left") == 2
    assert core.common_length([[9, 2, 3], [1, 2, 3]], "right") == 2
    assert core.common_length([[1, 2], [1, 2, 3]], "left") == 2
    assert core.scored_spans("multiple_choice", [[1, 2, 3], [1, 2, 4, 5]]) == \
        ([[1, 2, 3], [1, 2, 4, 5]], [2, 2], [3, 4])
    assert core.scored_spans("schema", [[1, 7, 8, 3], [1, 9, 3]]) == ([[1, 7, 8, 3], [1, 9, 3]], [3, 2], [4, 3])
    assert core.scored_spans("language_modeling", [[1, 2], [1, 2, 5, 6]]) == ([[1, 2, 5, 6]], [2], [4])
    with pytest.raises(ValueError, match="not a prefix"):
        core.scored_spans("language_modeling", [[1, 3], [1, 2, 5]])


def test_fewshot_draw_excludes_the_item_and_is_seeded():
    items = list(range(20))
    for index in range(20):
        shots = core.fewshot_examples(items, index, 5)
        assert index not in shots and len(set(shots)) == 5
        assert shots == random.Random(1234 + index).sample([i for i in items if i != index], 5)
    assert core.fewshot_examples(items, 3, 0) == []


WORDS = ["red", "blue", "cat", "dog", "sun", "tree", "one", "two", "river", "stone", "seven", "plus"]


def write_bundle(root, rng, items=12):
    """A bundle of the real format (core.yaml, eval_meta_data.csv, eval_data/*.jsonl): one task of each type."""
    folder = root / "eval_bundle"
    (folder / "eval_data" / "sub").mkdir(parents=True)
    mc = [{"query": f"Question: {' '.join(rng.choices(WORDS, k=4))}?\nAnswer:", "choices": rng.sample(WORDS, 3),
           "gold": rng.randrange(3)} for _ in range(items)]
    schema = [{"context_options": [f"The {w} sat" for w in rng.sample(WORDS, 3)], "continuation": "on a stone.",
               "gold": rng.randrange(3)} for _ in range(items)]
    lm = [{"context": " ".join(rng.choices(WORDS[:3], k=5)) + " ", "continuation": rng.choice(WORDS[:3])}
          for _ in range(items)]
    for name, rows in (("mc.jsonl", mc), ("schema.jsonl", schema), ("sub/lm.jsonl", lm)):
        (folder / "eval_data" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "core.yaml").write_text(
        "icl_tasks:\n"
        "- label: toy_mc\n  dataset_uri: mc.jsonl\n  num_fewshot: [3]\n  icl_task_type: multiple_choice\n"
        "  continuation_delimiter: ' '\n"
        "- label: toy_schema\n  dataset_uri: schema.jsonl\n  num_fewshot: [0]\n  icl_task_type: schema\n"
        "- label: toy_lm\n  dataset_uri: sub/lm.jsonl\n  num_fewshot: [2]\n  icl_task_type: language_modeling\n"
        "  continuation_delimiter: ' '\n")
    (folder / "eval_meta_data.csv").write_text("Eval Task,Task Category,Task Type,#shots,Random baseline\n"
                                               "toy_mc,x,mc,3,33.3333\ntoy_schema,x,s,0,33.3333\ntoy_lm,x,lm,2,0\n")
    return {"toy_mc": mc, "toy_schema": schema, "toy_lm": lm}


def reference_correct(model, tokenizer, kind, item, shots):
    """
    One item scored another way: each option alone through GPT.forward's per-token losses, the scored tokens found
    with os.path.commonprefix (of the token lists; reversed for the schema's common suffix).
    """
    def mean_losses(texts, reverse=False):
        rows = [tokenizer.encode(text, prepend="<|bos|>") for text in texts]
        shared = len(os.path.commonprefix([row[::-1] if reverse else row for row in rows]))
        means = []
        for row in rows:
            ids = torch.tensor([row])
            losses = model(ids[:, :-1], ids[:, 1:], loss_reduction="none")[0]  # losses[t] scores token t + 1
            means.append((losses[-shared:] if reverse else losses[shared - 1:]).mean().item())
        return means

    if kind == "multiple_choice":
        solved = "".join(f"{s['query']} {s['choices'][s['gold']]}\n\n" for s in shots)
        means = mean_losses([f"{solved}{item['query']} {c}" for c in item["choices"]])
    elif kind == "schema":
        means = mean_losses([f"{c} {item['continuation']}" for c in item["context_options"]], reverse=True)
    else:
        solved = "".join(f"{s['context'].strip()} {s['continuation']}\n\n" for s in shots)
        context = tokenizer.encode(f"{solved}{item['context'].strip()}", prepend="<|bos|>")
        ids = torch.tensor([tokenizer.encode(f"{solved}{item['context'].strip()} {item['continuation']}",
                                             prepend="<|bos|>")])
        predicted = model(ids[:, :-1])[0].argmax(-1)  # predicted[t]: the guess for token t + 1
        return bool((predicted[len(context) - 1:] == ids[0, len(context):]).all())
    return means.index(min(means)) == item["gold"]


def test_core_on_a_local_bundle_equals_a_hand_computation(tmp_path, monkeypatch):
    tokenizer = make_tokenizer()
    model = make_model(tokenizer).eval()
    written = write_bundle(tmp_path, random.Random(0))
    loaded = core.load_bundle(tmp_path)
    result = core.evaluate_core(model, tokenizer, loaded)

    baselines = {"toy_mc": 1 / 3, "toy_schema": 1 / 3, "toy_lm": 0.0}
    kinds = {"toy_mc": "multiple_choice", "toy_schema": "schema", "toy_lm": "language_modeling"}
    shots = {"toy_mc": 3, "toy_schema": 0, "toy_lm": 2}
    centred = {}
    for label, items in written.items():
        random.Random(1337).shuffle(items)  # base_eval.py's shuffle
        with torch.no_grad():
            right = [reference_correct(model, tokenizer, kinds[label], item,
                                       [items[j] for j in random.Random(1234 + i).sample(
                                           [j for j in range(len(items)) if j != i], shots[label])] if shots[label]
                                       else []) for i, item in enumerate(items)]
        accuracy = sum(right) / len(items)
        centred[label] = (accuracy - baselines[label]) / (1 - baselines[label])
        got = result["tasks"][label]
        assert got["acc"] == pytest.approx(accuracy) and got["count"] == 12 and got["errors"] == 0
        assert got["centred"] == pytest.approx(centred[label], abs=1e-5)  # the csv's 33.3333 vs 1/3
    assert result["core"] == pytest.approx(sum(centred.values()) / 3, abs=1e-5)

    # eval.py --tasks core on a checkpoint: the number, the per-task rows and the report card's table.
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(tmp_path))
    common.save_checkpoint(tmp_path / "ckpt", 1, model, {"stage": "base"}, tokenizer=tokenizer)
    evaluation.main(["--stage", "base", "--ckpt", str(tmp_path / "ckpt"), "--tasks", "core", "--device", "cpu"])
    record = common.read_report()[-1]
    assert record["metrics"]["core"] == pytest.approx(result["core"])
    assert record["core"]["toy_schema"]["acc"] == result["tasks"]["toy_schema"]["acc"]
    card = (tmp_path / "home" / "report.md").read_text()
    assert "## CORE" in card and "| toy_lm | language_modeling | 2 | 12 |" in card and "**CORE**" in card


def test_core_of_a_scripted_model_is_the_hand_count(tmp_path):
    """
    A model that always continues ':' and 'cat' with ' dog' (conftest.scripted_model): it picks ' dog' in every
    multiple-choice item and completes exactly the items whose continuation is 'dog'. With gold on ' dog' in 5 of 8
    two-way items and 'dog' the continuation of 3 of 8: acc 5/8 and 3/8, centred (5/8 - 1/2) / (1/2) = 0.25 and
    (3/8 - 0) / 1 = 0.375, CORE 0.3125. The 2-shot language-modelling prompts exceed the 64-token context: cut.
    """
    tokenizer = make_tokenizer()
    colon, cat = tokenizer.encode("Answer:")[-1], tokenizer.encode(" cat")[-1]
    dog = tokenizer.encode(" dog")
    assert tokenizer.encode(" sun")[0] != dog[0]
    model = scripted_model(tokenizer, {colon: dog[0], cat: dog[0], dog[0]: dog[1], dog[1]: dog[2]}, scale=2.0)
    mc = [{"query": f"Question {i}?\nAnswer:", "choices": ["dog", "sun"] if i < 5 else ["sun", "dog"], "gold": 0}
          for i in range(8)]
    lm = [{"context": "one two three four five six seven eight nine ten red cat", "continuation":
           "dog" if i < 3 else "sun"} for i in range(8)]
    folder = tmp_path / "eval_bundle"
    (folder / "eval_data").mkdir(parents=True)
    (folder / "eval_data" / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    (folder / "eval_data" / "lm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lm))
    (folder / "core.yaml").write_text(
        "icl_tasks:\n- label: mc\n  dataset_uri: mc.jsonl\n  num_fewshot: [0]\n  icl_task_type: multiple_choice\n"
        "- label: lm\n  dataset_uri: lm.jsonl\n  num_fewshot: [2]\n  icl_task_type: language_modeling\n")
    (folder / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nmc,50.0\nlm,0.0\n")
    tasks_ = core.load_bundle(tmp_path)
    assert len(tokenizer.encode(core.render_prompts("language_modeling", lm[0], " ", lm[1:3])[1])) > 64
    result = core.evaluate_core(model, tokenizer, tasks_)
    assert result["tasks"]["mc"]["acc"] == 5 / 8 and result["tasks"]["lm"]["acc"] == 3 / 8
    assert result["tasks"]["mc"]["centred"] == 0.25 and result["tasks"]["lm"]["centred"] == 0.375
    assert result["core"] == 0.3125


def test_missing_bundle_is_named_with_the_command_that_fetches_it(tmp_path, monkeypatch):
    with pytest.raises(common.UserError, match="tasks.py prepare"):
        core.load_bundle(tmp_path)
    assert core.bundle_missing(tmp_path)
    tasks.write_stand_in_data(tmp_path, documents=20, rows=8)
    assert core.bundle_missing(tmp_path) == [] and tasks.missing_data(tmp_path) == []
    tasks.prepare(tmp_path)  # complete: checked offline, nothing downloaded
    (tmp_path / "eval_bundle" / "eval_data" / "lm.jsonl").unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(common.UserError, match=r"lacks 1 of what the presets read \(eval bundle .*lm.jsonl"):
        tasks.prepare(tmp_path)


class BundleServer(http.server.BaseHTTPRequestHandler):
    """Serves `body` at any path; honours `Range: bytes=N-` (206) only when `ranges` is set."""
    body, ranges, seen = b"", True, []

    def do_GET(self):
        start = int(self.headers["Range"][6:-1]) if self.ranges and self.headers.get("Range") else 0
        type(self).seen.append(self.headers.get("Range"))
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(self.body) - start))
        self.end_headers()
        self.wfile.write(self.body[start:])

    def log_message(self, *args):
        pass


def test_bundle_download_resumes_and_unzips(tmp_path):
    source = tmp_path / "source"
    write_bundle(source, random.Random(1), items=4)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for path in sorted((source / "eval_bundle").rglob("*")):
            z.write(path, path.relative_to(source))  # the zip holds eval_bundle/..., as nanochat's does
    BundleServer.body = buffer.getvalue()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), BundleServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/eval_bundle.zip"
        for ranges, part in ((True, BundleServer.body[:100]), (False, b"garbage that a 200 answer replaces")):
            dest = tmp_path / f"dest{ranges}"
            dest.mkdir()
            (dest / "eval_bundle.zip.part").write_bytes(part)
            BundleServer.ranges, BundleServer.seen = ranges, []
            core.download_bundle(dest, url)
            assert BundleServer.seen == [f"bytes={len(part)}-"]
            assert core.bundle_missing(dest) == [] and not list(dest.glob("*.zip*"))
            assert [t["items"] for t in core.load_bundle(dest)] == [t["items"] for t in core.load_bundle(source)]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()

"""
eval.py: pass@k against the closed form and brute force; pass@k curves, the coverage gain A, S and its bootstrap
on hand-computed counts; multiple-choice scoring against manual log-prob sums and on a model that memorised the
answers; generative counts with the real verifier; the same counts under torchrun (2 CPU processes, gloo) as in
one process; the CLI (compare, local task files).
"""

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import common
import eval as ev
from conftest import scripted_model
from engine import Engine
from model import GPT, GPTConfig
import report
from report import pass_at_k
from tasks import SyntheticTask, collate, synthetic_documents
from tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent

# -----------------------------------------------------------------------------
# A real tokenizer and tiny real models

COLORS = ["green", "blue", "red", "yellow"]
FACTS = [("What color is the sky?", 1), ("What color is grass?", 0), ("What color is a fire truck?", 2),
         ("What color is a banana?", 3)]
ITEMS = [{"question": q, "choices": COLORS, "answer": a, "subject": "colors"} for q, a in FACTS]


@pytest.fixture(scope="module")
def tokenizer():
    texts = synthetic_documents(300) + [f"Question: {q}\nAnswer: {c}" for q, _ in FACTS for c in COLORS]
    return Tokenizer.train(texts, 400)


@pytest.fixture(scope="module")
def random_model(tokenizer):
    # PyTorch's default init: non-trivial attention and MLPs, so every choice gets a different score.
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=48, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    return GPT(config).eval()


@pytest.fixture(scope="module")
def trained_model(tokenizer):
    """A tiny model that memorised the four facts, as base text and as chat answers by letter."""
    rows = []
    for item in ITEMS:
        context, continuations = ev.base_prompt(item, [], "continuation")
        context_ids = tokenizer.encode(context, prepend="<|bos|>")
        answer_ids = tokenizer.encode(continuations[item["answer"]])
        rows.append((context_ids + answer_ids, [0] * len(context_ids) + [1] * len(answer_ids)))
        conversation = ev.chat_prompt(item)
        conversation["messages"].append({"role": "assistant", "content": "ABCD"[item["answer"]]})
        rows.append(tokenizer.render_conversation(conversation))
    x, y = collate(rows, pad_id=0)
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=96, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    model = GPT(config)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(50):  # accuracy is 1.0 from ~30 steps on (loss ~0.02 at 50)
        loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


# -----------------------------------------------------------------------------
# pass@k


@pytest.mark.parametrize("n, c, k", [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (10, 3, 5), (10, 0, 10), (20, 19, 2),
                                     (16, 4, 16)])
def test_pass_at_k_matches_closed_form_and_brute_force(n, c, k):
    closed = 1 - math.comb(n - c, k) / math.comb(n, k)
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_1_is_the_fraction_correct():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)


def test_pass_at_k_large_n_is_stable():
    # math.comb(1000, 500) has ~300 digits; the product form stays exact enough
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)


@pytest.mark.parametrize("n, c, k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


# -----------------------------------------------------------------------------
# pass@k curves and the coverage gain A, S (hand-computed)

# 4 samples per problem; correct counts 0, 1, 4, 2.
#   pass@1 per problem 0, 1/4, 1, 1/2                  -> mean 7/16 = 0.4375
#   pass@2 = 1 - C(4-c, 2)/C(4, 2): 0, 1/2, 1, 5/6      -> mean 0.583333
#   pass@3 = 1 - C(4-c, 3)/C(4, 3): 0, 3/4, 1, 1        -> mean 0.6875
#   pass@4: 0, 1, 1, 1                                  -> mean 3/4
#   A = 3/4 - 7/16 = 5/16,  S = (5/16) / (9/16) = 5/9
COUNTS = [0, 1, 4, 2]


def test_pass_at_k_curve_hand_computed():
    assert report.pass_at_k_curve(COUNTS, 4) == pytest.approx([0.4375, 0.5833333333, 0.6875, 0.75])


def test_coverage_gain_hand_computed():
    assert report.coverage_gain(COUNTS, 4) == pytest.approx((7 / 16, 3 / 4, 5 / 16, 5 / 9))
    # Sharpening: "sft" solves every problem 1 time in 4, "rl" two problems always and two never.
    # rl doubles pass@1 (0.25 -> 0.5) but covers half the problems: A 0.75 -> 0, S 1 -> 0.
    assert report.coverage_gain([1, 1, 1, 1], 4) == pytest.approx((0.25, 1.0, 0.75, 1.0))
    assert report.coverage_gain([4, 4, 0, 0], 4) == pytest.approx((0.5, 0.5, 0.0, 0.0))
    p1, pn, gain, normalised = report.coverage_gain([3, 3], 3)  # everything solved: nothing left for S to measure
    assert (p1, pn, gain) == (1.0, 1.0, 0.0) and math.isnan(normalised)


def test_bootstrap_coverage_matches_resampling_by_hand():
    correct = [0, 1, 4, 2, 3, 0, 4, 1, 2, 2]
    got = report.bootstrap_coverage(correct, 4, num_resamples=200, confidence=0.9, seed=7)
    # The same resamples, each scored by the scalar coverage_gain.
    picks = np.random.default_rng(7).integers(0, len(correct), size=(200, len(correct)))
    scored = [report.coverage_gain([correct[i] for i in row], 4) for row in picks]
    for name, column in (("A", 2), ("S", 3)):
        values = [s[column] for s in scored]
        assert got[name] == pytest.approx(tuple(np.quantile(values, [0.05, 0.95])))
    _, _, gain, normalised = report.coverage_gain(correct, 4)
    assert got["A"][0] <= gain <= got["A"][1] and got["S"][0] <= normalised <= got["S"][1]
    assert report.bootstrap_coverage(correct, 4, num_resamples=200, confidence=0.9, seed=7) == got  # seeded


def test_bootstrap_coverage_degenerate_cases():
    same = report.bootstrap_coverage([1, 1, 1], 4, num_resamples=50)  # every resample is the data itself
    assert same["A"] == pytest.approx((0.75, 0.75)) and same["S"] == pytest.approx((1.0, 1.0))
    solved = report.bootstrap_coverage([4, 4], 4, num_resamples=50)  # S undefined on every resample
    assert solved["A"] == (0.0, 0.0) and all(math.isnan(v) for v in solved["S"])


# -----------------------------------------------------------------------------
# The Sharpening tax as a paired comparison (dA, dS)


def test_paired_tax_bootstrap():
    # Identical stages: dA = dS = 0 on every resample, a zero-width interval.
    same = report.paired_coverage_delta(COUNTS, COUNTS, 4, num_resamples=200)
    assert same == {"dA": 0.0, "dS": 0.0, "dA_interval": (0.0, 0.0), "dS_interval": (0.0, 0.0)}
    # A known shift, hand-computed (see COUNTS): sft A = 5/16, S = 5/9; rl [4, 4, 0, 0]: A = 0, S = 0.
    shift = report.paired_coverage_delta(COUNTS, [4, 4, 0, 0], 4, num_resamples=200)
    assert (shift["dA"], shift["dS"]) == pytest.approx((-5 / 16, -5 / 9))
    # Paired: every problem gains one correct sample of 4 and stays covered, so pass@1 rises by 1/4 and pass@4 stays
    # on every resample: dA = -1/4 exactly, whatever problems are drawn, and S = 1 for both (dS = 0). Separate
    # intervals of A would be wide and overlap; the paired one has no width.
    a, b = [1, 2, 3, 1, 2, 1], [2, 3, 4, 2, 3, 2]
    paired = report.paired_coverage_delta(a, b, 4, num_resamples=300, seed=3)
    assert paired["dA"] == pytest.approx(-0.25) and paired["dA_interval"] == pytest.approx((-0.25, -0.25))
    assert paired["dS"] == 0.0 and paired["dS_interval"] == pytest.approx((0.0, 0.0))
    low_a, high_a = report.bootstrap_coverage(a, 4, num_resamples=300, seed=3)["A"]
    low_b, high_b = report.bootstrap_coverage(b, 4, num_resamples=300, seed=3)["A"]
    assert high_a - low_a > 0.1 and high_b - low_b > 0.1 and high_b > low_a  # unpaired: no clear difference
    # The interval is the one of resampling by hand: one draw of problems, both stages scored on it.
    c, d = [0, 1, 4, 2, 3, 0, 4, 1], [1, 1, 4, 4, 0, 0, 4, 2]
    got = report.paired_coverage_delta(c, d, 4, num_resamples=200, confidence=0.9, seed=7)
    picks = np.random.default_rng(7).integers(0, len(c), size=(200, len(c)))
    deltas = [np.subtract(report.coverage_gain([d[i] for i in row], 4), report.coverage_gain([c[i] for i in row], 4))
              for row in picks]
    for name, column in (("dA", 2), ("dS", 3)):
        values = [delta[column] for delta in deltas if np.isfinite(delta[column])]
        assert got[f"{name}_interval"] == pytest.approx(tuple(np.quantile(values, [0.05, 0.95])))
    with pytest.raises(ValueError, match="same problems"):
        report.paired_coverage_delta([1, 2], [1, 2, 3], 4)


def coverage_entry(correct, **changes):
    task = SyntheticTask("test", size=len(correct))
    entry = {"samples": 4, "correct": correct, "temperature": 1.0, "top_k": None, "max_tokens": 96,
             "problems": ev.problem_set_id(task, range(len(task)))}
    return {**entry, **changes}


def test_compare_refuses_mismatched_evals():
    sft = coverage_entry([0, 1, 4, 2])
    paired = report.paired_tax("synthetic", "sft", sft, "rl", coverage_entry([4, 4, 0, 0]))
    assert paired["dA"] == pytest.approx(-5 / 16)
    other_problems = ev.problem_set_id(SyntheticTask("test", size=5), range(1, 5))
    for changes in ({"samples": 8}, {"temperature": 0.7}, {"max_tokens": 64}, {"top_k": 20},
                    {"problems": other_problems}):
        key, value = next(iter(changes.items()))
        with pytest.raises(ValueError, match=f"differ in {key} .* vs {value!r}"):
            report.paired_tax("synthetic", "sft", sft, "rl", coverage_entry([4, 4, 0, 0], **changes))
    old = {"samples": 4, "correct": [4, 4, 0, 0]}  # a record of an eval.py that stored no settings
    with pytest.raises(ValueError, match="does not record temperature"):
        report.paired_tax("synthetic", "sft", sft, "rl", old)
    # The report card refuses the pair with the reason instead of printing a meaningless difference.
    evals = {"sft": {"coverage": {"synthetic": sft}},
             "rl": {"coverage": {"synthetic": coverage_entry([4, 4, 0, 0], max_tokens=64)}}}
    (row,) = report.paired_rows(evals)
    assert isinstance(row[3], ValueError)
    assert "- synthetic, sft -> rl: not compared." in "\n".join(report.paired_table([row]))
    assert ev.problem_set_id(SyntheticTask("test", size=4), range(4)) == sft["problems"]


# -----------------------------------------------------------------------------
# Bits per byte


def test_bpb_of_a_uniform_model_is_log2_vocab_per_byte(tokenizer, tmp_path, monkeypatch):
    # All logits 0: every target costs ln V nats, so bpb = log2(V) * (targets with bytes) / (their bytes).
    uniform = scripted_model(tokenizer, {})
    token_bytes = torch.tensor(tokenizer.token_bytes())
    ids = tokenizer.encode(["What is 3 + 4?", "Tables: 2 * 5 = 10"], prepend="<|bos|>")
    x, y = collate([(row, [1] * len(row)) for row in ids], pad_id=0)  # y: -1 in padding; <|bos|> has 0 bytes
    counted = [t for t in y.flatten().tolist() if t >= 0 and t != tokenizer.bos_id]
    num_bytes = sum(len(tokenizer.decode([t]).encode()) for t in counted)
    expected = math.log2(tokenizer.vocab_size) * len(counted) / num_bytes
    assert ev.evaluate_bpb(uniform, [(x, y)], token_bytes, "cpu") == pytest.approx(expected, rel=1e-6)

    # the CLI: the preset's validation text, packed like pretraining, about --bpb-tokens tokens
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    common.save_checkpoint(common.checkpoint_dir("base"), 1, uniform, {}, tokenizer=tokenizer)
    ev.main(["--stage", "base", "--tasks", "bpb", "--bpb-tokens", "2048", "--batch-size", "4", "--device", "cpu"])
    batches = list(ev.validation_batches(tokenizer, "tiny", 4, uniform.config.sequence_len, 2048))
    assert len(batches) == 2048 // (4 * 64)
    targets = torch.cat([y.flatten() for _, y in batches])
    num_bytes = token_bytes[targets]
    expected = math.log2(tokenizer.vocab_size) * (num_bytes > 0).sum().item() / num_bytes.sum().item()
    assert common.read_report()[-1]["metrics"] == {"bpb": pytest.approx(expected, rel=1e-6)}

    # Several stages in one process (speedrun.sh): one record each, in order; --ckpt names only one stage's checkpoint.
    common.save_checkpoint(common.checkpoint_dir("sft"), 1, uniform, {}, tokenizer=tokenizer)
    ev.main(["--stage", "base", "sft", "--tasks", "bpb", "--bpb-tokens", "2048", "--batch-size", "4", "--device",
             "cpu"])
    assert [(r["of"], r["metrics"]) for r in common.read_report()[-2:]] == [
        ("base", {"bpb": pytest.approx(expected, rel=1e-6)}), ("sft", {"bpb": pytest.approx(expected, rel=1e-6)})]
    with pytest.raises(SystemExit):
        ev.main(["--stage", "base", "sft", "--ckpt", str(common.checkpoint_dir("sft"))])


# -----------------------------------------------------------------------------
# Multiple choice


def test_base_prompt_formats():
    shot = {"question": "2+2?", "choices": ["3", "4"], "answer": 1, "subject": "high_school_math"}
    item = {"question": "1+1?", "choices": ["2", "5"], "answer": 0, "subject": "high_school_math"}
    assert ev.base_prompt(item, [shot], "continuation") == (
        "Question: 2+2?\nAnswer: 4\n\nQuestion: 1+1?\nAnswer:", [" 2", " 5"])
    assert ev.base_prompt(item, [shot], "letter") == (
        "The following are multiple choice questions (with answers) about high school math.\n\n"
        "2+2?\nA. 3\nB. 4\nAnswer: B\n\n1+1?\nA. 2\nB. 5\nAnswer:", [" A", " B"])


def test_pick_choices_sum_and_per_character():
    # sums -2 and -3: acc takes choice 0; per character -2/2 = -1 and -3/6 = -0.5: acc_norm takes choice 1
    assert ev.pick_choices([-2.0, -3.0], [" a", " bbbbb"]) == (0, 1)
    assert ev.pick_choices([-1.0, -1.0], [" a", " b"]) == (0, 0)  # ties go to the first


def test_continuation_logprobs_equal_manual_sums(random_model, tokenizer):
    long_context = tokenizer.encode("Question: " + "What is 2 + 2? " * 12, prepend="<|bos|>")
    assert len(long_context) > random_model.config.sequence_len  # this one is cut from the left
    sky = tokenizer.encode("Question: What color is the sky?\nAnswer:", prepend="<|bos|>")
    requests = [(sky, tokenizer.encode(f" {c}")) for c in COLORS] + [(long_context, tokenizer.encode(" 4"))]
    # Micro-batches of <= sequence_len positions: the long row alone, the short ones together, out of request order.
    got = ev.continuation_logprobs(random_model, requests, "cpu", batch_tokens=random_model.config.sequence_len)
    for (context, continuation), score in zip(requests, got):
        ids = (context + continuation)[-(random_model.config.sequence_len + 1):]
        x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
        y[0, :len(ids) - 1 - len(continuation)] = -1  # score the continuation only
        manual = -random_model(x, y, loss_reduction="none").sum().item()
        logprobs = random_model(x)[0].log_softmax(-1)  # (T, V), the same sum from the logits
        by_hand = sum(logprobs[len(ids) - 1 - len(continuation) + j, t].item() for j, t in enumerate(continuation))
        assert score == pytest.approx(manual, abs=1e-4) and score == pytest.approx(by_hand, abs=1e-4)


def test_multiple_choice_picks_the_memorised_answers(trained_model, random_model, tokenizer):
    result = ev.evaluate_multiple_choice(trained_model, tokenizer, ITEMS, "continuation", batch_size=8)
    assert result == {"acc": 1.0, "acc_norm": 1.0, "count": 4}
    assert ev.evaluate_multiple_choice_chat(trained_model, tokenizer, ITEMS, batch_size=3) == {"acc": 1.0, "count": 4}
    # On a random model too, the choice picked is the argmax of the per-choice sums (base) and of the letter
    # logits after the prompt, run alone and cut to the last sequence_len tokens (chat).
    letters = [tokenizer.encode(letter)[0] for letter in "ABCD"]
    for item in ITEMS:
        context, continuations = ev.base_prompt(item, [], "continuation")
        requests = [(tokenizer.encode(context, prepend="<|bos|>"), tokenizer.encode(c)) for c in continuations]
        scores = ev.continuation_logprobs(random_model, requests, "cpu")
        base = ev.evaluate_multiple_choice(random_model, tokenizer, [item], "continuation")
        assert base["acc"] == float(max(range(4), key=scores.__getitem__) == item["answer"])
        prompt = tokenizer.render_for_completion(ev.chat_prompt(item))[-random_model.config.sequence_len:]
        letter_logits = random_model(torch.tensor([prompt]))[0, -1, letters]  # (4,)
        chat = ev.evaluate_multiple_choice_chat(random_model, tokenizer, [item])
        assert chat["acc"] == float(letter_logits.argmax().item() == item["answer"])


# -----------------------------------------------------------------------------
# Generative evaluation and the CLI, with a scripted model that always answers "#### 24"

NUM_PROBLEMS = 40  # the first 40 held-out synthetic problems: 4 of them have the answer 24


def answer_24_model(tokenizer, scale=1.0):
    t = tokenizer.token_id
    script = [t("<|assistant_start|>"), *tokenizer.encode("#### 24"), t("<|assistant_end|>")]
    assert len(set(script)) == len(script)
    return scripted_model(tokenizer, dict(zip(script[:-1], script[1:])), scale)


def expected_correct(num_samples):
    task = SyntheticTask("test", size=NUM_PROBLEMS)
    return [num_samples * (p["answer"] == 24) for p in task.problems]


def test_generative_counts_with_the_real_verifier(tokenizer):
    engine = Engine(answer_24_model(tokenizer), tokenizer)
    result = ev.evaluate_generative(engine, SyntheticTask("test", size=NUM_PROBLEMS), list(range(NUM_PROBLEMS)),
                                    num_samples=2, ks=(1, 2), max_tokens=8, temperature=0.0, batch_size=16)
    assert result["correct"].tolist() == expected_correct(2) and sum(expected_correct(1)) == 4
    assert result["pass@1"] == result["pass@2"] == pytest.approx(4 / NUM_PROBLEMS)
    assert result["errors"] == 0


DDP_SCRIPT = """
import json, sys
import torch
import common, eval as ev
from engine import Engine, load_model
from tasks import SyntheticTask

torch.set_num_threads(1)
out, scripted_dir, random_dir, items_path = sys.argv[1:]
_, rank, _, world_size, device = common.compute_init("cpu")
model, tokenizer, _ = load_model(scripted_dir, device)
generative = ev.evaluate_generative(Engine(model, tokenizer), SyntheticTask("test", size=40), list(range(40)),
                                    num_samples=2, ks=(1, 2), max_tokens=8, temperature=0.0, batch_size=8)
model, tokenizer, _ = load_model(random_dir, device)
items = json.load(open(items_path))
base = ev.evaluate_multiple_choice(model, tokenizer, items, "continuation", num_shots=1, batch_size=8)
chat = ev.evaluate_multiple_choice_chat(model, tokenizer, items, batch_size=4)
if rank == 0:
    generative["correct"] = generative["correct"].tolist()
    json.dump({"world_size": world_size, "generative": generative, "base": base, "chat": chat}, open(out, "w"))
common.compute_cleanup()
"""


@pytest.mark.slow
def test_distributed_eval_gathers_the_same_counts_as_one_process(tokenizer, random_model, tmp_path):
    common.save_checkpoint(tmp_path / "scripted", 0, answer_24_model(tokenizer), {}, tokenizer=tokenizer)
    common.save_checkpoint(tmp_path / "random", 0, random_model, {}, tokenizer=tokenizer)
    problems = SyntheticTask("test", size=30, seed=1).problems  # multiple choice: the answer and three near misses
    items = [{"question": p["question"], "choices": [str(p["answer"] + d) for d in (0, 1, -1, 10)][i % 4:] +
              [str(p["answer"] + d) for d in (0, 1, -1, 10)][:i % 4], "answer": (4 - i % 4) % 4, "subject": p["kind"]}
             for i, p in enumerate(problems)]
    (tmp_path / "items.json").write_text(json.dumps(items))
    (tmp_path / "ddp_eval.py").write_text(DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "NANOPOST_HOME": str(tmp_path)}
    args = [str(tmp_path / name) for name in ("scripted", "random", "items.json")]
    single = [sys.executable, str(tmp_path / "ddp_eval.py"), str(tmp_path / "one.json"), *args]
    ddp = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(tmp_path / "ddp_eval.py"), str(tmp_path / "two.json"), *args]
    for command in (single, ddp):
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert (one.pop("world_size"), two.pop("world_size")) == (1, 2)
    assert one == two
    assert one["generative"]["correct"] == expected_correct(2)
    assert one["base"]["count"] == one["chat"]["count"] == 30


def test_cli_compare_writes_records_and_the_report(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    # "sft" follows the script with probability ~0.79 per token, "rl" (sharper) with ~0.997.
    for stage, step, scale in (("sft", 10, 1.0), ("rl", 20, 2.0)):
        model = answer_24_model(tokenizer, scale)
        common.save_checkpoint(common.checkpoint_dir(stage), step, model, {}, tokenizer=tokenizer)
    ev.main(["--compare", "sft", "rl", "--tasks", "synthetic", "--num-samples", "4", "--k", "1,2,4",
             "--max-problems", str(NUM_PROBLEMS), "--max-tokens", "6", "--device", "cpu"])
    records = common.read_report()
    assert [(r["stage"], r["of"], r["step"]) for r in records] == [("eval", "sft", 10), ("eval", "rl", 20)]
    assert records[0]["ckpt"] == str((common.checkpoint_dir("sft") / "step_000010").resolve())  # the step folder
    solvable = [i for i, c in enumerate(expected_correct(1)) if c]
    for record in records:
        correct = record["coverage"]["synthetic"]["correct"]
        assert record["coverage"]["synthetic"]["samples"] == 4 and len(correct) == NUM_PROBLEMS
        assert all(c == 0 for i, c in enumerate(correct) if i not in solvable)  # never right by accident
        for k in (1, 2, 4):
            assert record["metrics"][f"synthetic/pass@{k}"] == pytest.approx(report.pass_at_k_curve(correct, 4)[k - 1])
    sft, rl = (r["coverage"]["synthetic"]["correct"] for r in records)
    assert sum(rl) > sum(sft)  # the sharper policy is right more often
    card = (tmp_path / "report.md").read_text()
    assert "## Coverage" in card
    assert "| synthetic | sft | 4 | 40 |" in card and "| synthetic | rl | 4 | 40 |" in card
    # The paired change sft -> rl, from the two records (they share n, temperature, max_tokens and problems).
    paired = report.paired_coverage_delta(sft, rl, 4)
    assert (f"| synthetic | sft | rl | {paired['dA']:+.3f} [{paired['dA_interval'][0]:+.3f}, "
            f"{paired['dA_interval'][1]:+.3f}] |") in card
    # rl evaluated again with a longer max_tokens: the report refuses the pair and says why.
    ev.main(["--stage", "rl", "--tasks", "synthetic", "--num-samples", "4", "--max-problems", str(NUM_PROBLEMS),
             "--max-tokens", "7", "--device", "cpu"])
    card = (tmp_path / "report.md").read_text()
    assert "- synthetic, sft -> rl: not compared." in card and "max_tokens 6 vs 7" in card
    assert "| synthetic | sft | rl |" not in card


def test_cli_rejects_k_above_num_samples(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    with pytest.raises(SystemExit):
        ev.main(["--stage", "sft", "--num-samples", "2", "--k", "1,4"])
    with pytest.raises(SystemExit):
        ev.main(["--compare", "sft", "rl", "--num-samples", "1"])


def test_cli_multiple_choice_from_local_files(trained_model, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    rows = [{"id": str(i), "question": item["question"], "answerKey": "ABCD"[item["answer"]],
             "choices": {"text": item["choices"], "label": list("ABCD")}} for i, item in enumerate(ITEMS)]
    # The flat layout of $NANOPOST_DATA_DIR (tasks.local_files): <root>/<repo>/<config>/<split>.jsonl.
    folder = tmp_path / "data" / "allenai/ai2_arc" / "ARC-Easy"
    folder.mkdir(parents=True)
    (folder / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setenv("NANOPOST_DATA_DIR", str(tmp_path / "data"))
    common.save_checkpoint(tmp_path / "ckpt", 5, trained_model, {}, tokenizer=tokenizer)
    for stage in ("base", "sft"):  # base: log-likelihood of the answer text; sft: log-prob of the letter
        ev.main(["--stage", stage, "--ckpt", str(tmp_path / "ckpt"), "--tasks", "arc-easy",
                 "--device", "cpu"])
    base, sft = common.read_report()
    assert base["metrics"] == {"arc-easy/acc": 1.0, "arc-easy/acc_norm": 1.0}
    assert sft["metrics"] == {"arc-easy/acc": 1.0}
    with pytest.raises(FileNotFoundError, match="mmlu"):
        ev.main(["--stage", "base", "--ckpt", str(tmp_path / "ckpt"), "--tasks", "mmlu"])


def test_truncated_answer_is_not_correct_in_pass_at_k(tokenizer):
    # The budget holds "#### 24" but not the <|assistant_end|> after it: the right text, never a finished answer.
    engine = Engine(answer_24_model(tokenizer), tokenizer)
    task, indices = SyntheticTask("test", size=NUM_PROBLEMS), list(range(NUM_PROBLEMS))
    budget = len(tokenizer.encode("#### 24"))
    cut = ev.evaluate_generative(engine, task, indices, num_samples=2, ks=(1, 2), max_tokens=budget,
                                 temperature=0.0, batch_size=16)
    assert cut["correct"].tolist() == [0] * NUM_PROBLEMS and cut["pass@1"] == cut["pass@2"] == 0.0
    assert cut["truncated"] == 2 * NUM_PROBLEMS and cut["errors"] == 0
    stopped = ev.evaluate_generative(engine, task, indices, num_samples=2, ks=(1, 2), max_tokens=budget + 1,
                                     temperature=0.0, batch_size=16)
    assert stopped["correct"].tolist() == expected_correct(2) and stopped["truncated"] == 0


def test_truncated_answer_is_not_correct_in_the_held_out_check(tokenizer):
    # A scripted model that answers "#### 24" and then ends its turn; 4 of the first 40 held-out problems are 24.
    t = tokenizer.token_id
    script = [t("<|assistant_start|>"), *tokenizer.encode("#### 24"), t("<|assistant_end|>")]
    model = scripted_model(tokenizer, dict(zip(script[:-1], script[1:])), scale=2.0)
    cut = ev.held_out_check(model, tokenizer, "synthetic", 40, 2, len(script) - 2, 0)  # ends before <|assistant_end|>
    assert cut["format_rate"] == 1.0 and cut["stop_rate"] == 0.0  # the right text, in format, never finished
    assert cut["pass@1"] == 0.0 and cut["pass@1_t1"] == 0.0 and cut["truncated"] >= 40
    stopped = ev.held_out_check(model, tokenizer, "synthetic", 40, 2, len(script) - 1, 0)
    assert stopped["pass@1"] == pytest.approx(4 / 40) and stopped["stop_rate"] == 1.0

import copy
import math
import random
import subprocess
import sys

import pytest
import torch

import engine as engine_module
from conftest import scripted_model
from engine import Engine, assistant_content, calculator, sample_tokens, sampling_logits, sampling_logprobs
from model import GPT, GPTConfig
from tokenizer import Tokenizer

NEG_INF = float("-inf")


@pytest.fixture(scope="module")
def tokenizer():
    rng = random.Random(0)
    words = "the cat sat on a mat while we add and multiply numbers like".split()
    sums = [f"{rng.randint(0, 999)}{rng.choice('+-*/')}{rng.randint(0, 99)}" for _ in range(300)]
    texts = [" ".join(rng.choice(words) for _ in range(30)) + " " + expr for expr in sums]
    return Tokenizer.train(texts, vocab_size=320)


@pytest.fixture(scope="module")
def model(tokenizer):
    # PyTorch's default init: random, non-trivial attention and MLPs (init_weights would zero the output projections).
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=64, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    return GPT(config).eval()


@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def compiled(request):
    """
    Every engine test runs on both decode paths: the eager reference and the compiled step (slow: each new cache
    shape costs an inductor compile, ~10 s on an idle CPU core).
    """
    return request.param


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["the cat", "we add numbers like 12+7 and", "a"]
    return [tokenizer.encode(text, prepend="<|bos|>") for text in texts]  # lengths differ


# -----------------------------------------------------------------------------
# sampling_logprobs on a 5-token example: probabilities 0.4 0.3 0.15 0.1 0.05, stored out of order


PROBS = [0.15, 0.4, 0.05, 0.3, 0.1]  # token 1 is the most likely, then 3, 0, 4, 2
LOGITS = torch.tensor(PROBS).log()


def assert_distribution(logprobs, expected):
    torch.testing.assert_close(logprobs.exp(), torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)
    assert all((lp == NEG_INF) == (p == 0) for lp, p in zip(logprobs.tolist(), expected))


def test_sampling_logprobs_plain_and_temperature():
    assert_distribution(sampling_logprobs(LOGITS), PROBS)
    # temperature 2: p_i^(1/2) / sum_j p_j^(1/2)
    roots = [math.sqrt(p) for p in PROBS]
    assert_distribution(sampling_logprobs(LOGITS, temperature=2.0), [r / sum(roots) for r in roots])
    greedy = sampling_logprobs(LOGITS, temperature=0)
    assert greedy.tolist() == [NEG_INF, 0.0, NEG_INF, NEG_INF, NEG_INF]


def test_sampling_logprobs_top_k_and_top_p():
    assert_distribution(sampling_logprobs(LOGITS, top_k=2), [0, 4 / 7, 0, 3 / 7, 0])  # 0.4 and 0.3, renormalised
    assert_distribution(sampling_logprobs(LOGITS, top_k=1), [0, 1, 0, 0, 0])
    # nucleus 0.75: 0.4 + 0.3 = 0.7 < 0.75, so 0.15 joins; the set sums to 0.85
    assert_distribution(sampling_logprobs(LOGITS, top_p=0.75), [0.15 / 0.85, 0.4 / 0.85, 0, 0.3 / 0.85, 0])
    assert_distribution(sampling_logprobs(LOGITS, top_p=0.6), [0, 4 / 7, 0, 3 / 7, 0])
    assert_distribution(sampling_logprobs(LOGITS, top_p=0.3), [0, 1, 0, 0, 0])  # the top token is always kept
    # top-k first, then the nucleus of the renormalised top-k: 4/7 >= 0.5 alone
    assert_distribution(sampling_logprobs(LOGITS, top_k=2, top_p=0.5), [0, 1, 0, 0, 0])
    # temperature before the nucleus: at T=2 the probabilities flatten (.300 .260 .184 .150 .106), top 2 sum to .56 < .6
    roots = [math.sqrt(p) for p in PROBS]
    kept = [r if p >= 0.15 else 0 for r, p in zip(roots, PROBS)]
    assert_distribution(sampling_logprobs(LOGITS, temperature=2.0, top_p=0.6), [r / sum(kept) for r in kept])


def test_sampling_logprobs_batched_and_validated():
    batch = torch.stack([LOGITS, LOGITS.flip(0)])  # (2, 5)
    out = sampling_logprobs(batch, top_k=2)
    assert_distribution(out[0], [0, 4 / 7, 0, 3 / 7, 0])
    assert_distribution(out[1], [0, 3 / 7, 0, 4 / 7, 0])
    for kwargs in ({"temperature": -1}, {"top_k": 0}, {"top_p": 0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            sampling_logprobs(LOGITS, **kwargs)


# -----------------------------------------------------------------------------
# sample_tokens: the engine's sampler


def chi_square_critical(df, z=3.09):
    """The chi-square quantile of df degrees of freedom at normal quantile z (3.09: p = 0.001), by Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, None, None), (1.3, 3, None),
                                                       (1.0, None, 0.75), (0.8, 4, 0.9)])
def test_sample_tokens_draws_the_target_distribution(temperature, top_k, top_p):
    # 200,000 draws from sampling_logprobs's distribution over 8 tokens, chi-square against it at p = 0.001. Broken
    # once (the exclusive running sum c_i - p_i as the CDF: each token's interval shifted to its neighbour) and this
    # failed: chi-square 2e6 to 9e6, or draws outside the top-k / nucleus.
    logits = torch.tensor([2.0, -1.0, 0.5, 1.5, 0.0, -3.0, 1.0, 0.3])
    logprobs = sampling_logprobs(logits, temperature, top_k, top_p)
    n = 200_000
    generator = torch.Generator().manual_seed(0)
    scaled = sampling_logits(logits, temperature, top_k, top_p)
    tokens, token_logprobs = sample_tokens(scaled.expand(n, -1), 1 - torch.rand(n, generator=generator))
    # the log-probs it records are those of the distribution it sampled
    assert torch.allclose(token_logprobs, logprobs[tokens], atol=1e-6)
    counts = torch.bincount(tokens, minlength=logits.numel()).double()
    expected = n * logprobs.double().exp()
    kept = expected > 0
    assert counts[~kept].sum() == 0  # never a token outside the top-k / nucleus
    chi2 = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
    assert chi2 < chi_square_critical(int(kept.sum()) - 1), chi2


def test_sample_tokens_is_deterministic_and_handles_the_ends():
    logits = sampling_logits(torch.tensor([[0.0, 1.0, 2.0, -1.0]] * 5), top_k=2)  # tokens 1 and 2 kept
    first, _ = sample_tokens(logits, 1 - torch.rand(5, generator=torch.Generator().manual_seed(3)))
    again, _ = sample_tokens(logits, 1 - torch.rand(5, generator=torch.Generator().manual_seed(3)))
    assert first.tolist() == again.tolist()
    # u = 1 is the last kept token, not a removed one after it (broken once with searchsorted's right=True: token 3);
    # the smallest u is the first kept token
    assert sample_tokens(logits[:2], torch.tensor([1.0, 2.0 ** -24]))[0].tolist() == [2, 1]
    # logits far beyond exp's float32 range (a low temperature) still sample and score: the max is taken out first
    tokens, logprobs = sample_tokens(torch.tensor([[0.0, 300.0, 299.0]]) * 10, torch.tensor([0.5]))
    assert tokens.tolist() == [1] and logprobs.item() == pytest.approx(-math.log1p(math.exp(-10)), abs=1e-6)


def test_draw_is_total_and_an_undefined_row_is_marked_for_itself_only():
    from engine import Sampling, draw

    logits = LOGITS.expand(3, -1)
    uniforms = torch.tensor([0.3, 0.6, 0.9])
    # a temperature below the floor is greedy (1e-38 overflowed logits / temperature: token 5 = vocabulary size),
    # and top-p keeps the top token even where top_p is 0 in float32 (1e-46 removed every token)
    for sampling in (Sampling(temperature=1e-39), Sampling(temperature=1e-38, top_k=2), Sampling(top_p=1e-46),
                     Sampling(temperature=0.5, top_p=1e-46)):
        tokens, logprobs = draw(logits, sampling, uniforms)
        assert tokens.tolist() == [1, 1, 1] and logprobs.tolist() == [0.0, 0.0, 0.0], sampling
    assert_distribution(sampling_logprobs(LOGITS, temperature=1e-39), [0, 1, 0, 0, 0])
    # rows with no distribution get token 0 and log-prob NaN; the healthy row draws what it draws alone
    hostile = torch.stack([LOGITS.masked_fill(torch.arange(5) == 2, float("nan")), LOGITS, torch.full((5,), NEG_INF),
                           LOGITS.masked_fill(torch.arange(5) == 4, float("inf"))])
    uniforms = torch.tensor([0.5, 0.5, 0.5, 0.5])
    for sampling in (Sampling(), Sampling(temperature=0), Sampling(temperature=0.7, top_k=3, top_p=0.9)):
        tokens, logprobs = draw(hostile, sampling, uniforms)
        alone_token, alone_logprob = draw(LOGITS[None], sampling, uniforms[:1])
        assert tokens.tolist() == [0, alone_token.item(), 0, 0], sampling
        assert [math.isnan(lp) for lp in logprobs.tolist()] == [True, False, True, True]
        assert logprobs[1].item() == alone_logprob.item()


def test_a_temperature_below_the_floor_generates_greedily(model, tokenizer, prompts):
    engine = Engine(model, tokenizer)
    greedy = engine.generate(prompts, max_tokens=8, temperature=0)
    tiny = engine.generate(prompts, max_tokens=8, temperature=1e-39, seed=0)
    assert [[c.tokens for c in p] for p in tiny] == [[c.tokens for c in p] for p in greedy]


def test_a_non_finite_row_in_generate_is_a_clear_error(model, tokenizer, prompts, monkeypatch):
    engine = Engine(model, tokenizer)
    monkeypatch.setattr(model.lm_head.weight, "data", model.lm_head.weight.data * float("nan"))
    with pytest.raises(RuntimeError, match="not finite"):
        engine.generate(prompts, max_tokens=4)


# -----------------------------------------------------------------------------
# Calculator


@pytest.mark.parametrize("expr, expected", [
    ("2+3", "5"), ("2+3*4", "14"), ("(2+3)*4", "20"), (" 48 / 2 + 48 ", "72"), ("7/2", "3.5"), ("8/2", "4"),
    ("0.1+0.2", "0.3"), ("1.1*3", "3.3"), ("1/3", "0.333333333333333"), ("1e15/3", "333333333333333"),
    ("2**10", "1024"), ("2**-1", "0.5"), ("-3**2", "-9"),
    ("7//2", "3"), ("-7//2", "-4"), ("7%3", "1"), ("1e3", "1000"), ("1.5e-20", "1.5e-20"), ("10**30", str(10**30)),
    ("(" * 90 + "1" + ")" * 90, "1"), ("-" * 150 + "1", "1"), ("+-+-2", "2"),
])
def test_calculator_values(expr, expected):
    assert calculator(expr) == expected


@pytest.mark.parametrize("expr, reason", [
    ("1/0", "division by zero"), ("5%0", "division by zero"), ("0**-1", "division by zero"),
    ("9**9**9", "exponent"), ("10**10**10", "exponent"), ("2**101", "exponent"), ("10**31", "too large"),
    ("1e308*10", "too large"), ("1e400", "too large"), ("(-8)**0.5", "complex"), ("2" * 40, "too large"),
    ("(1,)*9", "unsupported"), ("[1]*9", "unsupported"), ("__import__('os')", "unsupported"), ("a.b", "unsupported"),
    ("x", "unsupported"), ("'1'*10**9", "unsupported"), ("True+1", "unsupported"), ("1j", "unsupported"),
    ("lambda: 1", "unsupported"), ("1 if 1 else 2", "unsupported"), ("1 < 2", "unsupported"),
    ("1" * 10_000, "longer than"), ("(" * 1000, "longer than"), ("(" * 199, "invalid"), ("", "invalid"),
    ("2+", "invalid"), ("import os", "invalid"), ("1\x002", "invalid"),
])
def test_calculator_refuses(expr, reason):
    # How fast it refuses is a timing, measured by bench/calculator.py, not asserted here (no wall-clock in tests).
    result = calculator(expr)
    assert result.startswith("error:") and reason in result, result


# -----------------------------------------------------------------------------
# Engine against a naive recompute and against re-scoring


def naive_greedy(model, prompt, max_tokens, stop_ids):
    """Reference: full forward over the whole sequence for every new token, no cache."""
    ids = list(prompt)
    while len(ids) - len(prompt) < max_tokens:
        ids.append(model(torch.tensor([ids]))[0, -1].argmax().item())
        if ids[-1] in stop_ids:
            break
    return ids[len(prompt):]


def test_greedy_equals_naive_recompute(model, tokenizer, prompts, compiled):
    # So that some rows stop while others go on decoding, <|assistant_end|> gets 1.1x the lm_head row of the 4th
    # greedy token of prompt 0: it outscores that token wherever that token would have won.
    stopping = copy.deepcopy(model)
    fourth = naive_greedy(model, prompts[0], 4, stop_ids=())[-1]
    with torch.no_grad():
        stopping.lm_head.weight[tokenizer.token_id("<|assistant_end|>")] = 1.1 * model.lm_head.weight[fourth]
    engine = Engine(stopping, tokenizer, compiled=compiled)
    results = engine.generate(prompts, num_samples=2, max_tokens=16, temperature=0)
    assert [len(samples) for samples in results] == [2, 2, 2]
    for prompt, samples in zip(prompts, results):
        expected = naive_greedy(stopping, prompt, 16, engine.stop_ids)
        for c in samples:
            assert c.tokens == expected
            assert c.mask == [1] * len(expected)  # no calculator call in these completions
            assert c.logprobs == [0.0] * len(expected)  # greedy: the delta distribution
            assert c.finish == ("stop" if expected[-1] in engine.stop_ids else "length")
    assert len(results[0][0].tokens) == 4
    assert {c.finish for samples in results for c in samples} == {"stop", "length"}


@pytest.mark.parametrize("temperature, top_k, top_p",
                         [(0.7, None, None), (1.0, 5, None), (1.0, None, 0.9), (0.8, 5, 0.9)])
def test_logprobs_equal_rescored_full_forward(model, tokenizer, prompts, temperature, top_k, top_p, compiled):
    engine = Engine(model, tokenizer, compiled=compiled)
    results = engine.generate(prompts, num_samples=3, max_tokens=12, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=0)
    for prompt, samples in zip(prompts, results):
        for c in samples:
            assert len(c.tokens) == len(c.mask) == len(c.logprobs) >= 1
            logits = model(torch.tensor([prompt + c.tokens]))[0, len(prompt) - 1:-1]  # (n, V): predicts each token
            rescored = sampling_logprobs(logits, temperature, top_k, top_p).gather(1, torch.tensor(c.tokens)[:, None])
            sampled = torch.tensor(c.mask) == 1
            assert rescored[sampled].isfinite().all()  # never a token outside the top-k / nucleus
            torch.testing.assert_close(torch.tensor(c.logprobs)[sampled], rescored[sampled].squeeze(1),
                                       atol=1e-5, rtol=0)


@pytest.mark.slow
def test_compiled_keeps_its_cache_across_calls_and_matches_eager(model, tokenizer, prompts):
    # The compiled path's cache outlives a call; the next call of the same shape (rows, prompts and lengths rounded
    # up) reuses its storage, and what the previous call left in it must not leak in. Broken once (load() did not set
    # each row's first slot): the second call's shorter prompt attended to its padding slots, holding the first
    # call's keys, and its tokens differed from eager's. Both layouts: prompts shared by their samples' rows
    # (num_samples > 1: a prompt of 3 tokens where one of 11 was, whose stale prefix slots prefix_mask hides), and
    # one row per prompt.
    eager, compiled = Engine(model, tokenizer, compiled=False), Engine(model, tokenizer, compiled=True)
    calls = [([prompts[1], prompts[0]], 2, 12, 0.0), ([prompts[0], prompts[1]], 2, 12, 1.0),
             ([prompts[2], prompts[1]], 2, 12, 1.0), (prompts, 3, 8, 1.0),  # the last: 3 prompts, a new shape
             ([prompts[1], prompts[0]], 1, 20, 0.0), ([prompts[0], prompts[2]], 1, 20, 1.0)]  # 1 row per prompt
    storages = []
    for batch, num_samples, max_tokens, temperature in calls:
        args = dict(num_samples=num_samples, max_tokens=max_tokens, temperature=temperature, seed=7)
        expected, got = eager.generate(batch, **args), compiled.generate(batch, **args)
        assert [[c.tokens for c in s] for s in got] == [[c.tokens for c in s] for s in expected]
        for got_samples, expected_samples in zip(got, expected):
            for g, e in zip(got_samples, expected_samples):
                torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-5, rtol=0)
        storages.append(compiled._static_cache.keys[0].data_ptr())
    assert storages[0] == storages[1] == storages[2] != storages[3] != storages[4] == storages[5]


@pytest.mark.slow
def test_compiled_cpu_step_reads_the_written_slots_with_one_graph_for_every_length(model, tokenizer, prompts):
    # On CPU the compiled step attends over slots 0 .. slot only (StaticKVCache.filled), a length that grows every
    # step, and over the longest prompt's prefix slots: once each length has changed, one graph with the lengths
    # symbolic must serve every step and call. Broken once each: insert returning all max_len slots, and the step
    # compiled with dynamic=False (a recompile per step up to torch.compile's recompile limit of 8, then eager).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # forget the graphs earlier tests compiled
    frames = counters["frames"]["ok"]
    engine = Engine(model, tokenizer, compiled=True)
    engine.generate([prompts[0]], num_samples=2, max_tokens=30, temperature=0)
    engine.generate([prompts[1]], num_samples=2, max_tokens=40, temperature=0)  # other prompt and storage lengths
    assert counters["frames"]["ok"] - frames <= 4  # the first lengths, then symbolic ones (a few at a time)
    compiles = counters["frames"]["ok"]
    engine.generate([prompts[2]], num_samples=2, max_tokens=50, temperature=0)  # all lengths new: the same graph
    assert counters["frames"]["ok"] == compiles
    cache = engine._static_cache  # step by step, uncompiled: each insert returns exactly the slots written so far
    kv = torch.zeros(cache.keys[0].size(0), 1, *cache.keys[0].shape[2:])
    with torch.inference_mode():  # the engine's tensors are inference tensors
        for _ in range(3):
            keys, values = cache.insert(0, kv, kv)
            assert keys.size(1) == values.size(1) == int(cache.slot) + 1 == cache.filled + 1 < cache.max_len
            cache.advance(1)


def test_eager_step_drops_finished_rows_and_keeps_the_others_draws(model, tokenizer, prompts, monkeypatch):
    # Once half of the rows have finished, the eager step decodes only the others (KVCache.keep_rows). The rows still
    # decoding must get the tokens and log-probs the full batch gives them: same cache rows, same positions and
    # padding, same uniforms. Rows are finished early here by the caller of the decoding loop (Engine._decode).
    from engine import Sampling

    def run(finish_early):
        steps = Engine(model, tokenizer, compiled=False)._decode(prompts, 3, 12, Sampling(temperature=1.0, seed=3))
        for step, rows in enumerate(steps):
            if step == 2 and finish_early:
                for i in (0, 1, 3, 4, 6):
                    rows[i].finish = "stop"
        return rows

    batch_rows = []
    full = run(False)
    one_token_logits = engine_module._one_token_logits

    def counting(model, ids, kv_cache):  # records each decode step's batch size
        batch_rows.append(ids.size(0))
        return one_token_logits(model, ids, kv_cache)

    monkeypatch.setattr(engine_module, "_one_token_logits", counting)
    early = run(True)
    assert batch_rows[:2] == [9, 9] and batch_rows[2:] == [4] * (len(batch_rows) - 2)  # 5 of 9 rows finished
    for i in (2, 5, 7, 8):
        assert early[i].tokens == full[i].tokens and early[i].logprobs == full[i].logprobs


def test_seed_makes_sampling_deterministic(model, tokenizer, prompts, compiled):
    engine = Engine(model, tokenizer, compiled=compiled)

    def tokens(seed):
        results = engine.generate(prompts, num_samples=4, max_tokens=10, temperature=1.0, seed=seed)
        return [[c.tokens for c in samples] for samples in results]

    first = tokens(123)
    assert tokens(123) == first
    assert tokens(124) != first
    assert all(len({tuple(t) for t in samples}) > 1 for samples in first)  # a prompt's rows sample independently


def test_stream_yields_the_generated_tokens(model, tokenizer, prompts, compiled):
    engine = Engine(model, tokenizer, compiled=compiled)
    (completion,), = engine.generate([prompts[1]], max_tokens=9, temperature=0.9, top_k=20, seed=5)
    streamed = list(engine.generate_stream(prompts[1], max_tokens=9, temperature=0.9, top_k=20, seed=5))
    assert streamed == completion.tokens


def test_generate_rejects_bad_arguments(model, tokenizer, compiled):
    engine = Engine(model, tokenizer, compiled=compiled)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[tokenizer.bos_id], []])
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate([[tokenizer.bos_id]], max_tokens=0)
    with pytest.raises(ValueError, match="positions"):
        engine.generate([[tokenizer.bos_id]], max_tokens=model.rotary_len)


# -----------------------------------------------------------------------------
# Calculator tool use and finish reasons, end to end, with a scripted model


def test_calculator_call_is_evaluated_and_forced(tokenizer, compiled):
    """A scripted real GPT (conftest.scripted_model: greedy next token = f(current token)) writes a calculator call;
    the engine must evaluate it, force the output with mask 0, and let the model finish after it."""
    t = tokenizer.token_id
    expr = tokenizer.encode("2+3*4")
    call = [t("<|python_start|>"), *expr, t("<|python_end|>")]
    assert len(set(call)) == len(call)  # distinct tokens, so the script below is a function
    hello, cat = tokenizer.encode("hello")[-1], tokenizer.encode(" cat")[-1]
    transitions = {t("<|assistant_start|>"): call[0], **dict(zip(call[:-1], call[1:])),
                   t("<|output_end|>"): t("<|assistant_end|>"),  # after the forced output, stop
                   hello: t("<|assistant_end|>"),  # stops at once
                   cat: cat}  # never stops
    engine = Engine(scripted_model(tokenizer, transitions), tokenizer, compiled=compiled)
    tool_prompt = tokenizer.render_for_completion({"messages": [{"role": "user", "content": "what is 2+3*4?"}]})
    prompts = [tool_prompt, [tokenizer.bos_id, hello], [tokenizer.bos_id, cat]]
    tool, stop, length = engine.generate(prompts, num_samples=2, max_tokens=20, temperature=0)

    output = [t("<|output_start|>"), *tokenizer.encode("14"), t("<|output_end|>")]
    for c in tool:
        assert tokenizer.decode(c.tokens) == ("<|python_start|>2+3*4<|python_end|>"
                                              "<|output_start|>14<|output_end|><|assistant_end|>")
        assert c.tokens == call + output + [t("<|assistant_end|>")]
        assert c.mask == [1] * len(call) + [0] * len(output) + [1]
        assert c.logprobs == [0.0] * len(c.tokens)
        assert c.finish == "stop"
    for c in stop:
        assert (c.tokens, c.mask, c.finish) == ([t("<|assistant_end|>")], [1], "stop")
    for c in length:
        assert (c.tokens, c.finish) == ([cat] * 20, "length")

    # max_tokens counts forced tokens: cut inside the tool output
    (cut, _), = engine.generate([tool_prompt], num_samples=2, max_tokens=len(call) + 1, temperature=0)
    assert (cut.tokens, cut.mask, cut.finish) == (call + output[:1], [1] * len(call) + [0], "length")


def test_assistant_content_inverts_rendering(tokenizer):
    content = [{"type": "text", "text": "Let me compute."}, {"type": "python", "text": "2+3"},
               {"type": "python_output", "text": "5"}, {"type": "text", "text": " The answer is 5."}]
    conversation = {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": content}]}
    ids, _ = tokenizer.render_conversation(conversation)
    reply = ids[len(tokenizer.render_for_completion(conversation)):]
    assert assistant_content(tokenizer, reply) == content


# -----------------------------------------------------------------------------
# CLI


def run_cli(*args, home):
    return subprocess.run([sys.executable, "engine.py", *args], capture_output=True, text=True, timeout=120,
                          env={"NANOPOST_HOME": str(home), "PATH": "/usr/bin:/bin"})


def test_cli_answers_a_prompt_from_a_checkpoint(model, tokenizer, tmp_path):
    import common

    common.save_checkpoint(tmp_path / "sft", 0, model, {"stage": "test"}, tokenizer=tokenizer)
    result = run_cli("--ckpt", str(tmp_path / "sft"), "--prompt", "the cat", "--max-tokens", "5", "--device", "cpu",
                     "--seed", "0", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "loaded" in result.stderr and result.stdout.strip()


def test_cli_missing_checkpoint_says_so(tmp_path):
    result = run_cli("--ckpt", str(tmp_path / "nothing"), "--prompt", "hi", "--device", "cpu", home=tmp_path)
    assert result.returncode == 1
    assert "no checkpoint" in result.stderr

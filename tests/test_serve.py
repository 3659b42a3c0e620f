"""
serve.py end to end: a real server on an ephemeral 127.0.0.1 port, a tiny random model, the real tokenizer and
engine. Every request has a timeout and goes to 127.0.0.1 only.
"""

import http.client
import json
import math
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import serve
from conftest import make_model, make_tokenizer, scripted_model
from engine import Engine, Sampling, readable_reply

TIMEOUT = 60  # seconds, for every request: a broken server fails the test instead of hanging it
CAP = 100  # the test server's --max-tokens (the tiny model's context is 128)


def start(engine, start_worker=True, **kwargs):
    server = serve.make_server(engine, port=0, quiet=True, **kwargs)
    if start_worker:
        server.worker.thread.start()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop(server):
    server.shutdown()
    server.worker.stop()
    server.server_close()


def request(server, method, path, body=None):
    """(status, headers, text) of one request to the server on 127.0.0.1."""
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=TIMEOUT)
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    return response.status, response.headers, text


def chat(server, **body):
    status, _, text = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200, text
    return json.loads(text)


def stream(server, **body):
    """The chunks of a streamed completion, checked to be server-sent events ending with `data: [DONE]`."""
    status, headers, text = request(server, "POST", "/v1/chat/completions", {**body, "stream": True})
    assert status == 200, text
    assert headers["Content-Type"] == "text/event-stream"
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: ") for event in events[:-1])
    return [json.loads(event[len("data: "):]) for event in events[:-2]]


def send_only(server, body):
    """A socket that has sent a chat-completion request and read nothing: the test decides when to hang up."""
    client = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=TIMEOUT)
    data = json.dumps(body).encode()
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return client


def health(server):
    return json.loads(request(server, "GET", "/health")[2])


USER = [{"role": "user", "content": "What is 12+7?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_model(tokenizer).eval()


@pytest.fixture(scope="module")
def server(model, tokenizer):
    server = start(Engine(model, tokenizer), max_tokens=CAP, max_body=4096)
    yield server
    stop(server)


# -----------------------------------------------------------------------------
# The OpenAI schema, streamed and not


def test_completion_schema(server):
    response = chat(server, messages=USER, max_tokens=12, n=2, seed=0, temperature=1.0)
    assert response["object"] == "chat.completion" and response["id"].startswith("chatcmpl-")
    assert isinstance(response["created"], int) and response["model"] == "nanopost"
    assert [choice["index"] for choice in response["choices"]] == [0, 1]
    for choice in response["choices"]:
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length")
    usage = response["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > usage["prompt_tokens"] > 0

    status, _, text = request(server, "GET", "/v1/models")
    assert status == 200 and json.loads(text)["data"][0] == {**json.loads(text)["data"][0], "id": "nanopost",
                                                             "object": "model"}
    assert health(server)["status"] == "ok"


@pytest.mark.parametrize("seed", [0, 1])
def test_streamed_text_equals_non_streamed(server, seed):
    body = {"messages": USER, "max_tokens": 40, "n": 2, "seed": seed, "temperature": 1.0, "top_k": None}
    whole = chat(server, **body)
    *chunks, last = stream(server, **body, stream_options={"include_usage": True})
    assert {chunk["id"] for chunk in chunks} == {chunks[0]["id"]}
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert (last["choices"], last["usage"]) == ([], whole["usage"])
    for choice in whole["choices"]:
        mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == choice["index"]]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == choice["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
        assert "".join(c["delta"].get("content", "") for c in mine) == choice["message"]["content"]
    # the random tiny model writes stray bytes: the stream must hold back a cut character, never mangle it
    assert any(choice["message"]["content"] for choice in whole["choices"])


# -----------------------------------------------------------------------------
# Batching


def test_concurrent_requests_are_all_answered_and_batched(server):
    before = health(server)
    bodies = [{"messages": [{"role": "user", "content": f"What is {i}+{i}?"}], "max_tokens": 24, "seed": i,
               "temperature": 1.0} for i in range(8)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda body: chat(server, **body), bodies))
    after = health(server)
    assert all(r["choices"][0]["finish_reason"] in ("stop", "length") for r in responses)
    assert after["requests"] - before["requests"] == len(bodies)
    assert after["prefills"] - before["prefills"] < len(bodies)  # some prompts were prefilled together
    assert after["largest_batch"] >= 2


# -----------------------------------------------------------------------------
# Hard edges


LONG = " ".join(["twelve plus seven"] * 200)  # far more than the context
MEDIUM = " ".join(["twelve plus seven"] * 3)  # about 45 tokens: fits the context, not with CAP more


@pytest.mark.parametrize("body, status, message", [
    ("{not json", 400, "not valid JSON"),
    ([1, 2], 400, "must be a JSON object"),
    ({"messages": "hi"}, 400, "'messages' must be a list"),
    ({}, 400, "'messages' must be a list"),
    ({"messages": []}, 400, "'messages' is empty"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "role 'robot'"),
    ({"messages": [{"role": "user", "content": ""}]}, 400, "empty content"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}, 400,
     "last message"),
    ({"messages": [{"role": "user", "content": LONG}]}, 400, "context is 128 tokens"),
    ({"messages": [{"role": "user", "content": MEDIUM}], "max_tokens": CAP}, 400, "does not fit"),  # within the cap
    ({"messages": USER, "max_tokens": CAP + 1}, 400, f"cap of {CAP}"),
    ({"messages": USER, "max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
    ({"messages": USER, "temperature": "hot"}, 400, "'temperature' must be a number"),
    ({"messages": USER, "top_p": 1.5}, 400, "'top_p' must be between 0 and 1"),
    ({"messages": USER, "n": 100}, 400, "'n' must be between 1 and 8"),
    ({"messages": USER, "stream": "yes"}, 400, "'stream' must be true or false"),
    ({"messages": USER, "pad": "x" * 5000}, 413, "at most 4096"),
])
def test_bad_requests_get_their_status_and_message(server, body, status, message):
    got, _, text = request(server, "POST", "/v1/chat/completions", body)
    error = json.loads(text)["error"]
    assert (got, error["type"]) == (status, "invalid_request_error"), text
    assert message in error["message"]


def test_unknown_route_is_404(server):
    assert request(server, "GET", "/v2/nothing")[0] == 404
    assert request(server, "POST", "/v1/completions", {})[0] == 404


def test_full_queue_answers_503_at_once_and_a_queued_client_that_leaves_is_dropped(model, tokenizer):
    server = start(Engine(model, tokenizer), start_worker=False, max_queue=1)  # nothing is decoded: jobs wait
    try:
        waiting = send_only(server, {"messages": USER, "max_tokens": 4})
        deadline = time.monotonic() + TIMEOUT
        while health(server)["queued"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, _, text = request(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 4})
        assert status == 503 and "--max-queue" in json.loads(text)["error"]["message"]
        # a client that leaves while its request waits: the request is dropped, never decoded
        waiting.close()
        while not server.worker.jobs[0].cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        server.worker.thread.start()
        assert chat(server, messages=USER, max_tokens=4)["choices"][0]["finish_reason"] in ("stop", "length")
        assert (health(server)["prefills"], health(server)["largest_batch"]) == (1, 1)
    finally:
        stop(server)


def test_disconnected_client_frees_its_row_and_the_next_request_is_served(server):
    before = health(server)["cancelled_rows"]
    client = send_only(server, {"messages": USER, "max_tokens": CAP, "stream": True, "temperature": 1.0})
    received = b""
    while b"data: " not in received:  # the stream has started
        received += client.recv(4096)
    assert received.startswith(b"HTTP/1.1 200")
    client.close()
    assert chat(server, messages=USER, max_tokens=5)["choices"][0]["finish_reason"] in ("stop", "length")
    # The worker sees the disconnect when it next writes to the socket, which on a loaded machine can come after the
    # next request's reply: wait for it (a row that ran to its CAP tokens instead is never counted).
    deadline = time.monotonic() + TIMEOUT
    while health(server)["cancelled_rows"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert health(server)["cancelled_rows"] == before + 1  # the row stopped before its CAP tokens


def test_a_crash_in_generation_answers_500_and_the_server_stays_up(server, model, monkeypatch):
    def broken_hidden(*args, **kwargs):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(model, "hidden", broken_hidden)  # the prefill and every decoding step go through it
    status, _, text = request(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 5})
    assert status == 500 and "simulated failure" in json.loads(text)["error"]["message"]
    monkeypatch.undo()
    assert chat(server, messages=USER, max_tokens=5)["choices"][0]["message"]["role"] == "assistant"


def test_the_page_is_served_and_self_contained(server):
    status, headers, page = request(server, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "/v1/chat/completions" in page and "New chat" in page
    assert not re.search(r"https?:|//[a-z0-9]|\bsrc\s*=|\bhref\s*=|@import|url\(", page, re.IGNORECASE)


def serve_process(model, tokenizer, tmp_path, ignore_sigint=False):
    """serve.py on a checkpoint of `model`, in a subprocess on a free port (its first stderr line says which);
    ignore_sigint: started with SIGINT ignored, as a background job of a script is (`cmd &`)."""
    import common

    common.save_checkpoint(tmp_path / "sft", 0, model, {"stage": "test"}, tokenizer=tokenizer)
    command = [sys.executable, "serve.py", "--ckpt", str(tmp_path / "sft"), "--port", "0", "--device", "cpu", "--quiet"]
    if ignore_sigint:
        command = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True,
                            env={"NANOPOST_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def test_ctrl_c_shuts_down_cleanly(model, tokenizer, tmp_path):
    # Started with SIGINT ignored: SIGINT must still stop it. Broken once (Python keeps an inherited SIG_IGN): the
    # server ignored SIGINT when the test suite ran in the background.
    process = serve_process(model, tokenizer, tmp_path, ignore_sigint=True)
    try:
        line = process.stderr.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", line).group(1))  # binds 127.0.0.1 by default
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        connection.request("GET", "/health")
        assert json.loads(connection.getresponse().read())["status"] == "ok"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=TIMEOUT) == 0
        assert "shutting down" in process.stderr.read()
    finally:
        process.kill()


# -----------------------------------------------------------------------------
# Readable calculator calls: API, raw tokens, the CLI


@pytest.fixture(scope="module")
def calculator_model(tokenizer):
    """A scripted real GPT (conftest.scripted_model) that answers any user turn with a call of 2+3*4, then stops."""
    t = tokenizer.token_id
    call = [t("<|python_start|>"), *tokenizer.encode("2+3*4"), t("<|python_end|>")]
    assert len(set(call)) == len(call)
    transitions = {t("<|assistant_start|>"): call[0], **dict(zip(call[:-1], call[1:])),
                   t("<|output_end|>"): t("<|assistant_end|>")}
    return scripted_model(tokenizer, transitions)


def test_calculator_calls_read_as_calculations(calculator_model, tokenizer):
    server = start(Engine(calculator_model, tokenizer))
    try:
        body = {"messages": USER, "max_tokens": 20, "temperature": 0}
        readable = chat(server, **body)["choices"][0]
        assert (readable["message"]["content"], readable["finish_reason"]) == ("[calculator: 2+3*4 → 14]", "stop")
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in stream(server, **body)) == \
            "[calculator: 2+3*4 → 14]"
        raw = chat(server, **body, raw_tokens=True)["choices"][0]["message"]["content"]
        assert raw == "<|python_start|>2+3*4<|python_end|><|output_start|>14<|output_end|>"
        # a reply's content parts, sent back, render the call as the model wrote it in the next turn's prompt
        parts = [{"type": "python", "text": "2+3*4"}, {"type": "python_output", "text": "14"}]
        assert readable["message"]["content_parts"] == parts
        history = USER + [{"role": "assistant", "content": parts}, {"role": "user", "content": "and 2+3*4?"}]
        assert chat(server, messages=history, max_tokens=20, temperature=0)["choices"][0]["message"]["content"] == \
            "[calculator: 2+3*4 → 14]"
    finally:
        stop(server)


def calculator_reply(tokenizer):
    """The token ids of a reply with one calculator call: "so ", 17+25 -> 42, " ok", end of turn."""
    t = tokenizer.token_id
    return [*tokenizer.encode("so "), t("<|python_start|>"), *tokenizer.encode("17+25"), t("<|python_end|>"),
            t("<|output_start|>"), *tokenizer.encode("42"), t("<|output_end|>"), *tokenizer.encode(" ok"),
            t("<|assistant_end|>")]


def test_readable_reply_grows_by_prefixes(tokenizer):
    tokens = calculator_reply(tokenizer)
    assert readable_reply(tokenizer, tokens) == "so [calculator: 17+25 → 42] ok"
    texts = [readable_reply(tokenizer, tokens[:k]) for k in range(len(tokens) + 1)]
    assert all(longer.startswith(shorter) for shorter, longer in zip(texts, texts[1:]))


def test_chat_cli_prints_readable_calculator_calls(calculator_model, tokenizer, tmp_path):
    import common

    common.save_checkpoint(tmp_path / "sft", 0, calculator_model, {"stage": "test"}, tokenizer=tokenizer)
    result = subprocess.run([sys.executable, "engine.py", "--ckpt", str(tmp_path / "sft"), "--prompt", "2+3*4?",
                             "--temperature", "0", "--max-tokens", "20", "--device", "cpu"],
                            capture_output=True, text=True, timeout=120,
                            env={"NANOPOST_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[calculator: 2+3*4 → 14]"



# -----------------------------------------------------------------------------
# Continuous batching


def prompt_of(tokenizer, text):
    return tokenizer.render_for_completion({"messages": [{"role": "user", "content": text}]})


def test_requests_joining_a_running_batch_decode_as_if_alone(model, tokenizer):
    from engine import DecodeBatch, Request

    engine = Engine(model, tokenizer)
    prompts = [prompt_of(tokenizer, text) for text in ("What is 3+4?", "hello there, how are you", "hi",
                                                       "What is 12 + 7 times 5?")]
    alone = [engine.generate([p], max_tokens=30, temperature=0)[0][0].tokens for p in prompts]
    batch = DecodeBatch(engine)
    requests = [Request(p, 1, 30, Sampling(temperature=0)) for p in prompts]
    batch.add(requests[:2])  # prefilled together
    for _ in range(3):
        batch.step()
    batch.add(requests[2:3])  # joins mid-batch: a shorter prompt next to longer rows
    for _ in range(5):
        batch.step()
    batch.add(requests[3:])  # a longer prompt than every running row holds
    steps = 0
    while batch.rows and steps < 100:
        batch.step()
        steps += 1
    assert [r.completions[0].tokens for r in requests] == alone
    batch.step()  # nothing left to decode: the finished rows leave, nothing runs
    assert batch.slots == [] and batch.cache is None

    # a seeded request samples the same alone and joined to a batch running other settings
    def sample(join_after):
        batch = DecodeBatch(engine)
        other = Request(prompts[1], 3, 40, Sampling(temperature=0.8, top_k=5, seed=3))
        mine = Request(prompts[0], 2, 25, Sampling(temperature=1.0, seed=7))
        if join_after is None:
            batch.add([mine])
        else:
            batch.add([other])
            for _ in range(join_after):
                batch.step()
            batch.add([mine])
        while any(c.finish is None for c in mine.completions) or batch.joining:
            batch.step()
        return [c.tokens for c in mine.completions]

    solo = sample(None)
    assert sample(2) == solo and sample(0) == solo
    assert solo[0] != solo[1]
    # the same sampler and draws as Engine.generate: a seed gives the same samples through either
    generated = engine.generate([prompts[0]], num_samples=2, max_tokens=25, temperature=1.0, seed=7)[0]
    assert [c.tokens for c in generated] == solo


def test_a_hostile_row_fails_its_own_request_and_its_neighbours_decode_as_if_alone(model, tokenizer):
    from engine import DecodeBatch, Request

    engine = Engine(model, tokenizer)
    prompts = [prompt_of(tokenizer, text) for text in ("What is 3+4?", "hello there", "hi")]

    def neighbours():
        return [Request(prompts[0], 2, 20, Sampling(temperature=0.9, top_k=40, seed=5)),
                Request(prompts[1], 1, 20, Sampling(temperature=0))]

    alone = []
    for r in neighbours():
        batch = DecodeBatch(engine)
        batch.add([r])
        while batch.rows:
            batch.step()
        alone.append([c.tokens for c in r.completions])
    # a NaN bias gives the hostile request's rows no distribution; temperature 1e-39 and top_p 1e-46 once sampled
    # token 400 (= vocabulary size) and failed the whole batch
    nan = Request(prompts[2], 2, 20, Sampling(seed=1), logit_bias={7: float("nan")})
    cold = Request(prompts[2], 1, 20, Sampling(temperature=1e-39))
    narrow = Request(prompts[2], 1, 20, Sampling(top_p=1e-46))
    requests = neighbours()
    batch = DecodeBatch(engine)
    batch.add(requests)
    for _ in range(3):
        batch.step()
    batch.add([nan, cold, narrow])  # joins the running batch
    while batch.rows:
        batch.step()
    assert [[c.tokens for c in r.completions] for r in requests] == alone
    assert nan.failed and [c.finish for c in nan.completions] == ["error", "error"]
    greedy = engine.generate([prompts[2]], max_tokens=20, temperature=0)[0][0].tokens
    assert not cold.failed and not narrow.failed
    assert cold.completions[0].tokens == greedy and narrow.completions[0].tokens == greedy


def test_a_hostile_request_fails_alone_and_a_concurrent_stream_finishes(server, tokenizer):
    from engine import Request

    body = {"messages": USER, "max_tokens": 40, "temperature": 0}
    expected = chat(server, **body)["choices"][0]["message"]["content"]
    with ThreadPoolExecutor(4) as pool:
        streamed = pool.submit(stream, server, **body)
        hostile = [pool.submit(request, server, "POST", "/v1/chat/completions",
                               {"messages": USER, "max_tokens": 40, **extra})
                   for extra in ({"temperature": 1e-39}, {"top_p": 1e-46}, {"temperature": 1.5, "top_p": 1e-46})]
        # a request whose rows have no distribution (no JSON can carry a NaN bias: the worker gets it directly)
        broken = serve.Job(Request(prompt_of(tokenizer, "hi"), 2, 40, Sampling(), logit_bias={7: float("nan")}))
        server.worker.submit(broken)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed.result(TIMEOUT))
        assert text == expected
        assert [f.result(TIMEOUT)[0] for f in hostile] == [200, 200, 200]
    kind, error = broken.get(TIMEOUT)
    assert kind == "error" and error.status == 500 and "not finite" in str(error)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_finished_rows_are_reused_in_place_and_packed_away(model, tokenizer, compiled):
    # the compiled step (a StaticKVCache of rows rounded up) reuses rows the same way but never packs
    from engine import DecodeBatch, Request

    engine = Engine(model, tokenizer, compiled=compiled)
    texts = ("What is 3+4?", "hello there, how are you today", "hi", "ok", "What is 5?")
    budgets = (4, 40, 30, 5, 20)
    prompts = [prompt_of(tokenizer, text) for text in texts]
    eager = Engine(model, tokenizer, compiled=False)
    # sampled (each request seeded): the log-probs show what a row attends to, which greedy tokens may not
    alone = [eager.generate([p], max_tokens=n, seed=i)[0][0] for i, (p, n) in enumerate(zip(prompts, budgets))]
    requests = [Request(p, 1, n, Sampling(seed=i)) for i, (p, n) in enumerate(zip(prompts, budgets))]
    batch = DecodeBatch(engine)
    batch.add(requests[:2])
    for _ in range(5):  # the first request's 4 tokens: its row is free
        batch.step()
    cache = batch.cache
    batch.add(requests[2:3])  # fits the free row: written in place, the other row's keys and values untouched
    batch.step()
    assert batch.cache is cache and batch.slots[0][0] is requests[2] and batch.slots[1][0] is requests[1]
    batch.add(requests[3:])  # two rows, one free: the cache is rebuilt with every busy row
    batch.step()
    assert batch.cache is not cache and len(batch.slots) == 4
    rows_seen = set()
    while batch.rows:
        batch.step()
        rows_seen.add(len(batch.slots))
    # eager: the last busy row outlived the others and was packed alone as soon as 3 of 4 rows were free
    assert rows_seen == ({4} if compiled else {4, 1})
    for request, expected in zip(requests, alone):
        assert request.completions[0].tokens == expected.tokens
        assert request.completions[0].logprobs == pytest.approx(expected.logprobs, abs=1e-4)


def test_the_room_left_for_later_joins_stays_within_the_rotary_tables(model, tokenizer):
    # twice the longest budget would reach past the positions the model covers (GPT.forward refuses such a cache)
    from engine import DecodeBatch, Request

    batch = DecodeBatch(Engine(model, tokenizer))
    never_stop = {tokenizer.token_id("<|assistant_end|>"): -100, tokenizer.bos_id: -100}
    request = Request(prompt_of(tokenizer, "hi"), 1, model.rotary_len - 50, Sampling(temperature=0),
                      logit_bias=never_stop)
    batch.add([request])
    for _ in range(3):
        batch.step()
    assert batch.cache.max_len == model.rotary_len and len(request.completions[0].tokens) == 3


def test_a_request_arriving_mid_batch_is_answered_while_the_batch_still_runs(server, tokenizer):
    before = health(server)
    never_stop = {str(tokenizer.token_id("<|assistant_end|>")): -100, str(tokenizer.bos_id): -100}
    long = send_only(server, {"messages": USER, "max_tokens": CAP, "stream": True, "temperature": 0,
                              "logit_bias": never_stop})
    received = b""
    while received.count(b"data: ") < 3:  # the long stream is decoding
        received += long.recv(4096)
    short = chat(server, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    assert short["choices"][0]["finish_reason"] in ("stop", "length")
    while b"[DONE]" not in received:
        received += long.recv(65536)
    long.close()
    # the long request was still decoding when the short one finished: the short one joined its batch
    assert received.count(b'"finish_reason": "length"') == 1
    assert health(server)["joined_running"] >= before["joined_running"] + 1


# -----------------------------------------------------------------------------
# Every parameter honoured or refused


@pytest.mark.parametrize("extra, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "no function calling"),
    ({"functions": [{"name": "f"}]}, "functions", "no function calling"),
    ({"tool_choice": "auto"}, "tool_choice", "can only be \"none\""),
    ({"response_format": {"type": "json_object"}}, "response_format", "cannot be constrained to JSON"),
    ({"store": True}, "store", "stores nothing"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "'prediction' is not supported"),
    ({"stop": 5}, "stop", "'stop' must be"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "'stop' must be"),
    ({"top_logprobs": 3}, "top_logprobs", "needs 'logprobs': true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({"logit_bias": {"hello": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"²": 5}}, "logit_bias", "token ids"),  # "²".isdigit(), int("²") raises: the connection closed
    ({"logit_bias": {"١": 5}}, "logit_bias", "token ids"),  # Arabic-Indic one: was silently token 1
    ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages", "has 'name'"),
    ({"messages": [{"role": "user", "content": "hi", "content_parts": [{"type": "text", "text": "x"}]}]}, "messages",
     "only assistant messages"),
    ({"logit_bias": {"3": 101}}, "3", "between -100 and 100"),
    ({"presence_penalty": 3}, "presence_penalty", "between -2 and 2"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "with \"stream\": true"),
    ({"messages": [{"role": "tool", "content": "4", "tool_call_id": "x"}]}, "messages", "role 'tool'"),
    ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}, *USER]}, "messages",
     "'tool_calls'"),
])
def test_unsupported_parameters_are_refused_by_name(server, extra, param, message):
    status, _, text = request(server, "POST", "/v1/chat/completions", {"messages": USER, **extra})
    error = json.loads(text)["error"]
    assert (status, error["param"]) == (400, param), text
    assert message in error["message"]


def test_an_unknown_model_is_404_model_not_found_and_name_is_not_function_calling(server):
    status, _, text = request(server, "POST", "/v1/chat/completions", {"messages": USER, "model": "gpt-4o"})
    error = json.loads(text)["error"]
    assert (status, error["code"], error["param"]) == (404, "model_not_found", "model")
    assert "is not served here" in error["message"]
    status, _, text = request(server, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hi", "name": "ann"}]})
    assert status == 400 and "function calling" not in json.loads(text)["error"]["message"]


def raw_exchange(server, head, body=b""):
    """The raw bytes a hand-written request gets back, up to the server closing the connection."""
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=TIMEOUT) as client:
        client.sendall(head + b"\r\n\r\n" + body)
        reply = b""
        while chunk := client.recv(1 << 16):
            reply += chunk
    return reply.decode()


@pytest.mark.parametrize("lengths, status", [([b"2", b"2"], 400), ([b"\xb2"], 411)], ids=["two", "superscript"])
def test_a_bad_content_length_is_a_json_error(server, lengths, status):
    # headers are read as latin-1: b"\xb2" is "²", which str.isdigit() takes and int() refuses
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json" + b"".join(
        b"\r\nContent-Length: " + length for length in lengths)
    reply = raw_exchange(server, head, b"{}")
    assert reply.startswith(f"HTTP/1.1 {status} ") or reply.startswith(f"HTTP/1.0 {status} "), reply
    assert "Content-Length" in json.loads(reply.split("\r\n\r\n", 1)[1])["error"]["message"]


@pytest.mark.parametrize("head, status", [
    (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: 127.0.0.1", 414),  # http.server's 65,536-byte request line
    (b"GET / HTTP/1.1\r\nHost: 127.0.0.1" + b"".join(b"\r\nX-%d: 1" % i for i in range(101)), 431),  # > 100
])
def test_http_servers_own_refusals_are_json_too(server, head, status):
    reply = raw_exchange(server, head)
    assert reply.startswith(f"HTTP/1.1 {status} ") or reply.startswith(f"HTTP/1.0 {status} "), reply[:200]
    assert json.loads(reply.split("\r\n\r\n", 1)[1])["error"]["message"]


def test_null_parameters_and_echoed_null_fields_are_accepted(server):
    # what clients send for "not given", and what a reply message echoes back
    reply = chat(server, messages=USER, max_tokens=3, tools=None, response_format={"type": "text"}, user="u1",
                 tool_choice="none", store=False, model="nanopost")
    echoed = {**reply["choices"][0]["message"], "tool_calls": None, "refusal": None, "function_call": None}
    assert chat(server, messages=[*USER, echoed, *USER], max_tokens=3)["choices"][0]["message"]["role"] == "assistant"


def test_stop_strings_cut_the_reply_streamed_or_not(server):
    body = {"messages": USER, "max_tokens": 40, "temperature": 0}
    text = chat(server, **body)["choices"][0]["message"]["content"]
    # three characters from the middle of the tiny model's greedy reply, not a cut multi-byte character
    stop = next(text[i:i + 3] for i in range(12, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    expected = text[:text.find(stop)]
    for stops in (stop, ["never there", stop]):
        choice = chat(server, **body, stop=stops)["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (expected, "stop")
        chunks = [c["choices"][0] for c in stream(server, **body, stop=stops)]
        assert "".join(c["delta"].get("content", "") for c in chunks) == expected
        assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["stop"]


def test_logprobs_are_those_of_the_sampling_distribution(server, model, tokenizer):
    body = {"messages": USER, "max_tokens": 12, "temperature": 0.9, "top_k": 3, "seed": 5, "logprobs": True,
            "top_logprobs": 5, "raw_tokens": True}
    choice = chat(server, **body)["choices"][0]
    [[completion]] = Engine(model, tokenizer).generate([prompt_of(tokenizer, USER[0]["content"])], max_tokens=12,
                                                       temperature=0.9, top_k=3, seed=5)
    entries = choice["logprobs"]["content"]
    assert [e["logprob"] for e in entries] == pytest.approx(completion.logprobs, abs=1e-5)
    assert b"".join(bytes(e["bytes"]) for e in entries).decode(errors="replace") == \
        tokenizer.decode(completion.tokens)
    for entry in entries:  # top_k=3: three tokens have probability, and they hold all of it
        top = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert sum(math.exp(lp) for lp in top) == pytest.approx(1, abs=1e-4)
        assert entry["logprob"] in top
    streamed = [e for c in stream(server, **body) for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert streamed == entries
    assert chat(server, messages=USER, max_tokens=3)["choices"][0]["logprobs"] is None


def test_logit_bias_and_frequency_penalty_steer_the_tokens(server, tokenizer):
    x = tokenizer.encode(" seven")[0]
    body = {"messages": USER, "max_tokens": 10, "temperature": 0, "raw_tokens": True, "logprobs": True,
            "logit_bias": {str(x): 10}}

    def tokens(**extra):
        return [bytes(e["bytes"]) for e in chat(server, **body, **extra)["choices"][0]["logprobs"]["content"]]

    mark = tokenizer.enc.decode_single_token_bytes(x)
    assert tokens() == [mark] * 10
    # the tiny model's own logits span a few units: +10 wins them all, +10 - 2 x count loses after a few repeats
    assert tokens(frequency_penalty=2.0).count(mark) < 10
    assert tokens(presence_penalty=2.0) == [mark] * 10  # a flat 2 does not outweigh 10


def test_developer_is_system_and_top_p_zero_is_greedy(server):
    def reply(role, **extra):
        r = chat(server, messages=[{"role": role, "content": "Be brief."}, *USER], max_tokens=12, seed=1, **extra)
        return r["choices"][0]["message"]["content"], r["usage"]["prompt_tokens"]

    assert reply("developer", temperature=0) == reply("system", temperature=0)
    assert reply("system", temperature=1.0, top_p=0) == reply("system", temperature=0)


# -----------------------------------------------------------------------------
# Protocol


def test_http11_keep_alive_and_chunked_streams(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=TIMEOUT)
    body = json.dumps({"messages": USER, "max_tokens": 5, "stream": True})
    connection.request("POST", "/v1/chat/completions?api-version=1", body=body)  # query strings are ignored
    response = connection.getresponse()
    assert (response.version, response.status, response.headers["Transfer-Encoding"]) == (11, 200, "chunked")
    assert response.read().endswith(b"data: [DONE]\n\n")
    sock = connection.sock
    connection.request("GET", "/v1/models/nanopost?x=1")
    response = connection.getresponse()
    assert (response.status, json.loads(response.read())["id"]) == (200, "nanopost")
    connection.request("GET", "/v1/models/gpt-4o")
    response = connection.getresponse()
    assert (response.status, json.loads(response.read())["error"]["code"]) == (404, "model_not_found")
    assert connection.sock is sock  # one connection for all three
    connection.close()


@pytest.mark.parametrize("body, message", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"messages": ' + b"[" * 40 + b"]" * 40 + b"}", "nested more than 32 levels"),
    (b'{"messages": [], "seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"messages": [], "temperature": NaN}', "not valid JSON"),
    (b'{"messages": "\xff"}', "not valid JSON"),
])
def test_hostile_json_is_a_400(body, message, model, tokenizer):
    server = start(Engine(model, tokenizer), max_body=1 << 20)
    try:
        status, _, text = request(server, "POST", "/v1/chat/completions", body)
        assert status == 400 and message in json.loads(text)["error"]["message"]
        assert chat(server, messages=USER, max_tokens=2)["choices"]  # still serving
    finally:
        stop(server)


def test_a_20mb_body_is_answered_413_to_urllib(server):
    import urllib.error
    import urllib.request

    data = b'{"messages": "' + b"x" * (20 << 20) + b'"}'
    call = urllib.request.Request(f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions", data=data,
                                  headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(call, timeout=TIMEOUT)
    assert error.value.code == 413 and "at most 4096" in json.loads(error.value.read())["error"]["message"]


def test_a_half_closed_client_still_gets_its_reply(model, tokenizer):
    server = start(Engine(model, tokenizer), start_worker=False)  # requests wait: the server sees the half-close
    try:
        clients = []
        for streamed in (False, True):
            clients.append(send_only(server, {"messages": USER, "max_tokens": 5, "stream": streamed}))
            clients[-1].shutdown(socket.SHUT_WR)  # sent everything; still reading
        time.sleep(0.5)  # the handlers check their clients every 0.1 s
        server.worker.thread.start()
        for streamed, client in zip((False, True), clients):
            received = b""
            while chunk := client.recv(65536):
                received += chunk
            client.close()
            # a non-streamed reply is preceded by the interim 100 that told a closed client from a half-closed one
            assert received.startswith(b"HTTP/1.1 200" if streamed else b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200")
            assert (b"[DONE]" in received) == streamed and b'"finish_reason"' in received
    finally:
        stop(server)


def test_shutdown_mid_stream_ends_with_an_error_event(model, tokenizer):
    server = start(Engine(model, tokenizer))
    try:
        client = send_only(server, {"messages": USER, "max_tokens": 100, "stream": True, "temperature": 0,
                                    "logit_bias": {str(tokenizer.token_id("<|assistant_end|>")): -100,
                                                   str(tokenizer.bos_id): -100}})
        received = b""
        while received.count(b"data: ") < 3:
            received += client.recv(4096)
        server.worker.stop()
        while not received.endswith(b"\r\n0\r\n\r\n"):  # the chunked body still ends properly
            received += client.recv(65536)
        client.close()
        assert b"shutting down" in received and b"[DONE]" not in received and b"cancelled" not in received
    finally:
        server.shutdown()
        server.server_close()


def test_a_killed_server_mid_stream_is_an_error_for_the_client(model, tokenizer, tmp_path):
    process = serve_process(model, tokenizer, tmp_path)
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", process.stderr.readline()).group(1))
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        connection.request("POST", "/v1/chat/completions", body=json.dumps(
            {"messages": USER, "max_tokens": 100, "stream": True, "temperature": 0,
             "logit_bias": {str(tokenizer.token_id("<|assistant_end|>")): -100, str(tokenizer.bos_id): -100}}))
        response = connection.getresponse()
        assert response.readline().startswith(b"data: ")
        process.kill()
        with pytest.raises(http.client.IncompleteRead):
            response.read()
    finally:
        process.kill()
        process.wait(timeout=TIMEOUT)


def test_retry_after_on_503_and_the_connection_cap(model, tokenizer):
    server = start(Engine(model, tokenizer), start_worker=False, max_queue=0, max_connections=2)
    try:
        status, headers, _ = request(server, "POST", "/v1/chat/completions", {"messages": USER})
        assert (status, headers["Retry-After"]) == (503, "1")  # --max-queue 0: the queue is always full
        deadline = time.monotonic() + TIMEOUT
        while server.open_connections > 0 and time.monotonic() < deadline:  # that connection's thread has ended
            time.sleep(0.01)
        idle = [socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=TIMEOUT) for _ in range(2)]
        while server.open_connections < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, headers, text = request(server, "GET", "/health")
        assert (status, headers["Retry-After"]) == (503, "1") and "--max-connections" in text
        for client in idle:
            client.close()
        while server.open_connections > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert request(server, "GET", "/health")[0] == 200
    finally:
        stop(server)


def test_a_request_that_trickles_in_is_cut_at_the_read_deadline(model, tokenizer):
    server = start(Engine(model, tokenizer), read_timeout=0.5)
    try:
        client = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=TIMEOUT)
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        t0 = time.monotonic()
        for _ in range(40):  # a byte every 0.1 s: each read is quick, the request never completes
            try:
                client.sendall(b" ")
            except OSError:
                break
            time.sleep(0.1)
        assert client.recv(1024) == b"" and time.monotonic() - t0 < 3  # closed at about 0.5 s
        client.close()
        assert chat(server, messages=USER, max_tokens=2)["choices"]
    finally:
        stop(server)


# -----------------------------------------------------------------------------
# Exposure: API key, CORS, model aliases


@pytest.fixture(scope="module")
def guarded(model, tokenizer):
    server = start(Engine(model, tokenizer), api_key="s3cret", cors_origin="http://localhost:3000",
                   model_aliases=["gpt-4o"])
    yield server
    stop(server)


def authorized(server, method, path, body=None, key="s3cret", origin=None):
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=TIMEOUT)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
               **({"Origin": origin} if origin else {})}
    connection.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    return response.status, response.headers, text


def test_an_api_key_guards_the_api_but_not_the_page(guarded):
    for key in (None, "wrong"):
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", {"messages": USER})):
            status, headers, text = authorized(guarded, method, path, body, key=key)
            assert (status, headers["WWW-Authenticate"]) == (401, "Bearer")
            assert json.loads(text)["error"]["code"] == "invalid_api_key"
    status, _, text = authorized(guarded, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2,
                                                                           "model": "gpt-4o"})
    assert status == 200 and json.loads(text)["model"] == "nanopost"
    assert [m["id"] for m in json.loads(authorized(guarded, "GET", "/v1/models")[2])["data"]] == ["nanopost", "gpt-4o"]
    assert request(guarded, "GET", "/")[0] == 200 and request(guarded, "GET", "/health")[0] == 200


def test_cors_only_for_the_configured_origin(guarded, server):
    status, headers, _ = authorized(guarded, "OPTIONS", "/v1/chat/completions", key=None,
                                    origin="http://localhost:3000")
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert "Authorization" in headers["Access-Control-Allow-Headers"]
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert authorized(guarded, "GET", "/v1/models", origin="http://localhost:3000")[1][
        "Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert "Access-Control-Allow-Origin" not in authorized(guarded, "GET", "/v1/models", origin="http://evil.example")[1]
    status, headers, _ = authorized(server, "OPTIONS", "/v1/models", key=None, origin="http://localhost:3000")
    assert status == 204 and "Access-Control-Allow-Origin" not in headers  # no --cors-origin: no CORS


def test_binding_beyond_loopback_needs_a_key(tmp_path):
    env = {"NANOPOST_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "serve.py", "--ckpt", str(tmp_path / "none"), "--host", "0.0.0.0"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1 and "--api-key" in result.stderr and "--allow-no-key" in result.stderr
    assert [serve.is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "192.168.1.5")] == \
        [True, True, True, False, False]


# -----------------------------------------------------------------------------
# Round trip: a reply sent back as text is read back into the model's format


def test_replies_sent_back_as_text_render_as_the_model_wrote_them(calculator_model, tokenizer):
    server = start(Engine(calculator_model, tokenizer))
    try:
        body = {"messages": USER, "max_tokens": 20, "temperature": 0}
        reply = chat(server, **body)["choices"][0]["message"]
        raw = chat(server, **body, raw_tokens=True)["choices"][0]["message"]["content"]
        prompts = []
        for sent in ({"role": "assistant", "content": reply["content"]},  # the readable [calculator: ...] text
                     {"role": "assistant", "content": raw},  # the special tokens as text
                     reply,  # the whole message, content_parts included (what messages.append(reply) sends)
                     {"role": "assistant", "content": reply["content_parts"]}):
            usage = chat(server, messages=[*USER, sent, *USER], max_tokens=1)["usage"]
            prompts.append(usage["prompt_tokens"])
        assert len(set(prompts)) == 1
        plain = chat(server, messages=[*USER, {"role": "assistant", "content": [{"type": "text", "text":
                                                                                  reply["content"]}]}, *USER],
                     max_tokens=1)["usage"]["prompt_tokens"]
        assert plain > prompts[0]  # the readable text taken literally is longer: it was not read back before
    finally:
        stop(server)


def test_reply_parts_inverts_readable_reply(tokenizer):
    from engine import assistant_content, reply_parts

    tokens = calculator_reply(tokenizer)
    assert reply_parts(readable_reply(tokenizer, tokens)) == assistant_content(tokenizer, tokens)
    assert reply_parts(tokenizer.decode(tokens[:-1])) == assistant_content(tokenizer, tokens)
    assert reply_parts("[calculator: 1+") == [{"type": "text", "text": "[calculator: 1+"}]  # unfinished: text


# -----------------------------------------------------------------------------
# The official client (where the `openai` package is installed; it is not a dependency)


def test_the_official_openai_client(server, tokenizer):
    openai = pytest.importorskip("openai")
    import asyncio

    base = f"http://127.0.0.1:{server.server_address[1]}/v1"
    client = openai.OpenAI(base_url=base, api_key="none", timeout=TIMEOUT, max_retries=0)
    reply = client.chat.completions.create(model="nanopost", messages=USER, max_tokens=12, seed=3, logprobs=True,
                                           top_logprobs=2)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and len(choice.logprobs.content) == reply.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="nanopost", messages=USER, max_tokens=12, seed=3,
                                                 stream=True, stop=["zz"]))
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] in (["stop"], ["length"])
    # messages.append(reply): the whole message object goes back, and is read back into the model's format
    follow = client.chat.completions.create(model="nanopost", messages=[*USER, choice.message, *USER], max_tokens=2)
    parts = {"role": "assistant", "content": choice.message.model_extra["content_parts"]}
    exact = client.chat.completions.create(model="nanopost", messages=[*USER, parts, *USER], max_tokens=2)
    assert follow.usage.prompt_tokens == exact.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="'tools' is not supported"):
        client.chat.completions.create(model="nanopost", messages=USER, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        client.chat.completions.create(model="gpt-4o", messages=USER)

    async def many():
        async with openai.AsyncOpenAI(base_url=base, api_key="none", timeout=TIMEOUT, max_retries=0) as aclient:
            replies = await asyncio.gather(*[aclient.chat.completions.create(
                model="nanopost", messages=[{"role": "user", "content": f"What is {i}+1?"}], max_tokens=8, seed=i)
                for i in range(16)])
        return [r.choices[0].finish_reason for r in replies]

    assert set(asyncio.run(many())) <= {"stop", "length"}


def test_the_official_client_sees_an_interrupted_stream_as_an_error(model, tokenizer):
    openai = pytest.importorskip("openai")
    server = start(Engine(model, tokenizer))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="none",
                               timeout=TIMEOUT, max_retries=0)
        stream = client.chat.completions.create(
            model="nanopost", messages=USER, max_tokens=100, temperature=0, stream=True,
            logit_bias={str(tokenizer.token_id("<|assistant_end|>")): -100, str(tokenizer.bos_id): -100})
        next(stream)
        server.worker.stop()
        with pytest.raises(openai.APIError, match="shutting down"):
            for chunk in stream:
                assert chunk.choices[0].finish_reason in (None, "length")
    finally:
        server.shutdown()
        server.server_close()

"""
serve.py end to end: a real server on an ephemeral 127.0.0.1 port, a tiny random model, the real tokenizer and
engine. Every request has a timeout and goes to 127.0.0.1 only.
"""

import http.client
import json
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


def test_a_prompt_samples_the_same_whatever_shares_its_batch(model, tokenizer):
    # The property the server's seeds rely on: each prompt's rows draw from their own generator.
    engine = Engine(model, tokenizer)
    a, b = (tokenizer.render_for_completion({"messages": [{"role": "user", "content": text}]})
            for text in ("What is 3+4?", "hello there, how are you"))

    def run(prompts, samplings):
        for rows in engine.generate_steps(prompts, samplings, num_samples=2, max_tokens=20):
            pass
        return [c.tokens for c in rows]

    alone = run([a], [Sampling(temperature=1.0, seed=7)])
    batched = run([b, a], [Sampling(temperature=0.8, top_k=5, seed=3), Sampling(temperature=1.0, seed=7)])
    assert batched[2:] == alone
    assert alone[0] != alone[1]  # a prompt's samples still differ from each other
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate_steps([a, b], [Sampling()])


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
    assert health(server)["cancelled_rows"] == before + 1  # the row stopped before its CAP tokens


def test_a_crash_in_generation_answers_500_and_the_server_stays_up(server, model, monkeypatch):
    def broken_forward(*args, **kwargs):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(model, "forward", broken_forward)
    status, _, text = request(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 5})
    assert status == 500 and "simulated failure" in json.loads(text)["error"]["message"]
    monkeypatch.undo()
    assert chat(server, messages=USER, max_tokens=5)["choices"][0]["message"]["role"] == "assistant"


def test_the_page_is_served_and_self_contained(server):
    status, headers, page = request(server, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "/v1/chat/completions" in page and "New chat" in page
    assert not re.search(r"https?:|//[a-z0-9]|\bsrc\s*=|\bhref\s*=|@import|url\(", page, re.IGNORECASE)


def test_ctrl_c_shuts_down_cleanly(model, tokenizer, tmp_path):
    import common

    common.save_checkpoint(tmp_path / "sft", 0, model, {"stage": "test"}, tokenizer=tokenizer)
    process = subprocess.Popen([sys.executable, "serve.py", "--ckpt", str(tmp_path / "sft"), "--port", "0",
                                "--device", "cpu", "--quiet"], stderr=subprocess.PIPE, text=True,
                               env={"NANOPOST_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
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


def test_readable_reply_grows_by_prefixes(tokenizer):
    t = tokenizer.token_id
    tokens = [*tokenizer.encode("so "), t("<|python_start|>"), *tokenizer.encode("17+25"), t("<|python_end|>"),
              t("<|output_start|>"), *tokenizer.encode("42"), t("<|output_end|>"), *tokenizer.encode(" ok"),
              t("<|assistant_end|>")]
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


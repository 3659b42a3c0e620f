"""
Serve a chat checkpoint: an OpenAI-compatible HTTP API and a web chat page, standard library only.

    python serve.py --ckpt ~/.cache/nanopost/checkpoints/rl          # then open http://127.0.0.1:8000
    curl -s 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "What is 17 + 25?"}]}'
    NANOPOST_API_KEY=secret python serve.py --ckpt ... --host 0.0.0.0   # beyond loopback: a key, or --allow-no-key

Endpoints: POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id}, GET /health (status and the batching
counters), GET / (the chat page), OPTIONS on any of them (CORS headers only with --cors-origin). Query strings are
ignored. With --api-key (or $NANOPOST_API_KEY) the /v1/ routes need `Authorization: Bearer <key>`.

Every request parameter is honoured or refused with a 400 that names it, never silently ignored. Honoured:
messages (roles system, developer = system, user, assistant), model (this checkpoint's name or a --model-alias),
temperature, top_p (0 = greedy), max_tokens or max_completion_tokens, seed, n, stream, stream_options.include_usage,
stop (up to 4 strings: the reply ends before the first one, finish_reason "stop"), logprobs and top_logprobs (of the
distribution each token was sampled from: after temperature, top-k/top-p, penalties and bias; a forced calculator
output token has log-prob 0 and no alternatives), presence_penalty, frequency_penalty, logit_bias (this tokenizer's
ids), response_format {"type": "text"}, tool_choice "none", store false, user (an id for the caller's records; it
changes nothing). Refused: tools and function calling, JSON modes, anything else.
Extensions to OpenAI's request: `top_k` (an int), and `raw_tokens: true`, which returns a calculator call as the
special tokens the model wrote (<|python_start|>17+25<|python_end|><|output_start|>42<|output_end|>) instead of
the readable `[calculator: 17+25 → 42]` (engine.readable_reply). A non-streamed reply also carries the extension
message.content_parts: the reply split into text / python / python_output parts. An assistant message sent back in
either text form, or with its content_parts, is read back into those parts (engine.reply_parts), so the next prompt
shows the calls as the model wrote them. Every conversation renders through tokenizer.render_for_completion.

Protocol: HTTP/1.1 with keep-alive; a stream is server-sent events in OpenAI's chunk format sent with chunked
transfer encoding and ended by `data: [DONE]`, so a server that dies mid-reply is a broken chunked body the client
sees as an error; a reply the server cannot finish (a failure, a shutdown) ends with an error event instead of
[DONE]; finish_reason is only ever "stop" or "length". A body that is not JSON of at most MAX_JSON_DEPTH levels is a
400, one over --max-body a 413 sent after reading (up to MAX_DRAIN bytes) what the client sends, so that it reads
the answer; 503s (full queue, too many connections, shutting down) carry Retry-After. At most --max-connections are
open at once, and each request must arrive (request line, headers, body) within --read-timeout seconds, which also
bounds an idle keep-alive connection.

How requests are served (continuous batching, engine.DecodeBatch). One worker thread owns the model. Requests wait
in a queue of at most --max-queue (a full queue answers 503 at once). Before every decoding step the worker admits
every waiting request whose rows still fit --max-batch (oldest first): their prompts are prefilled together in one
forward and their rows join the running batch at that step, each request with its own sampling settings, seed and
max_tokens; n > 1 shares one prefill per prompt. A row leaves the batch as soon as it finishes; a client that goes
away, or a reply that reached a stop string, has its rows finished before the next step. A failure inside
generation answers 500 (an error event in a stream) to the requests decoding then, and the worker goes on. The
decode step is the Engine's: compiled where that is its default (CUDA; --eager opts out), eager on CPU.
"""

import argparse
import hmac
import ipaddress
import json
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import common
from engine import DecodeBatch, Engine, Request, Sampling, assistant_content, load_model, readable_reply, reply_parts

MAX_JSON_DEPTH = 32  # nesting of a request body; a chat request needs 5
MAX_DRAIN = 64 << 20  # bytes of an oversized body read (and dropped) before answering 413; beyond it, just close
MAX_STOP = 4  # stop strings per request, as OpenAI
MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
RETRY_AFTER = "1"  # seconds a client told 503 should wait

# -----------------------------------------------------------------------------
# Requests: validation and the job the worker runs


class ApiError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status, message, param=None, kind="invalid_request_error", code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or ({"Retry-After": RETRY_AFTER} if status == 503 else {})

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Job:
    """One chat-completion request: the engine Request, the reply's settings, and the events the worker sends back."""

    def __init__(self, request, stop=(), logprobs=False):
        self.request, self.stop, self.logprobs = request, list(stop), logprobs
        self.n = request.num_samples
        self.events = deque()  # ("step", new tokens, finish, new log-prob entries; one each per sample) or ("error", ApiError)
        self.ready = threading.Condition()
        self.cancelled = False  # set by the handler when its client went away
        self.ended = set()  # samples the handler ended (their text reached a stop string): the worker stops their rows
        self.sent = [0] * self.n  # worker side: tokens of each sample already sent

    def put(self, event):
        with self.ready:
            self.events.append(event)
            self.ready.notify()

    def get(self, timeout):
        """The next event, or None after `timeout` seconds without one."""
        with self.ready:
            if not self.events:
                self.ready.wait(timeout)
            return self.events.popleft() if self.events else None


def parse_json(data):
    """The JSON value of a request body; ApiError(400) for anything but JSON nested at most MAX_JSON_DEPTH deep."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    try:
        body = json.loads(data, parse_constant=refuse)
    except RecursionError:
        raise ApiError(400, f"the request body is nested too deeply (this server takes {MAX_JSON_DEPTH} levels)") \
            from None
    except ValueError as e:  # also bad UTF-8, and integers past Python's digit limit
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    level = [(body, 1)]
    while level:  # breadth-first, without recursion
        value, depth = level.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        level.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return body


def _number(body, key, default, low, high, integer=False):
    """body[key] (default when absent or null), checked to be a number (an int if `integer`) in [low, high]."""
    value = body.get(key)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ApiError(400, f"'{key}' must be {kind}, got {json.dumps(value)}", key)
    if not low <= value <= high:
        bounds = f">= {low}" if high == float("inf") else f"between {low} and {high}"
        raise ApiError(400, f"'{key}' must be {bounds}, got {value}", key)
    return value


def _flag(body, key):
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be true or false, got {json.dumps(value)}", key)
    return bool(value)


HONOURED = {"messages", "model", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "seed", "n",
            "stream", "stream_options", "stop", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
            "logit_bias", "response_format", "tool_choice", "store", "user", "raw_tokens"}
NO_TOOLS = ("this server has no function calling: the model calls its built-in calculator by itself, and the reply "
            "shows the call as [calculator: expr → result]")
WHY_NOT = {"tools": NO_TOOLS, "functions": NO_TOOLS, "function_call": NO_TOOLS, "parallel_tool_calls": NO_TOOLS}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MESSAGE_FIELDS = {"role", "content", "content_parts"}  # others are refused unless null or empty (clients echo them)


def read_messages(messages):
    """OpenAI messages -> the tokenizer's conversation; assistant text is read back into tool-call parts."""
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be a list of {\"role\", \"content\"} objects", "messages")
    if not messages:
        raise ApiError(400, "'messages' is empty; send at least one user message", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"message {i} must be an object with 'role' and 'content', got {json.dumps(m)}",
                           "messages")
        extra = sorted(k for k, v in m.items() if k not in MESSAGE_FIELDS and v not in (None, [], ""))
        if m.get("role") == "tool" or "tool_calls" in extra or "function_call" in extra:
            what = "has role 'tool'" if m.get("role") == "tool" else f"has {extra[0]!r}"
            raise ApiError(400, f"message {i} {what}, which this server does not support: {NO_TOOLS}", "messages")
        if extra:
            raise ApiError(400, f"message {i} has {extra[0]!r}, which this server does not support: a message is "
                                "'role' and 'content' (assistant messages may add 'content_parts')", "messages")
        role, content = ROLES.get(m.get("role"), m.get("role")), m.get("content")
        if role != "assistant" and m.get("content_parts") is not None:
            raise ApiError(400, f"message {i} has 'content_parts' with role {m.get('role')!r}: only assistant "
                                "messages carry them (the model's own tool calls)", "messages")
        if role == "assistant" and m.get("content_parts") is not None:
            content = m["content_parts"]
        elif role == "assistant" and isinstance(content, str):
            content = reply_parts(content)
        turns.append({"role": role, "content": content})
    return {"messages": turns}


def ascii_digits(text):
    """Whether text is a non-negative decimal integer in ASCII digits (str.isdigit() also takes '²' and '١')."""
    return isinstance(text, str) and re.fullmatch(r"[0-9]+", text) is not None


def parse_request(body, tokenizer, context, limits):
    """
    The Job and the flags (stream, raw_tokens, include_usage) of a decoded request body; ApiError(400) naming
    what is wrong.
    context: the model's context length (prompt + max_tokens must fit). limits: the server's settings.
    """
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if value is not None and key not in HONOURED:
            raise ApiError(400, f"'{key}' is not supported by this server" + (f": {WHY_NOT[key]}" if key in WHY_NOT
                                                                                 else ""), key)
    model = body.get("model")
    if model is not None and model != limits.model_name and model not in limits.aliases and "*" not in limits.aliases:
        raise ApiError(404, f"model {json.dumps(model)} is not served here; this server serves {limits.model_name!r}"
                            + (f" (also answering to {', '.join(map(repr, limits.aliases))})" if limits.aliases
                               else "") + " (--model-alias adds names)", "model", code="model_not_found")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise ApiError(400, f"'response_format' {json.dumps(response_format)} is not supported: this model cannot be "
                            "constrained to JSON; only {\"type\": \"text\"}", "response_format")
    if body.get("tool_choice") not in (None, "none"):
        raise ApiError(400, f"'tool_choice' can only be \"none\": {NO_TOOLS}", "tool_choice")
    if body.get("store") not in (None, False):
        raise ApiError(400, "'store' can only be false: this server stores nothing", "store")
    if not isinstance(body.get("user", ""), str):
        raise ApiError(400, "'user' must be a string", "user")

    conversation = read_messages(body.get("messages"))
    try:
        prompt = tokenizer.render_for_completion(conversation)
    except ValueError as e:
        raise ApiError(400, f"invalid 'messages': {e}", "messages") from None
    if conversation["messages"][-1]["role"] != "user":
        raise ApiError(400, f"the last message has role {conversation['messages'][-1]['role']!r}; the assistant "
                            "answers a user message, so the last message must be from the user", "messages")
    if len(prompt) >= context:
        raise ApiError(400, f"the conversation is {len(prompt)} tokens; this model's context is {context} tokens, "
                            "which must hold the conversation and the reply; start a new conversation", "messages",
                       code="context_length_exceeded")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, None, 1, float("inf"), integer=True)
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise ApiError(400, f"'{key}' is {max_tokens}, above this server's cap of {limits.max_tokens} (--max-tokens)",
                       key)
    if max_tokens is None:
        max_tokens = min(limits.max_tokens, context - len(prompt))
    elif len(prompt) + max_tokens > context:
        raise ApiError(400, f"this model's context is {context} tokens; the conversation ({len(prompt)} tokens) "
                            f"plus {key}={max_tokens} does not fit; ask for at most {context - len(prompt)}", key,
                       code="context_length_exceeded")

    temperature = _number(body, "temperature", limits.temperature, 0, 2)
    top_p = _number(body, "top_p", None, 0, 1)
    if top_p == 0:  # OpenAI accepts it: only the most likely token is left, i.e. greedy
        temperature, top_p = 0, None
    sampling = Sampling(temperature=temperature, top_p=top_p,
                        top_k=_number(body, "top_k", limits.top_k, 1, tokenizer.vocab_size, integer=True),
                        seed=_number(body, "seed", None, -2**63, 2**64 - 1, integer=True))
    n = _number(body, "n", 1, 1, limits.max_n, integer=True)

    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or not 1 <= len(stop) <= MAX_STOP
                             or not all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, f"'stop' must be a non-empty string or a list of 1 to {MAX_STOP} of them, got "
                            f"{json.dumps(body.get('stop'))}", "stop")
    logprobs = _flag(body, "logprobs")
    top_logprobs = _number(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True)
    if top_logprobs and not logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logit_bias = body.get("logit_bias") or {}
    if not isinstance(logit_bias, dict) or len(logit_bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} {{\"token id\": bias}} "
                            "entries", "logit_bias")
    bias = {}
    for token, value in logit_bias.items():
        if not ascii_digits(token) or int(token) >= tokenizer.vocab_size:
            raise ApiError(400, f"'logit_bias' has key {token!r}; keys are token ids of this model's tokenizer, "
                                f"0 to {tokenizer.vocab_size - 1}", "logit_bias")
        bias[int(token)] = _number(logit_bias, token, 0, -100, 100)
    request = Request(prompt, n, max_tokens, sampling, logit_bias=bias, top_logprobs=top_logprobs,
                      presence_penalty=_number(body, "presence_penalty", 0.0, -2, 2),
                      frequency_penalty=_number(body, "frequency_penalty", 0.0, -2, 2))

    flags = {"stream": _flag(body, "stream"), "raw_tokens": _flag(body, "raw_tokens")}
    stream_options = body.get("stream_options")
    if stream_options is not None and (not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}
                                       or not flags["stream"]):
        raise ApiError(400, "'stream_options' is {\"include_usage\": true|false}, with \"stream\": true",
                       "stream_options")
    flags["include_usage"] = _flag(stream_options or {}, "include_usage")
    return Job(request, stop or (), logprobs), flags


# -----------------------------------------------------------------------------
# The generation worker: one thread owns the model and decodes the requests together, step by step


class Worker:
    def __init__(self, engine, device, max_queue, max_batch):
        self.engine, self.device, self.max_queue, self.max_batch = engine, device, max_queue, max_batch
        self.jobs = deque()  # waiting, oldest first
        self.running = []  # jobs with rows in the batch
        self.batch = DecodeBatch(engine)
        self.lock = threading.Condition()
        self.stopping = False
        self.stats = {"requests": 0, "steps": 0, "prefills": 0, "joined_running": 0, "largest_batch": 0,
                      "cancelled_rows": 0, "errors": 0}
        self.thread = threading.Thread(target=self.run, name="generation", daemon=True)

    def submit(self, job):
        """Queue a job, or raise ApiError(503) at once when --max-queue requests already wait."""
        with self.lock:
            if self.stopping:
                raise ApiError(503, "the server is shutting down", kind="server_error")
            if len(self.jobs) >= self.max_queue:
                raise ApiError(503, f"{len(self.jobs)} requests are already waiting (--max-queue); retry shortly",
                               kind="server_error")
            self.jobs.append(job)
            self.stats["requests"] += 1
            self.lock.notify()

    def admit(self):
        """The waiting jobs, oldest first, whose rows fit the batch next to the running ones (the first one always
        fits an empty batch); jobs whose client left while waiting are dropped. Called with the lock held."""
        admitted, rows = [], self.batch.rows
        while self.jobs:
            job = self.jobs[0]
            if not job.cancelled and rows and rows + job.n > self.max_batch:
                break
            self.jobs.popleft()
            if not job.cancelled:
                admitted.append(job)
                rows += job.n
        return admitted

    def run(self):
        while True:
            with self.lock:
                while not self.jobs and not self.running and not self.stopping:
                    self.lock.wait()
                if self.stopping:
                    break
                new = self.admit()
            try:  # a failing prefill answers only the new requests: add() changes the batch only when it returns
                with common.autocast_ctx(self.device):
                    if new:
                        self.batch.add([job.request for job in new])
                        self.stats["prefills"] += 1
                        self.stats["joined_running"] += len(new) if self.running else 0
                        self.running += new
                        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(self.running))
            except Exception as e:
                self.fail(new, e)
            try:  # a failing step leaves the batch in no known state: its requests are answered 500, it starts anew
                with common.autocast_ctx(self.device):
                    self.finish_early()
                    self.batch.step()
                self.stats["steps"] += 1
                self.send()
            except Exception as e:
                self.fail(self.running, e)
                self.running, self.batch = [], DecodeBatch(self.engine)
        for job in self.running:
            job.put(("error", ApiError(503, "the server is shutting down; the reply is incomplete",
                                       kind="server_error")))

    def fail(self, jobs, e):
        """Answer `jobs` with a 500 naming the exception; the worker goes on with the others."""
        traceback.print_exc()
        self.stats["errors"] += 1
        error = ApiError(500, f"generation failed: {type(e).__name__}: {e}", kind="server_error")
        for job in jobs:
            job.put(("error", error))

    def finish_early(self):
        """Finish the rows nobody reads any more (client gone) or whose text reached a stop string."""
        for job in self.running:
            for s, c in enumerate(job.request.completions):
                if c.finish is None and (job.cancelled or s in job.ended):
                    c.finish = "cancelled" if job.cancelled else "stop"
                    self.stats["cancelled_rows"] += job.cancelled

    def send(self):
        """Send each running job its new tokens; jobs whose rows all finished leave."""
        for job in self.running:
            completions = job.request.completions
            if job.cancelled:
                continue
            if job.request.failed:  # its own rows only: the batch's other rows decoded this step as usual
                self.stats["errors"] += 1
                job.put(("error", ApiError(500, "generation failed: the model's next-token logits for this request "
                                                "are not finite (NaN or inf)", kind="server_error")))
                continue
            new, entries = [], []
            for s, c in enumerate(completions):
                start, job.sent[s] = job.sent[s], len(c.tokens)
                new.append(c.tokens[start:])
                entries.append([(c.tokens[k], c.logprobs[k], job.request.top[s][k] if job.request.top_logprobs
                                 else []) for k in range(start, len(c.tokens))] if job.logprobs else [])
            job.put(("step", new, [c.finish for c in completions], entries))
        self.running = [job for job in self.running if any(c.finish is None for c in job.request.completions)]

    def stop(self):
        """End the running requests with an error event at the next step, answer waiting ones 503, wait."""
        with self.lock:
            self.stopping = True
            waiting, self.jobs = list(self.jobs), deque()
            self.lock.notify()
        for job in waiting:
            job.put(("error", ApiError(503, "the server is shutting down", kind="server_error")))
        if self.thread.is_alive():
            self.thread.join(timeout=30)


# -----------------------------------------------------------------------------
# HTTP


class Choice:
    """One sample of a reply as its handler assembles it: tokens, text (cut before a stop string), log-probs."""

    def __init__(self):
        self.tokens, self.text, self.finish, self.trimmed = [], "", None, False
        self.logprobs, self.unsent = [], []  # entries for the reply; those a stream has not sent yet
        self.shown, self.done = 0, False  # characters streamed; finish_reason streamed


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and chunked streams whose truncation the client can see
    server_version = "nanopost"
    timeout = 60  # seconds a socket read or write may block: a stalled client cannot hold a thread forever

    def log_message(self, format, *args):
        if not self.server.quiet:
            super().log_message(format, *args)

    def handle_one_request(self):
        self.server.watch(self)  # the request (or, between requests, the next one) must arrive in --read-timeout
        try:
            super().handle_one_request()
        finally:
            self.server.unwatch(self)

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (414: request line too long, 431: too many or too long headers, 400: a bad
        request line, ...) as JSON, like every other error; the connection closes, as http.server's do."""
        self.close_connection = True
        self.send_json(code, ApiError(code, message or self.responses.get(code, ("error",))[0]).body())

    def end_headers(self):
        origin = self.server.cors_origin
        headers = getattr(self, "headers", None) or {}  # none yet when the request line itself was refused
        if origin is not None and origin in ("*", headers.get("Origin")):
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
        super().end_headers()

    def send_json(self, status, payload, headers=()):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in dict(headers).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, error):
        self.send_json(error.status, error.body(), error.headers)

    def authorize(self):
        """ApiError(401) unless the request carries the server's --api-key as `Authorization: Bearer <key>`."""
        key = self.server.api_key
        if key is None:
            return
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "this server needs an API key: send `Authorization: Bearer <key>` with the key it was "
                                "started with (--api-key or $NANOPOST_API_KEY)", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def do_OPTIONS(self):
        self.server.unwatch(self)
        self.send_response(204)
        self.send_header("Allow", "GET, POST, OPTIONS")
        if self.server.cors_origin is not None:
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")
            self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        self.server.unwatch(self)
        server, path = self.server, urlsplit(self.path).path
        if path == "/":
            data = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return self.wfile.write(data)
        if path == "/health":
            with server.worker.lock:  # a consistent snapshot; sent after the lock is released
                health = {"status": "ok", "model": server.model_name, "queued": len(server.worker.jobs),
                          "running": len(server.worker.running), **server.worker.stats}
            return self.send_json(200, health)
        models = [{"id": name, "object": "model", "created": server.started, "owned_by": "nanopost"}
                  for name in [server.model_name, *(a for a in server.limits.aliases if a != "*")]]
        try:
            if path.startswith("/v1/"):
                self.authorize()
            if path == "/v1/models":
                return self.send_json(200, {"object": "list", "data": models})
            if path.startswith("/v1/models/"):
                name = path[len("/v1/models/"):]
                model = next((m for m in models if m["id"] == name), None)
                if model is None:
                    raise ApiError(404, f"no model {name!r} here; GET /v1/models lists them", code="model_not_found")
                return self.send_json(200, model)
            raise ApiError(404, f"no route GET {path}; try /, /health, /v1/models")
        except ApiError as e:
            self.send_error_json(e)

    def do_POST(self):
        path = urlsplit(self.path).path
        try:
            if path != "/v1/chat/completions":
                self.close_connection = True  # its body is not read
                raise ApiError(404, f"no route POST {path}; try /v1/chat/completions")
            self.authorize_or_close()
            job, flags = self.read_request()
            self.server.worker.submit(job)
        except ApiError as e:
            return self.send_error_json(e)
        except ConnectionError:  # the body never came whole
            self.close_connection = True
            return
        self.reply_text = self.raw_reply if flags["raw_tokens"] else readable_reply
        try:
            if flags["stream"]:
                self.stream(job, flags["include_usage"])
            else:
                self.complete(job)
        except OSError:  # the client went away (or stalled past `timeout`): nobody reads the rest
            job.cancelled = True  # the worker finishes its rows at the next step
            self.close_connection = True

    def authorize_or_close(self):
        try:
            self.authorize()
        except ApiError:
            self.close_connection = True  # its body is not read
            raise

    def read_request(self):
        """The Job and flags of the request body; ApiError for a bad one; ConnectionError if it is cut short."""
        if len(self.headers.get_all("Content-Length") or []) > 1:  # which one frames the body is ambiguous
            self.close_connection = True
            raise ApiError(400, "the request has more than one Content-Length header; send one")
        if self.headers.get("Transfer-Encoding") is not None or not ascii_digits(self.headers.get("Content-Length")):
            self.close_connection = True
            raise ApiError(411, "send the JSON body with a Content-Length header (no chunked request bodies)")
        length, limit = int(self.headers["Content-Length"]), self.server.limits.max_body
        if length > limit:
            self.close_connection = True
            if length <= MAX_DRAIN:  # read it, so that a client that sends its whole body first reads the answer
                while length > 0 and (chunk := self.rfile.read(min(length, 1 << 16))):
                    length -= len(chunk)
            raise ApiError(413, f"the request body is {self.headers['Content-Length']} bytes; this server takes at "
                                f"most {limit} (--max-body)")
        data = self.rfile.read(length)
        if len(data) < length:
            raise ConnectionAbortedError
        self.server.unwatch(self)  # the request is in; generation may take longer than --read-timeout
        server = self.server
        return parse_request(parse_json(data), server.engine.tokenizer, server.engine.model.config.sequence_len,
                             server.limits)

    def raw_reply(self, tokenizer, tokens):
        return tokenizer.decode([t for t in tokens if t not in self.server.engine.stop_ids])

    def events(self, job, streaming):
        """The job's events as they come; raises ConnectionAbortedError when the client has gone away."""
        checked, probed = time.monotonic(), streaming
        while True:
            event = job.get(timeout=0.1)
            if time.monotonic() - checked > 0.1 or event is None:
                checked = time.monotonic()
                gone, probed = self.client_gone(probed)
                if gone:
                    raise ConnectionAbortedError
            if event is not None:
                yield event
                if event[0] == "error" or all(finish is not None for finish in event[2]):
                    return

    def client_gone(self, probed):
        """
        (gone, probed): gone once the client closed its connection. Reading the end of the stream is not enough: a
        client may half-close after sending and still read the reply. So at the first end-of-stream a harmless
        interim `100 Continue` is sent (HTTP/1.1 clients skip it), unless the reply is already streaming (its own
        writes do the same): a closed client answers it with a reset, which the next poll reports.
        """
        poller = select.poll()  # not select.select, which fails on descriptors above 1023
        poller.register(self.connection, select.POLLIN)
        try:
            events = poller.poll(0)
            if not events:
                return False, probed
            if events[0][1] & (select.POLLHUP | select.POLLERR):
                return True, probed
            if self.connection.recv(1, socket.MSG_PEEK) == b"" and not probed:
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.wfile.flush()
                probed = True
            return False, probed
        except OSError:
            return True, probed

    def response_header(self):
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": self.server.model_name}

    def absorb(self, job, choices, event):
        """Add a step event to the choices: tokens, text (cut before the first stop string), log-prob entries."""
        tokenizer = self.server.engine.tokenizer
        for s, (choice, new, finish, entries) in enumerate(zip(choices, *event[1:])):
            if choice.finish is not None:  # ended here at a stop string: what the worker sent after it is dropped
                continue
            choice.tokens += new
            entries = [token_logprob(tokenizer, token, logprob, top) for token, logprob, top in entries]
            choice.logprobs += entries
            choice.unsent += entries
            choice.text = self.reply_text(tokenizer, choice.tokens)
            cut = min((i for i in (choice.text.find(stop) for stop in job.stop) if i >= 0), default=-1)
            if cut >= 0:
                choice.text, choice.finish, choice.trimmed = choice.text[:cut], "stop", True
                job.ended.add(s)
            else:
                choice.finish = finish

    def complete(self, job):
        choices = [Choice() for _ in range(job.n)]
        for event in self.events(job, streaming=False):
            if event[0] == "error":
                return self.send_error_json(event[1])
            self.absorb(job, choices, event)
        tokenizer = self.server.engine.tokenizer
        reply = [{"index": s, "message": {"role": "assistant", "content": c.text,
                                          "content_parts": reply_parts(c.text) if c.trimmed else
                                          assistant_content(tokenizer, c.tokens)},
                  "logprobs": {"content": c.logprobs} if job.logprobs else None, "finish_reason": c.finish}
                 for s, c in enumerate(choices)]
        self.send_json(200, {**self.response_header(), "object": "chat.completion", "choices": reply,
                             "usage": usage(job, choices)})

    def write_chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def stream(self, job, include_usage):
        header = {**self.response_header(), "object": "chat.completion.chunk"}

        def send(payload):
            self.write_chunk(b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode())
                             + b"\n\n")

        def chunk(s, delta, finish=None):
            entries, choices[s].unsent = choices[s].unsent, []
            send({**header, "choices": [{"index": s, "delta": delta, "finish_reason": finish,
                                         "logprobs": {"content": entries} if job.logprobs else None}]})

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        choices = [Choice() for _ in range(job.n)]
        for s in range(job.n):
            chunk(s, {"role": "assistant", "content": ""})
        hold = max(map(len, job.stop), default=1) - 1  # a stop string may be starting in the last characters
        for event in self.events(job, streaming=True):
            if event[0] == "error":  # the status line is gone already: OpenAI's way is an error event, no [DONE]
                send(event[1].body())
                return self.write_chunk(b"")
            self.absorb(job, choices, event)
            for s, c in enumerate(choices):
                visible = c.text if c.finish else c.text[:len(c.text) - hold]
                while not c.finish and visible.endswith("\ufffd"):  # a character's last bytes are still to come
                    visible = visible[:-1]
                if len(visible) > c.shown:
                    chunk(s, {"content": visible[c.shown:]})
                    c.shown = len(visible)
                if c.finish and not c.done:
                    chunk(s, {}, c.finish)
                    c.done = True
        if include_usage:  # OpenAI's stream_options: a last chunk with no choices and the token counts
            send({**header, "choices": [], "usage": usage(job, choices)})
        send(b"[DONE]")
        self.write_chunk(b"")


def token_logprob(tokenizer, token, logprob, top):
    """OpenAI's log-prob entry of one token: its text, log-prob, UTF-8 bytes and the most likely alternatives."""
    def entry(t, lp):
        data = tokenizer.enc.decode_single_token_bytes(t)
        return {"token": data.decode(errors="replace"), "logprob": lp, "bytes": list(data)}

    return {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}


def usage(job, choices):
    prompt, completion = len(job.request.prompt), sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with a cap on open connections and a deadline on reading each request."""
    request_queue_size = 128  # connections the OS may hold before accept() (the default 5 resets a burst of clients)

    def setup_limits(self, max_connections, read_timeout):
        self.max_connections, self.read_timeout = max_connections, read_timeout
        self.open_connections, self.deadlines, self.guard = 0, {}, threading.Lock()
        self.closing = threading.Event()
        threading.Thread(target=self.reap, name="read-deadlines", daemon=True).start()

    def process_request(self, request, client_address):
        with self.guard:
            full = self.open_connections >= self.max_connections
            self.open_connections += not full
        if not full:
            return super().process_request(request, client_address)
        body = json.dumps(ApiError(503, f"{self.max_connections} connections are open (--max-connections); retry "
                                        "shortly", kind="server_error").body()).encode()
        try:  # answered here, without a thread: read what already arrived, so that closing does not reset it
            request.setblocking(False)
            request.recv(1 << 16)
        except OSError:
            pass
        try:
            request.setblocking(True)
            request.settimeout(1)
            request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: "
                            + RETRY_AFTER.encode() + b"\r\nConnection: close\r\nContent-Length: "
                            + str(len(body)).encode() + b"\r\n\r\n" + body)
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.guard:
                self.open_connections -= 1

    def watch(self, handler):
        with self.guard:
            self.deadlines[handler] = time.monotonic() + self.read_timeout

    def unwatch(self, handler):
        with self.guard:
            self.deadlines.pop(handler, None)

    def reap(self):
        """Close the connections whose request did not arrive in --read-timeout (a trickling or idle client)."""
        while not self.closing.wait(0.25):
            now = time.monotonic()
            with self.guard:
                late = [handler for handler, deadline in self.deadlines.items() if deadline < now]
                for handler in late:
                    del self.deadlines[handler]
            for handler in late:
                try:
                    handler.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def server_close(self):
        self.closing.set()
        super().server_close()


def make_server(engine, device="cpu", host="127.0.0.1", port=8000, model_name="nanopost", max_queue=64,
                max_batch=32, max_tokens=512, max_n=8, max_body=1 << 20, temperature=0.6, top_k=50, quiet=False,
                api_key=None, cors_origin=None, model_aliases=(), max_connections=128, read_timeout=30.0):
    """The HTTP server (serve_forever() to run it) with its worker in .worker (start it with .worker.thread.start())."""
    server = Server((host, port), Handler)
    server.setup_limits(max_connections, read_timeout)
    server.engine, server.model_name, server.quiet, server.started = engine, model_name, quiet, int(time.time())
    server.api_key, server.cors_origin = api_key, cors_origin
    server.limits = argparse.Namespace(max_tokens=max_tokens, max_n=max_n, max_body=max_body, temperature=temperature,
                                       top_k=top_k, model_name=model_name, aliases=list(model_aliases))
    server.worker = Worker(engine, device, max_queue, max_batch)
    return server


def is_loopback(host):
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host == "localhost"


def main():
    parser = argparse.ArgumentParser(description="Serve a chat checkpoint: OpenAI-compatible API + web chat page.")
    parser.add_argument("--ckpt", required=True, help="checkpoint folder, e.g. ~/.cache/nanopost/checkpoints/rl")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port; the chosen one is printed)")
    parser.add_argument("--device", default=None, help="cuda | mps | cpu (default: autodetect)")
    parser.add_argument("--api-key", default=os.environ.get("NANOPOST_API_KEY"),
                        help="require `Authorization: Bearer <key>` on /v1/ (default: $NANOPOST_API_KEY)")
    parser.add_argument("--allow-no-key", action="store_true",
                        help="serve beyond loopback without an API key (refused otherwise)")
    parser.add_argument("--cors-origin", default=None,
                        help="let pages from this origin (or *) call the API from a browser (CORS); default: none")
    parser.add_argument("--model-alias", action="append", default=[],
                        help="another model name requests may use (repeatable; * accepts any)")
    parser.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more are answered 503")
    parser.add_argument("--max-batch", type=int, default=32, help="rows (requests x n) decoded together at most")
    parser.add_argument("--max-tokens", type=int, default=512, help="cap on a request's max_tokens (400 above it)")
    parser.add_argument("--max-n", type=int, default=8, help="cap on a request's n (completions per request)")
    parser.add_argument("--max-body", type=int, default=1 << 20, help="request body cap in bytes (413 above it)")
    parser.add_argument("--max-connections", type=int, default=128, help="open connections; more are answered 503")
    parser.add_argument("--read-timeout", type=float, default=30.0,
                        help="seconds a request may take to arrive (and a keep-alive connection may idle)")
    parser.add_argument("--temperature", type=float, default=0.6, help="temperature when a request gives none")
    parser.add_argument("--top-k", type=int, default=50, help="top_k when a request gives none")
    parser.add_argument("--eager", action="store_true",
                        help="decode with the eager step even where the compiled one is the default (CUDA): the "
                             "compiled step makes the first requests wait for its compiles")
    parser.add_argument("--quiet", action="store_true", help="do not log each request")
    args = parser.parse_args()

    exposed = not is_loopback(args.host)
    if exposed and not args.api_key and not args.allow_no_key:
        sys.exit(f"error: --host {args.host} reaches beyond this machine and no API key is set: anyone who can "
                 "connect could use the model. Set --api-key (or $NANOPOST_API_KEY), or pass --allow-no-key.")
    device = common.autodetect_device() if args.device is None else args.device
    try:
        model, tokenizer, meta = load_model(args.ckpt, device)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    name = Path(args.ckpt).expanduser().resolve().name
    engine = Engine(model, tokenizer, compiled=False if args.eager else None)
    server = make_server(engine, device, args.host, args.port, name, args.max_queue, args.max_batch, args.max_tokens,
                         args.max_n, args.max_body, args.temperature, args.top_k, args.quiet, args.api_key or None,
                         args.cors_origin, args.model_alias, args.max_connections, args.read_timeout)
    server.worker.thread.start()
    host, port = server.server_address[:2]
    if exposed and not args.api_key:
        print("\n" + "!" * 100 + f"\nWARNING: serving on {host} WITHOUT an API key (--allow-no-key): anyone who can "
              "reach this port can use the model.\n" + "!" * 100 + "\n", file=sys.stderr, flush=True)
    # SIGINT stops the server even when it was started with SIGINT ignored, as a background job of a script
    # (`cmd &` without job control) is: Python then leaves SIGINT ignored instead of raising KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"serving {name} (step {meta.get('step')}, {model.num_params():,} parameters, {device}) on "
          f"http://{host}:{port}  (Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("shutting down", file=sys.stderr)
    finally:
        server.worker.stop()
        server.server_close()


# -----------------------------------------------------------------------------
# The chat page: one self-contained HTML file (no external scripts, styles or fonts)

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>nanopost chat</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 0; display: flex; flex-direction: column; height: 100vh; }
  header { display: flex; gap: 1em; align-items: center; padding: .5em 1em; border-bottom: 1px solid #ddd; }
  header h1 { font-size: 1.1em; margin: 0; flex: 1; }
  #log { flex: 1; overflow-y: auto; padding: 1em; }
  .msg { max-width: 46em; margin: 0 auto .8em; white-space: pre-wrap; line-height: 1.4; }
  .user { background: #eef3ff; padding: .5em .8em; border-radius: .5em; }
  .assistant .tool { display: inline-block; font-family: ui-monospace, monospace; background: #f3f3f3;
                     border: 1px solid #ccc; border-radius: .3em; padding: 0 .4em; margin: .1em 0; }
  .tool .label { color: #777; font-size: .8em; margin-right: .4em; }
  .busy .text::after { content: "\\25CF"; color: #999; margin-left: .2em; animation: blink 1s infinite; }
  @keyframes blink { 50% { opacity: 0; } }
  .incomplete .text, .incomplete.user { opacity: .55; }
  .note { display: block; margin-top: .3em; font-size: .85em; color: #a60; white-space: normal; }
  .error { color: #b00; }
  form { display: flex; gap: .5em; padding: .8em 1em; border-top: 1px solid #ddd; }
  textarea { flex: 1; font: inherit; height: 3em; }
  [hidden] { display: none !important; }
</style></head>
<body>
<header><h1>nanopost chat</h1>
  <label id="keybox" hidden>API key <input id="key" type="password" size="12" autocomplete="off"></label>
  <label>temperature <input id="temperature" type="number" min="0" max="2" step="0.1" value="0.6" size="3"></label>
  <button id="new" type="button">New chat</button></header>
<div id="log"></div>
<form id="form"><textarea id="input" placeholder="Message (Enter sends, Shift+Enter for a new line)"></textarea>
  <button id="send">Send</button><button id="stop" type="button" hidden>Stop</button></form>
<script>
"use strict";
// The conversation sent with every request: only finished exchanges (finish_reason "stop"). A reply cut by the
// token limit, stopped, interrupted or failed stays on screen, marked, and leaves the conversation with its user
// turn, whose text goes back into the input box.
let messages = [];
let controller = null;  // the running request's AbortController; null when idle
const log = document.getElementById("log"), input = document.getElementById("input");
const sendButton = document.getElementById("send"), stopButton = document.getElementById("stop");
const keyInput = document.getElementById("key"), keyBox = document.getElementById("keybox");
const MARKS = {"<|python_start|>": "python", "<|python_end|>": "text",
               "<|output_start|>": "python_output", "<|output_end|>": "text"};
const NOTES = {length: "Cut off: the reply reached the token limit. It is not part of the conversation.",
               stopped: "Stopped. This reply is not part of the conversation.",
               interrupted: "Interrupted: the connection to the server broke off. This reply is not part of the conversation.",
               unreachable: "Could not reach the server: is it running? Your message is back in the box, unsent."};
keyInput.value = sessionStorage.getItem("nanopost-key") || "";
keyBox.hidden = !keyInput.value;
keyInput.addEventListener("change", () => sessionStorage.setItem("nanopost-key", keyInput.value));

// raw reply text -> content parts, split at the tool tokens (as engine.assistant_content splits token ids)
function toParts(raw) {
  const parts = []; let kind = "text";
  for (const piece of raw.split(/(<\\|python_start\\|>|<\\|python_end\\|>|<\\|output_start\\|>|<\\|output_end\\|>)/)) {
    if (piece in MARKS) kind = MARKS[piece];
    else if (piece) parts.push({type: kind, text: piece});
  }
  return parts;
}

function render(div, parts) {  // text as text; a calculator call as one box: "calculator 17+25 → 42"
  div.textContent = "";
  const body = document.createElement("span"); body.className = "text"; div.append(body);
  let box = null;
  for (const part of parts) {
    if (part.type === "text") { body.append(part.text); box = null; continue; }
    if (part.type === "python" || !box) {
      box = document.createElement("span"); box.className = "tool";
      const label = document.createElement("span"); label.className = "label"; label.textContent = "calculator";
      box.append(label); body.append(box);
    }
    box.append(part.type === "python" ? part.text : " → " + part.text);
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role; div.textContent = text;
  log.append(div); log.scrollTop = log.scrollHeight;
  return div;
}

function note(div, text) {
  const span = document.createElement("span"); span.className = "note"; span.textContent = text; div.append(span);
}

function setBusy(busy) {
  sendButton.disabled = busy; stopButton.hidden = !busy;
}

class ServerError extends Error {
  constructor(error, status) { super(error.message); this.code = error.code; this.status = status; }
}

// Reads the server-sent events of a reply into div; returns the raw text and the finish_reason ("stop" or
// "length"), or null when the stream ended without one (the server went away).
async function readStream(response, div) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "", raw = "", finish = null;
  for (;;) {
    const {done, value} = await reader.read();
    if (done) return {raw, finish};
    buffer += decoder.decode(value, {stream: true});
    const events = buffer.split("\\n\\n"); buffer = events.pop();
    for (const event of events) {
      const data = event.replace(/^data: /, "");
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ServerError(chunk.error, 0);
      const choice = chunk.choices[0];
      raw += choice.delta.content || "";
      finish = choice.finish_reason || finish;
      render(div, toParts(raw)); log.scrollTop = log.scrollHeight;
    }
  }
}

async function send() {
  const text = input.value.trim();
  if (!text || controller) return;
  controller = new AbortController(); setBusy(true);
  input.value = "";
  messages.push({role: "user", content: text});
  const userDiv = addMessage("user", text);
  const div = addMessage("assistant busy", "");
  render(div, []);
  let outcome = "stop", error = null, raw = "", reached = false;
  try {
    const headers = {"Content-Type": "application/json"};
    if (keyInput.value) headers["Authorization"] = "Bearer " + keyInput.value;
    const response = await fetch("/v1/chat/completions", {method: "POST", headers, signal: controller.signal,
      body: JSON.stringify({messages, stream: true, raw_tokens: true,
                            temperature: parseFloat(document.getElementById("temperature").value)})});
    reached = true;
    if (!response.ok) throw new ServerError((await response.json()).error, response.status);
    const result = await readStream(response, div);
    raw = result.raw;
    outcome = result.finish || "interrupted";
  } catch (e) {
    if (e.name === "AbortError") outcome = "stopped";
    else if (e instanceof ServerError) { outcome = "error"; error = e; }
    // fetch itself failing is a refused connection; after the response it is a broken stream (a server killed)
    else outcome = reached ? "interrupted" : "unreachable";
  }
  div.classList.remove("busy");
  if (outcome === "stop") {
    messages.push({role: "assistant", content: toParts(raw).length ? toParts(raw) : [{type: "text", text: ""}]});
  } else {
    messages.pop();  // the user turn got no finished answer: it leaves the conversation, its text goes back
    userDiv.classList.add("incomplete"); div.classList.add("incomplete");
    if (!input.value) input.value = text;
    if (outcome !== "error") note(div, NOTES[outcome]);
    else if (raw) note(div, "Interrupted: " + error.message + ". This reply is not part of the conversation.");
    else { div.remove(); showError(error); }
  }
  controller = null; setBusy(false); input.focus();
}

function showError(e) {
  let text = "error: " + e.message;
  if (e.code === "context_length_exceeded")
    text = "This conversation no longer fits the model's context. Press New chat to start over.";
  else if (e.status === 401) {
    keyBox.hidden = false; keyInput.focus();
    text = "This server needs an API key: enter it in the API key field above, then send again.";
  }
  addMessage("error", text);
}

document.getElementById("form").addEventListener("submit", e => { e.preventDefault(); send(); });
input.addEventListener("keydown", e => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } });
stopButton.addEventListener("click", () => { if (controller) controller.abort(); });
document.getElementById("new").addEventListener("click", () => {
  if (controller) controller.abort();
  messages = []; log.textContent = ""; input.focus();
});
</script></body></html>
"""

if __name__ == "__main__":
    main()

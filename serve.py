"""
Serve a chat checkpoint: an OpenAI-compatible HTTP API and a web chat page, standard library only.

    python serve.py --ckpt ~/.cache/nanopost/checkpoints/rl          # then open http://127.0.0.1:8000
    curl -s 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "What is 17 + 25?"}]}'

Endpoints: POST /v1/chat/completions (OpenAI's schema: messages, temperature, top_p, max_tokens or
max_completion_tokens, seed, n, stream, stream_options.include_usage; with stream: true, server-sent events in
OpenAI's chunk format ending with `data: [DONE]`), GET /v1/models, GET /health (status and the batching
counters), GET / (the chat page).
Extensions to OpenAI's request: `top_k` (an int), and `raw_tokens: true`, which returns a calculator call as the
special tokens the model wrote (<|python_start|>17+25<|python_end|><|output_start|>42<|output_end|>) instead of
the readable `[calculator: 17+25 → 42]` (engine.readable_reply). A non-streamed reply also carries the extension
message.content_parts: the reply split into text / python / python_output parts by engine.assistant_content.
Sent back as an assistant turn's content, those parts render the calls as the model wrote them (the page does the
same from the raw tokens); a plain string is read as plain text. Every conversation renders through tokenizer.render_for_completion, as everywhere else.

How requests are served. One worker thread owns the model. Requests wait in a queue of at most --max-queue (a
full queue answers 503 at once); whenever the worker is free it takes every waiting request that fits one batch
(same n, at most --max-batch rows) and decodes them together with Engine.generate_steps, each request with its own
sampling settings, seed and max_tokens; n > 1 shares one prefill per prompt. Requests that arrive while a batch
decodes wait for the next one: a batch is fixed once it starts (no joining at a step boundary). A client that goes
away has its rows finished at the next step, so its batch ends as soon as the other rows do; a failure inside
generation answers 500 to the requests of that batch and the worker goes on with the next.
"""

import argparse
import json
import select
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import common
from engine import Engine, Sampling, assistant_content, load_model, readable_reply

# -----------------------------------------------------------------------------
# Requests: validation and the job the worker runs


class ApiError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status, message, param=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class Job:
    """One chat-completion request: its prompt and settings, and the events the worker sends back to its handler."""

    def __init__(self, prompt, n, max_tokens, sampling):
        self.prompt, self.n, self.max_tokens, self.sampling = prompt, n, max_tokens, sampling
        self.events = deque()  # ("step", new tokens per sample, finish per sample) or ("error", ApiError)
        self.ready = threading.Condition()
        self.cancelled = False  # set by the handler when its client went away

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


def parse_request(body, tokenizer, context, limits):
    """
    The Job and the flags (stream, raw_tokens, include_usage) of a decoded request body; ApiError(400) naming
    what is wrong.
    context: the model's context length (prompt + max_tokens must fit). limits: the server's settings.
    """
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be a list of {\"role\", \"content\"} objects", "messages")
    if not messages:
        raise ApiError(400, "'messages' is empty; send at least one user message", "messages")
    conversation = {"messages": [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m
                                 for m in messages]}
    try:
        prompt = tokenizer.render_for_completion(conversation)
    except ValueError as e:
        raise ApiError(400, f"invalid 'messages': {e}", "messages") from None
    if conversation["messages"][-1]["role"] != "user":
        raise ApiError(400, f"the last message has role {conversation['messages'][-1]['role']!r}; the assistant "
                            "answers a user message, so the last message must be from the user", "messages")
    if len(prompt) >= context:
        raise ApiError(400, f"the conversation is {len(prompt)} tokens; this model's context is {context} tokens, "
                            "which must hold the conversation and the reply; send fewer or shorter messages",
                       "messages")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, None, 1, float("inf"), integer=True)
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise ApiError(400, f"'{key}' is {max_tokens}, above this server's cap of {limits.max_tokens} (--max-tokens)",
                       key)
    if max_tokens is None:
        max_tokens = min(limits.max_tokens, context - len(prompt))
    elif len(prompt) + max_tokens > context:
        raise ApiError(400, f"this model's context is {context} tokens; the conversation ({len(prompt)} tokens) "
                            f"plus {key}={max_tokens} does not fit; ask for at most {context - len(prompt)}", key)
    sampling = Sampling(temperature=_number(body, "temperature", limits.temperature, 0, 2),
                        top_k=_number(body, "top_k", limits.top_k, 1, tokenizer.vocab_size, integer=True),
                        top_p=_number(body, "top_p", None, 1e-9, 1),
                        seed=_number(body, "seed", None, -2**63, 2**64 - 1, integer=True))
    n = _number(body, "n", 1, 1, limits.max_n, integer=True)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    flags = {}
    for flag, value in (("stream", body.get("stream")), ("raw_tokens", body.get("raw_tokens")),
                        ("include_usage", stream_options.get("include_usage"))):
        flags[flag] = False if value is None else value
        if not isinstance(flags[flag], bool):
            raise ApiError(400, f"'{flag}' must be true or false, got {json.dumps(value)}", flag)
    return Job(prompt, n, max_tokens, sampling), flags


# -----------------------------------------------------------------------------
# The generation worker: one thread owns the model and decodes queued requests together


class Worker:
    def __init__(self, engine, device, max_queue, max_batch):
        self.engine, self.device, self.max_queue, self.max_batch = engine, device, max_queue, max_batch
        self.jobs = deque()  # waiting, oldest first
        self.lock = threading.Condition()
        self.stopping = False
        self.stats = {"requests": 0, "batches": 0, "largest_batch": 0, "cancelled_rows": 0, "errors": 0}
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

    def next_batch(self):
        """
        The oldest waiting job (alone if its n exceeds max_batch) and every later one that can share its batch: the
        same n (the engine decodes num_samples rows per prompt), at most max_batch rows, and within the positions
        the model has.
        Empty when every waiting job was cancelled; None once stopping.
        """
        with self.lock:
            while not self.jobs and not self.stopping:
                self.lock.wait()
            if self.stopping:
                return None
            batch = []
            for job in list(self.jobs):
                longest = max(len(j.prompt) for j in batch + [job]) + max(j.max_tokens for j in batch + [job])
                if job.cancelled:  # its client left while it waited
                    self.jobs.remove(job)
                elif not batch or (job.n == batch[0].n and (len(batch) + 1) * job.n <= self.max_batch
                                   and longest <= self.engine.model.rotary_len):
                    batch.append(job)
                    self.jobs.remove(job)
            if batch:
                self.stats["batches"] += 1
                self.stats["largest_batch"] = max(self.stats["largest_batch"], len(batch))
            return batch

    def run(self):
        while (batch := self.next_batch()) is not None:
            try:
                if batch:
                    self.decode(batch)
            except Exception as e:  # a failure answers this batch's requests with 500; the worker goes on
                traceback.print_exc()
                self.stats["errors"] += 1
                error = ApiError(500, f"generation failed: {type(e).__name__}: {e}", kind="server_error")
                for job in batch:
                    job.put(("error", error))

    def decode(self, batch):
        n = batch[0].n
        sent = [0] * (len(batch) * n)  # tokens of each row already sent to its handler
        with common.autocast_ctx(self.device):
            steps = self.engine.generate_steps([job.prompt for job in batch], [job.sampling for job in batch],
                                               num_samples=n, max_tokens=max(job.max_tokens for job in batch))
            for rows in steps:
                for i, job in enumerate(batch):
                    mine = rows[i * n:(i + 1) * n]
                    for c in mine:  # finish here what the engine does not know about: the request's own limits
                        if c.finish is None and (job.cancelled or self.stopping):
                            c.finish = "cancelled"
                            self.stats["cancelled_rows"] += 1
                        elif c.finish is None and len(c.tokens) >= job.max_tokens:
                            c.finish = "length"
                    if job.cancelled or all(sent[i * n + s] == len(c.tokens) for s, c in enumerate(mine)):
                        continue  # nobody listens, or nothing new (the job finished at an earlier step)
                    new = [c.tokens[sent[i * n + s]:] for s, c in enumerate(mine)]
                    for s, c in enumerate(mine):
                        sent[i * n + s] = len(c.tokens)
                    job.put(("step", new, [c.finish for c in mine]))

    def stop(self):
        """Finish the running batch's rows at the next step, answer waiting requests 503, wait for the thread."""
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


class Handler(BaseHTTPRequestHandler):
    server_version = "nanopost"
    timeout = 60  # seconds a socket read or write may block: a stalled client cannot hold a thread forever

    def log_message(self, format, *args):
        if not self.server.quiet:
            super().log_message(format, *args)

    def send_json(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, error):
        self.send_json(error.status, error.body())

    def do_GET(self):
        server = self.server
        if self.path == "/":
            data = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/health":
            with server.worker.lock:  # a consistent snapshot; sent after the lock is released
                health = {"status": "ok", "model": server.model_name, "queued": len(server.worker.jobs),
                          **server.worker.stats}
            self.send_json(200, health)
        elif self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                                             "created": server.started, "owned_by": "nanopost"}]})
        else:
            self.send_error_json(ApiError(404, f"no route GET {self.path}; try /, /health, /v1/models"))

    def do_POST(self):
        if self.path != "/v1/chat/completions":
            return self.send_error_json(ApiError(404, f"no route POST {self.path}; try /v1/chat/completions"))
        try:
            job, flags = self.read_request()
            self.server.worker.submit(job)
        except ApiError as e:
            return self.send_error_json(e)
        self.reply_text = self.raw_reply if flags["raw_tokens"] else readable_reply
        try:
            if flags["stream"]:
                self.stream(job, flags["include_usage"])
            else:
                self.complete(job)
        except OSError:  # the client went away (or stalled past `timeout`): nobody reads the rest
            job.cancelled = True  # the worker finishes its rows at the next step

    def read_request(self):
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise ApiError(400, "send the JSON body with a Content-Length header")
        if int(length) > self.server.limits.max_body:
            self.close_connection = True  # the body is not read
            raise ApiError(413, f"the request body is {length} bytes; this server takes at most "
                                f"{self.server.limits.max_body} (--max-body)")
        try:
            body = json.loads(self.rfile.read(int(length)))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        server = self.server
        return parse_request(body, server.engine.tokenizer, server.engine.model.config.sequence_len, server.limits)

    def raw_reply(self, tokenizer, tokens):
        return tokenizer.decode([t for t in tokens if t not in self.server.engine.stop_ids])

    def events(self, job):
        """The job's events as they come; raises ConnectionAbortedError when the client has gone away."""
        checked = time.monotonic()
        while True:
            event = job.get(timeout=0.1)
            if time.monotonic() - checked > 0.1 or event is None:
                checked = time.monotonic()
                if self.client_gone():
                    raise ConnectionAbortedError
            if event is not None:
                yield event
                if event[0] == "error" or all(finish is not None for finish in event[2]):
                    return

    def client_gone(self):
        """True when the client closed its side: the socket reads as ready and the read is empty."""
        poller = select.poll()  # not select.select, which fails on descriptors above 1023
        poller.register(self.connection, select.POLLIN)
        try:
            return bool(poller.poll(0)) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def response_header(self):
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": self.server.model_name}

    def complete(self, job):
        tokens, finishes = [[] for _ in range(job.n)], [None] * job.n
        for event in self.events(job):
            if event[0] == "error":
                return self.send_error_json(event[1])
            for s, new in enumerate(event[1]):
                tokens[s] += new
            finishes = event[2]
        tokenizer = self.server.engine.tokenizer
        choices = [{"index": s, "message": {"role": "assistant", "content": self.reply_text(tokenizer, tokens[s]),
                                            "content_parts": assistant_content(tokenizer, tokens[s])},
                    "logprobs": None, "finish_reason": finishes[s]} for s in range(job.n)]
        self.send_json(200, {**self.response_header(), "object": "chat.completion", "choices": choices,
                             "usage": usage(job, tokens)})

    def stream(self, job, include_usage):
        header = {**self.response_header(), "object": "chat.completion.chunk"}

        def send(payload):
            self.wfile.write(b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode())
                             + b"\n\n")
            self.wfile.flush()

        def chunk(s, delta, finish=None):
            send({**header, "choices": [{"index": s, "delta": delta, "logprobs": None, "finish_reason": finish}]})

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.close_connection = True  # the stream ends when the connection does (HTTP/1.0, no length)
        for s in range(job.n):
            chunk(s, {"role": "assistant", "content": ""})
        tokenizer = self.server.engine.tokenizer
        tokens, shown = [[] for _ in range(job.n)], [""] * job.n
        for event in self.events(job):
            if event[0] == "error":  # the status line is gone already: OpenAI's way is an error event
                return send(event[1].body())
            for s, (new, finish) in enumerate(zip(event[1], event[2])):
                tokens[s] += new
                text = self.reply_text(tokenizer, tokens[s])
                if new and (finish is not None or not text.endswith("\ufffd")):  # wait for a character's last byte
                    if text[len(shown[s]):]:
                        chunk(s, {"content": text[len(shown[s]):]})
                    shown[s] = text
                if new and finish is not None:
                    chunk(s, {}, finish)
        if include_usage:  # OpenAI's stream_options: a last chunk with no choices and the token counts
            send({**header, "choices": [], "usage": usage(job, tokens)})
        send(b"[DONE]")


def usage(job, tokens):
    completion_tokens = sum(map(len, tokens))
    return {"prompt_tokens": len(job.prompt), "completion_tokens": completion_tokens,
            "total_tokens": len(job.prompt) + completion_tokens}


class Server(ThreadingHTTPServer):
    request_queue_size = 128  # connections the OS may hold before accept() (the default 5 resets a burst of clients)


def make_server(engine, device="cpu", host="127.0.0.1", port=8000, model_name="nanopost", max_queue=64,
                max_batch=32, max_tokens=512, max_n=8, max_body=1 << 20, temperature=0.6, top_k=50, quiet=False):
    """The HTTP server (serve_forever() to run it) with its worker in .worker (start it with .worker.thread.start())."""
    server = Server((host, port), Handler)
    server.engine, server.model_name, server.quiet, server.started = engine, model_name, quiet, int(time.time())
    server.limits = argparse.Namespace(max_tokens=max_tokens, max_n=max_n, max_body=max_body,
                                       temperature=temperature, top_k=top_k)
    server.worker = Worker(engine, device, max_queue, max_batch)
    return server


def main():
    parser = argparse.ArgumentParser(description="Serve a chat checkpoint: OpenAI-compatible API + web chat page.")
    parser.add_argument("--ckpt", required=True, help="checkpoint folder, e.g. ~/.cache/nanopost/checkpoints/rl")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port; the chosen one is printed)")
    parser.add_argument("--device", default=None, help="cuda | mps | cpu (default: autodetect)")
    parser.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more are answered 503")
    parser.add_argument("--max-batch", type=int, default=32, help="rows (requests x n) decoded together at most")
    parser.add_argument("--max-tokens", type=int, default=512, help="cap on a request's max_tokens (400 above it)")
    parser.add_argument("--max-n", type=int, default=8, help="cap on a request's n (completions per request)")
    parser.add_argument("--max-body", type=int, default=1 << 20, help="request body cap in bytes (413 above it)")
    parser.add_argument("--temperature", type=float, default=0.6, help="temperature when a request gives none")
    parser.add_argument("--top-k", type=int, default=50, help="top_k when a request gives none")
    parser.add_argument("--quiet", action="store_true", help="do not log each request")
    args = parser.parse_args()

    device = common.autodetect_device() if args.device is None else args.device
    try:
        model, tokenizer, meta = load_model(args.ckpt, device)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    name = Path(args.ckpt).expanduser().resolve().name
    server = make_server(Engine(model, tokenizer), device, args.host, args.port, name, args.max_queue,
                         args.max_batch, args.max_tokens, args.max_n, args.max_body, args.temperature, args.top_k,
                         args.quiet)
    server.worker.thread.start()
    host, port = server.server_address[:2]
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
  .error { color: #b00; }
  form { display: flex; gap: .5em; padding: .8em 1em; border-top: 1px solid #ddd; }
  textarea { flex: 1; font: inherit; height: 3em; }
</style></head>
<body>
<header><h1>nanopost chat</h1>
  <label>temperature <input id="temperature" type="number" min="0" max="2" step="0.1" value="0.6" size="3"></label>
  <button id="new">New chat</button></header>
<div id="log"></div>
<form id="form"><textarea id="input" placeholder="Message (Enter sends, Shift+Enter for a new line)"></textarea>
  <button id="send">Send</button></form>
<script>
"use strict";
let messages = [];  // the conversation sent with every request; assistant turns keep their tool calls as parts
let busy = false;
const log = document.getElementById("log"), input = document.getElementById("input");
const MARKS = {"<|python_start|>": "python", "<|python_end|>": "text",
               "<|output_start|>": "python_output", "<|output_end|>": "text"};

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
  let box = null;
  for (const part of parts) {
    if (part.type === "text") { div.append(part.text); box = null; continue; }
    if (part.type === "python" || !box) {
      box = document.createElement("span"); box.className = "tool";
      const label = document.createElement("span"); label.className = "label"; label.textContent = "calculator";
      box.append(label); div.append(box);
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

async function send() {
  const text = input.value.trim();
  if (!text || busy) return;
  busy = true; input.value = "";
  messages.push({role: "user", content: text});
  addMessage("user", text);
  const div = addMessage("assistant", "");
  let raw = "";
  try {
    const response = await fetch("/v1/chat/completions", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({messages, stream: true, raw_tokens: true,
                            temperature: parseFloat(document.getElementById("temperature").value)})});
    if (!response.ok) throw new Error((await response.json()).error.message);
    const reader = response.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {done, value} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      const events = buffer.split("\\n\\n"); buffer = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        raw += chunk.choices[0].delta.content || "";
        render(div, toParts(raw)); log.scrollTop = log.scrollHeight;
      }
    }
    messages.push({role: "assistant", content: toParts(raw).length ? toParts(raw) : [{type: "text", text: ""}]});
  } catch (e) {
    messages.pop();  // the user turn got no answer: drop it, so that the conversation still alternates
    addMessage("error", "error: " + e.message);
  }
  busy = false;
}

document.getElementById("form").addEventListener("submit", e => { e.preventDefault(); send(); });
input.addEventListener("keydown", e => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } });
document.getElementById("new").addEventListener("click", () => { messages = []; log.textContent = ""; input.focus(); });
</script></body></html>
"""

if __name__ == "__main__":
    main()

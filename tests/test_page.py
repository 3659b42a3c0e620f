"""
The chat page in a real headless browser (Debian's chromium, driven over the DevTools protocol on a pipe: no extra
Python package): finished, busy, stopped, cut-off, interrupted and failed replies, and an API key. Skipped where no
chromium is installed. Servers bind 127.0.0.1 on ephemeral ports; with $NANOPOST_SCREENSHOTS set, each state's
screenshot is also written there.
"""

import base64
import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

import serve
from conftest import make_model, make_tokenizer, scripted_model
from engine import Engine
from test_serve import start, stop

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed")]
TIMEOUT = 60


class Browser:
    """One headless chromium page, driven with DevTools protocol messages (JSON, NUL-separated) over fds 3 and 4."""

    def __init__(self, profile):
        to_chrome, self.writer = os.pipe()
        self.reader, from_chrome = os.pipe()
        # above the fds the child's 3 and 4 are copied to, so that neither copy overwrites the other
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in (to_chrome, from_chrome)]
        self.process = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--no-first-run", f"--user-data-dir={profile}", "about:blank"],
            pass_fds=(3, 4), preexec_fn=lambda: (os.dup2(high[0], 3), os.dup2(high[1], 4)),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for fd in (to_chrome, from_chrome, *high):
            os.close(fd)
        self.buffer, self.next_id = b"", 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=820, height=560, deviceScaleFactor=1, mobile=False,
                  session=True)

    def call(self, method, session=False, **params):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self.writer, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            while b"\0" not in self.buffer:
                self.buffer += os.read(self.reader, 1 << 20)
            raw, self.buffer = self.buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
        raise TimeoutError(method)

    def js(self, expression):
        result = self.call("Runtime.evaluate", session=True, expression=expression, awaitPromise=True,
                           returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def wait(self, expression):
        deadline = time.monotonic() + TIMEOUT
        while not self.js(expression):
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.05)

    def open(self, port):
        self.call("Page.navigate", session=True, url=f"http://127.0.0.1:{port}/")
        self.wait("document.readyState === 'complete' && typeof send === 'function'")

    def send(self, text):
        self.js(f"input.value = {json.dumps(text)}; document.getElementById('send').click()")

    def screenshot(self, path):
        data = base64.b64decode(self.call("Page.captureScreenshot", session=True, format="png")["data"])
        path.write_bytes(data)
        if os.environ.get("NANOPOST_SCREENSHOTS"):
            (Path(os.environ["NANOPOST_SCREENSHOTS"]) / path.name).write_bytes(data)

    def close(self):
        self.process.kill()
        self.process.wait(timeout=TIMEOUT)
        os.close(self.writer)
        os.close(self.reader)





@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def browser(tmp_path):
    browser = Browser(tmp_path / "profile")
    yield browser
    browser.close()


NOTE = "document.querySelector('.assistant:last-of-type .note')?.textContent || ''"


def test_finished_reply_api_key_and_context_full(browser, tokenizer, tmp_path):
    t = tokenizer.token_id
    call = [t("<|python_start|>"), *tokenizer.encode("2+3*4"), t("<|python_end|>")]
    transitions = {t("<|assistant_start|>"): call[0], **dict(zip(call[:-1], call[1:])),
                   t("<|output_end|>"): t("<|assistant_end|>")}
    server = start(Engine(scripted_model(tokenizer, transitions), tokenizer), api_key="k3y")
    try:
        browser.open(server.server_address[1])
        assert browser.js("document.getElementById('keybox').hidden")
        # greedy: at the page's default temperature 0.6 the scripted model leaves its script with probability ~0.2%
        # per token (399 other tokens tie with top_k's 50th and are kept), ~2% of runs over this reply
        browser.js("document.getElementById('temperature').value = '0'")
        browser.send("What is 2+3*4?")
        browser.wait("!!document.querySelector('.error')")
        # 401: the key field appears, the text is back in the input, nothing entered the conversation
        assert "API key" in browser.js("document.querySelector('.error').textContent")
        assert browser.js("[document.getElementById('keybox').hidden, input.value, messages.length]") == \
            [False, "What is 2+3*4?", 0]
        browser.screenshot(tmp_path / "page-api-key.png")
        browser.js("document.getElementById('key').value = 'k3y'; document.getElementById('send').click()")
        browser.wait("messages.length === 2")
        assert browser.js("document.querySelector('.assistant .tool').textContent") == "calculator2+3*4 → 14"
        assert browser.js("messages[1].content") == [{"type": "python", "text": "2+3*4"},
                                                    {"type": "python_output", "text": "14"}]
        assert browser.js("[input.value, document.getElementById('stop').hidden]") == ["", True]
        browser.screenshot(tmp_path / "page-finished.png")
        long = " ".join(["twelve plus seven"] * 30)  # more than the scripted model's 64-token context
        browser.send(long)
        browser.wait("document.querySelectorAll('.error').length === 2")
        assert "New chat" in browser.js("document.querySelectorAll('.error')[1].textContent")
        assert browser.js("[input.value, messages.length]") == [long, 2]
        browser.screenshot(tmp_path / "page-context-full.png")
    finally:
        stop(server)


def test_busy_stopped_cut_off_and_interrupted_replies(browser, tokenizer, tmp_path):
    model = make_model(tokenizer).eval()
    stops = [tokenizer.token_id("<|assistant_end|>"), tokenizer.bos_id]
    head = model.head

    def slow_head_that_never_stops(h):  # slow enough to watch the busy state; every reply runs to max_tokens
        time.sleep(0.05)
        logits = head(h)
        logits[..., stops] = -1e4
        return logits

    model.head = slow_head_that_never_stops
    server = start(Engine(model, tokenizer), max_tokens=40)
    connections = []
    stream = serve.Handler.stream

    def recorded_stream(handler, *args):
        connections.append(handler.connection)
        return stream(handler, *args)

    serve.Handler.stream = recorded_stream
    try:
        browser.open(server.server_address[1])
        browser.send("hello there")
        browser.wait("document.querySelector('.assistant .text').textContent.length > 5")
        assert browser.js("[document.getElementById('stop').hidden, document.getElementById('send').disabled]") == \
            [False, True]
        browser.screenshot(tmp_path / "page-busy.png")
        browser.js("document.getElementById('stop').click()")
        browser.wait(NOTE)
        assert browser.js(NOTE).startswith("Stopped") and browser.js("[input.value, messages.length]") == \
            ["hello there", 0]
        browser.screenshot(tmp_path / "page-stopped.png")

        browser.js("document.getElementById('send').click()")  # the restored text, sent again: runs to the limit
        browser.wait(f"{NOTE}.startsWith('Cut off')")
        assert browser.js("[input.value, messages.length]") == ["hello there", 0]
        browser.screenshot(tmp_path / "page-length.png")

        browser.js("document.getElementById('send').click()")
        browser.wait("document.querySelector('.assistant:last-of-type .text').textContent.length > 5")
        connections[-1].shutdown(2)  # the connection breaks mid-reply, as when the server is killed
        browser.wait(f"{NOTE}.startsWith('Interrupted')")
        assert browser.js("[input.value, messages.length, document.getElementById('stop').hidden]") == \
            ["hello there", 0, True]
        browser.screenshot(tmp_path / "page-interrupted.png")
    finally:
        serve.Handler.stream = stream
        stop(server)


def test_a_refused_connection_says_the_server_could_not_be_reached(browser, tokenizer, tmp_path):
    server = start(Engine(make_model(tokenizer).eval(), tokenizer), max_tokens=8)
    browser.open(server.server_address[1])
    stop(server)  # the page is loaded; the server is gone: the next fetch is refused
    browser.send("hello there")
    browser.wait(NOTE)
    assert browser.js(NOTE).startswith("Could not reach the server")
    assert browser.js("[input.value, messages.length]") == ["hello there", 0]
    browser.screenshot(tmp_path / "page-unreachable.png")

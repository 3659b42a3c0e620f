"""
serve.py under load: time to first token (TTFT) and generated tokens/s at several numbers of concurrent clients,
and the TTFT of a short request that arrives while a batch decodes. Servers run as their own processes on
127.0.0.1 (ephemeral ports), each serving the same random-init checkpoint (speed does not depend on the weights),
with a tokenizer trained on the synthetic task family, whose held-out questions are the prompts.

    python bench/serve.py                                     # depth 4, CPU: a few minutes on 2 cores
    python bench/serve.py --baseline /tmp/old-checkout        # side by side with an earlier serve.py
    python bench/serve.py --device cuda --depth 12 --clients 1 16 64

For each number of concurrent clients, every client sends --requests-per-client streamed requests back to back;
reported: generated tokens/s (all clients, from each stream's usage chunk) and p50/p95 TTFT (request sent -> first
content). "mid-batch": --clients-mid clients each send one request of --max-tokens tokens, and 0.5 s later one more
client asks for 13 tokens; reported is that late request's TTFT and latency.
With --baseline DIR (a checkout of an earlier version, e.g. `git archive <commit> | tar -x -C DIR`), both servers
run, measured alternately --repeats times (on a shared machine neighbours come and go: alternating spreads that over
both), and the medians are printed with the ratios.
The clients speak raw HTTP (http.client, in threads of this process, the servers in theirs): the `openai` client
would add its own per-request cost to what is measured, and a dependency.
"""

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from itertools import islice
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repo root: `serve` must not resolve to this file

import common  # noqa: E402
import tasks  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


def one_request(port, question, max_tokens, seed):
    """(seconds to the first content, seconds to the end, generated tokens) of one streamed request."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 1.0,
            "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    first, tokens = None, None
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[len(b"data: "):])
        if chunk.get("choices") and first is None and (chunk["choices"][0]["delta"].get("content")
                                                       or chunk["choices"][0]["finish_reason"]):
            first = time.perf_counter() - t0
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    connection.close()
    if response.status != 200 or tokens is None:
        raise RuntimeError(f"request failed with HTTP {response.status}")
    return first, time.perf_counter() - t0, tokens


def run_clients(port, clients, requests_per_client, questions, max_tokens, late=None):
    """tokens/s and per-request TTFTs of `clients` threads each sending its requests back to back; with `late`
    (delay s, max_tokens), also the (ttft, latency) of one more request sent `delay` seconds after the others."""
    results, errors, late_result = [], [], []

    def client(c):
        for r in range(requests_per_client):
            i = c * requests_per_client + r
            try:
                results.append(one_request(port, questions[i % len(questions)], max_tokens, seed=i))
            except Exception as e:  # reported below: a benchmark that hides failures measures nothing
                errors.append(e)

    def late_client():
        time.sleep(late[0])
        try:
            late_result.append(one_request(port, questions[-1], late[1], seed=12345))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    threads += [threading.Thread(target=late_client)] if late else []
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return {"tok/s": sum(r[2] for r in results) / seconds, "ttft": np.array([r[0] for r in results]),
            "late": late_result[0] if late else None}


def start_server(checkout, ckpt, device, max_batch, home):
    """A serve.py process of `checkout` on an ephemeral 127.0.0.1 port: (process, port)."""
    env = {**os.environ, "NANOPOST_HOME": home, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, str(Path(checkout) / "serve.py"), "--ckpt", ckpt, "--port", "0",
                                "--device", device, "--quiet", "--max-batch", str(max_batch)],
                               cwd=checkout, stderr=subprocess.PIPE, text=True, env=env)
    for line in process.stderr:
        if match := re.search(r"http://127\.0\.0\.1:(\d+)", line):
            return process, int(match.group(1))
    raise RuntimeError(f"{checkout}/serve.py did not start")


def main():
    parser = argparse.ArgumentParser(description="serve.py load test on 127.0.0.1: TTFT and tokens/s.")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | mps")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=512, help="(the synthetic corpus supports about 600)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16, 32], help="concurrency levels")
    parser.add_argument("--clients-mid", type=int, default=16, help="clients decoding when the late request comes")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=32, help="the servers' --max-batch")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per setting; medians are shown")
    parser.add_argument("--baseline", default=None, help="checkout of an earlier version to compare against")
    args = parser.parse_args()

    tokenizer = Tokenizer.train(tasks.synthetic_documents(2000, seed=0), vocab_size=args.vocab_size)
    config = GPTConfig.from_depth(args.depth, tokenizer.vocab_size, sequence_len=256)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    questions = [p["question"] for p in islice(tasks.synthetic_problems("test"), 64)]
    home = tempfile.mkdtemp(prefix="bench-serve-")
    ckpt = str(Path(home) / "bench")
    common.save_checkpoint(ckpt, 0, model, {"stage": "bench"}, tokenizer=tokenizer)
    print(f"depth {config.n_layer}, {model.num_params():,} parameters, vocab {config.vocab_size}, {args.device}, "
          f"1 thread per server; {args.requests_per_client} streamed requests per client, max_tokens "
          f"{args.max_tokens}, --max-batch {args.max_batch}; medians of {args.repeats} alternating runs")

    checkouts = {"current": str(REPO)} if args.baseline is None else {"baseline": args.baseline, "current": str(REPO)}
    servers = {name: start_server(path, ckpt, args.device, args.max_batch, home) for name, path in checkouts.items()}
    try:
        for name, (_, port) in servers.items():  # warm-up: allocations, kernel selection
            run_clients(port, 2, 1, questions, 8)
        settings = [(c, None) for c in args.clients] + [(args.clients_mid, (0.5, 13))]
        results = {}
        for clients, late in settings:
            for repeat in range(args.repeats):
                order = list(servers) if repeat % 2 == 0 else list(servers)[::-1]
                for name in order:
                    per_client = 1 if late else args.requests_per_client
                    results.setdefault((clients, late, name), []).append(
                        run_clients(servers[name][1], clients, per_client, questions, args.max_tokens, late))
        print(f"\n{'setting':>18} {'server':>9} {'tok/s':>8} {'TTFT p50':>9} {'p95':>7}   (ms, medians over runs)")
        summary = {}
        for (clients, late, name), runs in results.items():
            rate = float(np.median([r["tok/s"] for r in runs]))
            p50, p95 = (1000 * float(np.median([np.percentile(r["ttft"], q) for r in runs])) for q in (50, 95))
            label = f"{clients} clients" if late is None else f"{clients} + 1 late"
            summary[clients, late, name] = (rate, p50, p95)
            line = f"{label:>18} {name:>9} {rate:8.1f} {p50:9.0f} {p95:7.0f}"
            if late:
                ttft, latency = (1000 * float(np.median([r["late"][k] for r in runs])) for k in (0, 1))
                summary[clients, late, name] += (ttft,)
                line += f"   late request: TTFT {ttft:.0f} ms, latency {latency:.0f} ms"
            print(line)
        if args.baseline is not None:
            print()
            for clients, late in settings:
                old, new = summary[clients, late, "baseline"], summary[clients, late, "current"]
                text = (f"{clients} clients: tokens/s x{new[0] / old[0]:.2f}, TTFT p50 x{new[1] / old[1]:.2f}, "
                        f"p95 x{new[2] / old[2]:.2f}")
                if late:
                    text = f"{clients} clients + 1 late: late request's TTFT x{new[3] / old[3]:.2f}"
                print("current / baseline, " + text)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)


if __name__ == "__main__":
    main()

"""
What batching requests buys serve.py: a bounded load test against servers on 127.0.0.1 (in this process, ephemeral
ports), with a random-init model (speed does not depend on the weights) and a tokenizer trained on the synthetic
task family, whose held-out questions are the prompts.

    python bench/serve.py                        # depth 4, CPU: a minute or two on 2 cores
    python bench/serve.py --device cuda --depth 12 --clients 1 16 64

For each number of concurrent clients (each sends --requests-per-client streamed requests back to back), two servers:
    serial   --max-batch 1: the worker decodes one request at a time (requests wait their turn in the queue)
    batched  --max-batch 32: requests that wait while a batch decodes are decoded together in the next one
Reports generated tokens/s (all clients, from each stream's usage chunk), and p50/p95 time to the first token and
latency (request sent -> `data: [DONE]`), of the fastest of --repeats runs. Rows that sample a stop token end early;
tokens/s counts what was generated.
"""

import argparse
import concurrent.futures
import http.client
import multiprocessing
import json
import sys
import threading
import time
from itertools import islice
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `serve` must not resolve to this file

import serve  # noqa: E402
import tasks  # noqa: E402
from engine import Engine  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


def one_request(port, question, max_tokens, seed):
    """(seconds to the first token, seconds to the end, generated tokens) of one streamed request."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 1.0,
            "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body))
    response = connection.getresponse()
    first, tokens = None, None
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[len(b"data: "):])
        if chunk["choices"] and first is None and (chunk["choices"][0]["delta"].get("content")
                                                   or chunk["choices"][0]["finish_reason"]):
            first = time.perf_counter() - t0
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    connection.close()
    if response.status != 200 or tokens is None:
        raise RuntimeError(f"request failed with HTTP {response.status}")
    return first, time.perf_counter() - t0, tokens


def load(port, clients, requests_per_client, questions, max_tokens):
    """tokens/s and per-request (ttft, latency) of `clients` threads each sending its requests back to back."""
    results, errors = [], []

    def client(c):
        for r in range(requests_per_client):
            i = c * requests_per_client + r
            try:
                results.append(one_request(port, questions[i % len(questions)], max_tokens, seed=i))
            except Exception as e:  # reported below: a benchmark that hides failures measures nothing
                errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return sum(r[2] for r in results) / seconds, np.array([r[0] for r in results]), np.array([r[1] for r in results])


def main():
    parser = argparse.ArgumentParser(description="serve.py load test: batched vs one request at a time, 127.0.0.1.")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | mps")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=512, help="(the synthetic corpus supports about 600)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="concurrency levels")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per setting; the one with the most tokens/s is shown (on a shared machine the "
                             "slower runs measure the neighbours)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (1: steady timings on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = Tokenizer.train(tasks.synthetic_documents(2000, seed=0), vocab_size=args.vocab_size)
    config = GPTConfig.from_depth(args.depth, tokenizer.vocab_size, sequence_len=256)
    torch.manual_seed(0)
    model = GPT(config).to(args.device)
    model.init_weights()
    model.eval()
    engine = Engine(model, tokenizer)
    questions = [p["question"] for p in islice(tasks.synthetic_problems("test"), 64)]
    print(f"depth {config.n_layer}, {model.num_params():,} parameters, vocab {config.vocab_size}, {args.device}, "
          f"{args.threads} threads; {args.requests_per_client} streamed requests per client, "
          f"max_tokens {args.max_tokens}")

    # The clients run in a process of their own, as real clients would: in the server's process they would compete
    # with its threads for the GIL and measure that instead. It starts before the servers, so it forks no threads.
    clients_process = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
    clients_process.submit(time.sleep, 0).result()
    servers = {name: serve.make_server(engine, args.device, port=0, max_batch=max_batch, quiet=True)
               for name, max_batch in (("serial", 1), ("batched", 32))}
    for server in servers.values():
        server.worker.thread.start()
        threading.Thread(target=server.serve_forever, daemon=True).start()
    for server in servers.values():  # warm-up: allocations, kernel selection
        clients_process.submit(load, server.server_address[1], 2, 1, questions, 8).result()

    print(f"\n{'clients':>7} {'server':>8} {'tok/s':>8} {'TTFT p50':>9} {'p95':>7} {'latency p50':>12} {'p95':>7}"
          f"   (ms)")
    rates = {}
    for clients in args.clients:
        for name, server in servers.items():
            runs = [clients_process.submit(load, server.server_address[1], clients, args.requests_per_client,
                                           questions, args.max_tokens).result() for _ in range(args.repeats)]
            rate, ttft, latency = max(runs, key=lambda run: run[0])
            rates[clients, name] = rate
            ms = [1000 * np.percentile(x, q) for x in (ttft, latency) for q in (50, 95)]
            print(f"{clients:7d} {name:>8} {rate:8.1f} {ms[0]:9.0f} {ms[1]:7.0f} {ms[2]:12.0f} {ms[3]:7.0f}")
        stats = servers["batched"].worker.stats
        print(f"{'':7} batched: {stats['batches']} batches so far, largest {stats['largest_batch']} requests")
    for clients in args.clients:
        print(f"batched / serial tokens/s at {clients} clients: "
              f"{rates[clients, 'batched'] / rates[clients, 'serial']:.1f}x")
    for server in servers.values():
        server.shutdown()
        server.worker.stop()
        server.server_close()
    clients_process.shutdown()


if __name__ == "__main__":
    main()

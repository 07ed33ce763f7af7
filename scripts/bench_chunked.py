#!/usr/bin/env python3
"""A long prompt served through chunked prefill against the same prefill in one pass (issue 10's
target: <= 1.2x). scripts/bench-chunked is the front door (it builds kvshard and fetches the
default model); this file does the measuring. Standard library only.

  scripts/bench_chunked.py --kvshard build/cli/kvshard --model FILE [--runs 4]
                           [--prompt-tokens 2500] [--threads 2] [--budget TOKENS]
                           [--rt-priority 10] [--json OUT]

One `kvshard serve` (tp 1, --threads, the scheduler's default token budget per step unless
--budget sets scheduler.max_num_batched_tokens) gets --runs different prompts of --prompt-tokens
tokens (random common words, sized with POST /tokenize), one at a time, each a
POST /v1/completions with max_tokens 1, timed end to end by this client. After each request, with
the server idle, `kvshard bench-engine --batch 1 --runs 2 --decode-tokens 0 --prompt-tokens L`
(L: the request's usage.prompt_tokens) runs the same prefill in one forward pass, twice, in a
fresh process: the pairs are interleaved, so load from elsewhere on the machine hits both alike.
Both sides are timed warm: the server first answers one untimed request of another prompt of the
same length, and the one-pass time is bench-engine's second pass (its first, "cold", pays for the
first touch of its workspace and KV pool; it is printed too).

Printed: per request the served time, the one-pass time and their ratio, and where the served
time went: the queue and prefill phases from the server's /metrics histograms
(kvshard:request_queue_time_seconds, kvshard:request_prefill_time_seconds: from the first step that
ran the request to its token), the rest (HTTP, template, tokenization, response) by difference,
and the steps of `serve --step-log` (every chunk but the last, which the step log cannot time: see
coordinator/step_log.h). Then the medians and median(served) / median(one pass) against 1.2.
--rt-priority P runs the server and bench-engine under `chrt -f P` (SCHED_FIFO; needs root).
"""
import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

TARGET = 1.2
WORDS = ("time people year way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force "
         "education").split()


def fail(message):
    sys.exit(f"bench-chunked: {message}")


def positive(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench-chunked", description=__doc__.split("\n\n")[0])
    p.add_argument("--kvshard", required=True, help="the kvshard binary")
    p.add_argument("--model", required=True, help="the model file")
    p.add_argument("--runs", type=positive, default=4, help="requests (and one-pass runs)")
    p.add_argument("--prompt-tokens", type=positive, default=2500, help="tokens per prompt")
    p.add_argument("--threads", type=positive, default=2, help="CPU threads of both")
    p.add_argument("--budget", type=positive, default=None,
                   help="scheduler.max_num_batched_tokens (default: the server's own)")
    p.add_argument("--rt-priority", type=int, default=0,
                   help="run both under chrt -f P (1-99; 0: no)")
    p.add_argument("--json", default=None, help="also write the figures here as JSON")
    args = p.parse_args(argv)
    if not 0 <= args.rt_priority <= 99:
        p.error(f"--rt-priority {args.rt_priority}: expected 0 (off) or 1-99")
    if not os.access(args.kvshard, os.X_OK):
        p.error(f"--kvshard {args.kvshard}: not an executable file")
    if not os.path.isfile(args.model):
        p.error(f"--model {args.model}: no such file")
    if args.rt_priority and shutil.which("chrt") is None:
        p.error("--rt-priority needs the chrt command (util-linux)")
    return args


def prefix(args):
    return ["chrt", "-f", str(args.rt_priority)] if args.rt_priority else []


class Server:
    """`kvshard serve` on a free loopback port, writing its step log to `step_log`."""

    def __init__(self, args, step_log):
        cmd = prefix(args) + [args.kvshard, "serve", "--model", args.model, "--tp", "1",
                              "--threads", str(args.threads), "--host", "127.0.0.1", "--port",
                              "0", "--log-level", "warn", "--step-log", step_log]
        if args.budget:
            cmd += ["--set", f"scheduler.max_num_batched_tokens={args.budget}"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.log = []
        self.url = None
        deadline = time.monotonic() + 180
        while self.url is None:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                fail(f"kvshard serve exited with {self.proc.returncode}: {''.join(self.log)}")
            if time.monotonic() > deadline:
                self.stop()
                fail("kvshard serve did not start within 180 s")
            self.log.append(line)
            m = re.search(r"listening on (http://[\d.]+:\d+)", line)
            if m:
                self.url = m.group(1)
        # Keep reading stderr so the server never blocks on a full pipe.
        self.drain = threading.Thread(target=lambda: self.log.extend(self.proc.stderr),
                                      daemon=True)
        self.drain.start()

    def post(self, path, body, timeout=1800):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            fail(f"POST {path} answered {e.code}: {e.read().decode()[:300]}")

    def histogram_sum(self, name):
        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "_sum"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def words(n, seed):
    rng = random.Random(seed)
    return f"Text {seed}: " + " ".join(rng.choice(WORDS) for _ in range(n))


def prompt_of(server, tokens, seed):
    """The longest prompt of seed's words with at most `tokens` tokens (POST /tokenize)."""
    count = lambda n: server.post("/tokenize", {"prompt": words(n, seed)})["count"]
    lo, hi = 0, tokens  # a word is at least one token
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(mid) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return words(lo, seed)


def one_pass_seconds(args, tokens):
    """(warm, cold): the second and the first forward pass of one bench-engine process."""
    cmd = prefix(args) + [args.kvshard, "bench-engine", "--model", args.model, "--batch", "1",
                          "--runs", "2", "--threads", str(args.threads), "--prompt-tokens",
                          str(tokens), "--decode-tokens", "0", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        fail(f"{' '.join(cmd)} exited with {out.returncode}: {out.stderr.strip()[-500:]}")
    cold, warm = json.loads(out.stdout)["results"][0]["prefill_runs"]
    return tokens / warm, tokens / cold


def steps_between(step_log, start, end):
    """Lines of the step log whose step started within [start, end] (CLOCK_MONOTONIC, which is
    both the server's steady_clock and Python's time.monotonic on Linux)."""
    rows = []
    with open(step_log) as f:
        for line in f:
            row = json.loads(line)
            if start <= row["start_clock_s"] <= end:
                rows.append(row)
    return rows


def measure(args, tmp):
    step_log = os.path.join(tmp, "steps.jsonl")
    server = Server(args, step_log)
    try:
        context = server.post("/tokenize", {"prompt": "x"})["max_model_len"]
        if args.prompt_tokens >= context:
            fail(f"--prompt-tokens {args.prompt_tokens}: the model's context holds {context} "
                 f"tokens, the generated one included")
        server.post("/v1/completions", {"prompt": prompt_of(server, args.prompt_tokens, 0),
                                        "max_tokens": 1, "temperature": 0})
        rows = []
        for i in range(1, args.runs + 1):
            prompt = prompt_of(server, args.prompt_tokens, i)
            queue0 = server.histogram_sum("kvshard:request_queue_time_seconds")
            prefill0 = server.histogram_sum("kvshard:request_prefill_time_seconds")
            t0 = time.monotonic()
            answer = server.post("/v1/completions",
                                 {"prompt": prompt, "max_tokens": 1, "temperature": 0})
            t1 = time.monotonic()
            tokens = answer["usage"]["prompt_tokens"]
            if answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens"):
                fail(f"request {i} hit the prefix cache; its prompt was not new")
            queue = server.histogram_sum("kvshard:request_queue_time_seconds") - queue0
            prefill = server.histogram_sum("kvshard:request_prefill_time_seconds") - prefill0
            steps = steps_between(step_log, t0, t1)
            one, cold = one_pass_seconds(args, tokens)
            rows.append({"request": i, "prompt_tokens": tokens, "served_s": t1 - t0,
                         "one_pass_s": one, "one_pass_cold_s": cold, "ratio": (t1 - t0) / one,
                         "queue_s": queue,
                         "prefill_s": prefill, "http_s": t1 - t0 - queue - prefill,
                         # Before the first step (HTTP in, template, tokenization, queue) and
                         # after the token (response), split at the first chunk's start.
                         "before_s": steps[0]["start_clock_s"] - t0 if steps else None,
                         "after_s": t1 - steps[0]["start_clock_s"] - prefill if steps else None,
                         "chunk_execute_s": [s["execute_seconds"] for s in steps],
                         "chunk_cycle_s": [s["seconds"] for s in steps],
                         "chunk_tokens": [s["prefill_tokens"] for s in steps]})
            print(f"request {i}: {tokens} tokens, served {t1 - t0:.3f} s, one pass {one:.3f} s "
                  f"(cold {cold:.3f} s), ratio {(t1 - t0) / one:.3f}", file=sys.stderr, flush=True)
        return rows
    finally:
        server.stop()


def fmt(value, width):
    return f"{value:>{width}.3f}" if value is not None else f"{'-':>{width}}"


def report(args, rows):
    med = lambda key: statistics.median(r[key] for r in rows)
    served, one = med("served_s"), med("one_pass_s")
    ratio = served / one
    tokens = sorted({r["prompt_tokens"] for r in rows})
    print(f"chunked prefill through kvshard serve vs one pass (kvshard bench-engine): "
          f"{os.path.basename(args.model)}, {args.threads} threads, "
          f"scheduler budget {args.budget or 'default'}, prompts of "
          f"{'/'.join(map(str, tokens))} tokens, max_tokens 1"
          f"{f', chrt -f {args.rt_priority}' if args.rt_priority else ''}")
    print(f"{'request':>7} {'tokens':>6} {'served s':>9} {'one pass s':>10} {'(cold)':>7} "
          f"{'ratio':>6} "
          f"{'queue s':>8} {'prefill s':>9} {'http+tok s':>10} {'(before':>7} {'after)':>6}  "
          f"logged chunks: execute s")
    for r in rows:
        chunks = " ".join(f"{s:.3f}" for s in r["chunk_execute_s"])
        print(f"{r['request']:>7} {r['prompt_tokens']:>6} {r['served_s']:>9.3f} "
              f"{r['one_pass_s']:>10.3f} {r['one_pass_cold_s']:>7.3f} {r['ratio']:>6.3f} "
              f"{r['queue_s']:>8.3f} "
              f"{r['prefill_s']:>9.3f} {r['http_s']:>10.3f} {fmt(r['before_s'], 7)} "
              f"{fmt(r['after_s'], 6)}  {chunks}")
    print(f"{'median':>7} {'':>6} {served:>9.3f} {one:>10.3f} {med('one_pass_cold_s'):>7.3f} "
          f"{'':>6} {med('queue_s'):>8.3f} "
          f"{med('prefill_s'):>9.3f} {med('http_s'):>10.3f}")
    verdict = "met" if ratio <= TARGET else "missed"
    print(f"median served / median one pass = {ratio:.3f} (target <= {TARGET}: {verdict}); "
          f"median of the per-request ratios {med('ratio'):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "threads": args.threads, "budget": args.budget,
                       "rt_priority": args.rt_priority, "requests": rows,
                       "median_served_s": served, "median_one_pass_s": one, "ratio": ratio,
                       "target": TARGET}, f, indent=1)


def main(argv):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-chunked-") as tmp:
        rows = measure(args, tmp)
    report(args, rows)


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python3
"""Soak and chaos run of `kvshard serve` (scripts/soak is the front door; not part of CI).

A disaggregated configuration with worker processes (KV over TCP) serves mixed load for
--minutes: streamed and not, n > 1, clients that hang up mid-stream, oversized and malformed
requests, chats that share a long system prompt. Meanwhile a chaos loop, bounded and on loopback
only, kills (SIGKILL) and stops (SIGSTOP) worker processes and cuts KV connections (`ss -K`).

Every client result is classified: complete (a whole answer, or a stream ending in its final chunk
and [DONE]), error (a 4xx/5xx body or a stream's error event, then [DONE]), refused (the expected
4xx for a malformed or oversized request), aborted (the client hung up on purpose), and the two
that must never happen: hang (no answer within the client timeout) and truncated (a stream that
ends without [DONE], or a body that is not JSON). At the end: requests by kind, errors by status,
p50/p99 latency of complete requests, RSS of the server and its workers over time, KV blocks in
use once idle; exit 1 if any hang or truncation, RSS growth past --rss-growth-mib, or KV in use.
"""
import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "integration"))
import kvshard_server  # noqa: E402

SYSTEM = ("You are a careful assistant for a small bakery. You answer questions about opening "
          "hours, bread, cakes and orders in two sentences at most. ") * 4
WORDS = "once upon a time there was a little dog who loved to run in the park with friends".split()


class Tally:
    def __init__(self):
        self.mu = threading.Lock()
        self.kinds = {}
        self.errors = {}
        self.latencies = []
        self.examples = {}

    def add(self, kind, seconds=None, detail=""):
        with self.mu:
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            if kind == "complete" and seconds is not None:
                self.latencies.append(seconds)
            if kind == "error":
                self.errors[detail] = self.errors.get(detail, 0) + 1
            if kind in ("hang", "truncated") and len(self.examples.setdefault(kind, [])) < 5:
                self.examples[kind].append(detail)


def request(url, body, timeout, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, method="POST", data=data,
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def one_client(server, tally, rng, timeout):
    url = server.url
    kind = rng.choices(["plain", "stream", "n2", "abort", "chat", "oversized", "malformed"],
                       weights=[25, 30, 8, 8, 20, 4, 5])[0]
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
    max_tokens = rng.randint(4, 48)
    started = time.time()
    try:
        if kind == "oversized":
            r = request(url + "/v1/completions", None, timeout,
                        raw=b'{"prompt":"' + b"a" * (2 << 20) + b'"}')
            tally.add("truncated", detail=f"oversized got {r.status}")
            return
        if kind == "malformed":
            raw = rng.choice([b'{"prompt": "a", "max_tokens": 1e400}', b'{"prompt": ',
                              b'{"prompt": "a", "temperature": "hot"}', b'\x00\xff{]'])
            r = request(url + "/v1/completions", None, timeout, raw=raw)
            tally.add("truncated", detail=f"malformed {raw!r} got {r.status}")
            return
        if kind == "chat":
            path, body = "/v1/chat/completions", {
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0.7, "stream": rng.random() < 0.5}
        else:
            path, body = "/v1/completions", {
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
                "stream": kind in ("stream", "abort"), "n": 2 if kind == "n2" else 1}
        r = request(url + path, body, timeout)
        if not body["stream"]:
            text = r.read()
            try:
                json.loads(text)["choices"]
                tally.add("complete", time.time() - started)
            except (ValueError, KeyError):
                tally.add("truncated", detail=f"{path}: body {text[:80]!r}")
            return
        saw_done = saw_error = False
        lines = 0
        for raw_line in r:
            line = raw_line.decode().strip()
            if not line:
                continue
            lines += 1
            if line == "data: [DONE]":
                saw_done = True
            elif line.startswith("data: {") and '"error"' in line:
                saw_error = True
            if kind == "abort" and lines >= 3:
                r.close()
                tally.add("aborted")
                return
        if saw_done:
            tally.add("error" if saw_error else "complete", time.time() - started,
                      "stream error event")
        else:
            tally.add("truncated", detail=f"{path}: stream ended without [DONE] after {lines} lines")
    except urllib.error.HTTPError as e:
        body = e.read()
        if kind in ("oversized", "malformed") and 400 <= e.code < 500:
            tally.add("refused")
            return
        try:
            json.loads(body)["error"]
        except (ValueError, KeyError):
            tally.add("truncated", detail=f"{e.code} with body {body[:80]!r}")
            return
        tally.add("error", detail=str(e.code))
        if e.code in (429, 503):  # as a well-behaved client does: wait as told, then retry
            time.sleep(min(5.0, float(e.headers.get("Retry-After") or 1)))
    except (socket.timeout, TimeoutError) as e:
        tally.add("hang", detail=f"{kind}: {e!r}")
    except (ConnectionError, urllib.error.URLError, OSError) as e:
        if kind == "oversized":  # the server may close while the body is still being sent
            tally.add("refused")
        else:
            tally.add("error", detail=f"connection: {type(e).__name__}")


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def listening_ports(pid):
    out = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True).stdout
    return [int(m.group(1)) for line in out.splitlines() if f"pid={pid}," in line
            for m in [re.search(r":(\d+)\s", line)] if m]


def chaos(server, stop, rng, log, period_s):
    instances = ["prefill", "decode"]
    while not stop.wait(rng.uniform(period_s * 0.5, period_s * 1.5)):
        instance = rng.choice(instances)
        pids = kvshard_server.worker_pids(server.proc.pid, instance)
        if not pids:
            log.append((time.time(), f"{instance}: no worker (restarting)"))
            continue
        pid = rng.choice(pids)
        action = rng.choice(["kill", "stop", "cut-kv", "cut-kv"])
        if action == "kill":
            os.kill(pid, signal.SIGKILL)
        elif action == "stop":
            os.kill(pid, signal.SIGSTOP)
        else:
            for port in listening_ports(pid):
                subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", str(port)],
                               capture_output=True)
        log.append((time.time(), f"{action} {instance} worker {pid}"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kvshard", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--config", required=True, help="a disaggregated config, e.g. disagg-1p1d.yaml")
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--chaos-period-s", type=float, default=45)
    p.add_argument("--timeout-s", type=float, default=120, help="a client waiting longer hangs")
    p.add_argument("--rss-growth-mib", type=float, default=64,
                   help="allowed growth of the server's RSS from the first sample after warm-up")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--server-log", default="", help="write the server's log (info level) here")
    a = p.parse_args()

    server = kvshard_server.Server(a.kvshard, a.model, [
        "--config", a.config, "--set", "workers.mode=processes",
        "--set", "workers.heartbeat_interval_ms=250", "--set", "workers.dead_after_ms=2000",
        "--set", "workers.restart_backoff_ms=500", "--set", "workers.restart_limit=1000",
        "--set", "kv_transfer.timeout_ms=3000", "--set", "server.max_body_bytes=1048576"],
        log_level="info" if a.server_log else "warn")
    tally, stop, chaos_log, rss = Tally(), threading.Event(), [], []
    rng = random.Random(a.seed)

    def client_loop(seed):
        r = random.Random(seed)
        while not stop.is_set():
            one_client(server, tally, r, a.timeout_s)

    threads = [threading.Thread(target=client_loop, args=(a.seed * 1000 + i,))
               for i in range(a.clients)]
    threads.append(threading.Thread(target=chaos, args=(server, stop, rng, chaos_log,
                                                        a.chaos_period_s)))
    for t in threads:
        t.start()
    began = time.time()
    try:
        while time.time() - began < a.minutes * 60:
            time.sleep(10)
            workers = sum(rss_kib(w) for inst in ("prefill", "decode")
                          for w in kvshard_server.worker_pids(server.proc.pid, inst))
            rss.append((round(time.time() - began), rss_kib(server.proc.pid), workers))
            if server.proc.poll() is not None:
                break
    finally:
        stop.set()
        for t in threads:
            t.join()
    alive = server.proc.poll() is None
    idle = alive and server.wait_idle(timeout=60)
    kv_usage = server.metric("kvshard:kv_cache_usage_perc") if alive else None
    # Every instance must be serving again once the chaos stops (restarts take seconds).
    deadline = time.time() + 120
    while alive and time.time() < deadline and server.metric("kvshard:instance_up") < 2:
        time.sleep(1)
    instances_up = server.metric("kvshard:instance_up") if alive else 0
    server.stop()
    if a.server_log:
        with open(a.server_log, "w") as f:
            f.writelines(server.log)

    lat = sorted(tally.latencies)
    warm = [s for t, s, _ in rss if t >= 60] or [s for _, s, _ in rss]
    growth_mib = (max(warm) - warm[0]) / 1024 if warm else 0
    report = {
        "minutes": round((time.time() - began) / 60, 1),
        "requests": sum(tally.kinds.values()),
        "by_kind": tally.kinds,
        "errors_by_status": tally.errors,
        "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
        "latency_p99_s": round(lat[int(0.99 * (len(lat) - 1))], 3) if lat else None,
        "chaos_events": len(chaos_log),
        "chaos": [f"{round(t - began)}s {what}" for t, what in chaos_log],
        "rss_server_mib": [(t, round(s / 1024, 1)) for t, s, _ in rss],
        "rss_workers_mib": [(t, round(w / 1024, 1)) for t, _, w in rss],
        "server_rss_growth_mib": round(growth_mib, 1),
        "server_alive_at_end": alive,
        "idle_at_end": idle,
        "kv_cache_usage_when_idle": kv_usage,
        "instances_up_at_end": instances_up,
        "examples": tally.examples,
    }
    failures = []
    if tally.kinds.get("hang") or tally.kinds.get("truncated"):
        failures.append("hung or truncated answers")
    if growth_mib > a.rss_growth_mib:
        failures.append(f"server RSS grew {growth_mib:.0f} MiB (> {a.rss_growth_mib})")
    if not alive:
        failures.append("kvshard serve exited")
    if instances_up < 2:
        failures.append(f"{2 - instances_up:.0f} instance(s) still down 2 minutes after the chaos")
    if kv_usage not in (0, 0.0):
        failures.append(f"KV blocks in use when idle ({kv_usage})")
    report["failures"] = failures
    if a.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            if k not in ("chaos", "rss_server_mib", "rss_workers_mib"):
                print(f"{k}: {v}")
        print("rss (s, server MiB, workers MiB):",
              [(t, round(s / 1024), round(w / 1024)) for t, s, w in rss])
        print("chaos:", "; ".join(report["chaos"]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

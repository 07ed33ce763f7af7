#!/usr/bin/env python3
"""Integration tests of the KV pair path (kv_transfer.path: nccl) wired through `kvshard serve` and
`kvshard worker` processes, with the pairs on the socket TEST link (KVSHARD_KV_PAIR_LINK=socket):
serve plans the pairs and hands them out at registration, the workers make their channels at
start, the prefill step offers each pair's KV heads, the decode engine's plan readies them through
the coordinator and the decode step receives them into its blocks.

- prefill tp 1 -> decode tp 1, tp 2 -> tp 1 and tp 1 -> tp 2 (heads re-sharded per pair): the
  greedy completions of concurrent requests equal the colocated server's and the host-staged
  handoff's; every handoff counted, none failed, every KV block free or cached afterwards; the
  workers' logs say the KV came over the pairs.
- the decode worker killed while requests stream: every stream still ends with the colocated
  text (nothing hangs), later requests are served, nothing leaked (that the pairs come back
  after the re-form: kv_pair_reform_test.py).
- the refusals: nccl without the knob, embedded pools with it, a knob of another value.

    tests/integration/kv_pair_link_test.py --kvshard build/cli/kvshard \
        --model ../shared/models/stories260K/stories260K.bin --configs config/examples
Exit code 77 (ctest SKIP_RETURN_CODE) when the model is absent.
"""
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvshard_server  # noqa: E402

ARGS = None
PROMPTS = [f"{w}{' and then they played' * (i % 3)}" for i, w in enumerate(
    ["Once upon a time", "The little dog", "Lily and Tom went", "One day, a big bird",
     "The sun was hot and", "Sam had a red ball that", "In the park there was a", "Mom said"])]
PAIRS = ["--set", "workers.mode=processes", "--set", "kv_transfer.path=nccl"]


def server(extra, link="socket"):
    old = os.environ.get("KVSHARD_KV_PAIR_LINK")
    if link is None:
        os.environ.pop("KVSHARD_KV_PAIR_LINK", None)
    else:
        os.environ["KVSHARD_KV_PAIR_LINK"] = link
    try:
        # info: the device plan's handoff line (the workers log at info on their own).
        return kvshard_server.Server(ARGS.kvshard, ARGS.model, extra, log_level="info")
    finally:
        if old is None:
            os.environ.pop("KVSHARD_KV_PAIR_LINK", None)
        else:
            os.environ["KVSHARD_KV_PAIR_LINK"] = old


def config(name):
    return ["--config", os.path.join(ARGS.configs, name)]


def completions(extra, link=None, max_tokens=kvshard_server.MAX_TOKENS):
    s = server(extra, link)
    try:
        alone = [s.complete(p, max_tokens=max_tokens) for p in PROMPTS]
        assert all(status == 200 for status, _ in alone), alone
        return [t for _, t in alone]
    finally:
        s.stop()


REFERENCE = {}


def reference(max_tokens=kvshard_server.MAX_TOKENS):
    if max_tokens not in REFERENCE:
        REFERENCE[max_tokens] = completions(["--tp", "1"], max_tokens=max_tokens)
    return REFERENCE[max_tokens]


class KvPairLink(unittest.TestCase):
    def run_config(self, name):
        expected = reference()
        host_staged = completions(config(name) + ["--set", "workers.mode=processes"])
        self.assertEqual(host_staged, expected, "host-staged handoff")
        s = server(config(name) + PAIRS)
        try:
            alone = [s.complete(p) for p in PROMPTS[:2]]
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                together = list(pool.map(s.complete, PROMPTS))
            self.assertEqual([t for _, t in alone], expected[:2])
            for i, ((status, got), want) in enumerate(zip(together, expected)):
                self.assertEqual(status, 200, got)
                self.assertEqual(got, want, f"{name} prompt {i}")
            self.assertTrue(s.wait_idle(), "KV blocks still in use after every request finished")
            self.assertEqual(s.metric("kvshard:kv_transfers_total"), len(PROMPTS) + 2)
            self.assertGreater(s.metric("kvshard:kv_transfer_bytes_total"), 0)
            self.assertEqual(s.metric("kvshard:kv_transfer_failures_total"), 0)
            log = "".join(s.log)
            self.assertIn("the pairs over TCP sockets", log)
            self.assertIn("pair(s) on the socket link", log)
            self.assertIn("first transfer received over the socket link", log)
            self.assertNotIn("decoding it here", log)
        finally:
            s.stop()

    def test_1p1d(self):
        self.run_config("disagg-1p1d.yaml")

    def test_p2_d1_reshards(self):
        self.run_config("disagg-p2-d1.yaml")
        s = server(config("disagg-p2-d1.yaml") + PAIRS)
        try:
            s.complete(PROMPTS[0])
            log = "".join(s.log)
            # Each prefill rank sends its own KV heads to the decode rank: two pairs received.
            self.assertEqual(log.count("first transfer received over the socket link"), 2, log)
        finally:
            s.stop()

    def test_p1_d2_reshards(self):
        # Prefill tp 1 -> decode tp 2: the prefill rank sends each decode rank its own heads.
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write("pools:\n"
                    "  - {name: prefill, role: prefill, instances: [{tp: 1, devices: [cpu]}]}\n"
                    "  - {name: decode, role: decode, instances: [{tp: 2, devices: [cpu, cpu]}]}\n")
        try:
            expected = reference()
            s = server(["--config", f.name] + PAIRS)
            try:
                got = [s.complete(p) for p in PROMPTS]
                self.assertEqual([t for _, t in got], expected)
                self.assertEqual(s.metric("kvshard:kv_transfer_failures_total"), 0)
                self.assertTrue(s.wait_idle(), "KV blocks still in use")
                log = "".join(s.log)
                self.assertEqual(log.count("first transfer received over the socket link"), 2, log)
            finally:
                s.stop()
        finally:
            os.unlink(f.name)

    def test_killed_decode_worker_never_hangs_a_request(self):
        s = server(config("disagg-1p1d.yaml") + PAIRS + [
            "--set", "workers.dead_after_ms=2000", "--set", "workers.heartbeat_interval_ms=200",
            # A receive the dead peer never answers ends in 3 s, not the example's 10 s.
            "--set", "kv_transfer.timeout_ms=3000"])
        try:
            pids = kvshard_server.worker_pids(s.proc.pid, "decode")
            self.assertEqual(len(pids), 1, "one decode worker process")
            streaming = threading.Event()

            def stream(prompt):
                req = urllib.request.Request(s.url + "/v1/completions", method="POST", data=json.dumps({
                    "model": s.model, "prompt": prompt, "max_tokens": 300, "temperature": 0,
                    "ignore_eos": True, "stream": True}).encode(),
                    headers={"Content-Type": "application/json"})
                body = []
                with urllib.request.urlopen(req, timeout=60) as r:
                    for line in r:
                        body.append(line.decode())
                        if line.startswith(b"data: {") and len(body) > 4:
                            streaming.set()
                return "".join(body)

            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                futures = [pool.submit(stream, p) for p in PROMPTS]
                self.assertTrue(streaming.wait(30), "no request started streaming")
                os.kill(pids[0], signal.SIGSTOP)
                os.kill(pids[0], signal.SIGKILL)
                started = time.time()
                bodies = [f.result(timeout=60) for f in futures]
            self.assertLess(time.time() - started, 30, "requests must end soon after the worker died")
            expected = reference(300)
            for i, body in enumerate(bodies):
                self.assertNotIn('"error"', body, f"request {i}")
                self.assertTrue(body.rstrip().endswith("data: [DONE]"), body[-200:])
                text = "".join(json.loads(l[len("data: "):])["choices"][0]["text"]
                               for l in body.splitlines()
                               if l.startswith("data: {") and json.loads(l[len("data: "):]).get("choices"))
                self.assertEqual(text, expected[i], f"request {i}")
            self.assertEqual(s.http("GET", "/health")[0], 200)
            # Served afterwards, whatever became of the decode instance.
            self.assertEqual(s.complete(PROMPTS[0]), (200, reference()[0]))
            failed = sum(("sending its KV to" in line or "receiving its KV failed" in line)
                         and "failed" in line for line in s.log)
            self.assertEqual(s.metric("kvshard:kv_transfer_failures_total"), failed)
            self.assertTrue(s.wait_idle(), "KV blocks still in use after the failure")
        finally:
            s.stop()

    def refusal(self, extra, link):
        env = dict(os.environ)
        env.pop("KVSHARD_KV_PAIR_LINK", None)
        if link is not None:
            env["KVSHARD_KV_PAIR_LINK"] = link
        r = subprocess.run([ARGS.kvshard, "serve", "--model", ARGS.model, "--port", "0", *extra],
                           env=env, capture_output=True, text=True, timeout=120)
        self.assertNotEqual(r.returncode, 0, r.stderr)
        return r.stderr

    def test_refusals(self):
        no_knob = self.refusal(config("disagg-1p1d.yaml") + PAIRS, None)
        self.assertIn("kv_transfer.path: nccl: the cpu backend", no_knob)
        embedded = self.refusal(config("disagg-1p1d.yaml") + ["--set", "kv_transfer.path=nccl"],
                                "socket")
        self.assertIn("kv_transfer.path: nccl:", embedded)
        bad = self.refusal(config("disagg-1p1d.yaml") + PAIRS, "tcp")
        self.assertIn("KVSHARD_KV_PAIR_LINK: 'tcp'", bad)


def main():
    def start(args):
        global ARGS
        ARGS = args
        return []

    def options(parser):
        parser.add_argument("--configs", required=True)

    return kvshard_server.unittest_main(start, options)


if __name__ == "__main__":
    sys.exit(main())

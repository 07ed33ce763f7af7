#!/usr/bin/env python3
"""Integration tests of what `kvshard serve` does when things go wrong around it:

- SIGTERM drains: new requests get 503 with Retry-After and /health says "draining", streams in
  flight finish whole (their final chunk and `data: [DONE]`), the process exits 0; past
  server.drain_timeout_s what is left ends with an error event and [DONE]; a second signal exits
  at once.
- A worker process that dies (SIGKILL) or stalls (SIGSTOP) under load is noticed, killed if it is
  still there, relaunched, and the instance serves again without restarting `kvshard serve`: the
  same greedy text as before, no zombie left, every KV block back. With workers.restart_limit 0
  nothing is relaunched and `kvshard serve` exits non-zero, so a supervisor restarts it.

    tests/integration/recovery_test.py --kvshard build/cli/kvshard \\
        --model ../shared/models/stories260K/stories260K.bin \\
        --default-model models/SmolLM2-135M-Instruct.Q4_1.gguf
Exit code 77 (ctest SKIP_RETURN_CODE) when the model is absent. The drain tests need a model slow
enough for a stream to be in flight when the signal comes: the default model; they skip without it.
"""
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvshard_server  # noqa: E402
from kvshard_server import wait_for, worker_pids  # noqa: E402

ARGS = None


def post(url, body, timeout=120):
    """POST JSON; returns (status, headers, body text)."""
    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


class Stream:
    """A streamed completion read line by line on a thread of its own."""

    def __init__(self, server, max_tokens):
        body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(server.url + "/v1/completions", method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        self.lines = []
        self.first_chunk = threading.Event()
        self.error = None
        self.resp = urllib.request.urlopen(req, timeout=120)
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self):
        try:
            for raw in self.resp:
                line = raw.decode().strip()
                if line:
                    self.lines.append(line)
                    self.first_chunk.set()
        except Exception as e:  # a cut connection is what the tests look for
            self.error = e
        self.first_chunk.set()

    def join(self, timeout=120):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream hangs"
        events = [json.loads(l[len("data: "):]) for l in self.lines if l.startswith("data: {")]
        return events, self.lines[-1] if self.lines else None


def descendants(pid):
    """(pid, state) of every process under `pid`."""
    procs = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            procs[int(entry)] = (int(fields[1]), fields[0])
        except OSError:
            continue
    out, frontier = [], {pid}
    while frontier:
        nxt = {p for p, (ppid, _) in procs.items() if ppid in frontier}
        out += [(p, procs[p][1]) for p in nxt]
        frontier = nxt
    return out


class Drain(unittest.TestCase):
    def setUp(self):
        if not ARGS.default_model or not os.path.exists(ARGS.default_model):
            self.skipTest("the drain tests need the default model (a stream must still run when "
                          "the signal comes)")

    def server(self, *extra):
        return kvshard_server.Server(ARGS.kvshard, ARGS.default_model, ["--threads", "2", *extra])

    def test_sigterm_lets_streams_finish_and_refuses_new_requests(self):
        # A drain timeout long enough for a busy machine: these streams must finish whole.
        server = self.server("--set", "server.drain_timeout_s=300")
        streams = [Stream(server, 64) for _ in range(3)]
        for s in streams:
            self.assertTrue(s.first_chunk.wait(60))
        server.proc.send_signal(signal.SIGTERM)
        # Draining: not admitting, and saying so.
        wait_for(lambda: server.http("GET", "/health")[0] == 503, 10, "/health 503 while draining")
        status, body = server.http("GET", "/health")
        self.assertEqual(json.loads(body)["status"], "draining")
        status, headers, body = post(server.url + "/v1/completions",
                                     {"model": server.model, "prompt": "Hi", "max_tokens": 4})
        self.assertEqual(status, 503, body)
        self.assertIn("Retry-After", headers)
        self.assertIn("error", json.loads(body))
        for s in streams:
            events, last = s.join()
            self.assertIsNone(s.error)
            self.assertEqual(last, "data: [DONE]")
            self.assertFalse([e for e in events if "error" in e], events[-3:])
            self.assertEqual(events[-1]["choices"][0]["finish_reason"], "length")
        self.assertEqual(server.proc.wait(timeout=60), 0)
        server.drain.shutdown()

    def test_past_the_drain_timeout_streams_end_with_an_error_event(self):
        server = self.server("--set", "server.drain_timeout_s=1")
        stream = Stream(server, 1500)
        self.assertTrue(stream.first_chunk.wait(60))
        server.proc.send_signal(signal.SIGTERM)
        events, last = stream.join()
        self.assertEqual(last, "data: [DONE]")
        self.assertTrue([e for e in events if "error" in e], "no error event before [DONE]")
        self.assertEqual(server.proc.wait(timeout=60), 0)
        server.drain.shutdown()

    def test_a_second_signal_exits_at_once(self):
        server = self.server("--set", "server.drain_timeout_s=600")
        stream = Stream(server, 1500)
        self.assertTrue(stream.first_chunk.wait(60))
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: server.http("GET", "/health")[0] == 503, 10, "draining")
        server.proc.send_signal(signal.SIGINT)
        self.assertNotEqual(server.proc.wait(timeout=20), 0)
        stream.join()
        server.drain.shutdown()


class Recovery(unittest.TestCase):
    def load(self, server, stop, results):
        """Greedy completions, back to back, until `stop` is set; records each (status, text)."""
        while not stop.is_set():
            try:
                results.append(server.complete("Once upon a time", max_tokens=24, timeout=60))
            except Exception as e:  # a hang shows up as a timeout here
                results.append(("exception", repr(e)))

    def recover(self, extra, instance, kill, expect_workers, kvshard=None, after_start=None):
        server = kvshard_server.Server(kvshard or ARGS.kvshard, ARGS.model, [
            "--set", "workers.mode=processes", "--set", "workers.heartbeat_interval_ms=200",
            "--set", "workers.dead_after_ms=1000", "--set", "workers.restart_backoff_ms=200",
            *extra])
        try:
            status, expected = server.complete("Once upon a time", max_tokens=24)
            self.assertEqual(status, 200, expected)
            if after_start:
                after_start()
            before = worker_pids(server.proc.pid, instance)
            self.assertEqual(len(before), expect_workers, before)

            stop, results = threading.Event(), []
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                for _ in range(4):
                    pool.submit(self.load, server, stop, results)
                wait_for(lambda: len(results) >= 8, 60, "requests served before the fault")
                kill(before[-1])
                # Relaunched: new worker processes, the old ones gone (a stopped one killed).
                wait_for(lambda: len(set(worker_pids(server.proc.pid, instance)) - set(before))
                         == expect_workers, 60, "workers relaunched")
                wait_for(lambda: server.http("GET", "/health")[0] == 200, 60, "/health 200 again")
                # Relaunched while the server listens, the workers hold none of its sockets.
                http_port = server.url.rsplit(":", 1)[1]
                listeners = subprocess.run(["ss", "-tlnpH", f"sport = :{http_port}"],
                                           capture_output=True, text=True).stdout
                for pid in worker_pids(server.proc.pid, instance):
                    self.assertNotIn(f"pid={pid},", listeners)
                served_after = len(results)
                wait_for(lambda: len([r for r in results[served_after:] if r[0] == 200]) >= 8, 60,
                         "requests served after the restart")
                stop.set()
            self.assertIsNone(server.proc.poll(), "kvshard serve exited")
            kinds = {r[0] for r in results}
            self.assertNotIn("exception", kinds, [r for r in results if r[0] == "exception"][:3])
            self.assertLessEqual(kinds, {200, 500, 503}, kinds)
            self.assertEqual({r[1] for r in results if r[0] == 200}, {expected})
            self.assertEqual(server.complete("Once upon a time", max_tokens=24), (200, expected))
            self.assertEqual(server.metric("kvshard:instance_up"), 1.0)
            self.assertTrue(server.wait_idle(), "KV blocks still in use after recovery")
            # No sequence kept blocks across the re-form (coordinator/engine.cc CheckEpoch).
            self.assertFalse([l for l in server.log if "KV blocks still in use by" in l])
            for pid in before:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
                except OSError:
                    continue  # gone
                if state == "Z" and ppid == "1":
                    continue  # dead, left for init to reap (mpirun's child, mpirun killed)
                self.fail(f"old worker {pid} still there: state {state}, parent {ppid}")
            zombies = [p for p, state in descendants(server.proc.pid) if state == "Z"]
            self.assertEqual(zombies, [], "zombie worker processes")
        finally:
            server.stop()

    def test_killed_worker_of_a_tp2_instance_is_relaunched(self):
        if shutil.which("mpirun") is None or not ARGS.with_mpi:
            self.skipTest("tp 2 worker processes need mpirun and a kvshard built with MPI")
        self.recover(["--tp", "2", "--set", "workers.launcher=mpirun"], "default",
                     lambda pid: os.kill(pid, signal.SIGKILL), 2)

    def test_stalled_worker_is_killed_and_relaunched(self):
        self.recover(["--tp", "1"], "default", lambda pid: os.kill(pid, signal.SIGSTOP), 1)

    def test_relaunch_runs_the_servers_own_binary_after_it_was_replaced(self):
        # A rebuild or an upgrade while serving deletes the file the server runs from.
        with tempfile.TemporaryDirectory() as d:
            copy = os.path.join(d, "kvshard")
            shutil.copy2(ARGS.kvshard, copy)
            self.recover(["--tp", "1"], "default", lambda pid: os.kill(pid, signal.SIGKILL), 1,
                         kvshard=copy, after_start=lambda: os.remove(copy))

    def test_without_restarts_serve_exits_nonzero(self):
        server = kvshard_server.Server(ARGS.kvshard, ARGS.model, [
            "--set", "workers.mode=processes", "--set", "workers.heartbeat_interval_ms=200",
            "--set", "workers.dead_after_ms=1000", "--set", "workers.restart_limit=0"])
        try:
            self.assertEqual(server.complete("Once upon a time", max_tokens=8)[0], 200)
            pids = worker_pids(server.proc.pid, "default")
            self.assertEqual(len(pids), 1)
            os.kill(pids[0], signal.SIGKILL)
            self.assertNotEqual(server.proc.wait(timeout=30), 0)
        finally:
            if server.proc.poll() is None:
                server.proc.kill()
            server.proc.wait()
            server.drain.shutdown()


def main():
    def start(args):
        global ARGS
        ARGS = args
        return []

    def options(parser):
        parser.add_argument("--default-model", default="")
        kvshard_server.add_with_mpi_option(parser)

    return kvshard_server.unittest_main(start, options)


if __name__ == "__main__":
    sys.exit(main())

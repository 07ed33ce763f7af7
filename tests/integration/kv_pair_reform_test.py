#!/usr/bin/env python3
"""Integration tests of the KV pair path (kv_transfer.path: nccl, on the socket TEST link
KVSHARD_KV_PAIR_LINK=socket) when an instance re-forms: `kvshard serve` with one prefill and one
decode instance as worker processes; a worker of one side is killed (SIGKILL), its supervisor
relaunches it and the instance re-forms (epoch 2). Then, for either side:

- the pairs come back: serve made new pair ids for every pair with the re-formed instance, the
  new workers got them at registration and the healthy side's workers joined them, so later
  requests are handed off again (kvshard:kv_transfers_total grows by one per request) with no
  transfer failure and no "decoding it here";
- their greedy tokens equal those before the kill (and the colocated server's);
- every KV block is free or cached afterwards (nothing leaked), and no request after the re-form
  waits for kv_transfer.timeout_ms.

Also with handoffs in flight: streams running when the decode worker dies; and prompts handed
off to a stopped decode worker when the prefill worker dies and re-forms (their receives are
refused by the new pairs, and the prefill instance recomputes them: its new workers never had
their KV).

And a pair that fails with both instances healthy (no re-form: the socket link's fault knob
KVSHARD_KV_PAIR_SOCKET_FAIL_SENDS fails a send of the prefill worker as a reset connection
would): the request it carried is decoded on the prefill instance with the same tokens, serve
re-plans the pairs between the two instances (kvshard:kv_pair_replans_total), and later requests
are handed off again; a link whose every send fails is re-planned at most once a second, and no
request waits for the timeout.

    tests/integration/kv_pair_reform_test.py --kvshard build/cli/kvshard \\
        --model ../shared/models/stories260K/stories260K.bin --configs config/examples
Exit code 77 (ctest SKIP_RETURN_CODE) when the model is absent.
"""
import concurrent.futures
import json
import os
import re
import signal
import sys
import threading
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvshard_server  # noqa: E402
from kvshard_server import wait_for  # noqa: E402

ARGS = None
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went", "One day, a big bird"]
# A receive whose peer never answers ends in 3 s: a request slower than that after the re-form
# waited for a dead pair.
TIMEOUT_MS = 3000


def server(env=None):
    env = dict(env or {}, KVSHARD_KV_PAIR_LINK="socket")
    os.environ.update(env)
    try:
        return kvshard_server.Server(ARGS.kvshard, ARGS.model, [
            "--config", os.path.join(ARGS.configs, "disagg-1p1d.yaml"),
            "--set", "workers.mode=processes", "--set", "kv_transfer.path=nccl",
            "--set", "workers.heartbeat_interval_ms=200", "--set", "workers.dead_after_ms=1000",
            "--set", "workers.restart_backoff_ms=200",
            "--set", f"kv_transfer.timeout_ms={TIMEOUT_MS}"], log_level="info")
    finally:
        for name in env:
            os.environ.pop(name, None)


def stream(s, prompt, max_tokens, started):
    """A streamed greedy completion: (its text, whether it ended with an error event)."""
    req = urllib.request.Request(s.url + "/v1/completions", method="POST", data=json.dumps({
        "model": s.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True}).encode(), headers={"Content-Type": "application/json"})
    text, error = [], False
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                error = True
            for choice in event.get("choices", []):
                text.append(choice.get("text", ""))
            if len(text) > 2:
                started.set()
    return "".join(text), error


class KvPairReform(unittest.TestCase):
    def kill_and_wait(self, s, instance, while_stopped=None):
        """SIGKILL the instance's worker (SIGSTOP first, then while_stopped(), when given) and
        wait for its re-form."""
        pids = kvshard_server.worker_pids(s.proc.pid, instance)
        self.assertEqual(len(pids), 1, f"one {instance} worker process")
        if while_stopped is not None:
            os.kill(pids[0], signal.SIGSTOP)
            while_stopped()
        try:
            os.kill(pids[0], signal.SIGKILL)
        except ProcessLookupError:
            pass  # the supervisor killed the stopped worker first
        wait_for(lambda: any(re.search(f"instance {instance}: re-formed \\(epoch 2\\)", line)
                             for line in s.log), 60, f"{instance} re-formed")
        wait_for(lambda: s.http("GET", "/health")[0] == 200, 60, "/health 200 again")

    def check_handed_off_again(self, s, instance, expected):
        """After the re-form: every request handed off again over the new pairs, its greedy
        tokens `expected`, none waiting for a timeout, nothing failed or leaked."""
        transfers = s.metric("kvshard:kv_transfers_total")
        failures = s.metric("kvshard:kv_transfer_failures_total")
        after, seconds = complete_timed(s)
        print(f"\n[{instance} killed] after the re-form: handoffs {transfers:.0f} -> "
              f"{s.metric('kvshard:kv_transfers_total'):.0f}, failures {failures:.0f} -> "
              f"{s.metric('kvshard:kv_transfer_failures_total'):.0f}, seconds per request "
              f"{[round(x, 2) for x in seconds]}", file=sys.stderr)
        self.assertEqual(after, expected, "greedy tokens after the re-form")
        self.assertEqual(s.metric("kvshard:kv_transfers_total") - transfers, len(PROMPTS),
                         "every request after the re-form handed off again")
        self.assertEqual(s.metric("kvshard:kv_transfer_failures_total"), failures)
        self.assertLess(max(seconds), TIMEOUT_MS / 1000.0,
                        "a request after the re-form waited for a pair's timeout")
        self.assertTrue(s.wait_idle(), "KV blocks still in use after the re-form")
        # No sequence kept blocks across the re-form (coordinator/engine.cc CheckEpoch).
        self.assertFalse([l for l in s.log if "KV blocks still in use by" in l])
        log = "".join(s.log)
        self.assertIn(f"KV pairs with instance {instance} re-planned: new socket pair ids", log)
        # The healthy side's worker joined the new pairs, and the new pairs carried KV.
        self.assertRegex(log, f"\\[worker (prefill|decode) r0\\] KV pairs with instance "
                              f"{instance} re-planned: 1 pair\\(s\\) on the socket link")
        self.assertEqual(log.count("first transfer received over the socket link"), 2, log)

    def serve_kill_serve(self, instance):
        s = server()
        try:
            before = [s.complete(p) for p in PROMPTS]
            self.assertTrue(all(status == 200 for status, _ in before), before)
            self.assertEqual(s.metric("kvshard:kv_transfers_total"), len(PROMPTS))
            self.assertEqual(s.metric("kvshard:kv_transfer_failures_total"), 0)
            self.kill_and_wait(s, instance)
            self.check_handed_off_again(s, instance, before)
        finally:
            s.stop()

    def test_decode_worker_killed(self):
        self.serve_kill_serve("decode")

    def test_prefill_worker_killed(self):
        self.serve_kill_serve("prefill")

    def test_prefill_worker_killed_while_its_handoffs_wait(self):
        # The decode worker is stopped while the prefill instance hands it prompts; the prefill
        # worker is killed and re-forms; then the decode worker goes on (before it is found
        # dead): its receives of those transfers, planned before the re-plan, are refused by the
        # new pairs and the requests return to the prefill instance, whose new workers never had
        # their KV: they are recomputed there (not decoded from blocks nobody wrote) and end
        # with the same text.
        s = server()
        try:
            expected = [s.complete(p) for p in PROMPTS]
            decode = kvshard_server.worker_pids(s.proc.pid, "decode")
            prefill = kvshard_server.worker_pids(s.proc.pid, "prefill")
            self.assertEqual((len(decode), len(prefill)), (1, 1))
            before = prefilled(s)
            os.kill(decode[0], signal.SIGSTOP)
            try:
                with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                    futures = [pool.submit(s.complete, p) for p in PROMPTS]
                    wait_for(lambda: prefilled(s) >= before + len(PROMPTS), 10,
                             "every prompt prefilled and handed off")
                    os.kill(prefill[0], signal.SIGKILL)
                    wait_for(lambda: any("instance prefill: re-formed (epoch 2)" in line
                                         for line in s.log), 10, "prefill re-formed")
                    os.kill(decode[0], signal.SIGCONT)
                    got = [f.result(timeout=120) for f in futures]
            finally:
                os.kill(decode[0], signal.SIGCONT)
            self.assertEqual(got, expected)
            log = "".join(s.log)
            self.assertIn(f"{len(PROMPTS)} handed-off prompts' KV released", log)
            self.assertTrue(s.wait_idle(), "KV blocks still in use")
            # The decode worker lived through it (unless its heartbeats were missed meanwhile);
            # either way, the pairs carry KV again.
            wait_for(lambda: s.http("GET", "/health")[0] == 200, 60, "/health 200 again")
            if any("instance decode: down" in line for line in s.log):
                return
            self.check_handed_off_again(s, "prefill", expected)
        finally:
            s.stop()

    def test_decode_worker_killed_while_streams_run(self):
        # Handoffs in flight across the re-plan (offered on the old pairs, planned on the new
        # ones) end on the prefill instance with the same text; none hangs or waits for a
        # timeout on the new pairs; afterwards the pairs carry KV again.
        s = server()
        try:
            long = [s.complete(p, max_tokens=200) for p in PROMPTS]
            short = [s.complete(p) for p in PROMPTS]
            started = threading.Event()
            with concurrent.futures.ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
                futures = [pool.submit(stream, s, p, 200, started) for p in PROMPTS]
                self.assertTrue(started.wait(30), "no stream started")
                more = []

                def offer_more():
                    # The decode worker is stopped (its heartbeats too): these are prefilled and
                    # offered on the old pair while the coordinator notices it is gone.
                    more.extend(pool.submit(s.complete, p, kvshard_server.MAX_TOKENS)
                                for p in PROMPTS)
                    wait_for(lambda: any("instance decode: down" in line for line in s.log), 30,
                             "the stopped decode worker noticed")
                self.kill_and_wait(s, "decode", offer_more)
                streamed = [f.result(timeout=120) for f in futures]
                during = [f.result(timeout=120) for f in more]
            log = "".join(s.log)
            print(f"\n[decode killed under load] requests back on the prefill instance: "
                  f"{log.count('decoding it here') + log.count('recomputing its')}, of which "
                  f"refused by the new pairs as older than them: "
                  f"{log.count('planned before the KV pairs with instance')}", file=sys.stderr)
            for i, (text, error) in enumerate(streamed):
                self.assertFalse(error, f"stream {i}")
                self.assertEqual(text, long[i][1], f"stream {i}")
            self.assertEqual(during, short)
            self.assertFalse(any("pair receive" in l and "Aborted" in l for l in s.log),
                             "a transfer from before the re-plan aborted a new pair")
            self.check_handed_off_again(s, "decode", short)
        finally:
            s.stop()


class KvPairRepair(unittest.TestCase):
    def test_a_failed_pair_is_replanned_without_a_reform(self):
        # The prefill worker's fifth send fails: the first four requests hand off; the fifth's
        # receive fails on the decode side, which reports the pairs down.
        s = server({"KVSHARD_KV_PAIR_SOCKET_FAIL_SENDS": str(len(PROMPTS) + 1)})
        try:
            before = [s.complete(p) for p in PROMPTS]
            self.assertTrue(all(status == 200 for status, _ in before), before)
            self.assertEqual(s.metric("kvshard:kv_transfers_total"), len(PROMPTS))
            self.assertEqual(s.metric("kvshard:kv_pair_replans_total"), 0)
            self.assertEqual(s.complete(PROMPTS[0]), before[0], "the failed handoff's tokens")
            self.assertEqual(s.metric("kvshard:kv_transfers_total"), len(PROMPTS))
            self.assertEqual(s.metric("kvshard:kv_transfer_failures_total"), 1)
            wait_for(lambda: any("KV pairs prefill -> decode re-planned after a failure" in line
                                 for line in s.log), 30, "the pairs re-planned")
            failures = s.metric("kvshard:kv_transfer_failures_total")
            after, seconds = complete_timed(s)
            print(f"\n[a send failed] after the re-plan: handoffs "
                  f"{s.metric('kvshard:kv_transfers_total'):.0f} of {2 * len(PROMPTS) + 1}, "
                  f"seconds per request {[round(x, 2) for x in seconds]}", file=sys.stderr)
            self.assertEqual(after, before, "greedy tokens after the re-plan")
            self.assertEqual(s.metric("kvshard:kv_transfers_total"), 2 * len(PROMPTS),
                             "every request after the re-plan handed off again")
            self.assertEqual(s.metric("kvshard:kv_transfer_failures_total"), failures)
            self.assertEqual(s.metric("kvshard:kv_pair_replans_total"), 1)
            self.assertLess(max(seconds), TIMEOUT_MS / 1000.0)
            self.assertTrue(s.wait_idle(), "KV blocks still in use after the re-plan")
            log = "".join(s.log)
            # Both healthy sides' workers took the new pairs; nothing re-formed.
            for side, other in (("prefill", "decode"), ("decode", "prefill")):
                self.assertRegex(log, f"\\[worker {side} r0\\] KV pairs with instance {other} "
                                      f"re-planned: 1 pair\\(s\\) on the socket link")
            self.assertNotIn("re-formed (epoch 2)", log)
        finally:
            s.stop()

    def test_a_link_that_keeps_failing_is_not_replanned_in_a_loop(self):
        # Every send from the second on fails: each request after the first is decoded on the
        # prefill instance with its own tokens, at once; the re-plans wait a second, then two,
        # between them (cli/kv_pair_replan.h RepairDelay).
        s = server({"KVSHARD_KV_PAIR_SOCKET_FAIL_SENDS": ",".join(str(n) for n in range(2, 200))})
        try:
            expected = [s.complete(p) for p in PROMPTS]
            started = time.time()
            got, seconds = [], []
            while time.time() - started < 2.5:
                for p in PROMPTS:
                    t = time.time()
                    got.append((p, s.complete(p)))
                    seconds.append(time.time() - t)
            replans = s.metric("kvshard:kv_pair_replans_total")
            print(f"\n[every send fails] {len(got)} requests in "
                  f"{time.time() - started:.1f} s: {replans:.0f} re-plans, handoffs "
                  f"{s.metric('kvshard:kv_transfers_total'):.0f}, failures "
                  f"{s.metric('kvshard:kv_transfer_failures_total'):.0f}", file=sys.stderr)
            for p, answer in got:
                self.assertEqual(answer, expected[PROMPTS.index(p)], p)
            self.assertEqual(s.metric("kvshard:kv_transfers_total"), 1)
            self.assertGreaterEqual(replans, 1)
            # Immediately, after 1 s, after 2 s more: at most three in the first 3.5 s.
            self.assertLessEqual(replans, 3)
            self.assertLess(max(seconds), TIMEOUT_MS / 1000.0)
            self.assertTrue(s.wait_idle(), "KV blocks still in use")
        finally:
            s.stop()


def complete_timed(s):
    """Each of PROMPTS completed in turn: the answers, and each one's seconds."""
    after, seconds = [], []
    for p in PROMPTS:
        started = time.time()
        after.append(s.complete(p))
        seconds.append(time.time() - started)
    return after, seconds


def prefilled(s):
    """Requests whose first token the prefill pool produced (then handed off)."""
    total = 0.0
    for line in s.metrics().splitlines():
        if line.startswith("kvshard:pool_time_to_first_token_seconds_count{") and \
                'pool="prefill"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


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

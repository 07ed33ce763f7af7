#!/usr/bin/env python3
"""Smoke test of scripts/bench-chunked (a benchmark, not run in CI at its real size): on stories260K
with a scheduler budget of 64 tokens, two ~120-token prompts are served in two chunks each and
paired with a one-pass bench-engine run; the JSON and the printed table must agree with each
other and with the chunking the budget implies. Bad flags are refused in one line.

    tests/integration/bench_chunked_test.py --kvshard build/cli/kvshard --model .../stories260K.gguf
Exit code 77 (ctest SKIP_RETURN_CODE) when the model is absent. Standard library only.
"""
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvshard_server import unittest_main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "bench-chunked")
BUDGET = 64
ARGS = None


def bench(*flags):
    return subprocess.run([SCRIPT, "--no-build", "--kvshard", ARGS.kvshard, "--model", ARGS.model,
                           *flags], capture_output=True, text=True, timeout=240)


class BenchChunked(unittest.TestCase):
    def test_pairs_and_chunks(self):
        with tempfile.TemporaryDirectory() as tmp:
            out_json = os.path.join(tmp, "out.json")
            r = bench("--runs", "2", "--prompt-tokens", "120", "--budget", str(BUDGET),
                      "--json", out_json)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(out_json) as f:
                out = json.load(f)
        rows = out["requests"]
        self.assertEqual([row["request"] for row in rows], [1, 2])
        for row in rows:
            tokens = row["prompt_tokens"]
            # Sized by /tokenize to at most 120 tokens; a word is a few tokens of stories260K's
            # 512-token vocabulary, so it lands within a word of it, and past one chunk.
            self.assertLessEqual(tokens, 120)
            self.assertGreater(tokens, BUDGET + 16)
            # Every chunk but the last is in the step log, each a full budget of tokens.
            chunks = math.ceil(tokens / BUDGET)
            self.assertEqual(row["chunk_tokens"], [BUDGET] * (chunks - 1), row)
            self.assertEqual(len(row["chunk_execute_s"]), chunks - 1)
            for key in ("served_s", "one_pass_s", "prefill_s"):
                self.assertGreater(row[key], 0, key)
            self.assertGreaterEqual(row["queue_s"], 0)
            # The server's phases happen inside the client's end-to-end time.
            self.assertLess(row["queue_s"] + row["prefill_s"], row["served_s"])
            self.assertLessEqual(sum(row["chunk_cycle_s"]), row["prefill_s"])
            # Split at the first chunk's start: what came before it, and the response after.
            self.assertGreaterEqual(row["before_s"], 0)
            self.assertGreater(row["after_s"], -1e-3)
            self.assertAlmostEqual(row["before_s"] + row["prefill_s"] + row["after_s"],
                                   row["served_s"], places=9)
            self.assertAlmostEqual(row["ratio"], row["served_s"] / row["one_pass_s"], places=9)
        self.assertAlmostEqual(out["median_served_s"],
                               statistics.median(row["served_s"] for row in rows), places=9)
        self.assertAlmostEqual(out["ratio"], out["median_served_s"] / out["median_one_pass_s"],
                               places=9)
        self.assertEqual(out["budget"], BUDGET)
        printed = [l for l in r.stdout.splitlines() if l.startswith("median served")]
        self.assertEqual(len(printed), 1, r.stdout)
        self.assertIn(f"= {out['ratio']:.3f} (target <= 1.2: ", printed[0])

    def test_bad_flags_in_one_line(self):
        for flags, names in [(("--runs", "0"), "--runs"),
                             (("--prompt-tokens", "x"), "--prompt-tokens"),
                             (("--rt-priority", "100"), "--rt-priority"),
                             (("--prompt-tokens", "500"), "--prompt-tokens 500")]:
            with self.subTest(flags=flags):
                r = bench(*flags)
                self.assertNotEqual(r.returncode, 0)
                self.assertEqual(r.stdout, "")
                last = r.stderr.strip().splitlines()[-1]
                self.assertIn(names, last)


def main():
    def start(args):
        global ARGS
        ARGS = args
        return []

    return unittest_main(start)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""scripts/lib/median_bootstrap.py, the paired bootstrap scripts/validate-simulate and
scripts/replay-kept-simulate print beside each median: on synthetic requests whose answer is
known.

  median_bootstrap_test.py
"""
import math
import os
import random
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts", "lib"))
from median_bootstrap import format_interval, paired_median_bootstrap  # noqa: E402


def check(cond, what):
    if not cond:
        sys.exit("FAIL: " + what)


def requests(n, seed, scale=1.0, noise=0.0):
    """n requests with log-normal TTFTs (median 60 ms) and 8 gaps each around 7 ms; the
    simulated side is the same requests times `scale`, each value off by up to +-noise."""
    rng = random.Random(seed)
    real, sim = [], []
    for _ in range(n):
        ttft = 60 * math.exp(rng.gauss(0, 0.4))
        gaps = [7 * math.exp(rng.gauss(0, 0.3)) for _ in range(8)]
        real.append({"ttft_ms": ttft, "itl_ms": gaps, "output_len": 9})
        jitter = lambda v: v * scale * (1 + rng.uniform(-noise, noise))  # noqa: E731
        sim.append({"ttft_ms": jitter(ttft), "itl_ms": [jitter(g) for g in gaps],
                    "output_len": 9})
    return real, sim


def main():
    # A simulator 10% slow on every value: the error is +10% in every resample.
    real, sim = requests(60, seed=1, scale=1.1)
    for metric in ("ttft_ms", "itl_ms"):
        b = paired_median_bootstrap(real, sim, metric, resamples=300)
        check(b is not None, f"{metric}: no interval")
        check(all(abs(e - 0.1) < 1e-9 for e in b["error"]), f"{metric}: error {b['error']}")
        check(b["requests"] == 60 and b["resamples"] == 300 and b["level"] == 95, str(b))
        lo, hi = b["real"]
        values = ([r["ttft_ms"] for r in real] if metric == "ttft_ms"
                  else [g for r in real for g in r["itl_ms"]])
        whole = statistics.median(values)
        check(lo <= whole <= hi, f"{metric}: real median {whole} outside {b['real']}")
        check(abs(b["sim"][0] - 1.1 * lo) < 1e-9 * lo, f"{metric}: sim interval {b['sim']}")

    # Seeded: the same inputs give the same intervals; another seed others.
    real, sim = requests(50, seed=2, noise=0.2)
    one = paired_median_bootstrap(real, sim, "ttft_ms", resamples=200, seed=5)
    check(one == paired_median_bootstrap(real, sim, "ttft_ms", resamples=200, seed=5),
          "the same seed gave different intervals")
    check(one != paired_median_bootstrap(real, sim, "ttft_ms", resamples=200, seed=6),
          "another seed gave the same intervals")

    # More requests, narrower intervals: the real median's and the error's.
    few = paired_median_bootstrap(*requests(30, seed=3, noise=0.3), "ttft_ms", resamples=400)
    many = paired_median_bootstrap(*requests(600, seed=3, noise=0.3), "ttft_ms", resamples=400)
    width = lambda iv: iv[1] - iv[0]  # noqa: E731
    check(width(many["real"]) < width(few["real"]) / 2,
          f"600 requests {many['real']} against 30 {few['real']}")
    check(width(many["error"]) < width(few["error"]) / 2,
          f"600 requests {many['error']} against 30 {few['error']}")
    check(many["real"][0] < 60 < many["real"][1], f"the population median 60 outside {many['real']}")

    # The ITL median is over tokens, not over requests' medians: one request of many fast gaps
    # outweighs four of one slow gap each: a draw holding it has median 1 (67% of draws), where
    # the median of the requests' medians would be 1 only with it drawn 3 times of 5 (6%).
    real = [{"ttft_ms": 1, "itl_ms": [1.0] * 20, "output_len": 21}] + [
        {"ttft_ms": 1, "itl_ms": [9.0], "output_len": 2} for _ in range(4)]
    b = paired_median_bootstrap(real, real, "itl_ms", resamples=1000, level=50)
    check(b["real"] == [1.0, 9.0], f"token median's middle half {b['real']}: want [1, 9]")
    check(b["error"] == [0.0, 0.0], f"identical sides: error {b['error']}")

    # A one-token answer has no gaps on either side and counts for nothing; a longer answer
    # without per-token gaps (a trace written before they were) gives no ITL interval.
    real = [{"ttft_ms": 5, "itl_ms": [2.0, 3.0], "output_len": 3}, {"ttft_ms": 6, "output_len": 1}]
    check(paired_median_bootstrap(real, real, "itl_ms", resamples=50) is not None,
          "one-token answers refused")
    old = [{"ttft_ms": 5, "itl_median_ms": 2.5, "output_len": 3}]
    check(paired_median_bootstrap(old, old, "itl_ms") is None, "an old trace gave an ITL interval")
    check(paired_median_bootstrap(old, old, "ttft_ms", resamples=20) is not None,
          "an old trace has TTFTs")
    check(format_interval(None) == "n/a (no per-token gaps)", format_interval(None))
    check(format_interval({"real": [55.06, 79.94], "error": [-0.126, 0.022]}) ==
          "real 55.1-79.9 ms, error -12.6%..+2.2%",
          format_interval({"real": [55.06, 79.94], "error": [-0.126, 0.022]}))
    try:
        paired_median_bootstrap(real, real[:1], "ttft_ms")
        check(False, "unmatched request lists accepted")
    except ValueError:
        pass
    print("median bootstrap: ok")


if __name__ == "__main__":
    main()

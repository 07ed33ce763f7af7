#!/usr/bin/env python3
"""scripts/validate-simulate's readings of the profile, without a server: it parses the profile
line that the current `kvshard simulate` prints (a synthetic step log of known coefficients comes
back as those coefficients, the step-history terms h, w, tau and k included, and the script's
per-step prediction matches the steps); its
decode-by-batch diagnostic sorts pure decode steps into 1, 2, 3-4, 5-8 and 9+ sequences, and its
decode-by-context one the one-sequence steps into 0-127, 128-255, 256-511 and 512+ tokens.

  validate_simulate_test.py --kvshard build/cli/kvshard
"""
import argparse
import importlib.machinery
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "validate-simulate")
# a, b (prefill token), c (decode seq), d (KV token), e (prefill pair), g (cached chunk)
TRUTH = (0.003, 0.0009, 0.002, 3e-6, 2e-7, 0.008)
# h (a step of two or more rows), w (warm-up after a prefill) and its decay in decode steps
H, W, TAU = 0.0012, 0.002, 8
# k (a step with a prefill chunk)
K = 0.009


def load_script():
    loader = importlib.machinery.SourceFileLoader("validate_simulate", SCRIPT)
    spec = importlib.util.spec_from_loader("validate_simulate", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def check(cond, what):
    if not cond:
        sys.exit("FAIL: " + what)


def step(prefill, seqs, kv, pairs=0, cached=0, since=0):
    a, b, c, d, e, g = TRUTH
    multi_row = 1 if prefill + seqs >= 2 else 0
    warm = math.exp(-(since - 1) / TAU) if since > 0 else 0.0
    prefill_step = 1 if prefill > 0 else 0
    return {"prefill_tokens": prefill, "decode_seqs": seqs, "kv_tokens": kv,
            "prefill_pairs": pairs, "cached_chunks": cached, "multi_row": multi_row,
            "decodes_since_prefill": since, "prefill_step": prefill_step,
            "seconds": a + b * prefill + c * seqs + d * kv + e * pairs + g * cached
            + H * multi_row + W * warm + K * prefill_step}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvshard", required=True)
    args = ap.parse_args()
    vs = load_script()
    tmp = tempfile.mkdtemp(prefix="validate-simulate-test-")

    # Exact steps of every kind: the fit gives the truth back and every kind's factor is 1.
    rng = random.Random(3)
    steps = []
    for _ in range(200):
        seqs = rng.choice([1, 1, 1, 2, 2, 3, 5, 8])
        steps.append(step(0, seqs, seqs * rng.randint(40, 900), since=rng.randint(1, 60)))
    for _ in range(40):
        q, start = rng.randint(16, 512), rng.choice([0, 0, 300])
        seqs = rng.choice([0, 0, 2])
        steps.append(step(q, seqs, start + q + seqs * 200, q * start + q * (q + 1) // 2,
                          1 if start else 0))
    profile = os.path.join(tmp, "profile.jsonl")
    with open(profile, "w") as f:
        f.write("".join(json.dumps(s) + "\n" for s in steps))
    done = subprocess.run([args.kvshard, "simulate", "--model-config",
                           os.path.join(ROOT, "tests/kv/configs/llama-3-8b.json"),
                           "--device", "cpu", "--profile", profile, "--num-kv-blocks", "64",
                           "--block-size", "16", "--num-requests", "2",
                           "--input-len", "32", "--output-len", "4", "--json"],
                          capture_output=True, text=True, timeout=120)
    check(done.returncode == 0, "kvshard simulate failed:\n" + done.stderr)
    fit = vs.profile_coefficients([l for l in done.stderr.splitlines()
                                   if l.startswith("profile ")])
    check(fit is not None, "the script does not parse simulate's profile line:\n" + done.stderr)
    a, b, c, d, e, f, g = fit["coef"]
    for name, got, want in zip("abcdeg", (a, b, c, d, e, g), TRUTH):
        check(abs(got - want) <= 1e-3 * want, f"coefficient {name}: {got} against {want}")
    check(f == 0, f"no arrivals in the steps, yet f = {f}")
    for name, got, want in (("h", fit["h"], H), ("w", fit["w"], W), ("tau", fit["tau"], TAU),
                            ("k", fit["k"], K)):
        check(abs(got - want) <= 1e-3 * want, f"{name}: {got} against {want}")
    for kind, factor in fit["kinds"].items():
        check(abs(factor - 1) < 1e-3, f"kind {kind}: factor {factor} on exact steps")
    for s in steps[:5] + steps[-5:]:
        pred = vs.predicted_seconds(fit, s)
        check(abs(pred / s["seconds"] - 1) < 1e-3, f"predicted {pred} s for {s}")

    # Decode steps by batch: prefill steps left out, every bucket's count and ratio.
    lines = [json.dumps(step(0, n, 100 * n)) for n in (1, 1, 2, 3, 4, 5, 8, 9, 12)]
    lines.append(json.dumps(step(64, 2, 300)))
    table = vs.decode_batch_table(fit, lines, scale=0.5)
    check(list(table) == ["1", "2", "3-4", "5-8", "9+"], f"buckets {list(table)}")
    check([v[0] for v in table.values()] == [2, 1, 2, 2, 2], f"counts {table}")
    for name, (n, measured, predicted, ratio) in table.items():
        check(abs(ratio - 2) < 1e-3 and abs(measured / predicted - 2) < 1e-3,
              f"{name}: the profile at scale 0.5 should predict half the steps, got {ratio}")
    check("1: 2 steps" in vs.format_batch_table(table), vs.format_batch_table(table))

    # One-sequence decode steps by context: other batches and prefill steps left out.
    lines = [json.dumps(step(0, 1, kv)) for kv in (40, 127, 128, 300, 511, 512, 2000)]
    lines += [json.dumps(step(0, 2, 100)), json.dumps(step(64, 1, 100))]
    table = vs.decode_context_table(fit, lines)
    check(list(table) == ["0-127", "128-255", "256-511", "512+"], f"context buckets {list(table)}")
    check([v[0] for v in table.values()] == [2, 1, 2, 2], f"context counts {table}")
    check(all(abs(v[3] - 1) < 1e-3 for v in table.values()), f"context ratios {table}")
    check(vs.format_batch_table({}) == "no such steps", "an empty table prints nothing")

    # --profile-spread (the script passes it by default): with the profile it runs; without one
    # it is refused, naming the flag.
    base = [args.kvshard, "simulate", "--model-config",
            os.path.join(ROOT, "tests/kv/configs/llama-3-8b.json"), "--num-kv-blocks", "64",
            "--block-size", "16", "--num-requests", "2", "--input-len", "32", "--output-len", "4",
            "--json"]
    done = subprocess.run(base + ["--device", "cpu", "--profile", profile, "--profile-spread"],
                          capture_output=True, text=True, timeout=120)
    check(done.returncode == 0, "--profile-spread with a profile failed:\n" + done.stderr)
    done = subprocess.run(base + ["--device", "h200", "--profile-spread"], capture_output=True,
                          text=True, timeout=120)
    check(done.returncode != 0 and "--profile-spread" in done.stderr,
          "--profile-spread without --profile: " + done.stderr)
    print("validate-simulate profile readings: ok")


if __name__ == "__main__":
    main()

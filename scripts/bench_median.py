#!/usr/bin/env python3
"""Medians over runs of `kvshard bench --json` lines (from scripts/bench-serving, bench-disagg).

    scripts/bench_median.py --key server,concurrency < runs.jsonl
Groups the lines by the --key fields and prints, per group, the median and the range (min-max)
over runs of request throughput, output tokens/s, goodput, TTFT/ITL/TPOT median and p99.
"""
import argparse
import json
import statistics
import sys

FIELDS = [("request_throughput", None), ("output_throughput", None), ("goodput", None),
          ("ttft_ms", "median"), ("ttft_ms", "p99"), ("itl_ms", "median"), ("itl_ms", "p99"),
          ("tpot_ms", "median"), ("tpot_ms", "p99")]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--key", default="server,concurrency")
    args = p.parse_args()
    keys = args.key.split(",")
    groups = {}
    for line in sys.stdin:
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    header = keys + ["runs"] + [f + ("." + s if s else "") for f, s in FIELDS]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key, rs in groups.items():
        cells = [str(k) for k in key] + [str(len(rs))]
        for field, sub in FIELDS:
            vals = [v for v in ((r[field][sub] if sub else r[field]) for r in rs if r.get(field) is not None) if v is not None]
            if not vals:
                cells.append("")
                continue
            m = statistics.median(vals)
            cells.append(f"{m:.3g} ({min(vals):.3g}-{max(vals):.3g})" if len(vals) > 1 else f"{m:.3g}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

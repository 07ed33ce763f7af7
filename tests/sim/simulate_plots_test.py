#!/usr/bin/env python3
"""scripts/simulate-plots on the current `kvshard simulate --json` output: a sweep of two rates of
a tiny workload draws an SVG (needs nothing) whose panels carry the runs' figures, the saved
outputs draw it again from --json, and a PNG is drawn when matplotlib is installed (skipped,
said on stdout, otherwise). Bad input is refused with one line.

  simulate_plots_test.py --kvshard build/cli/kvshard
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "simulate-plots")
SIM_ARGS = ["--model-config", os.path.join(ROOT, "tests/kv/configs/llama-3-8b.json"),
            "--device", "h100", "--num-requests", "12", "--input-len", "256", "--output-len", "16",
            "--slo", "ttft_ms=500,tpot_ms=30"]


def run(args):
    return subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True,
                          timeout=300)


def check(cond, what):
    if not cond:
        sys.exit("FAIL: " + what)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvshard", required=True)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="simulate-plots-test-")
    svg = os.path.join(tmp, "sweep.svg")
    saved = os.path.join(tmp, "runs")
    done = run(["--kvshard", a.kvshard, "--out", svg, "--rates", "2,16", "--save-json", saved,
                "--"] + SIM_ARGS)
    check(done.returncode == 0, "the sweep failed:\n" + done.stdout + done.stderr)
    root = ET.parse(svg).getroot()  # well-formed XML
    check(root.tag.endswith("svg"), "the output is not an SVG document")
    check(len(list(root.iter())) > 30, "the SVG has almost nothing drawn")
    outputs = sorted(os.listdir(saved))
    check(len(outputs) == 2, "expected one saved output per rate, got %s" % outputs)
    for name in outputs:
        with open(os.path.join(saved, name)) as f:
            doc = json.load(f)
        check(doc["completed"] == 12, "%s: %s requests completed, not 12" % (name, doc["completed"]))
    # The same figure from the saved outputs.
    again = os.path.join(tmp, "again.svg")
    done = run(["--out", again] + ["--json"] + [os.path.join(saved, n) for n in outputs])
    check(done.returncode == 0, "--json failed:\n" + done.stderr)
    ET.parse(again)
    # Refused by name.
    bad = run(["--out", os.path.join(tmp, "x.gif"), "--json", os.path.join(saved, outputs[0])])
    check(bad.returncode != 0 and "--out" in bad.stderr, "a .gif output was not refused by name")
    bad = run(["--out", svg, "--rates", "2", "--"] + SIM_ARGS + ["--request-rate", "3"])
    check(bad.returncode != 0 and "--request-rate" in bad.stderr,
          "--request-rate after -- was not refused by name")
    if importlib.util.find_spec("matplotlib") is None:
        print("simulate-plots PNG: skipped (matplotlib is not installed)")
    else:
        png = os.path.join(tmp, "sweep.png")
        done = run(["--out", png, "--json"] + [os.path.join(saved, n) for n in outputs])
        check(done.returncode == 0, "the PNG failed:\n" + done.stderr)
        with open(png, "rb") as f:
            check(f.read(8) == b"\x89PNG\r\n\x1a\n", "the PNG output is not a PNG")
    print("simulate-plots: ok")


if __name__ == "__main__":
    main()

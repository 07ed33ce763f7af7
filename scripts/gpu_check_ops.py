#!/usr/bin/env python3
"""The ops8b step of scripts/gpu-check: reads kvshard_cuda_op_bench --json output and prints one
note line (the bf16 MatMul ceiling, the prefill attention's share of it against the 60% target,
the slowest decode ops per batch). Exits 1 when the output has no JSON object, a field is missing,
or a figure is not a positive finite number (NaN, 0 from a failed measurement).

  gpu_check_ops.py BENCH_OUTPUT      the note, or the problem, on stdout
  gpu_check_ops.py --self-test       checks this parsing on canned output (no GPU)
"""
import json
import math
import sys

PREFILL_TARGET_PCT = 60.0


def _positive(value, what):
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} is {value!r}, not a positive number")
    return float(value)


def summarize(text):
    """The note line for the bench's output `text`; ValueError naming the problem."""
    objects = [line for line in text.splitlines() if line.startswith("{")]
    if not objects:
        raise ValueError("no JSON object in the bench's output")
    data = json.loads(objects[-1])
    ceiling = _positive(data.get("ceiling_tflops"), "ceiling_tflops")
    gemms = data.get("gemms") or []
    if not gemms:
        raise ValueError("no gemms")
    for g in gemms:
        _positive(g.get("tflops"), f"gemm {g.get('name')} tflops")
    prefill = data.get("prefill") or {}
    pct = _positive(prefill.get("pct_of_ceiling"), "prefill pct_of_ceiling")
    tokens = prefill.get("tokens")
    ms = _positive(prefill.get("ms"), "prefill ms")
    ops = data.get("ops_us") or {}
    if not ops:
        raise ValueError("no ops_us")
    parts = []
    for batch, times in sorted(ops.items(), key=lambda kv: int(kv[0])):
        if not times:
            raise ValueError(f"no op times at batch {batch}")
        for name, us in times.items():
            _positive(us, f"op {name} at batch {batch}")
        top = sorted(times.items(), key=lambda kv: -kv[1])[:3]
        parts.append(f"b{batch} " + ", ".join(f"{n} {us:.1f}" for n, us in top) + " us")
    verdict = "meets" if pct >= PREFILL_TARGET_PCT else "below"
    return (f"ceiling {ceiling:.1f} TFLOP/s; prefill {tokens} tokens {ms:.2f} ms = {pct:.1f}% of it "
            f"({verdict} the {PREFILL_TARGET_PCT:.0f}% target); slowest ops: " + "; ".join(parts))


_CANNED = """\
gemm square_4096    m=4096 n=4096 k=4096 612.30 TFLOP/s
ceiling 640.00 TFLOP/s (bf16 MatMul, best of the products above)
op batch=1 embedding            3.10 us
prefill tokens=2048 3.100 ms 11.08 TFLOP/s 1.7% of ceiling
{"backend":"cuda","shape":"8b","ceiling_tflops":640.000,"gemms":[{"name":"square_4096","m":4096,"n":4096,"k":4096,"tflops":612.300},{"name":"8b_gate_up","m":2048,"n":28672,"k":4096,"tflops":640.000}],"ops_us":{"1":{"embedding":3.100,"matmul_gate_up":140.200,"attention":12.000,"rope":2.000},"32":{"matmul_gate_up":150.000,"attention":40.500}},"prefill":{"tokens":2048,"ms":3.1000,"tflops":11.080,"pct_of_ceiling":1.73}}
"""


def self_test():
    note = summarize(_CANNED)
    assert note.startswith("ceiling 640.0 TFLOP/s; prefill 2048 tokens 3.10 ms = 1.7% of it (below"), note
    assert "b1 matmul_gate_up 140.2, attention 12.0, embedding 3.1 us" in note, note
    assert "b32 matmul_gate_up 150.0, attention 40.5 us" in note, note
    good = json.loads(_CANNED.splitlines()[-1])
    good["prefill"]["pct_of_ceiling"] = 61.0
    assert "(meets the 60% target)" in summarize(json.dumps(good))
    for broken, want in [
        ("no json here", "no JSON object"),
        (_CANNED.replace('"ceiling_tflops":640.000', '"ceiling_tflops":NaN'), "ceiling_tflops"),
        (_CANNED.replace('"attention":40.500', '"attention":0'), "op attention at batch 32"),
        (_CANNED.replace('"pct_of_ceiling":1.73', '"pct_of_ceiling":-1'), "pct_of_ceiling"),
        (_CANNED.replace('"ops_us":{"1"', '"ops_us":{},"x":{"1"'), "no ops_us"),
    ]:
        try:
            summarize(broken)
        except ValueError as error:
            assert want in str(error), (want, str(error))
        else:
            raise AssertionError(f"accepted output with {want} broken")
    print("self-test passed")
    return 0


def main():
    if len(sys.argv) == 2 and sys.argv[1] == "--self-test":
        return self_test()
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    try:
        with open(sys.argv[1]) as f:
            print(summarize(f.read()))
    except (OSError, ValueError) as error:
        print(f"{sys.argv[1]}: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# kvshard_cuda_prefill_step_bench (scripts/gpu-check's prefill8b step) on the CPU backend with the
# tiny shape: the JSON has one entry per --tokens value with a positive time and GEMM share, and
# the `note` line gpu-check records names the longest prompt; bad values (a flag's, and
# KVSHARD_CUDA_PREFILL's) are refused in one line naming them, exit != 0.
#   cuda_prefill_step_bench_test.sh PREFILL_STEP_BENCH
set -uo pipefail
bench=$1
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

if "$bench" --backend cpu --shape tiny --tokens 8,33 --steps 2 --json >"$tmp/out" 2>"$tmp/err"; then
  python3 - "$tmp/out" <<'PY' || fail "prefill step bench output: $(cat "$tmp/out")"
import json, sys
lines = open(sys.argv[1]).read().splitlines()
j = json.loads([l for l in lines if l.startswith("{")][-1])
assert j["backend"] == "cpu" and j["shape"] == "tiny" and j["ceiling_tflops"] > 0, j
assert [s["tokens"] for s in j["steps"]] == [8, 33], j
for s in j["steps"]:
    k = s["kernels"]["cpu"]
    assert k["ms_per_step"] > 0 and k["tok_per_s"] > 0 and k["gemm_pct_of_ceiling"] > 0, s
    assert s["gemm_flops"] > 0 and s["attention_flops"] > 0, s
# More tokens, more work: the longer prompt's GEMM FLOPs are about 33/8 of the shorter's.
a, b = (s["gemm_flops"] for s in j["steps"])
assert 3.5 < b / a < 4.2, (a, b)
notes = [l for l in lines if l.startswith("note ")]
assert len(notes) == 1 and notes[0].startswith("note 33 tokens: cpu "), notes
PY
else
  fail "prefill step bench on the cpu: rc $? $(tail -3 "$tmp/err")"
fi

refused() {  # named args...
  local named=$1; shift
  if "$bench" "$@" >"$tmp/r.out" 2>"$tmp/r.err"; then
    fail "$* was accepted"
  elif ! grep -q -- "$named" "$tmp/r.err" "$tmp/r.out"; then
    fail "$*: no mention of $named in: $(head -3 "$tmp/r.err")"
  fi
}
refused --tokens --backend cpu --shape tiny --tokens 0
refused --tokens --backend cpu --shape tiny --tokens x
refused --steps --backend cpu --shape tiny --steps 0
refused --shape --backend cpu --shape 70b
refused --batches --backend cpu --shape tiny --batches 4
if KVSHARD_CUDA_PREFILL=fast "$bench" --backend cpu --shape tiny >"$tmp/r.out" 2>"$tmp/r.err"; then
  fail "KVSHARD_CUDA_PREFILL=fast was accepted"
elif ! grep -q 'KVSHARD_CUDA_PREFILL=fast' "$tmp/r.err"; then
  fail "KVSHARD_CUDA_PREFILL=fast: $(head -3 "$tmp/r.err")"
fi
[ "$fails" -eq 0 ] && echo "all passed"
[ "$fails" -eq 0 ]

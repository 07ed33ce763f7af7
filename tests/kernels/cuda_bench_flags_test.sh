#!/usr/bin/env bash
# kvshard_cuda_decode_bench and kvshard_cuda_op_bench parse their flags with CLI11
# (kernels/bench/cuda_bench_flags.h): both run on the CPU backend with the tiny shape and print
# the JSON their flags ask for, and a bad value is refused in a line naming its flag, exit != 0,
# before any backend is made.
#   cuda_bench_flags_test.sh DECODE_BENCH OP_BENCH
set -uo pipefail
decode=$1 op=$2
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# Runs on the CPU: the JSON line carries the batches asked for.
if "$decode" --backend cpu --shape tiny --batches 1,3 --context 8 --steps 2 --json \
     >"$tmp/decode.out" 2>"$tmp/decode.err"; then
  python3 - "$tmp/decode.out" <<'PY' || fail "decode bench JSON: $(cat "$tmp/decode.out")"
import json, sys
j = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
assert j["backend"] == "cpu" and j["shape"] == "tiny" and j["context"] == 8, j
assert [b["batch"] for b in j["batches"]] == [1, 3], j
PY
else
  fail "decode bench on the cpu: rc $? $(tail -3 "$tmp/decode.err")"
fi
if "$op" --backend cpu --shape tiny --batches 2 --prefill-tokens 16 --json \
     >"$tmp/op.out" 2>"$tmp/op.err"; then
  python3 - "$tmp/op.out" <<'PY' || fail "op bench JSON: $(cat "$tmp/op.out")"
import json, sys
j = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
assert j["backend"] == "cpu" and j["shape"] == "tiny", j
assert list(j["ops_us"]) == ["2"] and j["prefill"]["tokens"] == 16, j
PY
else
  fail "op bench on the cpu: rc $? $(tail -3 "$tmp/op.err")"
fi

# Refusals: exit != 0 and the flag named on stderr.
refused() {  # flag-named binary args...
  local named=$1 bin=$2; shift 2
  if "$bin" "$@" >"$tmp/r.out" 2>"$tmp/r.err"; then
    fail "$(basename "$bin") $* was accepted"
  elif ! grep -q -- "$named" "$tmp/r.err" "$tmp/r.out"; then
    fail "$(basename "$bin") $*: no mention of $named in: $(head -3 "$tmp/r.err")"
  fi
}
for bin in "$decode" "$op"; do
  refused --backend "$bin" --backend tpu
  refused --shape "$bin" --shape 70b
  refused --batches "$bin" --batches 1,0
  refused --batches "$bin" --batches x
  refused --bogus "$bin" --bogus
done
refused --context "$decode" --context 0
refused --steps "$decode" --steps -1
refused --prefill-tokens "$op" --prefill-tokens 1
"$op" --help >"$tmp/help.out" 2>&1 && grep -q -- --prefill-tokens "$tmp/help.out" ||
  fail "op bench --help does not list --prefill-tokens"

[ $fails -eq 0 ] && echo "cuda bench flags: ok"
[ $fails -eq 0 ]

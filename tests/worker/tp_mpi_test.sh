#!/usr/bin/env bash
# Tensor parallelism across processes: `mpirun -np N kvshard generate --tp N --comm mpi` must
# generate the greedy tokens of `kvshard generate --tp 1`. Run by ctest (label "mpi").
# Usage: tp_mpi_test.sh MPIEXEC KVSHARD STORIES_DIR [DEFAULT_MODEL]
# Models that are absent are skipped with a message; as root, mpirun needs --allow-run-as-root,
# and --oversubscribe lets 4 ranks share 2 cores.
set -euo pipefail
mpiexec="$1" kvshard="$2" stories="$3" default_model="${4:-}"
failures=0

token_ids() { grep -o '"token_ids":\[[^]]*\]' | head -n 1; }

check() {  # model np max_tokens prompt
    local model="$1" np="$2" max_tokens="$3" prompt="$4"
    local ref got
    ref="$("$kvshard" generate --model "$model" --prompt "$prompt" --max-tokens "$max_tokens" --json | token_ids)"
    got="$("$mpiexec" --allow-run-as-root --oversubscribe -np "$np" \
        "$kvshard" generate --model "$model" --prompt "$prompt" --max-tokens "$max_tokens" \
        --tp "$np" --comm mpi --json | token_ids)"
    if [ -n "$ref" ] && [ "$ref" = "$got" ]; then
        echo "ok   np $np $(basename "$model"): $ref"
    else
        echo "FAIL np $np $(basename "$model"): tp 1 $ref, mpi ${got:-<nothing>}"
        failures=$((failures + 1))
    fi
}

if [ -f "$stories/stories260K.bin" ]; then
    for np in 2 4; do
        check "$stories/stories260K.bin" "$np" 48 "Once upon a time"
        check "$stories/stories260K.gguf" "$np" 48 "Once upon a time"
    done
else
    echo "skipped: stories260K not found in $stories"
fi
if [ -n "$default_model" ] && [ -f "$default_model" ]; then
    check "$default_model" 3 6 "The capital of France is"
    check "$default_model" 2 6 "The capital of France is"
else
    echo "skipped: default model not found (${default_model:-none given})"
fi
[ "$failures" -eq 0 ]

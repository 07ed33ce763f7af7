#!/usr/bin/env bash
# Tensor parallelism across independent processes, no mpirun: `kvshard serve` in process mode
# with the direct launcher starts tp `kvshard worker` processes that meet through the coordinator
# and all-reduce over Gloo. A greedy completion over HTTP must give the text of tp 1 (tp 2 and 4
# on stories260K, 3 and 2 on the default model, as tp_mpi_test.sh does under mpirun), and so must
# tp 2 with --stage-collectives (each rank's all-reduces copied out of and back into its backend's
# memory around the Gloo call: the path of ranks sharing a GPU; the workers must log it). Run by
# ctest (label "gloo"). Usage: tp_gloo_test.sh KVSHARD STORIES_DIR [DEFAULT_MODEL]
# Models that are absent are skipped with a message.
set -euo pipefail
kvshard="$1" stories="$2" default_model="${3:-}"
failures=0
work="$(mktemp -d)"
server_pid=""
cleanup() {
    if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

# Starts `kvshard serve` (model, tp), prints the completion's text, stops the server.
complete() {  # model tp max_tokens prompt [serve flag]
    local model="$1" tp="$2" max_tokens="$3" prompt="$4" flag="${5:-}" level=warn
    [ -n "$flag" ] && level=info
    cat > "$work/serve.yaml" <<EOF
model: $model
log_level: $level
workers:
  mode: processes
  launcher: direct
  register_timeout_ms: 120000
EOF
    # A log of its own per server: a worker of the previous server that outlives it briefly still
    # writes to the previous file, never into the lines this server's URL is read from.
    log="$(mktemp "$work/serve.XXXXXX")"
    "$kvshard" serve --config "$work/serve.yaml" --tp "$tp" --threads 1 --host 127.0.0.1 \
        --port 0 $flag 2> "$log" &
    server_pid=$!
    local url=""
    for _ in $(seq 1 1200); do
        url="$(grep -o 'listening on http://[0-9.]*:[0-9]*' "$log" | head -n 1 |
               sed 's/listening on //')" || true
        [ -n "$url" ] && break
        if ! kill -0 "$server_pid" 2>/dev/null; then break; fi
        sleep 0.1
    done
    if [ -z "$url" ]; then
        echo "serve tp $tp did not start:" >&2
        cat "$log" >&2
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
        server_pid=""
        return 1
    fi
    local text
    text="$(curl -sS --max-time 120 --retry 5 --retry-connrefused --retry-delay 1 "$url/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"$(basename "$model")\", \"prompt\": \"$prompt\", \"max_tokens\": $max_tokens, \"temperature\": 0}" |
        grep -o '"text":"[^"]*"' | head -n 1)" || true
    if [ -z "$text" ]; then
        # Why, for the reader of the failure: is the server still there, and what did it log.
        kill -0 "$server_pid" 2>/dev/null && echo "serve tp $tp is running" >&2 ||
            echo "serve tp $tp exited" >&2
        tail -n 20 "$log" >&2
    fi
    echo "$text"
    cp "$log" "$work/serve.log"
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
}

check() {  # model tp max_tokens prompt [serve flag]
    local model="$1" tp="$2" max_tokens="$3" prompt="$4" flag="${5:-}" ref got
    ref="$(complete "$model" 1 "$max_tokens" "$prompt")" || ref=""
    got="$(complete "$model" "$tp" "$max_tokens" "$prompt" "$flag")" || got=""
    if [ "$flag" = "--stage-collectives" ] && ! grep -q 'host-staged collective' "$work/serve.log"; then
        echo "FAIL tp $tp $(basename "$model") $flag: no worker logged the host-staged path"
        failures=$((failures + 1))
    elif [ -n "$ref" ] && [ "$ref" = "$got" ]; then
        echo "ok   tp $tp $(basename "$model") $flag: $ref"
    else
        echo "FAIL tp $tp $(basename "$model") $flag: tp 1 ${ref:-<nothing>}, gloo ${got:-<nothing>}"
        failures=$((failures + 1))
    fi
}

if [ -f "$stories/stories260K.bin" ]; then
    for tp in 2 4; do
        check "$stories/stories260K.bin" "$tp" 32 "Once upon a time"
    done
    check "$stories/stories260K.bin" 2 32 "Once upon a time" --stage-collectives
else
    echo "skipped: stories260K not found in $stories"
fi
if [ -n "$default_model" ] && [ -f "$default_model" ]; then
    check "$default_model" 3 8 "The capital of France is"
    check "$default_model" 2 8 "The capital of France is"
    check "$default_model" 2 8 "The capital of France is" --stage-collectives
else
    echo "skipped: default model not found (${default_model:-none given})"
fi
[ "$failures" -eq 0 ]

#!/usr/bin/env python3
"""Regenerates tests/golden/arch_llamacpp.json: llama.cpp's greedy tokens and last-position
log-probabilities on the synthetic model of each architecture (llama, qwen2, qwen3, gemma3),
read by tests/worker/arch_model_test.cc.

The models are model/synthetic_gguf.h's SyntheticArchGguf (random F32 weights, seed 7), written
by the kvshard_write_arch_models tool; the test rebuilds the same files itself, so no model file
is stored. llama.cpp (an independent implementation) runs as its own llama-server on each file,
greedy (top-k 1), on prompts of token ids drawn here with a fixed seed. For each prompt it records
its greedy continuation (NEW_TOKENS tokens) and the log-probability of every vocabulary entry at
the last prompt position. Mistral's sliding window is not in the list: llama.cpp has no
`mistral` architecture and ignores `llama.attention.sliding_window` (the window is checked
against llama.cpp through gemma3's local layers, and on its own in the test).

    cmake --build build --target kvshard_write_arch_models
    python3 tests/golden/make_arch_llamacpp.py build/tests/kvshard_write_arch_models \
        [build-peer/llama.cpp/bin/llama-server]
"""
import json
import os
import random
import subprocess
import sys
import tempfile

from llamacpp_server import LlamaServer

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
VOCAB = 256
PROMPT_LENGTHS = [1, 5, 13, 29]
NEW_TOKENS = 16
PORT = 18471


def prompts():
    rng = random.Random(15)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


def run(server, model_path):
    cases = []
    with LlamaServer(server, model_path, PORT, 256) as llama:
        for ids in prompts():
            r, first = llama.greedy(ids, NEW_TOKENS, n_probs=VOCAB)
            if r["timings"]["prompt_n"] != len(ids):
                sys.exit(f"llama.cpp evaluated {r['timings']['prompt_n']} prompt tokens, "
                         f"sent {len(ids)}")
            logprobs = [None] * VOCAB
            for t in first:
                logprobs[t["id"]] = round(t["logprob"], 6)
            if any(v is None for v in logprobs):
                sys.exit(f"llama.cpp returned {len(first)} of {VOCAB} log-probabilities")
            cases.append({"prompt_token_ids": ids, "greedy_token_ids": r["tokens"],
                          "last_logprobs": logprobs})
            print(f"{os.path.basename(model_path)} prompt of {len(ids)}: {r['tokens']}",
                  file=sys.stderr)
    return cases


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    writer = sys.argv[1]
    server = sys.argv[2] if len(sys.argv) > 2 else os.path.join(
        root, "build-peer/llama.cpp/bin/llama-server")
    out = {"generator": "llama.cpp " + os.path.relpath(server, root), "new_tokens": NEW_TOKENS,
           "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([writer, tmp], check=True, stdout=subprocess.DEVNULL)
        for arch in ARCHS:
            out["models"][arch] = run(server, os.path.join(tmp, arch + ".gguf"))
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arch_llamacpp.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()

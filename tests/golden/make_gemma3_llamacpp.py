#!/usr/bin/env python3
"""Regenerates tests/golden/gemma3_llamacpp.json: llama.cpp's greedy tokens on Gemma 3 270M Q4_K_M
(models/gemma-3-270m-q4_k_m.gguf, fetched by scripts/fetch-gemma3), read by
tests/worker/gemma3_model_test.cc.

llama.cpp (an independent implementation) runs as its own llama-server, greedy (top-k 1), on the
same file kvshard loads. For each prompt it records llama.cpp's prompt token ids (BOS added,
special tokens parsed), its greedy continuation (64 tokens, EOS ignored) and the top-20
log-probabilities at the last prompt position. Half of the prompts are in Gemma's chat format.

    scripts/fetch-gemma3
    python3 tests/golden/make_gemma3_llamacpp.py [build-peer/llama.cpp/bin/llama-server]
"""
import json
import os
import sys

from llamacpp_server import LlamaServer


def chat(text):
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "1, 2, 3, 5, 8, 13,",
    chat("Write a haiku about the sea."),
    chat("What is 12 + 35?"),
    chat("Name three primary colors."),
    chat("Explain in two sentences what a transformer is in machine learning."),
]
NEW_TOKENS = 64
TOP = 20
MODEL = "gemma-3-270m-q4_k_m.gguf"
PORT = 18473


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    server = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        root, "build-peer/llama.cpp/bin/llama-server")
    cases = []
    with LlamaServer(server, os.path.join(root, "models", MODEL), PORT, 1024, timeout=1200) as llama:
        for prompt in PROMPTS:
            ids = llama.post("/tokenize", {"content": prompt, "add_special": True,
                                           "parse_special": True})["tokens"]
            r, first = llama.greedy(ids, NEW_TOKENS, n_probs=TOP)
            cases.append({
                "prompt": prompt,
                "prompt_token_ids": ids,
                "greedy_token_ids": r["tokens"],
                "greedy_text": r["content"],
                "last_top_logprobs": [[t["id"], round(t["logprob"], 6)] for t in first],
            })
            print(f"{prompt[:30]!r}: {r['content'][:60]!r}", file=sys.stderr)
    out = {"generator": "llama.cpp " + os.path.relpath(server, root), "model": MODEL,
           "new_tokens": NEW_TOKENS, "cases": cases}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemma3_llamacpp.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Regenerates tests/golden/kquant_llamacpp.json: llama.cpp's greedy tokens on the K-quant files
of the default model that scripts/make-kquant-models writes (Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0
tensors; Q6_K: Q6_K and Q8_0), read by tests/worker/kquant_model_test.cc.

llama.cpp (an independent implementation) runs as its own llama-server, greedy (top-k 1), on the
same file kvshard loads. For each prompt it records llama.cpp's prompt token ids (special tokens
parsed, no BOS), its greedy continuation (32 tokens, stopping early only at EOS), and the top-10
log-probabilities at the last prompt position (which llamacpp_server.py asks for in a request of
their own). llama.cpp multiplies K-quant weights with activations quantized to 8 bits (Q8_K), so
kvshard's fp32 arithmetic parts from it at near-ties.

    scripts/make-kquant-models
    python3 tests/golden/make_kquant_llamacpp.py [build-peer/llama.cpp/bin/llama-server]
"""
import json
import os
import sys

from llamacpp_server import LlamaServer

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is 12 + 35?\nA:",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 5, 8, 13,",
    "In machine learning, a transformer is",
    "The three primary colors are",
]
NEW_TOKENS = 32
MODELS = ["SmolLM2-135M-Instruct.Q4_K_M.gguf", "SmolLM2-135M-Instruct.Q6_K.gguf"]
PORT = 18467


def run(server, model_path):
    cases = []
    with LlamaServer(server, model_path, PORT, 512) as llama:
        for prompt in PROMPTS:
            ids = llama.post("/tokenize", {"content": prompt, "add_special": False,
                                           "parse_special": True})["tokens"]
            r, first = llama.greedy(ids, NEW_TOKENS, n_probs=10, ignore_eos=False)
            cases.append({
                "prompt": prompt,
                "prompt_token_ids": ids,
                "greedy_token_ids": r["tokens"],
                "greedy_text": r["content"],
                "first_top_logprobs": [[t["id"], t["logprob"]] for t in first],
            })
            print(f"{os.path.basename(model_path)} {prompt[:30]!r}: {len(r['tokens'])} tokens",
                  file=sys.stderr)
    return cases


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    server = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        root, "build-peer/llama.cpp/bin/llama-server")
    out = {"generator": "llama.cpp " + os.path.relpath(server, root), "new_tokens": NEW_TOKENS,
           "models": {}}
    for name in MODELS:
        out["models"][name] = run(server, os.path.join(root, "models", name))
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kquant_llamacpp.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Regenerates tests/golden/smollm2_llamacpp.json from llama.cpp (PyPI llama-cpp-python).

llama.cpp is an independent implementation, so its greedy tokens and logits are a reference no
kvshard code produced. For each prompt this records llama.cpp's prompt token ids, its greedy
continuation (64 tokens, stopping early only at EOS), and its logits at the last prompt position
(the 64 highest, plus every 97th vocabulary id) so kvshard's test can compare values.

    pip install llama-cpp-python numpy
    python3 tests/golden/make_smollm2_llamacpp.py models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import json
import os
import sys

import llama_cpp
import numpy as np

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is 12 + 35?\nA:",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Les étoiles brillent dans le ciel de la nuit, et",
    "1, 2, 3, 5, 8, 13,",
    "In machine learning, a transformer is",
    "The three primary colors are",
    "Here is a list of fruits:\n-",
]
NEW_TOKENS = 64
LOGIT_STRIDE = 97
TOP_LOGITS = 64


def main():
    model_path = sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    out_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_llamacpp.json")
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=512, n_batch=512, n_threads=2,
                          logits_all=True, verbose=False)
    eos = llm.token_eos()
    cases = []
    for prompt in PROMPTS:
        # Special tokens are parsed so the chat-formatted prompt uses <|im_start|> ids.
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        top = np.argsort(-logits, kind="stable")[:TOP_LOGITS]
        generated = []
        for _ in range(NEW_TOKENS):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            generated.append(tok)
            if tok == eos:
                break
            llm.eval([tok])
        cases.append({
            "prompt": prompt,
            "prompt_token_ids": [int(t) for t in ids],
            "greedy_token_ids": generated,
            "greedy_text": llm.detokenize(generated).decode("utf-8", errors="replace"),
            "last_logits_top": [[int(i), float(logits[i])] for i in top],
            "last_logits_strided": [float(v) for v in logits[::LOGIT_STRIDE]],
        })
        print(f"{prompt[:40]!r}: {len(ids)} prompt tokens, {len(generated)} generated", file=sys.stderr)
    golden = {
        "generator": "llama-cpp-python " + llama_cpp.__version__,
        "model": os.path.basename(model_path),
        "new_tokens": NEW_TOKENS,
        "logit_stride": LOGIT_STRIDE,
        "cases": cases,
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()

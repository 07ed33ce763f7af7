#!/usr/bin/env python3
"""Regenerates tests/golden/smollm2_llamacpp.json from llama.cpp (PyPI llama-cpp-python).

llama.cpp is an independent implementation, so its greedy tokens and logits are a reference no
kvshard code produced. It runs twice:

- "f32": on the same weights dequantized to F32 (by gguf-py, llama.cpp's own Python package,
  into a temporary GGUF). llama.cpp then multiplies in fp32 like kvshard, so tokens and logits
  must agree closely: this is the correctness reference.
- "q4_1": on the Q4_1 file as shipped. llama.cpp multiplies Q4_1 weights with activations
  quantized to 8 bits (Q8_1), a different arithmetic from kvshard's fp32, so greedy paths may part
  at near-ties; kvshard's test reports how far they agree.

For each prompt it records llama.cpp's prompt token ids, its greedy continuation (64 tokens,
stopping early only at EOS), and its logits at the last prompt position (the 64 highest, plus
every 97th vocabulary id).

    pip install llama-cpp-python numpy gguf
    python3 tests/golden/make_smollm2_llamacpp.py models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import json
import os
import sys
import tempfile

import llama_cpp
import gguf
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
    "The history of the Roman Empire began",
    "import numpy as np\n\n# Compute the mean of an array\n",
    "My favourite recipe for pancakes starts with",
]
NEW_TOKENS = 64
LOGIT_STRIDE = 97
TOP_LOGITS = 64


def dequantize_to_f32(src, dst):
    """Writes `src` with every tensor dequantized to F32, metadata unchanged."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def run(model_path):
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
        print(f"{prompt[:40]!r}: {len(ids)} prompt tokens, {len(generated)} generated",
              file=sys.stderr)
    return cases


def main():
    model_path = sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    out_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_llamacpp.json")
    with tempfile.TemporaryDirectory() as tmp:
        f32_path = os.path.join(tmp, "smollm2-f32.gguf")
        dequantize_to_f32(model_path, f32_path)
        f32_cases = run(f32_path)
    golden = {
        "generator": "llama-cpp-python " + llama_cpp.__version__ + ", gguf-py " +
                     getattr(gguf, "__version__", "?"),
        "model": os.path.basename(model_path),
        "new_tokens": NEW_TOKENS,
        "logit_stride": LOGIT_STRIDE,
        "f32": f32_cases,
        "q4_1": run(model_path),
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()

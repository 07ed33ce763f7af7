#!/usr/bin/env python3
"""llama.cpp's prefill and decode tokens/s through llama-cpp-python's low-level API, measured the
way `kvshard bench-engine` measures kvshard: `batch` sequences of `prompt` pseudo-random tokens
prefilled in one llama_decode call, then `decode` steps of one token per sequence (greedy).
Prints one JSON object like `kvshard bench-engine --json`. Used by scripts/bench-engine.
"""
import argparse
import ctypes
import json
import statistics
import sys
import time

import llama_cpp as L


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    # Silence llama.cpp's load-time log (it goes to stderr, which scripts/bench-engine keeps).
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(a.model.encode(), mparams)
    if not model:
        sys.exit(f"llama.cpp could not load {a.model}")
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    max_batch = max(a.batch)
    cparams = L.llama_context_default_params()
    cparams.n_ctx = max_batch * (a.prompt_tokens + a.decode_tokens)
    cparams.n_batch = max_batch * a.prompt_tokens
    cparams.n_ubatch = max_batch * a.prompt_tokens
    cparams.n_seq_max = max_batch
    cparams.n_threads = a.threads
    cparams.n_threads_batch = a.threads
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        sys.exit("llama.cpp could not create a context")
    batch = L.llama_batch_init(max_batch * a.prompt_tokens, 0, 1)

    state = 0x9E3779B97F4A7C15
    prompts = []
    for _ in range(max_batch):
        p = []
        for _ in range(a.prompt_tokens):
            state = (state * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
            p.append((state >> 33) % vocab)
        prompts.append(p)

    def fill(entries):
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if want else 0

    def argmax_row(i):
        row = L.llama_get_logits_ith(ctx, i)
        arr = (ctypes.c_float * vocab).from_address(ctypes.addressof(row.contents))
        return max(range(vocab), key=arr.__getitem__)

    results = []
    for b in a.batch:
        pre, dec = [], []
        for _ in range(a.runs):
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            fill([(prompts[s][i], i, s, i == a.prompt_tokens - 1)
                  for s in range(b) for i in range(a.prompt_tokens)])
            t0 = time.perf_counter()
            if L.llama_decode(ctx, batch) != 0:
                sys.exit("llama_decode failed (prefill)")
            pre.append(b * a.prompt_tokens / (time.perf_counter() - t0))
            nxt = [argmax_row(s * a.prompt_tokens + a.prompt_tokens - 1) for s in range(b)]
            spent = 0.0
            for step in range(a.decode_tokens):
                fill([(nxt[s], a.prompt_tokens + step, s, True) for s in range(b)])
                t0 = time.perf_counter()
                if L.llama_decode(ctx, batch) != 0:
                    sys.exit("llama_decode failed (decode)")
                spent += time.perf_counter() - t0
                nxt = [argmax_row(s) for s in range(b)]
            dec.append(b * a.decode_tokens / spent)
        results.append({"batch": b, "prompt_tokens": a.prompt_tokens, "decode_tokens": a.decode_tokens,
                        "prefill_tokens_per_second": statistics.median(pre),
                        "decode_tokens_per_second": statistics.median(dec),
                        "prefill_runs": pre, "decode_runs": dec})
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    print(json.dumps({"engine": "llama.cpp (llama-cpp-python " + L.__version__ + ")",
                      "threads": a.threads, "results": results}))


if __name__ == "__main__":
    main()

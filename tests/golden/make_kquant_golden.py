#!/usr/bin/env python3
"""Regenerates tests/golden/kquant_golden.json: random GGUF quant blocks and their dequantized
values by gguf-py (PyPI `gguf`, llama.cpp's own Python package, whose numpy dequantizers in
gguf.quants are an implementation independent of kvshard's).

For each type (Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; gguf-py has no Q8_K dequantizer, and
Q8_K, one f32 scale times int8, is checked by hand in the C++ test) it draws the bytes of a few
blocks at random, then overwrites each block's fp16 scale fields (d, dmin)
with finite values, so that random bits give no NaN or infinity, and records the bytes (hex) and
gguf-py's dequantization (float32 values, written exactly). tests/model/kquant_golden_test.cc
dequantizes the same bytes with kvshard's DequantizeRow and compares.

    pip install gguf numpy
    python3 tests/golden/make_kquant_golden.py > tests/golden/kquant_golden.json
"""
import importlib.metadata
import json
import sys

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

# Offsets (bytes inside one block) of the fp16 scale fields, from ggml's block structures.
HALF_FIELDS = {
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}
BLOCKS = {T.Q5_0: 8, T.Q5_1: 8}  # K-quants: 2 super-blocks of 256


def main():
    rng = np.random.default_rng(20261201)
    out = {"source": "gguf-py " + importlib.metadata.version("gguf"), "types": {}}
    for t in [T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]:
        block_elems, block_bytes = GGML_QUANT_SIZES[t]
        blocks = BLOCKS.get(t, 2)
        raw = bytearray(rng.integers(0, 256, size=blocks * block_bytes, dtype=np.uint8).tobytes())
        for b in range(blocks):
            base = b * block_bytes
            for off in HALF_FIELDS[t]:
                raw[base + off:base + off + 2] = np.float16(rng.uniform(-0.1, 0.1)).tobytes()
        data = np.frombuffer(bytes(raw), dtype=np.uint8).reshape(1, blocks * block_bytes)
        values = dequantize(data, t).astype(np.float32).reshape(-1)
        assert values.size == blocks * block_elems and np.all(np.isfinite(values))
        out["types"][t.name] = {
            "cols": int(values.size),
            "bytes": bytes(raw).hex(),
            "values": [float(v) for v in values],
        }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

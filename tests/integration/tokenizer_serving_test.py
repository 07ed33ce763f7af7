#!/usr/bin/env python3
"""Serving the tokenizer to benchmark clients, and `kvshard serve`'s vLLM-spelled flags.

The Hugging Face tokenizer.json that GET /v1/models/{id}/tokenizer serves, loaded with the
`tokenizers` package, encodes a set of texts (English, code, unicode and emoji, the chat markers)
to exactly the ids kvshard's own POST /tokenize returns, for the default model (byte-level BPE)
and for stories260K (SentencePiece-style); `kvshard convert --tokenizer-only` writes the same
files. On the default model the flags are checked through the server: --served-model-name (both
names listed and accepted, answers carry the first; the tokenizer under the "org/name" id that
benchmark clients send), --api-key (401 without it), --max-model-len (/v1/models says it, longer
prompts get 400) and --kv-cache-dtype; and the load progress lines. Exits 77 when `tokenizers` or
a model is missing.

    python3 tests/integration/tokenizer_serving_test.py --kvshard build/kvshard \
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --stories /work/shared/models/stories260K/stories260K.gguf
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvshard_server import Server, report, test_main  # noqa: E402

KEY = "test-key-1"
HF_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tx = {'a': [1, 2]}",
    "  leading spaces, trailing  ",
    "naïve café, Ünïcödé, 日本語のテキスト, Ελληνικά, emoji 🦙🚀👍🏽 and 1234567890",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "line one\r\nline two\n\n\nthree",
]


class KeyedServer(Server):
    """Server whose requests carry an API key (the base class asks /v1/models at start)."""

    def __init__(self, *args, api_key=None, **kwargs):
        self.api_key = api_key
        super().__init__(*args, **kwargs)

    def http(self, method, path, body=None, timeout=120, key=True):
        headers = {"Content-Type": "application/json"}
        if key and self.api_key:
            headers["Authorization"] = "Bearer " + self.api_key
        req = urllib.request.Request(self.url + path, method=method, headers=headers,
                                     data=json.dumps(body).encode() if body is not None else None)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


def check_tokenizer(server, model_id, what, failures):
    """The served tokenizer.json encodes TEXTS as POST /tokenize does; returns its text."""
    import tokenizers
    quoted = urllib.request.quote(model_id, safe="/")
    status, text = server.http("GET", f"/v1/models/{quoted}/tokenizer")
    if status != 200:
        failures.append(f"{what}: GET tokenizer: {status} {text[:300]}")
        return None
    tok = tokenizers.Tokenizer.from_str(text)
    for t in TEXTS:
        status, body = server.http("POST", "/tokenize", {"model": model_id, "prompt": t})
        if status != 200:
            failures.append(f"{what}: /tokenize {t!r}: {status} {body}")
            continue
        want = json.loads(body)["tokens"]
        got = tok.encode(t).ids
        if got != want:
            failures.append(f"{what}: {t!r}: tokenizers {got}, kvshard {want}")
    status, config = server.http("GET", f"/v1/models/{quoted}/tokenizer_config")
    if status != 200:
        failures.append(f"{what}: GET tokenizer_config: {status} {config[:300]}")
    else:
        c = json.loads(config)
        for key in ("bos_token", "eos_token"):
            if c.get(key) is not None and tok.token_to_id(c[key]) is None:
                failures.append(f"{what}: tokenizer_config {key} {c[key]!r} is not a token")
    return text


def check_convert(args, model, served_text, what, failures):
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run([args.kvshard, "convert", "--tokenizer-only", "--model", model,
                            "--out", out], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            failures.append(f"{what}: convert --tokenizer-only: {r.returncode} {r.stderr}")
            return
        files = sorted(os.listdir(out))
        if files != ["tokenizer.json", "tokenizer_config.json"]:
            failures.append(f"{what}: convert --tokenizer-only wrote {files}")
        with open(os.path.join(out, "tokenizer.json"), encoding="utf-8") as f:
            if served_text is not None and f.read() != served_text:
                failures.append(f"{what}: convert's tokenizer.json differs from the served one")


def check_default_model(args, failures):
    server = KeyedServer(args.kvshard, args.model,
                         ["--served-model-name", HF_NAME, "smol", "--api-key", KEY,
                          "--max-model-len", "64", "--kv-dtype", "int8"],
                         log_level="info", api_key=KEY)
    try:
        log = "".join(server.log)
        if not re.search(r"model loaded in \d+\.\d\d s", log):
            failures.append("no 'model loaded in S s' line in the log:\n" + log)
        if "KV blocks" not in log:
            failures.append("no instance line in the log:\n" + log)
        status, text = server.http("GET", "/v1/models")
        data = json.loads(text)["data"] if status == 200 else []
        if [m["id"] for m in data] != [HF_NAME, "smol"] or data[0]["max_model_len"] != 64:
            failures.append(f"/v1/models: {status} {text}")
        status, _ = server.http("GET", "/v1/models", key=False)
        if status != 401:
            failures.append(f"/v1/models without the key: {status}, expected 401")
        status, text = server.http("POST", "/v1/completions", {
            "model": "smol", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
            key=False)
        if status != 401:
            failures.append(f"completion without the key: {status}, expected 401")
        status, text = server.http("POST", "/v1/completions", {
            "model": "smol", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
        if status != 200 or json.loads(text)["model"] != HF_NAME:
            failures.append(f"completion naming 'smol': {status} {text}")
        status, text = server.http("POST", "/v1/completions", {
            "model": "nope", "prompt": "x", "max_tokens": 1})
        if status != 404 or f"'{HF_NAME}' (also named 'smol')" not in text:
            failures.append(f"unknown model: {status} {text}")
        status, text = server.http("POST", "/v1/completions", {
            "model": HF_NAME, "prompt": "word " * 80, "max_tokens": 4})
        if status != 400 or "64" not in text:
            failures.append(f"an 80-token prompt with --max-model-len 64: {status} {text}")
        served = check_tokenizer(server, HF_NAME, "default model", failures)
    finally:
        server.stop()
    check_convert(args, args.model, served, "default model", failures)


def check_stories(args, failures):
    server = Server(args.kvshard, args.stories, ["--kv-dtype", "bf16"])
    try:
        served = check_tokenizer(server, server.model, "stories260K", failures)
        # Served with bf16 KV (a pool of 2-byte elements): completions run.
        status, text = server.complete("Once upon a time", max_tokens=8)
        if status != 200 or not text:
            failures.append(f"stories260K: a completion with bf16 KV: {status} {text}")
    finally:
        server.stop()
    check_convert(args, args.stories, served, "stories260K", failures)


def check_cli(args, failures):
    readme = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")
    r = subprocess.run([args.kvshard, "serve", "--model", readme], capture_output=True,
                       text=True, timeout=60)
    want = "README.md: not a model file (expected GGUF, a llama2.c .bin checkpoint or a " \
           "Hugging Face folder)"
    if r.returncode == 0 or want not in r.stderr:
        failures.append(f"serve --model README.md: {r.returncode} {r.stderr}")
    # Every KV dtype the planner sizes is stored by the pools: the 16-bit ones generate text.
    for dtype in ("bf16", "fp16"):
        r = subprocess.run([args.kvshard, "generate", "--model", args.model, "--kv-dtype", dtype,
                            "--prompt", "Once upon a time", "--max-tokens", "8"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0 or not r.stdout.strip():
            failures.append(f"generate --kv-dtype {dtype}: {r.returncode} {r.stderr}")
    r = subprocess.run([args.kvshard, "serve", "--model", args.model, "--kv-dtype", "fp12"],
                       capture_output=True, text=True, timeout=60)
    if r.returncode == 0 or "flag --kv-cache-dtype: kv_cache.dtype: invalid value 'fp12'" \
            not in r.stderr:
        failures.append(f"serve --kv-dtype fp12: {r.returncode} {r.stderr}")
    r = subprocess.run([args.kvshard, "serv"], capture_output=True, text=True, timeout=60)
    if r.returncode != 2 or "did you mean 'serve'?" not in r.stderr:
        failures.append(f"kvshard serv: {r.returncode} {r.stderr}")


def run(args):
    failures = []
    check_cli(args, failures)
    check_default_model(args, failures)
    check_stories(args, failures)
    return report(failures)


def main():
    return test_main(run, lambda parser: parser.add_argument("--stories", required=True),
                     packages=("tokenizers",), files=lambda args: [args.model, args.stories])


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""`kvshard serve` on a GGUF whose tokenizer.chat_template is Qwen 2.5's real template (the
default model's file with that one metadata value replaced) runs the template in kvshard's Jinja
interpreter: the chat prompt is the one Python's jinja2 renders for the same conversation
(tests/model/chat_templates/renders.json), checked as token ids through /tokenize, and with tools,
tool calls and tool results through /v1/chat/completions (usage.prompt_tokens). A
cache_control breakpoint is refused by name. Standard library only.

    python3 tests/integration/jinja_template_test.py --kvshard build/kvshard \
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf --templates tests/model/chat_templates
"""
import json
import os
import struct
import sys
import tempfile

from kvshard_server import Server, report, test_main

TEMPLATE = "Qwen-Qwen2.5-7B-Instruct.jinja"

# GGUF value types whose size is fixed.
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4


class Reader:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, n):
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def u32(self):
        return struct.unpack("<I", self.take(4))[0]

    def u64(self):
        return struct.unpack("<Q", self.take(8))[0]

    def string(self):
        return self.take(self.u64())

    def skip_value(self, vtype):
        if vtype in FIXED:
            self.take(FIXED[vtype])
        elif vtype == STRING:
            self.string()
        elif vtype == ARRAY:
            etype, count = self.u32(), self.u64()
            for _ in range(count):
                self.skip_value(etype)
        else:
            raise ValueError(f"GGUF value type {vtype}")


def gguf_string(b):
    return struct.pack("<Q", len(b)) + b


def with_chat_template(src, dst, template):
    """Copies the GGUF `src` to `dst` with tokenizer.chat_template set to `template`."""
    with open(src, "rb") as f:
        data = f.read()
    r = Reader(data)
    assert r.take(4) == b"GGUF"
    version, n_tensors, n_kv = r.u32(), r.u64(), r.u64()
    kvs, alignment = [], 32
    for _ in range(n_kv):
        start = r.pos
        key = r.string()
        vtype = r.u32()
        value_at = r.pos
        r.skip_value(vtype)
        if key == b"general.alignment":
            alignment = struct.unpack("<I", data[value_at:value_at + 4])[0]
        if key != b"tokenizer.chat_template":
            kvs.append(data[start:r.pos])
    kvs.append(gguf_string(b"tokenizer.chat_template") + struct.pack("<I", STRING) +
               gguf_string(template.encode()))
    infos_start = r.pos
    for _ in range(n_tensors):
        r.string()
        dims = r.u32()
        r.take(8 * dims + 4 + 8)
    infos = data[infos_start:r.pos]
    data_start = (r.pos + alignment - 1) // alignment * alignment
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kvs)) + b"".join(kvs) + infos
    head += b"\0" * ((alignment - len(head) % alignment) % alignment)
    with open(dst, "wb") as f:
        f.write(head)
        f.write(data[data_start:])


def api_message(m):
    """A conversation message of renders.json as an OpenAI client sends it."""
    out = {"role": m["role"], "content": m["content"]}
    if m.get("tool_calls"):
        out["content"] = None
        out["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
            "name": c["function"]["name"],
            "arguments": json.dumps(c["function"]["arguments"])}} for c in m["tool_calls"]]
    if "tool_call_id" in m:
        out["tool_call_id"] = m["tool_call_id"]
    return out


def run(args):
    with open(os.path.join(args.templates, "renders.json"), encoding="utf-8") as f:
        golden = json.load(f)
    with open(os.path.join(args.templates, TEMPLATE), encoding="utf-8") as f:
        template = f.read()

    def expected(conversation):
        return next(r["text"] for r in golden["renders"] if r["template"] == TEMPLATE and
                    r["conversation"] == conversation and r["add_generation_prompt"])

    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "qwen-template.gguf")
        with_chat_template(args.model, model, template)
        server = Server(args.kvshard, model, ["--set", "scheduler.max_model_len=1024"],
                        log_level="info")
        try:
            log = "".join(server.log)
            if "running the template itself" not in log:
                failures.append("the log does not say the template is interpreted:\n" + log)

            def tokenize(body):
                status, text = server.http("POST", "/tokenize", body)
                return json.loads(text)["tokens"] if status == 200 else f"{status} {text}"

            # Plain chat: the same ids as jinja2's text.
            conv = golden["conversations"]["system_multi_turn"]
            got = tokenize({"messages": conv["messages"]})
            want = tokenize({"prompt": expected("system_multi_turn")})
            if got != want:
                failures.append(f"chat prompt ids {got}, jinja2's text gives {want}")

            # Tools, a tool call and its result, through the chat route.
            conv = golden["conversations"]["api_tools"]
            want = tokenize({"prompt": expected("api_tools")})
            status, text = server.http("POST", "/v1/chat/completions", {
                "model": server.model, "max_tokens": 1, "temperature": 0,
                "tools": conv["tools"], "messages": [api_message(m) for m in conv["messages"]]})
            if status != 200:
                failures.append(f"chat with tools: {status} {text}")
            elif json.loads(text)["usage"]["prompt_tokens"] != len(want):
                failures.append(f"chat with tools used {json.loads(text)['usage']} prompt "
                                f"tokens, jinja2's text is {len(want)}")

            # Breakpoints have no one place in an interpreted template's prompt.
            status, text = server.http("POST", "/v1/chat/completions", {
                "model": server.model, "max_tokens": 1, "messages": [{
                    "role": "user", "content": [{"type": "text", "text": "Hi",
                                                 "cache_control": {"type": "ephemeral"}}]}]})
            if status != 400 or "cache_control" not in text:
                failures.append(f"a cache_control breakpoint got {status} {text}")
            print(f"checked: chat ids, tools prompt of {len(want)} tokens, breakpoint refused")
        finally:
            server.stop()
    return report(failures)


def main():
    return test_main(run, lambda parser: parser.add_argument("--templates", required=True))


if __name__ == "__main__":
    sys.exit(main())

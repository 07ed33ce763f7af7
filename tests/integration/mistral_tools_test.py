#!/usr/bin/env python3
"""`kvshard serve` on a GGUF whose tokenizer.chat_template is Mistral Nemo's real template (the
default model's file with that one metadata value replaced): a chat request with tools and a
named tool_choice comes back as a parsed tool call (constrained decoding writes Mistral's call
array), its id is the 9 letters and digits the template takes, and the call and its result go
back through the template. Standard library only.

    python3 tests/integration/mistral_tools_test.py --kvshard build/kvshard \
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf --templates tests/model/chat_templates
"""
import json
import os
import sys
import tempfile

from jinja_template_test import with_chat_template
from kvshard_server import Server, report, test_main

TEMPLATE = "mistralai-Mistral-Nemo-Instruct-2407.jinja"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather now",
    "parameters": {"type": "object", "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"], "additionalProperties": False}}}]


def run(args):
    with open(os.path.join(args.templates, TEMPLATE), encoding="utf-8") as f:
        template = f.read()

    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "mistral-template.gguf")
        with_chat_template(args.model, model, template)
        # One CPU thread: the two requests are ~1.5 s of work, and on a loaded CI machine a second
        # OpenMP thread spins at every barrier (7.6 s of CPU for the first request instead of 1.1 s),
        # taking cores from the test that ctest -j2 runs beside this one.
        server = Server(args.kvshard, model,
                        ["--set", "scheduler.max_model_len=1024", "--threads", "1"])
        try:
            user = {"role": "user", "content": "What is the weather?"}
            status, text = server.http("POST", "/v1/chat/completions", {
                "model": server.model, "max_tokens": 40, "temperature": 0, "tools": TOOLS,
                "messages": [user],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
            calls = json.loads(text)["choices"][0]["message"].get("tool_calls") \
                if status == 200 else None
            if not calls:
                failures.append(f"named tool_choice: {status} {text}")
            else:
                call = calls[0]
                args_ = json.loads(call["function"]["arguments"])
                if call["function"]["name"] != "get_weather" or \
                        args_.get("unit") not in ("celsius", "fahrenheit"):
                    failures.append(f"the call is {call}")
                if len(call["id"]) != 9 or not call["id"].isalnum():
                    failures.append(f"the call id {call['id']!r} is not 9 letters and digits")
                # The call and its result go back through the template.
                status, text = server.http("POST", "/v1/chat/completions", {
                    "model": server.model, "max_tokens": 1, "tools": TOOLS, "messages": [
                        user, {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"], "content": "18"}]})
                if status != 200:
                    failures.append(f"the call sent back: {status} {text}")
                print(f"checked: {call['function']['name']}({call['function']['arguments']}) "
                      f"id {call['id']}, sent back: {status}")
        finally:
            server.stop()
    return report(failures)


def main():
    return test_main(run, lambda parser: parser.add_argument("--templates", required=True))


if __name__ == "__main__":
    sys.exit(main())

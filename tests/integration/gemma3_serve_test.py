#!/usr/bin/env python3
"""`kvshard serve --model models/gemma-3-270m-q4_k_m.gguf` answers chat (skipped, exit 77, when
scripts/fetch-gemma3 has not fetched the file). The file carries no chat template, so the server
chats in the built-in Gemma turn format chosen by its architecture and says so in its log; the
chat prompt's token ids are llama.cpp's for the same text (tests/golden/gemma3_llamacpp.json), and
the chat answer is the completion of those ids. Standard library only.

    python3 tests/integration/gemma3_serve_test.py --kvshard build/kvshard \
        --model models/gemma-3-270m-q4_k_m.gguf --golden tests/golden/gemma3_llamacpp.json
"""
import json
import sys

from kvshard_server import Server, report, test_main

MAX_TOKENS = 8


def run(args):
    with open(args.golden, encoding="utf-8") as f:
        golden = json.load(f)
    question = "What is 12 + 35?"
    want_ids = next(c["prompt_token_ids"] for c in golden["cases"]
                    if c["prompt"] == f"<start_of_turn>user\n{question}<end_of_turn>\n"
                                      "<start_of_turn>model\n")
    messages = [{"role": "user", "content": question}]
    server = Server(args.kvshard, args.model, ["--set", "scheduler.max_model_len=256"],
                    log_level="info")
    failures = []
    try:
        log = "".join(server.log)
        if "built-in 'gemma' template" not in log:
            failures.append("the log does not name the built-in gemma template:\n" + log)
        status, text = server.http("POST", "/tokenize", {"messages": messages})
        ids = json.loads(text)["tokens"] if status == 200 else None
        if ids != want_ids:
            failures.append(f"chat prompt ids {ids} ({status}), llama.cpp's {want_ids}")
        status, text = server.http("POST", "/v1/chat/completions", {
            "model": server.model, "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0})
        if status != 200:
            failures.append(f"chat: {status} {text}")
        else:
            chat = json.loads(text)
            content = chat["choices"][0]["message"]["content"]
            if chat["usage"]["prompt_tokens"] != len(want_ids):
                failures.append(f"chat usage {chat['usage']}, prompt of {len(want_ids)} tokens")
            status, completion = server.http("POST", "/v1/completions", {
                "model": server.model, "prompt": want_ids, "max_tokens": MAX_TOKENS,
                "temperature": 0})
            completion = json.loads(completion)["choices"][0]["text"] if status == 200 else None
            if not completion or not completion.startswith(content):
                failures.append(f"chat answered {content!r}, the completion of its prompt ids is "
                                f"{completion!r}")
            print(f"chat: {content!r} ({chat['choices'][0]['finish_reason']})")
    finally:
        server.stop()
    return report(failures)


def main():
    return test_main(run, lambda parser: parser.add_argument("--golden", required=True),
                     hint="run scripts/fetch-gemma3")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Integration tests of `kvshard serve` with real clients: curl and the official `openai` package.

Starts the server on an ephemeral loopback port with stories260K (fast), then checks streaming and
non-streaming completions and chats, 64 concurrent greedy streams against the same requests served
alone, error bodies for bad input, a client that disconnects mid-stream, and that afterwards every
KV block is free or cached (kvshard:kv_cache_usage_perc is 0).

    tests/integration/server_test.py --kvshard build/cli/kvshard --model ../shared/models/stories260K/stories260K.bin
Exit code 77 (ctest SKIP_RETURN_CODE) when the model or the openai package is absent.
"""
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
import unittest
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvshard_server import Server, unittest_main  # noqa: E402

ARGS = None
SERVER = None


def start_server(extra=()):
    return Server(ARGS.kvshard, ARGS.model, list(extra))


def http(method, path, body=None, headers=None, raw=None):
    url = SERVER.url + path
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(name):
    _, text = http("GET", "/metrics")
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metric("kvshard:num_requests_running") == 0 and metric("kvshard:kv_cache_usage_perc") == 0:
            return True
        time.sleep(0.05)
    return False


class ServerTest(unittest.TestCase):
    model = None

    @classmethod
    def setUpClass(cls):
        import openai
        cls.client = openai.OpenAI(base_url=SERVER.url + "/v1", api_key="unused")
        cls.model = cls.client.models.list().data[0].id

    def complete(self, prompt, max_tokens=24, **kw):
        return self.client.completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens,
                                              temperature=0, **kw)

    def test_completion_matches_reference_text(self):
        r = self.complete("Once upon a time", max_tokens=12)
        self.assertTrue(r.choices[0].text.startswith(", there was a little girl named Lily."), r.choices[0].text)
        self.assertEqual(r.usage.prompt_tokens, 5)
        self.assertEqual(r.usage.completion_tokens, 12)
        self.assertEqual(r.choices[0].finish_reason, "length")

    def test_streaming_equals_non_streaming(self):
        full = self.complete("The dog", max_tokens=30).choices[0].text
        stream = self.client.completions.create(model=self.model, prompt="The dog", max_tokens=30,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        parts, usage = [], None
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].text)
            if chunk.usage:
                usage = chunk.usage
        self.assertEqual("".join(parts), full)
        self.assertIsNotNone(usage)
        self.assertEqual(usage.completion_tokens, 30)

    def test_curl_stream_ends_with_done(self):
        out = subprocess.run(["curl", "-sN", SERVER.url + "/v1/completions", "-H", "Content-Type: application/json",
                              "-d", json.dumps({"model": self.model, "prompt": "Tom", "max_tokens": 5,
                                                "stream": True})],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        events = [e for e in out.split("\n\n") if e.strip()]
        self.assertEqual(events[-1], "data: [DONE]")
        for e in events[:-1]:
            self.assertTrue(e.startswith("data: {"), e)
            json.loads(e[len("data: "):])

    def test_n_and_logprobs(self):
        r = self.client.completions.create(model=self.model, prompt="Lily", max_tokens=6, n=3,
                                           temperature=1.0, seed=11, logprobs=2)
        self.assertEqual(len(r.choices), 3)
        for c in r.choices:
            self.assertEqual(len(c.logprobs.tokens), 6)
            self.assertEqual(len(c.logprobs.top_logprobs[0]), 2)
            self.assertTrue(all(lp <= 0 for lp in c.logprobs.token_logprobs))
        again = self.client.completions.create(model=self.model, prompt="Lily", max_tokens=6, n=3,
                                               temperature=1.0, seed=11)
        self.assertEqual([c.text for c in r.choices], [c.text for c in again.choices])

    def test_stop_string(self):
        r = self.complete("Once upon a time", max_tokens=40, stop=["Lily"])
        self.assertEqual(r.choices[0].text, ", there was a little girl named ")
        self.assertEqual(r.choices[0].finish_reason, "stop")

    def token_id(self, text):
        status, body = http("POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
        self.assertEqual(status, 200, body)
        return json.loads(body)["tokens"][0]

    def test_sampling_controls(self):
        # logit_bias, stop_token_ids, min_tokens, the penalties, include_stop_str_in_output and
        # logprobs up to 20 are obeyed (each was once refused or silently ignored).
        x = self.token_id("dog")
        r = self.complete("Once upon a time", max_tokens=4, logprobs=0, logit_bias={str(x): 100})
        tokens = r.choices[0].logprobs.tokens
        self.assertEqual(len(tokens), 4)
        self.assertEqual(len(set(tokens)), 1, tokens)
        r = self.complete("Once upon a time", max_tokens=8, logit_bias={str(x): 100},
                          extra_body={"stop_token_ids": [x]})
        self.assertEqual((r.choices[0].finish_reason, r.usage.completion_tokens), ("stop", 1))
        status, piece = http("POST", "/detokenize", {"tokens": [x]})
        self.assertEqual(status, 200, piece)
        # A plain (not control) stop token joins the text, as in vLLM.
        self.assertEqual(r.choices[0].text.strip(), json.loads(piece)["prompt"].strip())
        r = self.complete("Once upon a time", max_tokens=8, logit_bias={str(x): 100},
                          extra_body={"stop_token_ids": [x], "min_tokens": 3})
        self.assertEqual((r.choices[0].finish_reason, r.usage.completion_tokens), ("stop", 4))
        base = self.complete("Once upon a time", max_tokens=40).choices[0].text
        for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                        {"extra_body": {"repetition_penalty": 1.8}}):
            text = self.complete("Once upon a time", max_tokens=40, **penalty).choices[0].text
            self.assertNotEqual(text, base, penalty)
        words = base.split()
        stop = words[len(words) // 2]
        without = self.complete("Once upon a time", max_tokens=40, stop=[stop]).choices[0].text
        with_stop = self.complete("Once upon a time", max_tokens=40, stop=[stop],
                                  extra_body={"include_stop_str_in_output": True}).choices[0].text
        self.assertEqual(with_stop, without + stop)
        r = self.complete("Lily", max_tokens=2, logprobs=20)
        self.assertEqual(len(r.choices[0].logprobs.top_logprobs[0]), 20)
        # guided_regex is served now (structured_output_test.py); a second constraint beside it is
        # refused, naming the field.
        status, body = http("POST", "/v1/completions",
                            {"prompt": "a", "guided_regex": "a+", "guided_choice": ["a", "b"]})
        self.assertEqual(status, 400, body)
        self.assertIn("guided_", json.loads(body)["error"]["message"], body)

    def test_64_concurrent_streams_equal_alone(self):
        prompts = [f"Once upon a time {'and then ' * (i % 5)}the {w}"
                   for i, w in enumerate(["cat", "dog", "bird", "girl", "boy", "sun", "tree", "ball"] * 8)]
        alone = {}
        for p in set(prompts):
            alone[p] = self.complete(p, max_tokens=32).choices[0].text

        def stream(p):
            s = self.client.completions.create(model=self.model, prompt=p, max_tokens=32, temperature=0,
                                               stream=True)
            return "".join(c.choices[0].text for c in s if c.choices)

        with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
            results = list(pool.map(stream, prompts))
        for p, text in zip(prompts, results):
            self.assertEqual(text, alone[p], p)
        self.assertTrue(wait_idle(), "KV blocks still in use after every request finished")

    def test_chat_completion(self):
        import openai
        # stories260K has no chat template: a clear 400 saying how to give one.
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        self.assertIn("--chat-template", str(ctx.exception))
        # With one given, chat works, streaming and not.
        server = start_server(["--chat-template", "llama2"])
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
            msgs = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A cat"}]
            r = client.chat.completions.create(model=self.model, messages=msgs, max_tokens=8, temperature=0)
            self.assertEqual(r.choices[0].message.role, "assistant")
            self.assertEqual(r.usage.completion_tokens, 8)
            stream = client.chat.completions.create(model=self.model, messages=msgs, max_tokens=8,
                                                    temperature=0, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            self.assertEqual(text, r.choices[0].message.content)
            # OpenAI's developer role is the system role of newer models.
            dev = [{"role": "developer", "content": "Tell a story."}, msgs[1]]
            d = client.chat.completions.create(model=self.model, messages=dev, max_tokens=8, temperature=0)
            self.assertEqual(d.choices[0].message.content, r.choices[0].message.content)
        finally:
            server.stop()

    def test_list_of_prompts(self):
        # LangChain's batch and lm-eval's local-completions send several prompts at once: one
        # choice per prompt and n, numbered prompt * n + j, usage summed, streamed too.
        prompts = ["Once upon a time", "The dog"]
        alone = [self.complete(p, max_tokens=8) for p in prompts]
        r = self.complete(prompts, max_tokens=8, n=2)
        self.assertEqual([c.index for c in r.choices], [0, 1, 2, 3])
        self.assertEqual([c.text for c in r.choices],
                         [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2)
        self.assertEqual(r.usage.prompt_tokens, sum(a.usage.prompt_tokens for a in alone))
        self.assertEqual(r.usage.completion_tokens, 32)
        ids = []
        for p in prompts:
            status, body = http("POST", "/tokenize", {"prompt": p})
            self.assertEqual(status, 200, body)
            ids.append(json.loads(body)["tokens"])
        by_ids = self.complete(ids, max_tokens=8)
        self.assertEqual([c.text for c in by_ids.choices], [a.choices[0].text for a in alone])
        stream = self.client.completions.create(model=self.model, prompt=prompts, max_tokens=8,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        texts, usage = {}, None
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
            if chunk.usage:
                usage = chunk.usage
        self.assertEqual(texts, {0: alone[0].choices[0].text, 1: alone[1].choices[0].text})
        self.assertEqual(usage.completion_tokens, 16)
        # echo: the prompt's text opens each choice (with logprobs: prompt_logprobs_test.py).
        echoed = self.complete(prompts, max_tokens=8, echo=True)
        self.assertEqual([c.text for c in echoed.choices],
                         [p + a.choices[0].text for p, a in zip(prompts, alone)])

    def test_cors(self):
        server = start_server(["--set", "server.cors_allowed_origins=http://page.example"])
        try:
            def ask(method, headers, body=None):
                req = urllib.request.Request(server.url + "/v1/completions", method=method,
                                             data=json.dumps(body).encode() if body else None,
                                             headers={"Content-Type": "application/json", **headers})
                try:
                    with urllib.request.urlopen(req, timeout=60) as r:
                        return r.status, r.headers
                except urllib.error.HTTPError as e:
                    return e.code, e.headers
            status, h = ask("OPTIONS", {"Origin": "http://page.example",
                                        "Access-Control-Request-Method": "POST",
                                        "Access-Control-Request-Headers": "authorization,content-type"})
            self.assertEqual(status, 204)
            self.assertEqual(h["Access-Control-Allow-Origin"], "http://page.example")
            self.assertEqual(h["Access-Control-Allow-Headers"], "authorization,content-type")
            self.assertIn("POST", h["Access-Control-Allow-Methods"])
            status, h = ask("POST", {"Origin": "http://page.example"},
                            {"prompt": "Tom", "max_tokens": 2})
            self.assertEqual((status, h["Access-Control-Allow-Origin"]), (200, "http://page.example"))
            status, h = ask("POST", {"Origin": "http://page.example"}, {"prompt": 5})
            self.assertEqual((status, h["Access-Control-Allow-Origin"]), (400, "http://page.example"))
            status, h = ask("POST", {"Origin": "http://elsewhere.example"},
                            {"prompt": "Tom", "max_tokens": 2})
            self.assertEqual(status, 200)
            self.assertIsNone(h["Access-Control-Allow-Origin"])
        finally:
            server.stop()
        # Off by default: no CORS headers, OPTIONS is not a method of the route.
        status, _ = http("OPTIONS", "/v1/completions", headers={
            "Origin": "http://page.example", "Access-Control-Request-Method": "POST"})
        self.assertEqual(status, 405)

    def test_responses_api_and_chat_role_chunk(self):
        import openai
        server = start_server(["--chat-template", "llama2"])
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
            msgs = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A cat"}]
            chat = client.chat.completions.create(model=self.model, messages=msgs, max_tokens=8,
                                                  temperature=0)
            # The first streamed chat chunk is the role, as vLLM sends it.
            chunks = list(client.chat.completions.create(model=self.model, messages=msgs,
                                                         max_tokens=8, temperature=0, stream=True))
            self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
            self.assertEqual(chunks[0].choices[0].delta.content, "")
            r = client.responses.create(model=self.model, instructions="Tell a story.", input="A cat",
                                        max_output_tokens=8, temperature=0)
            self.assertEqual(r.object, "response")
            self.assertEqual(r.output_text, chat.choices[0].message.content)
            self.assertEqual(r.output[0].content[0].type, "output_text")
            self.assertEqual(r.status, "incomplete")
            self.assertEqual(r.incomplete_details.reason, "max_output_tokens")
            self.assertEqual((r.usage.input_tokens, r.usage.output_tokens),
                             (chat.usage.prompt_tokens, 8))
            listed = client.responses.create(
                model=self.model, temperature=0, max_output_tokens=8,
                input=[{"role": "system", "content": "Tell a story."},
                       {"role": "user", "content": [{"type": "input_text", "text": "A cat"}]}])
            self.assertEqual(listed.output_text, r.output_text)
            events = list(client.responses.create(model=self.model, instructions="Tell a story.",
                                                  input="A cat", max_output_tokens=8, temperature=0,
                                                  stream=True))
            types = [e.type for e in events]
            self.assertEqual(types[:2], ["response.created", "response.in_progress"])
            self.assertEqual(types[-1], "response.incomplete")
            self.assertIn("response.output_text.done", types)
            self.assertEqual("".join(e.delta for e in events if e.type == "response.output_text.delta"),
                             r.output_text)
            self.assertEqual(events[-1].response.output_text, r.output_text)
            with self.assertRaises(openai.BadRequestError) as ctx:
                client.responses.create(model=self.model, input="A cat", previous_response_id="resp_1")
            self.assertIn("previous_response_id", str(ctx.exception))
        finally:
            server.stop()

    def test_vllm_small_routes(self):
        status, body = http("GET", "/v1/models/" + self.model)
        self.assertEqual(status, 200, body)
        model = self.client.models.retrieve(self.model)
        self.assertEqual((model.id, model.object), (self.model, "model"))
        self.assertGreater(json.loads(body)["max_model_len"], 0)
        self.assertIsNone(json.loads(body)["parent"])
        status, body = http("GET", "/version")
        self.assertEqual(status, 200)
        self.assertIn("version", json.loads(body))
        status, body = http("POST", "/tokenize", {"prompt": "Once upon a time"})
        tok = json.loads(body)
        self.assertEqual(sorted(tok), ["count", "max_model_len", "token_strs", "tokens"])
        self.assertIsNone(tok["token_strs"])
        self.assertEqual(tok["count"], len(tok["tokens"]))
        status, body = http("POST", "/detokenize", {"tokens": tok["tokens"]})
        # Control tokens come back as their text (the BOS "<s>"), as vLLM's detokenize does.
        self.assertTrue(json.loads(body)["prompt"].endswith("Once upon a time"), body)

    def test_bad_input_gets_openai_errors(self):
        cases = [
            ("POST", "/v1/completions", None, b"{not json", 400),
            ("POST", "/v1/completions", {"model": self.model, "prompt": "x", "max_tokens": 0}, None, 400),
            ("POST", "/v1/completions", {"model": self.model, "prompt": "x", "max_tokens": 100000}, None, 400),
            ("POST", "/v1/completions", {"model": "no-such-model", "prompt": "x"}, None, 404),
            ("POST", "/v1/completions", {"model": self.model, "prompt": 5}, None, 400),
            ("POST", "/v1/completions", {"model": self.model, "prompt": "x", "temperature": "hot"}, None, 400),
            ("POST", "/v1/chat/completions", {"model": self.model, "messages": []}, None, 400),
            ("POST", "/v1/completions", None, b'{"model": "m", "prompt": "\xff\xfe"}', 400),
            ("POST", "/v1/completions", None, b"{" + b" " * (2 << 20) + b"}", 413),
            ("GET", "/v1/nothing", None, None, 404),
            ("GET", "/v1/completions", None, None, 405),
        ]
        for method, path, body, raw, code in cases:
            status, text = http(method, path, body, raw=raw)
            self.assertEqual(status, code, (path, body, raw and raw[:40], text[:200]))
            if code != 405 or text:
                err = json.loads(text)["error"]
                for key in ("message", "type", "param", "code"):
                    self.assertIn(key, err)

    def test_disconnect_mid_stream_frees_blocks(self):
        with socket.create_connection(("127.0.0.1", int(SERVER.url.rsplit(":", 1)[1])), timeout=30) as s:
            body = json.dumps({"model": self.model, "prompt": "Once upon a time", "max_tokens": 400,
                               "stream": True}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            got = b""
            while got.count(b"data: ") < 3:
                got += s.recv(4096)
        self.assertTrue(wait_idle(), "an abandoned stream kept its KV blocks")


def main():
    def start(args):
        global ARGS, SERVER
        ARGS = args
        SERVER = start_server()
        return [SERVER]

    return unittest_main(start, packages=("openai",))


if __name__ == "__main__":
    sys.exit(main())

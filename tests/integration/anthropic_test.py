#!/usr/bin/env python3
"""Integration test of Anthropic's Messages API on `kvshard serve`, with the official `anthropic`
Python client unchanged: sync and streaming messages, count_tokens, the API key as x-api-key (and
its 401), errors in Anthropic's shape, prompt-caching usage that adds up, and a tool-use round trip
(the shape of the protocol, not the small model's judgement: an answer is text or a well-formed
tool_use, and a tool_result for it is accepted).

    tests/integration/anthropic_test.py --kvshard build/cli/kvshard --model models/SmolLM2-135M-Instruct.Q4_1.gguf
Exit code 77 (ctest SKIP_RETURN_CODE) when the model or the anthropic package is absent.
"""
import json
import os
import sys
import unittest
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvshard_server import Server, unittest_main  # noqa: E402

ARGS = None
SERVER = None
KEY = "sk-ant-kvshard-test"

WEATHER = {
    "name": "get_weather",
    "description": "The current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]},
}


class KeyedServer(Server):
    """The helper's plain HTTP calls (its GET /v1/models at start, metrics) with the API key."""

    def http(self, method, path, body=None, timeout=120):
        req = urllib.request.Request(self.url + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


class MessagesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import anthropic
        cls.anthropic = anthropic
        # The client sends the key as x-api-key and an anthropic-version header.
        cls.client = anthropic.Anthropic(base_url=SERVER.url, api_key=KEY, max_retries=0)
        cls.model = SERVER.model

    # Greedy answers, so that two requests can be compared. This client release has no
    # `temperature` argument any more; the API (and kvshard) still take the field.
    GREEDY = {"temperature": 0}

    def create(self, **kw):
        kw.setdefault("model", self.model)
        kw.setdefault("max_tokens", 16)
        kw.setdefault("extra_body", self.GREEDY)
        return self.client.messages.create(**kw)

    def check_usage(self, usage, prompt_tokens=None):
        for field in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
                      "output_tokens"):
            self.assertIsInstance(getattr(usage, field), int, field)
            self.assertGreaterEqual(getattr(usage, field), 0, field)
        if prompt_tokens is not None:
            self.assertEqual(usage.input_tokens + usage.cache_creation_input_tokens +
                             usage.cache_read_input_tokens, prompt_tokens)

    def test_message(self):
        m = self.create(messages=[{"role": "user", "content": "What is the capital of France?"}],
                        system="You answer in one short sentence.")
        self.assertTrue(m.id.startswith("msg_"), m.id)
        self.assertEqual(m.type, "message")
        self.assertEqual(m.role, "assistant")
        self.assertEqual(m.model, self.model)
        self.assertIn(m.stop_reason, ("end_turn", "max_tokens"))
        self.assertGreaterEqual(len(m.content), 1)
        self.assertEqual(m.content[0].type, "text")
        self.assertTrue(m.content[0].text)
        self.assertLessEqual(m.usage.output_tokens, 16)
        count = self.client.messages.count_tokens(
            model=self.model, system="You answer in one short sentence.",
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        self.check_usage(m.usage, count.input_tokens)

    def test_stream_equals_message(self):
        kw = dict(messages=[{"role": "user", "content": "Name three colours."}], max_tokens=20)
        whole = self.create(**kw)
        with self.client.messages.stream(model=self.model, extra_body=self.GREEDY, **kw) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        self.assertEqual(text, whole.content[0].text)
        self.assertEqual(final.content[0].text, whole.content[0].text)
        self.assertEqual(final.stop_reason, whole.stop_reason)
        self.assertEqual(final.usage.output_tokens, whole.usage.output_tokens)
        self.check_usage(final.usage)
        # The raw events, in Anthropic's order (the client drops the pings): each "event: T"
        # line names the type of the JSON on its data line.
        status, body = SERVER.http("POST", "/v1/messages", {"model": self.model, "stream": True,
                                                            "temperature": 0, **kw})
        self.assertEqual(status, 200, body)
        events = []
        for block in body.strip().split("\n\n"):
            event, data = block.split("\n", 1)
            self.assertTrue(event.startswith("event: ") and data.startswith("data: "), block)
            self.assertEqual(json.loads(data[len("data: "):])["type"], event[len("event: "):])
            events.append(event[len("event: "):])
        self.assertEqual(events[:3], ["message_start", "ping", "content_block_start"])
        self.assertEqual(events[-3:], ["content_block_stop", "message_delta", "message_stop"])
        self.assertEqual(events.count("content_block_start"), events.count("content_block_stop"))

    def test_stop_sequence(self):
        m = self.create(messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
                        max_tokens=40)
        text = m.content[0].text
        if "," not in text:
            self.skipTest(f"the model wrote no comma: {text!r}")
        cut = self.create(messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
                          max_tokens=40, stop_sequences=[","])
        self.assertEqual(cut.stop_reason, "stop_sequence")
        self.assertEqual(cut.stop_sequence, ",")
        self.assertEqual(cut.content[0].text, text[:text.index(",")])

    def test_top_level_cache_control(self):
        # The client's automatic caching: a breakpoint at the last block.
        messages = [{"role": "user", "content": "Tell me about cats. " * 30}]
        prompt = self.client.messages.count_tokens(model=self.model, messages=messages).input_tokens
        first = self.create(messages=messages, max_tokens=2, cache_control={"type": "ephemeral"})
        second = self.create(messages=messages, max_tokens=2, cache_control={"type": "ephemeral"})
        self.check_usage(first.usage, prompt)
        self.check_usage(second.usage, prompt)
        self.assertGreater(second.usage.cache_read_input_tokens, 0)

    def test_prompt_caching_usage_adds_up(self):
        system = [{"type": "text", "text": "You are a helpful assistant. " * 40,
                   "cache_control": {"type": "ephemeral"}}]
        messages = [{"role": "user", "content": "Say hi."}]
        prompt = self.client.messages.count_tokens(model=self.model, system=system,
                                                   messages=messages).input_tokens
        first = self.create(system=system, messages=messages, max_tokens=4)
        second = self.create(system=system, messages=messages, max_tokens=4)
        self.check_usage(first.usage, prompt)
        self.check_usage(second.usage, prompt)
        # The second reads at least the system prompt's full blocks from the cache.
        self.assertGreater(second.usage.cache_read_input_tokens, 0)

    def test_errors_in_anthropic_shape(self):
        with self.assertRaises(self.anthropic.BadRequestError) as e:
            self.client.post("/v1/messages", body={"model": self.model, "messages": [
                {"role": "user", "content": "x"}]}, cast_to=object)
        self.assertEqual(e.exception.body["type"], "error")
        self.assertEqual(e.exception.body["error"]["type"], "invalid_request_error")
        self.assertTrue(e.exception.body["error"]["message"].startswith("max_tokens"))
        with self.assertRaises(self.anthropic.BadRequestError) as e:
            self.create(messages=[{"role": "user", "content": [
                {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}])
        self.assertIn("messages.0.content.0.cache_control.ttl", str(e.exception))
        with self.assertRaises(self.anthropic.BadRequestError) as e:
            self.create(messages=[{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "r"}]}])
        self.assertIn("tool_use_id", str(e.exception))
        wrong = self.anthropic.Anthropic(base_url=SERVER.url, api_key="wrong", max_retries=0)
        with self.assertRaises(self.anthropic.AuthenticationError):
            wrong.messages.create(model=self.model, max_tokens=4,
                                  messages=[{"role": "user", "content": "x"}])
        with self.assertRaises(self.anthropic.NotFoundError):
            self.create(model="claude-no-such-model", messages=[{"role": "user", "content": "x"}])

    def test_tool_use_round_trip(self):
        question = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
        m = self.create(messages=question, tools=[WEATHER], max_tokens=60)
        uses = [b for b in m.content if b.type == "tool_use"]
        for b in m.content:
            self.assertIn(b.type, ("text", "tool_use"))
        if uses:
            self.assertEqual(m.stop_reason, "tool_use")
            self.assertEqual(uses[0].name, "get_weather")
            self.assertIsInstance(uses[0].input, dict)
            self.assertTrue(uses[0].id.startswith("toolu_"))
            call = {"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}
        else:
            self.assertIn(m.stop_reason, ("end_turn", "max_tokens"))
            # The model answered in text: send back a call of our own to test the result path.
            call = {"type": "tool_use", "id": "toolu_client_1", "name": "get_weather",
                    "input": {"city": "Paris"}}
        history = question + [
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                          "content": "18 C and sunny"}]}]
        answer = self.create(messages=history, tools=[WEATHER], max_tokens=30)
        for b in answer.content:
            self.assertIn(b.type, ("text", "tool_use"))
        self.assertIn(answer.stop_reason, ("end_turn", "max_tokens", "tool_use"))
        # Streaming with tools: the final message the client assembles has the same shape.
        with self.client.messages.stream(model=self.model, max_tokens=60, extra_body=self.GREEDY,
                                         messages=question, tools=[WEATHER]) as stream:
            final = stream.get_final_message()
        self.assertEqual([b.type for b in final.content], [b.type for b in m.content])
        for a, b in zip(final.content, m.content):
            if a.type == "tool_use":
                self.assertEqual((a.name, a.input), (b.name, b.input))
            else:
                self.assertEqual(a.text, b.text)
        # tool_choice "none": no tools rendered, a text answer.
        none = self.create(messages=question, tools=[WEATHER], tool_choice={"type": "none"})
        self.assertTrue(all(b.type == "text" for b in none.content))

    def test_count_tokens_grows_with_tools(self):
        messages = [{"role": "user", "content": "Hi"}]
        plain = self.client.messages.count_tokens(model=self.model, messages=messages).input_tokens
        tools = self.client.messages.count_tokens(model=self.model, messages=messages,
                                                  tools=[WEATHER]).input_tokens
        self.assertGreater(plain, 0)
        self.assertGreater(tools, plain)


def main():
    def start(args):
        global ARGS, SERVER
        ARGS = args
        SERVER = KeyedServer(args.kvshard, args.model, ["--set", f"server.api_keys={KEY}"])
        return [SERVER]

    return unittest_main(start, packages=("anthropic",))


if __name__ == "__main__":
    sys.exit(main())

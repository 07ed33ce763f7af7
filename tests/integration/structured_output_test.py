#!/usr/bin/env python3
"""Structured outputs with the official `openai` client on the default model: response_format
json_schema through client.chat.completions.parse(PydanticModel), json_object, n > 1, vLLM's
guided_choice / guided_regex / guided_json on chat and completions (each prompt of a list held),
the Responses API's text.format, a required tool call whose arguments fit the tool's schema, and
the 400s for what kvshard does not support. Kept short for CI: small max_tokens, samples as n
choices of one request, one server per model. The model is
tiny (135M): only the grammar makes its output valid. Exits 77 when a package or the model is
missing."""
import json
import os
import re
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvshard_server import Server, unittest_main  # noqa: E402

ARGS = None
SERVER = None
STORIES = None


class StructuredOutputTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import openai
        cls.openai = openai
        cls.client = openai.OpenAI(base_url=SERVER.url + "/v1", api_key="none", max_retries=0)
        cls.model = SERVER.model

    def chat(self, content, **kw):
        kw.setdefault("max_tokens", 40)
        kw.setdefault("temperature", 0)
        return self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": content}], **kw)

    def test_parse_returns_a_validated_pydantic_object(self):
        from typing import Annotated
        import pydantic

        class City(pydantic.BaseModel):
            name: Annotated[str, pydantic.Field(max_length=24)]
            population: int
            coastal: bool
            landmarks: Annotated[list[Annotated[str, pydantic.Field(max_length=16)]],
                                 pydantic.Field(max_length=2)]

        r = self.client.chat.completions.parse(
            model=self.model, response_format=City, temperature=0, max_tokens=80,
            messages=[{"role": "user", "content": "Describe Paris as JSON."}])
        choice = r.choices[0]
        self.assertEqual(choice.finish_reason, "stop")
        self.assertIsInstance(choice.message.parsed, City, choice.message.content)

    def test_json_object_and_schema_validate(self):
        import jsonschema
        r = self.chat("Give me a JSON object about a cat.",
                      response_format={"type": "json_object"}, max_tokens=24)
        if r.choices[0].finish_reason == "stop":
            self.assertIsInstance(json.loads(r.choices[0].message.content), dict)
        schema = {"type": "object", "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "sizes": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
            "note": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]}},
            "required": ["color", "sizes", "note"], "additionalProperties": False}
        # n > 1: each choice keeps a grammar state of its own.
        r = self.chat("Pick a color.", temperature=1.0, seed=1, max_tokens=60, n=3,
                      response_format={"type": "json_schema", "json_schema": {
                          "name": "pick", "schema": schema, "strict": True}})
        self.assertEqual(len(r.choices), 3)
        for choice in r.choices:
            self.assertEqual(choice.finish_reason, "stop", choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)

    def test_guided_choice_and_regex(self):
        choices = ["yes", "no", "maybe so"]
        r = self.chat("Is the sky blue?", temperature=1.0, seed=0, n=3, max_tokens=8,
                      extra_body={"guided_choice": choices})
        for choice in r.choices:
            self.assertIn(choice.message.content, choices)
            self.assertEqual(choice.finish_reason, "stop")
        pattern = r"\d{3}-[A-Z][a-z]{2,5}"
        r = self.chat("Write a code.", max_tokens=16, extra_body={"guided_regex": pattern})
        self.assertRegex(r.choices[0].message.content, "^" + pattern + "$")
        # Completions, and structured_outputs, the newer spelling.
        c = self.client.completions.create(
            model=self.model, prompt="The answer is", max_tokens=10, temperature=0,
            extra_body={"structured_outputs": {"regex": "(true|false)!"}})
        self.assertIn(c.choices[0].text, ["true!", "false!"])

    def test_guided_json_on_each_prompt_of_a_list(self):
        import jsonschema
        # Bounded values: a tiny model left an integer would write digits until max_tokens.
        schema = {"type": "object", "properties": {"x": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
                  "required": ["x", "ok"], "additionalProperties": False}
        c = self.client.completions.create(model=self.model, prompt=["Data:", "Result:"],
                                           max_tokens=30, temperature=0,
                                           extra_body={"guided_json": schema})
        self.assertEqual(len(c.choices), 2)
        for choice in c.choices:
            self.assertEqual(choice.finish_reason, "stop", choice.text)
            jsonschema.validate(json.loads(choice.text), schema)

    def test_responses_text_format_json_schema(self):
        import typing
        import pydantic

        class Animal(pydantic.BaseModel):
            animal: typing.Literal["cat", "dog"]
            legs: typing.Literal[2, 4]

        # client.responses.parse sends text.format {"type": "json_schema", "name", "schema",
        # "strict": true} and validates the answer into the model.
        r = self.client.responses.parse(model=self.model, input="Name an animal.",
                                        max_output_tokens=30, temperature=0, text_format=Animal)
        self.assertEqual(r.status, "completed", r.output_text)
        self.assertIsInstance(r.output_parsed, Animal, r.output_text)
        self.assertEqual(r.text.format.type, "json_schema")

    def test_budget_too_small_ends_with_length(self):
        r = self.chat("Count.", max_tokens=3, extra_body={"guided_regex": "(ab){40}"})
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertTrue("abababababab"[:len(r.choices[0].message.content)] ==
                        r.choices[0].message.content, r.choices[0].message.content)

    def test_required_tool_call_fits_the_schema(self):
        import jsonschema
        params = {"type": "object", "properties": {"city": {"type": "string"},
                  "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
                  "additionalProperties": False}
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params,
                                                   "strict": True}}]
        r = self.chat("What is the weather in Oslo?", tools=tools, tool_choice="required",
                      max_tokens=50)
        calls = r.choices[0].message.tool_calls
        self.assertTrue(calls, r.choices[0].message)
        self.assertEqual(calls[0].function.name, "get_weather")
        jsonschema.validate(json.loads(calls[0].function.arguments), params)
        # strict with tool_choice auto is refused, naming the field.
        with self.assertRaises(self.openai.BadRequestError) as e:
            self.chat("Weather?", tools=tools)
        self.assertIn("tools[0].function.strict", str(e.exception))

    def test_unsupported_is_refused_by_name(self):
        cases = [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                "type": "object", "properties": {"age": {"type": "number", "minimum": 0}}}}}},
             "response_format.json_schema.schema.properties.age.minimum"),
            ({"extra_body": {"guided_grammar": "start: \"a\""}}, "guided_grammar"),
            ({"extra_body": {"guided_regex": "(a)\\1"}}, "guided_regex"),
            ({"extra_body": {"guided_choice": ["a"], "guided_regex": "b"}}, "guided_regex"),
        ]
        for kw, name in cases:
            with self.assertRaises(self.openai.BadRequestError, msg=name) as e:
                self.chat("x", **kw)
            self.assertIn(name, str(e.exception))


class NonsenseModelTest(unittest.TestCase):
    """stories260K writes children's stories, never JSON: every output must still validate, from
    the grammar alone (and its SentencePiece vocabulary's byte pieces must map right)."""

    SCHEMA = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
        "home": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
            "town": {"type": "string", "maxLength": 10}}, "required": ["town"],
            "additionalProperties": False}]}},
        "required": ["name", "age", "pets", "home"], "additionalProperties": False}

    def test_many_generations_validate(self):
        import jsonschema
        if STORIES is None:
            self.skipTest("stories260K.gguf not found")
        # One request, n choices decoded as one batch, each with its own grammar state.
        status, body = STORIES.http("POST", "/v1/completions", {
            "model": STORIES.model, "prompt": "Once upon a time", "max_tokens": 80,
            "temperature": 1.0, "seed": 7, "n": ARGS.stories_runs, "guided_json": self.SCHEMA})
        self.assertEqual(status, 200, body)
        choices = json.loads(body)["choices"]
        self.assertEqual(len(choices), ARGS.stories_runs)
        valid = length = 0
        for choice in choices:
            if choice["finish_reason"] == "length":
                length += 1
                continue
            self.assertEqual(choice["finish_reason"], "stop", choice)
            jsonschema.validate(json.loads(choice["text"]), self.SCHEMA)
            valid += 1
        print(f"stories260K: {valid} of {ARGS.stories_runs} outputs complete and valid, "
              f"{length} cut by max_tokens", file=sys.stderr)
        self.assertGreater(valid, 0)


def main():
    def start(args):
        global ARGS, SERVER, STORIES
        ARGS = args
        SERVER = Server(args.kvshard, args.model, [])
        if args.stories and os.path.exists(args.stories):
            STORIES = Server(args.kvshard, args.stories, [])
        return [s for s in (SERVER, STORIES) if s is not None]

    def options(parser):
        parser.add_argument("--stories", default="")
        parser.add_argument("--stories-runs", type=int, default=16)  # n of one request: at most 16

    return unittest_main(start, options, packages=("jsonschema", "openai", "pydantic"))


if __name__ == "__main__":
    sys.exit(main())

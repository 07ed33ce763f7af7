#!/usr/bin/env python3
"""Renders the real chat templates in this folder with Python's jinja2, set up as Hugging Face's
apply_chat_template sets it up (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loopcontrols, HF's tojson and raise_exception), over a fixed set of conversations, and writes
renders.json: the expected prompts of tests/model/jinja_chat_template_test.cc, which renders the
same conversations with kvshard's interpreter and compares byte for byte.

A conversation a template refuses (raise_exception, a type error) is recorded as an error; the
test expects kvshard to refuse it too.

    /work/main/.venv/bin/python tests/model/chat_templates/make_renders.py
"""
import json
import os

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))

# file -> (bos_token, eos_token) of the model the template comes with.
TEMPLATES = {
    "HuggingFaceTB-SmolLM2-135M-Instruct.jinja": ("<|im_start|>", "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("", "<|im_end|>"),
    "Qwen-Qwen3-0.6B.jinja": ("", "<|im_end|>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("<s>", "</s>"),
    "google-gemma-2-2b-it.jinja": ("<bos>", "<eos>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": (
        "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"),
    "deepseek-ai-DeepSeek-V3.1.jinja": (
        "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"),
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}


# The same tool with the keys of every object in sorted order: kvshard's OpenAI parser keeps a
# tool's parameters schema with sorted keys, so its prompt matches jinja2's for this one
# (tests/integration/jinja_template_test.py sends it through /v1/chat/completions).
WEATHER_SORTED = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "properties": {"city": {"description": "The city, e.g. Paris", "type": "string"}},
            "required": ["city"],
            "type": "object",
        },
    },
}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


CALL = {"id": "call00001", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}

CONVERSATIONS = {
    "system_multi_turn": {"messages": [
        {"role": "system", "content": " Be brief.\n"}, user(" Hi there "),
        assistant("Hello! "), user("What is 2+2?")]},
    "user_only": {"messages": [user("Hello")]},
    "two_turns": {"messages": [user("Hello"), assistant(" Hi."), user("Tell me a joke."),
                               assistant("Why did the GPU cross the bus?\n")]},
    "unicode_and_markup": {"messages": [
        user("Gr\u00fc\u00dfe \U0001F30D \"quoted\" <|im_end|> {{ not jinja }} \\n")]},
    "thinking": {"messages": [
        user("2+2?"), assistant("<think>\nTwo and two.\n</think>\n\nFour."), user("3+3?")]},
    "tools": {"tools": [WEATHER], "messages": [
        {"role": "system", "content": "You help with weather."},
        user("Weather in Paris?"),
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call00001", "content": "{\"temp\": 18}"},
        assistant("It is 18 degrees in Paris."), user("And tomorrow?")]},
    "tools_first_turn": {"tools": [WEATHER], "messages": [user("Weather in Oslo?")]},
    "api_tools": {"tools": [WEATHER_SORTED], "messages": [
        {"role": "system", "content": "You help with weather."},
        user("Weather in Paris?"),
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call00001", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call00001", "content": "18 C"},
        user("Thanks. And in Oslo?")]},
}


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def main():
    env = environment()
    renders = []
    templates = {}
    for name, (bos, eos) in TEMPLATES.items():
        with open(os.path.join(HERE, name), encoding="utf-8") as f:
            source = f.read()
        templates[name] = {"bos": bos, "eos": eos}
        compiled = env.from_string(source)
        for conv_name, conv in CONVERSATIONS.items():
            for gen in (True, False):
                entry = {"template": name, "conversation": conv_name,
                         "add_generation_prompt": gen}
                try:
                    entry["text"] = compiled.render(
                        messages=conv["messages"], tools=conv.get("tools"), documents=None,
                        add_generation_prompt=gen, bos_token=bos, eos_token=eos)
                except Exception as e:  # the template refuses the conversation
                    entry["error"] = f"{type(e).__name__}: {e}"
                renders.append(entry)
    out = {"templates": templates, "conversations": CONVERSATIONS, "renders": renders}
    with open(os.path.join(HERE, "renders.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    errors = sum("error" in r for r in renders)
    print(f"{len(renders)} renders ({errors} refused) of {len(templates)} templates")


if __name__ == "__main__":
    main()

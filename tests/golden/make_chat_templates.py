#!/usr/bin/env python3
"""Renders the chat templates kvshard recognises with Jinja2 (as Hugging Face's
apply_chat_template does: trim_blocks, lstrip_blocks) and writes tests/golden/chat_templates.json,
the expected prompts of tests/model/chat_template_test.cc.

The SmolLM2 template is read from the default model's GGUF (gguf package); the Llama 2 and
Llama 3 templates are those of meta-llama/Llama-2-7b-chat-hf and Meta-Llama-3-8B-Instruct.

    python3 tests/golden/make_chat_templates.py models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import json
import os
import sys

import jinja2
from gguf import GGUFReader

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}")
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")

CONVERSATIONS = {
    "with_system": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi there "},
        {"role": "assistant", "content": "Hello! "},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "no_system": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ],
    "unicode": [{"role": "user", "content": "Grüße, 世界 🌍\n\tnew line"}],
}


def main():
    reader = GGUFReader(sys.argv[1])
    field = reader.fields["tokenizer.chat_template"]
    smollm2 = bytes(field.parts[field.data[0]]).decode()
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    templates = {
        "smollm2": (smollm2, "<|im_start|>", "<|im_end|>"),
        "llama2": (LLAMA2, "<s>", "</s>"),
        "llama3": (LLAMA3, "<|begin_of_text|>", "<|end_of_text|>"),
    }
    out = {"conversations": CONVERSATIONS, "templates": {}, "rendered": []}
    for name, (source, bos, eos) in templates.items():
        out["templates"][name] = {"jinja": source, "bos": bos, "eos": eos}
        for conv_name, messages in CONVERSATIONS.items():
            for gen in (False, True):
                text = env.from_string(source).render(messages=messages, add_generation_prompt=gen,
                                                      bos_token=bos, eos_token=eos)
                out["rendered"].append({"template": name, "conversation": conv_name,
                                        "add_generation_prompt": gen, "text": text})
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()

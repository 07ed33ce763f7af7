#!/usr/bin/env python3
"""Prompt-token logprobs with the official `openai` client on the default model: completions'
echo + logprobs (lm-eval's loglikelihood call, echo + logprobs + max_tokens 0, and streamed),
vLLM's prompt_logprobs on completions and chat, a list of prompts, and the invariance a user relies
on: the logprob reported for a greedily generated token equals the prompt logprob reported for the
same token when prompt + generation is sent back. One server; small max_tokens. Exits 77 when a
package or the model is missing."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvshard_server import Server, unittest_main  # noqa: E402

SERVER = None
PROMPT = "The quick brown fox jumps over the lazy dog. Then the dog"


class PromptLogprobsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import openai
        cls.client = openai.OpenAI(base_url=SERVER.url + "/v1", api_key="none", max_retries=0)
        cls.model = SERVER.model

    def complete(self, prompt, **kw):
        kw.setdefault("temperature", 0)
        return self.client.completions.create(model=self.model, prompt=prompt, **kw)

    def assert_prompt_entries(self, lp, prompt):
        """The prompt's part of an echo's logprobs: null first, then a logprob and a dict each;
        the tokens spell the prompt, at increasing offsets."""
        n = len(lp.tokens)
        self.assertIsNone(lp.token_logprobs[0])
        self.assertIsNone(lp.top_logprobs[0])
        for i in range(1, n):
            self.assertLessEqual(lp.token_logprobs[i], 0.0)
            self.assertIsInstance(lp.top_logprobs[i], dict)
        self.assertEqual("".join(lp.tokens), prompt)
        self.assertEqual(lp.text_offset[0], 0)
        self.assertEqual(lp.text_offset, sorted(lp.text_offset))

    def test_loglikelihood_call_returns_the_prompt_scored(self):
        # lm-eval's local-completions loglikelihood request.
        r = self.complete(PROMPT, echo=True, logprobs=1, max_tokens=0)
        choice = r.choices[0]
        self.assertEqual(choice.text, PROMPT)
        self.assertEqual(choice.finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 0)
        lp = choice.logprobs
        self.assertEqual(len(lp.tokens), r.usage.prompt_tokens)
        self.assert_prompt_entries(lp, PROMPT)
        # lm-eval's is_greedy: the top entry of a position is its most likely token.
        for i in range(1, len(lp.tokens)):
            top = lp.top_logprobs[i]
            self.assertEqual(len(top), 1)
            self.assertGreaterEqual(max(top.values()), lp.token_logprobs[i] - 1e-6)
        # The same call again (its prefix is cached now) scores the same.
        again = self.complete(PROMPT, echo=True, logprobs=1, max_tokens=0)
        self.assertEqual(again.choices[0].logprobs.token_logprobs, lp.token_logprobs)

    def test_generated_logprob_equals_the_prompt_logprob_sent_back(self):
        gen = self.complete(PROMPT, max_tokens=8, logprobs=1)
        g = gen.choices[0]
        self.assertEqual(len(g.logprobs.tokens), 8)
        back = self.complete(PROMPT + g.text, echo=True, logprobs=1, max_tokens=0)
        lp = back.choices[0].logprobs
        tail = len(lp.tokens) - 8
        # Re-tokenizing prompt + generation gives the same tokens (else there is nothing to compare).
        self.assertEqual(lp.tokens[tail:], g.logprobs.tokens)
        for i in range(8):
            self.assertAlmostEqual(lp.token_logprobs[tail + i], g.logprobs.token_logprobs[i],
                                   delta=1e-4, msg=f"token {i} {g.logprobs.tokens[i]!r}")
        # Greedy: every generated token is its position's top token.
        for i in range(8):
            self.assertEqual(max(lp.top_logprobs[tail + i], key=lp.top_logprobs[tail + i].get),
                             g.logprobs.tokens[i])

    def test_echo_with_logprobs_leads_with_the_prompt_then_the_generated(self):
        r = self.complete(PROMPT, echo=True, logprobs=2, max_tokens=4)
        choice = r.choices[0]
        lp = choice.logprobs
        self.assertEqual(len(lp.tokens), r.usage.prompt_tokens + 4)
        self.assertEqual("".join(lp.tokens), choice.text)
        self.assertTrue(choice.text.startswith(PROMPT))
        self.assertTrue(all(x is not None for x in lp.token_logprobs[1:]))
        # Streamed: the first chunk carries the prompt's text and entries.
        tokens, lps, text = [], [], ""
        for chunk in self.complete(PROMPT, echo=True, logprobs=2, max_tokens=4, stream=True):
            for c in chunk.choices:
                text += c.text
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                    lps += c.logprobs.token_logprobs
        self.assertEqual(text, choice.text)
        self.assertEqual(tokens, lp.tokens)
        self.assertIsNone(lps[0])
        for a, b in zip(lps[1:], lp.token_logprobs[1:]):
            self.assertAlmostEqual(a, b, delta=1e-5)
        # A list of prompts: each choice leads with its own prompt.
        prompts = ["One two three", "Four five six seven"]
        r = self.complete(prompts, echo=True, logprobs=0, max_tokens=0)
        self.assertEqual([c.text for c in r.choices], prompts)
        for c, p in zip(r.choices, prompts):
            self.assert_prompt_entries(c.logprobs, p)

    def test_vllm_prompt_logprobs(self):
        echo = self.complete(PROMPT, echo=True, logprobs=3, max_tokens=0).choices[0].logprobs
        r = self.complete(PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 3})
        plp = r.choices[0].model_extra["prompt_logprobs"]
        self.assertEqual(len(plp), r.usage.prompt_tokens)
        self.assertIsNone(plp[0])
        for i, entry in enumerate(plp[1:], start=1):
            # The prompt token itself, then its top 3 (the token may be among them).
            self.assertIn(len(entry), (3, 4))
            mine = [v for v in entry.values() if v["decoded_token"] == echo.tokens[i]]
            self.assertTrue(mine, entry)
            self.assertAlmostEqual(mine[0]["logprob"], echo.token_logprobs[i], delta=1e-5)
            ranks = sorted(v["rank"] for v in entry.values())
            self.assertEqual(ranks[0], 1)
            for key in entry:
                self.assertTrue(key.isdigit(), key)
        # Chat: the response's prompt_logprobs, over the templated prompt.
        chat = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            temperature=0, extra_body={"prompt_logprobs": 0})
        cplp = chat.model_extra["prompt_logprobs"]
        self.assertEqual(len(cplp), chat.usage.prompt_tokens)
        self.assertIsNone(cplp[0])
        self.assertTrue(all(len(e) == 1 for e in cplp[1:]))

    def test_refusals_name_the_field(self):
        import openai
        cases = [({"max_tokens": 0}, "max_tokens"),
                 ({"max_tokens": 1, "extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
                 ({"max_tokens": 1, "stream": True, "extra_body": {"prompt_logprobs": 1}},
                  "prompt_logprobs")]
        for kw, param in cases:
            with self.assertRaises(openai.BadRequestError) as e:
                self.complete(PROMPT, **kw)
            self.assertEqual(e.exception.body.get("param"), param, e.exception.body)


def main():
    def start(args):
        global SERVER
        SERVER = Server(args.kvshard, args.model, [])
        return [SERVER]

    return unittest_main(start, packages=("openai",))


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""GET /metrics as a Prometheus client reads it: `kvshard serve` on the default model with
server.metrics_vllm_names on, a few requests with the official `openai` client (n=2, max_tokens, a
long-ish prompt, a stream), then the exposition parsed by prometheus_client's own parser and the
values a dashboard relies on checked against what the requests were: counts, token sums, the
request phases (prefill + decode = inference, queue time >= 0), request_params_n, the KV cache's
blocks as the server logged them, the process metrics against /proc, and every kvshard: series
again under its vllm: name with the same value. One server, small max_tokens: a few seconds of
CI. Exits 77 when a package or the model is missing."""
import os
import re
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvshard_server import Server, unittest_main  # noqa: E402

ARGS = None
SERVER = None
STARTED_AT = 0.0

LONG_PROMPT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(12))


class MetricsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import openai
        from prometheus_client.parser import text_string_to_metric_families
        client = openai.OpenAI(base_url=SERVER.url + "/v1", api_key="none", max_retries=0)
        model = SERVER.model
        cls.sent = []  # (n, max_tokens, usage)
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name two colors."}], n=2,
            max_tokens=6, temperature=1.0, seed=3)
        cls.sent.append((2, 6, r.usage))
        r = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=5, temperature=0)
        cls.sent.append((1, 5, r.usage))
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count to three."}], max_tokens=4,
            temperature=0, stream=True, stream_options={"include_usage": True})
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
        cls.sent.append((1, 4, usage))
        cls.text = SERVER.metrics()
        # "sample name" -> {frozenset(labels): value}, and family name -> type.
        cls.samples, cls.types = {}, {}
        for family in text_string_to_metric_families(cls.text):
            cls.types[family.name] = family.type
            for s in family.samples:
                cls.samples.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value

    def value(self, name, **labels):
        """The sample of `name` whose labels include `labels` (model_name aside); exactly one."""
        series = self.samples.get(name)
        self.assertIsNotNone(series, f"{name} missing")
        found = [v for ls, v in series.items() if set(labels.items()) <= ls]
        self.assertEqual(len(found), 1, f"{name}{labels}: {series}")
        return found[0]

    def test_counts_are_the_requests_sent(self):
        n = len(self.sent)
        self.assertEqual(sum(self.samples["kvshard:request_success_total"].values()), n)
        for h in ("queue_time_seconds", "prefill_time_seconds", "decode_time_seconds",
                  "inference_time_seconds", "prompt_tokens", "generation_tokens", "params_n",
                  "params_max_tokens"):
            self.assertEqual(self.types[f"kvshard:request_{h}"], "histogram", h)
            self.assertEqual(self.value(f"kvshard:request_{h}_count"), n, h)
            self.assertEqual(self.value(f"kvshard:request_{h}_bucket", le="+Inf"), n, h)
        self.assertEqual(self.value("kvshard:request_prompt_tokens_sum"),
                         sum(u.prompt_tokens for _, _, u in self.sent))
        self.assertEqual(self.value("kvshard:request_generation_tokens_sum"),
                         sum(u.completion_tokens for _, _, u in self.sent))
        self.assertEqual(self.value("kvshard:request_params_max_tokens_sum"),
                         sum(m for _, m, _ in self.sent))
        self.assertEqual(self.value("kvshard:prompt_tokens_total"),
                         self.value("kvshard:request_prompt_tokens_sum"))

    def test_request_params_n_saw_two(self):
        self.assertEqual(self.value("kvshard:request_params_n_sum"), sum(n for n, _, _ in self.sent))
        self.assertEqual(self.value("kvshard:request_params_n_bucket", le="1"), 2)
        self.assertEqual(self.value("kvshard:request_params_n_bucket", le="2"), 3)

    def test_phases_add_up(self):
        queue = self.value("kvshard:request_queue_time_seconds_sum")
        prefill = self.value("kvshard:request_prefill_time_seconds_sum")
        decode = self.value("kvshard:request_decode_time_seconds_sum")
        inference = self.value("kvshard:request_inference_time_seconds_sum")
        e2e = self.value("kvshard:e2e_request_latency_seconds_sum")
        self.assertGreaterEqual(queue, 0)
        self.assertGreater(prefill, 0)
        self.assertGreater(decode, 0)
        self.assertAlmostEqual(prefill + decode, inference, delta=1e-6 * max(1.0, inference))
        # Arrival -> end covers queue and inference (and the last delta's trip to the client).
        self.assertLessEqual(queue + inference, e2e + 1e-3)
        # Every step computed at least one token; the long prompt's tokens were all computed.
        self.assertGreaterEqual(self.value("kvshard:iteration_tokens_total_sum"),
                                self.sent[1][2].prompt_tokens)
        self.assertGreater(self.value("kvshard:iteration_tokens_total_count"), 0)

    def test_cache_config_info_is_the_servers_pool(self):
        m = re.search(r"(\d+) KV blocks of (\d+) tokens", "".join(SERVER.log))
        self.assertIsNotNone(m, "the server logs its KV pool at info")
        self.assertEqual(self.types["kvshard:cache_config_info"], "gauge")
        self.assertEqual(self.value("kvshard:cache_config_info", num_gpu_blocks=m.group(1),
                                    block_size=m.group(2)), 1)

    def test_process_metrics(self):
        with open(f"/proc/{SERVER.proc.pid}/status") as f:
            vm_rss = int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024
        rss = self.value("process_resident_memory_bytes")
        # The model's weights are resident: tens of MB at least, and what the kernel says.
        self.assertGreater(rss, 20 << 20)
        self.assertLess(abs(rss - vm_rss), 0.5 * vm_rss)
        self.assertGreaterEqual(self.value("process_virtual_memory_bytes"), rss)
        self.assertGreater(self.value("process_cpu_seconds_total"), 0)
        self.assertGreater(self.value("process_open_fds"), 3)
        self.assertGreaterEqual(self.value("process_max_fds"), self.value("process_open_fds"))
        start = self.value("process_start_time_seconds")
        self.assertGreater(start, STARTED_AT - 5)
        self.assertLess(start, time.time())
        self.assertNotIn("model_name", str(self.samples["process_resident_memory_bytes"]))

    def test_vllm_names_repeat_every_series(self):
        kvshard = {k: v for k, v in self.samples.items() if k.startswith("kvshard:")}
        self.assertGreater(len(kvshard), 20)
        for name, series in kvshard.items():
            alias = "vllm:" + name[len("kvshard:"):]
            self.assertEqual(self.samples.get(alias), series, alias)
        for family, kind in self.types.items():
            if family.startswith("kvshard:"):
                self.assertEqual(self.types["vllm:" + family[len("kvshard:"):]], kind, family)
        # What vLLM dashboards query, labelled as vLLM labels it.
        success = self.samples["vllm:request_success_total"]
        self.assertEqual(sum(success.values()), len(self.sent))
        for labels in success:
            self.assertIn(("model_name", SERVER.model), labels)
            self.assertIn(dict(labels)["finished_reason"], ("stop", "length"))
        self.assertNotIn("vllm:process_", self.text)


def main():
    def start(args):
        global ARGS, SERVER, STARTED_AT
        ARGS = args
        STARTED_AT = time.time()
        SERVER = Server(args.kvshard, args.model, ["--set", "server.metrics_vllm_names=true"],
                        log_level="info")
        return [SERVER]

    return unittest_main(start, packages=("openai", "prometheus_client"))


if __name__ == "__main__":
    sys.exit(main())

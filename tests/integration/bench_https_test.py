#!/usr/bin/env python3
"""Integration test of `kvshard bench` over https: a TLS reverse proxy (Python's ssl, a certificate
made here with the openssl command) in front of `kvshard serve` on stories260K. The bench trusts
the certificate with --ca-cert and completes (a ShareGPT file measured with the server's /tokenize,
or with --tokenizer and the model file, and a per-request result file whose lines match the report), refuses it in one line without, refuses a
name the certificate does not carry, and completes with --insecure.

    tests/integration/bench_https_test.py --kvshard build/cli/kvshard --model .../stories260K.bin
Exit code 77 (ctest SKIP_RETURN_CODE) when the model or the openssl command is absent.
Standard library only.
"""
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvshard_server import Server, unittest_main  # noqa: E402

ARGS = None


class TlsProxy:
    """Accepts TLS on 127.0.0.1 (an ephemeral port) and pipes the plain bytes to `upstream`."""

    def __init__(self, upstream, cert, key):
        self.upstream = upstream
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.server_names = []  # the SNI of each ClientHello (None: none sent)
        self.context.sni_callback = lambda sock, name, ctx: self.server_names.append(name)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.handshakes = 0
        self.lock = threading.Lock()
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(raw,), daemon=True).start()

    def handle(self, raw):
        try:
            conn = self.context.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            raw.close()  # the client refused the certificate
            return
        with self.lock:
            self.handshakes += 1
        up = socket.create_connection(self.upstream)

        def pipe(src, dst):
            try:
                while True:
                    data = src.recv(65536)
                    if not data:
                        break
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        t = threading.Thread(target=pipe, args=(up, conn), daemon=True)
        t.start()
        pipe(conn, up)
        t.join(timeout=30)
        conn.close()
        up.close()

    def close(self):
        self.listener.close()


class BenchHttpsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="kvshard-bench-https-")
        cls.cert = os.path.join(cls.dir, "cert.pem")
        key = os.path.join(cls.dir, "key.pem")
        # Self-signed, for the IP address only (so "localhost" is a name it does not carry).
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key, "-out", cls.cert,
                        "-days", "2", "-subj", "/CN=kvshard test", "-addext",
                        "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        cls.server = Server(ARGS.kvshard, ARGS.model, [])
        host, port = cls.server.url.removeprefix("http://").split(":")
        cls.proxy = TlsProxy((host, int(port)), cls.cert, key)
        cls.url = f"https://127.0.0.1:{cls.proxy.port}/v1"
        conversations = []
        for i in range(12):
            conversations.append({"id": f"c{i}", "conversations": [
                {"from": "human", "value": "Once upon a time there was a little dog " * (1 + i % 3)},
                {"from": "gpt", "value": "The dog ran to the park and played " * (1 + i % 2)},
                {"from": "human", "value": "and then?"}]})
        conversations.append({"id": "short", "conversations": [
            {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, how are you?"}]})
        cls.sharegpt = os.path.join(cls.dir, "sharegpt.json")
        with open(cls.sharegpt, "w") as f:
            json.dump(conversations, f)

    @classmethod
    def tearDownClass(cls):
        cls.proxy.close()
        cls.server.stop()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def bench(self, *extra, url=None):
        cmd = [ARGS.kvshard, "bench", "--base-url", url or self.url, "--max-concurrency", "4",
               "--timeout", "60", *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    def test_trusted_with_ca_cert_sharegpt_and_result_file(self):
        results = os.path.join(self.dir, "results.jsonl")
        r = self.bench("--ca-cert", self.cert, "--dataset", "sharegpt", "--dataset-path",
                       self.sharegpt, "--num-prompts", "6", "--seed", "1", "--json",
                       "--result-file", results)
        self.assertEqual(r.returncode, 0, r.stderr)
        report = json.loads(r.stdout)
        self.assertEqual(report["completed"], 6)
        self.assertEqual(report["failed"], 0)
        with open(results) as f:
            rows = [json.loads(line) for line in f]
        self.assertEqual(len(rows), 6)
        for row in rows:
            self.assertTrue(row["ok"], row)
            # ignore_eos: the answer's length, as the server's /tokenize measured the gpt turn.
            self.assertEqual(row["output_tokens"], row["max_tokens"])
            self.assertGreaterEqual(row["max_tokens"], 4)
            # The prompt as /tokenize counted it is what the completion's usage says.
            self.assertEqual(row["prompt_tokens"], row["dataset_prompt_tokens"])
            self.assertEqual(len(row["itl_ms"]), row["output_tokens"] - 1)
        self.assertEqual(sum(r["output_tokens"] for r in rows), report["total_output_tokens"])
        ttft = sorted(r["ttft_ms"] for r in rows)
        self.assertAlmostEqual((ttft[2] + ttft[3]) / 2, report["ttft_ms"]["median"], places=6)
        # "Hi" is shorter than vLLM's 4-token minimum: never sent.
        self.assertNotIn(True, [row["dataset_prompt_tokens"] < 4 for row in rows])

    def test_local_tokenizer_counts_as_the_server_does(self):
        results = os.path.join(self.dir, "local.jsonl")
        r = self.bench("--insecure", "--dataset", "sharegpt", "--dataset-path", self.sharegpt,
                       "--tokenizer", ARGS.model, "--num-prompts", "3", "--output-len", "5",
                       "--result-file", results)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(results) as f:
            rows = [json.loads(line) for line in f]
        self.assertEqual(len(rows), 3)
        for row in rows:
            self.assertTrue(row["ok"], row)
            self.assertEqual(row["output_tokens"], 5)  # --output-len instead of the answer's
            self.assertEqual(row["prompt_tokens"], row["dataset_prompt_tokens"])

    def test_untrusted_certificate_is_one_line(self):
        before = self.proxy.handshakes
        r = self.bench("--model", self.server.model, "--num-requests", "3", "--output-len", "4")
        self.assertEqual(r.returncode, 1)
        self.assertEqual(r.stdout, "")
        lines = r.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, r.stderr)
        self.assertIn("not trusted", lines[0])
        self.assertIn("self-signed", lines[0])
        self.assertIn("--ca-cert", lines[0])
        self.assertEqual(self.proxy.handshakes, before)

    def test_name_the_certificate_does_not_carry(self):
        r = self.bench("--ca-cert", self.cert, "--num-requests", "2", "--output-len", "4",
                       url=f"https://localhost:{self.proxy.port}")
        self.assertEqual(r.returncode, 1)
        self.assertIn("not trusted", r.stderr)
        self.assertIn("mismatch", r.stderr)
        self.assertIn("localhost", self.proxy.server_names)  # SNI for a DNS name
        self.assertNotIn("127.0.0.1", self.proxy.server_names)  # never for an IP address

    def test_insecure_skips_the_check(self):
        r = self.bench("--insecure", "--num-requests", "4", "--input-len", "8", "--output-len", "6",
                       "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        report = json.loads(r.stdout)
        self.assertEqual(report["completed"], 4)
        self.assertEqual(report["total_output_tokens"], 24)

    def test_unreadable_ca_cert(self):
        bad = os.path.join(self.dir, "bad.pem")
        with open(bad, "w") as f:
            f.write("not a certificate\n")
        r = self.bench("--ca-cert", bad, "--num-requests", "1")
        self.assertEqual(r.returncode, 1)
        self.assertIn(f"--ca-cert {bad}", r.stderr)


def main():
    def start(args):
        global ARGS
        ARGS = args
        return []

    return unittest_main(start, commands=("openssl",))


if __name__ == "__main__":
    sys.exit(main())

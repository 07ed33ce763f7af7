"""llama.cpp's llama-server as the peer of the golden scripts: started on one model file, waited
for, asked over HTTP, stopped. Shared by make_kquant_llamacpp.py, make_arch_llamacpp.py and
make_gemma3_llamacpp.py."""
import json
import subprocess
import time
import urllib.request


class LlamaServer:
    """`with LlamaServer(server, model, port, ctx) as s: s.post("/completion", {...})`."""

    def __init__(self, server, model_path, port, ctx, timeout=300):
        self.port = port
        self.timeout = timeout
        self.proc = subprocess.Popen([server, "-m", model_path, "--port", str(port), "-c",
                                      str(ctx), "-t", "2", "-np", "1", "--no-warmup"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self):
        for _ in range(240):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health",
                                            timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()

    def post(self, path, body):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            return json.loads(r.read())

    def greedy(self, ids, n_predict, n_probs=0, ignore_eos=True):
        """Greedy (top-k 1) completion of the prompt ids, EOS ignored unless ignore_eos is False
        (then the continuation ends with the EOS token); with n_probs, also the top
        log-probabilities at the last prompt position, from a request of one token: in a longer
        one llama-server leaves out the entries of tokens that end inside a UTF-8 character or
        came from its own drafts, so entry 0 need not be the first token's."""
        body = {"prompt": ids, "n_predict": n_predict, "temperature": 0, "top_k": 1,
                "samplers": ["top_k"], "cache_prompt": False, "return_tokens": True,
                "ignore_eos": ignore_eos}
        r = self.post("/completion", body)
        if n_probs == 0:
            return r, None
        one = self.post("/completion", dict(body, n_predict=1, n_probs=n_probs,
                                            post_sampling_probs=False))
        probs = one.get("completion_probabilities", [])
        if len(probs) != 1 or probs[0]["id"] != r["tokens"][0]:
            raise RuntimeError("llama.cpp's first-token probabilities do not match its first "
                               "token")
        return r, probs[0]["top_logprobs"]

"""`kvshard serve` as a child process for the integration tests: start it on a free port, talk
HTTP to it, read its metrics, find its worker processes. Standard library only."""
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request

MAX_TOKENS = 24


class Server:
    def __init__(self, kvshard, model, extra, log_level="warn"):
        cmd = [kvshard, "serve", "--model", model, "--port", "0", "--host", "127.0.0.1",
               "--log-level", log_level, *extra]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.log = []
        deadline = time.time() + 120
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvshard serve exited with {self.proc.returncode}: {''.join(self.log)}")
                continue
            self.log.append(line)
            m = re.search(r"listening on (http://[\d.]+:\d+)", line)
            if m:
                self.url = m.group(1)
                # Keep draining stderr so the server never blocks on a full pipe.
                self.drain = concurrent.futures.ThreadPoolExecutor(1)
                self.drain.submit(lambda: [self.log.append(l) for l in self.proc.stderr])
                self.model = json.loads(self.http("GET", "/v1/models")[1])["data"][0]["id"]
                return
        self.proc.kill()
        raise RuntimeError("kvshard serve did not start within 120 s")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.drain.shutdown()
        self.proc.stderr.close()

    def http(self, method, path, body=None, timeout=120):
        req = urllib.request.Request(self.url + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def complete(self, prompt, max_tokens=MAX_TOKENS, stream=False, timeout=120):
        status, text = self.http("POST", "/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}, timeout=timeout)
        if stream:
            return status, text
        return status, (json.loads(text)["choices"][0]["text"] if status == 200 else text)

    def metrics(self):
        _, text = self.http("GET", "/metrics")
        return text

    def metric(self, name):
        total, found = 0.0, False
        for line in self.metrics().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found:
            raise KeyError(name)
        return total

    def wait_idle(self, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.metric("kvshard:num_requests_running") == 0 and self.metric("kvshard:kv_cache_usage_perc") == 0:
                return True
            time.sleep(0.05)
        return False


def worker_pids(server_pid, instance):
    """The `kvshard worker --instance <instance>` processes under the server (its children, or
    mpirun's), without mpirun itself."""
    procs = {}  # pid -> (ppid, argv)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        procs[int(entry)] = (ppid, args)
    under, frontier = set(), {server_pid}
    while frontier:  # descendants of the server
        frontier = {p for p, (ppid, _) in procs.items() if ppid in frontier and p not in under}
        under |= frontier
    out = []
    for pid in sorted(under):
        args = procs[pid][1]
        if os.path.basename(args[0]) in (b"mpirun", b"mpiexec", b"orterun", b"prterun"):
            continue  # the launcher, not a worker
        if b"worker" in args and b"--instance" in args and \
                args[args.index(b"--instance") + 1] == instance.encode():
            out.append(pid)
    return out

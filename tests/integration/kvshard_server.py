"""`kvshard serve` as a child process for the integration tests: start it on a free port, talk
HTTP to it, read its metrics, find its worker processes; and the tests' main(): arguments, a skip
(exit 77) when something they need is missing, the tests run. Standard library only."""
import argparse
import concurrent.futures
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import unittest
import urllib.error
import urllib.request

MAX_TOKENS = 24
SKIP = 77  # the integration tests' SKIP_RETURN_CODE (tests/CMakeLists.txt)


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
        """SIGTERM, then SIGKILL after 30 s; the exit status (negative: the signal)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.drain.shutdown()
        self.proc.stderr.close()
        return self.proc.returncode

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


def wait_for(predicate, timeout, what):
    """Polls predicate() every 50 ms until it is true; AssertionError naming `what` after
    `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


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


def _parse_args(options, known):
    parser = argparse.ArgumentParser()
    parser.add_argument("--kvshard", required=True)
    parser.add_argument("--model", required=True)
    if options is not None:
        options(parser)
    return parser.parse_known_args() if known else (parser.parse_args(), [])


def _missing(packages, commands, files, hint):
    """Why the test cannot run on this machine, or None."""
    for name in packages:
        try:
            importlib.import_module(name)
        except ImportError:
            return f"the {name} package is not installed (scripts/lib/common.sh installs it)"
    for name in commands:
        if shutil.which(name) is None:
            return f"the {name} command is not installed (Debian: {name})"
    for path in files:
        if not os.path.exists(path):
            return f"{path} not found" + (f" ({hint})" if hint else "")
    return None


def _model_file(args):
    return [args.model]


def test_main(run, options=None, packages=(), commands=(), files=_model_file, hint=""):
    """main() of an integration test that checks by itself: parses --kvshard, --model and what
    `options(parser)` adds; returns SKIP, saying why, when a Python package in `packages`, a
    command in `commands` or a file of `files(args)` (the model by default; `hint` says where to
    get it) is missing; else run(args), the exit status."""
    args, _ = _parse_args(options, known=False)
    reason = _missing(packages, commands, files(args), hint)
    if reason:
        print("SKIP: " + reason)
        return SKIP
    return run(args)


def unittest_main(start, options=None, packages=(), commands=(), files=_model_file, hint=""):
    """main() of a unittest integration test: the arguments and the skip as test_main (unknown
    arguments go to unittest), then start(args), which keeps what the tests need in the module's
    globals and returns the servers to stop at the end, then every test; 0 when all passed."""
    args, rest = _parse_args(options, known=True)
    reason = _missing(packages, commands, files(args), hint)
    if reason:
        print("SKIP: " + reason)
        return SKIP
    servers = start(args)
    try:
        prog = unittest.main(argv=[sys.argv[0], *rest], exit=False, verbosity=2)
        return 0 if prog.result.wasSuccessful() else 1
    finally:
        for server in servers:
            print(f"server exit: {server.stop()}")


def add_with_mpi_option(parser):
    """--with-mpi ON|OFF (CMake's spelling): whether kvshard was built with MPI."""
    parser.add_argument("--with-mpi", type=lambda v: v.upper() in ("ON", "1", "TRUE", "YES"),
                        default=True, help="whether kvshard was built with MPI (KVSHARD_WITH_MPI)")


def report(failures):
    """Prints each failure of a test that checks by itself, and their count; its exit status."""
    for failure in failures:
        print("FAIL:", failure)
    print("ok" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0

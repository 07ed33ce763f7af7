#!/usr/bin/env python3
"""k8s.netns: the manifests' own commands run as a cluster would run them, each pod a host.

  k8s_netns_test.py --kvshard BUILD/cli/kvshard --model MODEL.gguf [--k8s K8S_DIR]

Each overlay is rendered (kubectl kustomize) and every pod it would make gets its own network
namespace (`ip netns` + a veth named eth0 on a bridge in a switch namespace; addresses
10.213.0.0/24 of this test's making, nothing routed outside). Each container's command runs there
with the environment Kubernetes and LeaderWorkerSet would give it: its env with fieldRef and
secretKeyRef resolved (POD_IP is the namespace's address), $(VAR) expanded, LWS_LEADER_ADDRESS,
LWS_WORKER_INDEX, LWS_GROUP_SIZE in a group's pods; the Services' names resolve (/etc/netns/NS/
hosts) to the addresses of the pods they select; a ConfigMap mounted at a path is that ConfigMap's
files. Like the kubelet, an exited container is started again (after 1 s). What differs from a
pod, and why: the config's model path is this machine's model file (the PVC's content), and its
threads: 1 (the CPU requests of a GPU node do not fit a CI machine).

Checks:
- colocated: /health 200, and every worker's exec probe (kvshard-connected) passes in its pod;
  the greedy text of a chat request is T.
- multinode (one tp-2 instance, its ranks on two hosts over Gloo): the same greedy text T as the
  tp-1 instances; SIGKILL of rank 1 heals once the kubelet-like restart brings it back (the
  coordinator re-forms the instance): /health 200 again and the same text.
- disaggregated: the same text, and kvshard:kv_transfer_bytes_total > 0 (KV moved from the
  prefill host to the decode host).

Skips (exit 77) where network namespaces cannot be made (not root, no `ip`), without kubectl,
without the model, or when this kvshard cannot form a tp > 1 instance without mpirun.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import k8s_manifests_test as m  # noqa: E402  (rendering and the render's model; skips likewise)

SKIP = 77
SUBNET = "10.213.0"
PREFIX = "kvk8s"
IP = shutil.which("ip") or "/usr/sbin/ip"
PROMPT = "What is the capital of France? Answer in one word."


def sh(*args, check=True, **kw):
    return subprocess.run(list(args), check=check, capture_output=True, text=True, **kw)


class Network:
    """A switch namespace with a bridge, and one namespace per pod attached to it."""

    def __init__(self, tag):
        self.tag = tag
        self.switch = "%s-%s-sw" % (PREFIX, tag)
        self.hosts = []  # (namespace, ip)
        # What an earlier run that was killed may have left (its veths go with the namespaces).
        for ns in sh("ip", "netns", "list").stdout.split():
            if ns.startswith("%s-%s-" % (PREFIX, tag)):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        sh("ip", "netns", "add", self.switch)
        sh("ip", "netns", "exec", self.switch, "ip", "link", "add", "br0", "type", "bridge")
        sh("ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "up")

    def add_host(self):
        n = len(self.hosts) + 1
        ns = "%s-%s-%d" % (PREFIX, self.tag, n)
        ip = "%s.%d" % (SUBNET, n + 1)
        sh("ip", "netns", "add", ns)
        outer, inner = "%s%sv%d" % (PREFIX, self.tag[:2], n), "%s%sp%d" % (PREFIX, self.tag[:2], n)
        sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        sh("ip", "link", "set", outer, "netns", self.switch)
        sh("ip", "link", "set", inner, "netns", ns)
        sh("ip", "netns", "exec", self.switch, "ip", "link", "set", outer, "master", "br0", "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "name", "eth0")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", ip + "/24", "dev", "eth0")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        self.hosts.append((ns, ip))
        return ns, ip

    def write_hosts(self, entries):
        """/etc/netns/NS/hosts (ip netns exec mounts it on /etc/hosts) in every host."""
        text = "127.0.0.1 localhost\n" + "".join("%s %s\n" % (ip, " ".join(names))
                                                  for ip, names in entries)
        for ns, ip in self.hosts:
            d = "/etc/netns/" + ns
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write(text)

    def close(self):
        for ns, _ in self.hosts + [(self.switch, None)]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree("/etc/netns/" + ns, ignore_errors=True)


class Container:
    """One container's process in its pod's namespace, restarted when it exits (the kubelet)."""

    def __init__(self, name, ns, argv, env, log_path):
        self.name, self.ns, self.argv, self.env, self.log_path = name, ns, argv, env, log_path
        self.proc = None
        self.starts = 0
        self.stopping = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while True:
            with self.lock:
                if self.stopping:
                    return
                log = open(self.log_path, "a")
                log.write("--- start %d: %s\n" % (self.starts + 1, " ".join(self.argv)))
                log.flush()
                self.proc = subprocess.Popen([IP, "netns", "exec", self.ns] + self.argv,
                                             env=self.env, stdout=log, stderr=log,
                                             start_new_session=True)
                self.starts += 1
            self.proc.wait()
            log.close()
            time.sleep(1)

    def kill(self):
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self):
        with self.lock:
            self.stopping = True
            p = self.proc
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.thread.join(timeout=5)


def pods_of(docs):
    """Every pod the render would make: (pod name, template, extra env, workload doc)."""
    pods = []
    for doc in docs:
        for path, template, count, role in m.pod_templates(doc):
            if doc.kind == "LeaderWorkerSet":
                size = doc.obj["spec"]["leaderWorkerTemplate"].get("size", 1)
                first = 0 if role in ("leader", "all") else 1
                for i in range(first, first + count):
                    pods.append(("%s-0%s" % (doc.name, "" if i == 0 else "-%d" % i), template,
                                 {"LWS_WORKER_INDEX": str(i), "LWS_GROUP_SIZE": str(size),
                                  "LWS_GROUP_INDEX": "0"}, doc))
            else:
                for i in range(count):
                    name = "%s-%d" % (doc.name, i) if doc.kind == "StatefulSet" else doc.name
                    pods.append((name, template, {}, doc))
    return pods


def resolve_env(container, docs, pod_ip, pod_name, extra):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", **extra}
    for e in container.get("env") or []:
        if "value" in e:
            value = str(e["value"])
        else:
            ref = e.get("valueFrom") or {}
            if "fieldRef" in ref:
                field = ref["fieldRef"]["fieldPath"]
                value = {"status.podIP": pod_ip, "metadata.name": pod_name}.get(field, "")
            elif "secretKeyRef" in ref:
                value = m.secret_value(docs, ref["secretKeyRef"]["name"],
                                       ref["secretKeyRef"]["key"]) or ""
            else:
                value = ""
        # $(VAR) in a value refers to earlier entries, as in Kubernetes.
        env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda mm: env.get(mm.group(1), mm.group(0)),
                                value)
    return env


def http(ns, method, url, body=None, timeout=120):
    args = ["ip", "netns", "exec", ns, "curl", "-s", "-m", str(timeout), "-o", "-", "-w",
            "\n%{http_code}", "-X", method, url]
    if body is not None:
        args += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    r = subprocess.run(args, capture_output=True, text=True)
    text, _, code = r.stdout.rpartition("\n")
    return int(code) if code.isdigit() else 0, text


class Cluster:
    def __init__(self, tag, docs, kvshard, model, k8s_root, workdir):
        self.docs, self.workdir = docs, workdir
        self.net = Network(tag)
        self.containers = []
        self.pods = []  # (name, ns, ip, template, extra, doc)
        for name, template, extra, doc in pods_of(docs):
            ns, ip = self.net.add_host()
            self.pods.append((name, ns, ip, template, extra, doc))
        self.client_ns, _ = self.net.add_host()
        # Services: their names resolve to the pods they select.
        entries = []
        for svc in m.by_kind(docs, "Service").values():
            selector = (svc.obj.get("spec") or {}).get("selector") or {}
            for name, ns, ip, template, extra, doc in self.pods:
                if selector and m.selects(selector, template):
                    entries.append((ip, [svc.name, svc.name + ".default.svc.cluster.local"]))
                    break
        for name, ns, ip, template, extra, doc in self.pods:
            entries.append((ip, [name]))
            if doc.kind == "LeaderWorkerSet" and extra.get("LWS_WORKER_INDEX") == "0":
                self.leader_ip = ip
        self.net.write_hosts(entries)
        self.coordinator_ip = None
        tools = self.tools = os.path.join(k8s_root, "image")
        for name, ns, ip, template, extra, doc in self.pods:
            spec = template.get("spec") or {}
            for c in spec.get("containers") or []:
                if not m.is_kvshard_image(c.get("image", "")):
                    continue
                more = dict(extra)
                if "LWS_WORKER_INDEX" in more:
                    more["LWS_LEADER_ADDRESS"] = self.leader_ip
                env = resolve_env(c, docs, ip, name, more)
                env["PATH"] = tools + ":" + env["PATH"]
                args = [re.sub(r"(?<!\$)\$\((\w+)\)", lambda mm: env.get(mm.group(1), ""), str(a))
                        for a in c.get("args") or []]
                args = self.mount_config_maps(name, c, spec, args, model)
                if args and args[0] == "serve":
                    self.coordinator_ip = ip
                    self.coordinator_ns = ns
                self.containers.append((name, ns, c, Container(
                    name, ns, [kvshard] + args, env,
                    os.path.join(workdir, "%s-%s.log" % (tag, name)))))

    def mount_config_maps(self, pod, c, spec, args, model):
        """Arguments naming a file under a ConfigMap mount name that ConfigMap's file here."""
        out = list(args)
        for mount in c.get("volumeMounts") or []:
            volume = next((v for v in spec.get("volumes") or []
                           if v.get("name") == mount.get("name")), {})
            cm = m.by_kind(self.docs, "ConfigMap").get((volume.get("configMap") or {}).get(
                "name"))
            if cm is None:
                continue
            d = os.path.join(self.workdir, pod, mount["name"])
            os.makedirs(d, exist_ok=True)
            for key, text in (cm.obj.get("data") or {}).items():
                if key.endswith(".yaml"):
                    text = re.sub(r"(?m)^model: .*$", "model: " + model, text)
                    text = re.sub(r"(?m)^threads: .*$", "threads: 1", text)
                with open(os.path.join(d, key), "w") as f:
                    f.write(text)
            mp = mount["mountPath"].rstrip("/")
            out = [d + a[len(mp):] if a == mp or a.startswith(mp + "/") else a for a in out]
        return out

    def health(self):
        return http(self.client_ns, "GET", "http://%s:8000/health" % self.coordinator_ip,
                    timeout=5)[0]

    def wait_healthy(self, seconds):
        deadline = time.time() + seconds
        while time.time() < deadline:
            if self.health() == 200:
                return True
            time.sleep(1)
        return False

    def chat(self):
        code, text = http(self.client_ns, "POST",
                          "http://%s:8000/v1/chat/completions" % self.coordinator_ip,
                          {"model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 24,
                           "messages": [{"role": "user", "content": PROMPT}]})
        if code != 200:
            raise RuntimeError("chat: HTTP %d: %s" % (code, text[:300]))
        return json.loads(text)["choices"][0]["message"]["content"]

    def metric(self, name):
        code, text = http(self.client_ns, "GET", "http://%s:8000/metrics" % self.coordinator_ip)
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def probe(self, ns, c):
        """The container's exec readiness probe, run in its pod."""
        command = ((c.get("readinessProbe") or {}).get("exec") or {}).get("command")
        if command is None:
            return True
        env = {"PATH": self.tools + ":" + os.environ.get("PATH", "")}
        return subprocess.run([IP, "netns", "exec", ns] + command, env=env,
                              capture_output=True).returncode == 0

    def coordinator_log(self):
        for name, ns, c, proc in self.containers:
            if proc.argv[1:2] == ["serve"]:
                with open(proc.log_path) as f:
                    return f.read()
        return ""

    def logs(self):
        out = []
        for name, ns, c, proc in self.containers:
            try:
                with open(proc.log_path) as f:
                    out.append("==== %s\n%s" % (name, "".join(f.readlines()[-15:])))
            except OSError:
                pass
        return "\n".join(out)

    def close(self):
        for _, _, _, proc in reversed(self.containers):
            proc.stop()
        self.net.close()


def netns_available():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("curl") is None:
        return "needs root, ip and curl"
    probe = "%s-probe-%d" % (PREFIX, os.getpid())
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return "ip netns add failed: " + r.stderr.strip()
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def tp_without_mpirun(kvshard):
    r = subprocess.run([kvshard, "worker", "--help"], capture_output=True, text=True)
    return "LWS_WORKER_INDEX" in r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvshard", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--k8s", default=os.path.join(HERE, "..", "..", "k8s"))
    ap.add_argument("--only", help="run this overlay only")
    a = ap.parse_args()
    why = netns_available()
    if why:
        print("SKIP: network namespaces cannot be made here (%s)" % why)
        return SKIP
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        print("SKIP: kubectl not found (it renders the overlays)")
        return SKIP
    if not os.path.exists(a.model):
        print("SKIP: no model at %s" % a.model)
        return SKIP
    kvshard = os.path.abspath(a.kvshard)
    model = os.path.abspath(a.model)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "k8s")
        shutil.copytree(os.path.abspath(a.k8s), root, ignore=shutil.ignore_patterns(".render"))
        token = os.path.join(root, "base", "worker-token")
        if not os.path.exists(token):
            with open(token, "w") as f:
                f.write(os.urandom(16).hex())
        order = ["colocated", "multinode", "disaggregated"]
        if a.only:
            order = [a.only]
        reference = None
        for overlay in order:
            if overlay == "multinode" and not tp_without_mpirun(kvshard):
                print("SKIP multinode: this kvshard cannot form a tp > 1 instance without "
                      "mpirun (no coordinator rendezvous in `kvshard worker --help`)")
                continue
            docs, error = m.render(kubectl, root, overlay, [])
            if error:
                failures.append(error)
                continue
            t0 = time.time()
            cluster = Cluster(overlay[:4], docs, kvshard, model, root, tmp)
            try:
                if not cluster.wait_healthy(300):
                    raise RuntimeError("/health not 200 within 300 s")
                for name, ns, c, proc in cluster.containers:
                    if c.get("args", [""])[0] == "worker" and not cluster.probe(ns, c):
                        raise RuntimeError("%s: its readiness probe fails in its pod" % name)
                text = cluster.chat()
                print("%s: healthy in %.0f s on %d hosts; greedy text %r" % (
                    overlay, time.time() - t0, len(cluster.pods), text))
                if reference is None:
                    reference = text
                elif text != reference:
                    raise RuntimeError("greedy text %r differs from colocated's %r" %
                                       (text, reference))
                if overlay == "multinode":
                    rank1 = next(p for n, ns, c, p in cluster.containers
                                 if p.env.get("LWS_WORKER_INDEX") == "1")
                    starts = rank1.starts
                    rank1.kill()
                    t1 = time.time()
                    deadline = time.time() + 60
                    went_down = False
                    while time.time() < deadline and not went_down:
                        went_down = cluster.health() != 200
                        time.sleep(0.1)
                    if not cluster.wait_healthy(300):
                        raise RuntimeError("rank 1 killed: /health not 200 again within 300 s")
                    if not went_down:
                        raise RuntimeError("rank 1 killed: /health stayed 200 for 60 s")
                    if "re-formed" not in cluster.coordinator_log():
                        raise RuntimeError("rank 1 killed: the coordinator did not log that it "
                                           "re-formed the instance")
                    again = cluster.chat()
                    print("multinode: rank 1 killed, restarted (%d starts), healed in %.0f s; "
                          "greedy text %r" % (rank1.starts - starts, time.time() - t1, again))
                    if again != reference:
                        raise RuntimeError("after healing the text %r differs from %r" %
                                           (again, reference))
                if overlay == "disaggregated":
                    moved = cluster.metric("kvshard:kv_transfer_bytes_total")
                    print("disaggregated: %d KV bytes handed from the prefill host to the decode "
                          "host" % moved)
                    if moved <= 0:
                        raise RuntimeError("kvshard:kv_transfer_bytes_total is 0: no handoff")
            except Exception as e:  # noqa: BLE001  (reported with the pods' logs)
                failures.append("%s: %s\n%s" % (overlay, e, cluster.logs()))
            finally:
                cluster.close()
    for f in failures:
        print("FAIL: " + f)
    print("FAIL" if failures else "PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

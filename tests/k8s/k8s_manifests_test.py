#!/usr/bin/env python3
"""k8s.manifests: the Kubernetes manifests in k8s/ checked without a cluster.

  k8s_manifests_test.py --kvshard BUILD/cli/kvshard [--k8s K8S_DIR]

1. yamllint (k8s/.yamllint) over k8s/.
2. Every overlay rendered with `kubectl kustomize` as a user would, and again with every component
   of k8s/components/ it does not include itself (origin annotations on, to name source files).
   No kubectl: the test skips (exit 77) and says so.
3. Every rendered document validated strictly: built-in kinds with kubernetes-validate's bundled
   schemas, LeaderWorkerSet and ServiceMonitor with tests/k8s/schemas/*.json (whose pod templates
   and selectors $ref Kubernetes' own definitions).
4. Semantic checks against kvshard itself: references (ConfigMap, Secret, PVC, Service) exist;
   the ConfigMap's config.yaml loads through `kvshard serve`'s own parser; every `--instance`
   names an instance of its pools: and every instance has exactly tp ranks of pods; GPU limits
   match the ranks' devices; ports, hosts, heartbeat and timeouts agree with the config; every
   $(VAR) is declared; every kvshard flag is one `kvshard <sub> --help` lists and every value one
   the binary's parser takes; probes, drain, /dev/shm, model volume, security context, requests.
5. The checker checked: deliberately broken copies of k8s/ must fail, naming the source file and
   the path inside the document.

Problems read "k8s/overlays/multinode/workers.yaml: LeaderWorkerSet/kvshard-worker-mixed:
spec.leaderWorkerTemplate.workerTemplate.spec.containers[0].args[6]: ...". Exit 0: all good;
1: problems (listed); 77: skipped.
"""
import argparse
import base64
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile

try:
    import jsonschema
    import kubernetes_validate
    import referencing
    import yaml
    from kubernetes_validate import utils as kv_utils
except ImportError as e:  # scripts/test's venv has them (scripts/lib/common.sh)
    print("SKIP: %s: run with the test venv's Python (kubernetes-validate and its jsonschema, "
          "referencing, PyYAML)" % e)
    sys.exit(77)

K8S_VERSION = "1.32"  # the kubectl the machine image carries; LWS needs >= 1.26, sleep hooks 1.30
SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMAS = os.path.join(HERE, "schemas")
ORIGIN = "config.kubernetes.io/origin"
GPU = "nvidia.com/gpu"
# Defaults of docs/config.md for the keys the checks read.
DEFAULTS = {
    ("server", "host"): "127.0.0.1", ("server", "port"): 8000, ("server", "drain_timeout_s"): 30,
    ("workers", "mode"): "embedded", ("workers", "launcher"): "direct",
    ("workers", "host"): "127.0.0.1", ("workers", "port"): 0,
    ("workers", "register_timeout_ms"): 120000, ("workers", "heartbeat_interval_ms"): 1000,
    ("workers", "dead_after_ms"): 5000,
}
WORKER_FLAG_DEFAULTS = {"--heartbeat-ms": 1000, "--dead-after-ms": 5000,
                        "--connect-timeout-ms": 60000}
SAMPLE_POD_IP = "10.0.0.7"


def fmt_path(parts):
    out = ""
    for p in parts:
        out += "[%d]" % p if isinstance(p, int) else ("." if out else "") + str(p)
    return out or "(document)"


class Doc:
    def __init__(self, obj, origin):
        self.obj = obj
        self.origin = origin
        self.kind = obj.get("kind", "?")
        self.name = (obj.get("metadata") or {}).get("name", "?")

    def where(self, path):
        return "%s: %s/%s: %s" % (self.origin, self.kind, self.name, fmt_path(path))


class Problems:
    def __init__(self):
        self.items = []

    def add(self, doc, path, message):
        self.items.append("%s: %s" % (doc.where(path), message))

    def add_text(self, message):
        self.items.append(message)


# ----------------------------------------------------------------------------------------------
# Rendering


def kustomization_of(directory):
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            with open(path) as f:
                return yaml.safe_load(f) or {}
    return None


def origin_file(root, wrapper, origin_text):
    """The source file of a document from kustomize's origin annotation, as 'k8s/...'."""
    origin = yaml.safe_load(origin_text) or {}
    rel = origin.get("path") or origin.get("configuredIn") or "?"
    path = os.path.normpath(os.path.join(wrapper, rel))
    # A generator's document comes from its files: entry when that can be found.
    by = origin.get("configuredBy") or {}
    if "configuredIn" in origin and by.get("kind") in ("ConfigMapGenerator", "SecretGenerator"):
        path = generator_source(path, by.get("kind"), by.get("name")) or path
    return "k8s/" + os.path.relpath(path, root)


def generator_source(kustomization_path, kind, name):
    with open(kustomization_path) as f:
        k = yaml.safe_load(f) or {}
    key = "configMapGenerator" if kind == "ConfigMapGenerator" else "secretGenerator"
    for g in k.get(key) or []:
        if name is None or g.get("name") == name:
            files = g.get("files") or []
            if len(files) == 1:
                return os.path.join(os.path.dirname(kustomization_path),
                                    files[0].split("=", 1)[-1])
    return None


def render(kubectl, root, overlay, components):
    """Renders k8s/overlays/<overlay> plus `components`; returns (docs, error)."""
    plain = subprocess.run([kubectl, "kustomize", os.path.join(root, "overlays", overlay)],
                           capture_output=True, text=True)
    if plain.returncode != 0:
        return None, "k8s/overlays/%s: kubectl kustomize failed: %s" % (
            overlay, plain.stderr.strip())
    wrapper = os.path.join(root, ".render", overlay)
    os.makedirs(wrapper, exist_ok=True)
    k = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
         "resources": [os.path.relpath(os.path.join(root, "overlays", overlay), wrapper)],
         "buildMetadata": ["originAnnotations"]}
    if components:
        k["components"] = [os.path.relpath(os.path.join(root, "components", c), wrapper)
                           for c in components]
    with open(os.path.join(wrapper, "kustomization.yaml"), "w") as f:
        yaml.safe_dump(k, f)
    r = subprocess.run([kubectl, "kustomize", wrapper], capture_output=True, text=True)
    if r.returncode != 0:
        return None, "k8s/overlays/%s with components %s: kubectl kustomize failed: %s" % (
            overlay, components, r.stderr.strip())
    docs = []
    for obj in yaml.safe_load_all(r.stdout):
        if not obj:
            continue
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        origin = "k8s/overlays/%s (generated)" % overlay
        if ORIGIN in annotations:
            origin = origin_file(root, wrapper, annotations.pop(ORIGIN))
            if not annotations:
                obj["metadata"].pop("annotations")
        docs.append(Doc(obj, origin))
    return docs, None


# ----------------------------------------------------------------------------------------------
# Schemas


def definitions_registry():
    schema_dir = "kubernetes-json-schema/v%s.0-local-strict" % K8S_VERSION
    defs = kv_utils.schema_contents(schema_dir + "/_definitions.json", K8S_VERSION)
    resource = referencing.Resource.from_contents(defs)
    return referencing.Registry().with_resource(defs["$id"], resource)


def own_schema(obj):
    api = re.sub(r"/", "-", str(obj.get("apiVersion", "")))
    path = os.path.join(SCHEMAS, "%s-%s.json" % (str(obj.get("kind", "")).lower(), api))
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return yaml.safe_load(f)


def check_schema(doc, registry, problems):
    schema = own_schema(doc.obj)
    if schema is not None:
        validator = jsonschema.Draft202012Validator(schema, registry=registry)
        for e in sorted(validator.iter_errors(doc.obj), key=lambda e: list(e.absolute_path)):
            problems.add(doc, list(e.absolute_path), "schema: " + e.message)
        return
    try:
        kubernetes_validate.validate(doc.obj, K8S_VERSION, strict=True)
    except kv_utils.ValidationError as e:
        problems.add(doc, list(e.absolute_path), "schema (Kubernetes %s, strict): %s" %
                     (K8S_VERSION, e.message))
    except kv_utils.SchemaNotFoundError as e:
        problems.add(doc, [], "no schema: %s (write one in tests/k8s/schemas/)" % e.message)


# ----------------------------------------------------------------------------------------------
# The render as kvshard sees it


def pod_templates(doc):
    """(path to the PodTemplateSpec, the template, pods it makes per group, role) of a workload."""
    o, spec = doc.obj, doc.obj.get("spec") or {}
    if doc.kind in ("Deployment", "StatefulSet", "ReplicaSet", "DaemonSet", "Job"):
        return [(["spec", "template"], spec.get("template") or {}, spec.get("replicas", 1), None)]
    if doc.kind == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate") or {}
        size = lwt.get("size", 1)
        out = []
        base = ["spec", "leaderWorkerTemplate"]
        if "leaderTemplate" in lwt:
            out.append((base + ["leaderTemplate"], lwt["leaderTemplate"], 1, "leader"))
            out.append((base + ["workerTemplate"], lwt.get("workerTemplate") or {}, size - 1,
                        "worker"))
        else:
            out.append((base + ["workerTemplate"], lwt.get("workerTemplate") or {}, size, "all"))
        return out
    if doc.kind == "Pod":
        return [([], o, 1, None)]
    return []


def is_kvshard_image(image):
    name = str(image).rsplit("/", 1)[-1]
    return name.split("@")[0].split(":")[0] == "kvshard"


def env_map(container):
    return {e.get("name"): e for e in container.get("env") or []}


def parse_help(kvshard, sub):
    """{flag: takes a value} from `kvshard <sub> --help`."""
    r = subprocess.run([kvshard, sub, "--help"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError("%s %s --help failed: %s" % (kvshard, sub, r.stderr))
    flags = {}
    for line in r.stdout.splitlines():
        m = re.match(r"^\s+(?:-\w,)?(--[A-Za-z0-9][\w-]*)(\s+(\S+))?", line)
        if m:
            takes_value = bool(m.group(3)) and m.group(3)[0].isupper()
            flags[m.group(1)] = takes_value
    return flags


class Container:
    def __init__(self, doc, path, template, pods, role, index, c):
        self.doc, self.template, self.pods, self.role = doc, template, pods, role
        self.path = path + ["spec", "containers", index]
        self.c = c
        self.spec = template.get("spec") or {}
        self.args = [str(a) for a in c.get("args") or []]
        self.sub = self.args[0] if self.args else None
        self.flags = {}  # flag -> (value, index in args)

    def at(self, *rest):
        return self.path + list(rest)


def kvshard_containers(docs, problems):
    out = []
    for doc in docs:
        for path, template, pods, role in pod_templates(doc):
            for i, c in enumerate((template.get("spec") or {}).get("containers") or []):
                if not is_kvshard_image(c.get("image", "")):
                    continue
                k = Container(doc, path, template, pods, role, i, c)
                if c.get("command") not in (None, ["kvshard"]):
                    problems.add(doc, k.at("command"),
                                 "run kvshard itself (the image's entrypoint), not %r" %
                                 c.get("command"))
                out.append(k)
    return out


def parse_flags(k, known, problems):
    """Fills k.flags from k.args[1:]; unknown flags are problems."""
    i = 1
    while i < len(k.args):
        a = k.args[i]
        if not a.startswith("--"):
            problems.add(k.doc, k.at("args", i),
                         "'%s': kvshard %s takes no positional arguments" % (a, k.sub))
            i += 1
            continue
        name, eq, value = a.partition("=")
        if name not in known:
            problems.add(k.doc, k.at("args", i), "kvshard %s has no flag %s (its --help lists %s)"
                         % (k.sub, name, ", ".join(sorted(known))))
            i += 1
            continue
        if known[name] and not eq:
            if i + 1 >= len(k.args):
                problems.add(k.doc, k.at("args", i), "%s needs a value" % name)
                break
            value = k.args[i + 1]
            k.flags.setdefault(name, []).append((value, i + 1))
            i += 2
        else:
            k.flags.setdefault(name, []).append((value, i))
            i += 1


def flag(k, name):
    v = k.flags.get(name)
    return v[-1] if v else (None, None)


def secret_value(docs, name, key):
    for d in docs:
        if d.kind == "Secret" and d.name == name:
            if key in (d.obj.get("stringData") or {}):
                return d.obj["stringData"][key]
            if key in (d.obj.get("data") or {}):
                return base64.b64decode(d.obj["data"][key]).decode("utf-8", "replace")
    return None


def substitute(k, docs, problems, text, index):
    """`text` with every $(VAR) replaced as the kubelet would, from the container's env."""
    env = env_map(k.c)

    def value(m):
        name = m.group(1)
        e = env.get(name)
        if e is None:
            problems.add(k.doc, k.at("args", index),
                         "$(%s) is not declared in the container's env (Kubernetes passes it "
                         "through unexpanded)" % name)
            return m.group(0)
        if "value" in e:
            return str(e["value"])
        ref = e.get("valueFrom") or {}
        if "fieldRef" in ref:
            return SAMPLE_POD_IP if "podIP" in ref["fieldRef"].get("fieldPath", "") else "x"
        if "secretKeyRef" in ref:
            v = secret_value(docs, ref["secretKeyRef"].get("name"), ref["secretKeyRef"].get("key"))
            return v if v is not None else "x"
        return "x"

    return re.sub(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, text)


# ----------------------------------------------------------------------------------------------
# Checks


def by_kind(docs, kind):
    return {d.name: d for d in docs if d.kind == kind}


def check_references(docs, problems):
    names = {kind: by_kind(docs, kind) for kind in
             ("ConfigMap", "Secret", "PersistentVolumeClaim", "Service")}
    for doc in docs:
        for path, template, _, _ in pod_templates(doc):
            spec = template.get("spec") or {}
            for i, v in enumerate(spec.get("volumes") or []):
                for field, kind, key in (("configMap", "ConfigMap", "name"),
                                         ("secret", "Secret", "secretName"),
                                         ("persistentVolumeClaim", "PersistentVolumeClaim",
                                          "claimName")):
                    if field in v and v[field].get(key) not in names[kind]:
                        problems.add(doc, path + ["spec", "volumes", i, field, key],
                                     "%s '%s' is not in the render" % (kind, v[field].get(key)))
            for ci, c in enumerate(spec.get("containers") or []):
                for ei, e in enumerate(c.get("env") or []):
                    ref = e.get("valueFrom") or {}
                    for field, kind in (("configMapKeyRef", "ConfigMap"),
                                        ("secretKeyRef", "Secret")):
                        if field not in ref:
                            continue
                        at = path + ["spec", "containers", ci, "env", ei, "valueFrom", field]
                        target = names[kind].get(ref[field].get("name"))
                        if target is None:
                            problems.add(doc, at + ["name"], "%s '%s' is not in the render" %
                                         (kind, ref[field].get("name")))
                        elif ref[field].get("key") not in {
                                **(target.obj.get("data") or {}),
                                **(target.obj.get("stringData") or {})}:
                            problems.add(doc, at + ["key"], "%s '%s' has no key '%s'" %
                                         (kind, target.name, ref[field].get("key")))
        if doc.kind == "StatefulSet":
            svc = (doc.obj.get("spec") or {}).get("serviceName")
            if svc and svc not in names["Service"]:
                problems.add(doc, ["spec", "serviceName"], "Service '%s' is not in the render" % svc)
    templates = [t for d in docs for _, t, _, _ in pod_templates(d)]
    for svc in names["Service"].values():
        selector = (svc.obj.get("spec") or {}).get("selector") or {}
        if selector and not any(selects(selector, t) for t in templates):
            problems.add(svc, ["spec", "selector"], "selects no pod of the render")
    for sm in by_kind(docs, "ServiceMonitor").values():
        spec = sm.obj.get("spec") or {}
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        chosen = [s for s in names["Service"].values()
                  if all(((s.obj.get("metadata") or {}).get("labels") or {}).get(k) == v
                         for k, v in labels.items())]
        if not chosen:
            problems.add(sm, ["spec", "selector"], "selects no Service of the render")
        for i, ep in enumerate(spec.get("endpoints") or []):
            ports = {p.get("name") for s in chosen for p in s.obj["spec"].get("ports") or []}
            if ep.get("port") not in ports:
                problems.add(sm, ["spec", "endpoints", i, "port"],
                             "no selected Service has a port named '%s'" % ep.get("port"))


def selects(selector, template):
    labels = (template.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def cfg(config, section, key):
    v = (config.get(section) or {}).get(key)
    return DEFAULTS[(section, key)] if v is None else v


def instances_of(config):
    """{instance name: (tp, devices, pool index, instance index)} as kvshard names them."""
    pools = config.get("pools") or [
        {"name": "default", "instances": [{"tp": config.get("tp", 1)}]}]
    out = {}
    for pi, pool in enumerate(pools):
        insts = pool.get("instances") or []
        for ii, inst in enumerate(insts):
            name = pool.get("name") if len(insts) == 1 else "%s-%d" % (pool.get("name"), ii)
            out[name] = (int(inst.get("tp", 1)), [str(d) for d in inst.get("devices") or []],
                         pi, ii)
    return out


def as_int(value, default):
    """`value` as an int; `default` when absent; None when not a number."""
    if value is None:
        return default
    try:
        return int(str(value))
    except ValueError:
        return None


def probe_window(probe):
    if not probe:
        return 0
    return (probe.get("initialDelaySeconds", 0) +
            probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3))


def port_number(container, port):
    if isinstance(port, int):
        return port
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return p.get("containerPort")
    return None


def mount_for(container, spec, path):
    """(mount index, mount, volume) of the mount holding `path`."""
    best = None
    for i, m in enumerate(container.get("volumeMounts") or []):
        mp = m.get("mountPath", "").rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best[1].get("mountPath", "")):
                best = (i, m)
    if best is None:
        return None, None, None
    volume = next((v for v in spec.get("volumes") or [] if v.get("name") == best[1].get("name")),
                  None)
    return best[0], best[1], volume


def sleep_seconds(container):
    pre = (container.get("lifecycle") or {}).get("preStop") or {}
    return (pre.get("sleep") or {}).get("seconds", 0)


def check_config_with_kvshard(kvshard, coordinator, docs, config_doc, config_key, problems, tmp):
    """Runs `kvshard serve` with the manifest's own arguments on the ConfigMap's text: its config
    reader (and the flags' --set overrides) either rejects it, naming the key, or accepts it and
    fails on the model file, which is not here."""
    config_text = config_doc.obj["data"][config_key]
    config_origin = config_doc.origin
    path = os.path.join(tmp, "config.yaml")
    with open(path, "w") as f:
        f.write(config_text)
    args = [substitute(coordinator, docs, Problems(), a, i)
            for i, a in enumerate(coordinator.args)]
    value, index = flag(coordinator, "--config")
    args[index] = path
    r = subprocess.run([kvshard] + args, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KVSHARD_NO_REEXEC": "1"})
    config = yaml.safe_load(config_text) or {}
    model = str(config.get("model", ""))
    accepted = "kvshard: error: %s: " % model
    first = r.stderr.strip().splitlines()[0] if r.stderr.strip() else ""
    if os.path.exists(model):
        problems.add(coordinator.doc, coordinator.at("args"),
                     "the model %s exists on this machine: the config check needs it absent" %
                     model)
    elif r.returncode == 0 or not first.startswith(accepted):
        message = first.replace(path, config_origin) or "exit %d" % r.returncode
        if path in first:  # the file's own value
            problems.add(config_doc, ["data", os.path.basename(config_key)],
                         "kvshard serve rejects it: %s" % message)
        else:  # a flag's (--set KEY=VALUE)
            problems.add(coordinator.doc, coordinator.at("args"),
                         "kvshard serve rejects its arguments: %s" % message)


def check_values_with_kvshard(kvshard, k, docs, problems):
    """The binary's own flag parser on the container's arguments (values converted and range-
    checked; `--help` last so that nothing runs)."""
    args = [substitute(k, docs, Problems(), a, i) for i, a in enumerate(k.args)]
    r = subprocess.run([kvshard] + args + ["--help"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KVSHARD_NO_REEXEC": "1"})
    if r.returncode != 0:
        message = r.stderr.strip().splitlines()[0] if r.stderr.strip() else "exit %d" % (
            r.returncode)
        message = re.sub(r"not in range .*", "out of range", message)
        at = k.at("args")
        m = re.match(r"^(--[\w-]+)", message) or re.search(r"(--[\w-]+)", message)
        if m and m.group(1) in k.flags:
            at = k.at("args", k.flags[m.group(1)][-1][1])
        problems.add(k.doc, at, "kvshard %s rejects it: %s" % (k.sub, message))


def check_common(k, problems, config, image_tools):
    c, spec = k.c, k.spec
    image = str(c.get("image", ""))
    tag = image.rsplit("/", 1)[-1].partition(":")[2]
    if "@" not in image and tag in ("", "latest"):
        problems.add(k.doc, k.at("image"), "'%s': name a version (kvshard:<version>), not "
                     "latest" % image)
    sc, psc = c.get("securityContext") or {}, spec.get("securityContext") or {}
    if not (sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True):
        problems.add(k.doc, k.at("securityContext"), "runAsNonRoot must be true")
    if sc.get("runAsUser", psc.get("runAsUser")) == 0:
        problems.add(k.doc, k.at("securityContext", "runAsUser"), "runs as root")
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.add(k.doc, k.at("securityContext", "allowPrivilegeEscalation"),
                     "must be false")
    requests = (c.get("resources") or {}).get("requests") or {}
    for r in ("cpu", "memory"):
        if r not in requests:
            problems.add(k.doc, k.at("resources", "requests"), "no %s request" % r)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe)
        if not p:
            problems.add(k.doc, k.at(probe), "missing")
            continue
        command = (p.get("exec") or {}).get("command")
        if command is not None:
            if command[0] not in image_tools:
                problems.add(k.doc, k.at(probe, "exec", "command", 0),
                             "'%s' is not a tool the image installs (k8s/image/: %s)" %
                             (command[0], ", ".join(sorted(image_tools))))
            elif command[0] == "kvshard-connected" and (
                    len(command) != 2 or command[1] != str(cfg(config, "workers", "port"))):
                problems.add(k.doc, k.at(probe, "exec", "command"),
                             "kvshard-connected must probe workers.port %s" %
                             cfg(config, "workers", "port"))
    model = str(config.get("model", ""))
    mi, mount, volume = mount_for(c, spec, model)
    if mount is None:
        problems.add(k.doc, k.at("volumeMounts"),
                     "no volume holds the config's model %s" % model)
    else:
        if mount.get("readOnly") is not True:
            problems.add(k.doc, k.at("volumeMounts", mi, "readOnly"),
                         "the model volume must be mounted read-only")
        pvc = (volume or {}).get("persistentVolumeClaim")
        if pvc is None:
            problems.add(k.doc, k.at("volumeMounts", mi),
                         "the model volume must be a PersistentVolumeClaim")
        elif pvc.get("readOnly") is not True:
            problems.add(k.doc, k.path[:-3] + ["spec", "volumes"],
                         "the model claim must be readOnly")


def check_coordinator(k, docs, problems, config):
    c, spec = k.c, k.spec
    ports = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
    for name, want in (("http", cfg(config, "server", "port")),
                       ("registry", cfg(config, "workers", "port"))):
        if ports.get(name) != want:
            problems.add(k.doc, k.at("ports"), "container port '%s' is %s; the config says %s" %
                         (name, ports.get(name), want))
    for section in ("server", "workers"):
        if cfg(config, section, "host") not in ("0.0.0.0", "::"):
            problems.add(k.doc, k.at("args"), "the config's %s.host %s cannot be reached from "
                         "other pods (use 0.0.0.0)" % (section, cfg(config, section, "host")))
    if cfg(config, "workers", "mode") != "processes" or cfg(config, "workers",
                                                            "launcher") != "external":
        problems.add(k.doc, k.at("args"), "worker pods need workers.mode: processes and "
                     "launcher: external in the config")
    for probe in ("startupProbe", "readinessProbe"):
        http = (c.get(probe) or {}).get("httpGet") or {}
        if http.get("path") != "/health" or port_number(c, http.get("port")) != cfg(
                config, "server", "port"):
            problems.add(k.doc, k.at(probe, "httpGet"), "must GET /health on server.port %s" %
                         cfg(config, "server", "port"))
    need = cfg(config, "workers", "register_timeout_ms") / 1000
    if probe_window(c.get("startupProbe")) < need:
        problems.add(k.doc, k.at("startupProbe"), "allows %ss; the coordinator waits up to "
                     "workers.register_timeout_ms (%ss) for its workers before it listens" %
                     (probe_window(c.get("startupProbe")), need))
    drain = cfg(config, "server", "drain_timeout_s")
    grace = spec.get("terminationGracePeriodSeconds", 30)
    if grace < sleep_seconds(c) + drain + 10:
        problems.add(k.doc, k.path[:-3] + ["spec", "terminationGracePeriodSeconds"],
                     "%ss does not cover preStop (%ss) + server.drain_timeout_s (%ss) + 10 s to "
                     "stop the workers" % (grace, sleep_seconds(c), drain))


def check_worker(k, docs, problems, config, instances, services, coordinator, ranks):
    c, spec = k.c, k.spec
    env = env_map(c)
    instance, ii = flag(k, "--instance")
    if instance not in instances:
        problems.add(k.doc, k.at("args", ii) if ii else k.at("args"),
                     "--instance '%s' is not an instance of the config's pools: (%s)" %
                     (instance, ", ".join(instances)))
        return
    tp, devices, _, _ = instances[instance]
    tpv, ti = flag(k, "--tp")
    if tpv is not None and str(tpv) != str(tp):
        problems.add(k.doc, k.at("args", ti), "--tp %s; instance %s has tp %d" %
                     (tpv, instance, tp))
    if k.doc.kind == "LeaderWorkerSet" and flag(k, "--rank")[0] is not None:
        problems.add(k.doc, k.at("args", flag(k, "--rank")[1]),
                     "leave --rank out: each pod's rank is LWS_WORKER_INDEX (leader: 0)")
    want_model, mi = flag(k, "--model")
    model = str(config.get("model", ""))
    if want_model is not None and want_model not in (model, os.path.basename(model)):
        problems.add(k.doc, k.at("args", mi), "--model %s; the config serves %s (the "
                     "coordinator would refuse this worker)" % (want_model, model))
    # Ranks: one worker process (one container) is one rank.
    ranks.setdefault(instance, []).append((k, k.pods))
    # GPUs: each rank's device; the pod sees its own GPUs from 0.
    gpus_wanted = 0 if not devices or all(d == "cpu" for d in devices) else 1
    limits = (c.get("resources") or {}).get("limits") or {}
    gpus = int(limits.get(GPU, 0))
    if gpus != gpus_wanted:
        problems.add(k.doc, k.at("resources", "limits", GPU) if GPU in limits else
                     k.at("resources", "limits"),
                     "%d GPUs for one rank of instance %s whose devices are %s (want %d)" %
                     (gpus, instance, devices or ["cpu"], gpus_wanted))
    for d in devices:
        if d != "cpu" and int(d) >= max(gpus, 1):
            problems.add(k.doc, k.at("resources", "limits"),
                         "instance %s names GPU %s; a pod with %d GPUs sees 0..%d" %
                         (instance, d, gpus, gpus - 1))
    # The coordinator's address: a Service that reaches it while it is not Ready.
    address, ai = flag(k, "--coordinator")
    host, _, port = str(address).rpartition(":")
    svc = services.get(host.split(".")[0])
    if svc is None:
        problems.add(k.doc, k.at("args", ai), "--coordinator %s: no Service '%s' in the render"
                     % (address, host.split(".")[0]))
    else:
        s = svc.obj.get("spec") or {}
        sport = next((p for p in s.get("ports") or [] if str(p.get("port")) == port), None)
        if sport is None or port_number(coordinator.c, sport.get("targetPort", sport.get(
                "port"))) != cfg(config, "workers", "port"):
            problems.add(k.doc, k.at("args", ai), "--coordinator %s: Service %s does not send "
                         "port %s to the coordinator's workers.port %s" %
                         (address, svc.name, port, cfg(config, "workers", "port")))
        if not selects(s.get("selector") or {}, coordinator.template):
            problems.add(svc, ["spec", "selector"], "does not select the coordinator, which "
                         "workers reach through it")
        if s.get("publishNotReadyAddresses") is not True:
            problems.add(svc, ["spec", "publishNotReadyAddresses"],
                         "must be true: the coordinator is not Ready until its workers register")
    for name, key in (("--heartbeat-ms", "heartbeat_interval_ms"),
                      ("--dead-after-ms", "dead_after_ms")):
        v, vi = flag(k, name)
        v = WORKER_FLAG_DEFAULTS[name] if v is None else v
        if str(v) != str(cfg(config, "workers", key)):
            problems.add(k.doc, k.at("args", vi) if vi else k.at("args"),
                         "%s %s; the config's workers.%s is %s" %
                         (name, v, key, cfg(config, "workers", key)))
    kvh, ki = flag(k, "--kv-host")
    m = re.fullmatch(r"\$\((\w+)\)", str(kvh))
    ref = ((env.get(m.group(1)) or {}).get("valueFrom") or {}).get("fieldRef") if m else None
    if not ref or ref.get("fieldPath") != "status.podIP":
        problems.add(k.doc, k.at("args", ki) if ki else k.at("args"),
                     "--kv-host must be $(POD_IP) with POD_IP from fieldRef status.podIP "
                     "(other instances send KV there)")
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if var not in env:
            problems.add(k.doc, k.at("env"), "no %s (the collective's network interface)" % var)
    # The token: the same Secret key as the coordinator's --set workers.token=$(VAR).
    token = ((env.get("KVSHARD_WORKER_TOKEN") or {}).get("valueFrom") or {}).get("secretKeyRef")
    coord_token = None
    for value, _ in coordinator.flags.get("--set", []):
        mm = re.fullmatch(r"workers\.token=\$\((\w+)\)", value)
        if mm:
            coord_token = ((env_map(coordinator.c).get(mm.group(1)) or {}).get(
                "valueFrom") or {}).get("secretKeyRef")
    if flag(k, "--token-file")[0] is None and (token is None or coord_token is None or (
            token.get("name"), token.get("key")) != (coord_token.get("name"),
                                                     coord_token.get("key"))):
        problems.add(k.doc, k.at("env"), "KVSHARD_WORKER_TOKEN must come from the Secret key "
                     "the coordinator's --set workers.token=$(...) reads")
    # /dev/shm in memory, for the collective's shared-memory transports.
    mi, mount, volume = mount_for(c, spec, "/dev/shm")
    if mount is None or mount.get("mountPath") != "/dev/shm" or (
            (volume or {}).get("emptyDir") or {}).get("medium") != "Memory":
        problems.add(k.doc, k.at("volumeMounts"), "/dev/shm must be an emptyDir with medium "
                     "Memory")
    connect_ms = as_int(flag(k, "--connect-timeout-ms")[0],
                        WORKER_FLAG_DEFAULTS["--connect-timeout-ms"])
    connect_s = (connect_ms or 0) / 1000  # not a number: the binary's check says so
    if probe_window(c.get("startupProbe")) < connect_s:
        problems.add(k.doc, k.at("startupProbe"), "allows %ss; the worker waits up to "
                     "--connect-timeout-ms (%ss) for the coordinator" %
                     (probe_window(c.get("startupProbe")), connect_s))
    drain = cfg(config, "server", "drain_timeout_s")
    if sleep_seconds(c) < drain:
        problems.add(k.doc, k.at("lifecycle", "preStop"), "a worker must outlive the "
                     "coordinator's drain (server.drain_timeout_s %ss); preStop waits %ss" %
                     (drain, sleep_seconds(c)))
    grace = spec.get("terminationGracePeriodSeconds", 30)
    if grace < sleep_seconds(c) + 5:
        problems.add(k.doc, k.path[:-3] + ["spec", "terminationGracePeriodSeconds"],
                     "%ss does not cover preStop's %ss" % (grace, sleep_seconds(c)))
    threads = as_int(flag(k, "--threads")[0], as_int(config.get("threads"), 0)) or 0
    cpu = str(((c.get("resources") or {}).get("requests") or {}).get("cpu", "0"))
    cores = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    if threads <= 0:
        problems.add(k.doc, k.at("args"), "set threads (config or --threads): 0 divides the "
                     "coordinator's cores among workers elsewhere")
    elif threads > cores:
        problems.add(k.doc, k.at("resources", "requests", "cpu"),
                     "%s CPUs for %d threads" % (cpu, threads))


def check_ranks(docs, problems, instances, ranks, config_doc):
    for name, (tp, _, pi, ii) in instances.items():
        got = ranks.get(name, [])
        total = sum(p for _, p in got)
        if not got:
            problems.add(config_doc, ["data", "config.yaml"],
                         "instance %s (pools[%d].instances[%d]) has no worker pods" %
                         (name, pi, ii))
        elif total != tp:
            k = got[0][0]
            where = (["spec", "leaderWorkerTemplate", "size"] if k.doc.kind == "LeaderWorkerSet"
                     else ["spec", "replicas"])
            problems.add(k.doc, where, "instance %s has tp %d but its workloads make %d pods "
                         "of one rank each" % (name, tp, total))
    for doc in docs:
        if doc.kind != "LeaderWorkerSet":
            continue
        spec = doc.obj.get("spec") or {}
        if spec.get("replicas", 1) != 1:
            problems.add(doc, ["spec", "replicas"], "one group is one instance: the coordinator "
                         "takes one set of ranks per instance name")
        lwt = spec.get("leaderWorkerTemplate") or {}
        if lwt.get("restartPolicy") != "RecreateGroupOnPodRestart":
            problems.add(doc, ["spec", "leaderWorkerTemplate", "restartPolicy"],
                         "must be RecreateGroupOnPodRestart: a rank that restarts re-forms the "
                         "whole instance")


def check_secret_tokens(docs, problems):
    for d in docs:
        if d.kind != "Secret":
            continue
        for key, value in (d.obj.get("data") or {}).items():
            text = base64.b64decode(value).decode("utf-8", "replace")
            if not text or re.search(r"\s", text):
                problems.add(d, ["data", key], "empty or holds whitespace (a newline at the "
                             "end?): workers would present another token than the coordinator")


def image_tools(root):
    d = os.path.join(root, "image")
    return {n for n in os.listdir(d) if os.access(os.path.join(d, n), os.X_OK)} if (
        os.path.isdir(d)) else set()


def check_render(docs, kvshard, helps, root, registry, problems, tmp):
    for d in docs:
        check_schema(d, registry, problems)
    check_references(docs, problems)
    check_secret_tokens(docs, problems)
    containers = kvshard_containers(docs, problems)
    for k in containers:
        if k.sub not in helps:
            problems.add(k.doc, k.at("args", 0) if k.args else k.at("args"),
                         "'%s' is not a kvshard subcommand this check knows (%s)" %
                         (k.sub, ", ".join(helps)))
            continue
        parse_flags(k, helps[k.sub], problems)
        for i, a in enumerate(k.args):
            substitute(k, docs, problems, a, i)
        check_values_with_kvshard(kvshard, k, docs, problems)
    coordinators = [k for k in containers if k.sub == "serve"]
    if len(coordinators) != 1:
        problems.add_text("%d kvshard serve containers in the render; want one" %
                          len(coordinators))
        return
    coordinator = coordinators[0]
    value, _ = flag(coordinator, "--config")
    if value is None:
        problems.add(coordinator.doc, coordinator.at("args"), "no --config")
        return
    mi, mount, volume = mount_for(coordinator.c, coordinator.spec, value)
    cm = by_kind(docs, "ConfigMap").get(((volume or {}).get("configMap") or {}).get("name"))
    key = os.path.relpath(value, mount.get("mountPath")) if mount else None
    if cm is None or key not in (cm.obj.get("data") or {}):
        problems.add(coordinator.doc, coordinator.at("args"),
                     "--config %s is not a key of a ConfigMap mounted there" % value)
        return
    text = cm.obj["data"][key]
    config = yaml.safe_load(text) or {}
    check_config_with_kvshard(kvshard, coordinator, docs, cm, key, problems, tmp)
    instances = instances_of(config)
    services = by_kind(docs, "Service")
    check_common(coordinator, problems, config, image_tools(root))
    check_coordinator(coordinator, docs, problems, config)
    clients = [s for s in services.values() if selects(
        (s.obj.get("spec") or {}).get("selector") or {}, coordinator.template) and any(
            port_number(coordinator.c, p.get("targetPort", p.get("port"))) ==
            cfg(config, "server", "port") for p in s.obj["spec"].get("ports") or [])]
    if not clients:
        problems.add(coordinator.doc, coordinator.at("ports"),
                     "no Service sends clients to server.port %s" % cfg(config, "server", "port"))
    ranks = {}
    for k in containers:
        if k.sub == "worker":
            check_common(k, problems, config, image_tools(root))
            check_worker(k, docs, problems, config, instances, services, coordinator, ranks)
    check_ranks(docs, problems, instances, ranks, cm)


# ----------------------------------------------------------------------------------------------
# The whole tree


def check_tree(root, kvshard, kubectl, helps, registry, log=print):
    """Problems of the k8s/ tree at `root` (a copy: a worker token is made when absent)."""
    problems = Problems()
    yamllint = shutil.which("yamllint")
    if yamllint:
        r = subprocess.run([yamllint, "-f", "parsable", "-c", os.path.join(root, ".yamllint"),
                            root], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            problems.add_text("k8s/" + os.path.relpath(line.split(":", 1)[0], root) + ":" +
                              line.split(":", 1)[1] + " (yamllint)")
        if r.returncode != 0 and not r.stdout.strip():
            problems.add_text("yamllint failed: " + r.stderr.strip())
    else:
        log("note: yamllint not found; the lint step is skipped")
    token = os.path.join(root, "base", "worker-token")
    if not os.path.exists(token):
        with open(token, "w") as f:
            f.write(secrets.token_hex(32))
    overlays = sorted(o for o in os.listdir(os.path.join(root, "overlays"))
                      if kustomization_of(os.path.join(root, "overlays", o)) is not None)
    components = sorted(c for c in os.listdir(os.path.join(root, "components"))
                        if kustomization_of(os.path.join(root, "components", c)) is not None)
    if not overlays:
        problems.add_text("k8s/overlays: no overlay")
    for overlay in overlays:
        own = kustomization_of(os.path.join(root, "overlays", overlay)).get("components") or []
        own = {os.path.basename(os.path.normpath(c)) for c in own}
        extra = [c for c in components if c not in own]
        docs, error = render(kubectl, root, overlay, extra)
        if error:
            problems.add_text(error)
            continue
        log("rendered overlays/%s%s: %d documents" % (
            overlay, " + " + ", ".join(extra) if extra else "", len(docs)))
        with tempfile.TemporaryDirectory() as tmp:
            check_render(docs, kvshard, helps, root, registry, problems, tmp)
    return problems.items


# Deliberately broken copies: (what, file, old text, new text, occurrence, expected problems: a
# list of substrings that one problem must all contain, or a list of such lists).
BREAKAGES = [
    ("a worker flag value the binary rejects", "overlays/colocated/workers.yaml",
     '- --connect-timeout-ms\n            - "600000"', '- --connect-timeout-ms\n            - "soon"',
     1, ["k8s/overlays/colocated/workers.yaml", "StatefulSet/kvshard-worker-mixed-0",
         "spec.template.spec.containers[0].args[10]", "kvshard worker rejects it",
         "--connect-timeout-ms"]),
    ("a config value kvshard's parser rejects", "overlays/disaggregated/config.yaml",
     "kv_transfer:\n", "scheduler:\n  max_num_seqs: -3\nkv_transfer:\n", 1,
     ["k8s/overlays/disaggregated/config.yaml: ConfigMap/kvshard-config", "data.config.yaml",
      "kvshard serve rejects it", "k8s/overlays/disaggregated/config.yaml:34: "
      "scheduler.max_num_seqs: invalid value '-3'"]),
    ("a --set override kvshard's parser rejects", "base/coordinator.yaml",
     "workers.token=$(KVSHARD_WORKER_TOKEN)", "workers.tokn=$(KVSHARD_WORKER_TOKEN)", 1,
     ["k8s/base/coordinator.yaml", "Deployment/kvshard-coordinator",
      "spec.template.spec.containers[0].args", "unknown key 'workers.tokn'"]),
    ("an unknown worker flag", "overlays/disaggregated/workers.yaml", "- --kv-host", "- --kv-addr",
     3, ["k8s/overlays/disaggregated/workers.yaml", "StatefulSet/kvshard-worker-decode",
         "spec.template.spec.containers[0].args[7]", "has no flag --kv-addr"]),
    ("tp that disagrees with the config", "overlays/multinode/workers.yaml",
     '- --tp\n              - "2"', '- --tp\n              - "4"', 2,
     ["k8s/overlays/multinode/workers.yaml", "LeaderWorkerSet/kvshard-worker-mixed",
      "spec.leaderWorkerTemplate.workerTemplate.spec.containers[0].args[6]", "instance mixed has "
      "tp 2"]),
    ("a GPU limit that is not the rank's device", "overlays/multinode/workers.yaml",
     "nvidia.com/gpu: 1", "nvidia.com/gpu: 2", 1,
     ["spec.leaderWorkerTemplate.leaderTemplate.spec.containers[0].resources.limits"
      ".nvidia.com/gpu", "2 GPUs for one rank"]),
    ("an instance that does not exist", "overlays/colocated/workers.yaml", "- mixed-1",
     "- mixed-2", 1, [["k8s/overlays/colocated/workers.yaml", "args[4]",
                       "--instance 'mixed-2' is not an instance"],
                      ["k8s/overlays/colocated/config.yaml", "data.config.yaml",
                       "instance mixed-1 (pools[0].instances[1]) has no worker pods"]]),
    ("a worker that expects another model", "overlays/multinode/workers.yaml",
     "- SmolLM2-135M-Instruct.Q4_1.gguf", "- Llama-3-8B.gguf", 1,
     ["LeaderWorkerSet/kvshard-worker-mixed",
      "spec.leaderWorkerTemplate.leaderTemplate.spec.containers[0].args[16]",
      "--model Llama-3-8B.gguf; the config serves /models/SmolLM2-135M-Instruct.Q4_1.gguf"]),
    ("a claim that is not in the render", "base/coordinator.yaml", "claimName: kvshard-models",
     "claimName: kvshard-model", 1,
     ["k8s/base/coordinator.yaml", "Deployment/kvshard-coordinator",
      "spec.template.spec.volumes[1].persistentVolumeClaim.claimName",
      "PersistentVolumeClaim 'kvshard-model' is not in the render"]),
    ("a workers Service that hides the unready coordinator", "base/services.yaml",
     "publishNotReadyAddresses: true", "publishNotReadyAddresses: false", 1,
     ["k8s/base/services.yaml", "Service/kvshard-workers", "spec.publishNotReadyAddresses"]),
    ("a grace period shorter than the drain", "base/coordinator.yaml",
     "terminationGracePeriodSeconds: 50", "terminationGracePeriodSeconds: 20", 1,
     ["k8s/base/coordinator.yaml", "spec.template.spec.terminationGracePeriodSeconds",
      "server.drain_timeout_s"]),
    ("an undeclared $(VAR)", "overlays/colocated/workers.yaml", "- $(POD_IP)", "- $(MY_IP)", 1,
     ["StatefulSet/kvshard-worker-mixed-0", "spec.template.spec.containers[0].args[8]",
      "$(MY_IP) is not declared"]),
    ("a field Kubernetes does not have", "base/coordinator.yaml", "readOnlyRootFilesystem",
     "readOnlyRootFileSystem", 1,
     ["k8s/base/coordinator.yaml", "spec.template.spec.containers[0].securityContext",
      "schema (Kubernetes"]),
    ("a LeaderWorkerSet field value its schema refuses", "overlays/multinode/workers.yaml",
     "restartPolicy: RecreateGroupOnPodRestart", "restartPolicy: RecreateOnRestart", 1,
     ["k8s/overlays/multinode/workers.yaml", "spec.leaderWorkerTemplate.restartPolicy",
      "schema:"]),
    ("a ServiceMonitor on a port no Service has", "components/monitoring/servicemonitor.yaml",
     "- port: http", "- port: web", 1,
     ["k8s/components/monitoring/servicemonitor.yaml", "ServiceMonitor/kvshard",
      "spec.endpoints[0].port"]),
    ("a startup probe shorter than the workers' registration", "base/coordinator.yaml",
     "failureThreshold: 66", "failureThreshold: 6", 1,
     ["Deployment/kvshard-coordinator", "startupProbe", "workers.register_timeout_ms"]),
]


def check_readme_examples(root, registry):
    """The YAML examples of k8s/README.md whose kinds have a schema here (the HPA; KEDA's
    ScaledObject has none offline and is only parsed), strictly."""
    out = Problems()
    path = os.path.join(root, "README.md")
    if not os.path.exists(path):
        return ["k8s/README.md is missing"]
    with open(path) as f:
        text = f.read()
    for n, block in enumerate(re.findall(r"```yaml\n(.*?)```", text, re.S)):
        try:
            obj = yaml.safe_load(block)
        except yaml.YAMLError as e:
            out.add_text("k8s/README.md: yaml example %d does not parse: %s" % (n + 1, e))
            continue
        doc = Doc(obj, "k8s/README.md (yaml example %d)" % (n + 1))
        if obj.get("apiVersion", "").startswith("keda.sh/"):
            continue
        check_schema(doc, registry, out)
    return out.items


def check_probe_tool(root):
    """kvshard-connected (the workers' probe) on real sockets: 0 with an established connection to
    the port, 1 without. Returns problems."""
    import socket
    tool = os.path.join(root, "image", "kvshard-connected")
    out = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            with accepted:
                r = subprocess.run([tool, str(port)], capture_output=True, text=True)
                if r.returncode != 0:
                    out.append("k8s/image/kvshard-connected %d: exit %d with a connection open "
                               "(%s)" % (port, r.returncode, r.stderr.strip()))
        # The client side is closed now: no established connection to `port` is left.
        r = subprocess.run([tool, str(port)], capture_output=True, text=True)
        if r.returncode != 1:
            out.append("k8s/image/kvshard-connected %d: exit %d with no connection open" %
                       (port, r.returncode))
    r = subprocess.run([tool, "notaport"], capture_output=True, text=True)
    if r.returncode != 2:
        out.append("k8s/image/kvshard-connected notaport: exit %d, want 2" % r.returncode)
    return out


def break_copy(root, file, old, new, occurrence):
    path = os.path.join(root, file)
    with open(path) as f:
        text = f.read()
    at = -1
    for _ in range(occurrence):
        at = text.find(old, at + 1)
        if at < 0:
            raise RuntimeError("%s: '%s' occurs fewer than %d times" % (file, old, occurrence))
    with open(path, "w") as f:
        f.write(text[:at] + new + text[at + len(old):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvshard", required=True, help="the built kvshard binary")
    ap.add_argument("--k8s", default=os.path.join(HERE, "..", "..", "k8s"))
    ap.add_argument("--kubectl", default="kubectl")
    ap.add_argument("--no-self-test", action="store_true",
                    help="check the tree only, not the broken copies")
    a = ap.parse_args()
    kubectl = shutil.which(a.kubectl)
    if kubectl is None:
        print("SKIP: kubectl not found (it renders the kustomize overlays); install kubectl to "
              "run the k8s manifest checks")
        return SKIP
    if not os.access(a.kvshard, os.X_OK):
        print("FAIL: no kvshard binary at %s" % a.kvshard)
        return 1
    helps = {sub: parse_help(a.kvshard, sub) for sub in ("serve", "worker")}
    registry = definitions_registry()
    source = os.path.abspath(a.k8s)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "k8s")
        shutil.copytree(source, root, ignore=shutil.ignore_patterns(".render"))
        problems = check_tree(root, a.kvshard, kubectl, helps, registry)
        problems += check_probe_tool(root)
        problems += check_readme_examples(root, registry)
        for p in problems:
            print("PROBLEM: " + p)
        print("k8s/: %d problems" % len(problems))
        failed = bool(problems)
        if a.no_self_test:
            return 1 if failed else 0
        for what, file, old, new, occurrence, expect in BREAKAGES:
            broken = os.path.join(tmp, "broken")
            shutil.rmtree(broken, ignore_errors=True)
            shutil.copytree(root, broken, ignore=shutil.ignore_patterns(".render"))
            break_copy(broken, file, old, new, occurrence)
            found = check_tree(broken, a.kvshard, kubectl, helps, registry, log=lambda _: None)
            wanted = expect if isinstance(expect[0], list) else [expect]
            hits = [next((p for p in found if all(e in p for e in w)), None) for w in wanted]
            if all(hits):
                print("self-test ok: %s: %s" % (what, " | ".join(hits)))
            else:
                failed = True
                print("SELF-TEST FAILED: %s (k8s/%s) was not reported as %s; the problems were:"
                      % (what, file, expect))
                for p in found:
                    print("    " + p)
    print("FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

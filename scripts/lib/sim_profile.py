"""The CPU profile as scripts read it (sim/cpu_profile.h): the coefficients `kvshard simulate`
prints, a step's kind and its predicted seconds, and the step-log fields a profile point may
carry. Shared by scripts/validate-simulate and scripts/replay-kept-simulate.
"""
import json
import math
import re


def profile_coefficients(fit_lines):
    """The fit of simulate's "profile ...: step s = a + b x prefill tokens + c x decode seqs + d x
    KV tokens + e x prefill pairs + g x cached chunks + h x multi-row steps + w x warm-up (tau T
    decode steps) + k x prefill steps, + f per request" line, and its per-kind factors
    ({"decode": 1.01, ...}) from the line after it: {"coef": [a, b, c, d, e, f, g], "h": h,
    "w": w, "tau": T, "k": k, "kinds": ...}."""
    if not fit_lines:
        return None
    m = re.search(r"step s = (\S+) \+ (\S+) x prefill tokens \+ (\S+) x decode seqs \+ "
                  r"(\S+) x KV tokens \+ (\S+) x prefill pairs \+ (\S+) x cached chunks \+ "
                  r"(\S+) x multi-row steps \+ (\S+) x warm-up \(tau (\S+) decode steps\) \+ "
                  r"(\S+) x prefill steps, "
                  r"\+ (\S+) per request", fit_lines[0])
    if not m:
        return None
    kinds = {"decode": 1.0, "prefill": 1.0, "mixed": 1.0, "cached": 1.0}
    for line in fit_lines[1:]:
        for kind, factor in re.findall(r"(decode|prefill|mixed|cached) (\S+) \(\d+\)", line):
            kinds[kind] = float(factor)
    a, b, c, d, e, g, h, w, tau, k, f = (float(x) for x in m.groups())
    return {"coef": [a, b, c, d, e, f, g], "h": h, "w": w, "tau": tau, "k": k, "kinds": kinds}


def step_kind(st):
    """sim/cpu_profile.h KindOf: a prefill chunk after a cached context (cached_chunks > 0: its
    sequence was not in the previous step) makes the step "cached", with or without decodes."""
    if st["prefill_tokens"] == 0:
        return "decode"
    if st.get("cached_chunks", 0) > 0:
        return "cached"
    return "prefill" if st["decode_seqs"] == 0 else "mixed"


def warm_up(profile, decodes_since_prefill):
    """CpuProfile::WarmUp: exp(-(n - 1) / tau) for n >= 1, else 0."""
    tau = profile.get("tau", 0)
    if decodes_since_prefill < 1 or tau <= 0:
        return 0.0
    return math.exp(-(decodes_since_prefill - 1) / tau)


def predicted_seconds(profile, st, arrivals=True):
    """The profile's seconds for a step-log line (its kind's factor applied), with f x arrivals
    unless arrivals is False."""
    c = profile["coef"]
    linear = (c[0] + c[1] * st["prefill_tokens"] + c[2] * st["decode_seqs"]
              + c[3] * st["kv_tokens"] + c[4] * st.get("prefill_pairs", 0)
              + c[6] * st.get("cached_chunks", 0)
              + profile.get("h", 0) * st.get("multi_row", 0)
              + profile.get("w", 0) * warm_up(profile, st.get("decodes_since_prefill", 0))
              + profile.get("k", 0) * st.get("prefill_step", 0))
    t = profile["kinds"][step_kind(st)] * linear
    return t + (c[5] * st.get("arrivals", 0) if arrivals else 0.0)


def token_median(pairs):
    """Median of (value, tokens) pairs, each value counted once per token."""
    pairs = sorted(pairs)
    total = sum(w for _, w in pairs)
    below = 0
    for v, w in pairs:
        below += w
        if below >= total / 2:
            return v
    return float("nan")


def speed_ratios(profile, step_lines):
    """(measured / profile, tokens) for each step-log line."""
    out = []
    for line in step_lines:
        st = json.loads(line)
        pred = predicted_seconds(profile, st)
        if st["seconds"] > 0 and pred > 0:
            out.append((st["seconds"] / pred, max(1, st["decode_seqs"])))
    return out


def with_step_history(steps, fields=("multi_row", "decodes_since_prefill")):
    """Step-log lines (dicts, in log order) with `fields` set as `kvshard serve --step-log`
    writes them since they exist (coordinator/step_log.h), for logs written before: multi_row
    from the step's shape, decodes_since_prefill counted over the logged steps, a step with a
    prefill chunk resetting it. The log leaves out the last step of a busy period, and the step
    after such a gap holds the next request's prefill, so the count is the server's whenever a
    gap is followed by a prefill (every gap of run S's log). Fields not in `fields` are removed:
    a profile without them fits their terms as 0."""
    out = []
    since = 0
    for st in steps:
        st = dict(st)
        if st["prefill_tokens"] > 0:
            since = 0
        elif st["decode_seqs"] > 0:
            since += 1
        derived = {"multi_row": 1 if st["prefill_tokens"] + st["decode_seqs"] >= 2 else 0,
                   "decodes_since_prefill": since,
                   "prefill_step": 1 if st["prefill_tokens"] > 0 else 0}
        for name, value in derived.items():
            if name in fields:
                st.setdefault(name, value)
            else:
                st.pop(name, None)
        out.append(st)
    return out

"""How far a validation run's medians can be trusted: a paired bootstrap over requests.

scripts/validate-simulate compares the median TTFT (over requests) and the median ITL (over
tokens) of a real run with the simulator's replay of the same requests. A workload of a few
dozen requests has medians that move by more than the 15% target from one run to the next (the
chat TTFT sits where the requests served alone give way to those that waited for another; the
long-prompt ITL between the steps of one sequence and those of two). Resampling the requests
with replacement, each resample taken from both runs at once (request i of the trace is line i of
the simulator's --per-request-out), gives the spread of the real median and of the simulator's
error as this run's own noise: an error whose interval straddles the target is not a verdict
either way, and one outside it is a miss whatever the noise.
"""
import random
import statistics


def _values(request, metric):
    """A request's values of `metric`: its TTFT (one) or its gaps between chunks (the trace's
    and per-request lines' itl_ms); None when the line does not have them."""
    if metric == "ttft_ms":
        return [request["ttft_ms"]] if "ttft_ms" in request else None
    if metric == "itl_ms":
        if "itl_ms" in request:
            return request["itl_ms"]
        # A one-token answer has no gap; a longer one without the field is an older trace.
        return [] if request.get("output_len", 2) <= 1 else None
    raise ValueError(f"unknown metric '{metric}'")


def _percentile(sorted_values, q):
    """The q-th percentile (0-100) of sorted values, linear between the closest ranks."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def paired_median_bootstrap(real, sim, metric, resamples=1000, seed=1, level=95):
    """The paired bootstrap of `metric`'s median ("ttft_ms": over requests; "itl_ms": over every
    gap of the requests drawn) for matched request lists (`real[i]` and `sim[i]` the same
    request). Returns None when a request lacks the metric on either side (an old trace without
    itl_ms) or no request has it; else {"real": [lo, hi], "sim": [lo, hi], "error": [lo, hi],
    "resamples": n, "requests": m, "level": level}: the central `level`% intervals of the real
    median, the simulated one and the relative error sim / real - 1, over `resamples` draws of
    the requests with replacement (seeded: the same inputs give the same intervals)."""
    if len(real) != len(sim):
        raise ValueError(f"{len(real)} real requests against {len(sim)} simulated")
    pairs = []
    for r, s in zip(real, sim):
        rv, sv = _values(r, metric), _values(s, metric)
        if rv is None or sv is None:
            return None
        pairs.append((rv, sv))
    if not any(rv and sv for rv, sv in pairs):
        return None
    rng = random.Random(seed)
    n = len(pairs)
    real_medians, sim_medians, errors = [], [], []
    while len(errors) < resamples:
        drawn = [pairs[rng.randrange(n)] for _ in range(n)]
        rv = [v for p in drawn for v in p[0]]
        sv = [v for p in drawn for v in p[1]]
        if not rv or not sv:
            continue  # a draw of only gapless answers says nothing
        rm, sm = statistics.median(rv), statistics.median(sv)
        real_medians.append(rm)
        sim_medians.append(sm)
        errors.append(sm / rm - 1 if rm else float("nan"))
    tail = (100 - level) / 2

    def interval(xs):
        xs = sorted(xs)
        return [_percentile(xs, tail), _percentile(xs, 100 - tail)]

    return {"real": interval(real_medians), "sim": interval(sim_medians),
            "error": interval(errors), "resamples": resamples, "requests": n, "level": level}


def format_interval(boot, unit_digits=1):
    """'real 55.1-79.9 ms, error -12.6%..+2.2%' for a paired_median_bootstrap result, or
    'n/a (no per-token gaps)' for None."""
    if boot is None:
        return "n/a (no per-token gaps)"
    lo, hi = boot["real"]
    elo, ehi = boot["error"]
    return (f"real {lo:.{unit_digits}f}-{hi:.{unit_digits}f} ms, "
            f"error {elo * 100:+.1f}%..{ehi * 100:+.1f}%")

#!/usr/bin/env python3
"""Oracle for `fp4moe trace summary`: real PyTorch profiler traces in
tests/data/traces/real/*.json.gz (made with dev/make_test_traces.py on a GPU)
and the synthetic traces in tests/data/traces/*.json are aggregated
independently here with the json and gzip modules, and compared with the
CLI's CSV and JSON output. At least one real trace must be there.

Event selection (the rule documented in docs/trace.md): GPU activities are
events with ph == "X" and cat, lower-cased, one of kernel / gpu_memcpy /
gpu_memset, plus B/E pairs of those categories on one (pid, tid). Times are
converted to integer nanoseconds from the decimal text, as the C reader
does, so the sums are exact on both sides.

Checked per kernel name: count, total, mean, p50/p90/p99 (numpy's linear
interpolation) and max. Checked per trace: the number of steps and the GPU
time inside steps per step, with steps found from the CPU ProfilerStep#N
spans and kernels attributed through the correlation id of their launch.
"""
import csv
import glob
import gzip
import io
import json
import os
import subprocess
import sys
from decimal import Decimal, ROUND_HALF_UP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fmtest import Checks, env_path, skip  # noqa: E402

try:
    import numpy as np
except ImportError as e:
    skip(e)

CLI = env_path("FM_CLI")
TRACES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "traces")
REAL = os.path.join(TRACES, "real")
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def ns(v):
    """Microseconds (int, or the decimal text of a float) to integer ns."""
    if isinstance(v, int):
        return v * 1000
    ip, _, fr = v.partition(".")
    if fr.isdigit() and (ip.isdigit() or (ip[:1] == "-" and ip[1:].isdigit())) and len(fr) <= 3:
        f = int(fr.ljust(3, "0"))
        return int(ip) * 1000 + (-f if ip.startswith("-") else f)
    return int((Decimal(v) * 1000).to_integral_value(rounding=ROUND_HALF_UP))


def load(path):
    opener = gzip.open if open(path, "rb").read(2) == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        return json.load(f, parse_float=str)


def aggregate(doc):
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    per = {}
    gpu = []  # (ts, dur, corr)
    launches = {}
    steps = []
    open_b = {}
    for e in events:
        ph, cat = e.get("ph"), e.get("cat")
        lc = cat.lower() if isinstance(cat, str) else None
        if ph == "X" and lc in GPU_CATS:
            d, t = ns(e["dur"]), ns(e["ts"])
            per.setdefault(e["name"], []).append(d)
            corr = e.get("args", {}).get("correlation", -1)
            gpu.append((t, d, corr if isinstance(corr, int) else -1))
        elif ph == "B":
            open_b.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        elif ph == "E":
            st = open_b.get((e.get("pid"), e.get("tid")))
            if st:
                b = st.pop()
                bc = b.get("cat")
                if isinstance(bc, str) and bc.lower() in GPU_CATS:
                    d = ns(e["ts"]) - ns(b["ts"])
                    per.setdefault(b["name"], []).append(d)
                    gpu.append((ns(b["ts"]), d, -1))
        elif ph == "X" and lc in ("cuda_runtime", "cuda_driver"):
            c = e.get("args", {}).get("correlation")
            if isinstance(c, int):
                launches[c] = ns(e["ts"])
        elif ph == "X" and lc == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#"):
            steps.append((ns(e["ts"]), ns(e["ts"]) + ns(e["dur"])))
    steps.sort()
    # kernel -> the CPU step containing its launch
    in_step = {}
    for t, d, c in gpu:
        if c not in launches:
            continue
        lt = launches[c]
        for i, (a, b) in enumerate(steps):
            if a <= lt < b or (a == b == lt):
                in_step[i] = in_step.get(i, 0) + d
                break
    return per, steps, in_step


def run(args):
    p = subprocess.run([CLI, "trace", "summary"] + args, capture_output=True, text=True)
    if p.returncode != 0:
        raise AssertionError("fp4moe trace summary %s failed: %s" % (args, p.stderr))
    return p.stdout


check = Checks()
real = sorted(glob.glob(os.path.join(REAL, "*.json.gz")))
for path in real + sorted(glob.glob(os.path.join(TRACES, "*.json"))):
    name = os.path.relpath(path, TRACES)
    per, steps, in_step = aggregate(load(path))
    if path in real:
        check(per and steps, "%s: a real trace without GPU activities or ProfilerStep spans (made without a GPU?)" % name)
    rows = list(csv.DictReader(io.StringIO(run([path, "--format", "csv"]))))
    check(list(rows[0].keys()) == ["name", "category", "count", "total_us", "mean_us", "p50_us", "p90_us", "p99_us",
                                   "max_us"] if rows else not per, name + ": CSV header")
    got = {r["name"]: r for r in rows}
    check(set(got) == set(per), "%s: kernel names differ: only C %s, only Python %s" % (
        name, sorted(set(got) - set(per))[:3], sorted(set(per) - set(got))[:3]))
    for k, durs in per.items():
        r = got.get(k)
        if r is None:
            continue
        a = np.array(sorted(durs), dtype=np.float64) / 1e3  # us
        check(int(r["count"]) == len(durs), "%s: %s count %s != %d" % (name, k[:60], r["count"], len(durs)))
        for col, want in (("total_us", sum(durs) / 1e3), ("mean_us", a.mean()), ("p50_us", np.percentile(a, 50)),
                          ("p90_us", np.percentile(a, 90)), ("p99_us", np.percentile(a, 99)), ("max_us", a.max())):
            v = float(r[col])
            check(abs(v - want) <= 1e-3 + 1e-9 * abs(want), "%s: %s %s %.6f != %.6f" % (name, k[:60], col, v, want))
    # steps: CPU ProfilerStep spans mapped through correlation ids
    j = json.loads(run([path, "--format", "json"]))
    unit = j["combined"]
    if steps and "correlation" in unit["steps"]["method"]:
        kept = sorted(in_step)
        check(unit["steps"]["count"] == len(kept), "%s: %d steps, Python finds %d" % (name, unit["steps"]["count"], len(kept)))
        want = sum(in_step.values()) / 1e6 / max(len(kept), 1)
        check(abs(unit["total_ms_per_step"] - want) <= 1e-6 + 1e-9 * want,
              "%s: GPU ms per step %.6f != %.6f" % (name, unit["total_ms_per_step"], want))
        per_step = [s["busy_ms"] for s in unit["steps"]["steps"]]
        check(all(b >= 0 for b in per_step), name + ": negative busy time")
    print("%s: %d kernel names, %d steps checked" % (name, len(per), unit["steps"]["count"]))

why = "no real traces in tests/data/traces/real (make them with dev/make_test_traces.py)"
check(real, why)
check.finish("all traces agree (%d real)" % len(real))

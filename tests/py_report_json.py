"""`fp4moe profile --json/--trace` on tiny presets, checked against the
performance model recomputed here in float64 (docs/profiling.md) and the
Chrome trace's structure (Perfetto / chrome://tracing JSON)."""
import json
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.environ.get("FM_TEST_DATA", "tests/data"), "prof"))
import profcheck  # noqa: E402


def close(a, b, rel=1e-9, abs_=1e-12):
    return abs(a - b) <= max(abs_, rel * max(abs(a), abs(b)))


def check_json(j, batches, bw, tile_n, steps):
    s = j["shape"]
    E, k = s["E"], s["k"]
    assert j["device"] == "cpu" and j["time_source"] == "host clock"
    assert j["layers_per_step"] == j["model_moe_layers"] >= 1
    assert close(j["bandwidth_Bps"], bw * 1e9)
    assert [b["batch"] for b in j["batches"]] == batches
    for b in j["batches"]:
        B, m, ph = b["batch"], b["model"], b["phases_ms"]
        assert b["steps"] == steps
        assert b["step_ms_min"] <= b["step_ms"] <= b["step_ms_max"]
        assert close(m["active_expected"], profcheck.expected_active(E, k, B), 1e-12)
        act = m["active_observed"]
        assert k <= act <= min(E, B * k), act
        assert close(m["tokens_per_expert"], B * k / act)
        want_bytes = profcheck.layer_bytes(j, act) * j["layers_per_step"]
        assert close(m["bytes_per_step"], want_bytes), (m["bytes_per_step"], want_bytes)
        floor_ms = want_bytes / (bw * 1e9) * 1e3
        assert close(m["floor_ms"], floor_ms)
        assert close(m["pct_of_floor"], 100 * floor_ms / b["step_ms"])
        # route-then-read bound: the routing phase + the routed experts' bytes
        routed = profcheck.layer_bytes(j, act) - profcheck.layer_bytes(j, 0)
        if ph["routing"] > 0:
            want = ph["routing"] + routed * j["layers_per_step"] / (bw * 1e9) * 1e3
            assert close(m["route_read_bound_ms"], want), (m["route_read_bound_ms"], want)
        else:
            assert m["route_read_bound_ms"] is None
        H, I = s["H"], s["I"]
        per_tok = 6.0 * H * I * k + 2.0 * H * E + (6.0 * H * s["shared_inter"] if s["n_shared"] else 0)
        assert close(m["flops_per_step"], per_tok * B * j["layers_per_step"])
        # phases + unattributed add up to the step (the CPU runs them in turn)
        parts = sum(v for r, v in ph.items() if r != "total")
        assert close(parts, ph["total"], 1e-9, 1e-9) and close(ph["total"], b["step_ms"])
        for r in j["fused_phases"]:
            assert ph[r] == 0.0
        # every tile of tile_n rows holds at most B*k <= tile_n tokens, so
        # the fill is B*k / (tile_n * active experts)
        if tile_n == 1:
            assert m["tile_fill"] == 1.0
        elif B * k <= tile_n:
            assert close(m["tile_fill"], B * k / (tile_n * act)), (m["tile_fill"], B * k / (tile_n * act))
        assert not m["tile_fill_is_expected"]
        assert b["verdict"] in ("bandwidth-bound", "compute-bound", "latency/launch-bound",
                                "busy but not bandwidth-bound", "under-used")
        assert b["verdict_text"].startswith(b["verdict"].split(" ")[0].split("/")[0])
        t = b["telemetry"]
        assert t["mean"]["sm_util_pct"] is None  # no NVML on the CPU path
        for metric in ("cpu_util_pct", "proc_cpu_util_pct"):
            v = t["mean"][metric]
            assert v is None or 0 <= v <= 100, (metric, v)
    for d, (a, b) in zip(j["deltas"], zip(j["batches"], j["batches"][1:])):
        assert (d["from"], d["to"]) == (a["batch"], b["batch"])
        total = b["phases_ms"]["total"] - a["phases_ms"]["total"]
        shares = 0.0
        for r, row in d["rows"].items():
            assert close(row["delta_ms"], b["phases_ms"][r] - a["phases_ms"][r], 1e-9, 1e-12)
            if r != "total" and total != 0:
                assert close(row["share_pct"], 100 * row["delta_ms"] / total, 1e-9, 1e-9)
                shares += row["share_pct"]
        if total != 0:
            assert close(shares, 100.0, 1e-9, 1e-6)


def inside(inner, outer, eps=0.01):
    return (inner["ts"] >= outer["ts"] - eps and
            inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + eps)


def check_trace(t, j, warmup, steps):
    ev = t["traceEvents"]
    assert isinstance(ev, list) and ev
    xs = [e for e in ev if e["ph"] == "X"]
    for e in ev:
        assert e["ph"] in ("X", "C", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    for e in xs:
        assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0 and e["name"]
    by = {c: [e for e in xs if e["cat"] == c] for c in ("batch", "step", "layer", "phase")}
    n_b = len(j["batches"])
    L = j["layers_per_step"]
    assert len(by["batch"]) == n_b
    assert len(by["step"]) == n_b * (warmup + steps)
    assert len(by["layer"]) == n_b * (warmup + steps) * L
    names = {"routing", "sort", "gate_up", "activation", "down", "combine", "shared", "other"}
    # nesting: phase in a layer, layer in a step, step in a batch
    for child, parent in (("phase", "layer"), ("layer", "step"), ("step", "batch")):
        for c in by[child]:
            assert any(inside(c, p) for p in by[parent] if p["tid"] == c["tid"]), (child, c)
    for p in by["phase"]:
        assert p["name"] in names and p["args"]["phase"] == p["name"]
    # phase spans of the measured steps add up to the JSON's per-step means
    for bj in j["batches"]:
        B = bj["batch"]
        meas = [s for s in by["step"] if s["args"]["batch"] == B and s["name"].startswith("step")]
        assert len(meas) == steps
        for r in names:
            tot = sum(p["dur"] for p in by["phase"] if p["name"] == r and any(inside(p, s) for s in meas))
            # spans are whole nanoseconds: up to 1 ns lost per span
            assert close(tot / steps / 1e3, bj["phases_ms"][r], 1e-6, 1e-6 * (L + 1)), (B, r, tot, bj["phases_ms"][r])
    cs = [e for e in ev if e["ph"] == "C"]
    # Utilization needs /proc/stat to advance between two samples (10 ms
    # ticks): only a run that lasted a while is sure to have counters.
    xs = [e for e in ev if e["ph"] == "X"]
    wall_us = max(e["ts"] + e["dur"] for e in xs) - min(e["ts"] for e in xs) if xs else 0
    if wall_us >= 200e3:
        assert len(cs) >= 1, wall_us
    for c in cs:
        assert c["name"] in ("host CPU utilization %", "fp4moe CPU utilization %"), c["name"]
        assert 0 <= c["args"]["value"] <= 100
    meta = [e for e in ev if e["ph"] == "M"]
    assert any(m["args"]["name"] == "fp4moe host" for m in meta)


def main():
    profcheck.cli()
    cases = [
        # preset, batches, bandwidth GB/s, tile_n, extra
        ("tiny-deepseek", [3, 16], 5.0, 64, []),
        ("tiny-deepseek-v4", [1, 5, 9], 2.5, 1, ["--format", "mxfp4"]),
        ("tiny-gptoss", [2, 7], 3.0, 0, []),
        ("tiny-mixtral", [2, 6], 4.0, 16, ["--format", "bf16"]),
    ]
    warmup, steps = 1, 2
    with tempfile.TemporaryDirectory() as d:
        for preset, batches, bw, tile, extra in cases:
            args = ["--preset", preset, "--batch", ",".join(map(str, batches)), "--bandwidth", str(bw),
                    "--peak-gflops", "20", "--steps", str(steps), "--warmup", str(warmup), *extra]
            if tile:
                args += ["--tile-n", str(tile)]
            out, paths = profcheck.run_profile(args, d)
            j = json.load(open(paths["json"]))
            t = json.load(open(paths["trace"]))
            assert j["model"] == preset
            check_json(j, batches, bw, tile, steps)
            check_trace(t, j, warmup, steps)
            assert f"| phase | bs {batches[0]} (ms/step) | bs {batches[1]} (ms/step) | delta | share |" in out
            for b in j["batches"]:
                assert f"  batch {b['batch']}: {b['verdict_text']}" in out
            print(f"ok {preset}: {[round(b['model']['pct_of_floor'], 1) for b in j['batches']]} % of floor")
    print("py_report_json: all checks passed")


if __name__ == "__main__":
    main()

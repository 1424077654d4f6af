"""dev/analysis/trace_layers.py (the per-layer timeline of `fp4moe profile
--device cuda --trace`) on a synthetic trace whose medians are known, on the
kernel names both as CUPTI writes them and demangled, and on broken input, which
must give exit 2 and a message, not a traceback."""
import io
import json
import os
import subprocess
import sys
import tempfile
from contextlib import redirect_stdout

src = os.environ.get("FM_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
script = os.path.join(src, "dev", "analysis", "trace_layers.py")
sys.path.insert(0, os.path.join(src, "dev", "analysis"))
import trace_layers as tl  # noqa: E402

LG = "_Z21fm_logits_gemv_kernel15fm_route_params"
SEL = "_Z15fm_route_kernelILi4EEv15fm_route_params"
GU = "_Z19fm_expert_wg_kernelILi2ELb0ELi2ELb0EEv16fm_expert_paramsii"
DN = "_Z19fm_expert_wg_kernelILi2ELb0ELi2ELb1EEv16fm_expert_paramsii"

# kind(): wgmma gate/up and its 128-row down, the 64-row down, the mma.sync
# kernels (NT 1 gate/up must not read as down), demangled names
assert tl.kind(GU) == "GU" and tl.kind(DN) == "DN"
assert tl.kind("_Z19fm_expert_wg_kernelILi1ELb1ELi4ELb0EEv16fm_expert_paramsii") == "DN"
assert tl.kind("_Z16fm_expert_kernelILi1ELi2ELb0ELi1ELb1EEv16fm_expert_paramsii") == "GU"
assert tl.kind("_Z16fm_expert_kernelILi2ELi1ELb0ELi1ELb1EEv16fm_expert_paramsii") == "DN"
assert tl.kind("void fm_expert_wg_kernel<2, 0, 4, 1>(fm_expert_params, int, int)") == "DN"
assert tl.kind("void fm_expert_wg_kernel<2, 0, 4, 0>(fm_expert_params, int, int)") == "GU"
assert tl.kind(LG) == "LG" and tl.kind(SEL) == "SEL" and tl.kind("memcpy") is None


def k(name, ts, dur, tid=1, phase=None):
    e = {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}
    if phase:
        e["args"] = {"phase": phase}
    return e


# three layers 100 us apart; layer L: logits [0, 4), selection ends at 10,
# routed gate/up [11, 60) and down [58, 95) on tid 1, the shared expert's
# gate/up [5, 20) and down [20, 30) on tid 2 (layer 1: on tid 1, as CUPTI may
# report a graph's branch, with the profile's phase "shared"); a routing-only pair first
# (no experts: not a layer of the table); the last logits closes layer 2
ev = [k(LG, -50, 3), k(SEL, -47, 2)]
for L in range(3):
    b = 100.0 * L
    ev += [k(LG, b, 4), k(SEL, b + 2, 8 + L), k(GU, b + 11, 49), k(DN, b + 58, 37),
           k(GU, b + 5, 15, tid=2) if L != 1 else k(GU, b + 5, 15, phase="shared"),
           k(DN, b + 20, 10, tid=2) if L != 1 else k(DN, b + 20, 10, phase="shared")]
ev.append(k(LG, 300, 4))
ev.append({"ph": "M", "name": "process_name", "pid": 1})  # not a kernel

with tempfile.TemporaryDirectory() as d:
    good = os.path.join(d, "t.json")
    with open(good, "w") as f:
        json.dump({"traceEvents": ev}, f)
    n, med = tl.summary(good)
    assert n == 3, n
    want = {"period": 100.0, "LG": 4.0, "SEL_end": 7.0, "GU_start": 7.0, "GU_dur": 49.0, "GU_end": 56.0,
            "DN_dur": 37.0, "DN_end": 91.0, "sh_GU_start": 1.0, "sh_GU_end": 16.0, "sh_DN_end": 26.0}
    for c, v in want.items():
        assert abs(med[c] - v) < 1e-9, (c, med[c], v)
    out = io.StringIO()
    sys.argv = ["trace_layers.py", good]
    with redirect_stdout(out):
        assert tl.main() == 0
    assert "91.00" in out.getvalue() and " 3 " in out.getvalue(), out.getvalue()

    # broken input: each gives exit 2 and a message naming the file
    cases = {"missing.json": None, "notjson.json": "{not json", "nolist.json": json.dumps({"traceEvents": 3}),
             "nots.json": json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": LG}]})}
    for name, text in cases.items():
        path = os.path.join(d, name)
        if text is not None:
            with open(path, "w") as f:
                f.write(text)
        r = subprocess.run([sys.executable, script, path], capture_output=True, text=True)
        assert r.returncode == 2, (name, r.returncode, r.stderr)
        assert "trace_layers: " + path in r.stderr and "Traceback" not in r.stderr, (name, r.stderr)
    r = subprocess.run([sys.executable, script], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
print("trace_layers: synthetic timeline and broken inputs: ok")

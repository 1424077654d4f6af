#!/usr/bin/env python3
"""Smoke test of an installed fp4moe package (CI runs it in a fresh virtual
environment after `pip install ./python`, with `python -I` so the source tree
is not on the path):

  python -I python/tests/smoke_installed.py BUILD/fp4moe

Checks that the package and its libfp4moe.so come from the environment, then
runs one layer of a tiny checkpoint made by `fp4moe gen` and compares the
output with `fp4moe forward` on the same input (the same CPU engine through
the CLI; relative error 1e-6 per token)."""
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

import fp4moe


def write_st(path, tensors):
    hdr, off, blob = {}, 0, b""
    for k, a in tensors.items():
        raw = a.tobytes()
        hdr[k] = {"dtype": {"float32": "F32", "int32": "I32"}[a.dtype.name], "shape": list(a.shape),
                  "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blob += raw
    h = json.dumps(hdr).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + blob)


def read_st(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in hdr.items():
        if k != "__metadata__":
            b, e = v["data_offsets"]
            out[k] = np.frombuffer(data[b:e], {"F32": np.float32, "I32": np.int32}[v["dtype"]]).reshape(v["shape"])
    return out


def main():
    cli = sys.argv[1]
    fails = []
    pkg = os.path.dirname(os.path.abspath(fp4moe.__file__))
    if not pkg.startswith(os.path.abspath(sys.prefix)):
        fails.append(f"fp4moe imported from {pkg}, not from the environment {sys.prefix}")
    if os.environ.get("FP4MOE_LIBRARY"):
        fails.append("FP4MOE_LIBRARY is set: the installed library is not the one tested")
    lib = fp4moe.library_path()
    if not (os.path.isfile(lib) and lib.startswith(pkg)):
        fails.append(f"libfp4moe.so is not inside the package: {lib}")
    with tempfile.TemporaryDirectory() as tmp:
        d = os.path.join(tmp, "ckpt")
        subprocess.run([cli, "gen", "--preset", "tiny-deepseek", "--format", "nvfp4", "--layers", "2", "--seed", "3",
                        "--out", d, "--quiet"], check=True)
        m = fp4moe.MoE.from_checkpoint(d, 1, max_tokens=8)
        x = np.random.default_rng(1).standard_normal((5, m.hidden)).astype(np.float32)
        out, ids, w = m(x, return_routing=True)
        inp, outp = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
        write_st(inp, {"hidden_states": x})
        subprocess.run([cli, "forward", "--model", d, "--layer", "1", "--input", inp, "--output", outp], check=True,
                       capture_output=True)
        ref = read_st(outp)
        if not np.array_equal(ids, ref["topk_ids"]):
            fails.append(f"topk_ids differ from fp4moe forward:\n{ids}\n{ref['topk_ids']}")
        r = ref["hidden_states"].astype(np.float64)
        rel = float((np.abs(out - r).max(axis=1) / np.abs(r).max(axis=1)).max())
        if not rel <= 1e-6:
            fails.append(f"output differs from fp4moe forward: relative error {rel:.3g}")
        print(m.describe())
        print(f"installed fp4moe {fp4moe.__version__} at {pkg}: moe(x) T=5 matches `fp4moe forward` "
              f"(relative error {rel:.2e})")
    for f in fails:
        print("FAIL:", f)
    print(f"{0 if fails else 1} passed, {1 if fails else 0} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())

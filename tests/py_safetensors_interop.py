#!/usr/bin/env python3
"""safetensors interoperability with the official Python package, both ways.

1. Python's safetensors writes files (metadata, scalars, zero-size tensors,
   every dtype it and fp4moe share, F4 and F8_E8M0 through TensorSpec);
   tests/tools/st_tool dumps them through fm_st_open: names, dtypes, shapes,
   offsets and bytes must match.
2. st_tool writes a fixed set with fm_st_writer; Python's safe_open reads it
   (which validates the file by the official rules) and every value, shape,
   dtype and metadata entry must match the formula st_tool used.
"""
import json
import os
import struct
import subprocess
import tempfile

from fmtest import Checks, env_path, skip

try:
    import numpy as np
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for safetensors)
    from safetensors import safe_open, serialize_file, TensorSpec
    from safetensors.numpy import save_file
except ImportError as e:  # pragma: no cover
    skip(e)

st_tool = env_path("FM_TOOLS_DIR", "st_tool")
check = Checks()


def dump(path, keys=()):
    r = subprocess.run([st_tool, "dump", path, *keys], capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def parse_dump(out):
    meta, tensors, counts = {}, {}, {}
    for line in out.splitlines():
        if line.startswith("count ") or line.startswith("meta_count "):
            k, v = line.split()
            counts[k] = int(v)
        elif line.startswith("meta\t"):
            _, k, v = line.split("\t", 2)
            meta[k] = v
        elif line.startswith("tensor\t"):
            _, name, dt, shape, b, e, hx = line.split("\t")
            shape = tuple(int(s) for s in shape.split(",")) if shape else ()
            tensors[name] = (dt, shape, int(b), int(e), bytes.fromhex(hx))
    return counts, meta, tensors


NP_TO_ST = {"bool": "BOOL", "int8": "I8", "uint8": "U8", "int16": "I16", "uint16": "U16",
            "int32": "I32", "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16",
            "float32": "F32", "float64": "F64", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
            "float8_e5m2": "F8_E5M2"}

with tempfile.TemporaryDirectory() as tmp:
    # ------------------------------------------------ 1. Python writes
    rng = np.random.default_rng(7)
    arrays = {}
    for i, name in enumerate(NP_TO_ST):
        shape = [(3, 4), (5,), (2, 1, 3), (), (0, 4), (7,)][i % 6]
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(
            getattr(ml_dtypes, name, None) or name).itemsize, dtype=np.uint8)
        if name == "bool":
            raw = raw % 2
        dt = getattr(ml_dtypes, name, None) or np.dtype(name)
        arrays[f"t.{name}"] = raw.view(dt).reshape(shape)
    arrays["scalar.f32"] = np.array(3.5, dtype=np.float32)
    arrays["zero.bf16"] = np.zeros((0,), dtype=ml_dtypes.bfloat16)
    arrays["name with spaces/and.slashes"] = np.arange(6, dtype=np.int32).reshape(2, 3)
    meta = {"format": "np", "note": "caf\u00e9 \u2713", "empty": ""}
    p1 = os.path.join(tmp, "py.safetensors")
    save_file(arrays, p1, metadata=meta)

    rc, out, err = dump(p1, list(meta) + ["absent"])
    check(rc == 0, f"st_tool dump of a Python file failed: {err}")
    counts, m, tensors = parse_dump(out)
    check(counts.get("count") == len(arrays), f"count {counts.get('count')} != {len(arrays)}")
    check(counts.get("meta_count") == len(meta), f"meta_count {counts.get('meta_count')}")
    for k, v in meta.items():
        check(m.get(k) == v, f"metadata {k!r}: {m.get(k)!r} != {v!r}")
    check(m.get("absent") == "<absent>", "absent metadata key found")
    for name, a in arrays.items():
        t = tensors.get(name)
        check(t is not None, f"tensor {name!r} missing from the dump")
        if t is None:
            continue
        dt, shape, b, e, data = t
        check(dt == NP_TO_ST[a.dtype.name], f"{name}: dtype {dt} != {a.dtype.name}")
        check(shape == a.shape, f"{name}: shape {shape} != {a.shape}")
        check(e - b == a.nbytes and data == a.tobytes(), f"{name}: data differs")

    # F4 and F8_E8M0 through TensorSpec (numpy has no such dtypes).
    buf = np.frombuffer(bytes(range(40, 52)), dtype=np.uint8).copy()
    specs = {
        "q": TensorSpec(dtype="float4_e2m1fn_x2", shape=(2, 3), data_ptr=buf.ctypes.data, data_len=6),
        "s": TensorSpec(dtype="float8_e8m0fnu", shape=(6,), data_ptr=buf.ctypes.data + 6, data_len=6),
    }
    p2 = os.path.join(tmp, "f4.safetensors")
    serialize_file(specs, p2, metadata=None)
    rc, out, err = dump(p2)
    check(rc == 0, f"st_tool dump of an F4 file failed: {err}")
    _, _, tensors = parse_dump(out)
    check(tensors.get("q", ("",))[0:2] == ("F4", (2, 6)), f"F4 tensor: {tensors.get('q')}")
    check(tensors.get("q", [b""] * 5)[4] == bytes(range(40, 46)), "F4 bytes differ")
    check(tensors.get("s", ("",))[0:2] == ("F8_E8M0", (6,)), f"E8M0 tensor: {tensors.get('s')}")
    check(tensors.get("s", [b""] * 5)[4] == bytes(range(46, 52)), "E8M0 bytes differ")

    # A dtype the official package knows and fp4moe does not.
    specs = {"c": TensorSpec(dtype="complex64", shape=(1,), data_ptr=buf.ctypes.data, data_len=8)}
    p3 = os.path.join(tmp, "c64.safetensors")
    serialize_file(specs, p3, metadata=None)
    rc, out, err = dump(p3)
    check(rc == 1 and "unknown dtype 'C64'" in err and "tensor 'c'" in err,
          f"C64 file: rc {rc}, {err.strip()}")

    # ------------------------------------------------ 2. fp4moe writes
    p4 = os.path.join(tmp, "fm.safetensors")
    r = subprocess.run([st_tool, "write", p4], capture_output=True, text=True)
    check(r.returncode == 0, f"st_tool write failed: {r.stderr}")
    SET = [("f32", "F32", (3, 4)), ("bf16", "BF16", (2, 3)), ("f16", "F16", (5,)),
           ("f64", "F64", (2,)), ("i64", "I64", (2, 2)), ("u8", "U8", (7,)), ("i8", "I8", (3,)),
           ("bool", "BOOL", (4,)), ("i16", "I16", (3,)), ("u16", "U16", (3,)),
           ("i32", "I32", (2,)), ("u32", "U32", (2,)), ("u64", "U64", (2,)),
           ("e4m3", "F8_E4M3", (4, 2)), ("e5m2", "F8_E5M2", (3,)), ("e8m0", "F8_E8M0", (2, 2)),
           ("f4", "F4", (2, 6)), ("scalar", "F32", ()), ("zero", "F32", (0, 3)),
           ("model.layers.0.mlp.experts.1.gate_proj.weight", "U8", (4, 8))]
    BITS = {"F32": 32, "BF16": 16, "F16": 16, "F64": 64, "I64": 64, "U8": 8, "I8": 8, "BOOL": 8,
            "I16": 16, "U16": 16, "I32": 32, "U32": 32, "U64": 64, "F8_E4M3": 8, "F8_E5M2": 8,
            "F8_E8M0": 8, "F4": 4}

    def expected(t, dt, shape):
        n = int(np.prod(shape)) * BITS[dt] // 8
        if dt == "BOOL":
            return bytes((i + t) % 2 for i in range(n))
        return bytes((31 * i + 17 * t + 5) & 0xFF for i in range(n))

    def check_fm_file(path):
        with open(path, "rb") as fh:
            blob = fh.read()
        n = struct.unpack("<Q", blob[:8])[0]
        check(n % 8 == 0, f"header length {n} not a multiple of 8")
        header = json.loads(blob[8:8 + n])
        with safe_open(path, "np") as f:
            check(f.metadata() == {"format": "pt", "producer": "fp4moe st_tool",
                                   "unicode": "h\u00e9llo \u2713", "empty": ""},
                  f"metadata read by safe_open: {f.metadata()}")
            check(sorted(f.keys()) == sorted(s[0] for s in SET), f"keys: {sorted(f.keys())}")
            for t, (name, dt, shape) in enumerate(SET):
                want = expected(t, dt, shape)
                sl = f.get_slice(name)
                check(sl.get_dtype() == dt, f"{name}: dtype {sl.get_dtype()} != {dt}")
                check(tuple(sl.get_shape()) == shape, f"{name}: shape {sl.get_shape()} != {shape}")
                if dt in ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"):
                    # numpy cannot materialize these; the bytes come from the
                    # offsets safe_open has just validated.
                    b, e = header[name]["data_offsets"]
                    got = blob[8 + n + b:8 + n + e]
                else:
                    got = f.get_tensor(name).tobytes()
                check(got == want, f"{name}: bytes differ ({got.hex()} != {want.hex()})")

    if r.returncode == 0:
        try:
            check_fm_file(p4)
        except Exception as e:  # e.g. the official reader refuses the file
            check(False, f"reading the file fp4moe wrote: {type(e).__name__}: {e}")

check.finish("safetensors interop OK in both directions")

"""Helpers shared by tests/py_report_*.py: run `fp4moe profile`, decode a PNG
without third-party packages, and the performance-model formulas written
out again from docs/profiling.md (an independent float64 oracle)."""
import os
import struct
import subprocess
import sys
import tempfile
import zlib


def skip(reason):
    print(f"SKIPPED: {reason}")
    sys.exit(77)


def cli():
    c = os.environ.get("FM_CLI")
    if not c or not os.path.exists(c):
        skip("FM_CLI not set or missing (run through ctest)")
    return c


def run_profile(args, outdir):
    """Runs the CLI with --json/--trace/--report into outdir; returns
    (stdout, paths dict)."""
    paths = {k: os.path.join(outdir, f) for k, f in
             (("json", "p.json"), ("trace", "t.json"), ("html", "r.html"))}
    cmd = [cli(), "profile", *args, "--quiet", "--json", paths["json"],
           "--trace", paths["trace"], "--report", paths["html"]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout, paths


def matrix_bytes(fmt, rows, cols):
    n = rows * cols
    if fmt == "nvfp4":
        return n / 2 + n / 16 + 4  # packed, E4M3 per 16, FP32 tensor scale
    if fmt == "mxfp4":
        return n / 2 + n / 32  # packed, E8M0 per 32
    if fmt == "bf16":
        return n * 2
    raise AssertionError(f"format {fmt}")


def layer_bytes(j, active):
    s = j["shape"]
    H, I, E, fmt = s["H"], s["I"], s["E"], j["format"]
    expert = 2 * matrix_bytes(fmt, I, H) + matrix_bytes(fmt, H, I)
    shared = 0.0
    if s["n_shared"] > 0:
        Is = s["shared_inter"]
        shared = 2 * matrix_bytes(fmt, Is, H) + matrix_bytes(fmt, H, Is)
    return active * expert + shared + E * H * 4.0


def expected_active(E, k, B):
    miss = 1.0
    for _ in range(B):
        miss *= 1.0 - k / E
    return E * (1.0 - miss)


def png_pixels(path):
    """Decodes an 8-bit RGB/RGBA non-interlaced PNG; returns (w, h, bpp,
    bytearray of raw pixels)."""
    try:
        import numpy as np
    except ImportError:
        skip("numpy not installed")
    d = open(path, "rb").read()
    assert d[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, w = 8, b"", None
    while pos < len(d):
        n, = struct.unpack(">I", d[pos:pos + 4])
        t, c = d[pos + 4:pos + 8], d[pos + 8:pos + 8 + n]
        pos += 12 + n
        if t == b"IHDR":
            w, h, depth, ctype, _, _, inter = struct.unpack(">IIBBBBB", c)
            assert depth == 8 and ctype in (2, 6) and inter == 0, (depth, ctype, inter)
        elif t == b"IDAT":
            idat += c
    bpp = 3 if ctype == 2 else 4
    raw = zlib.decompress(idat)
    stride = w * bpp
    out = bytearray(h * stride)
    prev = bytearray(stride)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if f == 1:  # Sub: a running sum per channel
            a = np.frombuffer(bytes(line), np.uint8).reshape(w, bpp).astype(np.uint32)
            line = bytearray((np.cumsum(a, axis=0) & 255).astype(np.uint8).tobytes())
        elif f == 2:  # Up
            a = np.frombuffer(bytes(line), np.uint8) + np.frombuffer(bytes(prev), np.uint8)
            line = bytearray(a.astype(np.uint8).tobytes())
        elif f == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 255
        elif f == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b = prev[i]
                c = prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pr = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pr) & 255
        else:
            assert f == 0, f"filter {f}"
        out[y * stride:(y + 1) * stride] = line
        prev = line
    return w, h, bpp, out

#!/usr/bin/env python3
"""The library's scalar formats against ml_dtypes / numpy.

Every code of E2M1, E4M3 (float8_e4m3fn), E8M0 (float8_e8m0fnu), BF16 and
F16 is decoded by tests/tools/fmt_dump and compared with ml_dtypes; then a
large set of random and edge floats is encoded by both. Documented
differences of the library (see src/formats/formats.c):
  E2M1: -0.0 and NaN encode to +0 / +6 (ModelOpt's _cast_fp4); ml_dtypes
        gives -0 for both.
  E4M3: finite overflow and inf saturate to +-448 (ModelOpt clamps before
        the cast); ml_dtypes gives NaN, so it is fed the clamped value.
  E8M0: the library's encoder is floor(log2 x); it is checked against
        numpy's frexp, not against ml_dtypes' rounding cast.
Finally fm_quantize_nvfp4 is compared bit for bit with ModelOpt's NVFP4
quantizer replayed in float32 numpy, and fm_quantize_mxfp4 with the OCP
scale rule, on random matrices with outliers, zero blocks and midpoints.
"""
import subprocess

from fmtest import Checks, env_path, fmt_dump_quant, skip

try:
    import numpy as np
    import ml_dtypes
except ImportError as e:  # pragma: no cover
    skip(e)

tool = env_path("FM_TOOLS_DIR", "fmt_dump")
check = Checks()


def same_f32(a, b):
    """Bitwise equal, or both NaN."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    nan = np.isnan(a) & np.isnan(b)
    eq = a.view(np.uint32) == b.view(np.uint32)
    return nan | eq


# ---------------------------------------------------------------- decode
out = subprocess.run([tool, "decode"], check=True, capture_output=True, text=True).stdout
tok = np.array(out.split()).reshape(-1, 3)
tables = {}
for fmt in np.unique(tok[:, 0]):
    sel = tok[tok[:, 0] == fmt]
    tables[str(fmt)] = list(zip(sel[:, 1].astype(np.int64).tolist(),
                                [int(h, 16) for h in sel[:, 2].tolist()]))

refs = {
    "e2m1": (16, ml_dtypes.float4_e2m1fn, np.uint8),
    "e4m3": (256, ml_dtypes.float8_e4m3fn, np.uint8),
    "e8m0": (256, ml_dtypes.float8_e8m0fnu, np.uint8),
    "bf16": (65536, ml_dtypes.bfloat16, np.uint16),
    "f16": (65536, np.float16, np.uint16),
}
for fmt, (n, dt, store) in refs.items():
    rows = tables.get(fmt, [])
    check(len(rows) == n, f"{fmt}: {len(rows)} codes printed, expected {n}")
    if len(rows) != n:
        continue
    codes = np.array([c for c, _ in rows], dtype=np.int64)
    check(np.array_equal(codes, np.arange(n)), f"{fmt}: codes out of order")
    ours = np.array([b for _, b in rows], dtype=np.uint32).view(np.float32)
    want = np.arange(n, dtype=store).view(dt).astype(np.float32)
    ok = same_f32(ours, want)
    bad = np.nonzero(~ok)[0]
    check(bad.size == 0, f"{fmt} decode differs at codes {bad[:10].tolist()}: "
          f"ours {ours[bad[:10]].tolist()} ml_dtypes {want[bad[:10]].tolist()}")

# ---------------------------------------------------------------- encode
rng = np.random.default_rng(20261129)
parts = [
    rng.integers(0, 2**32, 30000, dtype=np.uint64).astype(np.uint32).view(np.float32),
    (rng.standard_normal(20000) * 3).astype(np.float32),
    (rng.standard_normal(20000) * 300).astype(np.float32),
    np.ldexp(rng.uniform(-1, 1, 20000), rng.integers(-40, 20, 20000)).astype(np.float32),
]
# Every midpoint between neighbouring representable values, and its two
# neighbouring floats, for each format.
edges = [0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, 464.0, 480.0, 65504.0, 65520.0, 6.0, 7.0,
         np.finfo(np.float32).max, np.finfo(np.float32).tiny, 1e-45]
for dt, store, n in [(ml_dtypes.float4_e2m1fn, np.uint8, 8), (ml_dtypes.float8_e4m3fn, np.uint8, 0x7F),
                     (ml_dtypes.bfloat16, np.uint16, 0x7F80), (np.float16, np.uint16, 0x7C00)]:
    v = np.arange(n, dtype=store).view(dt).astype(np.float64)
    mid = ((v[:-1] + v[1:]) / 2).astype(np.float32)
    if mid.size > 4000:  # 16-bit formats: a sample keeps the test fast
        mid = np.concatenate([mid[:800], rng.choice(mid, 1000, replace=False), mid[-800:]])
    edges_arr = np.concatenate([mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf)),
                                v.astype(np.float32)])
    parts.append(edges_arr)
    parts.append(-edges_arr)
parts.append(np.array(edges, dtype=np.float32))
x = np.concatenate(parts).astype(np.float32)

inp = "\n".join(f"{u:08x}" for u in x.view(np.uint32).tolist()) + "\n"
res = subprocess.run([tool, "encode"], input=inp, check=True, capture_output=True, text=True).stdout
cols = np.array([int(t, 16) for t in res.split()], dtype=np.int64)
cols = cols.reshape(-1, 5) if cols.size % 5 == 0 else cols.reshape(-1, 1)
check(cols.shape == (x.size, 5), f"encode: got {cols.shape} results for {x.size} inputs")

if cols.shape == (x.size, 5):
    nan = np.isnan(x)

    # E2M1: ml_dtypes except -0.0 / NaN (see the module docstring).
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).astype(np.int64) & 0xF
    want[(x == 0)] = 0
    want[nan] = 7
    bad = np.nonzero(cols[:, 0] != want)[0]
    check(bad.size == 0, f"e2m1 encode differs for {x[bad[:10]].tolist()}: "
          f"ours {cols[bad[:10], 0].tolist()} ml_dtypes {want[bad[:10]].tolist()}")

    # E4M3: ml_dtypes of the value clamped to +-448.
    with np.errstate(invalid="ignore"):
        clamped = np.clip(x, np.float32(-448), np.float32(448))
        want = clamped.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.int64)
    ours = cols[:, 1]
    ok = (ours == want) | (nan & ((ours & 0x7F) == 0x7F) & ((want & 0x7F) == 0x7F))
    bad = np.nonzero(~ok)[0]
    check(bad.size == 0, f"e4m3 encode differs for {x[bad[:10]].tolist()}: "
          f"ours {ours[bad[:10]].tolist()} ml_dtypes {want[bad[:10]].tolist()}")

    # E8M0 floor: frexp for positive finite values, clamped to [0, 254].
    pos = (x > 0) & np.isfinite(x)
    m, e = np.frexp(x[pos].astype(np.float64))
    want = np.clip(e - 1 + 127, 0, 254)
    bad = np.nonzero(cols[pos, 2] != want)[0]
    check(bad.size == 0, f"e8m0 floor differs for {x[pos][bad[:10]].tolist()}")
    check(np.all(cols[nan, 2] == 0xFF), "e8m0 floor of NaN is not 0xFF")
    check(np.all(cols[(x <= 0), 2] == 0), "e8m0 floor of x <= 0 is not 0")
    check(np.all(cols[np.isposinf(x), 2] == 0xFE), "e8m0 floor of inf is not 0xFE")

    # BF16 and F16: direct, NaN as a class.
    for col, dt, name, qnan_mask, inf_bits in [(3, ml_dtypes.bfloat16, "bf16", 0x7F80, 0x7F80),
                                               (4, np.float16, "f16", 0x7C00, 0x7C00)]:
        with np.errstate(over="ignore", invalid="ignore"):
            want = x.astype(dt).view(np.uint16).astype(np.int64)
        ours = cols[:, col]
        ok = (ours == want) | (nan & ((ours & 0x7FFF) > inf_bits) & ((want & 0x7FFF) > inf_bits))
        bad = np.nonzero(~ok)[0]
        check(bad.size == 0, f"{name} encode differs for {x[bad[:10]].tolist()}: "
              f"ours {ours[bad[:10]].tolist()} ref {want[bad[:10]].tolist()}")

# ------------------------------------------------- NVFP4 / MXFP4 quantizers
# Reference NVFP4: ModelOpt's NVFP4QTensor.quantize replayed step by step in
# float32 numpy (torch does the same float32 operations); reference MXFP4:
# the OCP rule 2^(floor(log2 amax) - 2) with the same E2M1 rounding.
E2M1_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)


def cast_fp4(x):
    sign = (x < 0).astype(np.int64)
    a = np.abs(x)
    ordv = np.searchsorted(E2M1_BOUNDS, a, side="left")
    odd = (a == 0.75) | (a == 1.75) | (a == 3.5)
    return (sign << 3) + ordv + odd


def pack(q):
    return ((q[:, 1::2] << 4) | q[:, 0::2]).astype(np.uint8).tobytes()


def ref_nvfp4(w):
    amax = np.float32(np.abs(w).max())
    s2 = np.float32(amax / np.float32(6.0 * 448.0))
    blocks = w.reshape(w.shape[0], -1, 16)
    bamax = np.abs(blocks).max(axis=-1).astype(np.float32)
    s = (bamax / (np.float32(6.0) * s2)).astype(np.float32)
    s[s == 0] = np.float32(1.0)
    sc = s.astype(ml_dtypes.float8_e4m3fn)
    d = (sc.astype(np.float32) * s2).astype(np.float32)
    scaled = (blocks / d[..., None]).astype(np.float32).reshape(w.shape)
    return pack(cast_fp4(scaled)), sc.view(np.uint8).tobytes(), s2


def ref_mxfp4(w):
    blocks = w.reshape(w.shape[0], -1, 32).astype(np.float64)
    bamax = np.abs(blocks).max(axis=-1)
    _, e = np.frexp(bamax)
    code = np.where(bamax > 0, np.clip(e - 1 - 2 + 127, 0, 254), 0)
    scaled = np.ldexp(blocks, (127 - code)[..., None]).astype(np.float32).reshape(w.shape)
    return pack(cast_fp4(scaled)), code.astype(np.uint8).tobytes()


for trial in range(6):
    rows, cols = 24, 256
    w = (rng.standard_normal((rows, cols)) * [0.02, 1.0, 300.0, 1e-3, 5.0, 0.5][trial]).astype(np.float32)
    w[rng.random((rows, cols)) < 0.01] *= 40  # outliers
    w[3, 32:64] = 0  # an all-zero block for both formats
    w[5] *= np.float32(1e-2)  # a quiet row
    if trial == 5:  # values sitting exactly on E2M1 midpoints after scaling
        w[7, :16] = np.float32([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -2.5, -5, 0, 1, 2, 3])
    o = fmt_dump_quant(tool, "nvfp4", w)
    p_ref, s_ref, s2_ref = ref_nvfp4(w)
    check(o["status"] == "ok", f"nvfp4 trial {trial}: status {o['status']}")
    check(int(o["scale2"] or "0", 16) == int(np.float32(s2_ref).view(np.uint32)),
          f"nvfp4 trial {trial}: scale2 {o['scale2']} != ModelOpt {np.float32(s2_ref).view(np.uint32):08x}")
    check(bytes.fromhex(o["scales"]) == s_ref, f"nvfp4 trial {trial}: block scales differ from ModelOpt")
    check(bytes.fromhex(o["packed"]) == p_ref, f"nvfp4 trial {trial}: packed codes differ from ModelOpt")
    o = fmt_dump_quant(tool, "mxfp4", w)
    p_ref, s_ref = ref_mxfp4(w)
    check(o["status"] == "ok", f"mxfp4 trial {trial}: status {o['status']}")
    check(bytes.fromhex(o["scales"]) == s_ref, f"mxfp4 trial {trial}: scales differ from the OCP rule")
    check(bytes.fromhex(o["packed"]) == p_ref, f"mxfp4 trial {trial}: packed codes differ")

check.finish(f"formats match ml_dtypes: all codes decoded, {x.size} floats encoded; "
             "NVFP4 matches ModelOpt and MXFP4 the OCP rule on 6 matrices")

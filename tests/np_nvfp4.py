"""NVFP4 quantization in NumPy from the format's definition (ModelOpt's
rule), apart from fp4moe.hf's torch code and the library's C code: the
oracle the torch quantizer is held to on every device.

    scale_2 = amax(W) / (6 * 448)                    (FP32; 1 for an all-zero W)
    block scale = block_amax / (6 * scale_2), clamped to [2^-9, 448] (1 for an
                  all-zero block), to E4M3 by nearest value, ties to the even code
    element = E2M1 of w / (E4M3(scale) * scale_2): nearest magnitude of
              0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to the even code, saturating;
              code bit 3 = sign (w < 0)

E4M3 and E2M1 are rounded by searching their value tables (built from the
bit layouts: E4M3 bias 7 with subnormals m * 2^-9, 0x7F NaN), not by
arithmetic on exponents, so that no rounding step is shared with the code
under test.
"""
import numpy as np

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e4m3_values():
    """Magnitudes of the E4M3 codes 0..126 (127 is NaN), in float64."""
    v = []
    for c in range(127):
        e, m = c >> 3, c & 7
        v.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(v)


E4M3_VALUES = e4m3_values()


def nearest_even(x, table):
    """Codes of the table values nearest to x >= 0 (float64, exact for
    float32 inputs and these tables), ties to the even code."""
    d = np.abs(np.asarray(x, np.float64)[..., None] - table)
    best = d == d.min(axis=-1, keepdims=True)
    even = best & (np.arange(table.size) % 2 == 0)
    return np.where(even.any(-1), even.argmax(-1), best.argmax(-1))


def quantize_nvfp4(w, reciprocal=False):
    """float32 [R, K] -> (packed uint8 [R, K/2], scale codes uint8 [R, K/16],
    scale_2 float32). reciprocal=True computes scale_2 as amax times the
    float32 reciprocal of 2688 (what CUDA torch makes of a division by a
    Python number): not NVFP4's rule, a variant a test can show its data
    tells apart."""
    w = np.asarray(w, np.float32)
    R, K = w.shape
    amax = np.float32(np.abs(w).max())
    if reciprocal:
        s2 = np.float32(amax * (np.float32(1.0) / np.float32(6.0 * 448.0)))
    else:
        s2 = np.float32(amax / np.float32(6.0 * 448.0))
    if amax == 0:
        s2 = np.float32(1.0)
    blk = w.reshape(R, K // 16, 16)
    s = (np.abs(blk).max(-1) / (np.float32(6.0) * s2)).astype(np.float32)
    s = np.where(s == 0, np.float32(1.0), np.clip(s, np.float32(2.0 ** -9), np.float32(448.0))).astype(np.float32)
    scode = nearest_even(s, E4M3_VALUES).astype(np.uint8)
    d = (E4M3_VALUES[scode].astype(np.float32) * s2).astype(np.float32)
    q = (blk / d[..., None]).astype(np.float32)
    code = nearest_even(np.minimum(np.abs(q), np.float32(6.0)), E2M1_VALUES).astype(np.uint8)
    code = (code | np.where(q < 0, 8, 0)).astype(np.uint8).reshape(R, K)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    return packed, scode, s2

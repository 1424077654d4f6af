/*
 * Activation compression for the all-gather / dispatch ("FP4 all-gather").
 *
 * One encoded row per token, so a rank can decode any token alone:
 *   none   H x F32
 *   fp8    F32 scale (amax/448) + H x E4M3
 *   nvfp4  F32 scale (amax/(6*448)) + H/2 bytes E2M1 + H/16 E4M3 block
 *          scales (the NVFP4 weight format of ModelOpt applied to a [1, H]
 *          tensor, so the "per-tensor" scale is per token: a token's range
 *          does not depend on the other tokens in the batch)
 * Scales are stored with memcpy: rows are byte-packed and unaligned.
 */
#include "parallel/parallel_internal.h"
#include "util/util.h"
#include <math.h>
#include <string.h>

size_t fm_codec_row_bytes(fm_compress c, int H) {
    if (H < 1) return 0;
    switch (c) {
    case FM_COMPRESS_NONE: return (size_t)H * sizeof(float);
    case FM_COMPRESS_FP8: return sizeof(float) + (size_t)H;
    case FM_COMPRESS_NVFP4: return H % 16 ? 0 : sizeof(float) + (size_t)H / 2 + (size_t)H / 16;
    }
    return 0;
}

/* Smallest amax whose NVFP4 tensor scale stays a normal float; rows below
 * it are sent as zeros (they are below anything the experts resolve). */
#define NVFP4_MIN_AMAX (0x1p-126f * 6.0f * 448.0f)

fm_status fm_codec_encode_row(fm_compress c, const float *x, int H, uint8_t *dst) {
    float amax = 0.0f;
    for (int h = 0; h < H; h++) {
        if (!isfinite(x[h])) return fm_error(FM_E_NUMERIC, "compress: non-finite activation at column %d", h);
        float a = fabsf(x[h]);
        if (a > amax) amax = a;
    }
    if (c == FM_COMPRESS_NONE) {
        memcpy(dst, x, (size_t)H * sizeof(float));
        return FM_OK;
    }
    if (c == FM_COMPRESS_FP8) {
        float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
        if (!(scale > 0.0f)) scale = 0x1p-149f; /* amax so small that amax/448 underflowed */
        memcpy(dst, &scale, sizeof scale);
        for (int h = 0; h < H; h++) dst[sizeof scale + (size_t)h] = fm_f32_to_e4m3(x[h] / scale);
        return FM_OK;
    }
    if (c == FM_COMPRESS_NVFP4) {
        if (H % 16) return fm_error(FM_E_ARG, "compress: NVFP4 needs H a multiple of 16 (H=%d)", H);
        uint8_t *packed = dst + sizeof(float), *scales = packed + H / 2;
        float s2 = 0.0f;
        if (amax < NVFP4_MIN_AMAX) {
            memset(dst, 0, fm_codec_row_bytes(c, H));
            return FM_OK;
        }
        fm_status s = fm_quantize_nvfp4(x, 1, H, packed, scales, &s2);
        if (s) return s;
        memcpy(dst, &s2, sizeof s2);
        return FM_OK;
    }
    return fm_error(FM_E_ARG, "compress: unknown codec %d", (int)c);
}

void fm_codec_decode_row(fm_compress c, const uint8_t *src, int H, float *x) {
    if (c == FM_COMPRESS_NONE) {
        memcpy(x, src, (size_t)H * sizeof(float));
    } else if (c == FM_COMPRESS_FP8) {
        float scale;
        memcpy(&scale, src, sizeof scale);
        for (int h = 0; h < H; h++) x[h] = fm_e4m3_to_f32(src[sizeof scale + (size_t)h]) * scale;
    } else {
        float s2;
        memcpy(&s2, src, sizeof s2);
        fm_qmatrix m = {.fmt = FM_QF_NVFP4,
                        .rows = 1,
                        .cols = H,
                        .packed = src + sizeof s2,
                        .row_stride = H / 2,
                        .scales = src + sizeof s2 + H / 2,
                        .scale_stride = H / 16,
                        .scale2 = s2};
        fm_qmatrix_dequant_row(&m, 0, x);
    }
}

fm_status fm_dist_row_f32(const void *x, fm_dtype xdt, int H, int64_t t, float *out) {
    if (xdt == FM_DT_F32) {
        memcpy(out, (const float *)x + t * H, (size_t)H * sizeof(float));
    } else if (xdt == FM_DT_BF16 || xdt == FM_DT_F16) {
        const uint16_t *p = (const uint16_t *)x + t * H;
        for (int h = 0; h < H; h++) out[h] = xdt == FM_DT_BF16 ? fm_bf16_to_f32(p[h]) : fm_f16_to_f32(p[h]);
    } else {
        return fm_error(FM_E_ARG, "dist: activations must be F32, BF16 or F16, not %s", fm_dtype_name(xdt));
    }
    return FM_OK;
}

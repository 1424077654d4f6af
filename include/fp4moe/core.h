/* errors, dtypes, the FP4/FP8 formats; included by fp4moe.h (users include fp4moe.h). */
#ifndef FP4MOE_CORE_H
#define FP4MOE_CORE_H

#ifndef FP4MOE_H
#error "include fp4moe.h, not fp4moe/core.h"
#endif

/* ------------------------------------------------------------------ errors */

typedef enum {
    FM_OK = 0,
    FM_E_ARG,         /* bad argument from the caller                     */
    FM_E_IO,          /* open / read / write / mmap failed                */
    FM_E_FORMAT,      /* malformed file or value (safetensors, JSON, ...) */
    FM_E_RANGE,       /* value out of range (k > E, sizes, overflow)      */
    FM_E_NOMEM,       /* allocation failed                                */
    FM_E_NOTFOUND,    /* missing tensor / file / key                      */
    FM_E_UNSUPPORTED, /* not built in or not supported on this device     */
    FM_E_CUDA,        /* a CUDA call failed                               */
    FM_E_NUMERIC      /* non-finite input or result                       */
} fm_status;

const char *fm_status_name(fm_status s);
/* Message of the last failure on this thread ("" if none). */
const char *fm_last_error(void);
/* Records a failure message (printf-style) and returns s. */
fm_status fm_error(fm_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void fm_clear_error(void);

/* ----------------------------------------------------------------- dtypes */

typedef enum {
    FM_DT_INVALID = 0,
    FM_DT_BOOL,
    FM_DT_U8,
    FM_DT_I8,
    FM_DT_F8_E5M2,
    FM_DT_F8_E4M3,
    FM_DT_F8_E8M0,
    FM_DT_I16,
    FM_DT_U16,
    FM_DT_F16,
    FM_DT_BF16,
    FM_DT_I32,
    FM_DT_U32,
    FM_DT_F32,
    FM_DT_F64,
    FM_DT_I64,
    FM_DT_U64,
    FM_DT_F4, /* E2M1, two per byte; shape counts elements */
    FM_DT_COUNT_
} fm_dtype;

const char *fm_dtype_name(fm_dtype dt);     /* "F32", as safetensors spells it */
fm_dtype fm_dtype_from_name(const char *s); /* FM_DT_INVALID if unknown       */
/* Size in bits of one element (4 for F4). */
int fm_dtype_bits(fm_dtype dt);

/* ---------------------------------------------------------------- formats */

float fm_e2m1_to_f32(uint8_t code);     /* low 4 bits used                */
uint8_t fm_f32_to_e2m1(float x);        /* RNE, saturates at +-6, NaN->+6, -0->+0 (ModelOpt) */
float fm_e4m3_to_f32(uint8_t code);     /* float8_e4m3fn                  */
uint8_t fm_f32_to_e4m3(float x);        /* RNE, saturates at +-448 (inf too), NaN->0x7F|sign */
float fm_e8m0_to_f32(uint8_t code);     /* 2^(e-127), 0xFF -> NaN         */
uint8_t fm_f32_to_e8m0_floor(float x);  /* largest 2^e <= x (x > 0)       */
float fm_bf16_to_f32(uint16_t h);
uint16_t fm_f32_to_bf16(float x);       /* RNE, NaN stays NaN             */
float fm_f16_to_f32(uint16_t h);
uint16_t fm_f32_to_f16(float x);        /* RNE, overflow -> inf           */

/* Quantized formats of expert weights. */
typedef enum {
    FM_QF_NONE = 0,
    FM_QF_NVFP4, /* E2M1 + E4M3 scale per 16 along K + FP32 per-tensor scale */
    FM_QF_MXFP4, /* E2M1 + E8M0 scale per 32 along K                         */
    FM_QF_BF16   /* unquantized BF16 weights                                 */
} fm_qformat;

const char *fm_qformat_name(fm_qformat f); /* "nvfp4", "mxfp4", "bf16" */
fm_qformat fm_qformat_from_name(const char *s);
int fm_qformat_block(fm_qformat f); /* 16, 32, 0 */

/*
 * A quantized [rows, cols] matrix (rows = output features, cols = input
 * features, the K dimension). Element (r, c):
 *   packed[r*row_stride + c/2]  low nibble = even c, high nibble = odd c
 *   scales[r*scale_stride + c/block]
 *   value = E2M1(nibble) * scale(s) * scale2      (scale2 = 1 for MXFP4)
 * For FM_QF_BF16, packed holds rows*row_stride bytes of BF16 and scales is
 * NULL. bias (F32, [rows]) is optional (gpt-oss). Pointers are borrowed: the
 * owner (a checkpoint mapping or an fm_moe_layer) keeps them alive.
 */
typedef struct {
    fm_qformat fmt;
    int64_t rows, cols;
    const uint8_t *packed;
    int64_t row_stride;   /* bytes between rows of packed      */
    const uint8_t *scales;
    int64_t scale_stride; /* bytes between rows of scales      */
    float scale2;         /* NVFP4 per-tensor FP32 scale       */
    const float *bias;    /* optional, [rows]                  */
} fm_qmatrix;

/* ModelOpt NVFP4: scale2 = amax/(6*448); block scale = block_amax/(6*scale2)
 * clamped to [2^-9, 448], E4M3 RNE; all-zero block -> scale 1.0.
 * packed: rows*cols/2 bytes, scales: rows*cols/16 bytes. cols % 16 == 0. */
fm_status fm_quantize_nvfp4(const float *w, int64_t rows, int64_t cols,
                            uint8_t *packed, uint8_t *scales, float *scale2);
/* OCP MXFP4: scale = 2^(floor(log2(block_amax)) - 2). cols % 32 == 0. */
fm_status fm_quantize_mxfp4(const float *w, int64_t rows, int64_t cols,
                            uint8_t *packed, uint8_t *scales);
/* Dequantizes one row into out[cols] (float / double). */
void fm_qmatrix_dequant_row(const fm_qmatrix *m, int64_t row, float *out);
void fm_qmatrix_dequant_row_f64(const fm_qmatrix *m, int64_t row, double *out);
/* Bytes a kernel must read for the whole matrix (packed + scales). */
int64_t fm_qmatrix_bytes(const fm_qmatrix *m);

#endif /* FP4MOE_CORE_H */

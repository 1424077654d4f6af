/*
 * Prints the scalar format conversions of the library as text, for the
 * Python oracle test (tests/py_formats_ml_dtypes.py).
 *
 *   fmt_dump decode   one line per code: "<format> <code> <f32 bits hex>"
 *                     for e2m1 (16), e4m3 (256), e8m0 (256), bf16 and f16
 *                     (65536 each)
 *   fmt_dump encode   reads f32 bit patterns (hex, one per line) on stdin;
 *                     prints "<e2m1> <e4m3> <e8m0_floor> <bf16> <f16>" in hex
 *   fmt_dump quant nvfp4|mxfp4 ROWS COLS
 *                     reads ROWS*COLS f32 bit patterns on stdin, quantizes
 *                     them; prints "status <name>", then "packed <hex>",
 *                     "scales <hex>" and "scale2 <f32 bits hex>"
 */
#include "fp4moe.h"

#include <inttypes.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

static uint32_t bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "decode") == 0) {
        for (unsigned c = 0; c < 16; c++) printf("e2m1 %u %08" PRIx32 "\n", c, bits(fm_e2m1_to_f32((uint8_t)c)));
        for (unsigned c = 0; c < 256; c++) printf("e4m3 %u %08" PRIx32 "\n", c, bits(fm_e4m3_to_f32((uint8_t)c)));
        for (unsigned c = 0; c < 256; c++) printf("e8m0 %u %08" PRIx32 "\n", c, bits(fm_e8m0_to_f32((uint8_t)c)));
        for (unsigned c = 0; c < 65536; c++) printf("bf16 %u %08" PRIx32 "\n", c, bits(fm_bf16_to_f32((uint16_t)c)));
        for (unsigned c = 0; c < 65536; c++) printf("f16 %u %08" PRIx32 "\n", c, bits(fm_f16_to_f32((uint16_t)c)));
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "encode") == 0) {
        char line[64];
        while (fgets(line, sizeof line, stdin)) {
            uint32_t u;
            if (sscanf(line, "%" SCNx32, &u) != 1) {
                fprintf(stderr, "fmt_dump: bad input line: %s", line);
                return 1;
            }
            float x;
            memcpy(&x, &u, 4);
            printf("%x %x %x %x %x\n", fm_f32_to_e2m1(x), fm_f32_to_e4m3(x), fm_f32_to_e8m0_floor(x),
                   fm_f32_to_bf16(x), fm_f32_to_f16(x));
        }
        return 0;
    }
    if (argc == 5 && strcmp(argv[1], "quant") == 0) {
        fm_qformat qf = fm_qformat_from_name(argv[2]);
        long rows = atol(argv[3]), cols = atol(argv[4]);
        int blk = fm_qformat_block(qf);
        if (!blk || rows <= 0 || cols <= 0 || cols % blk || rows * cols > (1L << 24)) {
            fprintf(stderr, "fmt_dump: bad quant arguments\n");
            return 2;
        }
        size_t n = (size_t)(rows * cols);
        float *w = malloc(n * sizeof(float));
        uint8_t *packed = calloc(n / 2, 1), *scales = calloc(n / (size_t)blk, 1);
        if (!w || !packed || !scales) return 1;
        for (size_t i = 0; i < n; i++) {
            uint32_t u;
            if (scanf("%" SCNx32, &u) != 1) {
                fprintf(stderr, "fmt_dump: expected %zu values\n", n);
                return 1;
            }
            memcpy(&w[i], &u, 4);
        }
        float s2 = 1.0f;
        fm_status st = qf == FM_QF_NVFP4 ? fm_quantize_nvfp4(w, rows, cols, packed, scales, &s2)
                                         : fm_quantize_mxfp4(w, rows, cols, packed, scales);
        printf("status %s\npacked ", fm_status_name(st));
        for (size_t i = 0; i < n / 2; i++) printf("%02x", packed[i]);
        printf("\nscales ");
        for (size_t i = 0; i < n / (size_t)blk; i++) printf("%02x", scales[i]);
        printf("\nscale2 %08" PRIx32 "\n", bits(s2));
        free(w);
        free(packed);
        free(scales);
        return 0;
    }
    fprintf(stderr, "usage: fmt_dump decode | encode < f32-bits-hex | quant nvfp4|mxfp4 ROWS COLS\n");
    return 2;
}

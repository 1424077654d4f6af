/*
 * Prints the scalar format conversions of the library as text, for the
 * Python oracle test (tests/py_formats_ml_dtypes.py).
 *
 *   fmt_dump decode   one line per code: "<format> <code> <f32 bits hex>"
 *                     for e2m1 (16), e4m3 (256), e8m0 (256), bf16 and f16
 *                     (65536 each)
 *   fmt_dump encode   reads f32 bit patterns (hex, one per line) on stdin;
 *                     prints "<e2m1> <e4m3> <e8m0_floor> <bf16> <f16>" in hex
 */
#include "fp4moe.h"

#include <inttypes.h>
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
    fprintf(stderr, "usage: fmt_dump decode | fmt_dump encode < f32-bits-hex\n");
    return 2;
}

/* Bit-level pieces of the CUDA backend's FP4 weights that need no CUDA
 * header, so that host tests check them (tests/test_nv_scale.c): the NVFP4
 * block scales' conversion in the kernels and the form the upload stores
 * them in. cuda_internal.h includes this. */
#ifndef FM_FP4_BITS_H
#define FM_FP4_BITS_H
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define FM_HD __host__ __device__
#else
#define FM_HD
#endif

/* Two NVFP4 block scales as BF16 times 2^112, from their F16 pair h
 * (what the hardware's cvt.rn.f16x2.e4m3x2 makes of the two E4M3 bytes:
 * exact, each an F16 normal with its 3 mantissa bits on top, or NaN):
 * shifted right by 3, an F16 of exponent e and mantissa m has e at the BF16
 * exponent's low 5 bits and m's top 7 bits as the BF16 mantissa; or-ing 224
 * into that exponent (e < 32, so the or is a sum) makes it the F16's value
 * times 2^(224 - 112). The E4M3 NaN (F16 exponent 31) lands on exponent 255
 * with a mantissa, a BF16 NaN; a zero scale on 2^97 (the upload gives a zero
 * scale zero nibbles, fm_nv_canon_block). An or, not an add: an F16 NaN's
 * mantissa is not fixed, and the low bits of a NaN in the high half, which
 * the shift moves into the low half, must not carry back into it (the low
 * half, the scale of the neighbouring block of the same weight row, is then
 * wrong, but that row's output is NaN either way). Needs scales without
 * their sign bit (fm_nv_canon_block). */
static FM_HD inline uint32_t fm_nv_scale_bf16x2(uint32_t h) {
    return (h >> 3) | 0x70007000u;
}

/* An NVFP4 block (16 values: its E4M3 scale sc and its 8 bytes of nibbles)
 * in the form the GPU decode needs, with the same values: a negative scale's
 * sign moves to the nibbles (each E2M1 sign bit flipped), a zero scale gets
 * zero nibbles, a NaN scale is 0x7F. Returns the scale to store; packed is
 * changed in place. */
static inline uint8_t fm_nv_canon_block(uint8_t sc, uint8_t *packed) {
    if ((sc & 0x7F) == 0) {
        memset(packed, 0, 8);
        return 0;
    }
    if (sc & 0x80) {
        sc &= 0x7F;
        if (sc != 0x7F)
            for (int i = 0; i < 8; i++) packed[i] ^= 0x88;
    }
    return sc;
}
#endif

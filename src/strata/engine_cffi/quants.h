/* quants.h — block layouts and the per-type kernels behind the traits table (internal to quants*.c).
 * Layouts are GGUF's (little-endian). quants_ref.c holds the scalar reference of every kernel (dequantisation,
 * activation quantisers, one-row dot products); quants_x86.c the tiled products with AVX-512 / AVX2 paths (and,
 * without them, tiles of the scalar dots); quants.c the traits table, the naive reference products and the
 * public API. */
#pragma once
#include <math.h>
#include <string.h>
#include "kernels.h"
#include "simd.h"

// --- blocks

#define QK 32    // elements per Q8_0 / Q4_0 block
#define QKK 256  // elements per K-quant super-block

typedef struct {
    uint16_t d;      // f16 scale
    int8_t qs[QK];
} block_q8_0;

typedef struct {
    uint16_t d;          // f16 scale
    uint8_t qs[QK / 2];  // element i in the low nibble of qs[i], element i + 16 in the high one; value (q - 8) * d
} block_q4_0;

typedef struct {
    uint16_t d, dmin;     // f16 super-scales of the 6-bit sub-block scales and mins
    uint8_t scales[12];   // 8 scales and 8 mins of 6 bits, packed (see q4k_scale_min)
    uint8_t qs[QKK / 2];  // 4 chunks of 32 bytes: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1
} block_q4_K;

typedef struct {
    uint8_t ql[QKK / 2];  // low 4 bits
    uint8_t qh[QKK / 4];  // high 2 bits
    int8_t scales[QKK / 16];
    uint16_t d;           // f16 super-scale; value = d * scales[i / 16] * (q - 32)
} block_q6_K;

typedef struct {
    float d;
    int8_t qs[QKK];
    int16_t bsums[QKK / 16];  // sum of each group of 16 qs: the K-quants' offsets need it
} block_q8_K;

_Static_assert(sizeof(block_q8_0) == 34, "Q8_0 block");
_Static_assert(sizeof(block_q4_0) == 18, "Q4_0 block");
_Static_assert(sizeof(block_q4_K) == 144, "Q4_K block");
_Static_assert(sizeof(block_q6_K) == 210, "Q6_K block");
_Static_assert(sizeof(block_q8_K) == 292, "Q8_K block");

// The other weight types, as GGUF stores them (field order is the file's).
typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } block_q4_1;                       // d * q + m
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_0;         // d * (q - 16)
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_1;      // d * q + m
typedef struct { uint8_t scales[QKK / 16]; uint8_t qs[QKK / 4]; uint16_t d, dmin; } block_q2_K;
typedef struct { uint8_t hmask[QKK / 8]; uint8_t qs[QKK / 4]; uint8_t scales[12]; uint16_t d; } block_q3_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[QKK / 8]; uint8_t qs[QKK / 2]; } block_q5_K;
typedef struct { uint16_t d; uint8_t qs[QK / 2]; } block_iq4_nl;
typedef struct { uint16_t d, scales_h; uint8_t scales_l[QKK / 64]; uint8_t qs[QKK / 2]; } block_iq4_xs;
typedef struct { uint16_t d; uint8_t qs[QKK / 4]; uint8_t qh[QKK / 32]; uint8_t signs[QKK / 8];
                 uint8_t scales[QKK / 64]; } block_iq3_s;
typedef struct { uint16_t d; uint8_t qs[QKK / 4]; uint8_t aux[QKK / 8]; } block_iq3_xxs;  // aux: 8 x u32 scale|signs
typedef struct { uint16_t d; uint16_t qs[QKK / 8]; } block_iq2_xxs;                       // pairs of u32 per 32
typedef struct { uint16_t d; uint16_t qs[QKK / 8]; uint8_t scales[QKK / 32]; } block_iq2_xs;
typedef struct { uint16_t d; uint8_t qs[QKK / 8]; uint8_t signs[QKK / 8]; uint8_t qh[QKK / 32];
                 uint8_t scales[QKK / 32]; } block_iq2_s;
typedef struct { uint16_t d; uint8_t qs[QKK / 8]; uint16_t qh[QKK / 32]; } block_iq1_s;
typedef struct { uint8_t qs[QKK / 8]; uint8_t qh[QKK / 16]; uint8_t scales[QKK / 32]; } block_iq1_m;
typedef struct { uint8_t e; uint8_t qs[QK / 2]; } block_mxfp4;                            // 2^(e-127) * e2m1 value

_Static_assert(sizeof(block_q4_1) == 20 && sizeof(block_q5_0) == 22 && sizeof(block_q5_1) == 24, "32-blocks");
_Static_assert(sizeof(block_q2_K) == 84 && sizeof(block_q3_K) == 110 && sizeof(block_q5_K) == 176, "K blocks");
_Static_assert(sizeof(block_iq4_nl) == 18 && sizeof(block_iq4_xs) == 136 && sizeof(block_mxfp4) == 17, "4-bit");
_Static_assert(sizeof(block_iq3_s) == 110 && sizeof(block_iq3_xxs) == 98, "IQ3 blocks");
_Static_assert(sizeof(block_iq2_xxs) == 66 && sizeof(block_iq2_xs) == 74 && sizeof(block_iq2_s) == 82, "IQ2");
_Static_assert(sizeof(block_iq1_s) == 50 && sizeof(block_iq1_m) == 56, "IQ1 blocks");

// Tables of the IQ types (iq_tables.c, generated from the gguf package's) and of the non-linear 4-bit types.
extern const uint64_t strata_iq2xxs_grid[256], strata_iq2xs_grid[512], strata_iq2s_grid[1024], strata_iq1s_grid[2048];
extern const uint32_t strata_iq3xxs_grid[256], strata_iq3s_grid[512];
extern const uint8_t strata_ksigns_iq2xs[128];
extern const uint8_t strata_iq3s_planes[4 * 512];  // byte k of every IQ3_S grid entry, for k = 0 .. 3
static const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  // e2m1, doubled

// --- f16 / bf16 scalars
// Static inline for our own loops: under -fPIC the exported strata_* versions are calls through the PLT, which
// the compiler may not inline (they could be interposed), and a call per block costs a third of a prompt product.

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in f32
        float v = (float)mant * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    bits = exp == 31 ? sign | 0x7f800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (x >> 16) & 0x8000;
    x &= 0x7fffffff;
    if (x > 0x7f800000u) return sign | 0x7e00;   // NaN stays NaN
    if (x >= 0x477ff000u) return sign | 0x7c00;  // 65520 and up round to infinity
    if (x < 0x38800000u) {                        // below 2^-14: subnormal, units of 2^-24, round to even
        float a;
        memcpy(&a, &x, 4);
        return sign | (uint16_t)rintf(a * 16777216.0f);
    }
    x += 0xfff + ((x >> 13) & 1);  // round to nearest even; a carry moves into the exponent as it should
    return sign | (uint16_t)((x >> 13) - (112 << 10));
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#define F16(h) f16_to_f32(h)

// The 6-bit scale and min of each of the 8 sub-blocks: bytes 0-3 hold scales 0-3 (and the top bits of scales
// 4-7), bytes 4-7 mins 0-3 (and the top bits of mins 4-7), bytes 8-11 the low 4 bits of scales / mins 4-7.
static inline void q4k_scale_min(const uint8_t s[12], uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xf) | ((s[j] >> 6) << 4);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

// Element e of a Q6_K super-block, unsigned (0..63): half h = e / 128 of 64 ql bytes and 32 qh bytes; within a
// half, position p: ql byte p % 64, nibble p / 64; qh byte p % 32, 2-bit field p / 32.
static inline int q6k_value(const block_q6_K *b, int e) {
    int h = e / 128, p = e % 128;
    int lo = (b->ql[h * 64 + p % 64] >> (4 * (p / 64))) & 0xf;
    int hi = (b->qh[h * 32 + p % 32] >> (2 * (p / 32))) & 3;
    return lo | (hi << 4);
}


// Scales of the other types (inline: the vector tiles call them per block).

// The 16 signed 6-bit scales of a Q3_K block: low 4 bits from bytes 0-7 (nibble g / 8), high 2 bits from bytes
// 8-11 (field g / 4 of byte 8 + g % 4).
static inline void strata_q3k_scales(const uint8_t s[12], int8_t out[16]) {
    for (int g = 0; g < 16; g++) {
        int lo = (s[g % 8] >> (4 * (g / 8))) & 0xf, hi = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
        out[g] = (int8_t)((lo | hi << 4) - 32);
    }
}

// The signed 6-bit scale of sub-block s (32 values) of an IQ4_XS block.
static inline int strata_iq4xs_scale(const block_iq4_xs *b, int s) {
    return (((b->scales_l[s / 2] >> (4 * (s % 2))) & 0xf) | ((b->scales_h >> (2 * s)) & 3) << 4) - 32;
}

// 2^(e - 127) / 2, the scale of MXFP4's doubled e2m1 values, as the gguf package builds it from bits.
static inline float strata_e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// IQ1_M's f16 super-scale, kept in the top nibbles of its four 16-bit scale words.
static inline uint16_t strata_iq1m_d(const block_iq1_m *b) {
    uint16_t sc[4];
    memcpy(sc, b->scales, 8);
    return (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0xf0) | ((sc[2] >> 4) & 0xf00) | (sc[3] & 0xf000));
}

// --- the kernels of each type (quants_ref.c: to_float, from_float, vec_dot; quants_x86.c: gemm)

#define STRATA_TYPE_KERNELS(t) \
    void strata_to_float_##t(const void *src, float *dst, int64_t n); \
    float strata_vec_dot_##t(const void *w, const void *x, int64_t n); \
    void strata_gemm_##t(strata_gemm_args *a, int64_t r0, int64_t r1, int64_t n_tok);
STRATA_TYPE_KERNELS(f32)
STRATA_TYPE_KERNELS(f16)
STRATA_TYPE_KERNELS(bf16)
STRATA_TYPE_KERNELS(q8_0)
STRATA_TYPE_KERNELS(q4_0)
STRATA_TYPE_KERNELS(q4_K)
STRATA_TYPE_KERNELS(q6_K)
STRATA_TYPE_KERNELS(q4_1)
STRATA_TYPE_KERNELS(q5_0)
STRATA_TYPE_KERNELS(q5_1)
STRATA_TYPE_KERNELS(q2_K)
STRATA_TYPE_KERNELS(q3_K)
STRATA_TYPE_KERNELS(q5_K)
STRATA_TYPE_KERNELS(iq4_nl)
STRATA_TYPE_KERNELS(iq4_xs)
STRATA_TYPE_KERNELS(iq3_s)
STRATA_TYPE_KERNELS(iq3_xxs)
STRATA_TYPE_KERNELS(iq2_xxs)
STRATA_TYPE_KERNELS(iq2_xs)
STRATA_TYPE_KERNELS(iq2_s)
STRATA_TYPE_KERNELS(iq1_s)
STRATA_TYPE_KERNELS(iq1_m)
STRATA_TYPE_KERNELS(mxfp4)
void strata_to_float_q8_K(const void *src, float *dst, int64_t n);
void strata_from_float_f32(const float *src, void *dst, int64_t n);
void strata_from_float_q8_0(const float *src, void *dst, int64_t n);
void strata_from_float_q8_K(const float *src, void *dst, int64_t n);

/* blocks.cuh — the weight block formats on the device (GGUF's layouts, as quants.h has them) and their two
 * decoders: one value at a time (the reference kernels), and one 32-value chunk as int8s with its scales (the
 * fast products' dp4a path). Blocks are read by bytes and 16-bit halves: a row of 34- or 17-byte blocks gives
 * no wider alignment. The decoders compile for the host too (HD), so that a host program can check them against
 * the gguf package without a GPU (tests/engine/cuda_decoders.cu). */
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
#include "../strata_engine.h"

#define HD __host__ __device__ inline

namespace strata_cuda {

constexpr int QK = 32, QKK = 256;

__device__ __constant__ const int8_t KVALUES_IQ4NL_DEV[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                              1,    13,   25,  38,  53,  69,  89,  113};
__device__ __constant__ const int8_t KVALUES_MXFP4_DEV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
const int8_t KVALUES_IQ4NL_HOST[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
const int8_t KVALUES_MXFP4_HOST[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

HD int kvalue_iq4nl(int i) {
#ifdef __CUDA_ARCH__
    return KVALUES_IQ4NL_DEV[i];
#else
    return KVALUES_IQ4NL_HOST[i];
#endif
}

HD int kvalue_mxfp4(int i) {
#ifdef __CUDA_ARCH__
    return KVALUES_MXFP4_DEV[i];
#else
    return KVALUES_MXFP4_HOST[i];
#endif
}

// Products and differences rounded on their own, never fused into a multiply-add.
HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;  // the host build targets plain x86-64: no fused multiply-add to contract into
#endif
}

HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

HD float bits_to_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(bits);
#else
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Bytes per block and values per block of each weight type the products take. */
template <int T> struct block_geometry;
template <> struct block_geometry<STRATA_TYPE_F32> { static constexpr int bytes = 4, values = 1; };
template <> struct block_geometry<STRATA_TYPE_F16> { static constexpr int bytes = 2, values = 1; };
template <> struct block_geometry<STRATA_TYPE_BF16> { static constexpr int bytes = 2, values = 1; };
template <> struct block_geometry<STRATA_TYPE_Q8_0> { static constexpr int bytes = 34, values = QK; };
template <> struct block_geometry<STRATA_TYPE_MXFP4> { static constexpr int bytes = 17, values = QK; };
template <> struct block_geometry<STRATA_TYPE_Q4_K> { static constexpr int bytes = 144, values = QKK; };
template <> struct block_geometry<STRATA_TYPE_Q5_K> { static constexpr int bytes = 176, values = QKK; };
template <> struct block_geometry<STRATA_TYPE_Q6_K> { static constexpr int bytes = 210, values = QKK; };
template <> struct block_geometry<STRATA_TYPE_IQ4_XS> { static constexpr int bytes = 136, values = QKK; };

HD int u16_at(const uint8_t *p) { return p[0] | p[1] << 8; }

HD float f16_at(const uint8_t *p) { return __half2float(__ushort_as_half((unsigned short)u16_at(p))); }

HD float bf16_at(const uint8_t *p) { return bits_to_float((uint32_t)u16_at(p) << 16); }

/* 2^(e - 127) / 2: MXFP4's scale of its doubled e2m1 values. */
HD float e8m0_half(uint8_t e) {
    return bits_to_float(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

/* Element j of a 32-block of nibbles: the low nibble of qs[j] for j < 16, else the high nibble of qs[j - 16]. */
HD int nibble32(const uint8_t *qs, int j) { return j < 16 ? qs[j] & 0xf : qs[j - 16] >> 4; }

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block s (packed in 12 bytes). */
HD void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Byte offsets of the fields inside each block (quants.h's structs).
namespace q4k { constexpr int d = 0, dmin = 2, scales = 4, qs = 16; }
namespace q5k { constexpr int d = 0, dmin = 2, scales = 4, qh = 16, qs = 48; }
namespace q6k { constexpr int ql = 0, qh = 128, scales = 192, d = 208; }
namespace iq4xs { constexpr int d = 0, scales_h = 2, scales_l = 4, qs = 8; }

/* Value i of a row of type T, in the reference's order of f32 operations (no contraction into fused
 * multiply-adds: mul_rn, sub_rn). */
template <int T> HD float value_at(const uint8_t *row, int64_t i) {
    const uint8_t *b = row + (i / block_geometry<T>::values) * block_geometry<T>::bytes;
    int e = (int)(i % block_geometry<T>::values);
    if constexpr (T == STRATA_TYPE_F32) {
        return bits_to_float((uint32_t)u16_at(b) | (uint32_t)u16_at(b + 2) << 16);
    } else if constexpr (T == STRATA_TYPE_F16) {
        return f16_at(b);
    } else if constexpr (T == STRATA_TYPE_BF16) {
        return bf16_at(b);
    } else if constexpr (T == STRATA_TYPE_Q8_0) {
        return mul_rn((float)(int8_t)b[2 + e], f16_at(b));
    } else if constexpr (T == STRATA_TYPE_MXFP4) {
        return mul_rn(e8m0_half(b[0]), (float)kvalue_mxfp4(nibble32(b + 1, e)));
    } else if constexpr (T == STRATA_TYPE_Q4_K || T == STRATA_TYPE_Q5_K) {
        constexpr int qs = T == STRATA_TYPE_Q4_K ? q4k::qs : q5k::qs;
        int s = e / 32, sc, m;
        k_scale_min(b + q4k::scales, s, &sc, &m);
        int q = (b[qs + (e / 64) * 32 + e % 32] >> (4 * (s % 2))) & 0xf;
        if constexpr (T == STRATA_TYPE_Q5_K) q |= ((b[q5k::qh + e % 32] >> s) & 1) << 4;
        float dl = mul_rn(f16_at(b + q4k::d), (float)sc), ml = mul_rn(f16_at(b + q4k::dmin), (float)m);
        return sub_rn(mul_rn(dl, (float)q), ml);
    } else if constexpr (T == STRATA_TYPE_Q6_K) {
        int h = e / 128, p = e % 128;
        int lo = (b[q6k::ql + h * 64 + p % 64] >> (4 * (p / 64))) & 0xf;
        int hi = (b[q6k::qh + h * 32 + p % 32] >> (2 * (p / 32))) & 3;
        float dl = mul_rn(f16_at(b + q6k::d), (float)(int8_t)b[q6k::scales + e / 16]);
        return mul_rn(dl, (float)((lo | hi << 4) - 32));
    } else {  // IQ4_XS
        int s = e / 32;
        int sc = (((b[iq4xs::scales_l + s / 2] >> (4 * (s % 2))) & 0xf) |
                  ((u16_at(b + iq4xs::scales_h) >> (2 * s)) & 3) << 4) - 32;
        float dl = mul_rn(f16_at(b + iq4xs::d), (float)sc);
        return mul_rn(dl, (float)kvalue_iq4nl(nibble32(b + iq4xs::qs + 16 * s, e % 32)));
    }
}

/* A chunk of 32 values as int8s packed four to a word, with its scales: value j = d_lo * q_j - m for j < 16,
 * d_hi * q_j - m above (d_lo = d_hi except for Q6_K, whose scales cover 16 values). */
struct chunk {
    int32_t q[8];
    float d_lo, d_hi, m;
};

HD int32_t pack4(int a, int b, int c, int d) {
    return (int32_t)((uint32_t)(uint8_t)a | (uint32_t)(uint8_t)b << 8 | (uint32_t)(uint8_t)c << 16 |
                     (uint32_t)(uint8_t)d << 24);
}

template <int T> HD int chunk_value(const uint8_t *b, int c, int j);

/* Chunk c (values 32c .. 32c + 31) of a row of type T. */
template <int T> HD chunk chunk_at(const uint8_t *row, int64_t c) {
    constexpr int per_block = block_geometry<T>::values / 32;
    const uint8_t *b = row + (c / per_block) * block_geometry<T>::bytes;
    int s = (int)(c % per_block);
    chunk k;
    k.m = 0.0f;
    if constexpr (T == STRATA_TYPE_Q8_0) {
        k.d_lo = k.d_hi = f16_at(b);
    } else if constexpr (T == STRATA_TYPE_MXFP4) {
        k.d_lo = k.d_hi = e8m0_half(b[0]);
    } else if constexpr (T == STRATA_TYPE_Q4_K || T == STRATA_TYPE_Q5_K) {
        int sc, m;
        k_scale_min(b + q4k::scales, s, &sc, &m);
        k.d_lo = k.d_hi = f16_at(b + q4k::d) * (float)sc;
        k.m = f16_at(b + q4k::dmin) * (float)m;
    } else if constexpr (T == STRATA_TYPE_Q6_K) {
        float d = f16_at(b + q6k::d);
        k.d_lo = d * (float)(int8_t)b[q6k::scales + 2 * s];
        k.d_hi = d * (float)(int8_t)b[q6k::scales + 2 * s + 1];
    } else {  // IQ4_XS
        int sc = (((b[iq4xs::scales_l + s / 2] >> (4 * (s % 2))) & 0xf) |
                  ((u16_at(b + iq4xs::scales_h) >> (2 * s)) & 3) << 4) - 32;
        k.d_lo = k.d_hi = f16_at(b + iq4xs::d) * (float)sc;
    }
    for (int w = 0; w < 8; w++)  // a constant count: unrolled, k.q stays in registers
        k.q[w] = pack4(chunk_value<T>(b, s, 4 * w), chunk_value<T>(b, s, 4 * w + 1), chunk_value<T>(b, s, 4 * w + 2),
                       chunk_value<T>(b, s, 4 * w + 3));
    return k;
}

/* The int8 of value j of sub-chunk s of block b (the chunk's scales apart). */
template <int T> HD int chunk_value(const uint8_t *b, int s, int j) {
    if constexpr (T == STRATA_TYPE_Q8_0) {
        return (int8_t)b[2 + j];
    } else if constexpr (T == STRATA_TYPE_MXFP4) {
        return kvalue_mxfp4(nibble32(b + 1, j));
    } else if constexpr (T == STRATA_TYPE_Q4_K || T == STRATA_TYPE_Q5_K) {
        constexpr int qs = T == STRATA_TYPE_Q4_K ? q4k::qs : q5k::qs;
        int q = (b[qs + (s / 2) * 32 + j] >> (4 * (s % 2))) & 0xf;
        if constexpr (T == STRATA_TYPE_Q5_K) q |= ((b[q5k::qh + j] >> s) & 1) << 4;
        return q;
    } else if constexpr (T == STRATA_TYPE_Q6_K) {
        int e = 32 * s + j, h = e / 128, p = e % 128;
        int lo = (b[q6k::ql + h * 64 + p % 64] >> (4 * (p / 64))) & 0xf;
        int hi = (b[q6k::qh + h * 32 + p % 32] >> (2 * (p / 32))) & 3;
        return (lo | hi << 4) - 32;
    } else {  // IQ4_XS
        return kvalue_iq4nl(nibble32(b + iq4xs::qs + 16 * s, j));
    }
}

// --- the activations' side of the dp4a products

/* The activations of a quantised product as 32-value int8 blocks (Q8_1's content: scale d = amax / 127, and
 * s = d * the sum of the block's q, which the K-quants' mins take). */
struct act_block {
    float d, s;
    int8_t q[32];
};

/* v / d rounded to the nearest integer, ties to even (0 for an all-zero block). */
HD int act_quant(float v, float d) {
#ifdef __CUDA_ARCH__
    return d == 0.0f ? 0 : __float2int_rn(v / d);
#else
    return d == 0.0f ? 0 : (int)nearbyintf(v / d);
#endif
}

/* c + the dot product of four packed int8s with four others. */
HD int dot4(int32_t a, int32_t b, int c) {
#ifdef __CUDA_ARCH__
    return __dp4a(a, b, c);
#else
    for (int i = 0; i < 4; i++) c += (int8_t)(uint8_t)((uint32_t)a >> (8 * i)) * (int8_t)(uint8_t)((uint32_t)b >> (8 * i));
    return c;
#endif
}

/* sum_j value_j x_j over a chunk: d_x (d_lo sum_lo(q qx) + d_hi sum_hi(q qx)) - m s_x. */
HD float chunk_dot(const chunk &k, const act_block &a) {
    const int32_t *aq = (const int32_t *)a.q;
    int lo = 0, hi = 0;
    for (int i = 0; i < 4; i++) lo = dot4(k.q[i], aq[i], lo);
    for (int i = 4; i < 8; i++) hi = dot4(k.q[i], aq[i], hi);
    return a.d * (k.d_lo * (float)lo + k.d_hi * (float)hi) - k.m * a.s;
}

}  // namespace strata_cuda

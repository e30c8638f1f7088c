/* simd.h — the vector helpers the kernels (quants_*.c) and the forward pass (blocks.c) share.
 * AV lanes of f32 per register (avec, av_*): 16 with AVX-512, 8 with AVX2 + F16C + FMA; AV is undefined without a
 * vector unit, and callers keep a scalar path for that case. */
#pragma once
#include <stdint.h>
#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX2__)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#if defined(__AVX512F__)
#define AV 16
typedef __m512 avec;
#define av_zero _mm512_setzero_ps
#define av_set1 _mm512_set1_ps
#define av_add _mm512_add_ps
#define av_fmadd _mm512_fmadd_ps
#define av_load _mm512_loadu_ps
#define av_store _mm512_storeu_ps
#define av_sum _mm512_reduce_add_ps
#define av_sub _mm512_sub_ps
#define av_mul _mm512_mul_ps
#define av_max _mm512_max_ps
#define av_min _mm512_min_ps
#define av_div _mm512_div_ps
static inline avec av_floor(avec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
/* 2^n for whole n in [-126, 127], built as an f32's exponent bits */
static inline avec av_pow2(avec n) {
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
static inline avec av_from_f16(const uint16_t *h) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h)); }
static inline avec av_from_bf16(const uint16_t *h) {  // bf16 is the top half of an f32
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline avec av_from_i8(const int8_t *v) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)v)));
}
/* v's lanes where x > lo, 0 elsewhere; whether any lane of x is above lo */
static inline avec av_where_above(avec x, avec lo, avec v) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GT_OQ), v);
}
static inline int av_any_above(avec x, avec lo) { return _mm512_cmp_ps_mask(x, lo, _CMP_GT_OQ) != 0; }
/* bit k set where lane k of x equals v; where lane k of x is a NaN */
static inline unsigned av_equal_lanes(avec x, avec v) { return _mm512_cmp_ps_mask(x, v, _CMP_EQ_OQ); }
static inline unsigned av_nan_lanes(avec x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }
static inline float av_hmax(avec x) { return _mm512_reduce_max_ps(x); }
/* lane k = the sum of a[k]'s lanes, for 16 vectors at once: pairs of lanes, then of quarters, every vector's sum
 * by the same tree */
static inline avec av_sums(const avec a[16]) {
    __m512 t[8], u[4];
    for (int k = 0; k < 8; k++)  // per quarter: a0+a2, b0+b2, a1+a3, b1+b3
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 4; k++)  // per quarter: the quarter's sums of a[4k] .. a[4k + 3]
        u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0xee));
    const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xdd));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define AV 8
typedef __m256 avec;
#define av_zero _mm256_setzero_ps
#define av_set1 _mm256_set1_ps
#define av_add _mm256_add_ps
#define av_fmadd _mm256_fmadd_ps
#define av_load _mm256_loadu_ps
#define av_store _mm256_storeu_ps
#define av_sum hsum256
#define av_sub _mm256_sub_ps
#define av_mul _mm256_mul_ps
#define av_max _mm256_max_ps
#define av_min _mm256_min_ps
#define av_div _mm256_div_ps
static inline avec av_floor(avec v) { return _mm256_floor_ps(v); }
static inline avec av_pow2(avec n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
static inline avec av_from_f16(const uint16_t *h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)); }
static inline avec av_from_bf16(const uint16_t *h) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline avec av_from_i8(const int8_t *v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)v)));
}
static inline avec av_where_above(avec x, avec lo, avec v) { return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GT_OQ), v); }
static inline int av_any_above(avec x, avec lo) { return _mm256_movemask_ps(_mm256_cmp_ps(x, lo, _CMP_GT_OQ)) != 0; }
static inline unsigned av_equal_lanes(avec x, avec v) {
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(x, v, _CMP_EQ_OQ));
}
static inline unsigned av_nan_lanes(avec x) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
static inline float av_hmax(avec x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline avec av_sums(const avec a[8]) {
    __m256 t[4], u[2];
    for (int k = 0; k < 4; k++)
        t[k] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm256_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 2; k++)
        u[k] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * k], t[2 * k + 1], 0x44),
                             _mm256_shuffle_ps(t[2 * k], t[2 * k + 1], 0xee));
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
#endif

#if defined(AV)
/* e^x for x <= 87 (a softmax's x <= 0, SwiGLU's -g, a sampler's scaled logits less their maximum), within a few
 * ulp of expf: e^x = 2^n e^r with |r| <= ln2 / 2, n = round(x / ln2), ln2 split in two parts so that r is exact,
 * and e^r by Cephes' degree-7 polynomial for expf. Below -87 it gives about 1e-38 rather than 0, which no softmax
 * sum notices. */
static inline avec av_exp_neg(avec x) {
    static const float c[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};
    x = av_max(x, av_set1(-87.0f));
    avec n = av_floor(av_fmadd(x, av_set1(1.44269504089f), av_set1(0.5f)));
    avec r = av_fmadd(n, av_set1(-0.693359375f), x);
    r = av_fmadd(n, av_set1(2.12194440e-4f), r);
    avec poly = av_set1(c[0]);
    for (int k = 1; k < 6; k++) poly = av_fmadd(poly, r, av_set1(c[k]));
    avec er = av_fmadd(poly, av_mul(r, r), av_add(r, av_set1(1.0f)));  // 1 + r + r^2 poly(r)
    return av_mul(er, av_pow2(n));
}
#endif


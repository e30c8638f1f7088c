/* simd.h — the vector helpers the kernels (quants_*.c) and the forward pass (engine.c) share.
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
#endif

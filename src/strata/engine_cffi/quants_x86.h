/* quants_x86.h — what the tiled products of quants_x86*.c share: tile geometry, the driver over rows and tokens,
 * and small vector helpers. */
#pragma once
#include "quants.h"

// --- fast products: tiles of TR weight rows x TT tokens
// A tile keeps TR * TT accumulators in registers, so each weight block is loaded (and unpacked) once per TT
// tokens and each activation block once per TR rows; with one token (decode) the (TR, 1) tile streams TR rows
// at once. tile_*(..., NR, NT) are always inlined with constant NR <= TR, NT <= TT, which unrolls them.

#define TR 4
#define TT 4
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI512 1  // 512-bit integer products: two Q8_0 blocks, or 64 K-quant values, per instruction
#endif
#define TOKEN_BLOCK 64  // tokens whose activations stay in cache while every row tile passes over them

#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 4")

typedef strata_gemm_args gemm_args;

#define W_ROW(a, r) ((const void *)((a)->w + (r) * (a)->wb))
#define TILE_ROW(a, r, i) ((r) + (i) * (a)->rs)
#define X_ROW(a, t) ((const void *)((a)->x + (t) * (a)->xb))

#if defined(__AVX2__)
// acc + sum of the 4 products of unsigned u and signed s bytes, per 32-bit lane
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// acc + sum of the 2 products of 16-bit a and b, per 32-bit lane
static inline __m256i dot_s16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// An f16 scale in every lane.
static inline __m256 f16_bcast(const uint16_t *h) {
    return _mm256_cvtph_ps(_mm_set1_epi16((short)*h));
}
#endif

#if defined(__AVX2__)
// The f16 scale of padding blocks, which repeat a row's last block so that a step can stay whole.
static const uint16_t ZERO_F16 = 0;

INLINE void store_tile(const gemm_args *a, int64_t r, int64_t t, int NR, int NT, __m256 acc[TR][TT]) {
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int j = 0; j < NT; j++) a->y[(t + j) * a->ldy + TILE_ROW(a, r, i)] = hsum256(acc[i][j]);
}

// The shuffle pattern that copies 16-bit element e of each 128-bit lane to all of that lane.
static inline __m128i pick16(int e) {
    return _mm_set1_epi16((short)(0x0100 + 0x0202 * e));
}

#endif

#if defined(VNNI512)
INLINE void store_tile512(const gemm_args *a, int64_t r, int64_t t, int NR, int NT, __m512 acc[TR][TT]) {
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int j = 0; j < NT; j++)
            a->y[(t + j) * a->ldy + TILE_ROW(a, r, i)] = _mm512_reduce_add_ps(acc[i][j]);
}

// Scales a and b, 8 lanes each.
static inline __m512 f16_pair512(const uint16_t *a, const uint16_t *b) {
    return _mm512_cvtph_ps(_mm256_set_m128i(_mm_set1_epi16((short)*b), _mm_set1_epi16((short)*a)));
}

static inline __m512i load_2x256(const void *lo, const void *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(lo)), _mm256_loadu_si256(hi), 1);
}

// Scales a, b, c, d, 4 lanes each.
static inline __m512 f16_quad(const uint16_t *a, const uint16_t *b, const uint16_t *c, const uint16_t *d) {
    __m128 f = _mm_cvtph_ps(_mm_setr_epi16((short)*a, (short)*b, (short)*c, (short)*d, 0, 0, 0, 0));
    return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(f));
}

// 16 bytes from each of p[0..3], in that order.
static inline __m512i load_4x128(const void *p0, const void *p1, const void *p2, const void *p3) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(p0));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(p1), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(p2), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128(p3), 3);
}
#endif

// Without a vector path a tile is NR * NT scalar dot products.
#define TILE_SCALAR(t) \
    static inline void tile_scalar_##t(const gemm_args *a, int64_t r, int64_t tk, int NR, int NT) { \
        for (int i = 0; i < NR; i++) \
            for (int j = 0; j < NT; j++) \
                a->y[(tk + j) * a->ldy + TILE_ROW(a, r, i)] = \
                    strata_vec_dot_##t(W_ROW(a, TILE_ROW(a, r, i)), X_ROW(a, tk + j), a->n); \
    }
// Rows [r0, r1) x all tokens by tiles of TR rows a quarter of the range apart (rows r, r + rs, ...): adjacent
// rows, read as TR streams a few KB apart, starve the hardware prefetchers (a Q8_0 decode product ran at a
// third of the memory bandwidth). The last (r1 - r0) % TR rows, and tokens short of a full tile, take 1-wide tiles.
#define DEFINE_GEMM(NAME, TILE) \
    void NAME(gemm_args *a, int64_t r0, int64_t r1, int64_t n_tok) { \
        a->rs = (r1 - r0) / TR; \
        for (int64_t tb = 0; tb < n_tok; tb += TOKEN_BLOCK) { \
            int64_t te = tb + TOKEN_BLOCK < n_tok ? tb + TOKEN_BLOCK : n_tok; \
            for (int64_t r = r0; r < r0 + a->rs; r++) { \
                int64_t t = tb; \
                for (; t + TT <= te; t += TT) TILE(a, r, t, TR, TT); \
                for (; t < te; t++) TILE(a, r, t, TR, 1); \
            } \
            for (int64_t r = r0 + TR * a->rs; r < r1; r++) { \
                int64_t t = tb; \
                for (; t + TT <= te; t += TT) TILE(a, r, t, 1, TT); \
                for (; t < te; t++) TILE(a, r, t, 1, 1); \
            } \
        } \
    }


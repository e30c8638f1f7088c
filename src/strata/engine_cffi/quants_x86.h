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

// --- prompt-shaped K-quant products (AVX-512 VNNI)
// With many tokens, each tile of rows is unpacked once per block of tokens (kq_prep): values to bytes, scales to
// the lanes they multiply, so that work is not repeated for every tile of tokens. One vpdpbusd per 64 values sums
// 4 products per lane (at most 4 * 63 * 128 for Q6_K: 16 bits hold it); two chunks pack to 16 bits and one
// vpdpwssd applies their scales: 3 multiplies per 64 values where vpmaddubsw + vpdpwssd take 4.
#if defined(VNNI512)
#define KQ_PREPARED 1
#define KQ_MIN_TOKENS 16  // below this, preparing the rows costs more than it saves (measured)

typedef struct {
    uint8_t q[4][64];  // chunk c: elements 64c .. 64c + 63, unsigned (at most 63)
    int16_t s[2][32];  // per 16-bit lane of chunks 2h, 2h + 1 packed together, the scale of its sums
    union {
        float mins[8];    // Q4_K: dmin * m_s
        int16_t sc[16];   // Q6_K: the scales
    };
    float d;
} __attribute__((aligned(64))) kq_prep;

// What tile_kq_prepared adds to the products of the prepared values: Q4_K's and Q6_K's own terms.
enum { KQ_Q4_K, KQ_Q6_K };

// The scales of a packed pair of chunks 2h, 2h + 1: its 128-bit lane k holds 4 sums of chunk 2h (elements
// 128h + 16k ..) then 4 of chunk 2h + 1 (64 further on); sc holds one scale per `group` elements.
static inline __m512i kq_pair_scales(__m512i sc, int h, int group) {
    const __m512i second = _mm512_set_epi16(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0,
                                            1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i lane_k = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                            1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    // element 128h + 64 * second + 16k, in units of `group`
    __m512i e = _mm512_add_epi16(_mm512_slli_epi16(second, 6), _mm512_slli_epi16(lane_k, 4));
    __m512i idx = _mm512_srli_epi16(_mm512_add_epi16(e, _mm512_set1_epi16((short)(128 * h))), group == 32 ? 5 : 4);
    return _mm512_permutexvar_epi16(idx, sc);
}

// Lanes 0-7 of a, then lanes 0-7 of b, each the sum of its register's two halves.
static inline __m512i fold_pair(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xee));
}

// A tile of rows prepared in p (row i's blocks nb apart) and tokens in pairs. Each pair folds its two 16-lane
// sums into one register: a 4 x 4 tile holds 8 accumulators, not 16. The offsets cost a pair one instruction or
// two: Q4_K's mins (dmin * m_s times da * the sum of sub-block s of x, in lanes s and 8 + s) one FMA; Q6_K's
// 32 * sum_g sc_g * bsum_g a multiply-add of 16-bit pairs and a shift. Each kind's direct tile ends in the same
// integer lanes and f32 steps (kq_canonical).
INLINE void tile_kq_prepared(int kind, const gemm_args *a, const kq_prep *p, int64_t r, int64_t t, int NR, int NT) {
    const block_q8_K *x[TT];
    __m512 acc[TR][TT / 2];
    int64_t nb = a->n / QKK;
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j);
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int k = 0; k < NT / 2; k++) acc[i][k] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        // per pair, in the halves of a register: da of each token, and its bsums (Q6_K) or, for Q4_K, da * the sum
        // of each sub-block of 32
        __m512 da[TT / 2], xsum[TT / 2];
        __m512i bsums[TT / 2];
        UNROLL for (int k = 0; k < NT / 2; k++) {
            const block_q8_K *X0 = &x[2 * k][b], *X1 = &x[2 * k + 1][b];
            da[k] = _mm512_insertf32x8(_mm512_set1_ps(X0->d), _mm256_set1_ps(X1->d), 1);
            bsums[k] = load_2x256(X0->bsums, X1->bsums);
            if (kind == KQ_Q4_K)
                xsum[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(bsums[k], _mm512_set1_epi16(1))), da[k]);
        }
        UNROLL for (int i = 0; i < NR; i++) {
            const kq_prep *P = &p[i * nb + b];
            __m512i isum[TT];
            UNROLL for (int j = 0; j < NT; j++) isum[j] = _mm512_setzero_si512();
            UNROLL for (int h = 0; h < 2; h++) {
                __m512i q0 = _mm512_load_si512(P->q[2 * h]), q1 = _mm512_load_si512(P->q[2 * h + 1]);
                __m512i s = _mm512_load_si512(P->s[h]);
                UNROLL for (int j = 0; j < NT; j++) {
                    const int8_t *xs = x[j][b].qs + 128 * h;
                    // a fresh load for every row: kept across rows, x would take 16 registers
                    __asm__("" : "+r"(xs));
                    __m512i zero = _mm512_setzero_si512();
                    __m512i p0 = _mm512_dpbusd_epi32(zero, q0, _mm512_loadu_si512(xs));
                    __m512i p1 = _mm512_dpbusd_epi32(zero, q1, _mm512_loadu_si512(xs + 64));
                    isum[j] = _mm512_dpwssd_epi32(isum[j], _mm512_packs_epi32(p0, p1), s);
                }
            }
            __m512 d = _mm512_set1_ps(P->d);
            UNROLL for (int k = 0; k < NT / 2; k++) {
                __m512i sum = fold_pair(isum[2 * k], isum[2 * k + 1]);
                if (kind == KQ_Q6_K)  // the values are q + 32
                    sum = _mm512_sub_epi32(sum, _mm512_slli_epi32(_mm512_madd_epi16(
                        _mm512_broadcast_i32x8(_mm256_load_si256((const __m256i *)P->sc)), bsums[k]), 5));
                acc[i][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, da[k]), acc[i][k]);
                if (kind == KQ_Q4_K)
                    acc[i][k] = _mm512_fnmadd_ps(_mm512_broadcast_f32x8(_mm256_load_ps(P->mins)), xsum[k],
                                                 acc[i][k]);
            }
        }
    }
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int k = 0; k < NT / 2; k++) {
            int64_t row = TILE_ROW(a, r, i);
            a->y[(t + 2 * k) * a->ldy + row] = hsum256(_mm512_castps512_ps256(acc[i][k]));
            a->y[(t + 2 * k + 1) * a->ldy + row] = hsum256(_mm512_extractf32x8_ps(acc[i][k], 1));
        }
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
// third of the memory bandwidth). The last (r1 - r0) % TR rows take 1-wide tiles; tokens short of a full tile take
// a pair, then single ones (two decoding sequences went through the weights twice, one token at a time).
#define DEFINE_GEMM(NAME, TILE) \
    void NAME(gemm_args *a, int64_t r0, int64_t r1, int64_t n_tok) { \
        a->rs = (r1 - r0) / TR; \
        for (int64_t tb = 0; tb < n_tok; tb += TOKEN_BLOCK) { \
            int64_t te = tb + TOKEN_BLOCK < n_tok ? tb + TOKEN_BLOCK : n_tok; \
            for (int64_t r = r0; r < r0 + a->rs; r++) { \
                int64_t t = tb; \
                for (; t + TT <= te; t += TT) TILE(a, r, t, TR, TT); \
                for (; t + 2 <= te; t += 2) TILE(a, r, t, TR, 2); \
                for (; t < te; t++) TILE(a, r, t, TR, 1); \
            } \
            for (int64_t r = r0 + TR * a->rs; r < r1; r++) { \
                int64_t t = tb; \
                for (; t + TT <= te; t += TT) TILE(a, r, t, 1, TT); \
                for (; t + 2 <= te; t += 2) TILE(a, r, t, 1, 2); \
                for (; t < te; t++) TILE(a, r, t, 1, 1); \
            } \
        } \
    }


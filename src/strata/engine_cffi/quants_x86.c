/* quants_x86.c — the fast kernels: activation quantisers and tiled products, with AVX-512 (VNNI) and AVX2 paths
 * chosen at compile time (-march=native) and tiles of quants_ref.c's scalar dots as the #else. */
#include <stdlib.h>
#include "quants_x86.h"
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// --- activation quantisation

void strata_from_float_f32(const float *src, void *dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}

// Both activation types as the gguf package quantises Q8_0: d = amax / 127, q = round-half-away(x * (1 / d)).

// d of the n values at x (n a multiple of 16), and 1 / d in *id (0 for an all-zero block).
static float q8_scale(const float *x, int n, float *id) {
#if defined(__AVX512F__)
    __m512 m = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
    float amax = _mm512_reduce_max_ps(m);
#else
    float amax = 0.0f;
    for (int j = 0; j < n; j++) amax = fmaxf(amax, fabsf(x[j]));
#endif
    float d = amax / 127.0f;
    *id = d != 0.0f ? 1.0f / d : 0.0f;
    return d;
}

// q[0..16) = round-half-away(x * id), as roundf; returns their sum (Q8_K's bsums).
static int q8_round16(const float *x, float id, int8_t *q) {
#if defined(__AVX512F__)
    // truncate |v|, then add 1 where the dropped fraction (exact: |v| - trunc|v|) is at least 1/2
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(id)), a = _mm512_abs_ps(v);
    __m512 t = _mm512_roundscale_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(a, t), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    __m512i qi = _mm512_cvttps_epi32(_mm512_mask_add_ps(t, up, t, _mm512_set1_ps(1.0f)));
    __mmask16 negative = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
    qi = _mm512_mask_sub_epi32(qi, negative, _mm512_setzero_si512(), qi);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qi));
    return _mm512_reduce_add_epi32(qi);
#else
    int s = 0;
    for (int j = 0; j < 16; j++) s += q[j] = (int8_t)roundf(x[j] * id);
    return s;
#endif
}

void strata_from_float_q8_0(const float *x, void *dst, int64_t n) {
    block_q8_0 *b = dst;
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        float id, d = q8_scale(x, QK, &id);
        b[i].d = f32_to_f16(d);
        q8_round16(x, id, b[i].qs);
        q8_round16(x + 16, id, b[i].qs + 16);
    }
}

// Q8_K keeps d in f32, and the sums of each 16 values for the K-quants' mins and offsets.
void strata_from_float_q8_K(const float *x, void *dst, int64_t n) {
    block_q8_K *b = dst;
    for (int64_t i = 0; i < n / QKK; i++, x += QKK) {
        float id;
        b[i].d = q8_scale(x, QKK, &id);
        for (int g = 0; g < QKK / 16; g++) b[i].bsums[g] = (int16_t)q8_round16(x + 16 * g, id, b[i].qs + 16 * g);
    }
}


// --- fast products: tiles of TR weight rows x TT tokens
// A tile keeps TR * TT accumulators in registers, so each weight block is loaded (and unpacked) once per TT
// tokens and each activation block once per TR rows; with one token (decode) the (TR, 1) tile streams TR rows
// at once (quants_x86.h). Each has a 512-bit version (AVX-512 with VNNI), a 256-bit one (AVX2) and the scalar
// dot products as the #else.

// F32, F16 and BF16 weights with f32 activations: AV lanes of f32 per register (simd.h).
#if defined(AV)
// AV weights from element i of a row of `type`, as f32 (bf16 is the top half of an f32).
INLINE avec load_w(int type, const void *row, int64_t i) {
    if (type == STRATA_TYPE_F32) return av_load((const float *)row + i);
    if (type == STRATA_TYPE_F16) return av_from_f16((const uint16_t *)row + i);
    return av_from_bf16((const uint16_t *)row + i);
}

static inline float elem_f32(int type, const void *row, int64_t i) {
    if (type == STRATA_TYPE_F32) return ((const float *)row)[i];
    if (type == STRATA_TYPE_F16) return F16(((const uint16_t *)row)[i]);
    return bf16_to_f32(((const uint16_t *)row)[i]);
}

INLINE void tile_float(int type, const gemm_args *a, int64_t r, int64_t t, int NR, int NT) {
    const void *w[TR];
    const float *x[TT];
    avec acc[TR][TT];
    float tail[TR][TT];
    UNROLL for (int i = 0; i < NR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i));
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j);
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int j = 0; j < NT; j++) acc[i][j] = av_zero(), tail[i][j] = 0.0f;
    int64_t k = 0;
    for (; k + AV <= a->n; k += AV) {
        avec xv[TT];
        UNROLL for (int j = 0; j < NT; j++) {
            xv[j] = av_load(x[j] + k);
            // in a register: the compiler would rather fold the load into every FMA, one load per FMA
            __asm__("" : "+v"(xv[j]));
        }
        UNROLL for (int i = 0; i < NR; i++) {
            avec wv = load_w(type, w[i], k);
            __asm__("" : "+v"(wv));
            UNROLL for (int j = 0; j < NT; j++) acc[i][j] = av_fmadd(wv, xv[j], acc[i][j]);
        }
    }
    for (; k < a->n; k++)  // leftovers
        UNROLL for (int i = 0; i < NR; i++)
            UNROLL for (int j = 0; j < NT; j++) tail[i][j] += elem_f32(type, w[i], k) * x[j][k];
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int j = 0; j < NT; j++)
            a->y[(t + j) * a->ldy + TILE_ROW(a, r, i)] = av_sum(acc[i][j]) + tail[i][j];
}
#define TILE_F32(a, r, t, NR, NT) tile_float(STRATA_TYPE_F32, a, r, t, NR, NT)
#define TILE_F16(a, r, t, NR, NT) tile_float(STRATA_TYPE_F16, a, r, t, NR, NT)
#define TILE_BF16(a, r, t, NR, NT) tile_float(STRATA_TYPE_BF16, a, r, t, NR, NT)
#endif

#if defined(__AVX2__)
// Q8_0 x Q8_0. The product instruction wants one unsigned operand. With VNNI (no 16-bit saturation) that is
// w + 128, and -128 * sum(x) seeds the accumulator; otherwise |w|, with sign(x, w) moving w's sign onto x.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_OFFSET 1
#else
#define Q8_OFFSET 0
#endif
// Decode reads each weight row once, in TR streams: a prefetch this many bytes ahead in each stream has the
// memory busy before the hardware prefetchers have learnt a stream (an expert's rows are a few hundred KB; decode
// of the small MoE model went from 3.6 to 3.2 ms a token, with 1024 bytes it did not move).
#define Q8_PREFETCH 2048

#if !defined(VNNI512)  // VNNI512 takes the bands' f32 steps (tile_q8_0_exact, gemm_q8_0_banded)
INLINE void tile_q8_0(const gemm_args *a, int64_t r, int64_t t, int NR, int NT) {
    const block_q8_0 *w[TR], *x[TT];
    __m256 acc[TR][TT];
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    UNROLL for (int i = 0; i < NR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i));
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j);
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->n / QK; b++) {
        __m256i xq[TT], seed[TT];
        __m256 dx[TT];
        UNROLL for (int j = 0; j < NT; j++) {
            xq[j] = _mm256_loadu_si256((const __m256i *)x[j][b].qs);
            __m256i zero = _mm256_setzero_si256();
            seed[j] = Q8_OFFSET ? _mm256_sub_epi32(zero, dot_u8s8(zero, bias, xq[j])) : zero;
            dx[j] = f16_bcast(&x[j][b].d);
        }
        UNROLL for (int i = 0; i < NR; i++) {
            if (NT == 1) _mm_prefetch((const char *)&w[i][b] + Q8_PREFETCH, _MM_HINT_T0);
            __m256i wq = _mm256_loadu_si256((const __m256i *)w[i][b].qs);
            __m256i wu = Q8_OFFSET ? _mm256_xor_si256(wq, bias) : _mm256_abs_epi8(wq);
            __m256 dw = f16_bcast(&w[i][b].d);
            UNROLL for (int j = 0; j < NT; j++) {
                __m256i s = dot_u8s8(seed[j], wu, Q8_OFFSET ? xq[j] : _mm256_sign_epi8(xq[j], wq));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx[j]), acc[i][j]);
            }
        }
    }
    store_tile(a, r, t, NR, NT, acc);
}
#endif

// Q4_0 x Q8_0. The nibbles are the unsigned operand; their offset of 8 becomes -8 * sum(x), which seeds each
// token's integer accumulator.
#if defined(VNNI512)
// Four blocks at a time: one register holds the low nibbles (elements 0-15) of the four, in 128-bit lanes,
// another the high ones, and the activations are loaded in the same order; lane l sums block b + l.
INLINE void tile_q4_0(const gemm_args *a, int64_t r, int64_t t, int NR, int NT) {
    const block_q4_0 *w[TR];
    const block_q8_0 *x[TT];
    __m512 acc[TR][TT];
    const __m512i low4 = _mm512_set1_epi8(0xf), eight = _mm512_set1_epi8(8);
    UNROLL for (int i = 0; i < NR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i));
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j);
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t nb = a->n / QK;
    for (int64_t b = 0; b < nb; b += 4) {
        int64_t bk[4];  // past the last block, repeat it with its activation scale zeroed
        for (int k = 0; k < 4; k++) bk[k] = b + k < nb ? b + k : nb - 1;
        __m512i xlo[TT], xhi[TT], seed[TT];
        __m512 dx[TT];
        UNROLL for (int j = 0; j < NT; j++) {
            const block_q8_0 *X0 = &x[j][bk[0]], *X1 = &x[j][bk[1]], *X2 = &x[j][bk[2]], *X3 = &x[j][bk[3]];
            xlo[j] = load_4x128(X0->qs, X1->qs, X2->qs, X3->qs);
            xhi[j] = load_4x128(X0->qs + 16, X1->qs + 16, X2->qs + 16, X3->qs + 16);
            __m512i zero = _mm512_setzero_si512();
            __m512i sum8 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, eight, xlo[j]), eight, xhi[j]);
            seed[j] = _mm512_sub_epi32(zero, sum8);
            dx[j] = f16_quad(&X0->d, b + 1 < nb ? &X1->d : &ZERO_F16, b + 2 < nb ? &X2->d : &ZERO_F16,
                             b + 3 < nb ? &X3->d : &ZERO_F16);
        }
        UNROLL for (int i = 0; i < NR; i++) {
            const block_q4_0 *W0 = &w[i][bk[0]], *W1 = &w[i][bk[1]], *W2 = &w[i][bk[2]], *W3 = &w[i][bk[3]];
            __m512i raw = load_4x128(W0->qs, W1->qs, W2->qs, W3->qs);
            __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            __m512 dw = f16_quad(&W0->d, &W1->d, &W2->d, &W3->d);
            UNROLL for (int j = 0; j < NT; j++) {
                __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(seed[j], lo, xlo[j]), hi, xhi[j]);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx[j]), acc[i][j]);
            }
        }
    }
    store_tile512(a, r, t, NR, NT, acc);
}
#else
// Scales a and b, 4 lanes each.
static inline __m256 f16_pair(const uint16_t *a, const uint16_t *b) {
    return _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm_set1_epi16((short)*a), _mm_set1_epi16((short)*b)));
}

// Two blocks A, B at a time: one register holds the low nibbles of A and B (elements 0-15 of each), another
// the high ones, and the activations are loaded in the same order; 32-bit lanes 0-3 sum A's products, 4-7 B's.
INLINE void tile_q4_0(const gemm_args *a, int64_t r, int64_t t, int NR, int NT) {
    const block_q4_0 *w[TR];
    const block_q8_0 *x[TT];
    __m256 acc[TR][TT];
    const __m256i low4 = _mm256_set1_epi8(0xf), eight = _mm256_set1_epi8(8);
    UNROLL for (int i = 0; i < NR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i));
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j);
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t nb = a->n / QK;
    for (int64_t b = 0; b < nb; b += 2) {
        int64_t b1 = b + 1 < nb ? b + 1 : b;  // an odd last block pairs with itself, the twin's scale zeroed
        __m256i xlo[TT], xhi[TT], seed[TT];
        __m256 dx[TT];
        UNROLL for (int j = 0; j < NT; j++) {
            const block_q8_0 *A = &x[j][b], *B = &x[j][b1];
            xlo[j] = _mm256_loadu2_m128i((const __m128i *)B->qs, (const __m128i *)A->qs);
            xhi[j] = _mm256_loadu2_m128i((const __m128i *)(B->qs + 16), (const __m128i *)(A->qs + 16));
            __m256i sum8 = dot_u8s8(dot_u8s8(_mm256_setzero_si256(), eight, xlo[j]), eight, xhi[j]);
            seed[j] = _mm256_sub_epi32(_mm256_setzero_si256(), sum8);
            dx[j] = f16_pair(&A->d, b1 > b ? &B->d : &ZERO_F16);
        }
        UNROLL for (int i = 0; i < NR; i++) {
            const block_q4_0 *A = &w[i][b], *B = &w[i][b1];
            __m256i raw = _mm256_loadu2_m128i((const __m128i *)B->qs, (const __m128i *)A->qs);
            __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            __m256 dw = f16_pair(&A->d, &B->d);
            UNROLL for (int j = 0; j < NT; j++) {
                __m256i s = dot_u8s8(dot_u8s8(seed[j], lo, xlo[j]), hi, xhi[j]);
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx[j]), acc[i][j]);
            }
        }
    }
    store_tile(a, r, t, NR, NT, acc);
}
#endif

// q4k_scale_min on 32-bit words: the 8 scales and the 8 mins, a byte each.
static inline void q4k_scale_min_u64(const uint8_t s[12], uint64_t *sc, uint64_t *m) {
    uint32_t w[3];
    memcpy(w, s, 12);
    *sc = (w[0] & 0x3f3f3f3f) | (uint64_t)((w[2] & 0x0f0f0f0f) | ((w[0] >> 2) & 0x30303030)) << 32;
    *m = (w[1] & 0x3f3f3f3f) | (uint64_t)(((w[2] >> 4) & 0x0f0f0f0f) | ((w[1] >> 2) & 0x30303030)) << 32;
}

// The 8 values of 8 bytes as 16-bit integers.
static inline __m128i u8x8_to_16(uint64_t v) {
    return _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)v));
}

// Q4_K x Q8_K: sum_s sc_s * (q . x)_s scaled by d, minus sum_s m_s * bsum_s scaled by dmin.
#if defined(VNNI512)
// A 512-bit integer sum as 8 lanes.
static inline __m256i fold512(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// Each of the 8 mins once per group of 16 (one per bsum).
static inline __m256i q4k_mins16(uint64_t m8) {
    __m128i m = u8x8_to_16(m8);
    return _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
}

// 512-bit: a 32-byte chunk of qs unpacks to sub-block 2c (low nibbles) then 2c + 1 (high), the order of x. Each
// block ends in the integers and f32 steps of the bands (kb_part, kb_steps), 4 rows in the lanes.
INLINE void tile_q4_K(const gemm_args *a, int64_t r, int64_t t, int NR, int NT) {
    const block_q4_K *w[TR];
    const block_q8_K *x[TT];
    __m128 acc[TT];
    const __m512i low4 = _mm512_set1_epi8(0xf);
    UNROLL for (int i = 0; i < NR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i));
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j), acc[j] = _mm_setzero_ps();
    for (int64_t b = 0; b < a->n / QKK; b++) {
        __m128i part[TR][TT] = {0};
        float d[TR] = {0}, dmin[TR] = {0};
        UNROLL for (int i = 0; i < NR; i++) {
            const block_q4_K *B = &w[i][b];
            uint64_t sc8, m8;
            q4k_scale_min_u64(B->scales, &sc8, &m8);
            __m512i sc16 = _mm512_castsi128_si512(u8x8_to_16(sc8));
            __m256i m16 = q4k_mins16(m8);
            d[i] = F16(B->d), dmin[i] = F16(B->dmin);
            __m512i isum[2][TT];
            UNROLL for (int j = 0; j < NT; j++) isum[0][j] = isum[1][j] = _mm512_setzero_si512();
            UNROLL for (int c = 0; c < 4; c++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(B->qs + 32 * c));
                __m512i q2 = _mm512_and_si512(
                    _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1), low4);
                __m512i pick = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)),
                                                  _mm256_set1_epi16((short)(2 * c + 1)), 1);
                __m512i s = _mm512_permutexvar_epi16(pick, sc16);
                UNROLL for (int j = 0; j < NT; j++) {
                    __m512i xv = _mm512_loadu_si512(x[j][b].qs + 64 * c);
                    isum[c % 2][j] = _mm512_dpwssd_epi32(isum[c % 2][j], _mm512_maddubs_epi16(q2, xv), s);
                }
            }
            UNROLL for (int j = 0; j < NT; j++) {
                __m256i bs = _mm256_loadu_si256((const __m256i *)x[j][b].bsums);
                part[i][j] = kb_part(fold512(_mm512_add_epi32(isum[0][j], isum[1][j])), _mm256_madd_epi16(m16, bs));
            }
        }
        __m128 d4 = _mm_setr_ps(d[0], d[1], d[2], d[3]), dmin4 = _mm_setr_ps(dmin[0], dmin[1], dmin[2], dmin[3]);
        UNROLL for (int j = 0; j < NT; j++)
            acc[j] = kb_steps(1, acc[j], part[0][j], part[1][j], part[2][j], part[3][j], d4, dmin4, x[j][b].d);
    }
    store_rows4(a, r, t, NR, NT, acc);
}
#else
INLINE void tile_q4_K(const gemm_args *a, int64_t r, int64_t t, int NR, int NT) {
    const block_q4_K *w[TR];
    const block_q8_K *x[TT];
    __m256 acc[TR][TT];
    const __m256i low4 = _mm256_set1_epi8(0xf);
    UNROLL for (int i = 0; i < NR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i));
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j);
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->n / QKK; b++) {
        UNROLL for (int i = 0; i < NR; i++) {
            const block_q4_K *B = &w[i][b];
            uint64_t sc8, m8;
            q4k_scale_min_u64(B->scales, &sc8, &m8);
            __m256i sc16 = _mm256_broadcastsi128_si256(u8x8_to_16(sc8));  // for shuffles within each lane
            __m128i m = u8x8_to_16(m8);
            __m256i m16 = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));  // one per bsum
            __m256i isum[TT];
            UNROLL for (int j = 0; j < NT; j++) isum[j] = _mm256_setzero_si256();
            UNROLL for (int c = 0; c < 4; c++) {  // 64 elements: sub-blocks 2c (low nibbles) and 2c + 1 (high)
                __m256i q = _mm256_loadu_si256((const __m256i *)(B->qs + 32 * c));
                __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
                __m256i s0 = _mm256_shuffle_epi8(sc16, _mm256_broadcastsi128_si256(pick16(2 * c)));
                __m256i s1 = _mm256_shuffle_epi8(sc16, _mm256_broadcastsi128_si256(pick16(2 * c + 1)));
                UNROLL for (int j = 0; j < NT; j++) {
                    const int8_t *xs = x[j][b].qs + 64 * c;
                    __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xs));
                    __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xs + 32)));
                    isum[j] = dot_s16(dot_s16(isum[j], p0, s0), p1, s1);
                }
            }
            float d = F16(B->d), dmin = F16(B->dmin);
            UNROLL for (int j = 0; j < NT; j++) {
                __m256i bs = _mm256_loadu_si256((const __m256i *)x[j][b].bsums);
                __m256 mins = _mm256_cvtepi32_ps(_mm256_madd_epi16(m16, bs));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_set1_ps(d * x[j][b].d), acc[i][j]);
                acc[i][j] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(dmin * x[j][b].d), acc[i][j]);
            }
        }
    }
    store_tile(a, r, t, NR, NT, acc);
}
#endif

// The 32 unsigned 6-bit values of chunk k (0..3) of a Q6_K half: the nibble from ql0 / ql1, 2 bits from qh.
static inline __m256i q6k_chunk(__m256i ql0, __m256i ql1, __m256i qh, int k) {
    const __m256i low4 = _mm256_set1_epi8(0xf), bits45 = _mm256_set1_epi8(0x30);
    __m256i ql = k & 1 ? ql1 : ql0;
    __m256i lo = _mm256_and_si256(k & 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
    __m256i hi = k == 0 ? _mm256_slli_epi16(qh, 4) : k == 1 ? _mm256_slli_epi16(qh, 2)
               : k == 2 ? qh : _mm256_srli_epi16(qh, 2);  // bits 2k, 2k + 1 moved to bits 4, 5
    return _mm256_or_si256(lo, _mm256_and_si256(hi, bits45));
}

// Q6_K x Q8_K with q unsigned (0..63): the offset of 32 becomes -32 * sum_g sc_g * bsum_g, the seed.
#if defined(VNNI512)
// Indices base + l in the 16-bit elements of 128-bit lane l: a per-lane pick for _mm512_permutexvar_epi16.
static inline __m512i lane_index(int base) {
    const long long one = 0x0001000100010001LL;
    return _mm512_add_epi16(_mm512_set1_epi16((short)base), _mm512_set_epi64(3 * one, 3 * one, 2 * one, 2 * one,
                                                                             one, one, 0, 0));
}

// 512-bit: 64 values at a time, chunks 0-1 and 2-3 of a half (the order of x), a group of 16 per 128-bit lane.
// Each block ends as tile_q4_K's.
INLINE void tile_q6_K(const gemm_args *a, int64_t r, int64_t t, int NR, int NT) {
    const block_q6_K *w[TR];
    const block_q8_K *x[TT];
    __m128 acc[TT];
    const __m512i low4 = _mm512_set1_epi8(0xf), bits45 = _mm512_set1_epi8(0x30);
    UNROLL for (int i = 0; i < NR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i));
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j), acc[j] = _mm_setzero_ps();
    for (int64_t b = 0; b < a->n / QKK; b++) {
        __m128i part[TR][TT] = {0};
        float d[TR] = {0};
        UNROLL for (int i = 0; i < NR; i++) {
            const block_q6_K *B = &w[i][b];
            __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)B->scales));
            __m512i isum[2][TT];
            UNROLL for (int j = 0; j < NT; j++) isum[0][j] = isum[1][j] = _mm512_setzero_si512();
            UNROLL for (int h = 0; h < 2; h++) {
                __m512i ql = _mm512_loadu_si512(B->ql + 64 * h);  // chunk 0 | chunk 1 low nibbles
                __m256i qh = _mm256_loadu_si256((const __m256i *)(B->qh + 32 * h));
                __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
                __m512i q01 = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                              _mm512_and_si512(_mm512_slli_epi16(qh2, 4), bits45));
                __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                              _mm512_and_si512(qh2, bits45));
                // 128-bit lane l of q01 is group 8h + l, of q23 group 8h + 4 + l
                __m512i s01 = _mm512_permutexvar_epi16(lane_index(8 * h), _mm512_castsi256_si512(sc16));
                __m512i s23 = _mm512_permutexvar_epi16(lane_index(8 * h + 4), _mm512_castsi256_si512(sc16));
                UNROLL for (int j = 0; j < NT; j++) {
                    const int8_t *xs = x[j][b].qs + 128 * h;
                    __m512i p01 = _mm512_maddubs_epi16(q01, _mm512_loadu_si512(xs));
                    __m512i p23 = _mm512_maddubs_epi16(q23, _mm512_loadu_si512(xs + 64));
                    isum[0][j] = _mm512_dpwssd_epi32(isum[0][j], p01, s01);
                    isum[1][j] = _mm512_dpwssd_epi32(isum[1][j], p23, s23);
                }
            }
            d[i] = F16(B->d);
            UNROLL for (int j = 0; j < NT; j++) {  // the values are q + 32
                __m256i bs = _mm256_loadu_si256((const __m256i *)x[j][b].bsums);
                __m256i sum = _mm256_sub_epi32(fold512(_mm512_add_epi32(isum[0][j], isum[1][j])),
                                               _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
                part[i][j] = kb_part(sum, _mm256_setzero_si256());
            }
        }
        __m128 d4 = _mm_setr_ps(d[0], d[1], d[2], d[3]);
        UNROLL for (int j = 0; j < NT; j++)
            acc[j] = kb_steps(0, acc[j], part[0][j], part[1][j], part[2][j], part[3][j], d4, d4, x[j][b].d);
    }
    store_rows4(a, r, t, NR, NT, acc);
}
#else
INLINE void tile_q6_K(const gemm_args *a, int64_t r, int64_t t, int NR, int NT) {
    const block_q6_K *w[TR];
    const block_q8_K *x[TT];
    __m256 acc[TR][TT];
    UNROLL for (int i = 0; i < NR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i));
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j);
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->n / QKK; b++) {
        UNROLL for (int i = 0; i < NR; i++) {
            const block_q6_K *B = &w[i][b];
            __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)B->scales));
            __m256i isum[TT];
            UNROLL for (int j = 0; j < NT; j++) {
                __m256i bs = _mm256_loadu_si256((const __m256i *)x[j][b].bsums);
                isum[j] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
            }
            UNROLL for (int h = 0; h < 2; h++) {
                __m256i sc_h = _mm256_permute2x128_si256(sc16, sc16, h ? 0x11 : 0x00);  // scales 8h..8h+7, twice
                __m256i ql0 = _mm256_loadu_si256((const __m256i *)(B->ql + 64 * h));
                __m256i ql1 = _mm256_loadu_si256((const __m256i *)(B->ql + 64 * h + 32));
                __m256i qh = _mm256_loadu_si256((const __m256i *)(B->qh + 32 * h));
                UNROLL for (int k = 0; k < 4; k++) {
                    __m256i q = q6k_chunk(ql0, ql1, qh, k);
                    // scale of group 8h + 2k in bytes 0-15, of group 8h + 2k + 1 in bytes 16-31
                    __m256i s = _mm256_shuffle_epi8(sc_h, _mm256_set_m128i(pick16(2 * k + 1), pick16(2 * k)));
                    UNROLL for (int j = 0; j < NT; j++) {
                        __m256i xv = _mm256_loadu_si256((const __m256i *)(x[j][b].qs + 128 * h + 32 * k));
                        isum[j] = dot_s16(isum[j], _mm256_maddubs_epi16(q, xv), s);
                    }
                }
            }
            float d = F16(B->d);
            UNROLL for (int j = 0; j < NT; j++)
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_set1_ps(d * x[j][b].d), acc[i][j]);
        }
    }
    store_tile(a, r, t, NR, NT, acc);
}
#endif
#endif

// Q8_0 weights in bands of rows, laid out once at load (AVX-512 VNNI), for the engine's output weight. With a few
// tokens a tile of rows as they lie is bound by arithmetic: per 64 products of a row and a token it spends a
// vpdpbusd, then a conversion, a multiply and an FMA on the lanes' sums, or a horizontal sum (tile_q8_0_exact,
// below). A band holds QB_ROWS consecutive rows, one per 32-bit lane:
// for each block, step e holds values 4e .. 4e + 3 of every row, + 128 as unsigned bytes, so one vpdpbusd against
// a token's 4 activations broadcast sums 4 values of 16 rows (seeded with -128 * the activations' sum), and each
// block ends in one conversion, multiply and FMA for 16 rows. A row and token take the same steps whatever the
// other tokens are, and no horizontal sums, so 1 token gives the same bits as a batch. A band is its pairs of
// blocks (QB_PAIR), each the scales of both in f16 and then their values: one stream of whole cache lines.
#if defined(VNNI512)
#define QB_ROWS STRATA_BAND_ROWS
#define QB_TOKENS 8     // tokens per tile: 8 integer and 8 f32 accumulators
#define QB_SEEDS 4096   // -128 * sum(x) per token and block, on the stack: up to this many (wider rows: no bands)

#define QB_STREAMS 8  // bands per tile at most: bands x tokens <= 8 (integer and f32 accumulators)

// A pair of blocks: the scales of both (2 x 32 bytes), then their values (2 x 512), 17 cache lines. Scales first,
// so that a band is read in address order: after the values they made 1 token 3.1-3.2 ms against 2.6-2.7.
#define QB_PAIR 1088
static size_t qb_band_bytes(int64_t nb) {
    return (size_t)(nb + 1) / 2 * QB_PAIR;
}

// Ask for the lines of a band's block QB_PREFETCH bytes ahead (a block and its scales are QB_PAIR / 2 bytes; the
// next band follows in memory). Without it a few streams of bands leave the memory idle between loads: on a Xeon
// with AMX, at 2 threads in the engine, the output product went from 1.67 to 1.40 ms for 1 token and from 2.66 to
// ~2.0 for 4 (the tile unit), and 151,936 x 512 from memory (bench/kernels.py) from 2.93 to 2.45 ms for 4 tokens.
// Always inlined: gcc takes a function of prefetches alone for one without effects, and drops its calls.
#define QB_PREFETCH 4096
INLINE void qb_prefetch(const uint8_t *band, int64_t b) {
    const char *at = (const char *)band + b * (QB_PAIR / 2) + QB_PREFETCH;
    for (int line = 0; line < (QB_PAIR / 2 + 63) / 64; line++) _mm_prefetch(at + 64 * line, _MM_HINT_T0);
}

// Block b of a band: its values, its 16 scales.
static inline const uint8_t *qb_values(const uint8_t *band, int64_t b) {
    return band + b / 2 * QB_PAIR + 64 + b % 2 * 512;
}

static inline const uint16_t *qb_scales(const uint8_t *band, int64_t b) {
    return (const uint16_t *)(band + b / 2 * QB_PAIR + b % 2 * 32);
}

size_t strata_bands_size(int type, int64_t n_rows, int64_t n) {
    if (type != STRATA_TYPE_Q8_0 || n_rows <= 0 || n <= 0 || n % QK || n / QK > QB_SEEDS) return 0;
    return (size_t)((n_rows + QB_ROWS - 1) / QB_ROWS) * qb_band_bytes(n / QK);
}

// Each block of a band gathers its 16 rows' scales, then their values 4 bytes at a time: load lays every Q8_0
// layer matrix out this way (151,936 x 512: 13 ms, 6.3 GB/s; a row at a time 23 ms). Rows past the end read
// nothing: w = 0, scale 0.
void strata_bands_fill(int type, const void *w, int64_t n_rows, int64_t n, void *bands) {
    (void)type;
    const int64_t nb = n / QK, n_bands = (n_rows + QB_ROWS - 1) / QB_ROWS;
    const int64_t row_bytes = nb * (int64_t)sizeof(block_q8_0);
    const size_t band_bytes = qb_band_bytes(nb);
    const __m512i row_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)row_bytes));
    const __m512i flip = _mm512_set1_epi32((int)0x80808080u);  // values + 128
    for (int64_t k = 0; k < n_bands; k++) {
        uint8_t *band = (uint8_t *)bands + k * band_bytes;
        const char *first = (const char *)w + k * QB_ROWS * row_bytes;
        const int64_t left = n_rows - k * QB_ROWS;
        const __mmask16 rows = left >= QB_ROWS ? 0xffff : (__mmask16)((1u << left) - 1);
        if (nb % 2) {  // an odd count: the last pair's second block is zeros, scale 0
            memset(band + nb / 2 * QB_PAIR + 32, 0, 32);
            memset(band + nb / 2 * QB_PAIR + 64 + 512, 0x80, 512);
        }
        for (int64_t b = 0; b < nb; b++) {
            const char *block = first + b * (int64_t)sizeof(block_q8_0);  // row 0's; a block's scale comes first
            const __m512i d = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, row_at, block, 1);
            _mm256_storeu_si256((__m256i *)(uintptr_t)qb_scales(band, b), _mm512_cvtepi32_epi16(d));
            for (int e = 0; e < 8; e++) {
                const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, row_at, block + 2 + 4 * e,
                                                              1);
                _mm512_storeu_si512((uint8_t *)(uintptr_t)qb_values(band, b) + 64 * e, _mm512_xor_si512(v, flip));
            }
        }
    }
}

// -128 * the sum of a token's values of a block: what the bands' values + 128 add to its products.
static inline int32_t q8_band_seed(const block_q8_0 *block) {
    int32_t sum = 0;
    for (int v = 0; v < QK; v++) sum += block->qs[v];
    return -128 * sum;
}

// NB bands (rows of band i: its bits of rows[i]) against NT tokens: seed[j * nb + b] = -128 * sum of token j's
// block b; y[i] is band i's first row of the first token.
INLINE void tile_q8_bands(const uint8_t *const *band, const __mmask16 *rows, int64_t nb, const block_q8_0 *x0,
                          int64_t xb, const int32_t *seed, float *const *y, int64_t ldy, int NB, int NT) {
    const block_q8_0 *x[QB_TOKENS];
    __m512 acc[QB_STREAMS][QB_TOKENS];
    _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) {
        x[j] = (const block_q8_0 *)((const char *)x0 + j * xb);
        _Pragma("GCC unroll 8") for (int i = 0; i < NB; i++) acc[i][j] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        __m512i s[QB_STREAMS][QB_TOKENS];
        _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) {
            __m512i sj = _mm512_set1_epi32(seed[j * nb + b]);
            _Pragma("GCC unroll 8") for (int i = 0; i < NB; i++) s[i][j] = sj;
        }
        _Pragma("GCC unroll 8") for (int i = 0; i < NB; i++) qb_prefetch(band[i], b);
        _Pragma("GCC unroll 8") for (int e = 0; e < 8; e++)
            _Pragma("GCC unroll 8") for (int i = 0; i < NB; i++) {
                __m512i w = _mm512_loadu_si512(qb_values(band[i], b) + 64 * e);
                _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) {
                    int32_t x4;
                    memcpy(&x4, x[j][b].qs + 4 * e, 4);
                    s[i][j] = _mm512_dpbusd_epi32(s[i][j], w, _mm512_set1_epi32(x4));
                }
            }
        _Pragma("GCC unroll 8") for (int i = 0; i < NB; i++) {
            __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)qb_scales(band[i], b)));
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][j]),
                                            _mm512_mul_ps(dw, _mm512_set1_ps(F16(x[j][b].d))), acc[i][j]);
        }
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++)
        _Pragma("GCC unroll 8") for (int i = 0; i < NB; i++) _mm512_mask_storeu_ps(y[i] + j * ldy, rows[i], acc[i][j]);
}

// NT tokens against NB bands, QB_STREAMS / NT bands per tile.
INLINE void q8_bands_tile(const uint8_t *const *band, const __mmask16 *rows, int64_t nb, const char *x, int64_t xb,
                          const int32_t *seed, float *const *y, int64_t ldy, int NB, int NT) {
    float *yj[QB_STREAMS];
    for (int i = 0; i < NB; i++) yj[i] = y[i];
    const int per = QB_STREAMS / NT < NB ? QB_STREAMS / NT : NB;
    for (int i = 0; i < NB; i += per)
        tile_q8_bands(band + i, rows + i, nb, (const block_q8_0 *)x, xb, seed, yj + i, ldy, per, NT);
}

// Bands k + i * step (i < NB) against the g tokens at x (seeds as tile_q8_bands's), rows below r1.
INLINE void q8_bands_tokens(const uint8_t *bands, size_t band_bytes, int64_t nb, int64_t k, int64_t step, int NB,
                            int64_t r1, const char *x, int64_t xb, int64_t g, const int32_t *seed, float *y,
                            int64_t ldy) {
    const uint8_t *band[QB_STREAMS];
    __mmask16 rows[QB_STREAMS];
    float *yb[QB_STREAMS];
    for (int i = 0; i < NB; i++) {
        int64_t r = (k + i * step) * QB_ROWS;
        band[i] = bands + (k + i * step) * band_bytes;
        rows[i] = r1 - r >= QB_ROWS ? 0xffff : (__mmask16)((1u << (r1 - r)) - 1);
        yb[i] = y + r;
    }
    int64_t j = 0;
    for (; j + QB_TOKENS <= g; j += QB_TOKENS) {
        for (int i = 0; i < NB; i++) yb[i] += j ? QB_TOKENS * ldy : 0;
        q8_bands_tile(band, rows, nb, x + j * xb, xb, seed + j * nb, yb, ldy, NB, QB_TOKENS);
    }
    for (int i = 0; i < NB; i++) yb[i] = y + (k + i * step) * QB_ROWS + j * ldy;
    if (j + 4 <= g) {
        q8_bands_tile(band, rows, nb, x + j * xb, xb, seed + j * nb, yb, ldy, NB, 4);
        for (int i = 0; i < NB; i++) yb[i] += 4 * ldy;
        j += 4;
    }
    if (j + 2 <= g) {
        q8_bands_tile(band, rows, nb, x + j * xb, xb, seed + j * nb, yb, ldy, NB, 2);
        for (int i = 0; i < NB; i++) yb[i] += 2 * ldy;
        j += 2;
    }
    if (j < g) q8_bands_tile(band, rows, nb, x + j * xb, xb, seed + j * nb, yb, ldy, NB, 1);
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
// The tile unit (AMX): one TDPBSUD multiplies up to 16 tokens' values of a block (a tile of 16 rows of 32 signed
// bytes) by a band's block (8 rows of 64 unsigned bytes: the band layout is the tile layout), giving the exact
// integer sums of 16 rows x 16 tokens that 8 vpdpbusd per token give. The f32 steps after it are tile_q8_bands's,
// in its order, so a token gets the same bits either way. Where the VNNI tile spends 8 vpdpbusd per token and
// block, the tile unit spends one instruction for all of them; the sums go through memory (a tile store, then
// one load per token) to the f32 steps.
#define QB_AMX 1
#define QB_AMX_TOKENS 16
#define QB_AMX_MAX_BLOCKS 256  // the tokens' values, packed as tiles, on the stack: 160 KiB at most
// The least tokens a product gives the tile unit (strata_bands_amx). 151,936 x 512 at 2 threads, ms, VNNI / tile
// unit: 2 tokens 2.77 / 2.89, 3: 2.89 / 2.88, 4: 3.34 / 2.96, 5: 3.52 / 3.21, 8: 5.46 / 3.39, 16: 7.17 / 6.06.
static int bands_amx_tokens = 4;

static int amx_permitted;
static void amx_ask(void) {
    // Linux hands the tile registers' state to a process that asks for it (ARCH_REQ_XCOMP_PERM, XTILEDATA).
    amx_permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

static int amx_ready(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, amx_ask);
    return amx_permitted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

// Band k of each of NS streams (band[i] its bytes, rows[i] its rows below r1, y[i] its rows' place in y) against
// G tokens: a holds block b's values of the tokens at a + 512 b, dx[16 b + j] token j's scale of block b,
// seed[j * nb + b] as tile_q8_bands's. Tiles: 0 the tokens, 1 and 2 the streams' blocks in turn, 3 + i stream
// i's sums (8 tiles in all: 4 streams share 2 block tiles). A block's sums are stored while the f32 steps of the
// block before run (8 tokens 3.39 -> 3.32 ms for 151,936 x 512 at 2 threads), so that their loads find them landed.
#define QB_AMX_BLOCK(i, B, C)                          \
    if (i < NS) {                                      \
        qb_prefetch(band[i], b);                       \
        _tile_zero(C);                                 \
        _tile_loadd(B, qb_values(band[i], b), 64);     \
        _tile_dpbsud(C, 0, B);                         \
        _tile_stored(C, sums[b % 2][i], 64);           \
    }
// The f32 steps of block b's sums (stored by the tile unit one block before: its stores have landed by then).
INLINE void q8_bands_amx_finish(const uint8_t *const *band, int64_t b, int64_t nb, const float *dx,
                                const int32_t *seed, int32_t sums[][QB_AMX_TOKENS][16], __m512 acc[][QB_AMX_TOKENS],
                                int NS, int G) {
    _Pragma("GCC unroll 4") for (int i = 0; i < NS; i++) {
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)qb_scales(band[i], b)));
        _Pragma("GCC unroll 16") for (int j = 0; j < G; j++) {
            __m512i s = _mm512_add_epi32(_mm512_set1_epi32(seed[j * nb + b]), _mm512_load_si512(sums[i][j]));
            acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(dx[16 * b + j])),
                                        acc[i][j]);
        }
    }
}

INLINE void q8_bands_amx_tile(const uint8_t *const *band, const __mmask16 *rows, float *const *y, int64_t nb,
                              const int8_t *a, const float *dx, const int32_t *seed, int64_t ldy, int NS, int G) {
    int32_t sums[2][4][QB_AMX_TOKENS][16] __attribute__((aligned(64)));  // blocks b and b - 1
    __m512 acc[4][QB_AMX_TOKENS];
    _Pragma("GCC unroll 4") for (int i = 0; i < NS; i++)
        _Pragma("GCC unroll 16") for (int j = 0; j < G; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        _tile_loadd(0, a + 512 * b, 32);
        QB_AMX_BLOCK(0, 1, 3) QB_AMX_BLOCK(1, 2, 4) QB_AMX_BLOCK(2, 1, 5) QB_AMX_BLOCK(3, 2, 6)  // literal tiles
        if (b > 0) q8_bands_amx_finish(band, b - 1, nb, dx, seed, sums[(b - 1) % 2], acc, NS, G);
    }
    q8_bands_amx_finish(band, nb - 1, nb, dx, seed, sums[(nb - 1) % 2], acc, NS, G);
    _Pragma("GCC unroll 4") for (int i = 0; i < NS; i++)
        _Pragma("GCC unroll 16") for (int j = 0; j < G; j++) _mm512_mask_storeu_ps(y[i] + j * ldy, rows[i], acc[i][j]);
}
#undef QB_AMX_BLOCK

// Bands [k0, k1) against G tokens (a, dx, seed as q8_bands_amx_tile's), rows below r1: up to 8 tokens are bound by
// memory and read S streams of bands a 1 / S of the range apart at once, then the rest one band at a time
// (151,936 x 512 at 2 threads: 4 tokens 4.25 ms with one stream, 3.28 with 3, 2.96 with 4; 8 tokens 4.79 with
// one, 3.39 with 3, whose 24 accumulators leave registers to spare where 4 streams' 32 would not).
INLINE void q8_bands_amx_at(const uint8_t *bands, size_t band_bytes, int64_t nb, int64_t k, int64_t step,
                             int64_t r1, const int8_t *a, const float *dx, const int32_t *seed, float *y, int64_t ldy,
                             int NS, int G) {
    const uint8_t *band[4];
    __mmask16 rows[4];
    float *yb[4];
    for (int i = 0; i < NS; i++) {  // bands k + i * step
        int64_t r = (k + i * step) * QB_ROWS;
        band[i] = bands + (k + i * step) * band_bytes;
        rows[i] = r1 - r >= QB_ROWS ? 0xffff : (__mmask16)((1u << (r1 - r)) - 1);
        yb[i] = y + r;
    }
    q8_bands_amx_tile(band, rows, yb, nb, a, dx, seed, ldy, NS, G);
}

INLINE void q8_bands_amx_tokens(const uint8_t *bands, size_t band_bytes, int64_t nb, int64_t k0, int64_t k1,
                                int64_t r1, const int8_t *a, const float *dx, const int32_t *seed, float *y,
                                int64_t ldy, int G) {
    const int S = G <= 4 ? 4 : G <= 8 ? 3 : 1;
    const int64_t rs = S > 1 ? (k1 - k0) / S : 0;
    for (int64_t k = k0; k < k0 + rs; k++) {  // S streams; a constant count, so that each tile is unrolled
        if (S == 4) q8_bands_amx_at(bands, band_bytes, nb, k, rs, r1, a, dx, seed, y, ldy, 4, G);
        else q8_bands_amx_at(bands, band_bytes, nb, k, rs, r1, a, dx, seed, y, ldy, 3, G);
    }
    for (int64_t k = k0 + S * rs; k < k1; k++)  // the rest, one band at a time
        q8_bands_amx_at(bands, band_bytes, nb, k, 0, r1, a, dx, seed, y, ldy, 1, G);
}

// strata_gemm_bands by the tile unit, 16 tokens at a time.
static void gemm_bands_amx(const void *bands, int64_t n, int64_t r0, int64_t r1, const void *x, int64_t n_tok,
                           float *y, int64_t ldy) {
    const int64_t nb = n / QK, xb = nb * (int64_t)sizeof(block_q8_0);
    const size_t band_bytes = qb_band_bytes(nb);
    const int64_t k0 = r0 / QB_ROWS, k1 = (r1 + QB_ROWS - 1) / QB_ROWS;
    int8_t a[nb * 512];  // block b's values of the tokens, a tile's rows 32 bytes apart
    float dx[nb * QB_AMX_TOKENS];
    int32_t seed[nb * QB_AMX_TOKENS];
    for (int64_t t0 = 0; t0 < n_tok; t0 += QB_AMX_TOKENS) {
        const int64_t g = n_tok - t0 < QB_AMX_TOKENS ? n_tok - t0 : QB_AMX_TOKENS;
        amx_config config = {.palette = 1};
        config.rows[0] = (uint8_t)g, config.colsb[0] = QK;  // the tokens' values of a block
        for (int i = 1; i <= 2; i++) config.rows[i] = QK / 4, config.colsb[i] = 64;
        for (int i = 3; i <= 6; i++) config.rows[i] = (uint8_t)g, config.colsb[i] = 64;
        _tile_loadconfig(&config);
        for (int64_t j = 0; j < g; j++) {
            const block_q8_0 *xj = (const block_q8_0 *)((const char *)x + (t0 + j) * xb);
            for (int64_t b = 0; b < nb; b++) {
                memcpy(a + 512 * b + QK * j, xj[b].qs, QK);
                dx[16 * b + j] = F16(xj[b].d);
                seed[j * nb + b] = q8_band_seed(&xj[b]);
            }
        }
        float *yt = y + t0 * ldy;
        switch (g) {
#define QB_AMX_CASE(G) \
    case G: q8_bands_amx_tokens((const uint8_t *)bands, band_bytes, nb, k0, k1, r1, a, dx, seed, yt, ldy, G); break;
            QB_AMX_CASE(1) QB_AMX_CASE(2) QB_AMX_CASE(3) QB_AMX_CASE(4) QB_AMX_CASE(5) QB_AMX_CASE(6)
            QB_AMX_CASE(7) QB_AMX_CASE(8) QB_AMX_CASE(9) QB_AMX_CASE(10) QB_AMX_CASE(11) QB_AMX_CASE(12)
            QB_AMX_CASE(13) QB_AMX_CASE(14) QB_AMX_CASE(15) QB_AMX_CASE(16)
#undef QB_AMX_CASE
        }
    }
    _tile_release();  // a thread whose tiles are released saves none of their state when it is switched out
}

// Q8_0 rows as they lie in the file, by the tile unit. A tile of 16 weight rows' block b (16 x 32 signed bytes,
// loaded straight from the rows, a row's bytes apart) times the tokens' block b (8 rows of 4 bytes per token,
// packed once per call) gives the exact integer sums of 16 rows x up to 16 tokens. The f32 steps then add
// sum * (dw * dx) to each row and token's accumulator (acc[row], a lane per token), block after block. A row and
// token take the same steps whatever the other rows and tokens are, as in tile_q8_0_exact (one or two tokens, and
// rows longer than QB_AMX_MAX_BLOCKS blocks) and the bands, so a token's result does not depend on its batch.
// Small qwen3moe Q8_0, 2 threads, against a VNNI tile that scaled parts of a block's sum: a 40-token prompt
// 14.6 -> 10.3 ms, 256 tokens 83.6 -> 71.7 ms; decode of 4 sequences ~2% slower (products of 3-4 tokens).

typedef struct {
    const uint8_t *w;   // the tile's first row
    int64_t wb;         // bytes per row
    const char *ahead;  // the bytes of the next tile, asked for a block's share at a time
    __m512i row_at;     // lane i: i * wb, for the rows' scales
    __mmask16 rows;     // the tile's rows (fewer than 16 in a range of fewer)
} q8_row_tile;

// The f32 steps of block b, whose sums S (row i's at S + 16 i, a token a lane) the tile unit stored.
INLINE void q8_rows_amx_finish(const q8_row_tile *rt, int64_t b, const float *dx, const int32_t *S, __m512 acc[16]) {
    const __m512i d = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rt->rows, rt->row_at,
                                                  rt->w + b * (int64_t)sizeof(block_q8_0), 1);
    float dw[16] __attribute__((aligned(64)));
    _mm512_store_ps(dw, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d)));  // a block's scale is its first 2 bytes
    const __m512 vdx = _mm512_load_ps(dx + 16 * b);
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++)
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(S + 16 * i)),
                                 _mm512_mul_ps(_mm512_set1_ps(dw[i]), vdx), acc[i]);
}

// Block b into tiles A (the rows) and C (their sums), stored to S; and a block's share of the next tile's bytes
// asked for (a tile's rows lie together: the tiles are one stream; to L2, as a far prefetch to L1 held the fill
// buffers: 1 token 0.17 -> 0.16 ms).
#define QR_AMX_BLOCK(b, A, C, S)                                                   \
    {                                                                              \
        const char *pf = rt->ahead + (b) * share;                                  \
        for (int64_t l = 0; l < share; l += 64) _mm_prefetch(pf + l, _MM_HINT_T1);  \
        _tile_loadd(0, bt + 512 * (b), 64);                                        \
        _tile_loadd(A, rt->w + (b) * (int64_t)sizeof(block_q8_0) + 2, rt->wb);     \
        _tile_zero(C);                                                             \
        _tile_dpbssd(C, A, 0);                                                     \
        _tile_stored(C, S, 64);                                                    \
    }

// One tile of rows against the packed tokens (bt: block b's at bt + 512 b; dx[16 b + j]: token j's scale of block
// b). Tiles 0 the tokens, 1 and 3 the rows' blocks, 2 and 4 their sums, in turn; a block's f32 steps run two
// blocks behind its tile store, so that its loads find the sums landed.
INLINE void q8_rows_amx_tile(const q8_row_tile *rt, int64_t nb, const int8_t *bt, const float *dx, __m512 acc[16]) {
    int32_t sums[3][16 * 16] __attribute__((aligned(64)));
    const int64_t share = (16 * rt->wb / nb + 63) / 64 * 64;
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        QR_AMX_BLOCK(b, 1, 2, sums[b % 3])
        if (b >= 2) q8_rows_amx_finish(rt, b - 2, dx, sums[(b - 2) % 3], acc);
        QR_AMX_BLOCK(b + 1, 3, 4, sums[(b + 1) % 3])
        if (b >= 1) q8_rows_amx_finish(rt, b - 1, dx, sums[(b - 1) % 3], acc);
    }
    if (b < nb) {  // an odd count: the last block
        QR_AMX_BLOCK(b, 1, 2, sums[b % 3])
        if (b >= 2) q8_rows_amx_finish(rt, b - 2, dx, sums[(b - 2) % 3], acc);
        b++;
    }
    for (int64_t f = b >= 2 ? b - 2 : 0; f < b; f++) q8_rows_amx_finish(rt, f, dx, sums[f % 3], acc);
}
#undef QR_AMX_BLOCK

// Tiles: 0 the tokens' block (8 rows of 4 bytes per token), 1 and 3 the rows' blocks (m rows of 32 bytes), 2 and 4
// their sums (m rows of 4 bytes per token).
static void q8_rows_amx_config(int m, int g) {
    amx_config config = {.palette = 1};
    config.rows[0] = QK / 4, config.colsb[0] = (uint16_t)(4 * g);
    for (int i = 1; i <= 3; i += 2) config.rows[i] = (uint8_t)m, config.colsb[i] = QK;
    for (int i = 2; i <= 4; i += 2) config.rows[i] = (uint8_t)m, config.colsb[i] = (uint16_t)(4 * g);
    _tile_loadconfig(&config);
}

// Tiles of m rows from r0 (16, or fewer in a smaller range), each against n_groups groups of g tokens (group k's
// packed values at bt + k * nb * 512, scales at dx + k * nb * 16, tokens from t0 + 16 k): a tile's rows stay in
// cache while the groups pass. A last tile that would pass r1 starts m rows before it instead and stores only its
// rows not yet stored (a row's sums are the same in any tile).
static void q8_rows_amx_tokens(const gemm_args *a, int64_t r0, int64_t r1, int64_t m, int64_t nb, const int8_t *bt,
                               const float *dx, int64_t t0, int n_groups, int g) {
    const __m512i row_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)a->wb));
    for (int64_t r = r0; r < r1; r += m) {
        const int64_t first = r + m <= r1 ? r : r1 - m;
        const int64_t next = first + 2 * m <= r1 ? first + m : first;  // no asking past the range
        q8_row_tile rt = {(const uint8_t *)W_ROW(a, first), a->wb, (const char *)W_ROW(a, next), row_at,
                          (__mmask16)((1u << m) - 1)};
        for (int k = 0; k < n_groups; k++) {
            __m512 acc[16];
            q8_rows_amx_tile(&rt, nb, bt + k * nb * 512, dx + k * nb * 16, acc);
            for (int64_t i = r - first; i < m; i++) {
                float yi[16] __attribute__((aligned(64)));
                _mm512_store_ps(yi, acc[i]);
                for (int j = 0; j < g; j++) a->y[(t0 + 16 * k + j) * a->ldy + first + i] = yi[j];
            }
        }
    }
}

// Token j's 4 values k4 of block b go to row k4 of the block's tile, at 4 j; its scale to dx[16 b + j].
static void q8_rows_amx_pack(const gemm_args *a, int64_t t0, int g, int64_t nb, int8_t *bt, float *dx) {
    memset(dx, 0, sizeof(float) * nb * 16);
    for (int j = 0; j < g; j++) {
        const block_q8_0 *xj = X_ROW(a, t0 + j);
        for (int64_t b = 0; b < nb; b++) {
            for (int k4 = 0; k4 < QK / 4; k4++) memcpy(bt + 512 * b + 64 * k4 + 4 * j, xj[b].qs + 4 * k4, 4);
            dx[16 * b + j] = F16(xj[b].d);
        }
    }
}

#define QR_GROUPS_BYTES (128 * 1024)  // the packed tokens on the stack at most: 4 groups of 16 for rows up to 2048

static void gemm_q8_0_amx(const gemm_args *a, int64_t r0, int64_t r1, int64_t n_tok) {
    const int64_t nb = a->n / QK, m = r1 - r0 < 16 ? r1 - r0 : 16;
    const int per = nb * 512 * 4 <= QR_GROUPS_BYTES ? 4 : 1;  // groups of 16 tokens packed at once
    int8_t bt[per * nb * 512] __attribute__((aligned(64)));
    float dx[per * nb * 16] __attribute__((aligned(64)));
    for (int64_t t0 = 0; t0 < n_tok; t0 += 16 * per) {
        const int64_t n = n_tok - t0 < 16 * per ? n_tok - t0 : 16 * per;
        const int full = (int)(n / 16), rest = (int)(n % 16);
        for (int k = 0; k * 16 < n; k++)
            q8_rows_amx_pack(a, t0 + 16 * k, n - 16 * k < 16 ? (int)(n - 16 * k) : 16, nb, bt + k * nb * 512,
                             dx + k * nb * 16);
        if (full) {
            q8_rows_amx_config((int)m, 16);
            q8_rows_amx_tokens(a, r0, r1, m, nb, bt, dx, t0, full, 16);
        }
        if (rest) {  // the last group's tiles are narrower
            q8_rows_amx_config((int)m, rest);
            q8_rows_amx_tokens(a, r0, r1, m, nb, bt + full * nb * 512, dx + full * nb * 16, t0 + 16 * full, 1, rest);
        }
    }
    _tile_release();
}
#endif

// Rows [r0, r1) (r0 a multiple of QB_ROWS) as S streams of consecutive bands, S bands a 1 / S of the range apart
// read at once, then the rest. Fewer tokens are bound by memory and want more streams (one stream of bands: 1
// token 4.8 ms against 3.6 with 4); 8 tokens are bound by arithmetic and read one band at a time.
void strata_gemm_bands(int type, const void *bands, int64_t n, int64_t r0, int64_t r1, const void *x, int64_t n_tok,
                       float *y, int64_t ldy) {
    (void)type;
#if defined(QB_AMX)
    if (n_tok >= bands_amx_tokens && n / QK <= QB_AMX_MAX_BLOCKS && amx_ready()) {
        gemm_bands_amx(bands, n, r0, r1, x, n_tok, y, ldy);
        return;
    }
#endif
    const int64_t nb = n / QK, xb = nb * (int64_t)sizeof(block_q8_0), group = QB_SEEDS / nb;
    const size_t band_bytes = qb_band_bytes(nb);
    const int64_t k0 = r0 / QB_ROWS, k1 = (r1 + QB_ROWS - 1) / QB_ROWS;
    int32_t seed[QB_SEEDS];
    for (int64_t t0 = 0; t0 < n_tok; t0 += group) {  // the tokens whose seeds fit, over every band
        const int64_t g = n_tok - t0 < group ? n_tok - t0 : group;
        const char *xt = (const char *)x + t0 * xb;
        for (int64_t j = 0; j < g; j++) {
            const block_q8_0 *xj = (const block_q8_0 *)(xt + j * xb);
            for (int64_t b = 0; b < nb; b++) seed[j * nb + b] = q8_band_seed(&xj[b]);
        }
        float *yt = y + t0 * ldy;
        int S = g >= 8 ? 1 : g >= 4 ? 2 : 4;  // 4: one token measured 3.6 ms, 8 streams 4.5 (151,936 x 512)
        int64_t rs = S > 1 ? (k1 - k0) / S : 0, k = k0;
        for (; k < k0 + rs; k++) {  // S streams; constant band counts, so that each tile is unrolled
            if (S == 4) q8_bands_tokens(bands, band_bytes, nb, k, rs, 4, r1, xt, xb, g, seed, yt, ldy);
            else q8_bands_tokens(bands, band_bytes, nb, k, rs, 2, r1, xt, xb, g, seed, yt, ldy);
        }
        for (k = k0 + S * rs; k < k1; k++)
            q8_bands_tokens(bands, band_bytes, nb, k, 0, 1, r1, xt, xb, g, seed, yt, ldy);
    }
}
#else
size_t strata_bands_size(int type, int64_t n_rows, int64_t n) {
    (void)type, (void)n_rows, (void)n;
    return 0;  // the direct tiles are the only path
}

void strata_bands_fill(int type, const void *w, int64_t n_rows, int64_t n, void *bands) {
    (void)type, (void)w, (void)n_rows, (void)n, (void)bands;
}

void strata_gemm_bands(int type, const void *bands, int64_t n, int64_t r0, int64_t r1, const void *x, int64_t n_tok,
                       float *y, int64_t ldy) {
    (void)type, (void)bands, (void)n, (void)r0, (void)r1, (void)x, (void)n_tok, (void)y, (void)ldy;
}
#endif

#if defined(KQ_PREPARED)
// A row's super-block for a band (kb_prepare).
static void q4k_unpack(const void *blk, uint8_t *u, __m256i *sc, __m256i *m, float *d, float *dmin) {
    const block_q4_K *B = blk;
    uint64_t sc8, m8;
    q4k_scale_min_u64(B->scales, &sc8, &m8);
    *sc = q4k_mins16(sc8), *m = q4k_mins16(m8);  // each of the 8 once per group of 16
    *d = F16(B->d), *dmin = F16(B->dmin);
    const __m256i low4 = _mm256_set1_epi8(0xf);
    for (int c = 0; c < 4; c++) {  // sub-block 2c in the low nibbles, 2c + 1 in the high ones
        __m256i q = _mm256_loadu_si256((const __m256i *)(B->qs + 32 * c));
        _mm256_store_si256((__m256i *)(u + 64 * c), _mm256_and_si256(q, low4));
        _mm256_store_si256((__m256i *)(u + 64 * c + 32), _mm256_and_si256(_mm256_srli_epi16(q, 4), low4));
    }
}

static void q6k_unpack(const void *blk, uint8_t *u, __m256i *sc, __m256i *m, float *d, float *dmin) {
    const block_q6_K *B = blk;
    const __m512i low4 = _mm512_set1_epi8(0xf), bits45 = _mm512_set1_epi8(0x30);
    *sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)B->scales)), *m = _mm256_setzero_si256();
    *d = F16(B->d), *dmin = 0.0f;
    for (int h = 0; h < 2; h++) {  // as in tile_q6_K: elements 128h + 0..63, then 128h + 64..127, as q + 32
        __m512i ql = _mm512_loadu_si512(B->ql + 64 * h);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(B->qh + 32 * h));
        __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
        _mm512_store_si512(u + 128 * h, _mm512_or_si512(_mm512_and_si512(ql, low4),
                                                        _mm512_and_si512(_mm512_slli_epi16(qh2, 4), bits45)));
        _mm512_store_si512(u + 128 * h + 64, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                                             _mm512_and_si512(qh2, bits45)));
    }
}
#endif

#if !defined(AV)
TILE_SCALAR(f32)
TILE_SCALAR(f16)
TILE_SCALAR(bf16)
#define TILE_F32 tile_scalar_f32
#define TILE_F16 tile_scalar_f16
#define TILE_BF16 tile_scalar_bf16
#endif
#if !defined(__AVX2__)
TILE_SCALAR(q8_0)
TILE_SCALAR(q4_0)
TILE_SCALAR(q4_K)
TILE_SCALAR(q6_K)
#define tile_q8_0 tile_scalar_q8_0
#define tile_q4_0 tile_scalar_q4_0
#define tile_q4_K tile_scalar_q4_K
#define tile_q6_K tile_scalar_q6_K
#endif

DEFINE_GEMM(strata_gemm_f32, TILE_F32)
DEFINE_GEMM(strata_gemm_f16, TILE_F16)
DEFINE_GEMM(strata_gemm_bf16, TILE_BF16)
#if defined(VNNI512)
// The exact sums of up to 4 rows x 4 tokens: s[4j + i] (token j, row i) holds in lanes 0-7 parts of block b's sum,
// in lanes 8-15 parts of block b1's; lane 4j + i of *sb becomes block b's sum, of *sb1 block b1's. Pairs of lanes,
// then quads, within 128-bit lanes (in-lane shuffles), then each block's two 128-bit lanes; only NT tokens' vectors.
INLINE void q8_block_sums(const __m512i s[16], int NT, __m512i *sb, __m512i *sb1) {
    __m512i t[8], u[4];
    UNROLL for (int k = 0; k < 2 * NT; k++)  // 128-bit lane: s[2k]'s 0 + 2, s[2k + 1]'s 0 + 2, then 1 + 3 of each
        t[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2 * k], s[2 * k + 1]),
                                _mm512_unpackhi_epi32(s[2 * k], s[2 * k + 1]));
    UNROLL for (int m = 0; m < NT; m++)  // element e of 128-bit lane L: the sum of lane L of s[4m + e]
        u[m] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * m], t[2 * m + 1]),
                                _mm512_unpackhi_epi64(t[2 * m], t[2 * m + 1]));
    UNROLL for (int m = NT; m < 4; m++) u[m] = u[0];  // lanes of absent tokens, never stored
    // 128-bit lanes 0 + 1 are block b's, 2 + 3 block b1's: [u0 b, u0 b1, u1 b, u1 b1], then u2 and u3 alike
    const __m512i w01 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88),
                                         _mm512_shuffle_i32x4(u[0], u[1], 0xdd));
    const __m512i w23 = NT > 2 ? _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x88),
                                                  _mm512_shuffle_i32x4(u[2], u[3], 0xdd))
                               : w01;
    *sb = _mm512_shuffle_i32x4(w01, w23, 0x88), *sb1 = _mm512_shuffle_i32x4(w01, w23, 0xdd);
}

// Rows r + i rs (i < NR) against tokens t .. t + NT - 1 by the VNNI unit, in the bands' f32 steps: the 8 lanes of a
// block's products are summed to the block's exact integer sum, then sum * (dw * dx) is added to the row and
// token's accumulator (lane 4j + i), block after block, as tile_q8_bands (and the tile unit) do. A row and token
// take the same steps whatever the other rows and tokens are, so the rows as they lie in the file (mapped weights)
// give the bits of the bands (weights copied at load), and a token gets the same bits alone as in a batch. A tile
// that scaled each lane's part of a block's sum (as the AVX2 tile_q8_0 does) gave other last bits, which the next
// layer's rounding of its activations to Q8_0 made visible in the logits (0.04 on the llama test model).
INLINE void tile_q8_0_exact(const gemm_args *a, int64_t r, int64_t t, int NR, int NT) {
    const block_q8_0 *w[TR], *x[TT];
    const __m512i bias = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    const __m512i row_of = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    const __m512i token_of = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i second = _mm512_set1_epi32(4);  // block b1's scales follow block b's
    UNROLL for (int i = 0; i < TR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i < NR ? i : 0));
    UNROLL for (int j = 0; j < TT; j++) x[j] = X_ROW(a, t + (j < NT ? j : 0));
    __m512 acc = _mm512_setzero_ps();
    const int64_t nb = a->n / QK;
    for (int64_t b = 0; b < nb; b += 2) {
        const int64_t b1 = b + 1 < nb ? b + 1 : b;  // an odd last block pairs with itself, and is added once
        __m512i wu[TR], s[16];
        UNROLL for (int i = 0; i < NR; i++) {
            if (NT <= 2) _mm_prefetch((const char *)&w[i][b] + Q8_PREFETCH, _MM_HINT_T0);
            wu[i] = _mm512_xor_si512(load_2x256(w[i][b].qs, w[i][b1].qs), bias);
        }
        UNROLL for (int j = 0; j < NT; j++) {
            const __m512i xq = load_2x256(x[j][b].qs, x[j][b1].qs);
            const __m512i seed = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, xq));
            UNROLL for (int i = 0; i < TR; i++) s[4 * j + i] = i < NR ? _mm512_dpbusd_epi32(seed, wu[i], xq) : zero;
        }
        __m512i sb, sb1;
        q8_block_sums(s, NT, &sb, &sb1);
        const __m512 dw = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_setr_epi16(
            (short)w[0][b].d, (short)w[1][b].d, (short)w[2][b].d, (short)w[3][b].d,
            (short)w[0][b1].d, (short)w[1][b1].d, (short)w[2][b1].d, (short)w[3][b1].d)));
        __m512 dx0, dx1;  // the tokens' scales of blocks b and b1 in their lanes; one token's in all (decode)
        if (NT == 1) {
            dx0 = _mm512_cvtph_ps(_mm256_set1_epi16((short)x[0][b].d));
            dx1 = _mm512_cvtph_ps(_mm256_set1_epi16((short)x[0][b1].d));
        } else {
            const __m512 dx = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_setr_epi16(
                (short)x[0][b].d, (short)x[1][b].d, (short)x[2][b].d, (short)x[3][b].d,
                (short)x[0][b1].d, (short)x[1][b1].d, (short)x[2][b1].d, (short)x[3][b1].d)));
            dx0 = _mm512_permutexvar_ps(token_of, dx);
            dx1 = _mm512_permutexvar_ps(_mm512_add_epi32(token_of, second), dx);
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sb), _mm512_mul_ps(_mm512_permutexvar_ps(row_of, dw), dx0), acc);
        if (b1 > b) {
            const __m512 dw1 = _mm512_permutexvar_ps(_mm512_add_epi32(row_of, second), dw);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sb1), _mm512_mul_ps(dw1, dx1), acc);
        }
    }
    float y16[16] __attribute__((aligned(64)));
    _mm512_store_ps(y16, acc);
    UNROLL for (int j = 0; j < NT; j++)
        UNROLL for (int i = 0; i < NR; i++) a->y[(t + j) * a->ldy + TILE_ROW(a, r, i)] = y16[4 * j + i];
}

static DEFINE_GEMM(gemm_q8_0_exact, tile_q8_0_exact)

// From this many tokens, Q8_0 rows as they lie are laid out in bands per call, a band at a time, as a copy at load
// lays them out (strata_bands_fill), and the bands' tiles take every token: their integer sums need no horizontal
// steps, which tile_q8_0_exact spends per block and token.
#define QR_BANDS_MIN_TOKENS 6

// Ask for the rows of the band from r (below r1), one stretch of memory, at once: a band ahead, from memory
// 4096 x 512 at 16 tokens 0.32 -> 0.27 ms.
INLINE void qr_prefetch(const gemm_args *a, int64_t r, int64_t r1) {
    const int64_t rows = r1 - r < QB_ROWS ? r1 - r : QB_ROWS;
    for (int64_t at = 0; at < rows * (int64_t)a->wb; at += 64)
        _mm_prefetch((const char *)W_ROW(a, r) + at, _MM_HINT_T1);
}

// The band of rows r .. r + rows - 1 (rows <= QB_ROWS) into `band` as strata_bands_fill lays it out (the pad of an
// odd block count aside, which no product reads), by loads in each row's order and transposes: the gathers of
// strata_bands_fill, 16 rows apart, are slow from memory (4096 x 512 at 6 tokens 0.96 ms with them, 0.16 by the
// tiles that read the rows in turn).
static void qr_band_fill(const gemm_args *a, int64_t r, int64_t rows, uint8_t *band) {
    const __m512i flip = _mm512_set1_epi32((int)0x80808080u);  // values + 128
    const int64_t nb = a->n / QK;
    for (int64_t b = 0; b < nb; b += 2) {
        const int64_t b1 = b + 1 < nb ? b + 1 : b;
        uint16_t *d = (uint16_t *)(uintptr_t)qb_scales(band, b);  // block b's 16 scales, then b + 1's
        __m512i v[QB_ROWS];
        for (int i = 0; i < QB_ROWS; i++) {  // rows past the end: values 0, scale 0
            const block_q8_0 *w = i < rows ? W_ROW(a, r + i) : NULL;
            v[i] = w ? load_2x256(w[b].qs, w[b1].qs) : _mm512_setzero_si512();
            d[i] = w ? w[b].d : 0, d[QB_ROWS + i] = w ? w[b1].d : 0;
        }
        transpose16(v);  // v[e]: step e of block b, v[8 + e] of block b1
        uint8_t *q = (uint8_t *)(uintptr_t)qb_values(band, b);
        for (int e = 0; e < 16; e++) _mm512_store_si512(q + 64 * e, _mm512_xor_si512(v[e], flip));
    }
}

// Rows [r0, r1) against n_tok tokens through bands laid out here; 0 when the scratch cannot be had.
static int gemm_q8_0_banded(const gemm_args *a, int64_t r0, int64_t r1, int64_t n_tok) {
    const int64_t nb = a->n / QK;
    const size_t band_bytes = qb_band_bytes(nb);  // whole cache lines
    uint8_t *band = aligned_alloc(64, band_bytes);
    int32_t *seed = malloc((size_t)(n_tok * nb) * sizeof(int32_t));
    if (band && seed) {
        for (int64_t j = 0; j < n_tok; j++) {
            const block_q8_0 *xj = X_ROW(a, j);
            for (int64_t b = 0; b < nb; b++) seed[j * nb + b] = q8_band_seed(&xj[b]);
        }
        qr_prefetch(a, r0, r1);
        for (int64_t r = r0; r < r1; r += QB_ROWS) {
            const int64_t rows = r1 - r < QB_ROWS ? r1 - r : QB_ROWS;
            qr_prefetch(a, r + QB_ROWS, r1);
            qr_band_fill(a, r, rows, band);
            q8_bands_tokens(band, band_bytes, nb, 0, 0, 1, rows, a->x, (int64_t)a->xb, n_tok, seed, a->y + r, a->ldy);
        }
    }
    free(band), free(seed);
    return band && seed;
}

// Invariant: every Q8_0 product of rows takes the bands' f32 steps (a token's exact integer sum of each block, then
// acc += sum * (dw * dx), block after block), so that mapped weights give the bits of weights copied at load (laid
// out in bands, strata_bands_size), and a token the same bits alone as in a batch.
void strata_gemm_q8_0(gemm_args *a, int64_t r0, int64_t r1, int64_t n_tok) {
#if defined(QB_AMX)
    // With one or two tokens (decode) the tile unit is the slower (4096 x 512, 1 thread: 0.17 ms against 0.14 for
    // one token, 0.17 against 0.15 for two).
    if (n_tok > 2 && a->n / QK <= QB_AMX_MAX_BLOCKS && amx_ready()) {
        gemm_q8_0_amx(a, r0, r1, n_tok);
        return;
    }
#endif
    if (n_tok < QR_BANDS_MIN_TOKENS || !gemm_q8_0_banded(a, r0, r1, n_tok)) gemm_q8_0_exact(a, r0, r1, n_tok);
}
#else
DEFINE_GEMM(strata_gemm_q8_0, tile_q8_0)
#endif
DEFINE_GEMM(strata_gemm_q4_0, tile_q4_0)
static DEFINE_GEMM(gemm_q4_K_blocks, tile_q4_K)
static DEFINE_GEMM(gemm_q6_K_blocks, tile_q6_K)

// Prompts (KQ_MIN_TOKENS or more) in bands of rows; decode, a small expert's share, or a product whose scratch
// cannot be had read the blocks directly.
void strata_gemm_q4_K(gemm_args *a, int64_t r0, int64_t r1, int64_t n_tok) {
#if defined(KQ_PREPARED)
    if (n_tok >= KQ_MIN_TOKENS && gemm_kb(q4k_unpack, sizeof(block_q4_K), 0, 1, gemm_q4_K_blocks, a, r0, r1, n_tok))
        return;
#endif
    gemm_q4_K_blocks(a, r0, r1, n_tok);
}

void strata_gemm_q6_K(gemm_args *a, int64_t r0, int64_t r1, int64_t n_tok) {
#if defined(KQ_PREPARED)
    if (n_tok >= KQ_MIN_TOKENS && gemm_kb(q6k_unpack, sizeof(block_q6_K), 32, 0, gemm_q6_K_blocks, a, r0, r1, n_tok))
        return;
#endif
    gemm_q6_K_blocks(a, r0, r1, n_tok);
}

int strata_gemm_packs_tokens(int type, int64_t n) {
#if defined(QB_AMX)
    return type == STRATA_TYPE_Q8_0 && n / QK <= QB_AMX_MAX_BLOCKS && amx_ready();
#else
    (void)type, (void)n;
    return 0;
#endif
}

int strata_bands_amx(int min_tokens) {
#if defined(QB_AMX)
    if (!amx_ready()) return 0;
    if (min_tokens > 0) bands_amx_tokens = min_tokens;
    return bands_amx_tokens;
#else
    (void)min_tokens;
    return 0;
#endif
}

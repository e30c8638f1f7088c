/* quants_x86_iq4xs.c — IQ4_XS x Q8_K with AVX-512 VNNI, decode and prompt shapes (other builds: quants_x86_kx.c).
 *
 * IQ4_XS's values (the IQ4_NL table, -127 .. 113) are too wide for 16-bit pair sums. Stored unsigned as
 * u = q + 128 they suit vpdpbusd: the activations stay signed, and each sum starts from -128 times the sum of the
 * activations it multiplies.
 *
 * Prompts (16 tokens or more) take the K-quants' bands of rows (gemm_kb, quants_x86.h): each row is unpacked once
 * per product and the activations are read as they are. (A layout with 16 tokens in the lanes, as ggml's tiled
 * kernel has, was slower in one call, 4.0 against 3.5 ms for 1,024 x 2,048 x 256 tokens, and re-packed the
 * activations on every call: 7.0 against 3.6 ms in the engine's 16-row calls.)
 *
 * Decode tiles unpack the blocks themselves and reduce each row's integer sum per super-block to one number before
 * the f32 steps tile_kb takes per token, so a token's outputs are the same bits whatever shares its product. As
 * with IQ4_NL, one 128-bit lane holds one sub-block (elements 0-15 in one register, 16-31 in another, the nibble
 * order of the block itself), so a lane's two vpdpbusd belong to one sub-block and one vpmulld applies its 6-bit
 * scale; the activations are rearranged to that order once per call (ix_act). */
#include <stddef.h>
#include <stdlib.h>
#include "quants_x86.h"

#if defined(VNNI512)

// One token's super-block: group g holds sub-blocks 4g .. 4g + 3, sub-block l of a group in 128-bit lane l.
typedef struct {
    int8_t x[2][2][64];    // [g][0]: elements 0-15 of each sub-block, [g][1]: elements 16-31
    int32_t seed[2][16];   // -128 * the sum of the 8 activations each 32-bit lane of group g multiplies
    float d;
} __attribute__((aligned(64))) ix_act;

#define IX_MIN_TOKENS 16  // from here on, prompts take the bands (gemm_kb)
#define IX_PREFETCH 1024  // decode streams TR rows, ahead of the hardware prefetchers

static void ix_act_of(const block_q8_K *X, ix_act *A) {
    const __m512i offset = _mm512_set1_epi8((char)128);
    for (int g = 0; g < 2; g++) {
        __m512i n0 = _mm512_loadu_si512(X->qs + 128 * g), n1 = _mm512_loadu_si512(X->qs + 128 * g + 64);
        // 128-bit lanes of elements 0-63 and 64-127: 0-15, 32-47, 64-79, 96-111 and the 16 after each
        __m512i lo = _mm512_shuffle_i64x2(n0, n1, _MM_SHUFFLE(2, 0, 2, 0));
        __m512i hi = _mm512_shuffle_i64x2(n0, n1, _MM_SHUFFLE(3, 1, 3, 1));
        __m512i zero = _mm512_setzero_si512();
        _mm512_store_si512(A->x[g][0], lo);
        _mm512_store_si512(A->x[g][1], hi);
        _mm512_store_si512(A->seed[g], _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, offset, lo),
                                                                               offset, hi)));
    }
    A->d = X->d;
}

// A block's values + 128 (group g, half h), straight from its nibbles: qs[16 s + i] holds elements 32 s + i (low
// nibble) and 32 s + 16 + i (high).
INLINE void ix_values(const block_iq4_xs *B, __m512i u[2][2]) {
    const __m128i t = _mm_xor_si128(_mm_loadu_si128((const __m128i *)KVALUES_IQ4NL), _mm_set1_epi8((char)0x80));
    const __m512i table = _mm512_broadcast_i32x4(t), low4 = _mm512_set1_epi8(0xf);
    for (int g = 0; g < 2; g++) {
        __m512i raw = _mm512_loadu_si512(B->qs + 64 * g);
        u[g][0] = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, low4));
        u[g][1] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));
    }
}

// The signed 6-bit scales of sub-blocks 4g .. 4g + 3, each in the four 32-bit lanes of its 128-bit lane.
INLINE void ix_scales(const block_iq4_xs *B, __m512i sc[2]) {
    uint32_t scales_l;
    memcpy(&scales_l, B->scales_l, 4);
    __m256i l = _mm256_srlv_epi32(_mm256_set1_epi32((int)scales_l),
                                  _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    __m256i h = _mm256_srlv_epi32(_mm256_set1_epi32(B->scales_h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    __m256i s = _mm256_or_si256(_mm256_and_si256(l, _mm256_set1_epi32(0xf)),
                                _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(3)), 4));
    __m512i s8 = _mm512_castsi256_si512(_mm256_sub_epi32(s, _mm256_set1_epi32(32)));
    sc[0] = _mm512_permutexvar_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), s8);
    sc[1] = _mm512_permutexvar_epi32(_mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4), s8);
}



// The direct tiles' last steps per super-block: each row and token's integer sum (16 lanes of isum) reduced to one
// number, in lane i (row i) of acc[j], then acc[j] += sum * d_i * dx_j, as tile_kb does per token.
INLINE void ix_scale_add(__m512i isum[TR][TT], const float d[TR], const float dx[TT], __m128 acc[TT], int NR, int NT) {
    const __m128 dw = _mm_loadu_ps(d);
    UNROLL for (int j = 0; j < NT; j++) {
        __m256i h[TR];
        UNROLL for (int i = 0; i < NR; i++)
            h[i] = _mm256_add_epi32(_mm512_castsi512_si256(isum[i][j]), _mm512_extracti64x4_epi64(isum[i][j], 1));
        __m256i q;
        if (NR == TR) {  // lane k of each 128-bit half: a partial sum of row k
            q = _mm256_hadd_epi32(_mm256_hadd_epi32(h[0], h[1]), _mm256_hadd_epi32(h[2], h[3]));
        } else {
            q = _mm256_hadd_epi32(h[0], h[0]);
            q = _mm256_hadd_epi32(q, q);
        }
        __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        acc[j] = _mm_fmadd_ps(_mm_cvtepi32_ps(sum), _mm_mul_ps(dw, _mm_set1_ps(dx[j])), acc[j]);
    }
}

INLINE void ix_store(const gemm_args *a, const __m128 acc[TT], int64_t r, int64_t t, int NR, int NT) {
    UNROLL for (int j = 0; j < NT; j++) {
        float out[4];
        _mm_storeu_ps(out, acc[j]);
        UNROLL for (int i = 0; i < NR; i++) a->y[(t + j) * a->ldy + TILE_ROW(a, r, i)] = out[i];
    }
}

// NR rows from their blocks x NT tokens (A's, nb apart). Each row and token's integer sum is reduced to one
// number per super-block and scaled in f32 in lane i (row i) of an xmm: the steps tile_kb takes for
// each of its tokens, so a token's outputs are the same bits in either.
INLINE void tile_ix(const gemm_args *a, const ix_act *A, int64_t r, int64_t t, int NR, int NT) {
    const int64_t nb = a->n / QKK;
    const char *w[TR] = {0};
    __m128 acc[TT];
    UNROLL for (int i = 0; i < NR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i));
    UNROLL for (int j = 0; j < NT; j++) acc[j] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i isum[TR][TT];
        float d[TR] = {0};
        UNROLL for (int i = 0; i < NR; i++) {
            const block_iq4_xs *B = (const block_iq4_xs *)w[i] + b;
            if (NT == 1) _mm_prefetch((const char *)B + IX_PREFETCH, _MM_HINT_T0);
            __m512i u[2][2], sc[2];
            ix_values(B, u);
            ix_scales(B, sc);
            d[i] = F16(B->d);
            UNROLL for (int j = 0; j < NT; j++) {
                const ix_act *X = &A[j * nb + b];
                __m512i p[2];
                UNROLL for (int g = 0; g < 2; g++)
                    p[g] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_load_si512(X->seed[g]), u[g][0],
                                                                   _mm512_load_si512(X->x[g][0])),
                                               u[g][1], _mm512_load_si512(X->x[g][1]));
                isum[i][j] = _mm512_add_epi32(_mm512_mullo_epi32(p[0], sc[0]), _mm512_mullo_epi32(p[1], sc[1]));
            }
        }
        float dx[TT];
        UNROLL for (int j = 0; j < NT; j++) dx[j] = A[j * nb + b].d;
        ix_scale_add(isum, d, dx, acc, NR, NT);
    }
    ix_store(a, acc, r, t, NR, NT);
}

// Tokens [tb, te) (A from tb) against rows [r0, r1), in tiles of TR rows rs apart as DEFINE_GEMM's.
static void ix_direct(gemm_args *a, const ix_act *A, int64_t r0, int64_t r1, int64_t tb, int64_t te) {
    const int64_t nb = a->n / QKK;
    a->rs = (r1 - r0) / TR;
    for (int64_t r = r0; r < r1;) {
        const int full = r < r0 + a->rs;  // a tile of TR rows rs apart, else one of the last rows
        int64_t t = tb;
#define IX_TILE(NR, NT) tile_ix(a, A + (t - tb) * nb, r, t, NR, NT)
        if (full) {
            for (; t + TT <= te; t += TT) IX_TILE(TR, TT);
            for (; t < te; t++) IX_TILE(TR, 1);
        } else {
            for (; t + TT <= te; t += TT) IX_TILE(1, TT);
            for (; t < te; t++) IX_TILE(1, 1);
        }
#undef IX_TILE
        r = full && r + 1 == r0 + a->rs ? r0 + TR * a->rs : r + 1;
    }
}

static void ix_acts(const gemm_args *a, int64_t tb, int64_t te, ix_act *A) {
    const int64_t nb = a->n / QKK;
    for (int64_t t = tb; t < te; t++)
        for (int64_t b = 0; b < nb; b++) ix_act_of((const block_q8_K *)X_ROW(a, t) + b, &A[(t - tb) * nb + b]);
}

TILE_SCALAR(iq4_xs)
static DEFINE_GEMM(gemm_scalar_iq4_xs, tile_scalar_iq4_xs)

// A super-block for the bands: values + 128 in element order, each sub-block's scale for both its groups of 16.
static void kb_unpack_iq4_xs(const void *blk, uint8_t *u, __m256i *sc, __m256i *m, float *d, float *dmin) {
    const block_iq4_xs *B = blk;
    const __m128i table = _mm_xor_si128(_mm_loadu_si128((const __m128i *)KVALUES_IQ4NL), _mm_set1_epi8((char)0x80));
    const __m128i low4 = _mm_set1_epi8(0xf);
    int16_t g[16];
    for (int s = 0; s < 8; s++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(B->qs + 16 * s));
        _mm_storeu_si128((__m128i *)(u + 32 * s), _mm_shuffle_epi8(table, _mm_and_si128(v, low4)));
        _mm_storeu_si128((__m128i *)(u + 32 * s + 16),
                         _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), low4)));
        g[2 * s] = g[2 * s + 1] = (int16_t)strata_iq4xs_scale(B, s);
    }
    *sc = _mm256_loadu_si256((const __m256i *)g);
    *m = _mm256_setzero_si256();
    *d = F16(B->d);
    *dmin = 0.0f;
}

// Rows [r0, r1) x n_tok tokens by the decode tiles.
static void ix_gemm_direct(gemm_args *a, int64_t r0, int64_t r1, int64_t n_tok) {
    const int64_t nb = a->n / QKK;
    ix_act *A = aligned_alloc(64, (size_t)(n_tok * nb) * sizeof(ix_act));
    if (!A) {
        gemm_scalar_iq4_xs(a, r0, r1, n_tok);  // out of memory: slow, but right
        return;
    }
    ix_acts(a, 0, n_tok, A);
    ix_direct(a, A, r0, r1, 0, n_tok);
    free(A);
}

void strata_gemm_iq4_xs(gemm_args *a, int64_t r0, int64_t r1, int64_t n_tok) {
    if (n_tok >= IX_MIN_TOKENS &&
        gemm_kb(kb_unpack_iq4_xs, sizeof(block_iq4_xs), 128, 0, ix_gemm_direct, a, r0, r1, n_tok))
        return;
    ix_gemm_direct(a, r0, r1, n_tok);
}

#endif

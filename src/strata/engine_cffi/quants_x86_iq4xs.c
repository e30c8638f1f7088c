/* quants_x86_iq4xs.c — IQ4_XS x Q8_K with AVX-512 VNNI, decode and prompt shapes (other builds: quants_x86_kx.c).
 *
 * IQ4_XS's values (the IQ4_NL table, -127 .. 113) are too wide for the 16-bit pair sums of the shared K-quant
 * tiles. Stored unsigned as u = q + 128 they suit vpdpbusd: the activations stay signed, and each 32-bit lane's
 * -128 * (sum of its 8 activations) is a seed its sums start from. As with IQ4_NL, one 128-bit lane holds one
 * sub-block of 32 (elements 0-15 in one register, 16-31 in another, the nibble order of the block itself), so a
 * lane's two vpdpbusd belong to one sub-block and one vpmulld applies its 6-bit scale: four sub-blocks per
 * register, 1.5 multiplies per 64 values where the shared tiles take 2. The activations are rearranged to that
 * order once per product (ix_act), the rows once per block of tokens (ix_prep) when there are many tokens.
 * Decode tiles unpack the blocks themselves and end in the same integer lanes and f32 steps, so a token's outputs
 * do not depend on the tokens beside it. */
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

// One row's super-block, in ix_act's order: the values + 128, and the scale of each lane's sub-block.
typedef struct {
    uint8_t u[2][2][64];
    int32_t sc[2][16];
    float d;
} __attribute__((aligned(64))) ix_prep;

#define IX_MIN_TOKENS 16  // as the other 256-element types: from here on the rows are prepared once
#define IX_TOKEN_BLOCK 32 // tokens whose ix_act (448 bytes per super-block) stay in cache over every row tile
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

static void ix_prepare(const block_iq4_xs *B, ix_prep *P) {
    __m512i u[2][2], sc[2];
    ix_values(B, u);
    ix_scales(B, sc);
    for (int g = 0; g < 2; g++) {
        _mm512_store_si512(P->u[g][0], u[g][0]);
        _mm512_store_si512(P->u[g][1], u[g][1]);
        _mm512_store_si512(P->sc[g], sc[g]);
    }
    P->d = F16(B->d);
}

// NR rows (from their blocks, or prepared: P's rows nb apart) x NT tokens (A's, nb apart). Pairs of tokens share
// an f32 register as in tile_kq_prepared (each token's 16 integer lanes folded to 8); one token alone does the
// same steps on 8 lanes.
INLINE void tile_ix(const gemm_args *a, int prepared, const ix_prep *P, const ix_act *A, int64_t r, int64_t t,
                    int NR, int NT) {
    const int64_t nb = a->n / QKK;
    const char *w[TR] = {0};
    __m512 acc[TR][TT / 2];
    __m256 acc1[TR];
    UNROLL for (int i = 0; i < NR; i++) {
        w[i] = W_ROW(a, TILE_ROW(a, r, i));
        acc1[i] = _mm256_setzero_ps();
        UNROLL for (int k = 0; k < NT / 2; k++) acc[i][k] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        __m512 da[TT / 2];
        UNROLL for (int k = 0; k < NT / 2; k++)
            da[k] = _mm512_insertf32x8(_mm512_set1_ps(A[2 * k * nb + b].d), _mm256_set1_ps(A[(2 * k + 1) * nb + b].d), 1);
        UNROLL for (int i = 0; i < NR; i++) {
            __m512i u[2][2], sc[2];
            float d;
            if (prepared) {
                const ix_prep *p = &P[i * nb + b];
                for (int g = 0; g < 2; g++) {
                    u[g][0] = _mm512_load_si512(p->u[g][0]);
                    u[g][1] = _mm512_load_si512(p->u[g][1]);
                    sc[g] = _mm512_load_si512(p->sc[g]);
                }
                d = p->d;
            } else {
                const block_iq4_xs *B = (const block_iq4_xs *)w[i] + b;
                if (NT == 1) _mm_prefetch((const char *)B + IX_PREFETCH, _MM_HINT_T0);
                ix_values(B, u);
                ix_scales(B, sc);
                d = F16(B->d);
            }
            __m512i isum[TT];
            UNROLL for (int j = 0; j < NT; j++) {
                const ix_act *X = &A[j * nb + b];
                __m512i p[2];
                UNROLL for (int g = 0; g < 2; g++)
                    p[g] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_load_si512(X->seed[g]), u[g][0],
                                                                   _mm512_load_si512(X->x[g][0])),
                                               u[g][1], _mm512_load_si512(X->x[g][1]));
                isum[j] = _mm512_add_epi32(_mm512_mullo_epi32(p[0], sc[0]), _mm512_mullo_epi32(p[1], sc[1]));
            }
            if (NT == 1) {
                __m256i s = _mm256_add_epi32(_mm512_castsi512_si256(isum[0]), _mm512_extracti64x4_epi64(isum[0], 1));
                acc1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * A[b].d), acc1[i]);
            }
            UNROLL for (int k = 0; k < NT / 2; k++)
                acc[i][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fold_pair(isum[2 * k], isum[2 * k + 1])),
                                            _mm512_mul_ps(_mm512_set1_ps(d), da[k]), acc[i][k]);
        }
    }
    UNROLL for (int i = 0; i < NR; i++) {
        int64_t row = TILE_ROW(a, r, i);
        if (NT == 1) a->y[t * a->ldy + row] = hsum256(acc1[i]);
        UNROLL for (int k = 0; k < NT / 2; k++) {
            a->y[(t + 2 * k) * a->ldy + row] = hsum256(_mm512_castps512_ps256(acc[i][k]));
            a->y[(t + 2 * k + 1) * a->ldy + row] = hsum256(_mm512_extractf32x8_ps(acc[i][k], 1));
        }
    }
}

// Tokens [tb, te) (A from tb) against rows [r0, r1) in tiles of TR rows rs apart (as DEFINE_GEMM), each tile of
// rows prepared into P first when P is given.
INLINE void ix_rows(gemm_args *a, int prepared, ix_prep *P, const ix_act *A, int64_t r0, int64_t r1, int64_t tb,
                    int64_t te) {
    const int64_t nb = a->n / QKK;
    for (int64_t r = r0; r < r1;) {
        const int full = r < r0 + a->rs;  // a tile of TR rows rs apart, else one of the last rows
        if (prepared)
            for (int i = 0; i < (full ? TR : 1); i++)
                for (int64_t b = 0; b < nb; b++)
                    ix_prepare((const block_iq4_xs *)W_ROW(a, TILE_ROW(a, r, i)) + b, &P[i * nb + b]);
        int64_t t = tb;
        if (full) {
            for (; t + TT <= te; t += TT) tile_ix(a, prepared, P, A + (t - tb) * nb, r, t, TR, TT);
            for (; t + 2 <= te; t += 2) tile_ix(a, prepared, P, A + (t - tb) * nb, r, t, TR, 2);
            if (t < te) tile_ix(a, prepared, P, A + (t - tb) * nb, r, t, TR, 1);
        } else {
            for (; t + TT <= te; t += TT) tile_ix(a, prepared, P, A + (t - tb) * nb, r, t, 1, TT);
            for (; t + 2 <= te; t += 2) tile_ix(a, prepared, P, A + (t - tb) * nb, r, t, 1, 2);
            if (t < te) tile_ix(a, prepared, P, A + (t - tb) * nb, r, t, 1, 1);
        }
        r = full && r + 1 == r0 + a->rs ? r0 + TR * a->rs : r + 1;
    }
}

static __attribute__((noinline)) void ix_gemm(gemm_args *a, int prepared, ix_prep *P, ix_act *A, int64_t r0,
                                              int64_t r1, int64_t n_tok, int64_t tokens_per_block) {
    const int64_t nb = a->n / QKK;
    a->rs = (r1 - r0) / TR;
    for (int64_t tb = 0; tb < n_tok; tb += tokens_per_block) {
        int64_t te = tb + tokens_per_block < n_tok ? tb + tokens_per_block : n_tok;
        for (int64_t t = tb; t < te; t++)
            for (int64_t b = 0; b < nb; b++) ix_act_of((const block_q8_K *)X_ROW(a, t) + b, &A[(t - tb) * nb + b]);
        if (prepared) ix_rows(a, 1, P, A, r0, r1, tb, te);
        else ix_rows(a, 0, NULL, A, r0, r1, tb, te);
    }
}

TILE_SCALAR(iq4_xs)
static DEFINE_GEMM(gemm_scalar_iq4_xs, tile_scalar_iq4_xs)

void strata_gemm_iq4_xs(gemm_args *a, int64_t r0, int64_t r1, int64_t n_tok) {
    const int64_t nb = a->n / QKK;
    const int prepared = n_tok >= IX_MIN_TOKENS;
    const int64_t per_block = prepared ? IX_TOKEN_BLOCK : n_tok;
    ix_act *A = aligned_alloc(64, (size_t)(per_block * nb) * sizeof(ix_act));
    ix_prep *P = prepared ? aligned_alloc(64, (size_t)(TR * nb) * sizeof(ix_prep)) : NULL;
    if (A && (P || !prepared)) ix_gemm(a, prepared, P, A, r0, r1, n_tok, per_block);
    else gemm_scalar_iq4_xs(a, r0, r1, n_tok);  // out of memory: slow, but right
    free(A);
    free(P);
}

#endif

/* quants_x86_kx.c — products of the 256-element types that unpack to signed bytes (Q2_K, Q3_K, Q5_K, IQ4_XS,
 * IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) with Q8_K activations, one tile for all of them.
 *
 * Every one of these super-blocks reads as w = d * sc_g * q - dmin * m_g: 8 chunks of 32 byte values q, a 16-bit
 * scale sc_g per group g of 16 values (types with 32-value scales repeat each), and for Q2_K / Q5_K a 16-bit min
 * m_g. The IQ types' odd factors (1/4, 1/8; IQ1's delta of 1/8 becomes values 8q +- 1) go into d. A chunk's dot is
 * vpmaddubsw of |q| with x carrying q's sign (pairs stay within 16 bits: 2 * 127 * 127), then vpmaddwd (or VNNI's
 * vpdpwssd) with the scales; the mins need only the activations' sums of 16 (bsums). 256-bit registers: on the
 * AVX-512 machines we measured (Zen 4), 512-bit integer ops run as two halves, so 256 bits lose little and the
 * same code serves AVX2. Scales and values of each type come from kx_meta / kx_chunk, inlined with a constant
 * type so that each type's tile is its own straight-line code. */
#include <stddef.h>
#include <stdlib.h>
#include "quants_x86.h"

#if defined(__AVX2__)

typedef struct {
    __m256i sc, m;    // 16 x int16: scale and min of each group of 16 values
    float d, dmin;
} kx_meta;

enum { KX_Q2_K, KX_Q3_K, KX_Q5_K, KX_IQ4_XS, KX_IQ3_S, KX_IQ3_XXS, KX_IQ2_XXS, KX_IQ2_XS, KX_IQ2_S, KX_IQ1_S,
       KX_IQ1_M };

static const size_t KX_BLOCK_BYTES[] = {
    sizeof(block_q2_K), sizeof(block_q3_K), sizeof(block_q5_K), sizeof(block_iq4_xs), sizeof(block_iq3_s),
    sizeof(block_iq3_xxs), sizeof(block_iq2_xxs), sizeof(block_iq2_xs), sizeof(block_iq2_s), sizeof(block_iq1_s),
    sizeof(block_iq1_m)};

#define KX_MINS(k) ((k) == KX_Q2_K || (k) == KX_Q5_K)
#define KX_UNSIGNED(k) ((k) == KX_Q2_K || (k) == KX_Q5_K)

// 8 bytes -> 16 x int16, each repeated: the scales of 32-value sub-blocks as scales of 16-value groups.
static inline __m256i twice16(__m128i bytes8) {
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(bytes8, bytes8));
}

static inline __m256i twice16_signed(__m128i bytes8) {
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(bytes8, bytes8));
}

// 32 bytes, each -v where bit k of `bits` is set (byte k).
static inline __m256i negate_where(__m256i v, uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_mask_sub_epi8(v, (__mmask32)bits, _mm256_setzero_si256(), v);
#else
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i m = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    m = _mm256_cmpeq_epi8(_mm256_and_si256(m, bit), bit);  // 0xff where negative
    return _mm256_sub_epi8(_mm256_xor_si256(v, m), m);
#endif
}

// The sign bits of 4 groups of 8 from IQ2/IQ3's 7-bit sign codes at bits 0, 7, 14, 21 (the 8th bit is their parity).
static inline uint32_t ksigns4(uint32_t codes) {
    return strata_ksigns_iq2xs[codes & 127] | (uint32_t)strata_ksigns_iq2xs[(codes >> 7) & 127] << 8 |
           (uint32_t)strata_ksigns_iq2xs[(codes >> 14) & 127] << 16 | (uint32_t)strata_ksigns_iq2xs[(codes >> 21) & 127] << 24;
}

static inline uint32_t load_u32(const void *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

INLINE void kx_meta_of(int k, const void *blk, kx_meta *M) {
    M->m = _mm256_setzero_si256();
    M->dmin = 0.0f;
    if (k == KX_Q2_K) {
        const block_q2_K *B = blk;
        __m128i s = _mm_loadu_si128((const __m128i *)B->scales), low4 = _mm_set1_epi8(0xf);
        M->sc = _mm256_cvtepu8_epi16(_mm_and_si128(s, low4));
        M->m = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), low4));
        M->d = F16(B->d), M->dmin = F16(B->dmin);
    } else if (k == KX_Q3_K) {
        // strata_q3k_scales in registers: nibbles of bytes 0-7 (low ones first), 2-bit fields of bytes 8-11
        const block_q3_K *B = blk;
        const __m128i low4 = _mm_set1_epi8(0xf);
        __m128i v = _mm_loadl_epi64((const __m128i *)B->scales);
        __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(v, low4), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
        __m128i hi = _mm_srlv_epi32(_mm_set1_epi32((int)load_u32(B->scales + 8)), _mm_set_epi32(6, 4, 2, 0));
        hi = _mm_slli_epi16(_mm_and_si128(hi, _mm_set1_epi8(3)), 4);
        M->sc = _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_or_si128(lo, hi), _mm_set1_epi8(32)));
        M->d = F16(B->d);
    } else if (k == KX_Q5_K) {
        const block_q5_K *B = blk;
        uint32_t w[3];
        memcpy(w, B->scales, 12);
        uint64_t sc = (w[0] & 0x3f3f3f3f) | (uint64_t)((w[2] & 0x0f0f0f0f) | ((w[0] >> 2) & 0x30303030)) << 32;
        uint64_t m = (w[1] & 0x3f3f3f3f) | (uint64_t)(((w[2] >> 4) & 0x0f0f0f0f) | ((w[1] >> 2) & 0x30303030)) << 32;
        M->sc = twice16(_mm_cvtsi64_si128((long long)sc));
        M->m = twice16(_mm_cvtsi64_si128((long long)m));
        M->d = F16(B->d), M->dmin = F16(B->dmin);
    } else if (k == KX_IQ4_XS) {
        const block_iq4_xs *B = blk;
        uint32_t lo = load_u32(B->scales_l), hi = B->scales_h;
        // nibble s of lo (as bytes: even sub-blocks low nibbles), 2-bit field s of hi
        uint64_t l8 = 0, h8 = 0;
        for (int s = 0; s < 8; s++) {
            l8 |= (uint64_t)((lo >> (4 * s)) & 0xf) << (8 * s);
            h8 |= (uint64_t)((hi >> (2 * s)) & 3) << (8 * s + 4);
        }
        __m128i sc = _mm_sub_epi8(_mm_cvtsi64_si128((long long)(l8 | h8)), _mm_set1_epi8(32));
        M->sc = twice16_signed(sc);
        M->d = F16(B->d);
    } else if (k == KX_IQ3_S) {
        const block_iq3_s *B = blk;
        uint32_t s4 = load_u32(B->scales);
        uint64_t s8 = 0;
        for (int s = 0; s < 8; s++) s8 |= (uint64_t)(1 + 2 * ((s4 >> (4 * s)) & 0xf)) << (8 * s);
        M->sc = twice16(_mm_cvtsi64_si128((long long)s8));
        M->d = F16(B->d);
    } else if (k == KX_IQ3_XXS || k == KX_IQ2_XXS) {  // 4-bit scale in the top of each sub-block's 32-bit word
        uint64_t s8 = 0;
        for (int s = 0; s < 8; s++) {
            uint32_t word = k == KX_IQ3_XXS ? load_u32(((const block_iq3_xxs *)blk)->aux + 4 * s)
                                            : load_u32(((const block_iq2_xxs *)blk)->qs + 4 * s + 2);
            s8 |= (uint64_t)(1 + 2 * (word >> 28)) << (8 * s);
        }
        M->sc = twice16(_mm_cvtsi64_si128((long long)s8));
        // IQ3_XXS: d (0.5 + s) / 2 = d (2s + 1) / 4; IQ2_XXS: d (0.5 + s) / 4 = d (2s + 1) / 8
        M->d = F16(*(const uint16_t *)blk) * (k == KX_IQ3_XXS ? 0.25f : 0.125f);
    } else if (k == KX_IQ2_XS || k == KX_IQ2_S) {  // 4-bit scales per 16 values, in 8 bytes
        const uint8_t *s = k == KX_IQ2_XS ? ((const block_iq2_xs *)blk)->scales : ((const block_iq2_s *)blk)->scales;
        __m128i b = _mm_loadl_epi64((const __m128i *)s), low4 = _mm_set1_epi8(0xf);
        __m128i g = _mm_unpacklo_epi8(_mm_and_si128(b, low4), _mm_and_si128(_mm_srli_epi16(b, 4), low4));
        M->sc = _mm256_add_epi16(_mm256_slli_epi16(_mm256_cvtepu8_epi16(g), 1), _mm256_set1_epi16(1));
        M->d = F16(*(const uint16_t *)blk) * 0.125f;
    } else if (k == KX_IQ1_S) {  // values 8 g + delta * 8: d (2s + 1) / 8
        const block_iq1_s *B = blk;
        uint64_t s8 = 0;
        for (int s = 0; s < 8; s++) s8 |= (uint64_t)(2 * ((B->qh[s] >> 12) & 7) + 1) << (8 * s);
        M->sc = twice16(_mm_cvtsi64_si128((long long)s8));
        M->d = F16(B->d) * 0.125f;
    } else {  // KX_IQ1_M: 3-bit scales per 16 values
        const block_iq1_m *B = blk;
        uint64_t w;
        memcpy(&w, B->scales, 8);
        int16_t sc[16];
        for (int g = 0; g < 16; g++) sc[g] = (int16_t)(2 * ((w >> (16 * (g / 4) + 3 * (g % 4))) & 7) + 1);
        M->sc = _mm256_loadu_si256((const __m256i *)sc);
        M->d = F16(strata_iq1m_d(B)) * 0.125f;
    }
}

// IQ1's values: grid entries (-1, 0, 1) times 8 plus the group's delta sign (+-1).
static inline __m256i iq1_values(uint64_t g0, uint64_t g1, uint64_t g2, uint64_t g3, __m256i delta) {
    __m256i g = _mm256_set_epi64x((long long)g3, (long long)g2, (long long)g1, (long long)g0);
    // times 8 per byte: a 16-bit shift, dropping the bits that crossed into the next byte
    return _mm256_add_epi8(_mm256_and_si256(_mm256_slli_epi16(g, 3), _mm256_set1_epi8((char)0xf8)), delta);
}

// Values 32c .. 32c + 31 of a super-block, as signed bytes (Q2_K, Q5_K: unsigned, below 32).
INLINE __m256i kx_chunk(int k, const void *blk, int c) {
    const __m256i three = _mm256_set1_epi8(3);
    if (k == KX_Q2_K || k == KX_Q3_K) {
        const uint8_t *qs = k == KX_Q2_K ? ((const block_q2_K *)blk)->qs : ((const block_q3_K *)blk)->qs;
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * (c / 4))),
                                                       2 * (c % 4)), three);
        if (k == KX_Q2_K) return q;
        __m256i hm = _mm256_loadu_si256((const __m256i *)((const block_q3_K *)blk)->hmask);
        __m256i h = _mm256_and_si256(_mm256_srli_epi16(hm, c), _mm256_set1_epi8(1));
        return _mm256_sub_epi8(_mm256_or_si256(q, _mm256_slli_epi16(h, 2)), _mm256_set1_epi8(4));
    }
    if (k == KX_Q5_K) {
        const block_q5_K *B = blk;
        __m256i q = _mm256_loadu_si256((const __m256i *)(B->qs + 32 * (c / 2)));
        q = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0xf));
        __m256i h = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)B->qh), c),
                                     _mm256_set1_epi8(1));
        return _mm256_or_si256(q, _mm256_slli_epi16(h, 4));
    }
    if (k == KX_IQ4_XS) {
        const block_iq4_xs *B = blk;
        __m128i v = _mm_loadu_si128((const __m128i *)(B->qs + 16 * c)), low4 = _mm_set1_epi8(0xf);
        __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
        return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_IQ4NL)), idx);
    }
    if (k == KX_IQ3_S) {
        const block_iq3_s *B = blk;
#if defined(__AVX512F__)
        // the 8 indices (qs[i] plus bit i of qh as bit 8) in lanes, and one gather: fewer instructions than 8
        // scalar loads and inserts, which bound the decode product
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(B->qs + 8 * c)));
        __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32(B->qh[c]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        idx = _mm256_or_si256(idx, _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)), 8));
        __m256i q = _mm256_i32gather_epi32((const int *)strata_iq3s_grid, idx, 4);
#else
        const uint8_t *qs = B->qs + 8 * c;
        unsigned qh = B->qh[c];
        __m256i q = _mm256_set_epi32(
            (int)strata_iq3s_grid[qs[7] | ((qh << 1) & 256)], (int)strata_iq3s_grid[qs[6] | ((qh << 2) & 256)],
            (int)strata_iq3s_grid[qs[5] | ((qh << 3) & 256)], (int)strata_iq3s_grid[qs[4] | ((qh << 4) & 256)],
            (int)strata_iq3s_grid[qs[3] | ((qh << 5) & 256)], (int)strata_iq3s_grid[qs[2] | ((qh << 6) & 256)],
            (int)strata_iq3s_grid[qs[1] | ((qh << 7) & 256)], (int)strata_iq3s_grid[qs[0] | ((qh << 8) & 256)]);
#endif
        return negate_where(q, load_u32(B->signs + 4 * c));
    }
    if (k == KX_IQ3_XXS) {
        const block_iq3_xxs *B = blk;
        const uint8_t *qs = B->qs + 8 * c;
        __m256i q = _mm256_set_epi32((int)strata_iq3xxs_grid[qs[7]], (int)strata_iq3xxs_grid[qs[6]],
                                     (int)strata_iq3xxs_grid[qs[5]], (int)strata_iq3xxs_grid[qs[4]],
                                     (int)strata_iq3xxs_grid[qs[3]], (int)strata_iq3xxs_grid[qs[2]],
                                     (int)strata_iq3xxs_grid[qs[1]], (int)strata_iq3xxs_grid[qs[0]]);
        return negate_where(q, ksigns4(load_u32(B->aux + 4 * c)));
    }
    if (k == KX_IQ2_XXS) {
        const block_iq2_xxs *B = blk;
        uint32_t idx = load_u32(B->qs + 4 * c), codes = load_u32(B->qs + 4 * c + 2);
        __m256i q = _mm256_set_epi64x((long long)strata_iq2xxs_grid[idx >> 24],
                                      (long long)strata_iq2xxs_grid[(idx >> 16) & 0xff],
                                      (long long)strata_iq2xxs_grid[(idx >> 8) & 0xff],
                                      (long long)strata_iq2xxs_grid[idx & 0xff]);
        return negate_where(q, ksigns4(codes));
    }
    if (k == KX_IQ2_XS) {
        const uint16_t *qs = ((const block_iq2_xs *)blk)->qs + 4 * c;
        __m256i q = _mm256_set_epi64x((long long)strata_iq2xs_grid[qs[3] & 511], (long long)strata_iq2xs_grid[qs[2] & 511],
                                      (long long)strata_iq2xs_grid[qs[1] & 511], (long long)strata_iq2xs_grid[qs[0] & 511]);
        uint32_t signs = strata_ksigns_iq2xs[qs[0] >> 9] | (uint32_t)strata_ksigns_iq2xs[qs[1] >> 9] << 8 |
                         (uint32_t)strata_ksigns_iq2xs[qs[2] >> 9] << 16 | (uint32_t)strata_ksigns_iq2xs[qs[3] >> 9] << 24;
        return negate_where(q, signs);
    }
    if (k == KX_IQ2_S) {
        const block_iq2_s *B = blk;
        const uint8_t *qs = B->qs + 4 * c;
        unsigned qh = B->qh[c];
        __m256i q = _mm256_set_epi64x((long long)strata_iq2s_grid[qs[3] | ((qh << 2) & 0x300)],
                                      (long long)strata_iq2s_grid[qs[2] | ((qh << 4) & 0x300)],
                                      (long long)strata_iq2s_grid[qs[1] | ((qh << 6) & 0x300)],
                                      (long long)strata_iq2s_grid[qs[0] | ((qh << 8) & 0x300)]);
        return negate_where(q, load_u32(B->signs + 4 * c));
    }
    if (k == KX_IQ1_S) {
        const block_iq1_s *B = blk;
        const uint8_t *qs = B->qs + 4 * c;
        unsigned qh = B->qh[c];
        __m256i delta = _mm256_set1_epi8(qh & 0x8000 ? -1 : 1);
        return iq1_values(strata_iq1s_grid[qs[0] | (qh & 7) << 8], strata_iq1s_grid[qs[1] | ((qh >> 3) & 7) << 8],
                          strata_iq1s_grid[qs[2] | ((qh >> 6) & 7) << 8],
                          strata_iq1s_grid[qs[3] | ((qh >> 9) & 7) << 8], delta);
    }
    // KX_IQ1_M: a 4-bit field per group of 8: 3 index bits, the delta's sign
    const block_iq1_m *B = blk;
    const uint8_t *qs = B->qs + 4 * c;
    unsigned h0 = B->qh[2 * c], h1 = B->qh[2 * c + 1];
    const long long plus = 0x0101010101010101LL, minus = -1LL;  // bytes of +1, of -1
    __m256i delta = _mm256_set_epi64x(h1 & 0x80 ? minus : plus, h1 & 0x08 ? minus : plus, h0 & 0x80 ? minus : plus,
                                      h0 & 0x08 ? minus : plus);
    return iq1_values(strata_iq1s_grid[qs[0] | (h0 & 7) << 8], strata_iq1s_grid[qs[1] | ((h0 >> 4) & 7) << 8],
                      strata_iq1s_grid[qs[2] | (h1 & 7) << 8], strata_iq1s_grid[qs[3] | ((h1 >> 4) & 7) << 8], delta);
}

// The scales of chunk c in the 16-bit lanes of its pair products: groups 2c (lanes 0-7) and 2c + 1 (8-15).
static inline __m256i chunk_scales(__m256i sc, int c) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_permutexvar_epi16(_mm256_set_m128i(_mm_set1_epi16((short)(2 * c + 1)), _mm_set1_epi16((short)(2 * c))),
                                    sc);
#else
    __m256i half = _mm256_permute2x128_si256(sc, sc, c < 4 ? 0x00 : 0x11);
    return _mm256_shuffle_epi8(half, _mm256_set_m128i(pick16((2 * c + 1) % 8), pick16((2 * c) % 8)));
#endif
}

// Signed values become unsigned by an offset where |q| is small enough for vpmaddubsw's 16-bit pairs
// (2 * (2o) * 127 < 2^15), so x needs no sign moved onto it; the offset comes back as o * sum_g sc_g * bsum_g.
// IQ4_XS's values reach -127: it keeps |q| and the sign on x.
static inline int kx_offset(int k) {
    return k == KX_Q3_K ? 4 : k == KX_IQ3_S ? 15 : k == KX_IQ3_XXS ? 62 : k == KX_IQ1_S || k == KX_IQ1_M ? 9
         : k == KX_IQ2_XXS || k == KX_IQ2_XS || k == KX_IQ2_S ? 43 : 0;
}

// A row's super-block unpacked once for many tokens (prompts): kx_chunk's values and kx_meta.
typedef struct {
    int8_t q[QKK];
    __m256i sc, m;
    float d, dmin;
} __attribute__((aligned(32))) kx_prep;

#define KX_MIN_TOKENS 16  // with fewer tokens, each tile unpacks its blocks itself

// The types whose prompts take tile_kb (rows in the lanes) and whose direct tile ends in kb_steps. The others keep
// kx_prep and tile_kx's own f32 lanes.
#if defined(KQ_PREPARED)
#define KX_KQ(k) ((k) == KX_Q2_K || (k) == KX_Q3_K || (k) == KX_Q5_K || (k) == KX_IQ3_S || (k) == KX_IQ1_S || \
                  (k) == KX_IQ1_M)
#else
#define KX_KQ(k) 0
#endif

static void kx_prepare(int k, const void *blk, kx_prep *P) {
    kx_meta M;
    kx_meta_of(k, blk, &M);
    P->sc = M.sc, P->m = M.m, P->d = M.d, P->dmin = M.dmin;
    for (int c = 0; c < 8; c++) _mm256_store_si256((__m256i *)(P->q + 32 * c), kx_chunk(k, blk, c));
}

// Rows from their blocks, or (P not NULL) from kx_prep rows nb blocks apart.
INLINE void tile_kx(int k, const gemm_args *a, const kx_prep *P, int64_t r, int64_t t, int NR, int NT) {
    const char *w[TR] = {0};
    const block_q8_K *x[TT] = {0};  // all set for the NR, NT in use; initialised for the compiler's sake
    __m256 acc[TR][TT];
    __m128 acc4[TT];  // KX_KQ: rows in the lanes
    const int o = kx_offset(k);
    const int64_t nb = a->n / QKK;
    UNROLL for (int i = 0; i < NR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i));
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j), acc4[j] = _mm_setzero_ps();
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m128i part[TR][TT] = {0};  // KX_KQ: kb_part's, per row and token
        float d[TR] = {0}, dmin[TR] = {0};
        UNROLL for (int i = 0; i < NR; i++) {
            const void *B = w[i] + b * KX_BLOCK_BYTES[k];
            const kx_prep *p = P ? &P[i * nb + b] : NULL;
            kx_meta M;
            if (p) M.sc = p->sc, M.m = p->m, M.d = p->d, M.dmin = p->dmin;
            else kx_meta_of(k, B, &M);
            d[i] = M.d, dmin[i] = M.dmin;
            // KX_KQ: two chains of sums, half as long (their order does not matter)
            __m256i isum[2][TT];
            UNROLL for (int j = 0; j < TT; j++) isum[0][j] = isum[1][j] = _mm256_setzero_si256();  // TT: quiets GCC
            _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {
                const int half = KX_KQ(k) && c % 2;
                __m256i q = p ? _mm256_load_si256((const __m256i *)(p->q + 32 * c)) : kx_chunk(k, B, c);
                __m256i u = KX_UNSIGNED(k) ? q : o ? _mm256_add_epi8(q, _mm256_set1_epi8((char)o)) : _mm256_abs_epi8(q);
                __m256i s = chunk_scales(M.sc, c);
                UNROLL for (int j = 0; j < NT; j++) {
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(x[j][b].qs + 32 * c));
                    if (!KX_UNSIGNED(k) && !o) xv = _mm256_sign_epi8(xv, q);
                    isum[half][j] = dot_s16(isum[half][j], _mm256_maddubs_epi16(u, xv), s);
                }
            }
            __m256i osc = _mm256_mullo_epi16(M.sc, _mm256_set1_epi16((short)-o));
            UNROLL for (int j = 0; j < NT; j++) {
                __m256i sum = KX_KQ(k) ? _mm256_add_epi32(isum[0][j], isum[1][j]) : isum[0][j];
                if (KX_KQ(k)) {
                    __m256i bs = _mm256_loadu_si256((const __m256i *)x[j][b].bsums);
                    if (o) sum = dot_s16(sum, osc, bs);
                    part[i][j] = kb_part(sum, KX_MINS(k) ? _mm256_madd_epi16(M.m, bs) : _mm256_setzero_si256());
                    continue;
                }
                if (KX_MINS(k) || o) {
                    __m256i bs = _mm256_loadu_si256((const __m256i *)x[j][b].bsums);
                    if (o) sum = dot_s16(sum, osc, bs);
                    if (KX_MINS(k))
                        acc[i][j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(M.m, bs)),
                                                     _mm256_set1_ps(M.dmin * x[j][b].d), acc[i][j]);
                }
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(M.d * x[j][b].d), acc[i][j]);
            }
        }
        if (KX_KQ(k)) {
            __m128 d4 = _mm_setr_ps(d[0], d[1], d[2], d[3]), dmin4 = _mm_setr_ps(dmin[0], dmin[1], dmin[2], dmin[3]);
            UNROLL for (int j = 0; j < NT; j++)
                acc4[j] = kb_steps(KX_MINS(k), acc4[j], part[0][j], part[1][j], part[2][j], part[3][j], d4, dmin4,
                                   x[j][b].d);
        }
    }
    if (KX_KQ(k)) {
        store_rows4(a, r, t, NR, NT, acc4);
    } else {
        store_tile(a, r, t, NR, NT, acc);
    }
}

#if defined(KQ_PREPARED) && defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#define IQ3S_PLANES 1
// IQ3_S's direct tiles (decode) without a table load per grid entry: a super-block's 64 indices sit in one register
// and each byte of their grid entries comes from the byte planes of the grid (strata_iq3s_planes) by 4 vpermt2b
// (128 entries each: index bits 0-6), picked between by index bit 7 and then bit 8 (qh, as it is, a 64-bit mask).
// A gather per 32 values, or 8 scalar loads, bound the decode product; this takes 2.3x less time per block.
// Interleaving the 4 planes' bytes per 128-bit lane leaves register m, lane L with values 64L + 16m .. + 15; the
// activations are put in that order (a 4 x 4 transpose of their 128-bit lanes, once per token and block) and the
// sign bits by vpshufbitqmb. The integer sum of each row and block, and the f32 steps after it, are kb_steps':
// a token's outputs are the bits the bands give it.
INLINE void tile_iq3s_planes(const gemm_args *a, int64_t r, int64_t t, int NR, int NT) {
    const char *w[TR] = {0};
    const block_q8_K *x[TT] = {0};
    __m128 acc4[TT];
    const int64_t nb = a->n / QKK;
    const __m512i *plane = (const __m512i *)strata_iq3s_planes;  // 8 registers' worth per plane
    UNROLL for (int i = 0; i < NR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i));
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j), acc4[j] = _mm_setzero_ps();
    // register m's sign bits: byte 16L + e of the mask selects bit 16m + e of the signs of values 64L ..
    const __m512i e16 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    // lane L: scale byte L in every 16-bit element
    const __m512i pick = _mm512_set_epi32((int)0x80038003, (int)0x80038003, (int)0x80038003, (int)0x80038003,
                                          (int)0x80028002, (int)0x80028002, (int)0x80028002, (int)0x80028002,
                                          (int)0x80018001, (int)0x80018001, (int)0x80018001, (int)0x80018001,
                                          (int)0x80008000, (int)0x80008000, (int)0x80008000, (int)0x80008000);
    for (int64_t b = 0; b < nb; b++) {
        __m512i xt[TT][4];
        UNROLL for (int j = 0; j < NT; j++) {
            const int8_t *q8 = x[j][b].qs;
            __m512i x0 = _mm512_loadu_si512(q8), x1 = _mm512_loadu_si512(q8 + 64);
            __m512i x2 = _mm512_loadu_si512(q8 + 128), x3 = _mm512_loadu_si512(q8 + 192);
            __m512i t0 = _mm512_shuffle_i64x2(x0, x1, 0x44), t1 = _mm512_shuffle_i64x2(x0, x1, 0xee);
            __m512i t2 = _mm512_shuffle_i64x2(x2, x3, 0x44), t3 = _mm512_shuffle_i64x2(x2, x3, 0xee);
            xt[j][0] = _mm512_shuffle_i64x2(t0, t2, 0x88), xt[j][1] = _mm512_shuffle_i64x2(t0, t2, 0xdd);
            xt[j][2] = _mm512_shuffle_i64x2(t1, t3, 0x88), xt[j][3] = _mm512_shuffle_i64x2(t1, t3, 0xdd);
        }
        __m512i isum[TR][TT];
        float d[TR] = {0};
        UNROLL for (int i = 0; i < NR; i++) {
            const block_iq3_s *B = (const block_iq3_s *)w[i] + b;
            d[i] = F16(B->d);
            __m512i idx = _mm512_loadu_si512(B->qs);
            uint64_t qh;
            memcpy(&qh, B->qh, 8);
            __mmask64 bit7 = _mm512_movepi8_mask(idx), bit8 = (__mmask64)qh;
            __m512i p[4];
            for (int k = 0; k < 4; k++) {
                const __m512i *T = plane + 8 * k;
                __m512i q0 = _mm512_permutex2var_epi8(T[0], idx, T[1]), q1 = _mm512_permutex2var_epi8(T[2], idx, T[3]);
                __m512i q2 = _mm512_permutex2var_epi8(T[4], idx, T[5]), q3 = _mm512_permutex2var_epi8(T[6], idx, T[7]);
                p[k] = _mm512_mask_blend_epi8(bit8, _mm512_mask_blend_epi8(bit7, q0, q1), _mm512_mask_blend_epi8(bit7, q2, q3));
            }
            __m512i p01l = _mm512_unpacklo_epi8(p[0], p[1]), p01h = _mm512_unpackhi_epi8(p[0], p[1]);
            __m512i p23l = _mm512_unpacklo_epi8(p[2], p[3]), p23h = _mm512_unpackhi_epi8(p[2], p[3]);
            const __m512i q[4] = {_mm512_unpacklo_epi16(p01l, p23l), _mm512_unpackhi_epi16(p01l, p23l),
                                  _mm512_unpacklo_epi16(p01h, p23h), _mm512_unpackhi_epi16(p01h, p23h)};
            // the signs of values 64L .. 64L + 63 in 64-bit elements 2L and 2L + 1
            __m512i sg = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 0, 1, 1, 2, 2, 3, 3),
                                                  _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)B->signs)));
            // register m, lane L belongs to sub-block 2L + m / 2: the low nibble of scales[L] for m < 2, else the high
            __m512i sw = _mm512_shuffle_epi8(_mm512_set1_epi32((int)load_u32(B->scales)), pick), one = _mm512_set1_epi16(1);
            __m512i sc_lo = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(sw, _mm512_set1_epi16(15)), 1), one);
            __m512i sc_hi = _mm512_or_si512(_mm512_slli_epi16(_mm512_srli_epi16(sw, 4), 1), one);
            UNROLL for (int j = 0; j < NT; j++) isum[i][j] = _mm512_setzero_si512();
            UNROLL for (int m = 0; m < 4; m++) {
                __mmask64 neg = _mm512_bitshuffle_epi64_mask(sg, _mm512_add_epi8(e16, _mm512_set1_epi8((char)(16 * m))));
                UNROLL for (int j = 0; j < NT; j++) {
                    __m512i xv = _mm512_mask_sub_epi8(xt[j][m], neg, _mm512_setzero_si512(), xt[j][m]);
                    isum[i][j] = _mm512_dpwssd_epi32(isum[i][j], _mm512_maddubs_epi16(q[m], xv), m < 2 ? sc_lo : sc_hi);
                }
            }
        }
        // kb_part and kb_steps' sums and steps, 4 rows in the lanes (rows past NR: 0)
        __m128 d4 = _mm_setr_ps(d[0], d[1], d[2], d[3]);
        UNROLL for (int j = 0; j < NT; j++) {
            __m512i s[TR];
            UNROLL for (int i = 0; i < TR; i++) s[i] = i < NR ? isum[i][j] : _mm512_setzero_si512();
            __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[0], s[1]), _mm512_unpackhi_epi32(s[0], s[1]));
            __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2], s[3]), _mm512_unpackhi_epi32(s[2], s[3]));
            __m512i s4 = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
            __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s4), _mm512_extracti64x4_epi64(s4, 1));
            __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            acc4[j] = _mm_fmadd_ps(_mm_cvtepi32_ps(sum), _mm_mul_ps(d4, _mm_set1_ps(x[j][b].d)), acc4[j]);
        }
    }
    store_rows4(a, r, t, NR, NT, acc4);
}
#else
#define IQ3S_PLANES 0
#define tile_iq3s_planes(a, r, t, NR, NT) ((void)0)
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KX_PREP512 1
// The prepared rows with 512-bit registers: two chunks (64 values) per instruction. Half the instructions of
// tile_kx, which is what a prompt's inner loop is bound by (Zen 4 splits the 512-bit ops, but not the decoding).
INLINE void tile_kx_prep512(int k, const gemm_args *a, const kx_prep *P, int64_t r, int64_t t, int NR, int NT) {
    const block_q8_K *x[TT] = {0};
    __m256 acc[TR][TT];
    const int o = kx_offset(k);
    const int64_t nb = a->n / QKK;
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j);
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        UNROLL for (int i = 0; i < NR; i++) {
            const kx_prep *p = &P[i * nb + b];
            __m512i sc = _mm512_castsi256_si512(p->sc), isum[TT];
            UNROLL for (int j = 0; j < NT; j++) isum[j] = _mm512_setzero_si512();
            UNROLL for (int h = 0; h < 4; h++) {
                __m512i q = _mm512_loadu_si512(p->q + 64 * h);
                __m512i u = KX_UNSIGNED(k) ? q : o ? _mm512_add_epi8(q, _mm512_set1_epi8((char)o)) : _mm512_abs_epi8(q);
                __mmask64 neg = _mm512_movepi8_mask(q);
                // 16-bit lanes 8g' .. 8g' + 7 of the pair products belong to group 4h + g'
                __m512i s = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_set1_epi16((short)(4 * h)),
                    _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                                       15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3)), sc);
                UNROLL for (int j = 0; j < NT; j++) {
                    __m512i xv = _mm512_loadu_si512(x[j][b].qs + 64 * h);
                    if (!KX_UNSIGNED(k) && !o) xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                    isum[j] = _mm512_dpwssd_epi32(isum[j], _mm512_maddubs_epi16(u, xv), s);
                }
            }
            // from here on as tile_kx, op for op: the halves' sum is its integer sum, lane for lane
            UNROLL for (int j = 0; j < NT; j++) {
                __m256i sum = _mm256_add_epi32(_mm512_castsi512_si256(isum[j]), _mm512_extracti64x4_epi64(isum[j], 1));
                if (KX_MINS(k) || o) {
                    __m256i bs = _mm256_loadu_si256((const __m256i *)x[j][b].bsums);
                    if (o) sum = dot_s16(sum, _mm256_mullo_epi16(p->sc, _mm256_set1_epi16((short)-o)), bs);
                    if (KX_MINS(k))
                        acc[i][j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p->m, bs)),
                                                     _mm256_set1_ps(p->dmin * x[j][b].d), acc[i][j]);
                }
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(p->d * x[j][b].d), acc[i][j]);
            }
        }
    }
    store_tile(a, r, t, NR, NT, acc);
}
#define KX_PREPARED_TILE(k, a, P, r, t, NR, NT) tile_kx_prep512(k, a, P, r, t, NR, NT)
#else
#define KX_PREPARED_TILE(k, a, P, r, t, NR, NT) tile_kx(k, a, P, r, t, NR, NT)
#endif

#if defined(KQ_PREPARED)
// A KX_KQ row's super-block for a band (kb_prepare): values + offset, and its scales.
INLINE void kx_unpack(int k, const void *blk, uint8_t *u, __m256i *sc, __m256i *m, float *d, float *dmin) {
    kx_meta M;
    kx_meta_of(k, blk, &M);
    *sc = M.sc, *m = M.m, *d = M.d, *dmin = M.dmin;
    for (int c = 0; c < 8; c++)
        _mm256_store_si256((__m256i *)(u + 32 * c), _mm256_add_epi8(kx_chunk(k, blk, c), _mm256_set1_epi8((char)kx_offset(k))));
}
#endif

// Rows [r0, r1) (tiles as DEFINE_GEMM's) against tokens [tb, te), each tile of rows unpacked into P first.
INLINE void kx_prepared_rows(int k, gemm_args *a, void *P, int64_t r0, int64_t r1, int64_t tb, int64_t te) {
    int64_t nb = a->n / QKK;
    for (int64_t r = r0; r < r1;) {
        int full = r < r0 + a->rs;  // a tile of TR rows rs apart, else one of the last rows
        for (int i = 0; i < (full ? TR : 1); i++)
            for (int64_t b = 0; b < nb; b++)
                kx_prepare(k, (const char *)W_ROW(a, TILE_ROW(a, r, i)) + b * KX_BLOCK_BYTES[k], (kx_prep *)P + i * nb + b);
        int64_t t = tb;
        if (full) {
            for (; t + TT <= te; t += TT) KX_PREPARED_TILE(k, a, P, r, t, TR, TT);
            for (; t < te; t++) KX_PREPARED_TILE(k, a, P, r, t, TR, 1);
        } else {
            for (; t + TT <= te; t += TT) KX_PREPARED_TILE(k, a, P, r, t, 1, TT);
            for (; t < te; t++) KX_PREPARED_TILE(k, a, P, r, t, 1, 1);
        }
        r = full && r + 1 == r0 + a->rs ? r0 + TR * a->rs : r + 1;
    }
}

// --- blocks of 32 with Q8_0 activations: IQ4_NL, MXFP4 (a 16-entry table), Q5_0 (signed 5 bits), Q4_1 and Q5_1
// (unsigned, plus a min times the block's activation sum). One block per 256-bit register; vpmaddubsw of |q| with
// x carrying q's sign, summed to 32 bits and scaled in f32 per block.
enum { B32_IQ4_NL, B32_MXFP4, B32_Q5_0, B32_Q4_1, B32_Q5_1 };

static const size_t B32_BLOCK_BYTES[] = {sizeof(block_iq4_nl), sizeof(block_mxfp4), sizeof(block_q5_0),
                                         sizeof(block_q4_1), sizeof(block_q5_1)};

#define B32_MIN(k) ((k) == B32_Q4_1 || (k) == B32_Q5_1)

// The 32 values of a block as bytes (signed, or unsigned for Q4_1 / Q5_1), its scale and (Q4_1 / Q5_1) min.
INLINE __m256i b32_values(int k, const void *blk, float *d, float *m) {
    const uint8_t *qs = k == B32_IQ4_NL ? ((const block_iq4_nl *)blk)->qs : k == B32_MXFP4 ? ((const block_mxfp4 *)blk)->qs
                      : k == B32_Q5_0 ? ((const block_q5_0 *)blk)->qs : k == B32_Q4_1 ? ((const block_q4_1 *)blk)->qs
                      : ((const block_q5_1 *)blk)->qs;
    __m128i v = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0xf);
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
    *m = 0.0f;
    if (k == B32_IQ4_NL || k == B32_MXFP4) {
        const int8_t *table = k == B32_IQ4_NL ? KVALUES_IQ4NL : KVALUES_MXFP4;
        *d = k == B32_IQ4_NL ? F16(((const block_iq4_nl *)blk)->d) : strata_e8m0_half(((const block_mxfp4 *)blk)->e);
        return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table)), q);
    }
    if (k == B32_Q4_1) {
        const block_q4_1 *B = blk;
        *d = F16(B->d), *m = F16(B->m);
        return q;
    }
    // Q5_0, Q5_1: bit j of qh is element j's fifth bit
    const uint8_t *qh = k == B32_Q5_0 ? ((const block_q5_0 *)blk)->qh : ((const block_q5_1 *)blk)->qh;
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)load_u32(qh)), spread);
    h = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), _mm256_set1_epi8(16));
    q = _mm256_or_si256(q, h);
    if (k == B32_Q5_0) {
        *d = F16(((const block_q5_0 *)blk)->d);
        return _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    }
    const block_q5_1 *B = blk;
    *d = F16(B->d), *m = F16(B->m);
    return q;
}

#if defined(VNNI512)
// 512-bit, as tile_q4_0: four blocks per register, elements 0-15 of each in one (128-bit lane l: block b + l),
// 16-31 in another, the activations loaded in the same order. The values become unsigned bytes u = q + o
// (o = 128 for the tables, 16 for Q5_0, none for Q4_1 / Q5_1) so that vpdpbusd takes them, and -o * sum(x)
// seeds each token's integer accumulator; Q4_1 / Q5_1 add m * da * sum(x) per block instead.
#define B32_OFFSET(k) ((k) == B32_IQ4_NL || (k) == B32_MXFP4 ? 128 : (k) == B32_Q5_0 ? 16 : 0)
#define B32_PREFETCH 2048  // as Q8_PREFETCH: decode streams TR rows, ahead of the hardware prefetchers

// The four blocks' scales (f16 at byte `at` of each block, or MXFP4's exponents), 4 lanes each; blocks from n on
// (padding) get 0.
INLINE __m512 b32_scales4(int k, const char *const blk[4], int n, size_t at) {
    const __m512i quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    if (k == B32_MXFP4) {  // strata_e8m0_half in lanes: (e - 1) << 23, or for e < 2 the subnormal 2^21 << e
        __m128i e = _mm_setr_epi32(((const block_mxfp4 *)blk[0])->e, ((const block_mxfp4 *)blk[1])->e,
                                   ((const block_mxfp4 *)blk[2])->e, ((const block_mxfp4 *)blk[3])->e);
        __m128i normal = _mm_slli_epi32(_mm_sub_epi32(e, _mm_set1_epi32(1)), 23);
        __m128i small = _mm_sllv_epi32(_mm_set1_epi32(0x00200000), e);
        __m128i bits = _mm_blendv_epi8(normal, small, _mm_cmplt_epi32(e, _mm_set1_epi32(2)));
        bits = _mm_and_si128(bits, _mm_cmplt_epi32(_mm_setr_epi32(0, 1, 2, 3), _mm_set1_epi32(n)));  // padding: 0
        return _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_castsi128_ps(bits)));
    }
    const uint16_t *h[4];
    for (int l = 0; l < 4; l++) h[l] = l < n ? (const uint16_t *)(blk[l] + at) : &ZERO_F16;
    return f16_quad(h[0], h[1], h[2], h[3]);
}

// Elements 0-15 (lo) and 16-31 (hi) of the four blocks as the unsigned bytes u.
INLINE void b32_values4(int k, const char *const blk[4], __m512i *lo, __m512i *hi) {
    const size_t qs = k == B32_IQ4_NL ? offsetof(block_iq4_nl, qs) : k == B32_MXFP4 ? offsetof(block_mxfp4, qs)
                    : k == B32_Q5_0 ? offsetof(block_q5_0, qs) : k == B32_Q4_1 ? offsetof(block_q4_1, qs)
                    : offsetof(block_q5_1, qs);
    const __m512i low4 = _mm512_set1_epi8(0xf);
    __m512i raw = load_4x128(blk[0] + qs, blk[1] + qs, blk[2] + qs, blk[3] + qs);
    *lo = _mm512_and_si512(raw, low4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    if (k == B32_IQ4_NL || k == B32_MXFP4) {
        const int8_t *v = k == B32_IQ4_NL ? KVALUES_IQ4NL : KVALUES_MXFP4;
        __m128i t = _mm_xor_si128(_mm_loadu_si128((const __m128i *)v), _mm_set1_epi8((char)0x80));  // q + 128
        __m512i table = _mm512_broadcast_i32x4(t);
        *lo = _mm512_shuffle_epi8(table, *lo);
        *hi = _mm512_shuffle_epi8(table, *hi);
    } else if (k == B32_Q5_0 || k == B32_Q5_1) {  // bit j of qh is element j's fifth bit
        const size_t qh = k == B32_Q5_0 ? offsetof(block_q5_0, qh) : offsetof(block_q5_1, qh);
        uint64_t mlo = 0, mhi = 0;
        for (int l = 0; l < 4; l++) {
            uint32_t h = load_u32(blk[l] + qh);
            mlo |= (uint64_t)(h & 0xffff) << (16 * l);
            mhi |= (uint64_t)(h >> 16) << (16 * l);
        }
        const __m512i sixteen = _mm512_set1_epi8(16);
        *lo = _mm512_mask_add_epi8(*lo, (__mmask64)mlo, *lo, sixteen);
        *hi = _mm512_mask_add_epi8(*hi, (__mmask64)mhi, *hi, sixteen);
    }
}

INLINE void tile_b32(int k, const gemm_args *a, int64_t r, int64_t t, int NR, int NT) {
    const char *w[TR] = {0};
    const block_q8_0 *x[TT] = {0};
    __m512 acc[TR][TT];
    const __m512i offset = _mm512_set1_epi8((char)B32_OFFSET(k)), ones = _mm512_set1_epi8(1);
    const size_t bb = B32_BLOCK_BYTES[k];
    UNROLL for (int i = 0; i < NR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i));
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j);
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t nb = a->n / QK;
    for (int64_t b = 0; b < nb; b += 4) {
        int64_t bk[4];  // past the last block, repeat it with its activation scale zeroed
        for (int l = 0; l < 4; l++) bk[l] = b + l < nb ? b + l : nb - 1;
        const int n = nb - b < 4 ? (int)(nb - b) : 4;
        __m512i xlo[TT], xhi[TT], seed[TT];
        __m512 dx[TT], xsum[TT];
        UNROLL for (int j = 0; j < NT; j++) {
            const block_q8_0 *X0 = &x[j][bk[0]], *X1 = &x[j][bk[1]], *X2 = &x[j][bk[2]], *X3 = &x[j][bk[3]];
            xlo[j] = load_4x128(X0->qs, X1->qs, X2->qs, X3->qs);
            xhi[j] = load_4x128(X0->qs + 16, X1->qs + 16, X2->qs + 16, X3->qs + 16);
            dx[j] = f16_quad(&X0->d, n > 1 ? &X1->d : &ZERO_F16, n > 2 ? &X2->d : &ZERO_F16,
                             n > 3 ? &X3->d : &ZERO_F16);
            __m512i zero = _mm512_setzero_si512();
            if (B32_OFFSET(k))
                seed[j] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, offset, xlo[j]),
                                                                     offset, xhi[j]));
            else
                seed[j] = zero;
            if (B32_MIN(k))  // da * each lane's share of the block's activation sum
                xsum[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, ones, xlo[j]),
                                                                               ones, xhi[j])), dx[j]);
        }
        UNROLL for (int i = 0; i < NR; i++) {
            const char *W[4] = {w[i] + bk[0] * bb, w[i] + bk[1] * bb, w[i] + bk[2] * bb, w[i] + bk[3] * bb};
            if (NT == 1) _mm_prefetch(W[0] + B32_PREFETCH, _MM_HINT_T0);
            __m512i lo, hi;
            b32_values4(k, W, &lo, &hi);
            __m512 dw = b32_scales4(k, W, 4, 0), m = B32_MIN(k) ? b32_scales4(k, W, 4, 2) : dw;  // m after d
            UNROLL for (int j = 0; j < NT; j++) {
                __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(seed[j], lo, xlo[j]), hi, xhi[j]);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx[j]), acc[i][j]);
                if (B32_MIN(k)) acc[i][j] = _mm512_fmadd_ps(m, xsum[j], acc[i][j]);
            }
        }
    }
    store_tile512(a, r, t, NR, NT, acc);
}
#else
INLINE void tile_b32(int k, const gemm_args *a, int64_t r, int64_t t, int NR, int NT) {
    const char *w[TR] = {0};
    const block_q8_0 *x[TT] = {0};
    __m256 acc[TR][TT];
    const __m256i ones = _mm256_set1_epi8(1);
    UNROLL for (int i = 0; i < NR; i++) w[i] = W_ROW(a, TILE_ROW(a, r, i));
    UNROLL for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j);
    UNROLL for (int i = 0; i < NR; i++)
        UNROLL for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->n / QK; b++) {
        __m256i xv[TT];
        __m256 dx[TT], xsum[TT];
        UNROLL for (int j = 0; j < NT; j++) {
            xv[j] = _mm256_loadu_si256((const __m256i *)x[j][b].qs);
            dx[j] = f16_bcast(&x[j][b].d);
            if (B32_MIN(k))  // da * the block's activation sum, for the min
                xsum[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(dot_u8s8(_mm256_setzero_si256(), ones, xv[j])), dx[j]);
        }
        UNROLL for (int i = 0; i < NR; i++) {
            float d, m;
            __m256i q = b32_values(k, w[i] + b * B32_BLOCK_BYTES[k], &d, &m);
            __m256i u = B32_MIN(k) ? q : _mm256_abs_epi8(q);
            __m256 dw = _mm256_set1_ps(d);
            UNROLL for (int j = 0; j < NT; j++) {
                __m256i s = dot_u8s8(_mm256_setzero_si256(), u, B32_MIN(k) ? xv[j] : _mm256_sign_epi8(xv[j], q));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx[j]), acc[i][j]);
                if (B32_MIN(k)) acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(m), xsum[j], acc[i][j]);  // lanes sum to m * da * sum(x)
            }
        }
    }
    store_tile(a, r, t, NR, NT, acc);
}

#endif

#define B32_GEMM(t, K) \
    static inline void tile_##t(const gemm_args *a, int64_t r, int64_t tk, int NR, int NT) { \
        tile_b32(K, a, r, tk, NR, NT); \
    } \
    DEFINE_GEMM(strata_gemm_##t, tile_##t)

// Per type: decode-shaped products tile straight from the blocks; with KX_MIN_TOKENS or more tokens, each tile of
// rows is unpacked once per block of tokens. The grid types' decode tiles after IQ3_S (whose table lookups are byte
// permutes, or without VBMI one gather per chunk) keep the (never taken) prepared branch: without it GCC scheduled
// IQ3_S's 64 table loads per block worse (3.5 ms instead of 3.1 when it had them).
#define KX_NO_BANDS(t, K, a, r0, r1, n_tok) 0
#define KX_BANDS(t, K, a, r0, r1, n_tok) \
    gemm_kb(kb_unpack_##t, KX_BLOCK_BYTES[K], kx_offset(K), KX_MINS(K), gemm_blocks_##t, a, r0, r1, n_tok)
#define KX_GEMM_(t, K, TILE_SPEC, BANDS) \
    TILE_SPEC void tile_##t(const gemm_args *a, int64_t r, int64_t tk, int NR, int NT) { \
        const kx_prep *none = NULL; \
        if (K > KX_IQ3_S) __asm__("" : "+r"(none));  /* see KX_GEMM */ \
        if (K == KX_IQ3_S && IQ3S_PLANES) tile_iq3s_planes(a, r, tk, NR, NT); \
        else tile_kx(K, a, none, r, tk, NR, NT); \
    } \
    static DEFINE_GEMM(gemm_blocks_##t, tile_##t) \
    static __attribute__((noinline)) void gemm_prepared_##t(gemm_args *a, void *P, int64_t r0, int64_t r1, \
                                                             int64_t n_tok) { \
        a->rs = (r1 - r0) / TR; \
        for (int64_t tb = 0; tb < n_tok; tb += TOKEN_BLOCK) \
            kx_prepared_rows(K, a, P, r0, r1, tb, tb + TOKEN_BLOCK < n_tok ? tb + TOKEN_BLOCK : n_tok); \
    } \
    void strata_gemm_##t(gemm_args *a, int64_t r0, int64_t r1, int64_t n_tok) { \
        if (n_tok >= KX_MIN_TOKENS && BANDS(t, K, a, r0, r1, n_tok)) return; \
        void *P = n_tok >= KX_MIN_TOKENS ? aligned_alloc(64, (size_t)(TR * a->n / QKK) * sizeof(kx_prep)) : NULL; \
        if (P) gemm_prepared_##t(a, P, r0, r1, n_tok); \
        else gemm_blocks_##t(a, r0, r1, n_tok); \
        free(P); \
    }
#define KX_GEMM(t, K) KX_GEMM_(t, K, static inline, KX_NO_BANDS)
#if defined(KQ_PREPARED)
// The KX_KQ types' direct tiles are inlined with their sizes as constants: their last steps put 4 rows' sums in
// one register (tile_kx), which GCC keeps in registers only then (Q5_K decode 0.63 ms, 0.75 ms not inlined).
#define KX_GEMM_KQ(t, K) \
    static void kb_unpack_##t(const void *blk, uint8_t *u, __m256i *sc, __m256i *m, float *d, float *dmin) { \
        kx_unpack(K, blk, u, sc, m, d, dmin); \
    } \
    KX_GEMM_(t, K, INLINE, KX_BANDS)
#else
#define KX_GEMM_KQ KX_GEMM
#endif
#else
#define KX_GEMM(t, K) TILE_SCALAR(t) DEFINE_GEMM(strata_gemm_##t, tile_scalar_##t)
#define KX_GEMM_KQ KX_GEMM
#define B32_GEMM KX_GEMM
#endif

KX_GEMM_KQ(q2_K, KX_Q2_K)
KX_GEMM_KQ(q3_K, KX_Q3_K)
KX_GEMM_KQ(q5_K, KX_Q5_K)
#if !defined(VNNI512)  // with AVX-512 VNNI: quants_x86_iq4xs.c
KX_GEMM(iq4_xs, KX_IQ4_XS)
#endif
KX_GEMM_KQ(iq3_s, KX_IQ3_S)
KX_GEMM(iq3_xxs, KX_IQ3_XXS)
KX_GEMM(iq2_xxs, KX_IQ2_XXS)
KX_GEMM(iq2_xs, KX_IQ2_XS)
KX_GEMM(iq2_s, KX_IQ2_S)
KX_GEMM_KQ(iq1_s, KX_IQ1_S)
KX_GEMM_KQ(iq1_m, KX_IQ1_M)
// GCC 12 sees the lanes j >= NT of tile_b32's arrays, never read, as maybe uninitialised when it does not inline the
// tile (depending on how much else this file inlines)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
B32_GEMM(iq4_nl, B32_IQ4_NL)
B32_GEMM(mxfp4, B32_MXFP4)
B32_GEMM(q5_0, B32_Q5_0)
B32_GEMM(q4_1, B32_Q4_1)
B32_GEMM(q5_1, B32_Q5_1)
#pragma GCC diagnostic pop

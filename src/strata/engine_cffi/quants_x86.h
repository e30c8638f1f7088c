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

#if defined(VNNI512)
#define KQ_PREPARED 1     // prompts of the 256-element types in bands of rows (below)
// From this many tokens, Q4_K and Q6_K products unpack their rows once per call: 2048 x 768, 1 thread, 10-14
// tokens 0.30-0.42 ms read directly, 0.24-0.35 unpacked; 9 tokens 0.28-0.29 either way, 4 tokens 0.13 against 0.21.
#define KQ_MIN_TOKENS 10
#endif

#if defined(__AVX2__)
// The last steps of the direct tiles that end as the bands below do.
// The direct tiles' sums of one row and token, s and m in 8 lanes each, as 4 lanes: s in lanes 0 + 1, m in 2 + 3.
static inline __m128i kb_part(__m256i s, __m256i m) {
    __m256i sm = _mm256_hadd_epi32(s, m);
    return _mm_add_epi32(_mm256_castsi256_si128(sm), _mm256_extracti128_si256(sm, 1));
}

// The f32 steps of one token for 4 rows (kb_part's p0 .. p3) in the lanes.
INLINE __m128 kb_steps(int mins, __m128 acc, __m128i p0, __m128i p1, __m128i p2, __m128i p3, __m128 d, __m128 dmin,
                       float da) {
    __m128 f01 = _mm_cvtepi32_ps(_mm_hadd_epi32(p0, p1)), f23 = _mm_cvtepi32_ps(_mm_hadd_epi32(p2, p3));  // s m s m
    __m128 vda = _mm_set1_ps(da);
    if (mins) acc = _mm_fnmadd_ps(_mm_shuffle_ps(f01, f23, 0xdd), _mm_mul_ps(dmin, vda), acc);
    return _mm_fmadd_ps(_mm_shuffle_ps(f01, f23, 0x88), _mm_mul_ps(d, vda), acc);
}

INLINE void store_rows4(const gemm_args *a, int64_t r, int64_t t, int NR, int NT, const __m128 acc[TT]) {
    UNROLL for (int j = 0; j < NT; j++) {
        float y4[4];
        _mm_storeu_ps(y4, acc[j]);
        UNROLL for (int i = 0; i < NR; i++) a->y[(t + j) * a->ldy + TILE_ROW(a, r, i)] = y4[i];
    }
}

#endif

#if defined(VNNI512)
// --- prompts in bands of rows (AVX-512 VNNI): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_S, IQ1_S, IQ1_M
// A band of KB_ROWS consecutive rows is unpacked once per product: values + offset as unsigned bytes, 4 of each row
// per 32-bit lane, so that one vpdpbusd with a token's 4 activations broadcast sums 4 values of 16 rows, and needs
// no horizontal sum. A group of 16 values sums in 32 bits (seeded with -o * bsum_g), then one vpmulld applies its
// scale: 1.25 multiplies per 64 values, where vpmaddubsw + vpdpwssd take 2.
//
// The sums of a block, for each row and token, are two integers: s = sum_g sc_g * (q . x)_g (offset included) and
// m = sum_g m_g * bsum_g (types with mins), then two f32 steps: acc -= m * (dmin * da), acc += s * (d * da).
// Integer sums do not depend on their order, so the direct tiles (4 rows in the lanes of one register: kb_part,
// kb_steps) and the bands give a token the same bits alone (decode) as in a batch (prompt).
#define KB_ROWS 16
#define KB_TOKENS 8  // tokens per tile: 3 x 8 registers of sums (a group's, the block's, the f32 result)

typedef struct {
    uint8_t q[QKK / 4][4 * KB_ROWS];   // step s (values 4s .. 4s + 3), row i's at bytes 4i ..
    int32_t sc[QKK / 16][KB_ROWS];     // the scale of group g
    int16_t m[QKK / 32][2 * KB_ROWS];  // the mins of groups 2p, 2p + 1, a pair per row
    float d[KB_ROWS], dmin[KB_ROWS];
} __attribute__((aligned(64))) kb_prep;

// A row's super-block as kb_prepare takes it: 256 values + offset as bytes, the scale and min of each group of 16.
typedef void (*kb_unpack_fn)(const void *blk, uint8_t *u, __m256i *sc, __m256i *m, float *d, float *dmin);

// r[c] becomes the 16 elements c of r[0..15] (a 16 x 16 transpose of 32-bit elements): pairs, then quads within
// 128-bit lanes, then the lanes.
static inline void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  // b[4i + e], lane L: element 4L + e of rows 4i .. 4i + 3
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int e = 0; e < 4; e++) {
        __m512i c0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x88), c1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xdd);
        __m512i c2 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x88), c3 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xdd);
        r[e] = _mm512_shuffle_i32x4(c0, c2, 0x88), r[8 + e] = _mm512_shuffle_i32x4(c0, c2, 0xdd);
        r[4 + e] = _mm512_shuffle_i32x4(c1, c3, 0x88), r[12 + e] = _mm512_shuffle_i32x4(c1, c3, 0xdd);
    }
}

// Rows r .. r + KB_ROWS - 1, block by block, into P (nb blocks): each row unpacked as it comes, then turned into
// the lanes by transposes.
static void kb_prepare(kb_unpack_fn unpack, size_t block_bytes, int mins, const gemm_args *a, int64_t r,
                       kb_prep *P) {
    const int64_t nb = a->n / QKK;
    uint8_t v[KB_ROWS][QKK] __attribute__((aligned(64)));
    for (int64_t b = 0; b < nb; b++) {
        kb_prep *p = &P[b];
        __m512i sc[KB_ROWS], m[KB_ROWS];
        for (int i = 0; i < KB_ROWS; i++) {
            __m256i sc16, m16;
            unpack((const char *)W_ROW(a, r + i) + b * block_bytes, v[i], &sc16, &m16, &p->d[i], &p->dmin[i]);
            sc[i] = _mm512_cvtepi16_epi32(sc16);
            m[i] = _mm512_castsi256_si512(m16);  // as 8 pairs of 16 bits
        }
        transpose16(sc);
        for (int g = 0; g < QKK / 16; g++) _mm512_store_si512(p->sc[g], sc[g]);
        if (mins) {
            transpose16(m);
            for (int q = 0; q < QKK / 32; q++) _mm512_store_si512(p->m[q], m[q]);
        }
        for (int s16 = 0; s16 < QKK / 64; s16++) {  // steps 16 s16 .. 16 s16 + 15
            __m512i w[KB_ROWS];
            for (int i = 0; i < KB_ROWS; i++) w[i] = _mm512_load_si512(v[i] + 64 * s16);
            transpose16(w);
            for (int e = 0; e < 16; e++) _mm512_store_si512(p->q[16 * s16 + e], w[e]);
        }
    }
}

// The band prepared in P against tokens t .. t + NT - 1; each group's sum starts from -o * bsum_g (o: the offset).
INLINE void tile_kb(int mins, const gemm_args *a, const kb_prep *P, int o, int64_t r, int64_t t, int NT) {
    const block_q8_K *x[KB_TOKENS] = {0};
    __m512 acc[KB_TOKENS];
    const int64_t nb = a->n / QKK;
    _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) x[j] = X_ROW(a, t + j), acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const kb_prep *p = &P[b];
        __m512i s[KB_TOKENS];
        _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) s[j] = _mm512_setzero_si512();
        for (int g = 0; g < QKK / 16; g++) {
            __m512i raw[KB_TOKENS];
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++)
                raw[j] = _mm512_set1_epi32(-o * x[j][b].bsums[g]);
            UNROLL for (int e = 0; e < 4; e++) {
                __m512i w = _mm512_load_si512(p->q[4 * g + e]);
                _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) {
                    int32_t x4;
                    memcpy(&x4, x[j][b].qs + 16 * g + 4 * e, 4);
                    raw[j] = _mm512_dpbusd_epi32(raw[j], w, _mm512_set1_epi32(x4));
                }
            }
            __m512i sc = _mm512_load_si512(p->sc[g]);
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) s[j] = _mm512_add_epi32(s[j], _mm512_mullo_epi32(raw[j], sc));
        }
        __m512 d = _mm512_load_ps(p->d);
        _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) {
            __m512 da = _mm512_set1_ps(x[j][b].d);
            if (mins) {  // as kb_steps, lane by lane
                __m512i m = _mm512_setzero_si512();
                UNROLL for (int q = 0; q < QKK / 32; q++) {
                    int32_t pair;
                    memcpy(&pair, x[j][b].bsums + 2 * q, 4);
                    m = _mm512_dpwssd_epi32(m, _mm512_load_si512(p->m[q]), _mm512_set1_epi32(pair));
                }
                acc[j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(_mm512_load_ps(p->dmin), da), acc[j]);
            }
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[j]), _mm512_mul_ps(d, da), acc[j]);
        }
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) _mm512_storeu_ps(a->y + (t + j) * a->ldy + r, acc[j]);
}

// Rows [r0, r1) against n_tok tokens: bands of KB_ROWS rows, the last rows by `direct` (the type's direct tiles).
// 0 when the scratch cannot be had. Inlined so that each type's mins and offset are constants.
INLINE int gemm_kb(kb_unpack_fn unpack, size_t block_bytes, int o, int mins,
                   void (*direct)(gemm_args *, int64_t, int64_t, int64_t), gemm_args *a, int64_t r0, int64_t r1,
                   int64_t n_tok) {
    const int64_t nb = a->n / QKK;
    kb_prep *P = aligned_alloc(64, (size_t)nb * sizeof(kb_prep));
    if (!P) return 0;
    int64_t r = r0;
    for (; r + KB_ROWS <= r1; r += KB_ROWS) {
        kb_prepare(unpack, block_bytes, mins, a, r, P);
        int64_t t = 0;
        for (; t + KB_TOKENS <= n_tok; t += KB_TOKENS) tile_kb(mins, a, P, o, r, t, KB_TOKENS);
        if (t + 4 <= n_tok) tile_kb(mins, a, P, o, r, t, 4), t += 4;
        if (t + 2 <= n_tok) tile_kb(mins, a, P, o, r, t, 2), t += 2;
        if (t < n_tok) tile_kb(mins, a, P, o, r, t, 1);
    }
    if (r < r1) direct(a, r, r1, n_tok);
    free(P);
    return 1;
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


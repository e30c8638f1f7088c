/* quants.c — the type traits table, the naive reference products and the public kernel API. */
#include <stdlib.h>
#include <omp.h>
#include "quants.h"

// --- traits

#define WEIGHT(t, name, block, vdt) \
    {name, block, sizeof(block_##t), vdt, strata_to_float_##t, NULL, strata_vec_dot_##t, strata_gemm_##t}

typedef float block_f32;
typedef uint16_t block_f16, block_bf16;

static const strata_type_traits TRAITS[] = {
    [STRATA_TYPE_F32] = {"f32", 1, 4, STRATA_TYPE_F32, strata_to_float_f32, strata_from_float_f32,
                         strata_vec_dot_f32, strata_gemm_f32},
    [STRATA_TYPE_F16] = WEIGHT(f16, "f16", 1, STRATA_TYPE_F32),
    [STRATA_TYPE_BF16] = WEIGHT(bf16, "bf16", 1, STRATA_TYPE_F32),
    [STRATA_TYPE_Q4_0] = WEIGHT(q4_0, "q4_0", QK, STRATA_TYPE_Q8_0),
    [STRATA_TYPE_Q8_0] = {"q8_0", QK, sizeof(block_q8_0), STRATA_TYPE_Q8_0, strata_to_float_q8_0,
                          strata_from_float_q8_0, strata_vec_dot_q8_0, strata_gemm_q8_0},
    [STRATA_TYPE_Q4_K] = WEIGHT(q4_K, "q4_K", QKK, STRATA_TYPE_Q8_K),
    [STRATA_TYPE_Q6_K] = WEIGHT(q6_K, "q6_K", QKK, STRATA_TYPE_Q8_K),
    [STRATA_TYPE_Q4_1] = WEIGHT(q4_1, "q4_1", QK, STRATA_TYPE_Q8_0),
    [STRATA_TYPE_Q5_0] = WEIGHT(q5_0, "q5_0", QK, STRATA_TYPE_Q8_0),
    [STRATA_TYPE_Q5_1] = WEIGHT(q5_1, "q5_1", QK, STRATA_TYPE_Q8_0),
    [STRATA_TYPE_IQ4_NL] = WEIGHT(iq4_nl, "iq4_nl", QK, STRATA_TYPE_Q8_0),
    [STRATA_TYPE_MXFP4] = WEIGHT(mxfp4, "mxfp4", QK, STRATA_TYPE_Q8_0),
    [STRATA_TYPE_Q2_K] = WEIGHT(q2_K, "q2_K", QKK, STRATA_TYPE_Q8_K),
    [STRATA_TYPE_Q3_K] = WEIGHT(q3_K, "q3_K", QKK, STRATA_TYPE_Q8_K),
    [STRATA_TYPE_Q5_K] = WEIGHT(q5_K, "q5_K", QKK, STRATA_TYPE_Q8_K),
    [STRATA_TYPE_IQ4_XS] = WEIGHT(iq4_xs, "iq4_xs", QKK, STRATA_TYPE_Q8_K),
    [STRATA_TYPE_IQ3_S] = WEIGHT(iq3_s, "iq3_s", QKK, STRATA_TYPE_Q8_K),
    [STRATA_TYPE_IQ3_XXS] = WEIGHT(iq3_xxs, "iq3_xxs", QKK, STRATA_TYPE_Q8_K),
    [STRATA_TYPE_IQ2_XXS] = WEIGHT(iq2_xxs, "iq2_xxs", QKK, STRATA_TYPE_Q8_K),
    [STRATA_TYPE_IQ2_XS] = WEIGHT(iq2_xs, "iq2_xs", QKK, STRATA_TYPE_Q8_K),
    [STRATA_TYPE_IQ2_S] = WEIGHT(iq2_s, "iq2_s", QKK, STRATA_TYPE_Q8_K),
    [STRATA_TYPE_IQ1_S] = WEIGHT(iq1_s, "iq1_s", QKK, STRATA_TYPE_Q8_K),
    [STRATA_TYPE_IQ1_M] = WEIGHT(iq1_m, "iq1_m", QKK, STRATA_TYPE_Q8_K),
    // activations only: no weight kernels
    [STRATA_TYPE_Q8_K] = {"q8_K", QKK, sizeof(block_q8_K), STRATA_TYPE_Q8_K, strata_to_float_q8_K,
                          strata_from_float_q8_K, NULL, NULL},
};

const strata_type_traits *strata_traits(int type) {
    if (type < 0 || type >= (int)(sizeof(TRAITS) / sizeof(TRAITS[0])) || !TRAITS[type].name) return NULL;
    return &TRAITS[type];
}

int strata_type_supported(int type) {
    const strata_type_traits *t = strata_traits(type);
    return t != NULL && t->gemm != NULL;
}

static size_t row_bytes(int type, int64_t n) {
    const strata_type_traits *t = strata_traits(type);
    if (!t || n < 0 || n % t->block_size) return 0;
    return (size_t)(n / t->block_size) * t->block_bytes;
}

size_t strata_row_bytes(int type, long long n) {
    return strata_type_supported(type) ? row_bytes(type, n) : 0;
}

// --- rows and products through the table

void strata_dequantize_row_any(int type, const void *src, float *dst, int64_t n) {
    TRAITS[type].to_float(src, dst, n);
}

void strata_quantize_row_any(int vec_dot_type, const float *src, void *dst, int64_t n) {
    TRAITS[vec_dot_type].from_float(src, dst, n);
}

void strata_gemm_rows(int type, int64_t n, const void *w, int64_t r0, int64_t r1,
                      const void *x, int64_t n_tok, float *y, int64_t ldy) {
    const strata_type_traits *t = &TRAITS[type];
    strata_gemm_args a = {n, w, row_bytes(type, n), x, row_bytes(t->vec_dot_type, n), y, ldy, 1};
    t->gemm(&a, r0, r1, n_tok);
}

// --- naive reference products

static double dot_double(const float *a, const float *b, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * (double)b[i];
    return s;
}

// x_f: n_tok activation rows in f32, n apart. wrow: scratch of n floats.
static void gemm_rows_naive_f32(int type, int64_t n, const void *w, int64_t r0, int64_t r1,
                                const float *x_f, int64_t n_tok, float *y, int64_t ldy, float *wrow) {
    size_t wb = row_bytes(type, n);
    for (int64_t r = r0; r < r1; r++) {
        strata_dequantize_row_any(type, (const char *)w + r * wb, wrow, n);
        for (int64_t t = 0; t < n_tok; t++) y[t * ldy + r] = (float)dot_double(wrow, x_f + t * n, n);
    }
}

void strata_gemm_rows_naive(int type, int64_t n, const void *w, int64_t r0, int64_t r1,
                            const void *x, int64_t n_tok, float *y, int64_t ldy) {
    int xt = strata_traits(type)->vec_dot_type;
    size_t xb = row_bytes(xt, n);
    float *buf = malloc(((size_t)n_tok + 1) * (size_t)n * sizeof(float));
    if (!buf) {  // a reference has no status to return: make the failure impossible to miss
        for (int64_t r = r0; r < r1; r++)
            for (int64_t t = 0; t < n_tok; t++) y[t * ldy + r] = NAN;
        return;
    }
    for (int64_t t = 0; t < n_tok; t++) strata_dequantize_row_any(xt, (const char *)x + t * xb, buf + t * n, n);
    gemm_rows_naive_f32(type, n, w, r0, r1, buf, n_tok, y, ldy, buf + n_tok * n);
    free(buf);
}

// --- public API

const char *strata_status_string(strata_status status) {
    switch (status) {
    case STRATA_OK: return "ok";
    case STRATA_ERR_INVALID_ARG: return "invalid argument";
    case STRATA_ERR_UNSUPPORTED: return "unsupported";
    case STRATA_ERR_NOMEM: return "out of memory";
    case STRATA_ERR_CONTEXT_FULL: return "context full";
    case STRATA_ABORTED: return "aborted";
    }
    return "unknown status";
}

strata_status strata_dequantize_row(int type, const void *src, float *dst, long long n) {
    if (!strata_type_supported(type)) return STRATA_ERR_UNSUPPORTED;
    if (!src || !dst || n < 0 || n % strata_traits(type)->block_size) return STRATA_ERR_INVALID_ARG;
    strata_dequantize_row_any(type, src, dst, n);
    return STRATA_OK;
}

static strata_status check_matmul(int type, const void *w, long long n_rows, long long n_cols,
                                  const float *x, long long n_tok, const float *y) {
    if (!strata_type_supported(type)) return STRATA_ERR_UNSUPPORTED;
    if (!w || !x || !y || n_rows < 0 || n_tok < 0 || n_cols <= 0 || n_cols % strata_traits(type)->block_size)
        return STRATA_ERR_INVALID_ARG;
    return STRATA_OK;
}

#define MATMUL_CHUNKS_PER_THREAD 8

// y = x @ w^T, n_threads threads: w's rows, or the band layout of them when bands is not NULL.
static strata_status matmul_fast(int type, const void *w, const void *bands, long long n_rows, long long n_cols,
                                 const float *x, long long n_tok, float *y, int n_threads) {
    strata_status st = check_matmul(type, bands ? bands : w, n_rows, n_cols, x, n_tok, y);
    if (st != STRATA_OK) return st;
    int xt = strata_traits(type)->vec_dot_type;
    size_t xb = row_bytes(xt, n_cols);
    char *xq = malloc(xb * (size_t)(n_tok ? n_tok : 1));
    if (!xq) return STRATA_ERR_NOMEM;
    if (n_threads < 1) n_threads = 1;
    #pragma omp parallel num_threads(n_threads)
    {
        // x once, shared by every row; the loop's closing barrier publishes it
        #pragma omp for schedule(static)
        for (long long t = 0; t < n_tok; t++) strata_quantize_row_any(xt, x + t * n_cols, xq + t * xb, n_cols);
        // Chunks of rows handed out as threads free up: on a busy machine a thread that loses its core for a
        // while no longer holds up the call by its whole share. Whole bands: a multiple of 16 rows.
        int64_t chunk = (n_rows / ((int64_t)omp_get_num_threads() * MATMUL_CHUNKS_PER_THREAD) + 15) / 16 * 16;
        if (chunk < 16) chunk = 16;
        #pragma omp for schedule(dynamic, 1)
        for (long long r0 = 0; r0 < n_rows; r0 += chunk) {
            long long r1 = r0 + chunk < n_rows ? r0 + chunk : n_rows;
            if (bands)
                strata_gemm_bands(type, bands, n_cols, r0, r1, xq, n_tok, y, n_rows);
            else
                strata_gemm_rows(type, n_cols, w, r0, r1, xq, n_tok, y, n_rows);
        }
    }
    free(xq);
    return STRATA_OK;
}

strata_status strata_matmul(int type, const void *w, long long n_rows, long long n_cols,
                            const float *x, long long n_tok, float *y, int n_threads) {
    return matmul_fast(type, w, NULL, n_rows, n_cols, x, n_tok, y, n_threads);
}

size_t strata_bands_bytes(int type, long long n_rows, long long n_cols) {
    return strata_type_supported(type) && row_bytes(type, n_cols) ? strata_bands_size(type, n_rows, n_cols) : 0;
}

strata_status strata_bands_prepare(int type, const void *w, long long n_rows, long long n_cols, void *bands) {
    if (!strata_bands_bytes(type, n_rows, n_cols)) return STRATA_ERR_UNSUPPORTED;
    if (!w || !bands) return STRATA_ERR_INVALID_ARG;
    strata_bands_fill(type, w, n_rows, n_cols, bands);
    return STRATA_OK;
}

strata_status strata_matmul_bands(int type, const void *bands, long long n_rows, long long n_cols,
                                  const float *x, long long n_tok, float *y, int n_threads) {
    if (!strata_bands_bytes(type, n_rows, n_cols)) return STRATA_ERR_UNSUPPORTED;
    return matmul_fast(type, NULL, bands, n_rows, n_cols, x, n_tok, y, n_threads);
}

strata_status strata_matmul_naive(int type, const void *w, long long n_rows, long long n_cols,
                                  const float *x, long long n_tok, float *y) {
    strata_status st = check_matmul(type, w, n_rows, n_cols, x, n_tok, y);
    if (st != STRATA_OK) return st;
    float *wrow = malloc((size_t)n_cols * sizeof(float));
    if (!wrow) return STRATA_ERR_NOMEM;
    gemm_rows_naive_f32(type, n_cols, w, 0, n_rows, x, n_tok, y, n_rows, wrow);
    free(wrow);
    return STRATA_OK;
}

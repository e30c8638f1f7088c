/* kernels.h — the engine's internal kernel interface (not seen by cffi).
 * Weights are rows of blocks in GGUF's layouts. A dot product pairs a weight row with an activation row that was
 * first converted to the weight type's vec_dot_type (F32, Q8_0 or Q8_K), once per token, so the conversion cost is
 * shared by every row. Each type's block geometry and kernels are one row of a traits table, as in ggml: callers
 * look a type up once instead of switching on it per call. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "strata_engine.h"

/* A product's operands: weight rows [r0, r1) of n elements, wb bytes apart, against n_tok activation rows in the
 * vec_dot_type, xb bytes apart; y[t * ldy + r]. rs is the kernels' own (the rows of a tile are r, r + rs, ...). */
typedef struct {
    int64_t n;
    const char *w;
    size_t wb;
    const char *x;
    size_t xb;
    float *y;
    int64_t ldy;
    int64_t rs;
} strata_gemm_args;

typedef void (*strata_to_float_fn)(const void *src, float *dst, int64_t n);
typedef void (*strata_from_float_fn)(const float *src, void *dst, int64_t n);
typedef float (*strata_vec_dot_fn)(const void *w, const void *x, int64_t n);
typedef void (*strata_gemm_fn)(strata_gemm_args *a, int64_t r0, int64_t r1, int64_t n_tok);

typedef struct {
    const char *name;
    int64_t block_size;             /* elements per block */
    size_t block_bytes;             /* bytes per block */
    int vec_dot_type;               /* activation type this weight type is dotted with */
    strata_to_float_fn to_float;    /* dequantise n elements (n a multiple of block_size) */
    strata_from_float_fn from_float; /* quantise n activations into this type (activation types only, else NULL) */
    strata_vec_dot_fn vec_dot;      /* scalar dot of one row with one vec_dot_type row (weight types) */
    strata_gemm_fn gemm;            /* the fast product, rows x tokens in tiles (weight types) */
} strata_type_traits;

/* Traits of `type`, or NULL when it is not a type this engine knows (weights or activations). */
const strata_type_traits *strata_traits(int type);

/* --- rows */
void strata_dequantize_row_any(int type, const void *src, float *dst, int64_t n);
/* Convert one activation row to `vec_dot_type` (F32 copies; Q8_0, Q8_K quantise). n a multiple of its block size. */
void strata_quantize_row_any(int vec_dot_type, const float *src, void *dst, int64_t n);

/* --- products
 * y[t * ldy + r] = dot(w row r, x row t) for r in [r0, r1), t in [0, n_tok).
 * w: rows of `type`, strata_row_bytes(type, n) bytes apart; x: n_tok rows already in the vec_dot_type,
 * strata_row_bytes(vec_dot_type, n) bytes apart. Single-threaded: callers split [r0, r1) between threads. */
void strata_gemm_rows(int type, int64_t n, const void *w, int64_t r0, int64_t r1,
                      const void *x, int64_t n_tok, float *y, int64_t ldy);
/* Whether strata_gemm_rows of `type` rows of n elements packs its tokens anew in every call (Q8_0 by the tile
 * unit; strata_gemm_bands of them too), so that a prompt's product wants long runs of rows per call, not tasks
 * of a few rows. */
int strata_gemm_packs_tokens(int type, int64_t n);
/* Reference for the above: dequantise both sides, sum in double. */
void strata_gemm_rows_naive(int type, int64_t n, const void *w, int64_t r0, int64_t r1,
                            const void *x, int64_t n_tok, float *y, int64_t ldy);

/* --- f16 / bf16 scalars */
float strata_f16_to_f32(uint16_t h);
uint16_t strata_f32_to_f16(float f);
float strata_bf16_to_f32(uint16_t h);

/* --- weights laid out once in bands of rows (quants_x86.c; Q8_0 with AVX-512 VNNI), for a weight whose every
 * product should take it: the bytes for n_rows rows of n elements, 0 where this build has no band layout for
 * `type`; fill it from GGUF rows; then products as strata_gemm_rows, r0 a multiple of STRATA_BAND_ROWS. */
#define STRATA_BAND_ROWS 16
size_t strata_bands_size(int type, int64_t n_rows, int64_t n);
void strata_bands_fill(int type, const void *w, int64_t n_rows, int64_t n, void *bands);
void strata_gemm_bands(int type, const void *bands, int64_t n, int64_t r0, int64_t r1, const void *x, int64_t n_tok,
                       float *y, int64_t ldy);

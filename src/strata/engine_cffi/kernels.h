/* kernels.h — the engine's internal kernel interface (not seen by cffi).
 * Weights are rows of blocks in GGUF's layouts. A dot product pairs a weight row with an activation row that was
 * first converted to the weight type's vec_dot_type (F32 for F32/F16/BF16 weights, Q8_0 for Q8_0/Q4_0, Q8_K for
 * Q4_K/Q6_K), once per token, so the conversion cost is shared by every row. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "strata_engine.h"

typedef struct {
    const char *name;
    int64_t block_size;   /* elements per block */
    size_t block_bytes;   /* bytes per block */
    int vec_dot_type;     /* activation type this weight type is dotted with */
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
/* Reference for the above: dequantise both sides, sum in double. */
void strata_gemm_rows_naive(int type, int64_t n, const void *w, int64_t r0, int64_t r1,
                            const void *x, int64_t n_tok, float *y, int64_t ldy);

/* --- f16 / bf16 scalars */
float strata_f16_to_f32(uint16_t h);
uint16_t strata_f32_to_f16(float f);
float strata_bf16_to_f32(uint16_t h);

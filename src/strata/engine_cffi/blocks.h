/* blocks.h — the building blocks every architecture's layer is made of (blocks.c), and the team's helpers. Each
 * block is called by every thread of the team and ends at a barrier, except those that work on this thread's
 * share of the tokens only (said at each): a step on the same share may follow them at once. */
#ifndef STRATA_BLOCKS_H
#define STRATA_BLOCKS_H

#include "engine_internal.h"

// --- the team's helpers

/* This thread's part of [0, n): nth contiguous parts whose sizes differ by at most one. */
static inline range share(const team *tm, int64_t n) {
    int64_t base = n / tm->nth, extra = n % tm->nth;
    int64_t lo = tm->ith * base + (tm->ith < extra ? tm->ith : extra);
    return (range){lo, lo + base + (tm->ith < extra)};
}

/* Wait for the whole team: what any thread wrote before is visible to all after. */
static inline void team_sync(const team *tm) { strata_pool_barrier(tm->pool); }

/* The next unit of a loop whose units are taken one at a time as threads free up (units of uneven cost). */
static inline int team_next(const team *tm) { return strata_pool_next(tm->pool); }

/* The answer of the last poll of `slot`; after a barrier that follows it, every thread reads the same. */
static inline int team_stopped(const strata_context *c, int slot) { return c->stop_at[slot]; }

// --- shared steps (blocks.c)

/* out (n,) = x / sqrt(mean(x^2) + eps) * w */
void rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps);
/* out rows (n_tok, n) = rmsnorm of x rows, this thread's share of them; no barrier. */
void rmsnorm_rows(const team *tm, float *out, const float *x, const float *w, int n_tok, int64_t n, float eps);
/* ys[i] (n_tok, ws[i].n_out) = x (n_tok, n_in) @ ws[i]^T for weights reading the same input: x is converted
 * once per run of weights sharing a partner type. Ends at a barrier. */
void linear(const team *tm, strata_context *c, const float *x, int n_tok, int n_w, const matrix *const *ws,
            float *const *ys);
void linear1(const team *tm, strata_context *c, const float *x, int n_tok, const matrix *w, float *y);
/* x += y, row by row, this thread's share; no barrier. */
void add_rows(const team *tm, float *x, const float *y, int n_tok, int64_t n);

// --- blocks

/* Thread 0 polls the abort flags of the chunk's sequences into stop_at[slot] (read with team_stopped). */
void block_poll_aborts(const team *tm, strata_context *c, int slot, int n_tok);

/* x += attention(rmsnorm(x)) @ Wo, q and k heads normed (where the model has it) and turned by RoPE (the first
 * n_rot values of each), k and v rows cached at the chunk's positions; with gated attention (Qwen3.5) each head's
 * output times the sigmoid of its gate. */
void block_attention(const team *tm, strata_context *c, int il, int n_tok);

/* x += the Gated DeltaNet of rmsnorm(x) (blocks_deltanet.c), each sequence's conv and delta-rule state carried
 * on; polls the abort flags into slot 1 as block_attention does. */
void block_deltanet(const team *tm, strata_context *c, int il, int n_tok);

/* x += SwiGLU(rmsnorm(x)) through the layer's dense weights. */
void block_dense_ffn(const team *tm, strata_context *c, int il, int n_tok);

/* x += the router's top-k experts' SwiGLU of rmsnorm(x), weighted, and the gated shared expert's where the model
 * has one; no barrier at its end (this thread's share). */
void block_moe_ffn(const team *tm, strata_context *c, int il, int n_tok);

/* x rows = token embeddings, or the caller's rows; this thread's share, no barrier. */
void block_embed(const team *tm, strata_context *c, const float *embd_rows, int n_tok);

/* x rows of the caller's rows += their deepstack slice k + 1; this thread's share, no barrier. */
void block_add_deepstack(const team *tm, strata_context *c, const float *embd_rows, int k, int n_tok);

/* The caller's logits rows = rmsnorm(x) @ Woutput for the chunk's tokens that want them. */
void block_output_logits(const team *tm, strata_context *c, int n_tok, float *logits);

#endif

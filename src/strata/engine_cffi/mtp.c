/* mtp.c — the model's MTP block (multi-token prediction; Qwen3.5's nextn block) as speculative decoding's draft
 * source. For a position p the block reads a pair: the trunk's final hidden state h_p and the token x_{p+1}
 * that followed it; it predicts x_{p+2}:
 *   u = eh_proj([enorm(embed(x_{p+1})), hnorm(h_p)])     the embedding first, as Qwen's checkpoints concatenate
 *   u += attention(rmsnorm(u)) at position p, over the block's own KV rows of positions <= p
 *   u += feed-forward(rmsnorm(u))                         the block's own experts and shared expert (or dense)
 *   g = shared_head_norm(u); logits = g @ head            the block's head, else the model's output matrix
 * h_p is the trunk's hidden state after the output norm: the one the model's own head scores, which is what
 * Qwen3.5's block is fed by vLLM (qwen3_next_mtp) and llama.cpp (after its PR 24025). Drafts chain: the next
 * pair is (g, the draft), one position on.
 * The block attends over pairs of every earlier position, so its rows must hold every pair of the verified history
 * before a draft reads them. Filling them lazily: each eval keeps the chunk's hidden states and token ids of each
 * sequence's last STRATA_MTP_HISTORY positions, and the pairs they complete wait there (mtp_filled: the first
 * pair not in the rows) until a draft needs them, when strata_mtp_draft fills them first, all of them in one pass
 * over the block's weights, n_batch at a time. An eval fills its sequences' pairs at once only where waiting
 * would lose them: the chunk would push a pending pair's hidden state out of the held ones, or it brings
 * embedding rows in place of tokens (the held history keeps token ids only). A sequence whose drafter is backed
 * off costs a batched fill every HISTORY steps instead of one block run at every step. With a window (mtp_window
 * N), the block's history starts where its drafts last started instead: no eval fills (pairs whose hidden states
 * the kept ones lose lapse), a draft fills the last N waiting pairs at most, and the block attends over its rows
 * from mtp_from on (a pair that lapsed or was skipped moves it up). Its drafts are then those of a block that saw
 * the recent history only, verified as any: a backed-off sequence costs nothing between its guesses, and a guess
 * N pairs at most however long its prompt. Rows and hidden states past the verified history are scratch that the next eval or fill overwrites, so a wrong draft never reaches
 * the block's view of the history. */
#include <assert.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"

#define HIST STRATA_MTP_HISTORY

// --- the context's buffers

int mtp_alloc(strata_context *c) {
    const strata_model_params *p = &c->model->hp;
    size_t E = p->n_embd, B = c->n_batch, S = c->n_seq;
    c->mtp_hidden = malloc(sizeof(float) * S * HIST * E);
    c->mtp_hidden_pos = malloc(sizeof(int) * S * HIST);
    c->mtp_hidden_rope = malloc(sizeof(int) * S * HIST * 3);
    c->mtp_hidden_tok = malloc(sizeof(int) * S * HIST);
    c->mtp_filled = calloc(S, sizeof(int));
    c->mtp_from = calloc(S, sizeof(int));
    c->mtp_upto = malloc(sizeof(int) * S);
    c->mtp_h = malloc(sizeof(float) * B * E);
    c->mtp_in = malloc(sizeof(float) * B * 2 * E);
    c->mtp_hrow = malloc(sizeof(float *) * B);
    c->mtp_rope = malloc(sizeof(int) * B * 3);
    c->mtp_g = malloc(sizeof(float) * B * E);
    c->mtp_logits = malloc(sizeof(float) * B * p->n_vocab);
    int **ints[] = {&c->mtp_tok, &c->mtp_embd, &c->mtp_seq, &c->mtp_pos, &c->mtp_row, &c->mtp_base, &c->mtp_next};
    int ok = c->mtp_hidden && c->mtp_hidden_pos && c->mtp_hidden_rope && c->mtp_hidden_tok && c->mtp_filled &&
             c->mtp_from &&
             c->mtp_upto && c->mtp_h && c->mtp_in && c->mtp_hrow && c->mtp_rope && c->mtp_g && c->mtp_logits;
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) ok = ok && (*ints[i] = malloc(sizeof(int) * B));
    for (size_t i = 0; ok && i < S * HIST; i++) c->mtp_hidden_pos[i] = -1;
    return ok;
}

void mtp_free(strata_context *c) {
    void *bufs[] = {c->mtp_hidden, c->mtp_hidden_pos, c->mtp_hidden_rope, c->mtp_hidden_tok, c->mtp_filled, c->mtp_from,
                    c->mtp_upto, c->mtp_h, c->mtp_in,
                    (void *)c->mtp_hrow, c->mtp_rope, c->mtp_g, c->mtp_logits, c->mtp_tok, c->mtp_embd,
                    c->mtp_seq, c->mtp_pos, c->mtp_row, c->mtp_base, c->mtp_next};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
}

/* The slot holding (seq, position) among the sequence's kept ones, or -1 where none does. */
static long slot(const strata_context *c, int seq, int pos) {
    size_t at = (size_t)seq * HIST + pos % HIST;
    return pos >= 0 && c->mtp_hidden_pos[at] == pos ? (long)at : -1;
}

/* The held hidden-state row of (seq, position) and its RoPE position, or NULL where it is not held. */
static const float *held(const strata_context *c, int seq, int pos, const int **rope) {
    long at = slot(c, seq, pos);
    if (at < 0) return NULL;
    *rope = c->mtp_hidden_rope + 3 * at;
    return c->mtp_hidden + at * c->model->hp.n_embd;
}

/* Sequence s's block history: rows [from, filled) filled, the pairs from filled on waiting. */
static void set_history(strata_context *c, int s, int from, int filled) {
    c->mtp_from[s] = from;
    c->mtp_filled[s] = filled;
}

/* Whether the pair of (seq, p) can be filled from the held history: its hidden state and its token at p + 1. */
static int pair_held(const strata_context *c, int seq, int p) {
    const int *rope;
    long tok = slot(c, seq, p + 1);
    return held(c, seq, p, &rope) && tok >= 0 && c->mtp_hidden_tok[tok] >= 0;
}

void mtp_keep(strata_context *c, int seq, int n) {
    int last = n > 0 ? n - 1 : 0;  // the pair of n - 1 waits for the token at n
    if (c->mtp_filled[seq] > last) c->mtp_filled[seq] = last;
    if (c->mtp_from[seq] <= c->mtp_filled[seq]) return;
    // cut back past the start of a window's history: it starts again at the last pairs the held history has
    int from = last;
    while (from > 0 && last - from < c->mtp_window && pair_held(c, seq, from - 1)) from--;
    set_history(c, seq, from, from);
}

void mtp_skip(strata_context *c, int seq, int n) {
    // imported rows count as filled; with a window (rows before mtp_from never filled), none is known, and the
    // history starts at the first pair whose hidden state an eval will compute
    if (n > 0) set_history(c, seq, c->mtp_window ? n : c->mtp_from[seq], c->mtp_window ? n : n - 1);
}

void mtp_copy_prefix(strata_context *c, int src, int dst, int n) {
    size_t E = c->model->hp.n_embd;
    for (int i = 0; i < HIST; i++) {
        size_t from = (size_t)src * HIST + i, to = (size_t)dst * HIST + i;
        int pos = c->mtp_hidden_pos[from];
        c->mtp_hidden_pos[to] = pos >= 0 && pos < n ? pos : -1;
        if (c->mtp_hidden_pos[to] < 0) continue;
        memcpy(c->mtp_hidden + to * E, c->mtp_hidden + from * E, sizeof(float) * E);
        memcpy(c->mtp_hidden_rope + 3 * to, c->mtp_hidden_rope + 3 * from, sizeof(int) * 3);
        c->mtp_hidden_tok[to] = c->mtp_hidden_tok[from];
    }
    set_history(c, dst, c->mtp_from[src], c->mtp_filled[src]);  // its pending pairs are held in the copy too
    mtp_keep(c, dst, n);
}

void strata_mtp_get_counts(const strata_context *c, strata_mtp_counts *out) { *out = c->mtp_counts; }

// --- the block over a set of pairs

/* mtp_in rows (n) = [enorm(the pair's token embedding, or the caller's row), hnorm(its hidden state)]. */
static void pair_inputs(const team *tm, strata_context *c, const float *embd_rows, int n) {
    const strata_model *m = c->model;
    const layer_weights *L = m->mtp;
    const matrix *embd = L->nextn_embed.data ? &L->nextn_embed : &m->tok_embd;
    int64_t E = m->hp.n_embd, W = E * (1 + m->hp.n_deepstack);
    float eps = m->hp.rms_eps;
    range r = share(tm, n);
    for (int64_t t = r.lo; t < r.hi; t++) {
        float *e = c->mtp_in + t * 2 * E, *h = e + E;
        if (c->mtp_embd[t] >= 0)
            memcpy(e, embd_rows + (size_t)c->mtp_embd[t] * W, sizeof(float) * E);
        else
            strata_dequantize_row_any(embd->type, (const char *)embd->data + (size_t)c->mtp_tok[t] * embd->row_bytes,
                                      e, E);
        rmsnorm(e, e, L->nextn_enorm, E, eps);
        if (c->mtp_hrow[t]) rmsnorm(h, c->mtp_hrow[t], L->nextn_hnorm, E, eps);
        else memset(h, 0, sizeof(float) * E);
    }
    team_sync(tm);
}

static void swap_ints(int **a, int **b) {
    int *t = *a;
    *a = *b;
    *b = t;
}

/* x rows (n) = the block over the pairs of mtp_in: eh_proj, attention at the pairs' positions (the chunk's arrays
 * point at the pairs meanwhile; the block's routing is not recorded), the feed-forward. */
static void run_block(const team *tm, strata_context *c, int n) {
    const strata_model *m = c->model;
    int il = m->hp.n_layer;
    int *routing = c->route_rec;  // thread 0's, the one that records
    linear1(tm, c, c->mtp_in, n, &m->mtp->nextn_eh_proj, c->x);
    if (tm->ith == 0) {
        swap_ints(&c->chunk_seq, &c->mtp_seq);
        swap_ints(&c->chunk_pos, &c->mtp_pos);
        swap_ints(&c->chunk_rope, &c->mtp_rope);
        c->route_rec = NULL;
        c->attn_from = c->mtp_from;
    }
    team_sync(tm);
    block_attention(tm, c, il, n);
    if (m->is_moe) block_moe_ffn(tm, c, il, n);
    else block_dense_ffn(tm, c, il, n);
    team_sync(tm);
    if (tm->ith == 0) {
        swap_ints(&c->chunk_seq, &c->mtp_seq);
        swap_ints(&c->chunk_pos, &c->mtp_pos);
        swap_ints(&c->chunk_rope, &c->mtp_rope);
        c->route_rec = routing;
        c->attn_from = NULL;
    }
    team_sync(tm);
}

// --- filling the block's rows: the pending pairs of the verified history

/* Position of sequence s's first token in the eval's chunk, or INT_MAX (none, or no chunk). */
static int chunk_first(const strata_context *c, int chunk, int s) {
    return chunk && c->seq_first[s] < c->seq_first[s + 1] ? c->chunk_pos[c->seq_tokens[c->seq_first[s]]] : INT_MAX;
}

/* Row n = the pair of (s, p): the hidden state at p and the token at p + 1, each the chunk's where `chunk` has
 * that position, else held. A pending pair's token is held (a chunk with embedding rows fills its pairs at once);
 * its hidden state is not only after an import (the rows came without it): zeros then, as the eager fill had. */
static void add_pair(strata_context *c, int chunk, int s, int p, int n) {
    size_t E = c->model->hp.n_embd;
    int first = chunk_first(c, chunk, s);
    const int *rope = NULL;
    if (p >= first) {
        int t = c->seq_tokens[c->seq_first[s] + p - first];
        c->mtp_hrow[n] = c->mtp_h + (size_t)t * E;
        rope = c->chunk_rope + 3 * t;
    } else {
        c->mtp_hrow[n] = held(c, s, p, &rope);
    }
    for (int a = 0; a < 3; a++) c->mtp_rope[3 * n + a] = rope ? rope[a] : p;
    if (p + 1 >= first) {
        int t = c->seq_tokens[c->seq_first[s] + p + 1 - first];
        c->mtp_tok[n] = c->chunk_token[t];
        c->mtp_embd[n] = c->chunk_embd[t];
    } else {
        long tok = slot(c, s, p + 1);
        assert(tok >= 0 && c->mtp_hidden_tok[tok] >= 0);
        c->mtp_tok[n] = c->mtp_hidden_tok[tok];
        c->mtp_embd[n] = -1;
    }
    c->mtp_seq[n] = s;
    c->mtp_pos[n] = p;
}

/* Thread 0: the next pairs to fill, n_batch at most: each sequence's positions [mtp_filled, mtp_upto) in order,
 * from the cursor (*s, *p) on. */
static void plan_pairs(strata_context *c, int chunk, int *s, int *p) {
    int n = 0;
    while (n < c->n_batch && *s < c->n_seq) {
        if (*p < c->mtp_upto[*s]) add_pair(c, chunk, *s, (*p)++, n++);
        else if (++*s < c->n_seq) *p = c->mtp_filled[*s];
    }
    c->mtp_n = n;
}

/* Every thread: the block over each sequence's pending pairs up to mtp_upto, n_batch at a time (each pass reads
 * the block's weights once for all its rows); they are then filled. */
static void fill_pending(const team *tm, strata_context *c, const float *embd_rows, int chunk) {
    int s = 0, p = c->mtp_filled[0];  // thread 0's cursor
    for (;;) {
        if (tm->ith == 0) plan_pairs(c, chunk, &s, &p);
        team_sync(tm);
        int n = c->mtp_n;
        if (n == 0) break;
        pair_inputs(tm, c, embd_rows, n);
        run_block(tm, c, n);
        if (tm->ith == 0) {
            c->mtp_counts.fill_runs++;
            c->mtp_counts.pairs += n;
        }
    }
    if (tm->ith == 0)
        for (int q = 0; q < c->n_seq; q++)
            if (c->mtp_upto[q] > c->mtp_filled[q]) c->mtp_filled[q] = c->mtp_upto[q];
    team_sync(tm);
}

/* Thread 0: how far the chunk fills each of its sequences' pairs: all it completes where waiting would lose a
 * pending one (the chunk keeps its sequence's last HIST positions: a pending pair's hidden state would fall out)
 * or where it brings embedding rows (the kept history holds token ids only); else none. With a window, the pairs
 * waiting would lose lapse instead, and a chunk with embedding rows fills the last mtp_window it completes.
 * mtp_due = whether any sequence has pairs to fill. */
static void plan_chunk(strata_context *c) {
    c->mtp_due = 0;
    for (int s = 0; s < c->n_seq; s++) c->mtp_upto[s] = c->mtp_filled[s];
    for (int q = 0; q < c->n_chunk_seqs; q++) {
        int s = c->chunk_seqs[q], lo = c->seq_first[s], hi = c->seq_first[s + 1];
        int last = c->chunk_pos[c->seq_tokens[hi - 1]], lose = c->mtp_filled[s] <= last - HIST, embd = 0;
        for (int i = lo; i < hi && !embd; i++) embd = c->chunk_embd[c->seq_tokens[i]] >= 0;
        if (c->mtp_window && !embd) {
            if (lose) set_history(c, s, last - HIST + 1, last - HIST + 1);
            continue;
        }
        if (c->mtp_window && last - c->mtp_filled[s] > c->mtp_window)
            set_history(c, s, last - c->mtp_window, last - c->mtp_window);
        if ((lose || embd) && last > c->mtp_filled[s]) {
            c->mtp_upto[s] = last;
            c->mtp_due = 1;
        }
    }
}

/* The chunk's hidden states and tokens of each sequence's last HIST positions go where the pairs and drafts read
 * them. */
static void keep_hidden(const team *tm, strata_context *c, int n_tok) {
    size_t E = c->model->hp.n_embd;
    range r = share(tm, n_tok);
    for (int64_t t = r.lo; t < r.hi; t++) {
        int s = c->chunk_seq[t], pos = c->chunk_pos[t];
        int last = c->chunk_pos[c->seq_tokens[c->seq_first[s + 1] - 1]];
        if (pos <= last - HIST) continue;
        size_t at = (size_t)s * HIST + pos % HIST;
        memcpy(c->mtp_hidden + at * E, c->mtp_h + t * E, sizeof(float) * E);
        memcpy(c->mtp_hidden_rope + 3 * at, c->chunk_rope + 3 * t, sizeof(int) * 3);
        c->mtp_hidden_pos[at] = pos;
        c->mtp_hidden_tok[at] = c->chunk_embd[t] >= 0 ? -1 : c->chunk_token[t];
    }
    team_sync(tm);
}

void mtp_fill(const team *tm, strata_context *c, const float *embd_rows, int n_tok) {
    const strata_model *m = c->model;
    // the chunk's hidden states: output_norm(x), as the output head reads them
    rmsnorm_rows(tm, c->mtp_h, c->x, m->output_norm, n_tok, m->hp.n_embd, m->hp.rms_eps);
    if (tm->ith == 0) plan_chunk(c);
    team_sync(tm);
    if (c->mtp_due) fill_pending(tm, c, embd_rows, 1);  // before keep_hidden overwrites a held row a pair reads
    keep_hidden(tm, c, n_tok);
}

// --- drafts

typedef struct {
    strata_context *c;
    int n, n_draft;
    const int *seqs, *pos, *tokens;
    int *drafts;
    float *logits;
} draft_job;

/* Step k's pairs (thread 0): each sequence with its hidden state held, at position pos - 1 + k: the trunk's hidden
 * state and the caller's token first, then the last step's hidden state and draft. */
static void plan_draft(strata_context *c, const draft_job *j, int k) {
    int n = 0;
    for (int i = 0; i < j->n; i++) {
        int s = j->seqs[i], p = j->pos[i] - 1 + k;
        const int *rope = NULL;
        const float *h = k == 0 ? held(c, s, p, &rope) : NULL;
        if (k == 0 && !h) continue;
        if (k == 0) {
            c->mtp_row[n] = i;
            c->mtp_hrow[n] = h;
            c->mtp_tok[n] = j->tokens[i];
            int top = rope[0] > rope[1] ? rope[0] : rope[1];
            c->mtp_base[n] = 1 + (top > rope[2] ? top : rope[2]);  // text after p goes on from there
            for (int a = 0; a < 3; a++) c->mtp_rope[3 * n + a] = rope[a];
        } else {
            if (j->drafts[(size_t)i * j->n_draft] < 0) continue;
            c->mtp_hrow[n] = c->mtp_g + (size_t)n * c->model->hp.n_embd;  // row n kept its index: same rows
            c->mtp_tok[n] = c->mtp_next[n];
            for (int a = 0; a < 3; a++) c->mtp_rope[3 * n + a] = c->mtp_base[n] + k - 1;
        }
        c->mtp_embd[n] = -1;
        c->mtp_seq[n] = s;
        c->mtp_pos[n++] = p;
    }
    c->mtp_n = n;
}

/* Every thread's part of the drafts: per step, the block over the rows' pairs, their hidden states and logits,
 * and each row's greedy draft. */
static void draft_steps(int ith, int nth, void *arg) {
    const draft_job *j = arg;
    strata_context *c = j->c;
    const strata_model *m = c->model;
    const layer_weights *L = m->mtp;
    const matrix *head = L->nextn_head.data ? &L->nextn_head : &m->output;
    const float *head_norm = L->nextn_head_norm ? L->nextn_head_norm : m->output_norm;
    int64_t E = m->hp.n_embd, V = m->hp.n_vocab;
    team tm = {c->pool, ith, nth};
    fill_pending(&tm, c, NULL, 0);  // the rows of the history the drafts attend over
    for (int k = 0; k < j->n_draft; k++) {
        if (ith == 0) plan_draft(c, j, k);
        team_sync(&tm);
        int n = c->mtp_n;
        if (n == 0) break;
        pair_inputs(&tm, c, NULL, n);
        run_block(&tm, c, n);
        // g = shared_head_norm(x): the draft's hidden state, read by the next step; logits = g @ head
        rmsnorm_rows(&tm, c->mtp_g, c->x, head_norm, n, E, m->hp.rms_eps);
        team_sync(&tm);
        linear1(&tm, c, c->mtp_g, n, head, c->mtp_logits);
        range r = share(&tm, n);
        for (int64_t i = r.lo; i < r.hi; i++) {
            const float *row = c->mtp_logits + i * V;
            int at = c->mtp_row[i];
            c->mtp_next[i] = strata_argmax(row, (int)V);
            j->drafts[(size_t)at * j->n_draft + k] = c->mtp_next[i];
            if (j->logits) memcpy(j->logits + ((size_t)at * j->n_draft + k) * V, row, sizeof(float) * V);
        }
        team_sync(&tm);
    }
}

strata_status strata_mtp_draft(strata_context *c, int n, const int *seqs, const int *pos, const int *tokens,
                               int n_draft, int *drafts, float *logits) {
    if (!c->mtp) return engine_fail(STRATA_ERR_INVALID_ARG, "mtp_draft: the context runs no MTP block");
    if (n < 0 || n > c->n_batch || n_draft < 0 || (n > 0 && (!seqs || !pos || !tokens || !drafts)))
        return engine_fail(STRATA_ERR_INVALID_ARG, "mtp_draft: %d sequences (at most n_batch, %d), %d drafts each",
                           n, c->n_batch, n_draft);
    for (int i = 0; i < n; i++) {
        if (seqs[i] < 0 || seqs[i] >= c->n_seq)
            return engine_fail(STRATA_ERR_INVALID_ARG, "mtp_draft: sequence %d outside [0, %d)", seqs[i], c->n_seq);
        if (pos[i] < 1 || pos[i] + n_draft > c->n_ctx + 1)
            return engine_fail(STRATA_ERR_INVALID_ARG, "mtp_draft: %d drafts after position %d exceed the context "
                               "of %d", n_draft, pos[i], c->n_ctx);
        if (tokens[i] < 0 || tokens[i] >= c->model->hp.n_vocab)
            return engine_fail(STRATA_ERR_INVALID_ARG, "token id %d out of range [0, %d)", tokens[i],
                               c->model->hp.n_vocab);
        for (int e = 0; e < i; e++)
            if (seqs[e] == seqs[i]) return engine_fail(STRATA_ERR_INVALID_ARG, "mtp_draft: sequence %d twice", seqs[i]);
        for (int k = 0; k < n_draft; k++) drafts[(size_t)i * n_draft + k] = -1;
    }
    if (n == 0 || n_draft == 0) return STRATA_OK;
    for (int s = 0; s < c->n_seq; s++) c->mtp_upto[s] = c->mtp_filled[s];
    for (int i = 0; i < n; i++) {  // the pairs before pos[i] - 1 that the sequence's evals completed
        int upto = pos[i] - 1 < c->n_past[seqs[i]] - 1 ? pos[i] - 1 : c->n_past[seqs[i]] - 1;
        if (upto > c->mtp_upto[seqs[i]]) c->mtp_upto[seqs[i]] = upto;
        int first = upto - c->mtp_window;  // with a window, the last mtp_window waiting pairs at most
        if (c->mtp_window && first > c->mtp_filled[seqs[i]]) set_history(c, seqs[i], first, first);
    }
    draft_job job = {c, n, n_draft, seqs, pos, tokens, drafts, logits};
    strata_pool_run(c->pool, draft_steps, &job);
    for (int s = 0; s < c->n_seq; s++)  // the block's polls took these flags: the next eval acts on them
        if (c->dropped[s]) {
            atomic_store(&c->abort_flag[s], 1);
            c->dropped[s] = 0;
        }
    return STRATA_OK;
}

/* engine.c — the context holding several sequences, the batch step and the engine's public API; the model's
 * loading is model_load.c, the building blocks blocks.c, each architecture's layer arch_<family>.c (archs.c lists
 * them).
 * Threads: each chunk of tokens is one job on the context's thread pool (threadpool.h); every step inside it splits
 * its rows among the threads and ends at the pool's barrier, which orders it before the next step, so a small
 * decode pays no fork/join per product. */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "blocks.h"

// --- errors

static _Thread_local char last_error[512];

const char *strata_last_error(void) { return last_error; }

/* Record a message for strata_last_error and return `status`. */
strata_status engine_fail(strata_status status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, args);
    va_end(args);
    return status;
}

// --- context: the sequences' KV cache and scratch for one chunk

static size_t kv_elem_bytes(int kv_type) {
    return kv_type == STRATA_KV_F32 ? 4 : kv_type == STRATA_KV_F16 ? 2 : 1;
}

/* The recurrent layers' state of every sequence (zero: an empty sequence's) and the DeltaNet's scratch. */
static int alloc_recurrent(strata_context *c) {
    const strata_model *m = c->model;
    const strata_model_params *p = &m->hp;
    int64_t B = c->n_batch;
    c->state_floats = (size_t)m->n_rec_layer * (m->conv_state_floats + m->ssm_state_floats);
    c->state_valid = malloc(sizeof(int) * c->n_seq);
    c->seq_tokens = malloc(sizeof(int) * B);
    c->seq_first = malloc(sizeof(int) * (c->n_seq + 1));
    c->chunk_seqs = malloc(sizeof(int) * c->n_seq);
    c->rec_seq = calloc(c->n_seq, sizeof(float *));
    c->rec_spare = calloc(c->n_seq, sizeof(float *));
    c->ckpt = calloc(c->n_seq, 1);
    c->ckpt_pos = calloc(c->n_seq, sizeof(int));
    if (!c->state_valid || !c->seq_tokens || !c->seq_first || !c->chunk_seqs || !c->rec_seq || !c->rec_spare ||
        !c->ckpt || !c->ckpt_pos)
        return 0;
    for (int s = 0; s < c->n_seq; s++) c->state_valid[s] = 1;
    if (!m->n_rec_layer) return 1;
    c->rec_state = calloc((size_t)c->n_seq * c->state_floats, sizeof(float));
    for (int s = 0; c->rec_state && s < c->n_seq; s++) c->rec_seq[s] = c->rec_state + (size_t)s * c->state_floats;
    c->dn_qkv = malloc(sizeof(float) * B * m->conv_dim);
    c->dn_conv = malloc(sizeof(float) * B * m->conv_dim);
    c->dn_z = malloc(sizeof(float) * B * p->ssm_d_inner);
    c->dn_out = malloc(sizeof(float) * B * p->ssm_d_inner);
    c->dn_alpha = malloc(sizeof(float) * B * p->ssm_dt_rank);
    c->dn_beta = malloc(sizeof(float) * B * p->ssm_dt_rank);
    c->dn_work_floats = deltanet_work_floats(m);
    c->dn_work = malloc(sizeof(float) * c->n_threads * c->dn_work_floats);
    return c->rec_state && c->dn_qkv && c->dn_conv && c->dn_z && c->dn_out && c->dn_alpha && c->dn_beta &&
           c->dn_work;
}

static strata_status alloc_context(strata_context *c) {
    const strata_model_params *p = &c->model->hp;
    int64_t kv_dim = (int64_t)p->n_head_kv * p->head_dim, q_dim = (int64_t)p->n_head * p->head_dim;
    int64_t B = c->n_batch, k_used = c->model->is_moe ? p->n_expert_used : 1;
    int64_t n_ff_max = max64(c->model->is_moe ? p->n_ff_exp : p->n_ff, p->n_ff_shexp);  // per slot
    int64_t widest = max64(max64(max64(p->n_embd, q_dim), n_ff_max), p->ssm_d_inner);  // a product's input
    size_t cache_vals = (size_t)c->n_seq * c->n_kv_layer * c->n_ctx * kv_dim;
    c->act_row_max = sizeof(float) * widest;  // f32 is the widest activation type
    c->k_cache = malloc(cache_vals * c->kv_elem);
    c->v_cache = malloc(cache_vals * c->kv_elem);
    if (c->kv_type == STRATA_KV_INT8) {
        c->k_scale = malloc(sizeof(float) * cache_vals / p->head_dim);
        c->v_scale = malloc(sizeof(float) * cache_vals / p->head_dim);
    }
    c->x = malloc(sizeof(float) * B * p->n_embd);
    c->xb = malloc(sizeof(float) * B * p->n_embd);
    c->q = malloc(sizeof(float) * B * q_dim);
    c->k = malloc(sizeof(float) * B * kv_dim);
    c->v = malloc(sizeof(float) * B * kv_dim);
    c->att = malloc(sizeof(float) * B * q_dim);
    c->scores = malloc(sizeof(float) * c->n_threads * (p->n_head / p->n_head_kv) * c->n_ctx);
    c->hb = malloc(sizeof(float) * B * k_used * n_ff_max);  // k_used * n_ff_exp or the shared expert's n_ff_shexp
    c->hb2 = malloc(sizeof(float) * B * k_used * n_ff_max);
    c->xq = malloc(c->act_row_max * B * k_used);
    c->n_past = calloc(c->n_seq, sizeof(int));
    c->abort_flag = calloc(c->n_seq, sizeof(atomic_int));
    c->dropped = calloc(c->n_seq, sizeof(int));
    c->chunk_rope = malloc(sizeof(int) * 3 * B);
    if (c->model->gated_attn) c->qg = malloc(sizeof(float) * B * 2 * q_dim);
    if (p->n_ff_shexp > 0) {
        c->shexp_out = malloc(sizeof(float) * B * p->n_embd);
        c->shexp_gate = malloc(sizeof(float) * B);
    }
    if (c->model->mrope) {
        c->rope_t = malloc(sizeof(int) * c->n_seq * c->n_ctx);
        c->rope_next = malloc(sizeof(int) * c->n_seq * c->n_ctx);
    }
    int **chunk[] = {&c->chunk_token, &c->chunk_seq, &c->chunk_pos, &c->chunk_embd, &c->chunk_out};
    int ok = c->k_cache && c->v_cache && c->x && c->xb && c->q && c->k && c->v && c->att && c->scores &&
             c->hb && c->hb2 && c->xq && (c->kv_type != STRATA_KV_INT8 || (c->k_scale && c->v_scale)) &&
             c->n_past && c->abort_flag && c->dropped && c->chunk_rope &&
             (!c->model->mrope || (c->rope_t && c->rope_next)) && (!c->model->gated_attn || c->qg) &&
             (p->n_ff_shexp <= 0 || (c->shexp_out && c->shexp_gate)) && alloc_recurrent(c) &&
             (!c->mtp || mtp_alloc(c));
    for (size_t i = 0; i < sizeof chunk / sizeof chunk[0]; i++) ok = ok && (*chunk[i] = malloc(sizeof(int) * B));
    for (int s = 0; ok && s < c->n_seq; s++) atomic_init(&c->abort_flag[s], 0);
    if (c->model->is_moe) {
        int64_t blocks = (p->n_ff_exp + ROWS_PER_TASK - 1) / ROWS_PER_TASK + (p->n_embd + ROWS_PER_TASK - 1) /
                         ROWS_PER_TASK;  // gate/up tasks, then down tasks, per expert
        c->moe_out = malloc(sizeof(float) * B * k_used * p->n_embd);
        c->router = malloc(sizeof(float) * B * p->n_expert);
        c->xq_slots = malloc(c->act_row_max * B * k_used);
        c->slot_of = malloc(sizeof(int) * B * k_used);
        c->choice_weight = malloc(sizeof(float) * B * k_used);
        c->slot_token = malloc(sizeof(int) * B * k_used);
        c->expert_start = malloc(sizeof(int) * p->n_expert);
        c->expert_count = malloc(sizeof(int) * p->n_expert);
        c->tasks = malloc(sizeof(int) * 2 * p->n_expert * blocks);
        ok = ok && c->moe_out && c->router && c->xq_slots && c->slot_of && c->choice_weight && c->slot_token &&
             c->expert_start && c->expert_count && c->tasks;
    }
    return ok ? STRATA_OK : engine_fail(STRATA_ERR_NOMEM, "out of memory for a context of %d x %d positions", c->n_seq,
                                 c->n_ctx);
}

static strata_status check_context_params(const strata_model *m, const strata_context_params *p) {
    if (p->n_ctx <= 0 || p->n_seq <= 0 || p->n_batch <= 0 || p->n_threads <= 0)
        return engine_fail(STRATA_ERR_INVALID_ARG, "n_ctx, n_seq, n_batch and n_threads must be positive");
    if (p->n_ctx > m->hp.n_ctx_train)
        return engine_fail(STRATA_ERR_INVALID_ARG, "context of %d positions is larger than the model's %d", p->n_ctx,
                    m->hp.n_ctx_train);
    if (p->kv_type != STRATA_KV_F32 && p->kv_type != STRATA_KV_F16 && p->kv_type != STRATA_KV_INT8)
        return engine_fail(STRATA_ERR_INVALID_ARG, "unknown KV cache type %d", p->kv_type);
    if (p->mtp && !m->mtp)
        return engine_fail(STRATA_ERR_INVALID_ARG, "mtp: the %s model has no MTP block", m->arch);
    if (p->mtp && (p->mtp_window < 0 || p->mtp_window > STRATA_MTP_HISTORY))
        return engine_fail(STRATA_ERR_INVALID_ARG, "mtp_window %d outside [0, %d]", p->mtp_window, STRATA_MTP_HISTORY);
    return STRATA_OK;
}

strata_status strata_context_create(const strata_model *model, const strata_context_params *params,
                                    strata_context **out) {
    *out = NULL;
    if (!model || !params) return engine_fail(STRATA_ERR_INVALID_ARG, "no model or context parameters");
    strata_status st = check_context_params(model, params);
    if (st != STRATA_OK) return st;
    strata_context *c = calloc(1, sizeof *c);
    if (!c) return engine_fail(STRATA_ERR_NOMEM, "out of memory");
    c->model = model;
    c->n_ctx = params->n_ctx;
    c->n_seq = params->n_seq;
    c->n_batch = params->n_batch < params->n_ctx ? params->n_batch : params->n_ctx;
    c->n_threads = params->n_threads;
    c->kv_type = params->kv_type;
    c->kv_elem = kv_elem_bytes(params->kv_type);
    c->mtp = params->mtp != 0;
    c->mtp_window = c->mtp ? params->mtp_window : 0;
    c->n_kv_layer = model->n_kv_layer + c->mtp;
    c->pool = strata_pool_create(c->n_threads);
    if (!c->pool) st = engine_fail(STRATA_ERR_NOMEM, "could not start %d threads", c->n_threads);
    else st = alloc_context(c);
    if (st != STRATA_OK) {
        strata_context_free(c);
        return st;
    }
    *out = c;
    return STRATA_OK;
}

void strata_context_free(strata_context *c) {
    if (!c) return;
    strata_pool_free(c->pool);
    void *bufs[] = {c->k_cache, c->v_cache, c->k_scale, c->v_scale, c->x, c->xb, c->q, c->k, c->v, c->att,
                    c->scores, c->hb, c->hb2, c->moe_out, c->router, c->xq, c->xq_slots, c->slot_of,
                    c->choice_weight, c->slot_token, c->expert_start, c->expert_count, c->tasks, c->n_past,
                    (void *)c->abort_flag, c->dropped, c->chunk_token, c->chunk_seq, c->chunk_pos, c->chunk_embd,
                    c->chunk_out, c->chunk_rope, c->rope_t, c->rope_next, c->draw_work, c->draw_idx,
                    c->rec_state, c->state_valid, c->qg, c->shexp_out, c->shexp_gate, c->dn_qkv, c->dn_conv,
                    c->dn_z, c->dn_alpha, c->dn_beta, c->dn_out, c->dn_work, c->seq_tokens, c->seq_first,
                    c->chunk_seqs, (void *)c->rec_seq, c->rec_spare_block, (void *)c->rec_spare, c->ckpt,
                    c->ckpt_pos};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    mtp_free(c);
    free(c);
}

int strata_n_seq(const strata_context *c) { return c->n_seq; }

int strata_n_ctx(const strata_context *c) { return c->n_ctx; }

size_t strata_kv_bytes(const strata_context *c) {
    const strata_model_params *p = &c->model->hp;
    size_t rows = (size_t)c->n_seq * c->n_kv_layer * p->n_head_kv * c->n_ctx;  // of head_dim values, K and V
    return 2 * rows * (p->head_dim * c->kv_elem + (c->kv_type == STRATA_KV_INT8 ? sizeof(float) : 0));
}

size_t strata_state_bytes(const strata_context *c) { return sizeof(float) * c->state_floats; }

/* Sequence seq's recurrent state = an empty sequence's (zero), valid. */
static void clear_state(strata_context *c, int seq) {
    if (c->state_floats) memset(c->rec_seq[seq], 0, strata_state_bytes(c));
    c->state_valid[seq] = 1;
    c->ckpt[seq] = CKPT_NONE;
}

static strata_status check_seq(const strata_context *c, int seq) {
    if (seq < 0 || seq >= c->n_seq)
        return engine_fail(STRATA_ERR_INVALID_ARG, "sequence %d outside [0, %d)", seq, c->n_seq);
    return STRATA_OK;
}

int strata_n_past(const strata_context *c, int seq) { return check_seq(c, seq) == STRATA_OK ? c->n_past[seq] : -1; }

strata_status strata_keep(strata_context *c, int seq, int n) {
    strata_status st = check_seq(c, seq);
    if (st != STRATA_OK) return st;
    if (n < 0 || n > c->n_past[seq])
        return engine_fail(STRATA_ERR_INVALID_ARG, "keep(%d): sequence %d holds %d positions", n, seq, c->n_past[seq]);
    if (n == 0) clear_state(c, seq);
    else if (n < c->n_past[seq] && c->state_floats) c->state_valid[seq] = 0;  // the state cannot be cut back
    c->n_past[seq] = n;  // the rows past n are overwritten by the next eval
    if (c->mtp) mtp_keep(c, seq, n);
    return STRATA_OK;
}

// --- recurrent state

strata_status strata_state_save(const strata_context *c, int seq, void *buf) {
    strata_status st = check_seq(c, seq);
    if (st != STRATA_OK) return st;
    if (!c->state_valid[seq])
        return engine_fail(STRATA_ERR_INVALID_ARG, "sequence %d: its recurrent state was cut back; nothing to save", seq);
    if (c->state_floats) memcpy(buf, c->rec_seq[seq], strata_state_bytes(c));
    return STRATA_OK;
}

strata_status strata_state_load(strata_context *c, int seq, const void *buf) {
    strata_status st = check_seq(c, seq);
    if (st != STRATA_OK) return st;
    if (c->state_floats) memcpy(c->rec_seq[seq], buf, strata_state_bytes(c));
    c->state_valid[seq] = 1;
    c->ckpt[seq] = CKPT_NONE;
    return STRATA_OK;
}

strata_status strata_state_checkpoint(strata_context *c, int seq) {
    strata_status st = check_seq(c, seq);
    if (st != STRATA_OK) return st;
    if (!c->state_valid[seq])
        return engine_fail(STRATA_ERR_INVALID_ARG, "sequence %d: its recurrent state was cut back; no checkpoint", seq);
    if (!c->state_floats) return STRATA_OK;
    if (!c->rec_spare_block) {  // the spares, at the first checkpoint: a context that drafts nothing has none
        c->rec_spare_block = malloc(sizeof(float) * (size_t)c->n_seq * c->state_floats);
        if (!c->rec_spare_block) return engine_fail(STRATA_ERR_NOMEM, "out of memory for the states' checkpoints");
        for (int s = 0; s < c->n_seq; s++) c->rec_spare[s] = c->rec_spare_block + (size_t)s * c->state_floats;
    }
    c->ckpt[seq] = CKPT_DUE;
    c->ckpt_pos[seq] = c->n_past[seq];
    return STRATA_OK;
}

strata_status strata_state_restore(strata_context *c, int seq) {
    strata_status st = check_seq(c, seq);
    if (st != STRATA_OK) return st;
    if (!c->state_floats) return STRATA_OK;
    if (c->ckpt[seq] != CKPT_TAKEN || c->ckpt_pos[seq] != c->n_past[seq])
        return engine_fail(STRATA_ERR_INVALID_ARG, "sequence %d holds %d positions: no checkpoint of its state there",
                           seq, c->n_past[seq]);
    float *state = c->rec_seq[seq];  // the spare holds the state at the checkpoint: the two change places
    c->rec_seq[seq] = c->rec_spare[seq];
    c->rec_spare[seq] = state;
    c->state_valid[seq] = 1;
    c->ckpt[seq] = CKPT_NONE;
    return STRATA_OK;
}

strata_status strata_abort(strata_context *c, int seq) {
    strata_status st = check_seq(c, seq);
    if (st == STRATA_OK) atomic_store(&c->abort_flag[seq], 1);
    return st;
}

strata_status strata_clear_abort(strata_context *c, int seq) {
    strata_status st = check_seq(c, seq);
    if (st == STRATA_OK) atomic_store(&c->abort_flag[seq], 0);
    return st;
}

void strata_get_timings(const strata_context *c, strata_timings *out) { *out = c->timings; }

double strata_cpu_seconds(const strata_context *c) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec + strata_pool_worker_seconds(c->pool);
}

// --- draws of several rows

typedef struct {
    strata_context *c;
    int n_rows, n;
    const float *const *rows;
    const strata_sampling *settings;
    const double *u;
    int *tokens;
} draws_job;

static void draws(int ith, int nth, void *arg) {
    (void)nth;
    const draws_job *j = arg;
    float *work = j->c->draw_work + (size_t)ith * j->n;
    int *idx = j->c->draw_idx + (size_t)ith * j->n;
    for (int k; (k = strata_pool_next(j->c->pool)) < j->n_rows;)  // the pool's counter: the job's end resets it
        j->tokens[k] = j->settings[k].temperature > 0.0f
                           ? strata_sample(j->rows[k], j->n, &j->settings[k], j->u[k], work, idx)
                           : strata_argmax(j->rows[k], j->n);
}

strata_status strata_sample_rows(strata_context *c, int n_rows, const float *const *rows, int n,
                                 const strata_sampling *settings, const double *u, int *tokens) {
    if (n_rows < 0 || n <= 0 || (n_rows > 0 && (!rows || !settings || !u || !tokens)))
        return engine_fail(STRATA_ERR_INVALID_ARG, "draws need rows of at least one logit, their settings and u");
    if (n > c->draw_n) {  // every thread's scratch for a draw, kept for the next
        free(c->draw_work);
        free(c->draw_idx);
        c->draw_work = malloc(sizeof(float) * c->n_threads * (size_t)n);
        c->draw_idx = malloc(sizeof(int) * c->n_threads * (size_t)n);
        c->draw_n = c->draw_work && c->draw_idx ? n : 0;
        if (!c->draw_n) return engine_fail(STRATA_ERR_NOMEM, "out of memory for the draws' scratch");
    }
    draws_job job = {c, n_rows, n, rows, settings, u, tokens};
    strata_pool_run(c->pool, draws, &job);
    return STRATA_OK;
}

// --- KV cache: a sequence's prefix copied into another

strata_status strata_copy_prefix(strata_context *c, int src, int dst, int n) {
    strata_status st = check_seq(c, src);
    if (st == STRATA_OK) st = check_seq(c, dst);
    if (st != STRATA_OK) return st;
    if (n < 0 || n > c->n_past[src])
        return engine_fail(STRATA_ERR_INVALID_ARG, "copy of %d positions: sequence %d holds %d", n, src, c->n_past[src]);
    if (src == dst) return strata_keep(c, dst, n);
    const strata_model_params *p = &c->model->hp;
    size_t row = p->head_dim * c->kv_elem;
    for (int il = 0; il < p->n_layer + c->mtp; il++)  // the trunk's attention layers, then the MTP block's
        for (int h = 0; (il >= p->n_layer || !c->model->recurrent[il]) && h < p->n_head_kv; h++) {
            size_t from = kv_base(c, src, il, h), to = kv_base(c, dst, il, h);
            memcpy((char *)c->k_cache + to * row, (const char *)c->k_cache + from * row, n * row);
            memcpy((char *)c->v_cache + to * row, (const char *)c->v_cache + from * row, n * row);
            if (c->kv_type == STRATA_KV_INT8) {
                memcpy(c->k_scale + to, c->k_scale + from, sizeof(float) * n);
                memcpy(c->v_scale + to, c->v_scale + from, sizeof(float) * n);
            }
        }
    if (c->mtp) mtp_copy_prefix(c, src, dst, n);
    if (c->model->mrope) {
        memcpy(c->rope_t + (size_t)dst * c->n_ctx, c->rope_t + (size_t)src * c->n_ctx, sizeof(int) * n);
        memcpy(c->rope_next + (size_t)dst * c->n_ctx, c->rope_next + (size_t)src * c->n_ctx, sizeof(int) * n);
    }
    if (n == 0) {
        clear_state(c, dst);
    } else if (n == c->n_past[src]) {  // the state at n is src's own
        if (c->state_floats) memcpy(c->rec_seq[dst], c->rec_seq[src], strata_state_bytes(c));
        c->state_valid[dst] = c->state_valid[src];
    } else if (c->state_floats) {
        c->state_valid[dst] = 0;
    }
    c->ckpt[dst] = CKPT_NONE;  // its checkpoint was of another history
    c->n_past[dst] = n;
    return STRATA_OK;
}

// --- forward pass of one chunk

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}


/* One chunk's forward pass, as a job for the pool. */
typedef struct {
    strata_context *c;
    const float *embd_rows;        // (n_embd_rows, n_embd)
    int n_tok;
    float *logits;                 // the caller's (n_out, n_vocab)
} chunk_job;

/* Every thread's part of a chunk: embeddings, every layer (the abort flags polled before the end of its
 * attention and of its feed-forward, and the answer acted on after each: a long prompt's chunk spends about a
 * layer's time in each), logits, and with mtp the chunk's hidden states kept for the MTP block (mtp.c). */
static void forward_job(int ith, int nth, void *arg) {
    const chunk_job *j = arg;
    strata_context *c = j->c;
    const strata_model *m = c->model;
    team tm = {c->pool, ith, nth};
    block_embed(&tm, c, j->embd_rows, j->n_tok);
    block_poll_aborts(&tm, c, 0, j->n_tok);
    team_sync(&tm);
    int stop = 0;
    for (int il = 0; !(stop = team_stopped(c, 0)) && il < m->hp.n_layer; il++)
        if ((stop = m->layer(&tm, c, il, j->embd_rows, j->n_tok))) break;
    if (!stop) {
        team_sync(&tm);  // the output's runs of tokens need not be this thread's share of x
        if (ith == 0) c->output_t0 = now_ms();
        block_output_logits(&tm, c, j->n_tok, j->logits);
        if (c->mtp) mtp_fill(&tm, c, j->embd_rows, j->n_tok);
    }
    if (ith == 0) c->stop = stop;  // for the caller, once the job is done
}

// --- eval: validation, chunking, timings

/* Check the call's tokens: sequences in range, each sequence's positions following on from what it holds, token
 * ids in range where no embedding row replaces them, embedding rows at distinct indices. embd_at (n_tokens) = the
 * row replacing each token, or -1. */
static strata_status check_batch(const strata_context *c, const strata_batch *b, int *embd_at) {
    if (b->n_tokens <= 0 || !b->tokens || !b->seq || !b->pos)
        return engine_fail(STRATA_ERR_INVALID_ARG, "eval needs at least one token, with its sequence and position");
    if (b->n_embd_rows < 0 || (b->n_embd_rows > 0 && (!b->embd_rows || !b->embd_index)))
        return engine_fail(STRATA_ERR_INVALID_ARG, "embedding rows without their indices");
    if (b->n_out > 0 && (!b->out_index || !b->logits))
        return engine_fail(STRATA_ERR_INVALID_ARG, "logits rows without their indices or buffer");
    for (int t = 0; t < b->n_tokens; t++) embd_at[t] = -1;
    for (int r = 0; r < b->n_embd_rows; r++) {
        int t = b->embd_index[r];
        if (t < 0 || t >= b->n_tokens) return engine_fail(STRATA_ERR_INVALID_ARG, "embedding row %d at index %d, outside "
                                                   "the %d tokens", r, t, b->n_tokens);
        if (embd_at[t] >= 0) return engine_fail(STRATA_ERR_INVALID_ARG, "two embedding rows at index %d", t);
        const int *at = b->embd_grid ? b->embd_grid + 2 * r : NULL;
        if (at && !(at[0] == -1 && at[1] == -1) && (at[0] < 0 || at[0] >= c->n_ctx || at[1] < 0 || at[1] >= c->n_ctx))
            return engine_fail(STRATA_ERR_INVALID_ARG, "embedding row %d at (%d, %d) of its picture's grid, outside "
                        "[0, %d)", r, at[0], at[1], c->n_ctx);
        embd_at[t] = r;
    }
    for (int r = 0; r < b->n_out; r++)
        if (b->out_index[r] < 0 || b->out_index[r] >= b->n_tokens || (r > 0 && b->out_index[r] <= b->out_index[r - 1]))
            return engine_fail(STRATA_ERR_INVALID_ARG, "logits indices must be increasing token indices; %d at row %d",
                        b->out_index[r], r);
    int *next = c->dropped;  // scratch here: the position each sequence's next token must have
    for (int s = 0; s < c->n_seq; s++) next[s] = c->n_past[s];
    strata_status st = STRATA_OK;
    for (int t = 0; t < b->n_tokens && st == STRATA_OK; t++) {
        int s = b->seq[t];
        if (s < 0 || s >= c->n_seq)
            st = engine_fail(STRATA_ERR_INVALID_ARG, "token %d: sequence %d outside [0, %d)", t, s, c->n_seq);
        else if (b->pos[t] != next[s])
            st = engine_fail(STRATA_ERR_INVALID_ARG, "token %d: position %d, but sequence %d continues at %d", t, b->pos[t],
                      s, next[s]);
        else if (next[s]++ >= c->n_ctx)
            st = engine_fail(STRATA_ERR_CONTEXT_FULL, "sequence %d: %d positions held + the call's exceed the context of %d",
                      s, c->n_past[s], c->n_ctx);
        else if (!c->state_valid[s])
            st = engine_fail(STRATA_ERR_INVALID_ARG, "token %d: sequence %d's recurrent state was cut back (keep or "
                             "copy_prefix to fewer positions than it held): load a saved state or keep(0)", t, s);
        else if (embd_at[t] < 0 && (b->tokens[t] < 0 || b->tokens[t] >= c->model->hp.n_vocab))
            st = engine_fail(STRATA_ERR_INVALID_ARG, "token id %d out of range [0, %d)", b->tokens[t], c->model->hp.n_vocab);
    }
    memset(c->dropped, 0, sizeof(int) * c->n_seq);
    return st;
}

/* The chunk's tokens grouped by sequence, each sequence's in order (its positions'): seq_first, seq_tokens and
 * the list of the chunk's sequences. */
static void group_by_sequence(strata_context *c, int n_tok) {
    memset(c->seq_first, 0, sizeof(int) * (c->n_seq + 1));
    for (int t = 0; t < n_tok; t++) c->seq_first[c->chunk_seq[t] + 1]++;
    c->n_chunk_seqs = 0;
    for (int s = 0; s < c->n_seq; s++) {
        if (c->seq_first[s + 1]) c->chunk_seqs[c->n_chunk_seqs++] = s;
        c->seq_first[s + 1] += c->seq_first[s];
    }
    for (int q = 0; q < c->n_chunk_seqs; q++) {
        int s = c->chunk_seqs[q], at = c->seq_first[s];
        for (int t = 0; t < n_tok; t++)
            if (c->chunk_seq[t] == s) c->seq_tokens[at++] = t;
    }
}

/* rope (n_tokens, 3) = each token's RoPE position (t, h, w), by the rules of strata_batch; with multi-axis RoPE
 * each one is also kept with its position in the sequence's arrays (positions past n_past are only scratch until
 * a finished chunk takes them in). The batch is checked: each sequence's positions follow on. */
static void rope_positions(const strata_context *c, const strata_batch *b, const int *embd_at, int *rope) {
    for (int t = 0; t < b->n_tokens; t++) {
        int p = b->pos[t], *out = rope + 3 * t;
        if (!c->model->mrope) {
            out[0] = out[1] = out[2] = p;
            continue;
        }
        int *pos_t = c->rope_t + (size_t)b->seq[t] * c->n_ctx, *next = c->rope_next + (size_t)b->seq[t] * c->n_ctx;
        int text = p > 0 ? next[p - 1] : 0, r = embd_at[t];
        if (r >= 0 && b->embd_grid && b->embd_grid[2 * r] >= 0) {
            int row = b->embd_grid[2 * r], col = b->embd_grid[2 * r + 1];
            int start = (row == 0 && col == 0) || p == 0 ? text : pos_t[p - 1];
            out[0] = start, out[1] = start + row, out[2] = start + col;
        } else {
            out[0] = out[1] = out[2] = text;
        }
        pos_t[p] = out[0];
        int top = out[0] > out[1] ? out[0] : out[1];
        next[p] = 1 + (top > out[2] ? top : out[2]);
    }
}

strata_status strata_eval_batch(strata_context *c, const strata_batch *b) {
    double t0 = now_ms();
    memset(&c->timings, 0, sizeof c->timings);
    if (!b) return engine_fail(STRATA_ERR_INVALID_ARG, "no batch");
    if (b->notify_fd >= 0) {  // first: whoever waits on it runs while this call computes
        uint64_t one = 1;
        if (write(b->notify_fd, &one, sizeof one) < 0) {}  // full or closed: the waiter has had its wake-up
    }
    int n_alloc = b->n_tokens > 0 ? b->n_tokens : 1;
    int *embd_at = malloc(sizeof(int) * n_alloc), *rope = malloc(sizeof(int) * 3 * n_alloc);
    if (!embd_at || !rope) {
        free(embd_at);
        free(rope);
        return engine_fail(STRATA_ERR_NOMEM, "out of memory");
    }
    strata_status st = check_batch(c, b, embd_at);
    if (st == STRATA_OK) rope_positions(c, b, embd_at, rope);
    if (b->seq_dropped && st == STRATA_OK) memset(b->seq_dropped, 0, sizeof(int) * c->n_seq);
    // Chunks of up to n_batch tokens, taken in call order, skipping the tokens of dropped sequences.
    for (int t = 0, out = 0; st == STRATA_OK && t < b->n_tokens;) {
        int n = 0;
        for (; t < b->n_tokens && n < c->n_batch; t++) {
            int want = out < b->n_out && b->out_index[out] == t;
            out += want;
            if (c->dropped[b->seq[t]]) continue;
            c->chunk_token[n] = b->tokens[t];
            c->chunk_seq[n] = b->seq[t];
            c->chunk_pos[n] = b->pos[t];
            memcpy(c->chunk_rope + 3 * n, rope + 3 * t, sizeof(int) * 3);
            c->chunk_embd[n] = embd_at[t];
            c->chunk_out[n++] = want ? out - 1 : -1;
        }
        if (n == 0) break;
        group_by_sequence(c, n);
        chunk_job job = {c, b->embd_rows, n, b->logits};
        strata_pool_run(c->pool, forward_job, &job);
        if (!c->stop) c->timings.output_ms += now_ms() - c->output_t0;
        for (int i = 0; i < n; i++) {  // a finished chunk joins the cache of each sequence not dropped
            int seq = c->chunk_seq[i];
            if (!c->dropped[seq]) c->n_past[seq] = c->chunk_pos[i] + 1;
            else if (c->mtp) mtp_keep(c, seq, c->n_past[seq]);  // its pairs in the chunk wait for it again
        }
        for (int q = 0; q < c->n_chunk_seqs; q++) {  // a due checkpoint is taken by its sequence's first chunk
            int s = c->chunk_seqs[q];
            if (c->ckpt[s] == CKPT_DUE) c->ckpt[s] = c->dropped[s] ? CKPT_NONE : CKPT_TAKEN;
        }
        c->timings.n_tokens += n;
        c->timings.n_chunks++;
    }
    int n_dropped = 0;
    for (int s = 0; s < c->n_seq; s++) {
        n_dropped += c->dropped[s];
        if (b->seq_dropped) b->seq_dropped[s] = c->dropped[s];
        // its state took in part of a chunk its cache did not: invalid until a snapshot is loaded or keep(0); the
        // finished chunks' KV rows stay, so a snapshot at any position before n_past resumes it
        if (c->dropped[s] && c->state_floats) c->state_valid[s] = 0;
    }
    memset(c->dropped, 0, sizeof(int) * c->n_seq);
    free(embd_at);
    free(rope);
    c->timings.total_ms = now_ms() - t0;
    if (st == STRATA_OK && n_dropped)
        st = engine_fail(STRATA_ABORTED, "aborted: %d of the call's sequences dropped", n_dropped);
    return st;
}

// --- routing record: each MoE layer's choices, for the expert cache's traces

strata_status strata_record_routing(strata_context *c, int *buf, long long capacity) {
    if (buf && capacity < 0) return engine_fail(STRATA_ERR_INVALID_ARG, "a routing record of %lld ints", capacity);
    c->route_rec = buf;
    c->route_cap = buf ? capacity : 0;
    c->route_used = 0;
    return STRATA_OK;
}

long long strata_routing_used(const strata_context *c) { return c->route_used; }

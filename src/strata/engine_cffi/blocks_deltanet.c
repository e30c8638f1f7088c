/* blocks_deltanet.c — the Gated DeltaNet layer (Qwen3.5's linear attention) and the recurrent state it carries per
 * sequence. For each token: q, k, v = a short causal convolution (with SiLU) over the channels of x @ Wqkv, whose
 * last d_conv - 1 inputs are the sequence's conv state; q and k heads L2-normed (q also by 1/sqrt(head size));
 * per v head a decay g = a * softplus(alpha + dt_bias) (a < 0) and a write strength beta = sigmoid(b). Each v head
 * h keeps a state S (head_k_dim x head_v_dim) and reads q/k head h % n_k_heads (the converter writes v heads
 * tiled over the k heads):
 *     S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q
 * the gated delta rule. A sequence's run of up to RECURRENT_RUN tokens (a decode step, and one verifying a
 * speculative draft) takes that step token by token (the recurrent form): a draft's tokens are then computed as
 * decode computes them, bit for bit, and greedy speculation keeps the answer of decode where two tokens' logits
 * nearly tie (the chunked form rounds otherwise: a random Q8_0 qwen35moe's greedy answer changed at its 29th
 * token, a margin of 0.7% of the logits' std). Longer runs take it in chunks of CHUNK tokens (the chunked form, as Hugging Face's torch_chunk_gated_delta_rule): within a chunk the updates
 * are solved at once by forward substitution over a unit lower-triangular system, and the state is read and
 * written once per chunk, the work in blocked products. Then o = rmsnorm(o) * w * silu(z) per head (the gated
 * RMS norm) and x += o @ Wout. The team's units are (sequence, v head) pairs. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"

#define CHUNK 64          /* tokens of the chunked form's blocks */
#define RECURRENT_RUN 16  /* a sequence's tokens in a chunk up to which the recurrent form takes them */
#define CONV_CHANNELS 64  /* channels per unit of the convolution */

/* Floats of the scratch for one head's chunk, heads of dk values: q, k, v, o rows and g, beta (head_of_sequence),
 * then chunk_step's W rows, A, QK and gc; the recurrent step's 2 dv fit in the first of them. */
size_t deltanet_head_floats(size_t dk) {
    size_t dv = dk;
    return 2 * CHUNK * dk + 2 * CHUNK * dv + 2 * CHUNK + CHUNK * dk + 2 * CHUNK * CHUNK + CHUNK;
}

/* Floats of a thread's scratch (engine.c allocates n_threads of them). */
size_t deltanet_work_floats(const strata_model *m) { return deltanet_head_floats((size_t)m->hp.ssm_d_state); }

static float silu(float x) { return x / (1.0f + expf(-x)); }

static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }  // torch's threshold of 20

/* One channel of the convolution over n tokens of a sequence: out[tokens[i] * stride] = silu(w . the last d_conv
 * inputs) for in[tokens[i] * stride], in order, starting from state (the d_conv - 1 inputs before them, oldest
 * first), which then takes the last ones. */
void deltanet_conv_channel(const float *w, int d_conv, float *state, const float *in, float *out, size_t stride,
                           const int *tokens, int n) {
    const int K = d_conv;
    float win[K];  // the last K inputs, oldest first
    memcpy(win, state, sizeof(float) * (K - 1));
    for (int i = 0; i < n; i++) {
        size_t at = (size_t)tokens[i] * stride;
        win[K - 1] = in[at];
        float acc = 0.0f;
        for (int j = 0; j < K; j++) acc += w[j] * win[j];
        out[at] = silu(acc);
        memmove(win, win + 1, sizeof(float) * (K - 1));
    }
    memcpy(state, win, sizeof(float) * (K - 1));
}

/* dn_conv rows = silu(causal convolution of dn_qkv rows), per sequence over its tokens in order, starting from its
 * conv state (the d_conv - 1 inputs before them, per channel oldest first), which then takes the last ones.
 * Units: runs of CONV_CHANNELS channels. */
static void convolve(const team *tm, strata_context *c, const layer_weights *L, int il) {
    const strata_model *m = c->model;
    const int K = m->hp.ssm_d_conv;
    const int64_t C = m->conv_dim, units = (C + CONV_CHANNELS - 1) / CONV_CHANNELS;
    for (int64_t u; (u = team_next(tm)) < units;) {
        int64_t ch0 = u * CONV_CHANNELS, ch1 = min64(ch0 + CONV_CHANNELS, C);
        for (int q = 0; q < c->n_chunk_seqs; q++) {
            int s = c->chunk_seqs[q];
            float *state = rec_state_of(c, s, il), *spare = rec_spare_of(c, s, il);  // (conv_dim, K - 1)
            if (spare)  // its checkpoint: the channels' rows as they were
                memcpy(spare + ch0 * (K - 1), state + ch0 * (K - 1), sizeof(float) * (size_t)(ch1 - ch0) * (K - 1));
            const int *tokens = c->seq_tokens + c->seq_first[s];
            int n = c->seq_first[s + 1] - c->seq_first[s];
            for (int64_t ch = ch0; ch < ch1; ch++)
                deltanet_conv_channel(L->ssm_conv + ch * K, K, state + ch * (K - 1), c->dn_qkv + ch, c->dn_conv + ch,
                                      C, tokens, n);
        }
    }
    team_sync(tm);
}

/* x *= scale / sqrt(sum(x^2) + 1e-6) over n values (Hugging Face's l2norm, whose epsilon is fixed). */
void deltanet_l2norm(float *x, int n, float scale) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float f = scale / sqrtf(ss + 1e-6f);
    for (int i = 0; i < n; i++) x[i] *= f;
}

/* A token's gates per v head, in place: alpha -> g = a softplus(alpha + dt_bias) (the decay's log), b -> beta =
 * sigmoid(b) (the write strength). */
void deltanet_gates(float *alpha, float *beta, const float *a, const float *dt_bias, int n_heads) {
    for (int h = 0; h < n_heads; h++) {
        alpha[h] = a[h] * softplus(alpha[h] + dt_bias[h]);
        beta[h] = 1.0f / (1.0f + expf(-beta[h]));
    }
}

/* Per token, this thread's share: q, k heads L2-normed (q by 1/sqrt(head size) too); alpha -> g (the decay's
 * log, in place), b -> beta (in place). No barrier. */
static void gates_and_norms(const team *tm, strata_context *c, const layer_weights *L, int n_tok) {
    const strata_model_params *p = &c->model->hp;
    const int dk = p->ssm_d_state, hk = p->ssm_n_group, hv = p->ssm_dt_rank;
    const int64_t C = c->model->conv_dim;
    const float q_scale = 1.0f / sqrtf((float)dk);
    range r = share(tm, n_tok);
    for (int64_t t = r.lo; t < r.hi; t++) {
        float *row = c->dn_conv + t * C, *alpha = c->dn_alpha + t * hv, *beta = c->dn_beta + t * hv;
        for (int h = 0; h < hk; h++) {
            deltanet_l2norm(row + (size_t)h * dk, dk, q_scale);
            deltanet_l2norm(row + (size_t)(hk + h) * dk, dk, 1.0f);
        }
        deltanet_gates(alpha, beta, L->ssm_a, L->ssm_dt, hv);
    }
}

/* y (dv) += a * x (dv) */
static inline void axpy(float *restrict y, float a, const float *restrict x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One token's step of the rule on S (dk x dv): o = the output. work: 2 dv floats. */
static void recurrent_step(float *restrict S, const float *q, const float *k, const float *v, float g, float beta,
                           int dk, int dv, float *restrict o, float *restrict work) {
    float decay = expf(g), *kv = work, *delta = work + dv;
    memset(kv, 0, sizeof(float) * dv);
    for (int i = 0; i < dk; i++) {  // S = exp(g) S; kv = S^T k
        float *row = S + (size_t)i * dv;
        for (int j = 0; j < dv; j++) row[j] *= decay;
        axpy(kv, k[i], row, dv);
    }
    for (int j = 0; j < dv; j++) delta[j] = beta * (v[j] - kv[j]);
    memset(o, 0, sizeof(float) * dv);
    for (int i = 0; i < dk; i++) {  // S += k delta^T; o = S^T q
        float *row = S + (size_t)i * dv;
        axpy(row, k[i], delta, dv);
        axpy(o, q[i], row, dv);
    }
}

/* One head's chunk of L <= CHUNK tokens by the chunked form, on S (dk x dv), from the rows q, k, v (L rows each,
 * dk, dk, dv wide, gathered), g, beta; outputs o rows (L, dv) at `out`, `ld` floats apart. */
static void chunk_step(float *restrict S, int L, int dk, int dv, const float *Q, const float *Kr, float *V,
                       const float *g, const float *beta, float *out, size_t ld, float *work) {
    float *W = work, *A = W + CHUNK * dk, *QK = A + CHUNK * CHUNK, *gc = QK + CHUNK * CHUNK;
    // gc = the decays' running sum within the chunk
    for (int i = 0; i < L; i++) gc[i] = g[i] + (i ? gc[i - 1] : 0.0f);
    // A[i][j] = beta_i (k_i . k_j) exp(gc_i - gc_j), QK[i][j] = (q_i . k_j) exp(gc_i - gc_j) for j < i (j <= i)
    for (int i = 0; i < L; i++)
        for (int j = 0; j <= i; j++) {
            float e = expf(gc[i] - gc[j]);
            A[i * CHUNK + j] = beta[i] * dot(Kr + (size_t)i * dk, Kr + (size_t)j * dk, dk) * e;
            QK[i * CHUNK + j] = dot(Q + (size_t)i * dk, Kr + (size_t)j * dk, dk) * e;
        }
    // (I + strictly-lower A) U = beta V and (I + A) W = beta exp(gc) K, by forward substitution; U in V's rows
    for (int i = 0; i < L; i++) {
        float *u = V + (size_t)i * dv, *w = W + (size_t)i * dk, f = beta[i] * expf(gc[i]);
        const float *k = Kr + (size_t)i * dk;
        for (int x = 0; x < dv; x++) u[x] *= beta[i];
        for (int x = 0; x < dk; x++) w[x] = f * k[x];
        for (int j = 0; j < i; j++) {
            axpy(u, -A[i * CHUNK + j], V + (size_t)j * dv, dv);
            axpy(w, -A[i * CHUNK + j], W + (size_t)j * dk, dk);
        }
    }
    // v_new = U - W S (in V's rows); o_i = exp(gc_i) q_i S + sum_{j <= i} QK[i][j] v_new_j: S as it was
    for (int i = 0; i < L; i++) {
        float *u = V + (size_t)i * dv, *o = out + (size_t)i * ld, e = expf(gc[i]);
        const float *w = W + (size_t)i * dk, *q = Q + (size_t)i * dk;
        memset(o, 0, sizeof(float) * dv);
        for (int x = 0; x < dk; x++) {
            const float *row = S + (size_t)x * dv;
            axpy(u, -w[x], row, dv);
            axpy(o, e * q[x], row, dv);
        }
    }
    for (int i = 0; i < L; i++) {
        float *o = out + (size_t)i * ld;
        for (int j = 0; j <= i; j++) axpy(o, QK[i * CHUNK + j], V + (size_t)j * dv, dv);
    }
    // S = exp(gc_last) S + sum_j exp(gc_last - gc_j) k_j v_new_j^T
    float last = gc[L - 1], decay = expf(last);
    for (int x = 0; x < dk * dv; x++) S[x] *= decay;
    for (int j = 0; j < L; j++) {
        float e = expf(last - gc[j]);
        const float *k = Kr + (size_t)j * dk, *v = V + (size_t)j * dv;
        for (int x = 0; x < dk; x++) axpy(S + (size_t)x * dv, e * k[x], v, dv);
    }
}

/* out = rmsnorm(x) * w * silu(z) over n values (out may be x): the gated RMS norm of a head's output. */
void deltanet_gated_norm(float *out, const float *x, const float *z, const float *w, int n, float eps) {
    rmsnorm(out, x, w, n, eps);
    for (int i = 0; i < n; i++) out[i] *= silu(z[i]);
}

/* Whether a sequence's run of n tokens takes the chunked form (else the recurrent one, bit for bit as decode). */
int strata_deltanet_chunked(int n_tok) { return n_tok > RECURRENT_RUN; }

/* Sequence s's tokens in this chunk through v head h: the rule on its state, then the gated RMS norm, into
 * dn_out. work: deltanet_work_floats. */
static void head_of_sequence(strata_context *c, const layer_weights *L, int il, int s, int h, float *work) {
    const strata_model_params *p = &c->model->hp;
    const int dk = p->ssm_d_state, dv = dk, hk = p->ssm_n_group, hv = p->ssm_dt_rank, kh = h % hk;
    const int64_t C = c->model->conv_dim, VD = p->ssm_d_inner;
    float *S = rec_state_of(c, s, il) + c->model->conv_state_floats + (size_t)h * dk * dv;
    float *spare = rec_spare_of(c, s, il);
    if (spare)  // its checkpoint: the head's state as it was, read here anyway (the copy costs its writes)
        memcpy(spare + c->model->conv_state_floats + (size_t)h * dk * dv, S, sizeof(float) * dk * dv);
    const int first = c->seq_first[s], n = c->seq_first[s + 1] - first;
    const size_t q_at = (size_t)kh * dk, k_at = (size_t)(hk + kh) * dk, v_at = (size_t)2 * hk * dk + (size_t)h * dv;
    if (!strata_deltanet_chunked(n)) {
        for (int i = first; i < first + n; i++) {
            int t = c->seq_tokens[i];
            const float *row = c->dn_conv + (size_t)t * C;
            recurrent_step(S, row + q_at, row + k_at, row + v_at, c->dn_alpha[(size_t)t * hv + h],
                           c->dn_beta[(size_t)t * hv + h], dk, dv,
                           c->dn_out + (size_t)t * VD + (size_t)h * dv, work);
        }
    } else {
        float *Q = work, *Kr = Q + CHUNK * dk, *V = Kr + CHUNK * dk, *O = V + CHUNK * dv, *g = O + CHUNK * dv;
        float *beta = g + CHUNK, *rest = beta + CHUNK;
        for (int c0 = 0; c0 < n; c0 += CHUNK) {
            int len = n - c0 < CHUNK ? n - c0 : CHUNK;
            for (int i = 0; i < len; i++) {
                int t = c->seq_tokens[first + c0 + i];
                const float *row = c->dn_conv + (size_t)t * C;
                memcpy(Q + (size_t)i * dk, row + q_at, sizeof(float) * dk);
                memcpy(Kr + (size_t)i * dk, row + k_at, sizeof(float) * dk);
                memcpy(V + (size_t)i * dv, row + v_at, sizeof(float) * dv);
                g[i] = c->dn_alpha[(size_t)t * hv + h];
                beta[i] = c->dn_beta[(size_t)t * hv + h];
            }
            chunk_step(S, len, dk, dv, Q, Kr, V, g, beta, O, dv, rest);
            for (int i = 0; i < len; i++)
                memcpy(c->dn_out + (size_t)c->seq_tokens[first + c0 + i] * VD + (size_t)h * dv, O + (size_t)i * dv,
                       sizeof(float) * dv);
        }
    }
    // o = rmsnorm(o) * w * silu(z), per token
    for (int i = first; i < first + n; i++) {
        int t = c->seq_tokens[i];
        float *o = c->dn_out + (size_t)t * VD + (size_t)h * dv;
        deltanet_gated_norm(o, o, c->dn_z + (size_t)t * VD + (size_t)h * dv, L->ssm_norm, dv, p->rms_eps);
    }
}

void block_deltanet(const team *tm, strata_context *c, int il, int n_tok) {
    const strata_model *m = c->model;
    const strata_model_params *p = &m->hp;
    const layer_weights *L = &m->layers[il];
    const int hv = p->ssm_dt_rank;
    // xb = rmsnorm(x); qkv, z, alpha, beta = xb @ Wqkv, Wz, Walpha, Wbeta
    rmsnorm_rows(tm, c->xb, c->x, L->attn_norm, n_tok, p->n_embd, p->rms_eps);
    const matrix *ws[4] = {&L->ssm_qkv, &L->ssm_z, &L->ssm_alpha, &L->ssm_beta};
    float *ys[4] = {c->dn_qkv, c->dn_z, c->dn_alpha, c->dn_beta};
    linear(tm, c, c->xb, n_tok, 4, ws, ys);
    // q, k, v = silu(conv(qkv)) per sequence from its conv state; l2-normed q, k heads; g and beta per v head
    convolve(tm, c, L, il);
    gates_and_norms(tm, c, L, n_tok);
    team_sync(tm);
    // o = gated-normed delta rule per (sequence, v head); x += o @ Wout
    float *work = c->dn_work + (size_t)tm->ith * c->dn_work_floats;
    for (int u; (u = team_next(tm)) < c->n_chunk_seqs * hv;)
        head_of_sequence(c, L, il, c->chunk_seqs[u / hv], u % hv, work);
    team_sync(tm);
    block_poll_aborts(tm, c, 1, n_tok);  // read before the feed-forward
    linear1(tm, c, c->dn_out, n_tok, &L->ssm_out, c->xb);
    add_rows(tm, c->x, c->xb, n_tok, p->n_embd);
}

/* n tokens of one v head through the rule on S (head_dim x head_dim), by the recurrent form (chunked 0) or in
 * chunks of CHUNK: token i's q and k rows at q, k + i qk_stride, its v row at v + i v_stride, its g and beta at
 * [i gb_stride], its output row at out + i out_stride. work: deltanet_head_floats(head_dim). */
void deltanet_head(float *S, int n, int head_dim, const float *q, const float *k, size_t qk_stride, const float *v,
                   size_t v_stride, const float *g, const float *beta, size_t gb_stride, float *out, size_t out_stride,
                   int chunked, float *work) {
    const int dk = head_dim, dv = head_dim;
    float *Q = work, *Kr = Q + CHUNK * dk, *V = Kr + CHUNK * dk, *O = V + CHUNK * dv, *gh = O + CHUNK * dv;
    float *bh = gh + CHUNK, *rest = bh + CHUNK;
    for (int c0 = 0; c0 < n; c0 += chunked ? CHUNK : 1) {
        int len = !chunked ? 1 : n - c0 < CHUNK ? n - c0 : CHUNK;
        for (int i = 0; i < len; i++) {
            size_t t = (size_t)(c0 + i);
            memcpy(Q + (size_t)i * dk, q + t * qk_stride, sizeof(float) * dk);
            memcpy(Kr + (size_t)i * dk, k + t * qk_stride, sizeof(float) * dk);
            memcpy(V + (size_t)i * dv, v + t * v_stride, sizeof(float) * dv);
            gh[i] = g[t * gb_stride];
            bh[i] = beta[t * gb_stride];
        }
        if (chunked) chunk_step(S, len, dk, dv, Q, Kr, V, gh, bh, O, dv, rest);
        else recurrent_step(S, Q, Kr, V, gh[0], bh[0], dk, dv, O, rest);
        for (int i = 0; i < len; i++)
            memcpy(out + (size_t)(c0 + i) * out_stride, O + (size_t)i * dv, sizeof(float) * dv);
    }
}

// --- the rule alone, for tests

strata_status strata_delta_rule(const float *q, const float *k, const float *v, const float *g, const float *beta,
                                int n_tok, int n_k_heads, int n_v_heads, int head_dim, int chunked, float *state,
                                float *out) {
    if (n_tok <= 0 || n_k_heads <= 0 || n_v_heads % n_k_heads != 0 || head_dim <= 0)
        return engine_fail(STRATA_ERR_INVALID_ARG, "delta rule of %d tokens, %d q/k and %d v heads of %d", n_tok,
                           n_k_heads, n_v_heads, head_dim);
    const int d = head_dim;
    float *work = malloc(sizeof(float) * deltanet_head_floats(d));
    if (!work) return engine_fail(STRATA_ERR_NOMEM, "out of memory");
    for (int h = 0; h < n_v_heads; h++) {
        size_t qk_at = (size_t)(h % n_k_heads) * d, v_at = (size_t)h * d;
        deltanet_head(state + (size_t)h * d * d, n_tok, d, q + qk_at, k + qk_at, (size_t)n_k_heads * d, v + v_at,
                      (size_t)n_v_heads * d, g + h, beta + h, (size_t)n_v_heads, out + v_at, (size_t)n_v_heads * d,
                      chunked, work);
    }
    free(work);
    return STRATA_OK;
}

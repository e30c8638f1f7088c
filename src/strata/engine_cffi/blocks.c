/* blocks.c — the shared building blocks of the forward pass: RMS norm, RoPE, products of activations by weights,
 * attention over each sequence's cached K and V rows, the dense and mixture-of-experts SwiGLU feed-forwards, the
 * embeddings in and the logits out. Every architecture's layer (arch_*.c) is made of them. Activations are f32
 * rows; before a product they are converted once to the weight type's partner type (kernels.h), shared by every
 * weight that reads the same input. */
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "blocks.h"
#include "simd.h"

// --- KV cache rows: one (position, kv head) row of head_dim values

/* cache row `idx` = src (head_dim) in the cache's type. */
static void kv_store(const strata_context *c, void *cache, float *scales, size_t idx, const float *src) {
    int hd = c->model->hp.head_dim;
    if (c->kv_type == STRATA_KV_F32) {
        memcpy((float *)cache + idx * hd, src, sizeof(float) * hd);
    } else if (c->kv_type == STRATA_KV_F16) {
        uint16_t *dst = (uint16_t *)cache + idx * hd;
        for (int i = 0; i < hd; i++) dst[i] = strata_f32_to_f16(src[i]);
    } else {
        // symmetric int8: scale = max|x| / 127, so the error per value is at most scale / 2
        int8_t *dst = (int8_t *)cache + idx * hd;
        float amax = 0.0f;
        for (int i = 0; i < hd; i++) amax = fmaxf(amax, fabsf(src[i]));
        float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int i = 0; i < hd; i++) dst[i] = (int8_t)lrintf(src[i] * inv);
        scales[idx] = scale;
    }
}

/* Cache rows are read in place as f32 vectors of AV lanes (simd.h, which has the softmax's e^x too): a vector
 * path, a leftovers tail, a scalar path without AVX2. */
#if defined(AV)
#define AV_SLICE 4  /* vectors of a V row summed per pass: 2 heads x 4 accumulators stay in registers */

/* AV cached values from element i of a row, as f32 (int8 rows still unscaled). */
static inline avec kv_vec(int kv_type, const void *row, int i) {
    if (kv_type == STRATA_KV_F32) return av_load((const float *)row + i);
    if (kv_type == STRATA_KV_F16) return av_from_f16((const uint16_t *)row + i);
    return av_from_i8((const int8_t *)row + i);
}
#endif

/* Value i of a cache row, unscaled. */
static float load1(int kv_type, const void *row, int i) {
    if (kv_type == STRATA_KV_F32) return ((const float *)row)[i];
    if (kv_type == STRATA_KV_F16) return strata_f16_to_f32(((const uint16_t *)row)[i]);
    return ((const int8_t *)row)[i];
}

/* Cache row idx in place, and the factor its values take (the int8 scale, else 1). */
static const void *kv_row(const strata_context *c, const void *cache, const float *scales, size_t idx, float *f) {
    *f = c->kv_type == STRATA_KV_INT8 ? scales[idx] : 1.0f;
    return (const char *)cache + idx * c->model->hp.head_dim * c->kv_elem;
}

/* q (head_dim) . an unscaled cache row, read in place. */
static float dot_row(int kv_type, const float *q, const void *row, int hd) {
    int i = 0;
    float s = 0.0f;
#if defined(AV)
    avec a0 = av_zero(), a1 = av_zero();  // two chains: the sum is not one long dependency
    for (; i + 2 * AV <= hd; i += 2 * AV) {
        a0 = av_fmadd(av_load(q + i), kv_vec(kv_type, row, i), a0);
        a1 = av_fmadd(av_load(q + i + AV), kv_vec(kv_type, row, i + AV), a1);
    }
    for (; i + AV <= hd; i += AV) a0 = av_fmadd(av_load(q + i), kv_vec(kv_type, row, i), a0);
    s = av_sum(av_add(a0, a1));
#endif
    for (; i < hd; i++) s += q[i] * load1(kv_type, row, i);
    return s;
}

#if defined(AV)
/* Elements [i0, i0 + NV * AV) of out rows a, b (see weighted_rows); NV is a constant, so the 2 NV sums stay in
 * registers. */
static inline __attribute__((always_inline)) void weighted_slice(const strata_context *c, size_t base,
                                                                 const float *wa, const float *wb, int n_pos,
                                                                 int i0, int NV, float *oa, float *ob) {
    avec sa[AV_SLICE], sb[AV_SLICE];
    float f;
    for (int k = 0; k < NV; k++) sa[k] = sb[k] = av_zero();
    for (int p = 0; p < n_pos; p++) {
        const void *row = kv_row(c, c->v_cache, c->v_scale, base + p, &f);
        avec ba = av_set1(wa[p] * f), bb = av_set1(wb[p] * f);
        for (int k = 0; k < NV; k++) {
            avec v = kv_vec(c->kv_type, row, i0 + k * AV);
            sa[k] = av_fmadd(ba, v, sa[k]);
            sb[k] = av_fmadd(bb, v, sb[k]);
        }
    }
    for (int k = 0; k < NV; k++) av_store(oa + i0 + k * AV, sa[k]), av_store(ob + i0 + k * AV, sb[k]);
}
#endif

/* out rows a, b (head_dim) = sum over positions p < n_pos of wa[p], wb[p] times V row base + p. Each row is
 * converted once for both heads, the sums held in registers a slice of the row at a time. */
static void weighted_rows(const strata_context *c, size_t base, const float *wa, const float *wb, int n_pos,
                          float *oa, float *ob) {
    int hd = c->model->hp.head_dim, i0 = 0;
#if defined(AV)
    for (; i0 + AV_SLICE * AV <= hd; i0 += AV_SLICE * AV)
        weighted_slice(c, base, wa, wb, n_pos, i0, AV_SLICE, oa, ob);
    for (; i0 + AV <= hd; i0 += AV) weighted_slice(c, base, wa, wb, n_pos, i0, 1, oa, ob);
#endif
    for (int i = i0; i < hd; i++) {
        float sa = 0.0f, sb = 0.0f, f;
        for (int p = 0; p < n_pos; p++) {
            const void *row = kv_row(c, c->v_cache, c->v_scale, base + p, &f);
            float v = f * load1(c->kv_type, row, i);
            sa += wa[p] * v;
            sb += wb[p] * v;
        }
        oa[i] = sa;
        ob[i] = sb;
    }
}

// --- building blocks (each called by every thread of the team; each ends at a barrier, except those that work
// on this thread's share of the tokens only (share(tm, n_tok)): a step on the same share may follow them at once,
// since each thread then reads only rows it wrote itself)

void rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float s = 1.0f / sqrtf(ss / n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * s * w[i];
}

void rmsnorm_rows(const team *tm, float *out, const float *x, const float *w, int n_tok, int64_t n,
                         float eps) {
    range r = share(tm, n_tok);
    for (int64_t t = r.lo; t < r.hi; t++) rmsnorm(out + t * n, x + t * n, w, n, eps);
}

/* dst rows (n_tok) = x rows (n_tok, n) converted to `vec_dot_type`, rows `stride` bytes apart. */
static void quantize_rows(const team *tm, int vec_dot_type, const float *x, int n_tok, int64_t n, void *dst,
                          size_t stride) {
    range r = share(tm, n_tok);
    for (int64_t t = r.lo; t < r.hi; t++)
        strata_quantize_row_any(vec_dot_type, x + t * n, (char *)dst + t * stride, n);
    team_sync(tm);
}

static int64_t row_blocks(const matrix *w) { return (w->n_out + ROWS_PER_TASK - 1) / ROWS_PER_TASK; }

/* ys[i] (n_tok, ws[i].n_out) = xq @ ws[i]^T for n_w weights of one partner type, xq already converted to it.
 * The row blocks of every weight form one parallel loop, so q, k and v (or gate and up) share one barrier. Its
 * units are handed out through the shared counter as threads free up, so a thread that loses its core for a
 * while leaves its share to the others instead of holding up the barrier. With few tokens a unit is a long run
 * of one weight's blocks (about RUNS_PER_THREAD of them per thread), one kernel call: the kernel then reads its
 * rows as a few long streams (short rows taken 16 at a time left the output product at half the memory
 * bandwidth), and keeps each tile of rows in cache while every token passes over it. With many, a unit is one
 * block, whose rows stay in cache while the tokens' blocks go by, except for kernels that pack the tokens anew
 * in every call (strata_gemm_packs_tokens): their units are runs of up to PACKED_RUN_BLOCKS. Which thread computes
 * a row does not change its sum. */
static void products(const team *tm, int n_w, const matrix *const *ws, float *const *ys, const void *xq,
                     int n_tok) {
    int64_t total = 0, units = 0, per = 1;  // per: blocks per unit
    int packs = 1;  // every weight packs the tokens per call
    for (int i = 0; i < n_w; i++) {
        total += row_blocks(ws[i]);
        packs &= ws[i]->packs;
    }
    if (n_tok <= FEW_TOKENS) per = max64(MIN_RUN_BLOCKS, total / ((int64_t)RUNS_PER_THREAD * tm->nth));
    else if (packs) per = max64(1, min64(PACKED_RUN_BLOCKS, total / ((int64_t)RUNS_PER_THREAD * tm->nth)));
    for (int i = 0; i < n_w; i++) units += (row_blocks(ws[i]) + per - 1) / per;
    for (int64_t u; (u = team_next(tm)) < units;) {
        int i = 0;
        for (int64_t n; u >= (n = (row_blocks(ws[i]) + per - 1) / per); i++) u -= n;  // unit u of weight i
        const matrix *w = ws[i];
        int64_t r0 = u * per * ROWS_PER_TASK, r1 = min64(r0 + per * ROWS_PER_TASK, w->n_out);
        if (w->bands)
            strata_gemm_bands(w->type, w->bands, w->n_in, r0, r1, xq, n_tok, ys[i], w->n_out);
        else
            strata_gemm_rows(w->type, w->n_in, w->data, r0, r1, xq, n_tok, ys[i], w->n_out);
    }
    team_sync(tm);
}

void linear(const team *tm, strata_context *c, const float *x, int n_tok, int n_w, const matrix *const *ws,
                   float *const *ys) {
    for (int first = 0, last; first < n_w; first = last) {
        int vdt = ws[first]->vec_dot_type;
        for (last = first + 1; last < n_w && ws[last]->vec_dot_type == vdt;) last++;
        quantize_rows(tm, vdt, x, n_tok, ws[first]->n_in, c->xq, act_row_bytes(vdt, ws[first]->n_in));
        products(tm, last - first, ws + first, ys + first, c->xq, n_tok);
    }
}

void linear1(const team *tm, strata_context *c, const float *x, int n_tok, const matrix *w, float *y) {
    linear(tm, c, x, n_tok, 1, &w, &y);
}

/* Rotate pairs of x's first n_rot values by the angles whose cos and sin are given (n_rot / 2 each): pairs
 * (2i, 2i+1) or, NEOX, (i, i + n_rot/2); the rest of the head is left as it is (partial RoPE). */
static void rope(float *x, int n_rot, const float *cs, const float *sn, rope_mode mode) {
    for (int i = 0; i < n_rot / 2; i++) {
        int a = mode == ROPE_NEOX ? i : 2 * i, b = mode == ROPE_NEOX ? i + n_rot / 2 : 2 * i + 1;
        float x0 = x[a], x1 = x[b];
        x[a] = x0 * cs[i] - x1 * sn[i];
        x[b] = x0 * sn[i] + x1 * cs[i];
    }
}

/* Per token: q, k heads = RoPE(per-head RMSNorm (qwen3) of q, k) at the token's RoPE position; then its k and v
 * rows go into its sequence's cache at its position. */
static void rope_and_cache(const team *tm, strata_context *c, const layer_weights *L, int il, int n_tok) {
    const strata_model *m = c->model;
    int hd = m->hp.head_dim, nh = m->hp.n_head, nkv = m->hp.n_head_kv, n_rot = m->n_rot;
    range r = share(tm, n_tok);
    for (int t = (int)r.lo; t < r.hi; t++) {
        int pos = c->chunk_pos[t];
        const int *rope_pos = c->chunk_rope + 3 * t;  // (t, h, w): all pos with one axis
        float cs[n_rot / 2], sn[n_rot / 2];  // angle (pair i's component) * inv_freq[i], shared by every head
        for (int i = 0; i < n_rot / 2; i++) {
            float theta = rope_pos[m->rope_axis[i]] * m->inv_freq[i];
            cs[i] = cosf(theta);
            sn[i] = sinf(theta);
        }
        for (int h = 0; h < nh + nkv; h++) {
            float *x = h < nh ? c->q + ((size_t)t * nh + h) * hd : c->k + ((size_t)t * nkv + h - nh) * hd;
            if (m->has_qk_norm) rmsnorm(x, x, h < nh ? L->q_norm : L->k_norm, hd, m->hp.rms_eps);
            rope(x, n_rot, cs, sn, m->rope);
        }
        for (int h = 0; h < nkv; h++) {
            size_t idx = kv_base(c, c->chunk_seq[t], il, h) + pos, src = ((size_t)t * nkv + h) * hd;
            kv_store(c, c->k_cache, c->k_scale, idx, c->k + src);
            kv_store(c, c->v_cache, c->v_scale, idx, c->v + src);
        }
    }
    team_sync(tm);
}

/* x (n) = softmax(x). */
static void softmax(float *x, int n) {
    float max = -INFINITY, sum = 0.0f;
    int i = 0;
#if defined(AV)
    // the maximum by vector: one value at a time it was a chain of dependent maxima, ~9% of a 3,000-token prompt
    avec lanes = av_set1(-INFINITY);
    for (; i + AV <= n; i += AV) lanes = av_max(lanes, av_load(x + i));
    float part[AV];
    av_store(part, lanes);
    for (int l = 0; l < AV; l++) max = part[l] > max ? part[l] : max;
#endif
    // not fmaxf: that is a call per value, for NaN rules scores do not need
    for (; i < n; i++) max = x[i] > max ? x[i] : max;
    i = 0;
#if defined(AV)
    avec vmax = av_set1(max), vsum = av_zero();
    for (; i + AV <= n; i += AV) {
        avec e = av_exp_neg(av_sub(av_load(x + i), vmax));
        av_store(x + i, e);
        vsum = av_add(vsum, e);
    }
    sum = av_sum(vsum);
#endif
    for (; i < n; i++) sum += x[i] = expf(x[i] - max);
    float inv = 1.0f / sum;
    for (int p = 0; p < n; p++) x[p] *= inv;
}

#if defined(AV)
/* scores[p] = q (head_dim, a multiple of AV) . K row base + p, times the row's scale and `scale`, for p < n_pos:
 * AV positions at a time, each dot one chain of vectors, their lanes summed together (av_sums). One dot at a time,
 * the lanes' sum took more than its multiplications: ~20% of a 3,000-token prompt. A position's score does not
 * depend on the positions beside it. */
static void key_scores(strata_context *c, size_t base, const float *q, int n_pos, float scale, float *scores) {
    const int nv = c->model->hp.head_dim / AV;
    for (int p0 = 0; p0 < n_pos; p0 += AV) {
        avec acc[AV];
        float fs[AV] __attribute__((aligned(64)));
        _Pragma("GCC unroll 16") for (int k = 0; k < AV; k++) {
            acc[k] = av_zero(), fs[k] = 0.0f;
            if (p0 + k >= n_pos) continue;
            const void *row = kv_row(c, c->k_cache, c->k_scale, base + p0 + k, &fs[k]);
            avec a = av_mul(av_load(q), kv_vec(c->kv_type, row, 0));
            for (int i = 1; i < nv; i++) a = av_fmadd(av_load(q + i * AV), kv_vec(c->kv_type, row, i * AV), a);
            acc[k] = a, fs[k] *= scale;
        }
        const avec s = av_mul(av_sums(acc), av_load(fs));
        if (p0 + AV <= n_pos) {
            av_store(scores + p0, s);
        } else {
            float tail[AV];
            av_store(tail, s);
            for (int k = 0; p0 + k < n_pos; k++) scores[p0 + k] = tail[k];
        }
    }
}

/* key_scores for two heads of one kv head at once, AV / 2 positions at a time: a key row is converted once for
 * both. Each score takes the same steps as in key_scores (av_sums sums every vector by the same tree), so a head
 * gets the same bits alone or in a pair. */
static void key_scores_pair(strata_context *c, size_t base, const float *qa, const float *qb, int n_pos,
                            float scale, float *sa, float *sb) {
    enum { H = AV / 2 };
    const int nv = c->model->hp.head_dim / AV;
    for (int p0 = 0; p0 < n_pos; p0 += H) {
        avec acc[AV];
        float fs[AV] __attribute__((aligned(64))), out[AV];
        _Pragma("GCC unroll 8") for (int k = 0; k < H; k++) {
            acc[k] = acc[H + k] = av_zero(), fs[k] = fs[H + k] = 0.0f;
            if (p0 + k >= n_pos) continue;
            float f;
            const void *row = kv_row(c, c->k_cache, c->k_scale, base + p0 + k, &f);
            avec key = kv_vec(c->kv_type, row, 0), a = av_mul(av_load(qa), key), b = av_mul(av_load(qb), key);
            for (int i = 1; i < nv; i++) {
                key = kv_vec(c->kv_type, row, i * AV);
                a = av_fmadd(av_load(qa + i * AV), key, a);
                b = av_fmadd(av_load(qb + i * AV), key, b);
            }
            acc[k] = a, acc[H + k] = b, fs[k] = fs[H + k] = f * scale;
        }
        av_store(out, av_mul(av_sums(acc), av_load(fs)));
        const int n = n_pos - p0 < H ? n_pos - p0 : H;
        memcpy(sa + p0, out, sizeof(float) * n);
        memcpy(sb + p0, out + H, sizeof(float) * n);
    }
}
#endif

/* out rows (n_q, head_dim) = softmax(q_j . K[0..n_pos) / sqrt(head_dim)) . V[0..n_pos), in f32, for n_q query
 * heads sharing one kv head, whose rows start at `base`, reading the cache in place. scores: (n_q, n_ctx)
 * scratch. */
static void attend_heads(strata_context *c, size_t base, const float *q, int n_q, int n_pos, float *scores,
                         float *out) {
    int hd = c->model->hp.head_dim;
    float scale = 1.0f / sqrtf((float)hd), f;
#if defined(AV)
    if (hd % AV == 0) {
        int j = 0;
        for (; j + 2 <= n_q; j += 2)
            key_scores_pair(c, base, q + j * hd, q + (j + 1) * hd, n_pos, scale, scores + (size_t)j * c->n_ctx,
                            scores + (size_t)(j + 1) * c->n_ctx);
        if (j < n_q) key_scores(c, base, q + j * hd, n_pos, scale, scores + (size_t)j * c->n_ctx);
    } else
#endif
    for (int p = 0; p < n_pos; p++) {
        const void *row = kv_row(c, c->k_cache, c->k_scale, base + p, &f);
        for (int j = 0; j < n_q; j++)
            scores[(size_t)j * c->n_ctx + p] = dot_row(c->kv_type, q + j * hd, row, hd) * (f * scale);
    }
    for (int j = 0; j < n_q; j++) softmax(scores + (size_t)j * c->n_ctx, n_pos);
    for (int j = 0; j < n_q; j += 2) {  // heads in pairs; an odd last one pairs with itself
        int j1 = j + 1 < n_q ? j + 1 : j;
        weighted_rows(c, base, scores + (size_t)j * c->n_ctx, scores + (size_t)j1 * c->n_ctx, n_pos,
                      out + j * hd, out + j1 * hd);
    }
}

/* att = causal grouped-query attention of the chunk's queries over their sequences' caches (from each sequence's
 * attn_from where it is set: the MTP block's history). A task is a token
 * and some query heads of one kv head: the whole group, unless that leaves threads idle (decode), then halves of
 * it. */
static void attention(const team *tm, strata_context *c, int il, int n_tok) {
    const strata_model_params *p = &c->model->hp;
    int hd = p->head_dim, nh = p->n_head, group = p->n_head / p->n_head_kv, per = group;
    while (per % 2 == 0 && n_tok * (nh / per) < 2 * tm->nth) per /= 2;
    int tasks_per_token = nh / per;
    float *scores = c->scores + (size_t)tm->ith * group * c->n_ctx;
    for (int task; (task = team_next(tm)) < n_tok * tasks_per_token;) {
        int t = task / tasks_per_token, h0 = task % tasks_per_token * per;
        size_t off = ((size_t)t * nh + h0) * hd;
        int from = c->attn_from ? c->attn_from[c->chunk_seq[t]] : 0;
        attend_heads(c, kv_base(c, c->chunk_seq[t], il, h0 / group) + from, c->q + off, per,
                     c->chunk_pos[t] + 1 - from, scores, c->att + off);
    }
    team_sync(tm);
}

void add_rows(const team *tm, float *x, const float *y, int n_tok, int64_t n) {
    range r = share(tm, n_tok);
    for (int64_t t = r.lo; t < r.hi; t++)
        for (int64_t i = 0; i < n; i++) x[t * n + i] += y[t * n + i];
}

/* hb = silu(hb) * hb2 over this thread's share of n_rows rows of n; no barrier. */
static void swiglu_rows(const team *tm, float *hb, const float *hb2, int n_rows, int64_t n) {
    range rows = share(tm, n_rows);
    for (int64_t r = rows.lo; r < rows.hi; r++) {
        float *g = hb + r * n;
        const float *u = hb2 + r * n;
        int64_t i = 0;
#if defined(AV)
        // e^-g by the softmax's exp, its argument held below 87 (g above -87: silu(g) is then within 1e-36 of 0):
        // one call of expf per value was 2-4% of a decode step and of a prompt
        for (; i + AV <= n; i += AV) {
            avec gv = av_load(g + i), e = av_exp_neg(av_min(av_sub(av_zero(), gv), av_set1(87.0f)));
            av_store(g + i, av_mul(av_div(gv, av_add(av_set1(1.0f), e)), av_load(u + i)));
        }
#endif
        for (; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Thread 0 reads the abort flags of the chunk's sequences: a raised flag drops its sequence from the rest of the
 * call (and is lowered). The chunk stops when all its sequences are dropped; the others' tokens go on, so one
 * sequence's abort never costs another its work. The answer goes in stop_at[slot], which every thread reads
 * after the next barrier (team_stopped). Two slots, polled in turn, each with barriers between a poll and the
 * next one of its slot: every thread has read a slot before thread 0 can write it again. */
void block_poll_aborts(const team *tm, strata_context *c, int slot, int n_tok) {
    if (tm->ith != 0) return;
    int live = 0;
    for (int t = 0; t < n_tok; t++) {
        int s = c->chunk_seq[t];
        if (!c->dropped[s] && atomic_exchange(&c->abort_flag[s], 0)) c->dropped[s] = 1;
        live |= !c->dropped[s];
    }
    c->stop_at[slot] = !live;
}

// --- transformer blocks

/* Gated attention: q rows = the query halves of qg's heads (each head's query, then its gate); this thread's
 * share of the tokens, no barrier. */
static void split_gated_queries(const team *tm, strata_context *c, int n_tok) {
    int hd = c->model->hp.head_dim, nh = c->model->hp.n_head;
    range r = share(tm, n_tok);
    for (int64_t t = r.lo; t < r.hi; t++)
        for (int h = 0; h < nh; h++)
            memcpy(c->q + ((size_t)t * nh + h) * hd, c->qg + ((size_t)t * nh + h) * 2 * hd, sizeof(float) * hd);
}

/* Gated attention: att *= sigmoid(each head's gate), this thread's share of the tokens; no barrier. */
static void gate_attention(const team *tm, strata_context *c, int n_tok) {
    int hd = c->model->hp.head_dim, nh = c->model->hp.n_head;
    range r = share(tm, n_tok);
    for (int64_t t = r.lo; t < r.hi; t++)
        for (int h = 0; h < nh; h++) {
            float *o = c->att + ((size_t)t * nh + h) * hd;
            const float *g = c->qg + ((size_t)t * nh + h) * 2 * hd + hd;
            for (int i = 0; i < hd; i++) o[i] /= 1.0f + expf(-g[i]);
        }
}

void block_attention(const team *tm, strata_context *c, int il, int n_tok) {
    const strata_model *m = c->model;
    const strata_model_params *p = &m->hp;
    const layer_weights *L = &m->layers[il];
    // xb = rmsnorm(x); q, k, v = xb @ Wq, Wk, Wv (Qwen3.5: q with each head's output gate)
    rmsnorm_rows(tm, c->xb, c->x, L->attn_norm, n_tok, p->n_embd, p->rms_eps);
    const matrix *ws[3] = {&L->wq, &L->wk, &L->wv};
    float *ys[3] = {m->gated_attn ? c->qg : c->q, c->k, c->v};
    linear(tm, c, c->xb, n_tok, 3, ws, ys);
    if (m->gated_attn) split_gated_queries(tm, c, n_tok);  // rope_and_cache goes on with the same share
    // q, k = rope(qk_norm(q, k)); cache k, v at the chunk's positions
    rope_and_cache(tm, c, L, il, n_tok);
    // att = softmax(q k^T / sqrt(head_dim)) v over positions <= each token's; x += att @ Wo
    attention(tm, c, il, n_tok);
    block_poll_aborts(tm, c, 1, n_tok);  // read before the feed-forward
    if (m->gated_attn) gate_attention(tm, c, n_tok);  // the product's conversion goes on with the same share
    linear1(tm, c, c->att, n_tok, &L->wo, c->xb);
    add_rows(tm, c->x, c->xb, n_tok, p->n_embd);
}

void block_dense_ffn(const team *tm, strata_context *c, int il, int n_tok) {
    const strata_model_params *p = &c->model->hp;
    const layer_weights *L = &c->model->layers[il];
    // xb = rmsnorm(x); x += (silu(xb @ Wgate) * (xb @ Wup)) @ Wdown
    rmsnorm_rows(tm, c->xb, c->x, L->ffn_norm, n_tok, p->n_embd, p->rms_eps);
    const matrix *ws[2] = {&L->ffn_gate, &L->ffn_up};
    float *ys[2] = {c->hb, c->hb2};
    linear(tm, c, c->xb, n_tok, 2, ws, ys);
    swiglu_rows(tm, c->hb, c->hb2, n_tok, p->n_ff);
    block_poll_aborts(tm, c, 0, n_tok);  // read before the next layer
    linear1(tm, c, c->hb, n_tok, &L->ffn_down, c->xb);
    add_rows(tm, c->x, c->xb, n_tok, p->n_embd);
}

/* choice (k) = the k largest of probs (n), in descending order (the lower index wins a tie). */
static void top_k(const float *probs, int n, int k, int *choice) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= choice[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        choice[j] = best;
    }
}

/* Route each token: softmax over its router logits, top k, the k weights renormalised to sum to 1.
 * slot_of holds each choice's expert for now; expert_count counts the choices per expert. */
static void route_tokens(strata_context *c, int n_tok) {
    const strata_model_params *p = &c->model->hp;
    int n_exp = p->n_expert, k = p->n_expert_used, choice[MAX_EXPERT_USED];
    memset(c->expert_count, 0, sizeof(int) * n_exp);
    for (int t = 0; t < n_tok; t++) {
        float *prob = c->router + (size_t)t * n_exp, max = -INFINITY, sum = 0.0f, kept = 0.0f;
        for (int e = 0; e < n_exp; e++) max = fmaxf(max, prob[e]);
        for (int e = 0; e < n_exp; e++) sum += prob[e] = expf(prob[e] - max);
        top_k(prob, n_exp, k, choice);
        for (int j = 0; j < k; j++) kept += prob[choice[j]] / sum;
        for (int j = 0; j < k; j++) {
            c->choice_weight[t * k + j] = prob[choice[j]] / sum / kept;
            c->slot_of[t * k + j] = choice[j];
            c->expert_count[choice[j]]++;
        }
    }
}

/* Rows per expert task: ROWS_PER_TASK for a prompt (PACKED_RUN_BLOCKS of them where the product packs its tokens
 * per call, `packs`); for a few tokens, the longest runs (see products) that still leave RUNS_PER_THREAD / 2 tasks
 * per thread among the n_mat expert matrices of the loop, in whole ROWS_PER_TASK blocks. */
static int64_t expert_task_rows(const strata_context *c, int n_tok, int n_mat, int64_t n_out, int packs) {
    if (n_mat == 0) return ROWS_PER_TASK;
    if (n_tok > FEW_TOKENS) return packs ? PACKED_RUN_BLOCKS * ROWS_PER_TASK : ROWS_PER_TASK;
    int64_t per_matrix = (RUNS_PER_THREAD / 2 * c->n_threads + n_mat - 1) / n_mat;  // tasks per matrix
    int64_t rows = (n_out + per_matrix - 1) / per_matrix;
    return (rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK * ROWS_PER_TASK;
}

/* Give each (token, choice) a slot, slots grouped by expert (expert e owns expert_count[e] slots from
 * expert_start[e]); then list the (expert, row block) tasks: gate/up ones first, then down ones. Experts nobody
 * picked get no task. */
static void group_slots(strata_context *c, const layer_weights *L, int n_tok) {
    const strata_model_params *p = &c->model->hp;
    int n_exp = p->n_expert, k = p->n_expert_used, next[n_exp];  // next free slot per expert
    for (int e = 0, start = 0; e < n_exp; e++) {
        next[e] = c->expert_start[e] = start;
        start += c->expert_count[e];
    }
    for (int tj = 0; tj < n_tok * k; tj++) {
        int s = next[c->slot_of[tj]]++;
        c->slot_token[s] = tj / k;
        c->slot_of[tj] = s;
    }
    int n_picked = 0;
    for (int e = 0; e < n_exp; e++) n_picked += c->expert_count[e] > 0;
    c->task_rows[0] = expert_task_rows(c, n_tok, 2 * n_picked, p->n_ff_exp, L->gate_exps.packs && L->up_exps.packs);
    c->task_rows[1] = expert_task_rows(c, n_tok, n_picked, p->n_embd, L->down_exps.packs);
    int64_t blocks[2] = {(p->n_ff_exp + c->task_rows[0] - 1) / c->task_rows[0],
                         (p->n_embd + c->task_rows[1] - 1) / c->task_rows[1]};
    int n[2] = {0, 0};
    for (int pass = 0; pass < 2; pass++)
        for (int e = 0; e < n_exp; e++)
            for (int64_t b = 0; c->expert_count[e] && b < blocks[pass]; b++, n[pass]++) {
                int at = n[0] + (pass ? n[1] : 0);
                c->tasks[2 * at] = e;
                c->tasks[2 * at + 1] = (int)b;
            }
    c->n_tasks_up = n[0];
    c->n_tasks_down = n[1];
}

/* ys[i] rows of each expert = (its slots of xq) @ ws[i]_e^T over the tasks [first, first + n), for n_w weights
 * of one partner type in one parallel loop, `rows` rows per task; slot rows are `stride` bytes apart in xq,
 * ws[i].n_out floats in ys[i]. */
static void expert_products(const team *tm, const strata_context *c, int n_w, const matrix *const *ws,
                            float *const *ys, const void *xq, size_t stride, int first, int n, int64_t rows) {
    for (int k; (k = team_next(tm)) < n_w * n;) {
        const matrix *w = ws[k / n];
        int task = first + k % n, e = c->tasks[2 * task], s0 = c->expert_start[e];
        int64_t r0 = (int64_t)c->tasks[2 * task + 1] * rows, r1 = min64(r0 + rows, w->n_out);
        const char *x = (const char *)xq + (size_t)s0 * stride;
        float *y = ys[k / n] + (size_t)s0 * w->n_out;
        if (w->bands)
            strata_gemm_bands(w->type, (const char *)w->bands + (size_t)e * w->bands_bytes, w->n_in, r0, r1, x,
                              c->expert_count[e], y, w->n_out);
        else
            strata_gemm_rows(w->type, w->n_in, expert_data(w, e), r0, r1, x, c->expert_count[e], y, w->n_out);
    }
    team_sync(tm);
}

/* xq_slots row s = xq row of slot s's token: each token's activations are converted once, then gathered. */
static void gather_slots(const team *tm, strata_context *c, int n_slots, size_t stride) {
    range r = share(tm, n_slots);
    for (int64_t s = r.lo; s < r.hi; s++)
        memcpy((char *)c->xq_slots + s * stride, (const char *)c->xq + (size_t)c->slot_token[s] * stride, stride);
    team_sync(tm);
}

/* gate/up products of every picked expert over its slots: hb = silu(xb Wg_e) * (xb Wu_e). */
static void experts_gate_up(const team *tm, strata_context *c, const layer_weights *L, int n_tok) {
    const strata_model_params *p = &c->model->hp;
    int n_slots = n_tok * p->n_expert_used;
    const matrix *ws[2] = {&L->gate_exps, &L->up_exps};
    float *ys[2] = {c->hb, c->hb2};
    for (int first = 0, last; first < 2; first = last) {  // runs of weights sharing a partner type
        int vdt = ws[first]->vec_dot_type;
        size_t stride = act_row_bytes(vdt, p->n_embd);
        last = first == 0 && ws[1]->vec_dot_type == vdt ? 2 : first + 1;
        quantize_rows(tm, vdt, c->xb, n_tok, p->n_embd, c->xq, stride);
        gather_slots(tm, c, n_slots, stride);
        expert_products(tm, c, last - first, ws + first, ys + first, c->xq_slots, stride, 0, c->n_tasks_up,
                        c->task_rows[0]);
    }
    swiglu_rows(tm, c->hb, c->hb2, n_slots, p->n_ff_exp);  // the down product's conversion follows on its share
}

/* Append the chunk's choices in layer il to the caller's routing record (strata_record_routing): [il, chunk,
 * n_tok, each token's k expert ids in the router's order]; a record that does not fit marks the buffer full. */
static void record_routing(strata_context *c, int il, int n_tok) {
    int k = c->model->hp.n_expert_used;
    long long need = 3 + (long long)n_tok * k;
    if (c->route_used < 0 || c->route_used + need > c->route_cap) {
        c->route_used = -1;
        return;
    }
    int *out = c->route_rec + c->route_used;
    out[0] = il, out[1] = c->timings.n_chunks, out[2] = n_tok;
    memcpy(out + 3, c->slot_of, sizeof(int) * n_tok * k);  // route_tokens left each choice's expert there
    c->route_used += need;
}

/* Qwen3.5's shared expert, beside the routed ones: shexp_out = SwiGLU(xb) through its weights, shexp_gate = the
 * logit of its gate (xb . w). */
static void shared_expert(const team *tm, strata_context *c, const layer_weights *L, int n_tok) {
    const strata_model_params *p = &c->model->hp;
    range r = share(tm, n_tok);
    for (int64_t t = r.lo; t < r.hi; t++) {
        const float *x = c->xb + t * p->n_embd;
        float dot = 0.0f;
        for (int64_t i = 0; i < p->n_embd; i++) dot += x[i] * L->gate_inp_shexp[i];
        c->shexp_gate[t] = dot;
    }
    const matrix *ws[2] = {&L->gate_shexp, &L->up_shexp};
    float *ys[2] = {c->hb, c->hb2};
    linear(tm, c, c->xb, n_tok, 2, ws, ys);
    swiglu_rows(tm, c->hb, c->hb2, n_tok, p->n_ff_shexp);
    linear1(tm, c, c->hb, n_tok, &L->down_shexp, c->shexp_out);
}

void block_moe_ffn(const team *tm, strata_context *c, int il, int n_tok) {
    const strata_model_params *p = &c->model->hp;
    const layer_weights *L = &c->model->layers[il];
    int k = p->n_expert_used, n_slots = n_tok * k, shexp = L->gate_shexp.data != NULL;
    // xb = rmsnorm(x); the shared expert where the model has one; router logits = xb @ Wr; each token picks its
    // top-k experts
    rmsnorm_rows(tm, c->xb, c->x, L->ffn_norm, n_tok, p->n_embd, p->rms_eps);
    if (shexp) shared_expert(tm, c, L, n_tok);
    linear1(tm, c, c->xb, n_tok, &L->router, c->router);
    if (tm->ith == 0) {  // no barrier of its own: only gather_slots reads the routing, past the next one
        route_tokens(c, n_tok);
        if (c->route_rec) record_routing(c, il, n_tok);
        group_slots(c, L, n_tok);
    }
    // per slot: hb = silu(xb Wg_e) * (xb Wu_e); moe_out = hb @ Wd_e
    experts_gate_up(tm, c, L, n_tok);
    size_t stride = act_row_bytes(L->down_exps.vec_dot_type, p->n_ff_exp);
    block_poll_aborts(tm, c, 0, n_tok);  // read before the next layer
    quantize_rows(tm, L->down_exps.vec_dot_type, c->hb, n_slots, p->n_ff_exp, c->xq_slots, stride);
    const matrix *down = &L->down_exps;
    expert_products(tm, c, 1, &down, &c->moe_out, c->xq_slots, stride, c->n_tasks_up, c->n_tasks_down,
                    c->task_rows[1]);
    // x += sum over the token's choices of weight * moe_out[slot] (+ sigmoid(gate) * the shared expert's output)
    range r = share(tm, n_tok);
    for (int64_t t = r.lo; t < r.hi; t++) {
        float *x = c->x + t * p->n_embd;
        for (int j = 0; j < k; j++) {
            const float *y = c->moe_out + (size_t)c->slot_of[t * k + j] * p->n_embd;
            float w = c->choice_weight[t * k + j];
            for (int64_t i = 0; i < p->n_embd; i++) x[i] += w * y[i];
        }
        if (shexp) {
            const float *y = c->shexp_out + t * p->n_embd, w = 1.0f / (1.0f + expf(-c->shexp_gate[t]));
            for (int64_t i = 0; i < p->n_embd; i++) x[i] += w * y[i];
        }
    }  // no barrier: the next step on x works on the same share
}

// --- a chunk's ends: embeddings in, logits out

/* Floats per caller's embedding row: the embedding, then the deepstack slices. */
static int64_t embd_row_width(const strata_model *m) { return (int64_t)m->hp.n_embd * (1 + m->hp.n_deepstack); }

/* x rows = token embeddings, or the caller's rows where the chunk says so. */
void block_embed(const team *tm, strata_context *c, const float *embd_rows, int n_tok) {
    const strata_model *m = c->model;
    int64_t E = m->hp.n_embd, W = embd_row_width(m);
    range r = share(tm, n_tok);
    for (int64_t t = r.lo; t < r.hi; t++) {
        if (c->chunk_embd[t] >= 0)
            memcpy(c->x + t * E, embd_rows + (size_t)c->chunk_embd[t] * W, sizeof(float) * E);
        else
            strata_dequantize_row_any(m->tok_embd.type, (const char *)m->tok_embd.data +
                                      (size_t)c->chunk_token[t] * m->tok_embd.row_bytes, c->x + t * E, E);
    }  // no barrier: this thread's share
}

/* The caller's thread alone: a decode step's few rows take ~2 us, a 2,000-token prompt's 0.3 ms (Q8_0) to 6.7 ms
 * (Q6_K) at width 2,048 (bench/embedding_lookup.py), small beside the step they feed. */
strata_status strata_get_rows(int type, const void *w, long long n_rows, long long n_cols, const int *ids, int n_ids,
                              float *out) {
    if (!strata_type_supported(type)) return engine_fail(STRATA_ERR_UNSUPPORTED, "get_rows: type %d is not a weight "
                                                         "type this engine reads", type);
    size_t row_bytes = strata_row_bytes(type, n_cols);
    if (!w || !ids || !out || n_rows < 0 || n_ids < 0 || n_cols <= 0 || !row_bytes)
        return engine_fail(STRATA_ERR_INVALID_ARG, "get_rows: a table of %lld rows of %lld %s values, %d ids", n_rows,
                           n_cols, strata_traits(type)->name, n_ids);
    for (int i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= n_rows)
            return engine_fail(STRATA_ERR_INVALID_ARG, "get_rows: id %d (at %d) outside the table's %lld rows", ids[i],
                               i, n_rows);
    for (int i = 0; i < n_ids; i++)  // each row as the forward pass's (block_embed)
        strata_dequantize_row_any(type, (const char *)w + (size_t)ids[i] * row_bytes, out + (size_t)i * n_cols, n_cols);
    return STRATA_OK;
}

/* After layer k < n_deepstack: x rows of the caller's rows += their slice k + 1 (Qwen3-VL's deepstack: the
 * vision tower's features of earlier layers, added to the picture positions' hidden states of the first layers). */
void block_add_deepstack(const team *tm, strata_context *c, const float *embd_rows, int k, int n_tok) {
    int64_t E = c->model->hp.n_embd, W = embd_row_width(c->model);
    range r = share(tm, n_tok);
    for (int64_t t = r.lo; t < r.hi; t++) {
        if (c->chunk_embd[t] < 0) continue;
        const float *slice = embd_rows + (size_t)c->chunk_embd[t] * W + (size_t)(k + 1) * E;
        for (int64_t i = 0; i < E; i++) c->x[t * E + i] += slice[i];
    }  // no barrier: this thread's share
}

/* rmsnorm(x rows) @ Woutput into the caller's logits rows, for the chunk's tokens that want logits. Rows of
 * consecutive logits rows go through one product (normally the whole chunk: one read of the output weight). */
void block_output_logits(const team *tm, strata_context *c, int n_tok, float *logits) {
    const strata_model *m = c->model;
    int64_t E = m->hp.n_embd, V = m->hp.n_vocab;
    for (int t = 0; t < n_tok;) {
        if (c->chunk_out[t] < 0) {
            t++;
            continue;
        }
        int n = 1;  // a run of tokens t.. whose logits rows follow each other
        while (t + n < n_tok && c->chunk_out[t + n] == c->chunk_out[t] + n) n++;
        rmsnorm_rows(tm, c->xb, c->x + (size_t)t * E, m->output_norm, n, E, m->hp.rms_eps);
        linear1(tm, c, c->xb, n, &m->output, logits + (size_t)c->chunk_out[t] * V);
        t += n;
    }
}

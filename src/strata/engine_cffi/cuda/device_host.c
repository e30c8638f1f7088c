/* device_host.c — the host implementation of the device interface: plain memory, streams that run each call
 * as it is queued (so every ordering rule holds trivially), events that are timestamps, and kernels that are
 * the CPU engine's own (the products: strata_gemm_rows after quantising the activations as the engine does, and
 * the engine's naive reference for "matmul_ref"; the DeltaNet's pieces, blocks_deltanet.c's own code, so both names
 * give the CPU engine's bits) or C ports of the reference kernels (the rest). */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "../engine_internal.h"
#include "device_impl.h"

typedef struct {
    strata_dev_backend *be;  /* where a failure's reason goes (be->err) */
    double event_ms[STRATA_DEV_MAX_EVENTS];
    void *act;      // the activations of a product in its partner type (one token's row)
    size_t act_bytes;
} host_device;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int host_fail(host_device *h, int status, const char *why) {
    snprintf(h->be->err, h->be->err_len, "%s", why);
    return status;
}

// --- kernels

/* y (n_tok, rows) = w rows . x rows by the CPU engine's product, each token's activations converted to the
 * weight's partner type as the engine converts them (one token at a time: a row's result does not depend on
 * the others). act: scratch of the converted row's bytes at least. */
static void engine_product(int type, const void *w, int64_t rows, int64_t n, const float *x, int64_t n_tok,
                           float *y, void *act) {
    int vdt = strata_traits(type)->vec_dot_type;
    for (int64_t t = 0; t < n_tok; t++) {
        strata_quantize_row_any(vdt, x + t * n, act, n);
        strata_gemm_rows(type, n, w, 0, rows, act, 1, y + t * rows, rows);
    }
}

/* Bytes of one row of n activations in the partner type of `type`. */
static size_t act_bytes(int type, int64_t n) {
    const strata_type_traits *act = strata_traits(strata_traits(type)->vec_dot_type);
    return act->block_bytes * (size_t)(n / act->block_size);
}

/* y (n_tok, rows) = w rows . x rows: the engine's product, or its naive reference. */
static int product(host_device *h, int type, const void *w, int64_t rows, int64_t n, const float *x, int64_t n_tok,
                   float *y, int reference) {
    if (reference && strata_matmul_naive(type, w, rows, n, x, n_tok, y) != STRATA_OK)
        return host_fail(h, STRATA_ERR_INVALID_ARG, strata_last_error());
    if (reference) return STRATA_OK;
    size_t bytes = act_bytes(type, n);
    if (bytes > h->act_bytes) {
        void *p = realloc(h->act, bytes);
        if (!p) return host_fail(h, STRATA_ERR_NOMEM, "matmul: out of memory for the activations");
        h->act = p;
        h->act_bytes = bytes;
    }
    engine_product(type, w, rows, n, x, n_tok, y, h->act);
    return STRATA_OK;
}

static int matmul(host_device *h, const strata_dev_matmul_args *a, int reference) {
    return product(h, a->type, a->w, a->rows, a->n, a->x, a->n_tok, a->y, reference);
}

/* Each expert with rows: its run's product, as a hit's "matmul" over the same rows (the same bits). */
static int moe_matmul(host_device *h, const strata_dev_moe_matmul_args *a, int reference) {
    for (int e = 0; e < a->n_expert; e++) {
        if (a->count[e] == 0) continue;
        if (a->count[e] < 0 || a->count[e] > a->max_rows || a->first[e] < 0 || a->first[e] + a->count[e] > a->n_slots)
            return host_fail(h, STRATA_ERR_INVALID_ARG, "moe_matmul: an expert's rows lie outside [0, n_slots)");
        const char *w = (const char *)a->slots[e] + a->offset;
        int status = product(h, a->type, w, a->rows, a->n, a->x + (int64_t)a->first[e] * a->n, a->count[e],
                             a->y + (int64_t)a->first[e] * a->rows, reference);
        if (status) return status;
    }
    return STRATA_OK;
}

static void rms_norm(const strata_dev_rms_norm_args *a) {
    for (int64_t t = 0; t < a->n_tok; t++) {
        const float *x = a->x + t * a->n;
        double ss = 0.0;
        for (int64_t i = 0; i < a->n; i++) ss += (double)x[i] * x[i];
        float s = (float)(1.0 / sqrt(ss / (double)a->n + a->eps));
        for (int64_t i = 0; i < a->n; i++) a->out[t * a->n + i] = x[i] * s * a->w[i];
    }
}

static void rope(const strata_dev_rope_args *a) {
    int hd = a->head_dim, half = (a->n_rot ? a->n_rot : hd) / 2;
    for (int t = 0; t < a->n_tok; t++)
        for (int h = 0; h < a->n_head; h++) {
            float *x = a->x + ((size_t)t * a->n_head + h) * hd;
            for (int i = 0; i < half; i++) {
                float theta = (float)a->pos[3 * t + a->axis[i]] * a->inv_freq[i];
                double c = cos(theta), s = sin(theta);
                int p = a->neox ? i : 2 * i, q = a->neox ? i + half : 2 * i + 1;
                double x0 = x[p], x1 = x[q];
                x[p] = (float)(x0 * c - x1 * s);
                x[q] = (float)(x0 * s + x1 * c);
            }
        }
}

/* Element d of cached row `row` of the cache. */
static double kv_value(const strata_dev_attention_args *a, const void *cache, const float *scale, size_t row,
                       int d) {
    size_t i = row * a->head_dim + d;
    if (a->kv_type == STRATA_KV_F32) return ((const float *)cache)[i];
    if (a->kv_type == STRATA_KV_F16) return strata_f16_to_f32(((const uint16_t *)cache)[i]);
    return ((const int8_t *)cache)[i] * (double)scale[row];
}

static int attention(host_device *h, const strata_dev_attention_args *a) {
    int hd = a->head_dim, group = a->n_head / a->n_head_kv;
    double *scores = malloc(sizeof(double) * (a->n_ctx > 0 ? a->n_ctx : 1));
    if (!scores) return host_fail(h, STRATA_ERR_NOMEM, "attention: out of memory for the scores");
    for (int t = 0; t < a->n_tok; t++)
        if (a->n_pos[t] < 1 || a->n_pos[t] > a->n_ctx || (a->first && (a->first[t] < 0 || a->first[t] >= a->n_pos[t]))) {
            free(scores);
            return host_fail(h, STRATA_ERR_INVALID_ARG, "attention: a token's n_pos is not in [1, n_ctx], or its "
                             "first position not in [0, n_pos)");
        }
    for (int t = 0; t < a->n_tok; t++)
        for (int h = 0; h < a->n_head; h++) {
            const float *q = a->q + ((size_t)t * a->n_head + h) * hd;
            size_t base = (((size_t)a->seq[t] * a->n_layer + a->il) * a->n_head_kv + h / group) * a->n_ctx;
            double max = -INFINITY, sum = 0.0;
            int first = a->first ? a->first[t] : 0;
            for (int p = first; p < a->n_pos[t]; p++) {
                double s = 0.0;
                for (int d = 0; d < hd; d++) s += q[d] * kv_value(a, a->k, a->k_scale, base + p, d);
                scores[p] = s / sqrt((double)hd);
                max = scores[p] > max ? scores[p] : max;
            }
            for (int p = first; p < a->n_pos[t]; p++) sum += scores[p] = exp(scores[p] - max);
            float *out = a->out + ((size_t)t * a->n_head + h) * hd;
            for (int d = 0; d < hd; d++) {
                double acc = 0.0;
                for (int p = first; p < a->n_pos[t]; p++) acc += scores[p] * kv_value(a, a->v, a->v_scale, base + p, d);
                out[d] = (float)(acc / sum);
            }
        }
    free(scores);
    return STRATA_OK;
}

/* silu(g) * u in double, rounded once. */
static inline float silu_mul(float g, float u) { return (float)(g / (1.0 + exp(-(double)g)) * u); }

static void swiglu(const strata_dev_swiglu_args *a) {
    for (int64_t i = 0; i < a->n; i++) a->out[i] = silu_mul(a->g[i], a->u[i]);
}

static void add_rows(const strata_dev_add_rows_args *a) {
    for (int t = 0; t < a->n_tok; t++)
        for (int j = 0; j < a->k; j++) {
            int at = t * a->k + j;
            const float *y = a->y + (size_t)(a->idx ? a->idx[at] : at) * a->n;
            float w = a->weight ? a->weight[at] : 1.0f, *out = a->out + (size_t)t * a->n;
            for (int64_t i = 0; i < a->n; i++) out[i] += w * y[i];
        }
}

/* One row (head_dim) into cache row idx, as the CPU engine's kv_store converts it. */
static void store_row(const strata_dev_kv_store_args *a, void *cache, float *scales, size_t idx, const float *src) {
    int hd = a->head_dim;
    if (a->kv_type == STRATA_KV_F32) {
        memcpy((float *)cache + idx * hd, src, sizeof(float) * hd);
    } else if (a->kv_type == STRATA_KV_F16) {
        for (int i = 0; i < hd; i++) ((uint16_t *)cache)[idx * hd + i] = strata_f32_to_f16(src[i]);
    } else {
        float amax = 0.0f;
        for (int i = 0; i < hd; i++) amax = fmaxf(amax, fabsf(src[i]));
        float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int i = 0; i < hd; i++) ((int8_t *)cache)[idx * hd + i] = (int8_t)lrintf(src[i] * inv);
        scales[idx] = scale;
    }
}

static int kv_store(host_device *h, const strata_dev_kv_store_args *a) {
    for (int t = 0; t < a->n_tok; t++)
        if (a->pos[t] < 0 || a->pos[t] >= a->n_ctx)
            return host_fail(h, STRATA_ERR_INVALID_ARG, "kv_store: a token's position is not in [0, n_ctx)");
    for (int t = 0; t < a->n_tok; t++)
        for (int kvh = 0; kvh < a->n_head_kv; kvh++) {
            size_t idx = (((size_t)a->seq[t] * a->n_layer + a->il) * a->n_head_kv + kvh) * a->n_ctx + a->pos[t];
            size_t src = ((size_t)t * a->n_head_kv + kvh) * a->head_dim;
            store_row(a, a->k, a->k_scale, idx, a->k_in + src);
            store_row(a, a->v, a->v_scale, idx, a->v_in + src);
        }
    return STRATA_OK;
}

static void topk(const strata_dev_topk_args *a) {
    for (int t = 0; t < a->n_tok; t++) {
        const float *l = a->logits + (size_t)t * a->n_expert;
        int *ids = a->ids + t * a->k;
        float max = -INFINITY;
        double kept = 0.0;
        for (int e = 0; e < a->n_expert; e++) max = l[e] > max ? l[e] : max;
        for (int j = 0; j < a->k; j++) {  // softmax is monotonic: pick by logit, the lower index on a tie
            int best = -1;
            for (int e = 0; e < a->n_expert; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= ids[i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            ids[j] = best;
            kept += exp((double)l[best] - max);
        }
        for (int j = 0; j < a->k; j++) a->weights[t * a->k + j] = (float)(exp((double)l[ids[j]] - max) / kept);
    }
}

// --- Gated DeltaNet: the CPU engine's own functions (blocks_deltanet.c), for "<name>" and "<name>_ref" alike

/* 0 .. n - 1 (the convolution's token list: a sequence's rows are adjacent here), or NULL. */
static int *iota(int n) {
    int *v = malloc(sizeof(int) * (n > 0 ? n : 1));
    for (int i = 0; v && i < n; i++) v[i] = i;
    return v;
}

/* Whether seq_first (n_seq + 1) starts at 0 and never goes down (the card cannot check it: it lies in device
 * memory). */
static int check_sequences(host_device *h, const char *kernel, const int *seq_first, int n_seq) {
    int ok = seq_first[0] == 0;
    for (int s = 0; s < n_seq; s++) ok &= seq_first[s + 1] >= seq_first[s];
    if (ok) return STRATA_OK;
    char why[96];
    snprintf(why, sizeof why, "%s: seq_first must start at 0 and never decrease", kernel);
    return host_fail(h, STRATA_ERR_INVALID_ARG, why);
}

static int dn_conv(host_device *h, const strata_dev_dn_conv_args *a) {
    if (check_sequences(h, "dn_conv", a->seq_first, a->n_seq)) return STRATA_ERR_INVALID_ARG;
    int *tokens = iota(a->seq_first[a->n_seq]);
    if (!tokens) return host_fail(h, STRATA_ERR_NOMEM, "dn_conv: out of memory");
    for (int s = 0; s < a->n_seq; s++) {
        float *state = a->state + (size_t)a->seq[s] * a->state_stride;
        int first = a->seq_first[s];
        for (int64_t ch = 0; ch < a->channels; ch++)
            deltanet_conv_channel(a->w + ch * a->d_conv, a->d_conv, state + ch * (a->d_conv - 1), a->x + ch,
                                  a->out + ch, (size_t)a->channels, tokens + first, a->seq_first[s + 1] - first);
    }
    free(tokens);
    return STRATA_OK;
}

static void l2_norm(const strata_dev_l2_norm_args *a) {
    for (int t = 0; t < a->n_tok; t++)
        for (int j = 0; j < a->n_head; j++)
            deltanet_l2norm(a->x + t * a->row_stride + (size_t)j * a->head_dim, a->head_dim, a->scale);
}

static void dn_gates(const strata_dev_dn_gates_args *a) {
    for (int t = 0; t < a->n_tok; t++)
        deltanet_gates(a->alpha + (size_t)t * a->n_head, a->beta + (size_t)t * a->n_head, a->a, a->dt_bias,
                       a->n_head);
}

/* Per (sequence, v head) with a slot: the recurrent form token by token (chunked 0) or the chunked form. */
static int delta_rule(host_device *h, const strata_dev_delta_rule_args *a, int chunked) {
    const char *name = chunked ? "delta_rule_chunked" : "delta_rule";
    if (check_sequences(h, name, a->seq_first, a->n_seq)) return STRATA_ERR_INVALID_ARG;
    const int d = a->head_dim, hv = a->n_v_heads;
    float *work = malloc(sizeof(float) * deltanet_head_floats((size_t)d));
    if (!work) return host_fail(h, STRATA_ERR_NOMEM, "delta_rule: out of memory");
    for (int s = 0; s < a->n_seq; s++) {
        int first = a->seq_first[s], n = a->seq_first[s + 1] - first;
        for (int j = 0; j < hv && n > 0 && a->seq[s] >= 0; j++) {
            size_t row = (size_t)first * a->row_stride, qk = row + (size_t)(j % a->n_k_heads) * d;
            size_t gb = (size_t)first * hv + j;
            deltanet_head(a->state + (size_t)a->seq[s] * a->state_stride + (size_t)j * d * d, n, d, a->q + qk,
                          a->k + qk, (size_t)a->row_stride, a->v + row + (size_t)j * d, (size_t)a->row_stride,
                          a->g + gb, a->beta + gb, (size_t)hv, a->out + gb * d, (size_t)hv * d, chunked,
                          work);
        }
    }
    free(work);
    return STRATA_OK;
}

static void gated_rms_norm(const strata_dev_gated_rms_norm_args *a) {
    for (int64_t r = 0; r < a->n_rows; r++)
        deltanet_gated_norm(a->out + r * a->n, a->x + r * a->n, a->z + r * a->n, a->w, (int)a->n, a->eps);
}

/* x / (1 + e^-g) in double, rounded once (the reference kernel's port). */
static void sigmoid_gate(const strata_dev_sigmoid_gate_args *a) {
    for (int64_t r = 0; r < a->n_rows; r++)
        for (int64_t i = 0; i < a->n; i++) {
            float *x = a->x + r * a->n + i;
            double g = a->gate[r * a->gate_stride + (a->per_value ? i : 0)];
            *x = (float)(*x / (1.0 + exp(-g)));
        }
}

// --- a vision encoder's pieces: C ports of the reference kernels, sums in double

static void layer_norm(const strata_dev_layer_norm_args *a) {
    for (int64_t t = 0; t < a->n_tok; t++) {
        const float *x = a->x + t * a->n;
        double mean = 0.0, var = 0.0;
        for (int64_t i = 0; i < a->n; i++) mean += x[i];
        mean /= (double)a->n;
        for (int64_t i = 0; i < a->n; i++) var += (x[i] - mean) * (x[i] - mean);
        double s = 1.0 / sqrt(var / (double)a->n + a->eps);
        for (int64_t i = 0; i < a->n; i++) a->out[t * a->n + i] = (float)((x[i] - mean) * s * a->w[i] + a->b[i]);
    }
}

/* 0.7978845608028654: sqrt(2 / pi) */
static void gelu(const strata_dev_gelu_args *a) {
    for (int64_t i = 0; i < a->n; i++) {
        double x = a->x[i];
        double g = a->erf ? 0.5 * x * (1.0 + erf(x / sqrt(2.0)))
                          : 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
        a->out[i] = (float)g;
    }
}

static int vit_attention(host_device *h, const strata_dev_vit_attention_args *a) {
    int n = a->n_tok, hd = a->head_dim;
    size_t stride = (size_t)a->n_head * hd;
    double *scores = malloc(sizeof(double) * n);
    if (!scores) return host_fail(h, STRATA_ERR_NOMEM, "vit_attention: out of memory for the scores");
    for (int t = 0; t < n; t++)
        for (int hh = 0; hh < a->n_head; hh++) {
            const float *q = a->q + t * stride + (size_t)hh * hd;
            double max = -INFINITY, sum = 0.0;
            for (int p = 0; p < n; p++) {
                const float *k = a->k + p * stride + (size_t)hh * hd;
                double s = 0.0;
                for (int d = 0; d < hd; d++) s += (double)q[d] * k[d];
                scores[p] = s / sqrt((double)hd);
                max = scores[p] > max ? scores[p] : max;
            }
            for (int p = 0; p < n; p++) sum += scores[p] = exp(scores[p] - max);
            float *out = a->out + t * stride + (size_t)hh * hd;
            for (int d = 0; d < hd; d++) {
                double acc = 0.0;
                for (int p = 0; p < n; p++) acc += scores[p] * a->v[p * stride + (size_t)hh * hd + d];
                out[d] = (float)(acc / sum);
            }
        }
    free(scores);
    return STRATA_OK;
}

static int moe_group(host_device *h, const strata_dev_moe_group_args *a);  // with the host's grouping, below

static int launch(void *self, int stream, strata_dev_kernel kernel, int reference, const void *args) {
    (void)stream;
    switch (kernel) {
    case DEV_KERNEL_MATMUL: return matmul(self, args, reference);
    case DEV_KERNEL_RMS_NORM: rms_norm(args); return STRATA_OK;
    case DEV_KERNEL_ROPE: rope(args); return STRATA_OK;
    case DEV_KERNEL_ATTENTION: return attention(self, args);
    case DEV_KERNEL_SWIGLU: swiglu(args); return STRATA_OK;
    case DEV_KERNEL_TOPK: topk(args); return STRATA_OK;
    case DEV_KERNEL_ADD_ROWS: add_rows(args); return STRATA_OK;
    case DEV_KERNEL_KV_STORE: return kv_store(self, args);
    case DEV_KERNEL_DN_CONV: return dn_conv(self, args);
    case DEV_KERNEL_L2_NORM: l2_norm(args); return STRATA_OK;
    case DEV_KERNEL_DN_GATES: dn_gates(args); return STRATA_OK;
    case DEV_KERNEL_DELTA_RULE: return delta_rule(self, args, 0);
    case DEV_KERNEL_DELTA_RULE_CHUNKED: return delta_rule(self, args, 1);
    case DEV_KERNEL_GATED_RMS_NORM: gated_rms_norm(args); return STRATA_OK;
    case DEV_KERNEL_SIGMOID_GATE: sigmoid_gate(args); return STRATA_OK;
    case DEV_KERNEL_LAYER_NORM: layer_norm(args); return STRATA_OK;
    case DEV_KERNEL_GELU: gelu(args); return STRATA_OK;
    case DEV_KERNEL_VIT_ATTENTION: return vit_attention(self, args);
    case DEV_KERNEL_MOE_GROUP: return moe_group(self, args);
    case DEV_KERNEL_MOE_MATMUL: return moe_matmul(self, args, reference);
    default: return STRATA_ERR_INVALID_ARG;
    }
}

// --- memory, streams and events: everything happens as it is queued

static void *host_alloc(void *self, size_t bytes) {
    (void)self;
    return malloc(bytes);
}

static void host_free(void *self, void *p) {
    (void)self;
    free(p);
}

static int host_copy(void *self, int stream, void *dst, const void *src, size_t bytes, int direction) {
    (void)self, (void)stream, (void)direction;
    memcpy(dst, src, bytes);
    return STRATA_OK;
}

static int host_memset(void *self, int stream, void *dst, int value, size_t bytes) {
    (void)self, (void)stream;
    memset(dst, value, bytes);
    return STRATA_OK;
}

static int host_nothing(void *self, int stream) {
    (void)self, (void)stream;
    return STRATA_OK;
}

static int host_event_record(void *self, int event, int stream) {
    (void)stream;
    ((host_device *)self)->event_ms[event] = now_ms();
    return STRATA_OK;
}

static int host_wait(void *self, int stream, int event) {
    (void)self, (void)stream, (void)event;
    return STRATA_OK;
}

static double host_elapsed(void *self, int start, int end) {
    host_device *h = self;
    return h->event_ms[end] - h->event_ms[start];
}

static void host_close(void *self) {
    host_device *h = self;
    free(h->act);
    free(h);
}

int strata_host_backend_open(strata_dev_backend *b, char *err, size_t err_len) {
    host_device *h = calloc(1, sizeof *h);
    if (!h) {
        strncpy(err, "out of memory", err_len);
        return STRATA_ERR_NOMEM;
    }
    h->be = b;
    *b = (strata_dev_backend){
        .self = h, .name = "host", .alloc = host_alloc, .free = host_free, .copy = host_copy,
        .memset = host_memset, .stream_create = host_nothing, .stream_sync = host_nothing,
        .event_record = host_event_record, .stream_wait_event = host_wait, .event_sync = host_nothing,
        .event_elapsed_ms = host_elapsed, .launch = launch, .close = host_close,
    };
    return STRATA_OK;
}

// --- a miss: a routed expert on the CPU

int strata_host_expert_ffn(int gate_type, const void *gate, int up_type, const void *up, int down_type,
                           const void *down, int64_t n_embd, int64_t n_ff, const float *x, int n_tok, float *y) {
    size_t act = act_bytes(gate_type, n_embd);
    act = act > act_bytes(up_type, n_embd) ? act : act_bytes(up_type, n_embd);
    act = act > act_bytes(down_type, n_ff) ? act : act_bytes(down_type, n_ff);
    float *g = malloc(sizeof(float) * n_tok * n_ff), *u = malloc(sizeof(float) * n_tok * n_ff);
    void *xq = malloc(act);
    if (!g || !u || !xq) {
        free(g), free(u), free(xq);
        return engine_fail(STRATA_ERR_NOMEM, "out of memory for an expert of %d tokens", n_tok);
    }
    // g = x Wg^T, u = x Wu^T; g = silu(g) * u; y = g Wd^T
    engine_product(gate_type, gate, n_ff, n_embd, x, n_tok, g, xq);
    engine_product(up_type, up, n_ff, n_embd, x, n_tok, u, xq);
    for (int64_t i = 0; i < n_tok * n_ff; i++) g[i] = silu_mul(g[i], u[i]);
    engine_product(down_type, down, n_embd, n_ff, g, n_tok, y, xq);
    free(g), free(u), free(xq);
    return STRATA_OK;
}

// --- a layer's slots grouped by expert (the host's side of a step, and the host device's "moe_group")

/* The slots grouped as device.h's strata_host_group_slots says, each expert's run given by expert: first[e],
 * count[e] (as "moe_group" gives them). */
static int group_slots(int n_tok, int k, int n_expert, const int *ids, const float *x, int64_t n, float *x_out,
                       int *slot_of, int *first, int *count) {
    int n_slots = n_tok * k, *start = calloc((size_t)n_expert + 1, sizeof *start);
    if (!start) return engine_fail(STRATA_ERR_NOMEM, "out of memory for %d experts", n_expert);
    for (int s = 0; s < n_slots; s++) {
        if (ids[s] < 0 || ids[s] >= n_expert) {
            free(start);
            return engine_fail(STRATA_ERR_INVALID_ARG, "slot %d chose expert %d of %d", s, ids[s], n_expert);
        }
        start[ids[s] + 1]++;
    }
    // each expert's first place in the order (a counting sort: stable, so an expert's slots stay in token order)
    for (int e = 0; e < n_expert; e++) {
        first[e] = start[e], count[e] = start[e + 1];
        start[e + 1] += start[e];
    }
    // each slot to its place, its token's row with it
    for (int s = 0; s < n_slots; s++) {
        int at = start[ids[s]]++;
        slot_of[s] = at;
        memcpy(x_out + (int64_t)at * n, x + (int64_t)(s / k) * n, sizeof(float) * (size_t)n);
    }
    free(start);
    return STRATA_OK;
}

static int moe_group(host_device *h, const strata_dev_moe_group_args *a) {
    int status = group_slots(a->n_tok, a->k, a->n_expert, a->ids, a->x, a->n, a->x_out, a->slot_of, a->first,
                             a->count);
    return status ? host_fail(h, status, strata_last_error()) : STRATA_OK;
}

int strata_host_group_slots(int n_tok, int k, int n_expert, const int *ids, const float *x, int64_t n, float *x_out,
                            int *slot_of, int *experts, int *first, int *count, int *m) {
    int *runs = malloc(sizeof *runs * (2 * (size_t)n_expert + 1));
    if (!runs) return engine_fail(STRATA_ERR_NOMEM, "out of memory for %d experts", n_expert);
    int status = group_slots(n_tok, k, n_expert, ids, x, n, x_out, slot_of, runs, runs + n_expert);
    *m = 0;
    for (int e = 0; !status && e < n_expert; e++)  // the experts chosen, ascending
        if (runs[n_expert + e]) experts[*m] = e, first[*m] = runs[e], count[(*m)++] = runs[n_expert + e];
    free(runs);
    return status;
}

// --- a layer's misses on a pool of threads

strata_pool *strata_host_pool_create(int n_threads) { return strata_pool_create(n_threads < 1 ? 1 : n_threads); }

void strata_host_pool_free(strata_pool *pool) {
    if (pool) strata_pool_free(pool);
}

typedef struct {
    strata_pool *pool;
    int64_t n_embd, n_ff;
    const strata_host_expert *experts;
    int n;
    int status;                    /* the first failure's, under `lock` */
    char reason[512];
    pthread_mutex_t lock;
} misses_job;

static void misses(int ith, int nth, void *arg) {
    (void)ith, (void)nth;
    misses_job *j = arg;
    for (int i; (i = strata_pool_next(j->pool)) < j->n;) {  // the pool's counter: the job's end resets it
        const strata_host_expert *e = &j->experts[i];
        int status = strata_host_expert_ffn(e->gate_type, e->gate, e->up_type, e->up, e->down_type, e->down,
                                            j->n_embd, j->n_ff, e->x, e->n_tok, e->y);
        if (status) {
            pthread_mutex_lock(&j->lock);
            if (!j->status) {  // the reason is this thread's own (strata_last_error is per thread)
                j->status = status;
                snprintf(j->reason, sizeof j->reason, "expert %d of %d: %s", i, j->n, strata_last_error());
            }
            pthread_mutex_unlock(&j->lock);
        }
    }
}

int strata_host_experts_ffn(strata_pool *pool, int64_t n_embd, int64_t n_ff, const strata_host_expert *experts,
                            int n) {
    if (!pool || n < 0 || (n > 0 && !experts))
        return engine_fail(STRATA_ERR_INVALID_ARG, "misses: a pool and %d experts", n);
    for (int i = 0; i < n; i++) {  // every expert checked before any runs
        const strata_host_expert *e = &experts[i];
        if (!strata_type_supported(e->gate_type) || !strata_type_supported(e->up_type) ||
            !strata_type_supported(e->down_type) || e->n_tok < 1 || !e->x || !e->y || !e->gate || !e->up || !e->down)
            return engine_fail(STRATA_ERR_INVALID_ARG, "misses: expert %d of %d: weight types %d, %d, %d, %d rows", i,
                               n, e->gate_type, e->up_type, e->down_type, e->n_tok);
    }
    if (n == 0) return STRATA_OK;
    misses_job job = {.pool = pool, .n_embd = n_embd, .n_ff = n_ff, .experts = experts, .n = n};
    pthread_mutex_init(&job.lock, NULL);
    strata_pool_run(pool, misses, &job);
    pthread_mutex_destroy(&job.lock);
    return job.status ? engine_fail(job.status, "%s", job.reason) : STRATA_OK;
}

int strata_host_layer_misses(strata_pool *pool, int64_t n_embd, int64_t n_ff, const strata_host_layer_experts *layer,
                             int n, const int *experts, const int *first, const int *count, const float *x, float *y) {
    if (!layer || n < 0 || (n > 0 && (!experts || !first || !count || !x || !y)))
        return engine_fail(STRATA_ERR_INVALID_ARG, "misses: a layer and %d experts", n);
    if (n == 0) return strata_host_experts_ffn(pool, n_embd, n_ff, NULL, 0);
    strata_host_expert *each = malloc((size_t)n * sizeof *each);
    if (!each) return engine_fail(STRATA_ERR_NOMEM, "misses: %d experts", n);
    for (int i = 0; i < n; i++) {
        size_t e = (size_t)experts[i];
        each[i] = (strata_host_expert){
            .gate_type = layer->gate_type, .up_type = layer->up_type, .down_type = layer->down_type,
            .gate = layer->gate + e * layer->gate_bytes, .up = layer->up + e * layer->up_bytes,
            .down = layer->down + e * layer->down_bytes,
            .x = x + (size_t)first[i] * n_embd, .n_tok = count[i], .y = y + (size_t)first[i] * n_embd};
    }
    int status = strata_host_experts_ffn(pool, n_embd, n_ff, each, n);
    free(each);
    return status;
}

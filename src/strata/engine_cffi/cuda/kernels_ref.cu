/* kernels_ref.cu — the reference kernels: one thread per output, the maths written out as plain loops, sums in
 * double. Slow and obviously right; the fast kernels and the CPU engine are checked against them. */
#include <math.h>
#include "blocks.cuh"
#include "kernels.cuh"

namespace strata_cuda {

static int blocks_for(int64_t n, int threads) { return (int)((n + threads - 1) / threads); }

// --- products: y[t, r] = sum_i value(w row r, i) * x[t, i]

template <int T>
__global__ void matmul_ref_kernel(const uint8_t *w, size_t row_bytes, int64_t n, const float *x, float *y,
                                  int64_t rows, int64_t n_tok) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= rows * n_tok) return;
    int64_t r = o % rows, t = o / rows;
    const uint8_t *row = w + r * row_bytes;
    double acc = 0.0;
    for (int64_t i = 0; i < n; i++) acc += (double)value_at<T>(row, i) * x[t * n + i];
    y[t * rows + r] = (float)acc;
}

template <int T> static cudaError_t launch_matmul_ref(const strata_dev_matmul_args *a, cudaStream_t stream) {
    matmul_ref_kernel<T><<<blocks_for(a->rows * a->n_tok, 128), 128, 0, stream>>>(
        (const uint8_t *)a->w, a->row_bytes, a->n, a->x, a->y, a->rows, a->n_tok);
    return cudaGetLastError();
}

cudaError_t matmul_ref(const strata_dev_matmul_args *a, cudaStream_t stream) {
    return by_type(a->type, [&](auto t) { return launch_matmul_ref<decltype(t)::value>(a, stream); });
}

// --- RMS norm: one thread per row

__global__ void rms_norm_ref_kernel(strata_dev_rms_norm_args a) {
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (t >= a.n_tok) return;
    const float *x = a.x + t * a.n;
    double ss = 0.0;
    for (int64_t i = 0; i < a.n; i++) ss += (double)x[i] * x[i];
    float s = (float)(1.0 / sqrt(ss / (double)a.n + a.eps));
    for (int64_t i = 0; i < a.n; i++) a.out[t * a.n + i] = x[i] * s * a.w[i];
}

cudaError_t rms_norm_ref(const strata_dev_rms_norm_args *a, cudaStream_t stream) {
    rms_norm_ref_kernel<<<blocks_for(a->n_tok, 64), 64, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- RoPE: one thread per rotated pair

__global__ void rope_ref_kernel(strata_dev_rope_args a) {
    int half = (a.n_rot ? a.n_rot : a.head_dim) / 2;
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= (int64_t)a.n_tok * a.n_head * half) return;
    int i = (int)(o % half), t = (int)(o / half / a.n_head);
    float *x = a.x + o / half * a.head_dim;
    float theta = (float)a.pos[3 * t + a.axis[i]] * a.inv_freq[i];
    double c = cos((double)theta), s = sin((double)theta);
    int p = a.neox ? i : 2 * i, q = a.neox ? i + half : 2 * i + 1;
    double x0 = x[p], x1 = x[q];
    x[p] = (float)(x0 * c - x1 * s);
    x[q] = (float)(x0 * s + x1 * c);
}

cudaError_t rope_ref(const strata_dev_rope_args *a, cudaStream_t stream) {
    int64_t pairs = (int64_t)a->n_tok * a->n_head * ((a->n_rot ? a->n_rot : a->head_dim) / 2);
    rope_ref_kernel<<<blocks_for(pairs, 128), 128, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- attention: one thread per output value (token, head, d), three passes over the positions

__device__ double kv_value(const strata_dev_attention_args &a, const void *cache, const float *scale, size_t row,
                           int d) {
    size_t i = row * a.head_dim + d;
    if (a.kv_type == STRATA_KV_F32) return ((const float *)cache)[i];
    if (a.kv_type == STRATA_KV_F16) return __half2float(((const __half *)cache)[i]);
    return ((const int8_t *)cache)[i] * (double)scale[row];
}

__device__ double score(const strata_dev_attention_args &a, const float *q, size_t row) {
    double s = 0.0;
    for (int d = 0; d < a.head_dim; d++) s += q[d] * kv_value(a, a.k, a.k_scale, row, d);
    return s / sqrt((double)a.head_dim);
}

__global__ void attention_ref_kernel(strata_dev_attention_args a) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= (int64_t)a.n_tok * a.n_head * a.head_dim) return;
    int d = (int)(o % a.head_dim), h = (int)(o / a.head_dim % a.n_head), t = (int)(o / a.head_dim / a.n_head);
    const float *q = a.q + ((size_t)t * a.n_head + h) * a.head_dim;
    size_t base = (((size_t)a.seq[t] * a.n_layer + a.il) * a.n_head_kv + h / (a.n_head / a.n_head_kv)) * a.n_ctx;
    double max = -INFINITY, sum = 0.0, acc = 0.0;
    int first = a.first ? a.first[t] : 0;
    for (int p = first; p < a.n_pos[t]; p++) max = fmax(max, score(a, q, base + p));
    for (int p = first; p < a.n_pos[t]; p++) {
        double e = exp(score(a, q, base + p) - max);
        sum += e;
        acc += e * kv_value(a, a.v, a.v_scale, base + p, d);
    }
    a.out[o] = (float)(acc / sum);
}

cudaError_t attention_ref(const strata_dev_attention_args *a, cudaStream_t stream) {
    attention_ref_kernel<<<blocks_for((int64_t)a->n_tok * a->n_head * a->head_dim, 128), 128, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- SwiGLU: one thread per value

__global__ void swiglu_ref_kernel(strata_dev_swiglu_args a) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < a.n) a.out[i] = (float)(a.g[i] / (1.0 + exp(-(double)a.g[i])) * a.u[i]);
}

cudaError_t swiglu_ref(const strata_dev_swiglu_args *a, cudaStream_t stream) {
    swiglu_ref_kernel<<<blocks_for(a->n, 256), 256, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- top-k routing: one thread per token, k passes of a linear search (softmax is monotonic: the k largest
// logits are the k most probable experts)

__global__ void topk_ref_kernel(strata_dev_topk_args a) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= a.n_tok) return;
    const float *l = a.logits + (size_t)t * a.n_expert;
    int *ids = a.ids + t * a.k;
    float max = -INFINITY;
    double kept = 0.0;
    for (int e = 0; e < a.n_expert; e++) max = fmaxf(max, l[e]);
    for (int j = 0; j < a.k; j++) {
        int best = -1;
        for (int e = 0; e < a.n_expert; e++) {
            bool taken = false;
            for (int i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || l[e] > l[best])) best = e;
        }
        ids[j] = best;
        kept += exp((double)l[best] - max);
    }
    for (int j = 0; j < a.k; j++) a.weights[t * a.k + j] = (float)(exp((double)l[ids[j]] - max) / kept);
}

cudaError_t topk_ref(const strata_dev_topk_args *a, cudaStream_t stream) {
    topk_ref_kernel<<<blocks_for(a->n_tok, 64), 64, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- rows added: one thread per output value, the terms summed in double

__global__ void add_rows_ref_kernel(strata_dev_add_rows_args a) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= a.n_tok * a.n) return;
    int64_t t = o / a.n, i = o % a.n;
    double acc = a.out[o];
    for (int j = 0; j < a.k; j++) {
        int64_t at = t * a.k + j;
        acc += (double)(a.weight ? a.weight[at] : 1.0f) * a.y[(a.idx ? a.idx[at] : at) * a.n + i];
    }
    a.out[o] = (float)acc;
}

cudaError_t add_rows_ref(const strata_dev_add_rows_args *a, cudaStream_t stream) {
    add_rows_ref_kernel<<<blocks_for(a->n_tok * a->n, 128), 128, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- KV rows into the cache: one thread per (token, kv head) row

__device__ void store_row_ref(const strata_dev_kv_store_args &a, void *cache, float *scales, size_t idx,
                              const float *src) {
    int hd = a.head_dim;
    float amax = 0.0f;
    for (int i = 0; i < hd; i++) amax = fmaxf(amax, fabsf(src[i]));
    float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int i = 0; i < hd; i++) {
        if (a.kv_type == STRATA_KV_F32) ((float *)cache)[idx * hd + i] = src[i];
        else if (a.kv_type == STRATA_KV_F16) ((__half *)cache)[idx * hd + i] = __float2half_rn(src[i]);
        else ((int8_t *)cache)[idx * hd + i] = (int8_t)__float2int_rn(src[i] * inv);
    }
    if (a.kv_type == STRATA_KV_INT8) scales[idx] = scale;
}

__global__ void kv_store_ref_kernel(strata_dev_kv_store_args a) {
    int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (r >= (int64_t)a.n_tok * a.n_head_kv) return;
    int t = (int)(r / a.n_head_kv), kvh = (int)(r % a.n_head_kv);
    size_t idx = (((size_t)a.seq[t] * a.n_layer + a.il) * a.n_head_kv + kvh) * a.n_ctx + a.pos[t];
    store_row_ref(a, a.k, a.k_scale, idx, a.k_in + r * a.head_dim);
    store_row_ref(a, a.v, a.v_scale, idx, a.v_in + r * a.head_dim);
}

cudaError_t kv_store_ref(const strata_dev_kv_store_args *a, cudaStream_t stream) {
    kv_store_ref_kernel<<<blocks_for((int64_t)a->n_tok * a->n_head_kv, 64), 64, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- Gated DeltaNet

/* The convolution: one thread per (sequence, channel), its outputs in order and then its state; input i of the
 * window ending at the chunk's token j is the chunk's token j - (d_conv - 1) + i, or the state's before it. */
__device__ float conv_input(const strata_dev_dn_conv_args &a, const float *state, int first, int src, int64_t ch) {
    return src >= 0 ? a.x[(first + src) * a.channels + ch] : state[a.d_conv - 1 + src];
}

__global__ void dn_conv_ref_kernel(strata_dev_dn_conv_args a) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= a.n_seq * a.channels) return;
    int s = (int)(o / a.channels), K = a.d_conv, first = a.seq_first[s], n = a.seq_first[s + 1] - first;
    int64_t ch = o % a.channels;
    float *state = a.state + a.seq[s] * a.state_stride + ch * (K - 1), last[8];
    for (int j = 0; j < n; j++) {
        double acc = 0.0;
        for (int i = 0; i < K; i++) acc += (double)a.w[ch * K + i] * conv_input(a, state, first, j - (K - 1) + i, ch);
        a.out[(first + j) * a.channels + ch] = (float)(acc / (1.0 + exp(-acc)));
    }
    for (int i = 0; i < K - 1; i++) last[i] = conv_input(a, state, first, n - (K - 1) + i, ch);
    for (int i = 0; i < K - 1; i++) state[i] = last[i];
}

cudaError_t dn_conv_ref(const strata_dev_dn_conv_args *a, cudaStream_t stream) {
    dn_conv_ref_kernel<<<blocks_for(a->n_seq * a->channels, 128), 128, 0, stream>>>(*a);
    return cudaGetLastError();
}

/* L2 norm: one thread per (token, head) */
__global__ void l2_norm_ref_kernel(strata_dev_l2_norm_args a) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= (int64_t)a.n_tok * a.n_head) return;
    float *x = a.x + o / a.n_head * a.row_stride + o % a.n_head * a.head_dim;
    double ss = 0.0;
    for (int i = 0; i < a.head_dim; i++) ss += (double)x[i] * x[i];
    double f = a.scale / sqrt(ss + 1e-6);
    for (int i = 0; i < a.head_dim; i++) x[i] = (float)(x[i] * f);
}

cudaError_t l2_norm_ref(const strata_dev_l2_norm_args *a, cudaStream_t stream) {
    l2_norm_ref_kernel<<<blocks_for((int64_t)a->n_tok * a->n_head, 64), 64, 0, stream>>>(*a);
    return cudaGetLastError();
}

/* The gates: one thread per (token, v head), in double */
__global__ void dn_gates_ref_kernel(strata_dev_dn_gates_args a) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= (int64_t)a.n_tok * a.n_head) return;
    int h = (int)(o % a.n_head);
    double x = (double)a.alpha[o] + a.dt_bias[h];
    a.alpha[o] = (float)(a.a[h] * (x > 20.0 ? x : log1p(exp(x))));
    a.beta[o] = (float)(1.0 / (1.0 + exp(-(double)a.beta[o])));
}

cudaError_t dn_gates_ref(const strata_dev_dn_gates_args *a, cudaStream_t stream) {
    dn_gates_ref_kernel<<<blocks_for((int64_t)a->n_tok * a->n_head, 128), 128, 0, stream>>>(*a);
    return cudaGetLastError();
}

/* The delta rule by its recurrent form, token by token: one thread per (sequence, v head, column j of the state),
 * as a column's update reads only that column (S^T k and S^T q are per column) */
__global__ void delta_rule_ref_kernel(strata_dev_delta_rule_args a) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int d = a.head_dim, hv = a.n_v_heads;
    if (o >= (int64_t)a.n_seq * hv * d) return;
    int j = (int)(o % d), h = (int)(o / d % hv), s = (int)(o / d / hv), kh = h % a.n_k_heads;
    if (a.seq[s] < 0) return;  // a run the other form takes
    float *S = a.state + a.seq[s] * a.state_stride + (size_t)h * d * d + j;  // column j: rows d apart
    for (int t = a.seq_first[s]; t < a.seq_first[s + 1]; t++) {
        const float *q = a.q + t * a.row_stride + kh * d, *k = a.k + t * a.row_stride + kh * d;
        double decay = exp((double)a.g[t * hv + h]), kv = 0.0, out = 0.0;
        for (int i = 0; i < d; i++) kv += decay * S[i * d] * k[i];
        double delta = a.beta[t * hv + h] * (a.v[t * a.row_stride + h * d + j] - kv);
        for (int i = 0; i < d; i++) {
            double v = decay * S[i * d] + k[i] * delta;
            S[i * d] = (float)v;
            out += v * q[i];
        }
        a.out[((size_t)t * hv + h) * d + j] = (float)out;
    }
}

cudaError_t delta_rule_ref(const strata_dev_delta_rule_args *a, cudaStream_t stream) {
    delta_rule_ref_kernel<<<blocks_for((int64_t)a->n_seq * a->n_v_heads * a->head_dim, 128), 128, 0, stream>>>(*a);
    return cudaGetLastError();
}

/* The delta rule by its chunked form, in double: one thread per (sequence, v head, column j of the state), chunks
 * of DELTA_CHUNK tokens. Within a chunk, gc the decays' running sum and A[i][m] = beta_i (k_i . k_m) exp(gc_i - gc_m)
 * (m < i); the corrected values of column j solve (I + A) u = r, r_i = beta_i (v_ij - exp(gc_i) k_i . S_j) (the
 * CPU engine's U - W S, whose W S is (I + A)^-1 of beta exp(gc) K S); then o_ij = exp(gc_i) q_i . S_j +
 * sum_{m <= i} (q_i . k_m) exp(gc_i - gc_m) u_m and S_j = exp(gc_last) S_j + sum_m exp(gc_last - gc_m) k_m u_m.
 * A column reads only its own column, as in the recurrent form; A's entries are recomputed where they are used. */
__device__ double dot_rows(const float *x, const float *y, int d) {
    double s = 0.0;
    for (int i = 0; i < d; i++) s += (double)x[i] * y[i];
    return s;
}

__global__ void delta_rule_chunked_ref_kernel(strata_dev_delta_rule_args a) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int d = a.head_dim, hv = a.n_v_heads;
    if (o >= (int64_t)a.n_seq * hv * d) return;
    int j = (int)(o % d), h = (int)(o / d % hv), s = (int)(o / d / hv), kh = h % a.n_k_heads;
    if (a.seq[s] < 0) return;  // a run the other form takes
    float *S = a.state + a.seq[s] * a.state_stride + (size_t)h * d * d + j;  // column j: rows d apart
    double gc[DELTA_CHUNK], u[DELTA_CHUNK];
    for (int c0 = a.seq_first[s]; c0 < a.seq_first[s + 1]; c0 += DELTA_CHUNK) {
        int L = min(DELTA_CHUNK, a.seq_first[s + 1] - c0);
        const float *q = a.q + c0 * a.row_stride + kh * d, *k = a.k + c0 * a.row_stride + kh * d;
        const float *v = a.v + c0 * a.row_stride + h * d + j, *g = a.g + (size_t)c0 * hv + h;
        const float *beta = a.beta + (size_t)c0 * hv + h;
        for (int i = 0; i < L; i++) gc[i] = g[(size_t)i * hv] + (i ? gc[i - 1] : 0.0);
        for (int i = 0; i < L; i++) {  // u by forward substitution
            double ks = 0.0;
            for (int x = 0; x < d; x++) ks += (double)k[i * a.row_stride + x] * S[x * d];
            u[i] = beta[(size_t)i * hv] * (v[i * a.row_stride] - exp(gc[i]) * ks);
            for (int m = 0; m < i; m++)
                u[i] -= beta[(size_t)i * hv] * dot_rows(k + i * a.row_stride, k + m * a.row_stride, d) *
                        exp(gc[i] - gc[m]) * u[m];
        }
        for (int i = 0; i < L; i++) {  // the outputs, from S as it was
            double out = 0.0;
            for (int x = 0; x < d; x++) out += (double)q[i * a.row_stride + x] * S[x * d];
            out *= exp(gc[i]);
            for (int m = 0; m <= i; m++)
                out += dot_rows(q + i * a.row_stride, k + m * a.row_stride, d) * exp(gc[i] - gc[m]) * u[m];
            a.out[((size_t)(c0 + i) * hv + h) * d + j] = (float)out;
        }
        for (int x = 0; x < d; x++) {
            double col = exp(gc[L - 1]) * S[x * d];
            for (int m = 0; m < L; m++) col += exp(gc[L - 1] - gc[m]) * k[m * a.row_stride + x] * u[m];
            S[x * d] = (float)col;
        }
    }
}

cudaError_t delta_rule_chunked_ref(const strata_dev_delta_rule_args *a, cudaStream_t stream) {
    delta_rule_chunked_ref_kernel<<<blocks_for((int64_t)a->n_seq * a->n_v_heads * a->head_dim, 128), 128, 0,
                                    stream>>>(*a);
    return cudaGetLastError();
}

/* The gated RMS norm: one thread per row */
__global__ void gated_rms_norm_ref_kernel(strata_dev_gated_rms_norm_args a) {
    int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (r >= a.n_rows) return;
    const float *x = a.x + r * a.n, *z = a.z + r * a.n;
    double ss = 0.0;
    for (int64_t i = 0; i < a.n; i++) ss += (double)x[i] * x[i];
    double f = 1.0 / sqrt(ss / (double)a.n + a.eps);
    for (int64_t i = 0; i < a.n; i++)
        a.out[r * a.n + i] = (float)(x[i] * f * a.w[i] * (z[i] / (1.0 + exp(-(double)z[i]))));
}

cudaError_t gated_rms_norm_ref(const strata_dev_gated_rms_norm_args *a, cudaStream_t stream) {
    gated_rms_norm_ref_kernel<<<blocks_for(a->n_rows, 64), 64, 0, stream>>>(*a);
    return cudaGetLastError();
}


// --- Qwen3.5's gates: one thread per value, in double

__global__ void sigmoid_gate_ref_kernel(strata_dev_sigmoid_gate_args a) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= a.n_rows * a.n) return;
    int64_t r = o / a.n, i = o % a.n;
    double g = a.gate[r * a.gate_stride + (a.per_value ? i : 0)];
    a.x[o] = (float)(a.x[o] / (1.0 + exp(-g)));
}

cudaError_t sigmoid_gate_ref(const strata_dev_sigmoid_gate_args *a, cudaStream_t stream) {
    if (a->n_rows == 0) return cudaSuccess;
    sigmoid_gate_ref_kernel<<<blocks_for(a->n_rows * a->n, 128), 128, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- a vision encoder's pieces

/* LayerNorm: one thread per row, mean and variance in double */
__global__ void layer_norm_ref_kernel(strata_dev_layer_norm_args a) {
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (t >= a.n_tok) return;
    const float *x = a.x + t * a.n;
    double mean = 0.0, var = 0.0;
    for (int64_t i = 0; i < a.n; i++) mean += x[i];
    mean /= (double)a.n;
    for (int64_t i = 0; i < a.n; i++) var += (x[i] - mean) * (x[i] - mean);
    double s = 1.0 / sqrt(var / (double)a.n + a.eps);
    for (int64_t i = 0; i < a.n; i++) a.out[t * a.n + i] = (float)((x[i] - mean) * s * a.w[i] + a.b[i]);
}

cudaError_t layer_norm_ref(const strata_dev_layer_norm_args *a, cudaStream_t stream) {
    layer_norm_ref_kernel<<<blocks_for(a->n_tok, 64), 64, 0, stream>>>(*a);
    return cudaGetLastError();
}

/* GELU: one thread per value, in double (0.7978845608028654: sqrt(2 / pi)) */
__global__ void gelu_ref_kernel(strata_dev_gelu_args a) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= a.n) return;
    double x = a.x[i];
    a.out[i] = (float)(a.erf ? 0.5 * x * (1.0 + erf(x / sqrt(2.0)))
                             : 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))));
}

cudaError_t gelu_ref(const strata_dev_gelu_args *a, cudaStream_t stream) {
    gelu_ref_kernel<<<blocks_for(a->n, 256), 256, 0, stream>>>(*a);
    return cudaGetLastError();
}

/* Full attention over a picture's patches: one thread per output value (token, head, d), three passes over the
 * tokens (the maximum score, then the sum and the weighted values) */
__device__ double vit_score(const strata_dev_vit_attention_args &a, const float *q, int p, int h) {
    const float *k = a.k + ((size_t)p * a.n_head + h) * a.head_dim;
    double s = 0.0;
    for (int d = 0; d < a.head_dim; d++) s += (double)q[d] * k[d];
    return s / sqrt((double)a.head_dim);
}

__global__ void vit_attention_ref_kernel(strata_dev_vit_attention_args a) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= (int64_t)a.n_tok * a.n_head * a.head_dim) return;
    int d = (int)(o % a.head_dim), h = (int)(o / a.head_dim % a.n_head), t = (int)(o / a.head_dim / a.n_head);
    const float *q = a.q + ((size_t)t * a.n_head + h) * a.head_dim;
    double max = -INFINITY, sum = 0.0, acc = 0.0;
    for (int p = 0; p < a.n_tok; p++) max = fmax(max, vit_score(a, q, p, h));
    for (int p = 0; p < a.n_tok; p++) {
        double e = exp(vit_score(a, q, p, h) - max);
        sum += e;
        acc += e * a.v[((size_t)p * a.n_head + h) * a.head_dim + d];
    }
    a.out[o] = (float)(acc / sum);
}

cudaError_t vit_attention_ref(const strata_dev_vit_attention_args *a, cudaStream_t stream) {
    vit_attention_ref_kernel<<<blocks_for((int64_t)a->n_tok * a->n_head * a->head_dim, 128), 128, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- a layer's routed experts: the grouping by one thread (a counting sort), the rows gathered a thread per
// slot; each expert's product one thread per output, finding its expert by the runs

__global__ void moe_group_ref_kernel(strata_dev_moe_group_args a) {
    int n_slots = a.n_tok * a.k;
    for (int e = 0; e < a.n_expert; e++) a.count[e] = 0;
    for (int s = 0; s < n_slots; s++) a.count[a.ids[s]]++;
    for (int e = 0, at = 0; e < a.n_expert; e++) {
        a.first[e] = at;
        at += a.count[e];
    }
    for (int s = 0; s < n_slots; s++) {  // each expert's slots in token order: the slots before it of its expert
        int before = 0;
        for (int j = 0; j < s; j++) before += a.ids[j] == a.ids[s];
        a.slot_of[s] = a.first[a.ids[s]] + before;
    }
}

__global__ void gather_rows_ref_kernel(strata_dev_moe_group_args a) {
    int64_t s = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (s >= (int64_t)a.n_tok * a.k) return;
    for (int64_t i = 0; i < a.n; i++) a.x_out[a.slot_of[s] * a.n + i] = a.x[s / a.k * a.n + i];
}

cudaError_t moe_group_ref(const strata_dev_moe_group_args *a, cudaStream_t stream) {
    moe_group_ref_kernel<<<1, 1, 0, stream>>>(*a);
    gather_rows_ref_kernel<<<blocks_for((int64_t)a->n_tok * a->k, 64), 64, 0, stream>>>(*a);
    return cudaGetLastError();
}

template <int T> __global__ void moe_matmul_ref_kernel(strata_dev_moe_matmul_args a) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= a.n_slots * a.rows) return;
    int64_t r = o % a.rows, s = o / a.rows;
    for (int e = 0; e < a.n_expert; e++) {
        if (s < a.first[e] || s >= a.first[e] + a.count[e]) continue;
        const uint8_t *row = (const uint8_t *)a.slots[e] + a.offset + r * a.row_bytes;
        double acc = 0.0;
        for (int64_t i = 0; i < a.n; i++) acc += (double)value_at<T>(row, i) * a.x[s * a.n + i];
        a.y[s * a.rows + r] = (float)acc;
    }
}

cudaError_t moe_matmul_ref(const strata_dev_moe_matmul_args *a, cudaStream_t stream) {
    return by_type(a->type, [&](auto t) {
        moe_matmul_ref_kernel<decltype(t)::value><<<blocks_for(a->n_slots * a->rows, 128), 128, 0, stream>>>(*a);
        return cudaGetLastError();
    });
}

}  // namespace strata_cuda

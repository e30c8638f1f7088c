/* kernels_fast.cu — the fast kernels. Products: a warp per weight row; quantised weights meet activations
 * quantised to 32-value int8 blocks (act_block) in int8 dot products of four lanes (__dp4a), each warp holding
 * up to TOKENS tokens' sums, so one pass over a row serves a group of tokens (matrix-matrix products are the same
 * kernel over several groups); F32, F16 and BF16 rows meet f32 activations. The rest: warp and block reductions,
 * attention with a running (online) softmax per warp, and the Gated DeltaNet's pieces (the delta rule a token loop per
 * (sequence, head), its state's columns in registers). */
#include <math.h>
#include "blocks.cuh"
#include "kernels.cuh"

namespace strata_cuda {

constexpr int WARP = 32, TOKENS = 8, ROWS_PER_BLOCK = 4;

__device__ inline float warp_sum(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ inline float warp_max(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// --- activations to int8 blocks: a warp per block of 32, d = amax / 127, q = round(x / d)

__global__ void quantize_acts(const float *x, act_block *out, int64_t n_blocks) {
    int64_t b = blockIdx.x * (int64_t)(blockDim.x / WARP) + threadIdx.x / WARP;
    if (b >= n_blocks) return;
    int lane = threadIdx.x % WARP;
    float v = x[b * 32 + lane], d = warp_max(fabsf(v)) / 127.0f;
    int q = act_quant(v, d);
    out[b].q[lane] = (int8_t)q;
    float sum = warp_sum((float)q);
    if (lane == 0) {
        out[b].d = d;
        out[b].s = d * sum;
    }
}

// --- products

/* One weight row against up to TOKENS tokens (nt of them): token t's activations at xq + t chunks (quantised
 * blocks) or x + t n (f32), its sum written to y[t y_stride] by lane 0. The inner loop of "matmul" and of
 * "moe_matmul" alike. */
template <int T>
__device__ inline void row_q8(const uint8_t *row, int64_t chunks, const act_block *xq, int nt, float *y,
                              int64_t y_stride, int lane) {
    float acc[TOKENS] = {};
    for (int64_t c = lane; c < chunks; c += WARP) {
        chunk k = chunk_at<T>(row, c);
#pragma unroll
        for (int t = 0; t < TOKENS; t++) {
            if (t >= nt) break;
            acc[t] += chunk_dot(k, xq[t * chunks + c]);
        }
    }
#pragma unroll
    for (int t = 0; t < TOKENS; t++) {
        if (t >= nt) break;
        float v = warp_sum(acc[t]);
        if (lane == 0) y[t * y_stride] = v;
    }
}

/* F32 / F16 / BF16 rows against f32 activations: each lane takes pairs of values. */
template <int T>
__device__ inline void row_half(const uint8_t *row, int64_t n, const float *x, int nt, float *y, int64_t y_stride,
                                int lane) {
    float acc[TOKENS] = {};
    for (int64_t i = 2 * lane; i < n; i += 2 * WARP) {
        float w0 = value_at<T>(row, i), w1 = i + 1 < n ? value_at<T>(row, i + 1) : 0.0f;
#pragma unroll
        for (int t = 0; t < TOKENS; t++) {
            if (t >= nt) break;
            const float *xt = x + t * n;
            acc[t] += w0 * xt[i] + (i + 1 < n ? w1 * xt[i + 1] : 0.0f);
        }
    }
#pragma unroll
    for (int t = 0; t < TOKENS; t++) {
        if (t >= nt) break;
        float v = warp_sum(acc[t]);
        if (lane == 0) y[t * y_stride] = v;
    }
}

/* Row r (of this block's warps) times tokens [t0, t0 + nt) of x (or of its quantised blocks xq), into y (rows
 * apart): the float types read x, the others xq. */
template <int T>
__device__ inline void row_product(const uint8_t *row, int64_t n, const float *x, const act_block *xq, int64_t t0,
                                   int nt, float *y, int64_t rows) {
    int lane = threadIdx.x % WARP;
    if constexpr (T == STRATA_TYPE_F32 || T == STRATA_TYPE_F16 || T == STRATA_TYPE_BF16)
        row_half<T>(row, n, x + t0 * n, nt, y, rows, lane);
    else
        row_q8<T>(row, n / 32, xq + t0 * (n / 32), nt, y, rows, lane);
}

/* y[t, r] for the rows of this block's warps and the tokens [t0, t0 + TOKENS) of this grid row. */
template <int T>
__global__ void matmul_kernel(const uint8_t *w, size_t row_bytes, int64_t n, const float *x, const act_block *xq,
                              float *y, int64_t rows, int64_t n_tok) {
    int64_t r = blockIdx.x * (int64_t)ROWS_PER_BLOCK + threadIdx.x / WARP, t0 = blockIdx.y * (int64_t)TOKENS;
    if (r >= rows) return;
    row_product<T>(w + r * row_bytes, n, x, xq, t0, (int)min((int64_t)TOKENS, n_tok - t0), y + t0 * rows + r, rows);
}

/* Every expert's rows at once: grid (row blocks, expert, passes of TOKENS rows); a block past its expert's rows
 * (all of them, for an expert no token chose) exits at once. */
template <int T>
__global__ void moe_matmul_kernel(strata_dev_moe_matmul_args a, const act_block *xq) {
    int e = blockIdx.y, count = a.count[e];
    int64_t r = blockIdx.x * (int64_t)ROWS_PER_BLOCK + threadIdx.x / WARP, t0 = blockIdx.z * (int64_t)TOKENS;
    if (t0 >= count || r >= a.rows) return;
    const uint8_t *row = (const uint8_t *)a.slots[e] + a.offset + r * a.row_bytes;
    int64_t s0 = a.first[e] + t0;
    row_product<T>(row, a.n, a.x, xq, s0, (int)min((int64_t)TOKENS, count - t0), a.y + s0 * a.rows + r, a.rows);
}

static bool is_float(int type) {
    return type == STRATA_TYPE_F32 || type == STRATA_TYPE_F16 || type == STRATA_TYPE_BF16;
}

static size_t act_scratch_bytes(int type, int64_t n_tok, int64_t n) {
    return is_float(type) ? 0 : sizeof(act_block) * (size_t)(n_tok * n / 32);
}

size_t matmul_scratch_bytes(const strata_dev_matmul_args *a) { return act_scratch_bytes(a->type, a->n_tok, a->n); }

size_t moe_matmul_scratch_bytes(const strata_dev_moe_matmul_args *a) {
    return act_scratch_bytes(a->type, a->n_slots, a->n);
}

/* x's n_tok rows quantised into xq (32-value blocks), where the weights are quantised. */
static void quantize(int type, const float *x, int64_t n_tok, int64_t n, act_block *xq, cudaStream_t stream) {
    if (is_float(type)) return;
    int64_t n_blocks = n_tok * n / 32;
    quantize_acts<<<(unsigned)((n_blocks + 7) / 8), 8 * WARP, 0, stream>>>(x, xq, n_blocks);
}

template <int T> static cudaError_t launch_matmul(const strata_dev_matmul_args *a, act_block *xq, cudaStream_t stream) {
    dim3 grid((unsigned)((a->rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK), (unsigned)((a->n_tok + TOKENS - 1) / TOKENS));
    quantize(T, a->x, a->n_tok, a->n, xq, stream);
    matmul_kernel<T><<<grid, ROWS_PER_BLOCK * WARP, 0, stream>>>((const uint8_t *)a->w, a->row_bytes, a->n, a->x, xq,
                                                                 a->y, a->rows, a->n_tok);
    return cudaGetLastError();
}

template <int T>
static cudaError_t launch_moe_matmul(const strata_dev_moe_matmul_args *a, act_block *xq, cudaStream_t stream) {
    dim3 grid((unsigned)((a->rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK), (unsigned)a->n_expert,
              (unsigned)((a->max_rows + TOKENS - 1) / TOKENS));
    quantize(T, a->x, a->n_slots, a->n, xq, stream);
    moe_matmul_kernel<T><<<grid, ROWS_PER_BLOCK * WARP, 0, stream>>>(*a, xq);
    return cudaGetLastError();
}

cudaError_t matmul(const strata_dev_matmul_args *a, void *scratch, cudaStream_t stream) {
    return by_type(a->type, [&](auto t) { return launch_matmul<decltype(t)::value>(a, (act_block *)scratch, stream); });
}

cudaError_t moe_matmul(const strata_dev_moe_matmul_args *a, void *scratch, cudaStream_t stream) {
    return by_type(a->type,
                   [&](auto t) { return launch_moe_matmul<decltype(t)::value>(a, (act_block *)scratch, stream); });
}

// --- a layer's slots grouped by expert: one block counts each expert's slots, places them (each expert's in
// token order: a thread per expert scans the slots in order), then a thread per value gathers the rows

constexpr int GROUP_THREADS = 256;

__global__ void moe_group_kernel(strata_dev_moe_group_args a) {
    int n_slots = a.n_tok * a.k;
    for (int e = threadIdx.x; e < a.n_expert; e += GROUP_THREADS) {
        int c = 0;
        for (int s = 0; s < n_slots; s++) c += a.ids[s] == e;
        a.count[e] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // each expert's first place: the counts before it (n_expert is a few hundred at most)
        for (int e = 0, at = 0; e < a.n_expert; e++) {
            a.first[e] = at;
            at += a.count[e];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < a.n_expert; e += GROUP_THREADS) {
        int at = a.first[e], end = at + a.count[e];
        for (int s = 0; s < n_slots && at < end; s++)
            if (a.ids[s] == e) a.slot_of[s] = at++;
    }
}

__global__ void gather_rows_kernel(strata_dev_moe_group_args a) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= (int64_t)a.n_tok * a.k * a.n) return;
    int64_t s = o / a.n, i = o % a.n;
    a.x_out[a.slot_of[s] * a.n + i] = a.x[s / a.k * a.n + i];
}

cudaError_t moe_group(const strata_dev_moe_group_args *a, cudaStream_t stream) {
    int64_t values = (int64_t)a->n_tok * a->k * a->n;
    moe_group_kernel<<<1, GROUP_THREADS, 0, stream>>>(*a);
    gather_rows_kernel<<<(unsigned)((values + 255) / 256), 256, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- RMS norm: a block of 256 threads per row

constexpr int NORM_THREADS = 256;

__global__ void rms_norm_kernel(strata_dev_rms_norm_args a) {
    __shared__ float part[NORM_THREADS / WARP];
    const float *x = a.x + blockIdx.x * a.n;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < a.n; i += NORM_THREADS) ss += x[i] * x[i];
    ss = warp_sum(ss);
    if (threadIdx.x % WARP == 0) part[threadIdx.x / WARP] = ss;
    __syncthreads();
    ss = threadIdx.x < NORM_THREADS / WARP ? part[threadIdx.x] : 0.0f;
    ss = warp_sum(ss);  // every warp sums the partial sums: all threads end with the total
    float s = rsqrtf(ss / (float)a.n + a.eps);
    for (int64_t i = threadIdx.x; i < a.n; i += NORM_THREADS) a.out[blockIdx.x * a.n + i] = x[i] * s * a.w[i];
}

cudaError_t rms_norm(const strata_dev_rms_norm_args *a, cudaStream_t stream) {
    rms_norm_kernel<<<(unsigned)a->n_tok, NORM_THREADS, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- RoPE: a thread per pair, the angle's sine and cosine together in f32

__global__ void rope_kernel(strata_dev_rope_args a) {
    int half = (a.n_rot ? a.n_rot : a.head_dim) / 2;
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= (int64_t)a.n_tok * a.n_head * half) return;
    int i = (int)(o % half), t = (int)(o / half / a.n_head);
    float *x = a.x + o / half * a.head_dim, s, c;
    sincosf((float)a.pos[3 * t + a.axis[i]] * a.inv_freq[i], &s, &c);
    int p = a.neox ? i : 2 * i, q = a.neox ? i + half : 2 * i + 1;
    float x0 = x[p], x1 = x[q];
    x[p] = x0 * c - x1 * s;
    x[q] = x0 * s + x1 * c;
}

cudaError_t rope(const strata_dev_rope_args *a, cudaStream_t stream) {
    int64_t n = (int64_t)a->n_tok * a->n_head * ((a->n_rot ? a->n_rot : a->head_dim) / 2);
    rope_kernel<<<(unsigned)((n + 127) / 128), 128, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- attention: a block per (token, head); each warp runs an online softmax over every ATT_WARPS-th position
// (its running maximum m, sum l and weighted values acc), lane j holding values j, j + 32, ... of the head; the
// warps' states are merged at the end.

constexpr int ATT_WARPS = 4, MAX_PER_LANE = 256 / WARP;

__device__ inline float kv_at(const strata_dev_attention_args &a, const void *cache, const float *scale, size_t row,
                              int d) {
    size_t i = row * a.head_dim + d;
    if (a.kv_type == STRATA_KV_F32) return ((const float *)cache)[i];
    if (a.kv_type == STRATA_KV_F16) return __half2float(((const __half *)cache)[i]);
    return (float)((const int8_t *)cache)[i] * scale[row];
}

__global__ void attention_kernel(strata_dev_attention_args a) {
    __shared__ float wm[ATT_WARPS], wl[ATT_WARPS], wacc[ATT_WARPS][256];
    int t = blockIdx.x / a.n_head, h = blockIdx.x % a.n_head, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int per_lane = a.head_dim / WARP;
    const float *q = a.q + ((size_t)t * a.n_head + h) * a.head_dim;
    size_t base = (((size_t)a.seq[t] * a.n_layer + a.il) * a.n_head_kv + h / (a.n_head / a.n_head_kv)) * a.n_ctx;
    float scale = rsqrtf((float)a.head_dim), qv[MAX_PER_LANE], acc[MAX_PER_LANE], m = -INFINITY, l = 0.0f;
#pragma unroll
    for (int j = 0; j < MAX_PER_LANE; j++) {
        qv[j] = j < per_lane ? q[lane + WARP * j] * scale : 0.0f;
        acc[j] = 0.0f;
    }
    for (int p = (a.first ? a.first[t] : 0) + warp; p < a.n_pos[t]; p += ATT_WARPS) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_PER_LANE; j++)
            if (j < per_lane) s += qv[j] * kv_at(a, a.k, a.k_scale, base + p, lane + WARP * j);
        s = warp_sum(s);
        float m_new = fmaxf(m, s), old = __expf(m - m_new), e = __expf(s - m_new);
        l = l * old + e;
#pragma unroll
        for (int j = 0; j < MAX_PER_LANE; j++)
            if (j < per_lane) acc[j] = acc[j] * old + e * kv_at(a, a.v, a.v_scale, base + p, lane + WARP * j);
        m = m_new;
    }
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < MAX_PER_LANE; j++)
        if (j < per_lane) wacc[warp][lane + WARP * j] = acc[j];
    __syncthreads();
    // merge: out = sum_w e^(m_w - M) acc_w / sum_w e^(m_w - M) l_w (a warp with no positions has l = 0, m = -inf)
    float big = -INFINITY, total = 0.0f;
    for (int w = 0; w < ATT_WARPS; w++) big = fmaxf(big, wm[w]);
    for (int w = 0; w < ATT_WARPS; w++) total += wl[w] == 0.0f ? 0.0f : __expf(wm[w] - big) * wl[w];
    float *out = a.out + ((size_t)t * a.n_head + h) * a.head_dim;
    for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) {
        float v = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++)
            if (wl[w] != 0.0f) v += __expf(wm[w] - big) * wacc[w][d];
        out[d] = v / total;
    }
}

cudaError_t attention(const strata_dev_attention_args *a, cudaStream_t stream) {
    attention_kernel<<<(unsigned)(a->n_tok * a->n_head), ATT_WARPS * WARP, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- SwiGLU

__global__ void swiglu_kernel(strata_dev_swiglu_args a) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < a.n) {
        float g = a.g[i];
        a.out[i] = g / (1.0f + __expf(-g)) * a.u[i];
    }
}

cudaError_t swiglu(const strata_dev_swiglu_args *a, cudaStream_t stream) {
    swiglu_kernel<<<(unsigned)((a->n + 255) / 256), 256, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- top-k: a warp per token; k rounds of a warp-wide arg-max over the experts not yet taken (the larger
// logit, then the lower index), whose winner every lane then knows

__global__ void topk_kernel(strata_dev_topk_args a) {
    int t = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (t >= a.n_tok) return;
    const float *l = a.logits + (size_t)t * a.n_expert;
    float max = -INFINITY;
    for (int e = lane; e < a.n_expert; e += WARP) max = fmaxf(max, l[e]);
    max = warp_max(max);
    int chosen[32];
    float kept = 0.0f;
    for (int j = 0; j < a.k; j++) {
        float bv = -INFINITY;
        int bi = -1;
        for (int e = lane; e < a.n_expert; e += WARP) {
            bool taken = false;
            for (int i = 0; i < j; i++) taken |= chosen[i] == e;
            if (!taken && (bi < 0 || l[e] > bv)) bv = l[e], bi = e;
        }
        for (int o = WARP / 2; o > 0; o /= 2) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) bv = ov, bi = oi;
        }
        chosen[j] = bi;
        kept += expf(bv - max);
    }
    if (lane == 0)
        for (int j = 0; j < a.k; j++) {
            a.ids[t * a.k + j] = chosen[j];
            a.weights[t * a.k + j] = expf(l[chosen[j]] - max) / kept;
        }
}

cudaError_t topk(const strata_dev_topk_args *a, cudaStream_t stream) {
    topk_kernel<<<(unsigned)((a->n_tok + 3) / 4), 4 * WARP, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- rows added (a residual, a token's experts mixed): a thread per value

__global__ void add_rows_kernel(strata_dev_add_rows_args a) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, t = blockIdx.y;
    if (i >= a.n) return;
    float acc = a.out[t * a.n + i];
    for (int j = 0; j < a.k; j++) {
        int64_t at = t * a.k + j;
        acc += (a.weight ? a.weight[at] : 1.0f) * a.y[(a.idx ? a.idx[at] : at) * a.n + i];
    }
    a.out[t * a.n + i] = acc;
}

cudaError_t add_rows(const strata_dev_add_rows_args *a, cudaStream_t stream) {
    add_rows_kernel<<<dim3((unsigned)((a->n + 255) / 256), (unsigned)a->n_tok), 256, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- KV rows into the cache: a warp per (token, kv head) row, K then V

__device__ void store_row_warp(const strata_dev_kv_store_args &a, void *cache, float *scales, size_t idx,
                               const float *src, int lane) {
    int hd = a.head_dim;
    if (a.kv_type == STRATA_KV_F32) {
        for (int i = lane; i < hd; i += WARP) ((float *)cache)[idx * hd + i] = src[i];
    } else if (a.kv_type == STRATA_KV_F16) {
        for (int i = lane; i < hd; i += WARP) ((__half *)cache)[idx * hd + i] = __float2half_rn(src[i]);
    } else {
        float amax = 0.0f;
        for (int i = lane; i < hd; i += WARP) amax = fmaxf(amax, fabsf(src[i]));
        float scale = warp_max(amax) / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int i = lane; i < hd; i += WARP) ((int8_t *)cache)[idx * hd + i] = (int8_t)__float2int_rn(src[i] * inv);
        if (lane == 0) scales[idx] = scale;
    }
}

__global__ void kv_store_kernel(strata_dev_kv_store_args a) {
    int64_t r = blockIdx.x * (int64_t)(blockDim.x / WARP) + threadIdx.x / WARP;  // token t's kv head h: t * n_kv + h
    if (r >= (int64_t)a.n_tok * a.n_head_kv) return;
    int t = (int)(r / a.n_head_kv), kvh = (int)(r % a.n_head_kv), lane = threadIdx.x % WARP;
    size_t idx = (((size_t)a.seq[t] * a.n_layer + a.il) * a.n_head_kv + kvh) * a.n_ctx + a.pos[t];
    store_row_warp(a, a.k, a.k_scale, idx, a.k_in + r * a.head_dim, lane);
    store_row_warp(a, a.v, a.v_scale, idx, a.v_in + r * a.head_dim, lane);
}

cudaError_t kv_store(const strata_dev_kv_store_args *a, cudaStream_t stream) {
    int64_t rows = (int64_t)a->n_tok * a->n_head_kv;
    kv_store_kernel<<<(unsigned)((rows + 3) / 4), 4 * WARP, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- Gated DeltaNet

/* The convolution: a thread per (sequence, channel), its window of d_conv <= 8 inputs in registers, sliding over
 * the sequence's tokens (consecutive threads take consecutive channels: the rows are read coalesced) */
constexpr int MAX_CONV = 8;

__global__ void dn_conv_kernel(strata_dev_dn_conv_args a) {
    int64_t ch = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int s = blockIdx.y, K = a.d_conv;
    if (ch >= a.channels) return;
    float *state = a.state + a.seq[s] * a.state_stride + ch * (K - 1), w[MAX_CONV], win[MAX_CONV];
#pragma unroll
    for (int i = 0; i < MAX_CONV; i++) {
        w[i] = i < K ? a.w[ch * K + i] : 0.0f;
        win[i] = i < K - 1 ? state[i] : 0.0f;  // win[K - 1] takes each token's own input
    }
    for (int t = a.seq_first[s]; t < a.seq_first[s + 1]; t++) {
        float acc = 0.0f, in = a.x[t * a.channels + ch];
#pragma unroll
        for (int i = 0; i < MAX_CONV; i++) {
            if (i == K - 1) win[i] = in;
            if (i < K) acc += w[i] * win[i];
        }
        a.out[t * a.channels + ch] = acc / (1.0f + expf(-acc));
#pragma unroll
        for (int i = 0; i + 1 < MAX_CONV; i++)
            if (i < K - 1) win[i] = win[i + 1];
    }
#pragma unroll
    for (int i = 0; i < MAX_CONV; i++)
        if (i < K - 1) state[i] = win[i];
}

cudaError_t dn_conv(const strata_dev_dn_conv_args *a, cudaStream_t stream) {
    dn_conv_kernel<<<dim3((unsigned)((a->channels + 127) / 128), (unsigned)a->n_seq), 128, 0, stream>>>(*a);
    return cudaGetLastError();
}

/* L2 norm: a warp per (token, head) */
__global__ void l2_norm_kernel(strata_dev_l2_norm_args a) {
    int64_t o = blockIdx.x * (int64_t)(blockDim.x / WARP) + threadIdx.x / WARP;
    if (o >= (int64_t)a.n_tok * a.n_head) return;
    int lane = threadIdx.x % WARP;
    float *x = a.x + o / a.n_head * a.row_stride + o % a.n_head * a.head_dim, ss = 0.0f;
    for (int i = lane; i < a.head_dim; i += WARP) ss += x[i] * x[i];
    float f = a.scale * rsqrtf(warp_sum(ss) + 1e-6f);
    for (int i = lane; i < a.head_dim; i += WARP) x[i] *= f;
}

cudaError_t l2_norm(const strata_dev_l2_norm_args *a, cudaStream_t stream) {
    int64_t heads = (int64_t)a->n_tok * a->n_head;
    l2_norm_kernel<<<(unsigned)((heads + 3) / 4), 4 * WARP, 0, stream>>>(*a);
    return cudaGetLastError();
}

/* The gates: a thread per (token, v head) */
__global__ void dn_gates_kernel(strata_dev_dn_gates_args a) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= (int64_t)a.n_tok * a.n_head) return;
    int h = (int)(o % a.n_head);
    float x = a.alpha[o] + a.dt_bias[h];
    a.alpha[o] = a.a[h] * (x > 20.0f ? x : log1pf(expf(x)));
    a.beta[o] = 1.0f / (1.0f + expf(-a.beta[o]));
}

cudaError_t dn_gates(const strata_dev_dn_gates_args *a, cudaStream_t stream) {
    int64_t n = (int64_t)a->n_tok * a->n_head;
    dn_gates_kernel<<<(unsigned)((n + 127) / 128), 128, 0, stream>>>(*a);
    return cudaGetLastError();
}

/* The delta rule: a block per (sequence, v head), a thread per column j of its state, held in registers for the
 * sequence's tokens (read and written once per launch); each token's q and k rows in shared memory. A column's
 * update needs only that column (S^T k and S^T q are per column), so the threads never exchange partial sums.
 * A run whose slot is negative is the chunked form's (delta_rule_chunked below). */
constexpr int MAX_HEAD = 128;

__global__ void delta_rule_kernel(strata_dev_delta_rule_args a) {
    __shared__ float qs[MAX_HEAD], ks[MAX_HEAD];
    const int d = a.head_dim, hv = a.n_v_heads, j = threadIdx.x;
    int s = blockIdx.x / hv, h = blockIdx.x % hv, kh = h % a.n_k_heads;
    if (a.seq[s] < 0) return;
    float *S = a.state + a.seq[s] * a.state_stride + (size_t)h * d * d + j, col[MAX_HEAD];
#pragma unroll
    for (int i = 0; i < MAX_HEAD; i++) col[i] = i < d ? S[i * d] : 0.0f;
    for (int t = a.seq_first[s]; t < a.seq_first[s + 1]; t++) {
        __syncthreads();  // the previous token's rows are read
        qs[j] = a.q[t * a.row_stride + kh * d + j];
        ks[j] = a.k[t * a.row_stride + kh * d + j];
        __syncthreads();
        float decay = expf(a.g[t * hv + h]), kv = 0.0f, out = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_HEAD; i++)
            if (i < d) {
                col[i] *= decay;
                kv += col[i] * ks[i];
            }
        float delta = a.beta[t * hv + h] * (a.v[t * a.row_stride + h * d + j] - kv);
#pragma unroll
        for (int i = 0; i < MAX_HEAD; i++)
            if (i < d) {
                col[i] += ks[i] * delta;
                out += col[i] * qs[i];
            }
        a.out[((size_t)t * hv + h) * d + j] = out;
    }
#pragma unroll
    for (int i = 0; i < MAX_HEAD; i++)
        if (i < d) S[i * d] = col[i];
}

cudaError_t delta_rule(const strata_dev_delta_rule_args *a, cudaStream_t stream) {
    delta_rule_kernel<<<(unsigned)(a->n_seq * a->n_v_heads), (unsigned)a->head_dim, 0, stream>>>(*a);
    return cudaGetLastError();
}

/* The delta rule by its chunked form (blocks_deltanet.c's chunk_step): a block per (sequence, v head), a thread per
 * column j of its state, held in registers for the sequence's tokens as in the token loop. Per chunk of C tokens,
 * in shared memory: the chunk's k rows, its q rows (whose place the corrected values u then take), the decays'
 * running sum gc, beta, and one C x C matrix holding A[i][m] = beta_i (k_i . k_m) exp(gc_i - gc_m) below its
 * diagonal and, transposed on and above it, QK[i][m] = (q_i . k_m) exp(gc_i - gc_m) (m <= i). After those
 * products each column is on its own, as in the token loop: u solves (I + A) u = beta (v_j - exp(gc) K S_j) by
 * forward substitution (the CPU engine's U - W S: W S = (I + A)^-1 beta exp(gc) K S), o_i = exp(gc_i) q_i . S_j +
 * sum_{m <= i} QK[i][m] u_m, then S_j = exp(gc_last) S_j + sum_m exp(gc_last - gc_m) k_m u_m. Rows are head_dim + 1
 * floats apart (the products' threads read different rows at the same column: no bank conflicts). */
__host__ __device__ constexpr size_t delta_chunked_shared(int head_dim) {
    constexpr size_t C = DELTA_CHUNK;
    return sizeof(float) * (2 * C * (head_dim + 1) + C * C + 2 * C);
}
// 81 KiB at head_dim 128: over the default 48 KiB a block, within sm_86's and sm_89's 99 KiB and sm_90's 227 KiB
static_assert(delta_chunked_shared(MAX_HEAD) <= 99 * 1024, "the chunked delta rule's shared memory fits sm_86");

__global__ void delta_rule_chunked_kernel(strata_dev_delta_rule_args a) {
    constexpr int C = DELTA_CHUNK;
    extern __shared__ float shared[];
    const int d = a.head_dim, P = d + 1, hv = a.n_v_heads, j = threadIdx.x;
    int s = blockIdx.x / hv, h = blockIdx.x % hv, kh = h % a.n_k_heads;
    if (a.seq[s] < 0) return;
    float *ks = shared, *qu = ks + C * P, *aq = qu + C * P, *gc = aq + C * C, *beta = gc + C;
    float *S = a.state + a.seq[s] * a.state_stride + (size_t)h * d * d + j, col[MAX_HEAD];
#pragma unroll
    for (int i = 0; i < MAX_HEAD; i++) col[i] = i < d ? S[i * d] : 0.0f;
    for (int c0 = a.seq_first[s]; c0 < a.seq_first[s + 1]; c0 += C) {
        const int L = min(C, a.seq_first[s + 1] - c0);
        float *out = a.out + ((size_t)c0 * hv + h) * d + j;  // token c0 + i's at out[i hv d]
        __syncthreads();  // the previous chunk's rows are read
        for (int i = 0; i < L; i++) {
            ks[i * P + j] = a.k[(c0 + i) * a.row_stride + kh * d + j];
            qu[i * P + j] = a.q[(c0 + i) * a.row_stride + kh * d + j];
        }
        if (j == 0)
            for (int i = 0; i < L; i++) {
                gc[i] = a.g[(size_t)(c0 + i) * hv + h] + (i ? gc[i - 1] : 0.0f);
                beta[i] = a.beta[(size_t)(c0 + i) * hv + h];
            }
        __syncthreads();
        for (int e = j; e < L * L; e += d) {  // entry (i, m), m <= i: QK, and A below the diagonal
            int i = e / L, m = e % L;
            if (m > i) continue;
            float qk = 0.0f, kk = 0.0f, w = expf(gc[i] - gc[m]);
            for (int x = 0; x < d; x++) {
                qk += qu[i * P + x] * ks[m * P + x];
                kk += ks[i * P + x] * ks[m * P + x];
            }
            aq[m * C + i] = qk * w;
            if (m < i) aq[i * C + m] = beta[i] * kk * w;
        }
        for (int i = 0; i < L; i++) {  // exp(gc_i) q_i . S_j, S as it was
            float qs = 0.0f;
#pragma unroll
            for (int x = 0; x < MAX_HEAD; x++)
                if (x < d) qs += qu[i * P + x] * col[x];
            out[(size_t)i * hv * d] = expf(gc[i]) * qs;
        }
        __syncthreads();  // the q rows are read: u takes their place, column by column
        for (int i = 0; i < L; i++) {
            float kS = 0.0f;
#pragma unroll
            for (int x = 0; x < MAX_HEAD; x++)
                if (x < d) kS += ks[i * P + x] * col[x];
            float u = beta[i] * (a.v[(c0 + i) * a.row_stride + h * d + j] - expf(gc[i]) * kS);
            for (int m = 0; m < i; m++) u -= aq[i * C + m] * qu[m * P + j];
            qu[i * P + j] = u;
            float o = out[(size_t)i * hv * d];
            for (int m = 0; m <= i; m++) o += aq[m * C + i] * qu[m * P + j];
            out[(size_t)i * hv * d] = o;
        }
        const float last = gc[L - 1], decay = expf(last);
#pragma unroll
        for (int x = 0; x < MAX_HEAD; x++) col[x] *= decay;
        for (int m = 0; m < L; m++) {
            float w = expf(last - gc[m]) * qu[m * P + j];
#pragma unroll
            for (int x = 0; x < MAX_HEAD; x++)
                if (x < d) col[x] += ks[m * P + x] * w;
        }
    }
#pragma unroll
    for (int i = 0; i < MAX_HEAD; i++)
        if (i < d) S[i * d] = col[i];
}

cudaError_t delta_rule_chunked(const strata_dev_delta_rule_args *a, cudaStream_t stream) {
    size_t shared = delta_chunked_shared(a->head_dim);
    cudaError_t e = cudaFuncSetAttribute(delta_rule_chunked_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)shared);
    if (e != cudaSuccess) return e;
    delta_rule_chunked_kernel<<<(unsigned)(a->n_seq * a->n_v_heads), (unsigned)a->head_dim, shared, stream>>>(*a);
    return cudaGetLastError();
}

/* The gated RMS norm: a warp per row */
__global__ void gated_rms_norm_kernel(strata_dev_gated_rms_norm_args a) {
    int64_t r = blockIdx.x * (int64_t)(blockDim.x / WARP) + threadIdx.x / WARP;
    if (r >= a.n_rows) return;
    int lane = threadIdx.x % WARP;
    const float *x = a.x + r * a.n, *z = a.z + r * a.n;
    float ss = 0.0f;
    for (int64_t i = lane; i < a.n; i += WARP) ss += x[i] * x[i];
    float f = rsqrtf(warp_sum(ss) / (float)a.n + a.eps);
    for (int64_t i = lane; i < a.n; i += WARP) a.out[r * a.n + i] = x[i] * f * a.w[i] * (z[i] / (1.0f + expf(-z[i])));
}

cudaError_t gated_rms_norm(const strata_dev_gated_rms_norm_args *a, cudaStream_t stream) {
    gated_rms_norm_kernel<<<(unsigned)((a->n_rows + 3) / 4), 4 * WARP, 0, stream>>>(*a);
    return cudaGetLastError();
}


// --- Qwen3.5's gates: a thread per value (rows may pass a grid's 65535 in y: tokens x heads of a long chunk)

__global__ void sigmoid_gate_kernel(strata_dev_sigmoid_gate_args a) {
    int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (o >= a.n_rows * a.n) return;
    int64_t r = o / a.n, i = o % a.n;
    float g = a.gate[r * a.gate_stride + (a.per_value ? i : 0)];
    a.x[o] /= 1.0f + expf(-g);
}

cudaError_t sigmoid_gate(const strata_dev_sigmoid_gate_args *a, cudaStream_t stream) {
    if (a->n_rows == 0) return cudaSuccess;
    sigmoid_gate_kernel<<<(unsigned)((a->n_rows * a->n + 255) / 256), 256, 0, stream>>>(*a);
    return cudaGetLastError();
}

// --- a vision encoder's pieces

/* The sum of v over a block of VIT_THREADS threads, known to every thread. */
constexpr int VIT_THREADS = 256;

__device__ float block_sum(float v) {
    __shared__ float part[VIT_THREADS / WARP];
    v = warp_sum(v);
    __syncthreads();  // a previous call's partial sums are read
    if (threadIdx.x % WARP == 0) part[threadIdx.x / WARP] = v;
    __syncthreads();
    return warp_sum(threadIdx.x % WARP < VIT_THREADS / WARP ? part[threadIdx.x % WARP] : 0.0f);
}

/* LayerNorm: a block per row; the mean, then the centred squares' mean (two passes over the row, as the
 * reference, rather than E[x^2] - mean^2, which cancels) */
__global__ void layer_norm_kernel(strata_dev_layer_norm_args a) {
    const float *x = a.x + blockIdx.x * a.n;
    float sum = 0.0f;
    for (int64_t i = threadIdx.x; i < a.n; i += VIT_THREADS) sum += x[i];
    float mean = block_sum(sum) / (float)a.n, sq = 0.0f;
    for (int64_t i = threadIdx.x; i < a.n; i += VIT_THREADS) sq += (x[i] - mean) * (x[i] - mean);
    float s = rsqrtf(block_sum(sq) / (float)a.n + a.eps);
    for (int64_t i = threadIdx.x; i < a.n; i += VIT_THREADS)
        a.out[blockIdx.x * a.n + i] = (x[i] - mean) * s * a.w[i] + a.b[i];
}

cudaError_t layer_norm(const strata_dev_layer_norm_args *a, cudaStream_t stream) {
    layer_norm_kernel<<<(unsigned)a->n_tok, VIT_THREADS, 0, stream>>>(*a);
    return cudaGetLastError();
}

/* GELU: a thread per value (0.7978845608f: sqrt(2 / pi)) */
__global__ void gelu_kernel(strata_dev_gelu_args a) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= a.n) return;
    float x = a.x[i];
    a.out[i] = a.erf ? 0.5f * x * (1.0f + erff(x * 0.70710678f))
                     : 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
}

cudaError_t gelu(const strata_dev_gelu_args *a, cudaStream_t stream) {
    gelu_kernel<<<(unsigned)((a->n + 255) / 256), 256, 0, stream>>>(*a);
    return cudaGetLastError();
}

/* Full attention over a picture's patches, in tiles: a block per (VA_WARPS * VA_ROWS query rows, head), each warp
 * holding VA_ROWS rows' online softmax (running maximum m, sum l, weighted values acc; lane j holds values j,
 * j + 32, ... of a row). The block's queries stay in shared memory; the keys and values pass through it VA_KEYS
 * tokens at a time, lane j scoring key j of the tile against each row (the key rows padded by one value, so the
 * lanes read different banks), then every lane adding each key's weighted value row. */
constexpr int VA_WARPS = 4, VA_ROWS = 8, VA_KEYS = 32, VA_PER_LANE = 256 / WARP;

static size_t vit_attention_shared(int hd) {
    return sizeof(float) * ((size_t)VA_WARPS * VA_ROWS * hd + (size_t)VA_KEYS * (hd + 1) + (size_t)VA_KEYS * hd);
}

__global__ void vit_attention_kernel(strata_dev_vit_attention_args a) {
    extern __shared__ float sh[];
    const int hd = a.head_dim, h = blockIdx.y, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int q_rows = VA_WARPS * VA_ROWS, q0 = blockIdx.x * q_rows, per_lane = (hd + WARP - 1) / WARP;
    const size_t stride = (size_t)a.n_head * hd;
    float *qs = sh;                       // (q_rows, hd): the block's queries, scaled by 1 / sqrt(hd)
    float *ks = qs + q_rows * hd;         // (VA_KEYS, hd + 1)
    float *vs = ks + VA_KEYS * (hd + 1);  // (VA_KEYS, hd)
    const float scale = rsqrtf((float)hd);
    for (int i = threadIdx.x; i < q_rows * hd; i += blockDim.x) {
        int r = i / hd, d = i % hd;
        qs[i] = q0 + r < a.n_tok ? a.q[(q0 + r) * stride + h * hd + d] * scale : 0.0f;
    }
    float m[VA_ROWS], l[VA_ROWS], acc[VA_ROWS][VA_PER_LANE];
#pragma unroll
    for (int r = 0; r < VA_ROWS; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int u = 0; u < VA_PER_LANE; u++) acc[r][u] = 0.0f;
    }
    for (int k0 = 0; k0 < a.n_tok; k0 += VA_KEYS) {
        const int nk = min(VA_KEYS, a.n_tok - k0);
        __syncthreads();  // the previous tile is read (the first time: the queries are written)
        for (int i = threadIdx.x; i < VA_KEYS * hd; i += blockDim.x) {
            int j = i / hd, d = i % hd;
            size_t src = (k0 + j) * stride + h * hd + d;
            ks[j * (hd + 1) + d] = j < nk ? a.k[src] : 0.0f;
            vs[j * hd + d] = j < nk ? a.v[src] : 0.0f;
        }
        __syncthreads();
        const float *kr = ks + lane * (hd + 1);
#pragma unroll
        for (int r = 0; r < VA_ROWS; r++) {
            const float *qr = qs + (warp * VA_ROWS + r) * hd;
            float s = 0.0f;
            for (int d = 0; d < hd; d++) s += qr[d] * kr[d];
            s = lane < nk ? s : -INFINITY;
            float m_new = fmaxf(m[r], warp_max(s)), p = expf(s - m_new), corr = expf(m[r] - m_new);
            l[r] = l[r] * corr + warp_sum(p);
#pragma unroll
            for (int u = 0; u < VA_PER_LANE; u++) acc[r][u] *= corr;
            for (int j = 0; j < nk; j++) {
                float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
                for (int u = 0; u < VA_PER_LANE; u++)
                    if (u < per_lane && lane + WARP * u < hd) acc[r][u] += pj * vs[j * hd + lane + WARP * u];
            }
            m[r] = m_new;
        }
    }
#pragma unroll
    for (int r = 0; r < VA_ROWS; r++) {
        int row = q0 + warp * VA_ROWS + r;
        if (row >= a.n_tok) continue;
#pragma unroll
        for (int u = 0; u < VA_PER_LANE; u++)
            if (u < per_lane && lane + WARP * u < hd) a.out[row * stride + h * hd + lane + WARP * u] = acc[r][u] / l[r];
    }
}

cudaError_t vit_attention(const strata_dev_vit_attention_args *a, cudaStream_t stream) {
    size_t shared = vit_attention_shared(a->head_dim);
    cudaError_t e = cudaFuncSetAttribute(vit_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared);
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)((a->n_tok + VA_WARPS * VA_ROWS - 1) / (VA_WARPS * VA_ROWS)), (unsigned)a->n_head);
    vit_attention_kernel<<<grid, VA_WARPS * WARP, shared, stream>>>(*a);
    return cudaGetLastError();
}

}  // namespace strata_cuda

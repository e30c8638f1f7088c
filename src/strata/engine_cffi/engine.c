/* engine.c — a model built from a GGUF tensor table, a context holding several sequences, and the forward pass of
 * qwen3moe, qwen3, llama and Qwen3-VL's text side (qwen3vl, qwen3vlmoe: multi-axis RoPE, deepstack rows) on the
 * CPU.
 * Threads: each chunk of tokens is one job on the context's thread pool (threadpool.h); every step inside it splits
 * its rows among the threads and ends at the pool's barrier, which orders it before the next step, so a small
 * decode pays no fork/join per product. Activations are f32 rows; before a product they are converted once to the
 * weight type's partner type (kernels.h), shared by every weight that reads the same input. */
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "kernels.h"
#include "simd.h"
#include "threadpool.h"

#define ROWS_PER_TASK 16   /* output rows per unit of work in a product: small enough to balance threads */
_Static_assert(ROWS_PER_TASK % STRATA_BAND_ROWS == 0, "a unit of rows starts a band");
#define MAX_EXPERT_USED 64
#define FEW_TOKENS 64      /* chunks up to this many tokens are decode-shaped: products read rows as long runs
                            * (the kernels keep a tile of rows in cache while up to 64 tokens pass over it) */
#define RUNS_PER_THREAD 8  /* units of a decode-shaped product per thread: enough for one to take up another's */
#define MIN_RUN_BLOCKS 8   /* ROWS_PER_TASK blocks per unit at least: a run long enough to stream */
#define PACKED_RUN_BLOCKS 32 /* a prompt's unit of a product that packs its tokens per call (strata_gemm_packs_tokens),
                              * bounded as decode's by RUNS_PER_THREAD: a 256-token prompt of the small Q8_0 MoE at 2
                              * threads took 71.7 ms in units of 1 block (each repacking every token), 53 in 8, 48 */

// --- errors

static _Thread_local char last_error[512];

const char *strata_last_error(void) { return last_error; }

/* Record a message for strata_last_error and return `status`. */
static strata_status fail(strata_status status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, args);
    va_end(args);
    return status;
}

// --- weights: a view of one GGUF tensor

typedef struct {
    const void *data;      /* NULL when the tensor is absent */
    int type;              /* GGML type id */
    int vec_dot_type;      /* the activation type its products read */
    int64_t n_in;          /* ne[0]: elements per row */
    int64_t n_out;         /* ne[1]: rows (per expert for 3-D tensors) */
    size_t row_bytes;
    size_t matrix_bytes;   /* n_out rows: the stride between the experts of a 3-D tensor */
    size_t bytes;          /* every expert's rows */
    const void *bands;     /* NULL, or the rows laid out in bands (strata_bands_fill): every product reads that */
    size_t bands_bytes;    /* one expert's bands: the stride between the experts' bands of a 3-D tensor */
    int packs;             /* its products pack the tokens anew per call (strata_gemm_packs_tokens) */
} matrix;

/* The matrix of expert e in a 3-D expert tensor. */
static const void *expert_data(const matrix *w, int e) {
    return (const char *)w->data + (size_t)e * w->matrix_bytes;
}

typedef struct {
    float *attn_norm;      // (n_embd,)
    matrix wq;             // (n_head * head_dim, n_embd)
    matrix wk;             // (n_head_kv * head_dim, n_embd)
    matrix wv;             // (n_head_kv * head_dim, n_embd)
    float *q_norm;         // (head_dim,) qwen3 and qwen3moe only
    float *k_norm;         // (head_dim,) qwen3 and qwen3moe only
    matrix wo;             // (n_embd, n_head * head_dim)
    float *ffn_norm;       // (n_embd,)
    matrix ffn_gate;       // (n_ff, n_embd) dense only
    matrix ffn_up;         // (n_ff, n_embd) dense only
    matrix ffn_down;       // (n_embd, n_ff) dense only
    matrix router;         // (n_expert, n_embd) MoE only
    matrix gate_exps;      // (n_expert, n_ff_exp, n_embd) MoE only
    matrix up_exps;        // (n_expert, n_ff_exp, n_embd) MoE only
    matrix down_exps;      // (n_expert, n_embd, n_ff_exp) MoE only
} layer_weights;

// --- model

typedef enum { ROPE_NORMAL, ROPE_NEOX } rope_mode;  /* rotate adjacent pairs, or pairs half a head apart */

struct strata_model {
    strata_model_params hp;    /* tensors and arch are not kept: they belong to the caller */
    char arch[16];
    rope_mode rope;
    int has_qk_norm;
    int is_moe;
    int mrope;                 /* positions have (t, h, w) components (multi-axis RoPE) */
    unsigned char *rope_axis;  // (head_dim / 2,) the component each frequency pair turns by (0 without mrope)
    matrix tok_embd;           // (n_vocab, n_embd)
    matrix output;             // (n_vocab, n_embd): token_embd when the model ties them
    void *output_bands;        // output's rows in bands, built at load where the build has them for its type
    size_t prepared_bytes;     /* what output_bands takes */
    void *weights;             // the copy of the matrices decode reads whole (copy_weights), in huge pages
    size_t copied_bytes;       /* what weights holds */
    float *output_norm;        // (n_embd,)
    float *inv_freq;           // (head_dim / 2,) rope frequencies, scaled (build_rope)
    layer_weights *layers;     // (n_layer,)
};

/* The tensor named `base` or `base`.weight (llama.cpp's converters add the suffix; the gguf package's names lack
 * it). */
static const strata_tensor_info *find_tensor(const strata_model_params *p, const char *base) {
    size_t n = strlen(base);
    for (int i = 0; i < p->n_tensors; i++) {
        const char *name = p->tensors[i].name;
        if (strncmp(name, base, n) == 0 && (name[n] == 0 || strcmp(name + n, ".weight") == 0))
            return &p->tensors[i];
    }
    return NULL;
}

/* Check a tensor's type, shape and size; fill `w`. ne1/ne2 of 0 mean "absent dimension" (must be 1). */
static strata_status view_tensor(const strata_tensor_info *t, int64_t ne0, int64_t ne1, int64_t ne2, matrix *w) {
    const strata_type_traits *tr = strata_type_supported(t->type) ? strata_traits(t->type) : NULL;
    if (!tr) return fail(STRATA_ERR_UNSUPPORTED, "tensor %s: unsupported type %d", t->name, t->type);
    int64_t want[4] = {ne0, ne1 ? ne1 : 1, ne2 ? ne2 : 1, 1};
    for (int d = 0; d < 4; d++)
        if ((d < t->n_dims ? t->ne[d] : 1) != want[d])
            return fail(STRATA_ERR_INVALID_ARG,
                        "tensor %s: shape [%lld, %lld, %lld, %lld], expected [%lld, %lld, %lld, %lld]", t->name,
                        t->ne[0], t->ne[1], t->ne[2], t->ne[3], (long long)want[0], (long long)want[1],
                        (long long)want[2], (long long)want[3]);
    if (ne0 % tr->block_size != 0)
        return fail(STRATA_ERR_UNSUPPORTED, "tensor %s: row of %lld not a multiple of %s's block of %lld", t->name,
                    (long long)ne0, tr->name, (long long)tr->block_size);
    w->data = t->data;
    w->type = t->type;
    w->vec_dot_type = tr->vec_dot_type;
    w->n_in = ne0;
    w->n_out = want[1];
    w->row_bytes = strata_row_bytes(t->type, ne0);
    w->matrix_bytes = w->row_bytes * (size_t)want[1];
    w->bytes = w->matrix_bytes * (size_t)want[2];
    w->packs = strata_gemm_packs_tokens(t->type, ne0);
    if ((unsigned long long)t->n_bytes < w->bytes)
        return fail(STRATA_ERR_INVALID_ARG, "tensor %s: %lld bytes, its shape needs %zu (truncated file?)",
                    t->name, t->n_bytes, w->bytes);
    return STRATA_OK;
}

/* The tensor `name` (printf-style, with the layer index) as a matrix; absent is an error unless optional. */
static strata_status get_matrix(const strata_model_params *p, matrix *w, int optional, int64_t ne0, int64_t ne1,
                                int64_t ne2, const char *fmt, int il) {
    char name[96];
    snprintf(name, sizeof name, fmt, il);
    const strata_tensor_info *t = find_tensor(p, name);
    memset(w, 0, sizeof *w);
    if (!t) return optional ? STRATA_OK : fail(STRATA_ERR_INVALID_ARG, "missing tensor %s", name);
    return view_tensor(t, ne0, ne1, ne2, w);
}

/* A norm weight (n,) of any supported type, dequantised into a new f32 array. */
static strata_status get_vector(const strata_model_params *p, float **out, int64_t n, const char *fmt, int il) {
    matrix w;
    strata_status st = get_matrix(p, &w, 0, n, 0, 0, fmt, il);
    if (st != STRATA_OK) return st;
    *out = malloc(sizeof(float) * n);
    if (!*out) return fail(STRATA_ERR_NOMEM, "out of memory");
    strata_dequantize_row_any(w.type, w.data, *out, n);
    return STRATA_OK;
}

static strata_status check_hparams(const strata_model_params *p) {
    if (p->n_vocab <= 0 || p->n_embd <= 0 || p->n_layer <= 0 || p->n_head <= 0 || p->n_head_kv <= 0 ||
        p->head_dim <= 0 || p->head_dim % 2 != 0 || p->n_ctx_train <= 0 || p->n_head % p->n_head_kv != 0)
        return fail(STRATA_ERR_INVALID_ARG, "inconsistent hyper-parameters (n_vocab %d, n_embd %d, n_layer %d, "
                    "n_head %d, n_head_kv %d, head_dim %d, n_ctx_train %d)", p->n_vocab, p->n_embd, p->n_layer,
                    p->n_head, p->n_head_kv, p->head_dim, p->n_ctx_train);
    if (!(p->rms_eps > 0) || !(p->rope_base > 0))
        return fail(STRATA_ERR_INVALID_ARG, "rms_eps and rope_base must be positive");
    return STRATA_OK;
}

static strata_status build_layer(const strata_model *m, const strata_model_params *p, int il, layer_weights *L) {
    int64_t E = p->n_embd, q_dim = (int64_t)p->n_head * p->head_dim, kv_dim = (int64_t)p->n_head_kv * p->head_dim;
    strata_status st;
#define TRY(call) do { if ((st = (call)) != STRATA_OK) return st; } while (0)
    TRY(get_vector(p, &L->attn_norm, E, "blk.%d.attn_norm", il));
    TRY(get_matrix(p, &L->wq, 0, E, q_dim, 0, "blk.%d.attn_q", il));
    TRY(get_matrix(p, &L->wk, 0, E, kv_dim, 0, "blk.%d.attn_k", il));
    TRY(get_matrix(p, &L->wv, 0, E, kv_dim, 0, "blk.%d.attn_v", il));
    TRY(get_matrix(p, &L->wo, 0, q_dim, E, 0, "blk.%d.attn_output", il));
    if (m->has_qk_norm) {
        TRY(get_vector(p, &L->q_norm, p->head_dim, "blk.%d.attn_q_norm", il));
        TRY(get_vector(p, &L->k_norm, p->head_dim, "blk.%d.attn_k_norm", il));
    }
    TRY(get_vector(p, &L->ffn_norm, E, "blk.%d.ffn_norm", il));
    if (m->is_moe) {
        TRY(get_matrix(p, &L->router, 0, E, p->n_expert, 0, "blk.%d.ffn_gate_inp", il));
        TRY(get_matrix(p, &L->gate_exps, 0, E, p->n_ff_exp, p->n_expert, "blk.%d.ffn_gate_exps", il));
        TRY(get_matrix(p, &L->up_exps, 0, E, p->n_ff_exp, p->n_expert, "blk.%d.ffn_up_exps", il));
        TRY(get_matrix(p, &L->down_exps, 0, p->n_ff_exp, E, p->n_expert, "blk.%d.ffn_down_exps", il));
    } else {
        TRY(get_matrix(p, &L->ffn_gate, 0, E, p->n_ff, 0, "blk.%d.ffn_gate", il));
        TRY(get_matrix(p, &L->ffn_up, 0, E, p->n_ff, 0, "blk.%d.ffn_up", il));
        TRY(get_matrix(p, &L->ffn_down, 0, p->n_ff, E, 0, "blk.%d.ffn_down", il));
    }
#undef TRY
    return STRATA_OK;
}

/* The architectures the forward pass runs, and their traits. */
static const struct { const char *name; rope_mode rope; int has_qk_norm, is_moe, mrope; } ARCHS[] = {
    {"qwen3moe", ROPE_NEOX, 1, 1, 0},
    {"qwen3", ROPE_NEOX, 1, 0, 0},
    {"llama", ROPE_NORMAL, 0, 0, 0},
    /* Qwen3-VL's text side: Qwen3 with multi-axis RoPE over pictures and deepstack rows */
    {"qwen3vl", ROPE_NEOX, 1, 0, 1},
    {"qwen3vlmoe", ROPE_NEOX, 1, 1, 1},
};
#define N_ARCHS ((int)(sizeof ARCHS / sizeof ARCHS[0]))

static int arch_index(const char *arch) {
    for (int i = 0; i < N_ARCHS; i++)
        if (strcmp(arch, ARCHS[i].name) == 0) return i;
    return -1;
}

/* Architecture traits; UNSUPPORTED for any other name. */
static strata_status set_arch(strata_model *m, const char *arch) {
    if (!arch) return fail(STRATA_ERR_INVALID_ARG, "no architecture given");
    int i = arch_index(arch);
    if (i < 0)
        return fail(STRATA_ERR_UNSUPPORTED, "unsupported architecture '%s' (qwen3moe, qwen3, llama, qwen3vl, "
                    "qwen3vlmoe)", arch);
    m->rope = ARCHS[i].rope;
    m->has_qk_norm = ARCHS[i].has_qk_norm;
    m->is_moe = ARCHS[i].is_moe;
    m->mrope = ARCHS[i].mrope;
    snprintf(m->arch, sizeof m->arch, "%s", arch);
    return STRATA_OK;
}

/* inv_freq[i] = rope_base^(-2i / head_dim) / rope_freqs[i]: the optional `rope_freqs` tensor (head_dim / 2
 * factors, which llama.cpp's converter writes for Llama 3.1's "llama3" scaling) divides each pair's frequency. */
static strata_status build_rope(strata_model *m, const strata_model_params *p) {
    int n = p->head_dim / 2;
    m->inv_freq = malloc(sizeof(float) * n);
    if (!m->inv_freq) return fail(STRATA_ERR_NOMEM, "out of memory");
    for (int i = 0; i < n; i++) m->inv_freq[i] = (float)(1.0 / pow(p->rope_base, (2.0 * i) / p->head_dim));
    const strata_tensor_info *t = find_tensor(p, "rope_freqs");
    if (!t) return STRATA_OK;
    if (t->type != STRATA_TYPE_F32 || t->n_dims != 1 || t->ne[0] != n ||
        t->n_bytes < (long long)(sizeof(float) * n))
        return fail(STRATA_ERR_INVALID_ARG, "tensor %s: expected %d F32 values (head_dim / 2)", t->name, n);
    const float *factors = t->data;
    for (int i = 0; i < n; i++) {
        if (!(factors[i] > 0))
            return fail(STRATA_ERR_INVALID_ARG, "tensor %s: factor %d is not positive", t->name, i);
        m->inv_freq[i] /= factors[i];
    }
    return STRATA_OK;
}

/* rope_axis[i]: the position component pair i turns by, Qwen3-VL's interleaving (Hugging Face's
 * apply_interleaved_mrope: h on pairs 1, 4, 7, ... below 3 sections[1], w on 2, 5, 8, ... below 3 sections[2],
 * t on the rest); and the deepstack count, which only those models have. */
static strata_status build_mrope(strata_model *m, const strata_model_params *p) {
    const int *sec = p->rope_sections;
    int n = p->head_dim / 2, any = sec[0] || sec[1] || sec[2] || sec[3];
    if (sec[0] < 0 || sec[1] < 0 || sec[2] < 0 || sec[3] != 0 || sec[0] + sec[1] + sec[2] > n)
        return fail(STRATA_ERR_UNSUPPORTED, "rope.dimension_sections [%d, %d, %d, %d]: expected three sections of "
                    "at most head_dim / 2 = %d pairs in all, the fourth 0", sec[0], sec[1], sec[2], sec[3], n);
    if (!m->mrope && any)
        return fail(STRATA_ERR_UNSUPPORTED, "rope.dimension_sections on %s, whose RoPE has one axis", m->arch);
    if (p->n_deepstack < 0 || p->n_deepstack > p->n_layer || (!m->mrope && p->n_deepstack))
        return fail(STRATA_ERR_INVALID_ARG, "n_deepstack_layers %d on %s with %d layers", p->n_deepstack, m->arch,
                    p->n_layer);
    m->rope_axis = calloc(n, 1);
    if (!m->rope_axis) return fail(STRATA_ERR_NOMEM, "out of memory");
    for (int i = 0; m->mrope && i < n; i++)
        m->rope_axis[i] = i % 3 == 1 && i < 3 * sec[1] ? 1 : i % 3 == 2 && i < 3 * sec[2] ? 2 : 0;
    return STRATA_OK;
}

static strata_status check_moe_hparams(const strata_model *m) {
    const strata_model_params *p = &m->hp;
    if (m->is_moe && (p->n_expert <= 0 || p->n_expert_used <= 0 || p->n_expert_used > p->n_expert ||
                      p->n_expert_used > MAX_EXPERT_USED || p->n_ff_exp <= 0))
        return fail(STRATA_ERR_INVALID_ARG, "inconsistent expert counts (n_expert %d, n_expert_used %d, "
                    "n_ff_exp %d)", p->n_expert, p->n_expert_used, p->n_ff_exp);
    if (!m->is_moe && p->n_ff <= 0) return fail(STRATA_ERR_INVALID_ARG, "feed_forward_length must be positive");
    return STRATA_OK;
}

/* The output product takes several tokens whenever several sequences decode, and from 4 tokens on its Q8_0 tile
 * is bound by arithmetic: its rows are laid out once in bands, a copy (a tied embedding keeps its rows for the
 * lookups, and an untied output's mapped pages are not read again), and every product of it, 1 token included,
 * reads the bands, so a sequence's logits have the same bits alone and in a batch. */
static strata_status prepare_output(strata_model *m) {
    matrix *w = &m->output;
    size_t n = strata_bands_size(w->type, w->n_out, w->n_in);
    if (!n) return STRATA_OK;
    const size_t huge = (size_t)2 << 20;  // read as a few long streams every step: huge pages spare the TLB
    m->output_bands = aligned_alloc(huge, (n + huge - 1) / huge * huge);
    if (!m->output_bands) return fail(STRATA_ERR_NOMEM, "out of memory for the output weight's bands (%zu bytes)", n);
    madvise(m->output_bands, (n + huge - 1) / huge * huge, MADV_HUGEPAGE);  // a hint: no error if refused
    strata_bands_fill(w->type, w->data, w->n_out, w->n_in, m->output_bands);
    w->bands = m->output_bands;
    w->packs = 0;
    m->prepared_bytes = n;
    return STRATA_OK;
}

/* The matrices a decode step reads from end to end: every layer's, and the output unless it has bands. */
static int streamed_matrices(strata_model *m, matrix **out) {
    int n = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        layer_weights *L = &m->layers[il];
        matrix *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->ffn_gate, &L->ffn_up, &L->ffn_down, &L->router,
                        &L->gate_exps, &L->up_exps, &L->down_exps};
        for (size_t i = 0; i < sizeof ws / sizeof *ws; i++)
            if (ws[i]->data) out[n++] = ws[i];
    }
    if (!m->output.bands) out[n++] = &m->output;
    return n;
}

/* What a matrix takes in the copy: its bands where the build has them for its type, else its rows. */
static size_t copy_bytes(const matrix *w) {
    size_t n_mats = w->bytes / w->matrix_bytes, bands = strata_bands_size(w->type, w->n_out, w->n_in);
    return ((bands ? bands * n_mats : w->bytes) + 63) / 64 * 64;  // each matrix on its own cache lines
}

/* Mapped from the file, the weights sit in 4 KiB pages: a step's long reads take a TLB miss every 4 KiB, and the
 * hardware prefetchers stop at each page's end. One copy in 2 MiB pages at load spares both. The small Q8_0 MoE
 * at 2 threads, a step's time besides the output product: 1 token 1.15-1.39 -> 1.07-1.18 ms, 4 tokens
 * 3.08-3.38 -> 2.96-3.10. The file's pages are not read again; the token embeddings stay mapped (a step reads
 * one row per token). Q8_0 matrices go into the copy in bands, as the output weight's (prepare_output), in the
 * same bytes: rows as they lie are bound by arithmetic from 3 tokens (a step of several sequences gives an
 * expert or a dense layer that many), the bands are not, and both end each block in the same f32 steps. Small
 * Q8_0 MoE, 4 / 8 sequences: 705-749 -> 805-849 / 1018-1049 -> 1266-1289 tok/s; dense qwen3 4 sequences
 * 360 -> 454-471. */
typedef struct {
    const matrix *const *ws;  // the matrices, their data still where mapped
    char *const *dst;         // where each one's copy goes
    const int *first_unit;    // (n + 1,) each matrix's first unit (one unit per expert), then the count of units
    int n;
    atomic_int next;          // the next unit to take
} copy_work;

/* Run by each thread of the load's pool: take units (one expert's matrix, or a 2-D matrix) until none is left,
 * and copy each one: into bands where the build has them for its type, else as it lies. */
static void copy_units(int ith, int nth, void *arg) {
    (void)ith, (void)nth;
    copy_work *cw = arg;
    for (int u; (u = atomic_fetch_add(&cw->next, 1)) < cw->first_unit[cw->n];) {
        int lo = 0, hi = cw->n;  // the matrix i with first_unit[i] <= u < first_unit[i + 1]
        while (hi - lo > 1) {
            int mid = (lo + hi) / 2;
            if (cw->first_unit[mid] <= u) lo = mid;
            else hi = mid;
        }
        const matrix *w = cw->ws[lo];
        size_t e = (size_t)(u - cw->first_unit[lo]), bands = strata_bands_size(w->type, w->n_out, w->n_in);
        const char *src = (const char *)w->data + e * w->matrix_bytes;
        if (bands) strata_bands_fill(w->type, src, w->n_out, w->n_in, cw->dst[lo] + e * bands);
        else memcpy(cw->dst[lo] + e * w->matrix_bytes, src, w->matrix_bytes);
    }
}

static strata_status copy_weights(strata_model *m, int n_threads) {
    const size_t cap = (size_t)m->hp.n_layer * 11 + 1;
    matrix **ws = malloc(sizeof(matrix *) * cap);
    char **dst = malloc(sizeof(char *) * cap);
    int *first_unit = malloc(sizeof(int) * (cap + 1));
    if (!ws || !dst || !first_unit) {
        free(ws), free(dst), free(first_unit);
        return fail(STRATA_ERR_NOMEM, "out of memory");
    }
    int n = streamed_matrices(m, ws);
    size_t total = 0;
    first_unit[0] = 0;
    for (int i = 0; i < n; i++) {
        total += copy_bytes(ws[i]);
        first_unit[i + 1] = first_unit[i] + (int)(ws[i]->bytes / ws[i]->matrix_bytes);
    }
    const size_t huge = (size_t)2 << 20, size = (total + huge - 1) / huge * huge;
    char *at = m->weights = total ? aligned_alloc(huge, size) : NULL;
    if (total && !at) {
        free(ws), free(dst), free(first_unit);
        return fail(STRATA_ERR_NOMEM, "out of memory for a copy of the weights (%zu MiB)", total >> 20);
    }
    if (total) madvise(at, size, MADV_HUGEPAGE);  // a hint: no error if refused
    for (int i = 0; i < n; i++) {
        dst[i] = at;
        at += copy_bytes(ws[i]);
    }
    // The copy is bound by memory and page faults: the cores the context will use share it (a pool that cannot
    // start leaves it to this thread).
    copy_work cw = {.ws = (const matrix *const *)ws, .dst = dst, .first_unit = first_unit, .n = n};
    strata_pool *pool = n_threads > 1 ? strata_pool_create(n_threads) : NULL;
    if (pool) strata_pool_run(pool, copy_units, &cw);
    else copy_units(0, 1, &cw);
    strata_pool_free(pool);
    for (int i = 0; i < n; i++) {  // the products read the copy from now on
        matrix *w = ws[i];
        size_t bands = strata_bands_size(w->type, w->n_out, w->n_in);
        if (bands) w->bands = dst[i], w->bands_bytes = bands;
        else w->data = dst[i];
    }
    free(ws), free(dst), free(first_unit);
    m->copied_bytes = total;
    return STRATA_OK;
}

static strata_status build_model(strata_model *m, const strata_model_params *p) {
    strata_status st;
    m->hp = *p;
    if ((st = set_arch(m, p->arch)) != STRATA_OK || (st = check_hparams(p)) != STRATA_OK ||
        (st = check_moe_hparams(m)) != STRATA_OK || (st = build_mrope(m, p)) != STRATA_OK)
        return st;
    m->hp.arch = m->arch;
    m->hp.tensors = NULL;
    m->hp.n_tensors = 0;
    if ((st = get_matrix(p, &m->tok_embd, 0, p->n_embd, p->n_vocab, 0, "token_embd", 0)) != STRATA_OK ||
        (st = get_matrix(p, &m->output, 1, p->n_embd, p->n_vocab, 0, "output", 0)) != STRATA_OK ||
        (st = get_vector(p, &m->output_norm, p->n_embd, "output_norm", 0)) != STRATA_OK)
        return st;
    if (!m->output.data) m->output = m->tok_embd;  // tied embeddings
    if ((st = prepare_output(m)) != STRATA_OK) return st;
    if ((st = build_rope(m, p)) != STRATA_OK) return st;
    m->layers = calloc(p->n_layer, sizeof(layer_weights));
    if (!m->layers) return fail(STRATA_ERR_NOMEM, "out of memory");
    for (int il = 0; il < p->n_layer; il++)
        if ((st = build_layer(m, p, il, &m->layers[il])) != STRATA_OK) return st;
    return p->copy_weights ? copy_weights(m, p->load_threads) : STRATA_OK;
}

strata_status strata_model_create(const strata_model_params *params, strata_model **out) {
    *out = NULL;
    if (!params) return fail(STRATA_ERR_INVALID_ARG, "no model parameters");
    strata_model *m = calloc(1, sizeof *m);
    if (!m) return fail(STRATA_ERR_NOMEM, "out of memory");
    strata_status st = build_model(m, params);
    if (st != STRATA_OK) {
        strata_model_free(m);
        return st;
    }
    *out = m;
    return STRATA_OK;
}

size_t strata_model_prepared_bytes(const strata_model *m) { return m->prepared_bytes; }

size_t strata_model_copied_bytes(const strata_model *m) { return m->copied_bytes; }

void strata_model_free(strata_model *m) {
    if (!m) return;
    if (m->layers)
        for (int il = 0; il < m->hp.n_layer; il++) {
            layer_weights *L = &m->layers[il];
            free(L->attn_norm); free(L->q_norm); free(L->k_norm); free(L->ffn_norm);
        }
    free(m->layers);
    free(m->output_norm);
    free(m->output_bands);
    free(m->weights);
    free(m->inv_freq);
    free(m->rope_axis);
    free(m);
}

// --- context: the sequences' KV cache and scratch for one chunk

struct strata_context {
    const strata_model *model;
    int n_ctx, n_seq, n_batch, n_threads, kv_type;
    strata_pool *pool;             /* n_threads threads, the caller's included */
    int *n_past;                   // (n_seq,) positions each sequence holds
    atomic_int *abort_flag;        // (n_seq,) raised by strata_abort, lowered when a call drops the sequence
    int *dropped;                  // (n_seq,) the call in flight dropped the sequence (its flag was seen)
    int stop;                      /* every sequence of the chunk was dropped: the chunk stopped */
    int stop_at[2];                /* the answers of the two alternating polls of the abort flags */
    strata_timings timings;
    double output_t0;              /* when the current output projection began (ms) */
    size_t kv_elem;                /* bytes per cached value */
    void *k_cache;                 // (n_seq, n_layer, n_head_kv, n_ctx, head_dim) of kv_type
    void *v_cache;                 // (n_seq, n_layer, n_head_kv, n_ctx, head_dim) of kv_type
    float *k_scale;                // (n_seq, n_layer, n_head_kv, n_ctx) int8 only
    float *v_scale;                // (n_seq, n_layer, n_head_kv, n_ctx) int8 only
    /* multi-axis RoPE only: each cached position's t component, and 1 + its largest (where text goes on) */
    int *rope_t;                   // (n_seq, n_ctx)
    int *rope_next;                // (n_seq, n_ctx)
    /* the chunk in flight: its tokens gathered from the call, in call order */
    int *chunk_token;              // (n_batch,) token ids
    int *chunk_seq;                // (n_batch,) sequence of each token
    int *chunk_pos;                // (n_batch,) position of each token in its sequence
    int *chunk_rope;               // (n_batch, 3) its RoPE position's (t, h, w) components (all = pos: one axis)
    int *chunk_embd;               // (n_batch,) the caller's embedding row replacing the token, or -1
    int *chunk_out;                // (n_batch,) the caller's logits row of the token, or -1
    float *x;                      // (n_batch, n_embd) residual stream
    float *xb;                     // (n_batch, n_embd) normed input of a block, then its output
    float *q;                      // (n_batch, n_head * head_dim)
    float *k;                      // (n_batch, n_head_kv * head_dim)
    float *v;                      // (n_batch, n_head_kv * head_dim)
    float *att;                    // (n_batch, n_head * head_dim) attention output
    float *scores;                 // (n_threads, n_head / n_head_kv, n_ctx) attention weights
    float *hb;                     // (n_rows_ff, n_ff_max) gate, then the SwiGLU product
    float *hb2;                    // (n_rows_ff, n_ff_max) up
    float *moe_out;                // (n_batch * n_expert_used, n_embd) each expert's output per slot
    float *router;                 // (n_batch, n_expert) router logits
    float *draw_work;              // (n_threads, draw_n) strata_sample_rows' scratch
    int *draw_idx;                 // (n_threads, draw_n)
    int draw_n;
    void *xq;                      // (n_rows_ff, act_row_max) activations in a product's partner type
    void *xq_slots;                // (n_batch * n_expert_used, act_row_max) token rows gathered per slot
    size_t act_row_max;            /* bytes of the widest activation row */
    /* MoE routing of the current chunk */
    int *slot_of;                  // (n_batch, n_expert_used) slot of each (token, choice)
    float *choice_weight;          // (n_batch, n_expert_used) renormalised router weight
    int *slot_token;               // (n_batch * n_expert_used) token of each slot; slots are grouped by expert
    int *expert_start;             // (n_expert,) first slot of each expert
    int *expert_count;             // (n_expert,) slots of each expert
    int *tasks;                    // (n_expert * (blocks of n_ff_exp + blocks of n_embd), 2) (expert, row block);
                                   // a block is task_rows rows, ROWS_PER_TASK or more
    int n_tasks_up, n_tasks_down;  /* tasks for the gate/up products, then for the down product */
    int64_t task_rows[2];          /* rows per gate/up task, per down task */
};

static size_t act_row_bytes(int vec_dot_type, int64_t n) {
    const strata_type_traits *tr = strata_traits(vec_dot_type);
    return tr->block_bytes * (size_t)(n / tr->block_size);
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static size_t kv_elem_bytes(int kv_type) {
    return kv_type == STRATA_KV_F32 ? 4 : kv_type == STRATA_KV_F16 ? 2 : 1;
}

static strata_status alloc_context(strata_context *c) {
    const strata_model_params *p = &c->model->hp;
    int64_t kv_dim = (int64_t)p->n_head_kv * p->head_dim, q_dim = (int64_t)p->n_head * p->head_dim;
    int64_t B = c->n_batch, k_used = c->model->is_moe ? p->n_expert_used : 1;
    int64_t n_ff_max = c->model->is_moe ? p->n_ff_exp : p->n_ff;
    int64_t widest = max64(max64(p->n_embd, q_dim), n_ff_max);
    size_t cache_vals = (size_t)c->n_seq * p->n_layer * c->n_ctx * kv_dim;
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
    c->hb = malloc(sizeof(float) * B * k_used * n_ff_max);
    c->hb2 = malloc(sizeof(float) * B * k_used * n_ff_max);
    c->xq = malloc(c->act_row_max * B * k_used);
    c->n_past = calloc(c->n_seq, sizeof(int));
    c->abort_flag = calloc(c->n_seq, sizeof(atomic_int));
    c->dropped = calloc(c->n_seq, sizeof(int));
    c->chunk_rope = malloc(sizeof(int) * 3 * B);
    if (c->model->mrope) {
        c->rope_t = malloc(sizeof(int) * c->n_seq * c->n_ctx);
        c->rope_next = malloc(sizeof(int) * c->n_seq * c->n_ctx);
    }
    int **chunk[] = {&c->chunk_token, &c->chunk_seq, &c->chunk_pos, &c->chunk_embd, &c->chunk_out};
    int ok = c->k_cache && c->v_cache && c->x && c->xb && c->q && c->k && c->v && c->att && c->scores &&
             c->hb && c->hb2 && c->xq && (c->kv_type != STRATA_KV_INT8 || (c->k_scale && c->v_scale)) &&
             c->n_past && c->abort_flag && c->dropped && c->chunk_rope &&
             (!c->model->mrope || (c->rope_t && c->rope_next));
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
    return ok ? STRATA_OK : fail(STRATA_ERR_NOMEM, "out of memory for a context of %d x %d positions", c->n_seq,
                                 c->n_ctx);
}

static strata_status check_context_params(const strata_model *m, const strata_context_params *p) {
    if (p->n_ctx <= 0 || p->n_seq <= 0 || p->n_batch <= 0 || p->n_threads <= 0)
        return fail(STRATA_ERR_INVALID_ARG, "n_ctx, n_seq, n_batch and n_threads must be positive");
    if (p->n_ctx > m->hp.n_ctx_train)
        return fail(STRATA_ERR_INVALID_ARG, "context of %d positions is larger than the model's %d", p->n_ctx,
                    m->hp.n_ctx_train);
    if (p->kv_type != STRATA_KV_F32 && p->kv_type != STRATA_KV_F16 && p->kv_type != STRATA_KV_INT8)
        return fail(STRATA_ERR_INVALID_ARG, "unknown KV cache type %d", p->kv_type);
    return STRATA_OK;
}

strata_status strata_context_create(const strata_model *model, const strata_context_params *params,
                                    strata_context **out) {
    *out = NULL;
    if (!model || !params) return fail(STRATA_ERR_INVALID_ARG, "no model or context parameters");
    strata_status st = check_context_params(model, params);
    if (st != STRATA_OK) return st;
    strata_context *c = calloc(1, sizeof *c);
    if (!c) return fail(STRATA_ERR_NOMEM, "out of memory");
    c->model = model;
    c->n_ctx = params->n_ctx;
    c->n_seq = params->n_seq;
    c->n_batch = params->n_batch < params->n_ctx ? params->n_batch : params->n_ctx;
    c->n_threads = params->n_threads;
    c->kv_type = params->kv_type;
    c->kv_elem = kv_elem_bytes(params->kv_type);
    c->pool = strata_pool_create(c->n_threads);
    if (!c->pool) st = fail(STRATA_ERR_NOMEM, "could not start %d threads", c->n_threads);
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
                    c->chunk_out, c->chunk_rope, c->rope_t, c->rope_next, c->draw_work, c->draw_idx};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(c);
}

int strata_n_seq(const strata_context *c) { return c->n_seq; }

int strata_n_ctx(const strata_context *c) { return c->n_ctx; }

size_t strata_kv_bytes(const strata_context *c) {
    const strata_model_params *p = &c->model->hp;
    size_t rows = (size_t)c->n_seq * p->n_layer * p->n_head_kv * c->n_ctx;  // of head_dim values, K and V each
    return 2 * rows * (p->head_dim * c->kv_elem + (c->kv_type == STRATA_KV_INT8 ? sizeof(float) : 0));
}

static strata_status check_seq(const strata_context *c, int seq) {
    if (seq < 0 || seq >= c->n_seq)
        return fail(STRATA_ERR_INVALID_ARG, "sequence %d outside [0, %d)", seq, c->n_seq);
    return STRATA_OK;
}

int strata_n_past(const strata_context *c, int seq) { return check_seq(c, seq) == STRATA_OK ? c->n_past[seq] : -1; }

strata_status strata_keep(strata_context *c, int seq, int n) {
    strata_status st = check_seq(c, seq);
    if (st != STRATA_OK) return st;
    if (n < 0 || n > c->n_past[seq])
        return fail(STRATA_ERR_INVALID_ARG, "keep(%d): sequence %d holds %d positions", n, seq, c->n_past[seq]);
    c->n_past[seq] = n;  // the rows past n are overwritten by the next eval
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
        return fail(STRATA_ERR_INVALID_ARG, "draws need rows of at least one logit, their settings and u");
    if (n > c->draw_n) {  // every thread's scratch for a draw, kept for the next
        free(c->draw_work);
        free(c->draw_idx);
        c->draw_work = malloc(sizeof(float) * c->n_threads * (size_t)n);
        c->draw_idx = malloc(sizeof(int) * c->n_threads * (size_t)n);
        c->draw_n = c->draw_work && c->draw_idx ? n : 0;
        if (!c->draw_n) return fail(STRATA_ERR_NOMEM, "out of memory for the draws' scratch");
    }
    draws_job job = {c, n_rows, n, rows, settings, u, tokens};
    strata_pool_run(c->pool, draws, &job);
    return STRATA_OK;
}

// --- KV cache rows: one (position, kv head) row of head_dim values

/* Index of row (seq, il, kvh, position 0) in the cache, and of its int8 scale; position p is row base + p. A kv
 * head's positions are adjacent, so attention reads each head's rows as one sequential stream. */
static size_t kv_base(const strata_context *c, int seq, int il, int kvh) {
    const strata_model_params *p = &c->model->hp;
    return (((size_t)seq * p->n_layer + il) * p->n_head_kv + kvh) * c->n_ctx;
}

strata_status strata_copy_prefix(strata_context *c, int src, int dst, int n) {
    strata_status st = check_seq(c, src);
    if (st == STRATA_OK) st = check_seq(c, dst);
    if (st != STRATA_OK) return st;
    if (n < 0 || n > c->n_past[src])
        return fail(STRATA_ERR_INVALID_ARG, "copy of %d positions: sequence %d holds %d", n, src, c->n_past[src]);
    if (src == dst) return strata_keep(c, dst, n);
    const strata_model_params *p = &c->model->hp;
    size_t row = p->head_dim * c->kv_elem;
    for (int il = 0; il < p->n_layer; il++)
        for (int h = 0; h < p->n_head_kv; h++) {
            size_t from = kv_base(c, src, il, h), to = kv_base(c, dst, il, h);
            memcpy((char *)c->k_cache + to * row, (const char *)c->k_cache + from * row, n * row);
            memcpy((char *)c->v_cache + to * row, (const char *)c->v_cache + from * row, n * row);
            if (c->kv_type == STRATA_KV_INT8) {
                memcpy(c->k_scale + to, c->k_scale + from, sizeof(float) * n);
                memcpy(c->v_scale + to, c->v_scale + from, sizeof(float) * n);
            }
        }
    if (c->model->mrope) {
        memcpy(c->rope_t + (size_t)dst * c->n_ctx, c->rope_t + (size_t)src * c->n_ctx, sizeof(int) * n);
        memcpy(c->rope_next + (size_t)dst * c->n_ctx, c->rope_next + (size_t)src * c->n_ctx, sizeof(int) * n);
    }
    c->n_past[dst] = n;
    return STRATA_OK;
}

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

// --- the team: every thread of the pool runs each building block, on its share of the rows

/* One thread's view of the job it runs with the others. */
typedef struct {
    strata_pool *pool;
    int ith, nth;                  /* this thread, of nth */
} team;

typedef struct { int64_t lo, hi; } range;

/* This thread's part of [0, n): nth contiguous parts whose sizes differ by at most one. */
static range share(const team *tm, int64_t n) {
    int64_t base = n / tm->nth, extra = n % tm->nth;
    int64_t lo = tm->ith * base + (tm->ith < extra ? tm->ith : extra);
    return (range){lo, lo + base + (tm->ith < extra)};
}

/* Wait for the whole team: what any thread wrote before is visible to all after. */
static void team_sync(const team *tm) { strata_pool_barrier(tm->pool); }

/* The next unit of a loop whose units are taken one at a time as threads free up (units of uneven cost). */
static int team_next(const team *tm) { return strata_pool_next(tm->pool); }

// --- building blocks (each called by every thread of the team; each ends at a barrier, except those that work
// on this thread's share of the tokens only (share(tm, n_tok)): a step on the same share may follow them at once,
// since each thread then reads only rows it wrote itself)

/* out (n,) = x / sqrt(mean(x^2) + eps) * w */
static void rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float s = 1.0f / sqrtf(ss / n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * s * w[i];
}

/* out rows (n_tok, n) = rmsnorm of x rows, this thread's share of them; no barrier. */
static void rmsnorm_rows(const team *tm, float *out, const float *x, const float *w, int n_tok, int64_t n,
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

/* ys[i] (n_tok, ws[i].n_out) = x (n_tok, n_in) @ ws[i]^T for weights reading the same input: x is converted
 * once per run of weights sharing a partner type. */
static void linear(const team *tm, strata_context *c, const float *x, int n_tok, int n_w, const matrix *const *ws,
                   float *const *ys) {
    for (int first = 0, last; first < n_w; first = last) {
        int vdt = ws[first]->vec_dot_type;
        for (last = first + 1; last < n_w && ws[last]->vec_dot_type == vdt;) last++;
        quantize_rows(tm, vdt, x, n_tok, ws[first]->n_in, c->xq, act_row_bytes(vdt, ws[first]->n_in));
        products(tm, last - first, ws + first, ys + first, c->xq, n_tok);
    }
}

static void linear1(const team *tm, strata_context *c, const float *x, int n_tok, const matrix *w, float *y) {
    linear(tm, c, x, n_tok, 1, &w, &y);
}

/* Rotate pairs of x (head_dim) by the angles whose cos and sin are given (head_dim / 2 each): pairs (2i, 2i+1)
 * or, NEOX, (i, i + head_dim/2). */
static void rope(float *x, int hd, const float *cs, const float *sn, rope_mode mode) {
    for (int i = 0; i < hd / 2; i++) {
        int a = mode == ROPE_NEOX ? i : 2 * i, b = mode == ROPE_NEOX ? i + hd / 2 : 2 * i + 1;
        float x0 = x[a], x1 = x[b];
        x[a] = x0 * cs[i] - x1 * sn[i];
        x[b] = x0 * sn[i] + x1 * cs[i];
    }
}

/* Per token: q, k heads = RoPE(per-head RMSNorm (qwen3) of q, k) at the token's RoPE position; then its k and v
 * rows go into its sequence's cache at its position. */
static void rope_and_cache(const team *tm, strata_context *c, const layer_weights *L, int il, int n_tok) {
    const strata_model *m = c->model;
    int hd = m->hp.head_dim, nh = m->hp.n_head, nkv = m->hp.n_head_kv;
    range r = share(tm, n_tok);
    for (int t = (int)r.lo; t < r.hi; t++) {
        int pos = c->chunk_pos[t];
        const int *rope_pos = c->chunk_rope + 3 * t;  // (t, h, w): all pos with one axis
        float cs[hd / 2], sn[hd / 2];  // angle (pair i's component) * inv_freq[i], shared by every head
        for (int i = 0; i < hd / 2; i++) {
            float theta = rope_pos[m->rope_axis[i]] * m->inv_freq[i];
            cs[i] = cosf(theta);
            sn[i] = sinf(theta);
        }
        for (int h = 0; h < nh + nkv; h++) {
            float *x = h < nh ? c->q + ((size_t)t * nh + h) * hd : c->k + ((size_t)t * nkv + h - nh) * hd;
            if (m->has_qk_norm) rmsnorm(x, x, h < nh ? L->q_norm : L->k_norm, hd, m->hp.rms_eps);
            rope(x, hd, cs, sn, m->rope);
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

/* att = causal grouped-query attention of the chunk's queries over their sequences' caches. A task is a token
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
        attend_heads(c, kv_base(c, c->chunk_seq[t], il, h0 / group), c->q + off, per, c->chunk_pos[t] + 1, scores,
                     c->att + off);
    }
    team_sync(tm);
}

/* x += y, row by row, this thread's share; no barrier. */
static void add_rows(const team *tm, float *x, const float *y, int n_tok, int64_t n) {
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
static void poll_aborts(const team *tm, strata_context *c, int slot, int n_tok) {
    if (tm->ith != 0) return;
    int live = 0;
    for (int t = 0; t < n_tok; t++) {
        int s = c->chunk_seq[t];
        if (!c->dropped[s] && atomic_exchange(&c->abort_flag[s], 0)) c->dropped[s] = 1;
        live |= !c->dropped[s];
    }
    c->stop_at[slot] = !live;
}

/* The answer of the last poll of `slot`; after a barrier that follows it, every thread reads the same. */
static int team_stopped(const strata_context *c, int slot) { return c->stop_at[slot]; }

// --- transformer blocks

static void attention_block(const team *tm, strata_context *c, int il, int n_tok) {
    const strata_model_params *p = &c->model->hp;
    const layer_weights *L = &c->model->layers[il];
    // xb = rmsnorm(x); q, k, v = xb @ Wq, Wk, Wv
    rmsnorm_rows(tm, c->xb, c->x, L->attn_norm, n_tok, p->n_embd, p->rms_eps);
    const matrix *ws[3] = {&L->wq, &L->wk, &L->wv};
    float *ys[3] = {c->q, c->k, c->v};
    linear(tm, c, c->xb, n_tok, 3, ws, ys);
    // q, k = rope(qk_norm(q, k)); cache k, v at the chunk's positions
    rope_and_cache(tm, c, L, il, n_tok);
    // att = softmax(q k^T / sqrt(head_dim)) v over positions <= each token's; x += att @ Wo
    attention(tm, c, il, n_tok);
    poll_aborts(tm, c, 1, n_tok);  // read before the feed-forward
    linear1(tm, c, c->att, n_tok, &L->wo, c->xb);
    add_rows(tm, c->x, c->xb, n_tok, p->n_embd);
}

static void dense_ffn_block(const team *tm, strata_context *c, int il, int n_tok) {
    const strata_model_params *p = &c->model->hp;
    const layer_weights *L = &c->model->layers[il];
    // xb = rmsnorm(x); x += (silu(xb @ Wgate) * (xb @ Wup)) @ Wdown
    rmsnorm_rows(tm, c->xb, c->x, L->ffn_norm, n_tok, p->n_embd, p->rms_eps);
    const matrix *ws[2] = {&L->ffn_gate, &L->ffn_up};
    float *ys[2] = {c->hb, c->hb2};
    linear(tm, c, c->xb, n_tok, 2, ws, ys);
    swiglu_rows(tm, c->hb, c->hb2, n_tok, p->n_ff);
    poll_aborts(tm, c, 0, n_tok);  // read before the next layer
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

static void moe_block(const team *tm, strata_context *c, int il, int n_tok) {
    const strata_model_params *p = &c->model->hp;
    const layer_weights *L = &c->model->layers[il];
    int k = p->n_expert_used, n_slots = n_tok * k;
    // xb = rmsnorm(x); router logits = xb @ Wr; each token picks its top-k experts
    rmsnorm_rows(tm, c->xb, c->x, L->ffn_norm, n_tok, p->n_embd, p->rms_eps);
    linear1(tm, c, c->xb, n_tok, &L->router, c->router);
    if (tm->ith == 0) {  // no barrier of its own: only gather_slots reads the routing, past the next one
        route_tokens(c, n_tok);
        group_slots(c, L, n_tok);
    }
    // per slot: hb = silu(xb Wg_e) * (xb Wu_e); moe_out = hb @ Wd_e
    experts_gate_up(tm, c, L, n_tok);
    size_t stride = act_row_bytes(L->down_exps.vec_dot_type, p->n_ff_exp);
    poll_aborts(tm, c, 0, n_tok);  // read before the next layer
    quantize_rows(tm, L->down_exps.vec_dot_type, c->hb, n_slots, p->n_ff_exp, c->xq_slots, stride);
    const matrix *down = &L->down_exps;
    expert_products(tm, c, 1, &down, &c->moe_out, c->xq_slots, stride, c->n_tasks_up, c->n_tasks_down,
                    c->task_rows[1]);
    // x += sum over the token's choices of weight * moe_out[slot]
    range r = share(tm, n_tok);
    for (int64_t t = r.lo; t < r.hi; t++)
        for (int j = 0; j < k; j++) {
            const float *y = c->moe_out + (size_t)c->slot_of[t * k + j] * p->n_embd;
            float w = c->choice_weight[t * k + j];
            for (int64_t i = 0; i < p->n_embd; i++) c->x[t * p->n_embd + i] += w * y[i];
        }  // no barrier: the next step on x works on the same share
}

// --- forward pass of one chunk

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* Floats per caller's embedding row: the embedding, then the deepstack slices. */
static int64_t embd_row_width(const strata_model *m) { return (int64_t)m->hp.n_embd * (1 + m->hp.n_deepstack); }

/* x rows = token embeddings, or the caller's rows where the chunk says so. */
static void embed(const team *tm, strata_context *c, const float *embd_rows, int n_tok) {
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

/* After layer k < n_deepstack: x rows of the caller's rows += their slice k + 1 (Qwen3-VL's deepstack: the
 * vision tower's features of earlier layers, added to the picture positions' hidden states of the first layers). */
static void add_deepstack(const team *tm, strata_context *c, const float *embd_rows, int k, int n_tok) {
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
static void output_logits(const team *tm, strata_context *c, int n_tok, float *logits) {
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

/* One chunk's forward pass, as a job for the pool. */
typedef struct {
    strata_context *c;
    const float *embd_rows;        // (n_embd_rows, n_embd)
    int n_tok;
    float *logits;                 // the caller's (n_out, n_vocab)
} chunk_job;

/* Every thread's part of a chunk: embeddings, every layer (the abort flags polled before the end of its
 * attention and of its feed-forward, and the answer acted on after each: a long prompt's chunk spends about a
 * layer's time in each), logits. */
static void forward_job(int ith, int nth, void *arg) {
    const chunk_job *j = arg;
    strata_context *c = j->c;
    const strata_model *m = c->model;
    team tm = {c->pool, ith, nth};
    embed(&tm, c, j->embd_rows, j->n_tok);
    poll_aborts(&tm, c, 0, j->n_tok);
    team_sync(&tm);
    int stop = 0;
    for (int il = 0; !(stop = team_stopped(c, 0)) && il < m->hp.n_layer; il++) {
        attention_block(&tm, c, il, j->n_tok);
        if ((stop = team_stopped(c, 1))) break;
        if (m->is_moe) moe_block(&tm, c, il, j->n_tok);
        else dense_ffn_block(&tm, c, il, j->n_tok);
        if (il < m->hp.n_deepstack) add_deepstack(&tm, c, j->embd_rows, il, j->n_tok);
    }
    if (!stop) {
        team_sync(&tm);  // the output's runs of tokens need not be this thread's share of x
        if (ith == 0) c->output_t0 = now_ms();
        output_logits(&tm, c, j->n_tok, j->logits);
    }
    if (ith == 0) c->stop = stop;  // for the caller, once the job is done
}

// --- eval: validation, chunking, timings

/* Check the call's tokens: sequences in range, each sequence's positions following on from what it holds, token
 * ids in range where no embedding row replaces them, embedding rows at distinct indices. embd_at (n_tokens) = the
 * row replacing each token, or -1. */
static strata_status check_batch(const strata_context *c, const strata_batch *b, int *embd_at) {
    if (b->n_tokens <= 0 || !b->tokens || !b->seq || !b->pos)
        return fail(STRATA_ERR_INVALID_ARG, "eval needs at least one token, with its sequence and position");
    if (b->n_embd_rows < 0 || (b->n_embd_rows > 0 && (!b->embd_rows || !b->embd_index)))
        return fail(STRATA_ERR_INVALID_ARG, "embedding rows without their indices");
    if (b->n_out > 0 && (!b->out_index || !b->logits))
        return fail(STRATA_ERR_INVALID_ARG, "logits rows without their indices or buffer");
    for (int t = 0; t < b->n_tokens; t++) embd_at[t] = -1;
    for (int r = 0; r < b->n_embd_rows; r++) {
        int t = b->embd_index[r];
        if (t < 0 || t >= b->n_tokens) return fail(STRATA_ERR_INVALID_ARG, "embedding row %d at index %d, outside "
                                                   "the %d tokens", r, t, b->n_tokens);
        if (embd_at[t] >= 0) return fail(STRATA_ERR_INVALID_ARG, "two embedding rows at index %d", t);
        const int *at = b->embd_grid ? b->embd_grid + 2 * r : NULL;
        if (at && !(at[0] == -1 && at[1] == -1) && (at[0] < 0 || at[0] >= c->n_ctx || at[1] < 0 || at[1] >= c->n_ctx))
            return fail(STRATA_ERR_INVALID_ARG, "embedding row %d at (%d, %d) of its picture's grid, outside "
                        "[0, %d)", r, at[0], at[1], c->n_ctx);
        embd_at[t] = r;
    }
    for (int r = 0; r < b->n_out; r++)
        if (b->out_index[r] < 0 || b->out_index[r] >= b->n_tokens || (r > 0 && b->out_index[r] <= b->out_index[r - 1]))
            return fail(STRATA_ERR_INVALID_ARG, "logits indices must be increasing token indices; %d at row %d",
                        b->out_index[r], r);
    int *next = c->dropped;  // scratch here: the position each sequence's next token must have
    for (int s = 0; s < c->n_seq; s++) next[s] = c->n_past[s];
    strata_status st = STRATA_OK;
    for (int t = 0; t < b->n_tokens && st == STRATA_OK; t++) {
        int s = b->seq[t];
        if (s < 0 || s >= c->n_seq)
            st = fail(STRATA_ERR_INVALID_ARG, "token %d: sequence %d outside [0, %d)", t, s, c->n_seq);
        else if (b->pos[t] != next[s])
            st = fail(STRATA_ERR_INVALID_ARG, "token %d: position %d, but sequence %d continues at %d", t, b->pos[t],
                      s, next[s]);
        else if (next[s]++ >= c->n_ctx)
            st = fail(STRATA_ERR_CONTEXT_FULL, "sequence %d: %d positions held + the call's exceed the context of %d",
                      s, c->n_past[s], c->n_ctx);
        else if (embd_at[t] < 0 && (b->tokens[t] < 0 || b->tokens[t] >= c->model->hp.n_vocab))
            st = fail(STRATA_ERR_INVALID_ARG, "token id %d out of range [0, %d)", b->tokens[t], c->model->hp.n_vocab);
    }
    memset(c->dropped, 0, sizeof(int) * c->n_seq);
    return st;
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
    if (!b) return fail(STRATA_ERR_INVALID_ARG, "no batch");
    if (b->notify_fd >= 0) {  // first: whoever waits on it runs while this call computes
        uint64_t one = 1;
        if (write(b->notify_fd, &one, sizeof one) < 0) {}  // full or closed: the waiter has had its wake-up
    }
    int n_alloc = b->n_tokens > 0 ? b->n_tokens : 1;
    int *embd_at = malloc(sizeof(int) * n_alloc), *rope = malloc(sizeof(int) * 3 * n_alloc);
    if (!embd_at || !rope) {
        free(embd_at);
        free(rope);
        return fail(STRATA_ERR_NOMEM, "out of memory");
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
        chunk_job job = {c, b->embd_rows, n, b->logits};
        strata_pool_run(c->pool, forward_job, &job);
        if (!c->stop) c->timings.output_ms += now_ms() - c->output_t0;
        for (int i = 0; i < n; i++)  // a finished chunk joins the cache of each sequence not dropped
            if (!c->dropped[c->chunk_seq[i]]) c->n_past[c->chunk_seq[i]] = c->chunk_pos[i] + 1;
        c->timings.n_tokens += n;
        c->timings.n_chunks++;
    }
    int n_dropped = 0;
    for (int s = 0; s < c->n_seq; s++) {
        n_dropped += c->dropped[s];
        if (b->seq_dropped) b->seq_dropped[s] = c->dropped[s];
    }
    memset(c->dropped, 0, sizeof(int) * c->n_seq);
    free(embd_at);
    free(rope);
    c->timings.total_ms = now_ms() - t0;
    if (st == STRATA_OK && n_dropped)
        st = fail(STRATA_ABORTED, "aborted: %d of the call's sequences dropped", n_dropped);
    return st;
}

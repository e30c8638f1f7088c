/* model_load.c — a model from the GGUF tensor table Python hands over: the architecture's row (archs.c), the
 * hyper-parameters checked, each tensor's type, shape and size checked, RoPE frequencies, and the copy of the
 * layer matrices into huge pages (Q8_0 ones in bands) on the load's threads. */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "engine_internal.h"

// --- model: tensors, hyper-parameters, the copy of the weights

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
    if (!tr) return engine_fail(STRATA_ERR_UNSUPPORTED, "tensor %s: unsupported type %d", t->name, t->type);
    int64_t want[4] = {ne0, ne1 ? ne1 : 1, ne2 ? ne2 : 1, 1};
    for (int d = 0; d < 4; d++)
        if ((d < t->n_dims ? t->ne[d] : 1) != want[d])
            return engine_fail(STRATA_ERR_INVALID_ARG,
                        "tensor %s: shape [%lld, %lld, %lld, %lld], expected [%lld, %lld, %lld, %lld]", t->name,
                        t->ne[0], t->ne[1], t->ne[2], t->ne[3], (long long)want[0], (long long)want[1],
                        (long long)want[2], (long long)want[3]);
    if (ne0 % tr->block_size != 0)
        return engine_fail(STRATA_ERR_UNSUPPORTED, "tensor %s: row of %lld not a multiple of %s's block of %lld", t->name,
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
        return engine_fail(STRATA_ERR_INVALID_ARG, "tensor %s: %lld bytes, its shape needs %zu (truncated file?)",
                    t->name, t->n_bytes, w->bytes);
    return STRATA_OK;
}

strata_status load_matrix(const strata_model_params *p, matrix *w, int optional, int64_t ne0, int64_t ne1,
                          int64_t ne2, const char *fmt, int il) {
    char name[96];
    snprintf(name, sizeof name, fmt, il);
    const strata_tensor_info *t = find_tensor(p, name);
    memset(w, 0, sizeof *w);
    if (!t) return optional ? STRATA_OK : engine_fail(STRATA_ERR_INVALID_ARG, "missing tensor %s", name);
    return view_tensor(t, ne0, ne1, ne2, w);
}

strata_status load_vector(const strata_model_params *p, float **out, int optional, int64_t n, const char *fmt,
                          int il) {
    matrix w;
    strata_status st = load_matrix(p, &w, optional, n, 0, 0, fmt, il);
    if (st != STRATA_OK || !w.data) return st;
    *out = malloc(sizeof(float) * n);
    if (!*out) return engine_fail(STRATA_ERR_NOMEM, "out of memory");
    strata_dequantize_row_any(w.type, w.data, *out, n);
    return STRATA_OK;
}

static strata_status check_hparams(const strata_model_params *p) {
    if (p->n_vocab <= 0 || p->n_embd <= 0 || p->n_layer <= 0 || p->n_head <= 0 || p->n_head_kv <= 0 ||
        p->head_dim <= 0 || p->head_dim % 2 != 0 || p->n_ctx_train <= 0 || p->n_head % p->n_head_kv != 0)
        return engine_fail(STRATA_ERR_INVALID_ARG, "inconsistent hyper-parameters (n_vocab %d, n_embd %d, n_layer %d, "
                    "n_head %d, n_head_kv %d, head_dim %d, n_ctx_train %d)", p->n_vocab, p->n_embd, p->n_layer,
                    p->n_head, p->n_head_kv, p->head_dim, p->n_ctx_train);
    if (!(p->rms_eps > 0) || !(p->rope_base > 0))
        return engine_fail(STRATA_ERR_INVALID_ARG, "rms_eps and rope_base must be positive");
    return STRATA_OK;
}

#define TRY(call) do { if ((st = (call)) != STRATA_OK) return st; } while (0)

strata_status load_routed_experts(const strata_model_params *p, layer_weights *L, int il) {
    strata_status st;
    int64_t E = p->n_embd;
    TRY(load_matrix(p, &L->router, 0, E, p->n_expert, 0, "blk.%d.ffn_gate_inp", il));
    TRY(load_matrix(p, &L->gate_exps, 0, E, p->n_ff_exp, p->n_expert, "blk.%d.ffn_gate_exps", il));
    TRY(load_matrix(p, &L->up_exps, 0, E, p->n_ff_exp, p->n_expert, "blk.%d.ffn_up_exps", il));
    return load_matrix(p, &L->down_exps, 0, p->n_ff_exp, E, p->n_expert, "blk.%d.ffn_down_exps", il);
}

static strata_status build_layer(const strata_model *m, const strata_model_params *p, int il, layer_weights *L) {
    int64_t E = p->n_embd, q_dim = (int64_t)p->n_head * p->head_dim, kv_dim = (int64_t)p->n_head_kv * p->head_dim;
    strata_status st;
    TRY(load_vector(p, &L->attn_norm, 0, E, "blk.%d.attn_norm", il));
    TRY(load_matrix(p, &L->wq, 0, E, q_dim, 0, "blk.%d.attn_q", il));
    TRY(load_matrix(p, &L->wk, 0, E, kv_dim, 0, "blk.%d.attn_k", il));
    TRY(load_matrix(p, &L->wv, 0, E, kv_dim, 0, "blk.%d.attn_v", il));
    TRY(load_matrix(p, &L->wo, 0, q_dim, E, 0, "blk.%d.attn_output", il));
    if (m->has_qk_norm) {
        TRY(load_vector(p, &L->q_norm, 0, p->head_dim, "blk.%d.attn_q_norm", il));
        TRY(load_vector(p, &L->k_norm, 0, p->head_dim, "blk.%d.attn_k_norm", il));
    }
    TRY(load_vector(p, &L->ffn_norm, 0, E, "blk.%d.ffn_norm", il));
    if (m->is_moe) {
        TRY(load_routed_experts(p, L, il));
    } else {
        TRY(load_matrix(p, &L->ffn_gate, 0, E, p->n_ff, 0, "blk.%d.ffn_gate", il));
        TRY(load_matrix(p, &L->ffn_up, 0, E, p->n_ff, 0, "blk.%d.ffn_up", il));
        TRY(load_matrix(p, &L->ffn_down, 0, p->n_ff, E, 0, "blk.%d.ffn_down", il));
    }
#undef TRY
    return STRATA_OK;
}

strata_status transformer_load(strata_model *m, const strata_model_params *p) {
    for (int il = 0; il < p->n_layer; il++) {
        strata_status st = build_layer(m, p, il, &m->layers[il]);
        if (st != STRATA_OK) return st;
    }
    return STRATA_OK;
}

/* The architecture's traits and layer; UNSUPPORTED for a name the table lacks. */
static strata_status set_arch(strata_model *m, const char *name) {
    if (!name) return engine_fail(STRATA_ERR_INVALID_ARG, "no architecture given");
    const arch *a = arch_find(name);
    if (!a) {
        char names[256];
        arch_names(names, sizeof names);
        return engine_fail(STRATA_ERR_UNSUPPORTED, "unsupported architecture '%s' (%s)", name, names);
    }
    m->rope = a->rope;
    m->has_qk_norm = a->has_qk_norm;
    m->is_moe = a->is_moe;
    m->mrope = a->mrope;
    m->layer = a->layer;
    m->load = a->load;
    snprintf(m->arch, sizeof m->arch, "%s", name);
    return STRATA_OK;
}

/* inv_freq[i] = rope_base^(-2i / n_rot) / rope_freqs[i]: the optional `rope_freqs` tensor (n_rot / 2 factors,
 * which llama.cpp's converter writes for Llama 3.1's "llama3" scaling) divides each pair's frequency. */
static strata_status build_rope(strata_model *m, const strata_model_params *p) {
    m->n_rot = p->n_rot ? p->n_rot : p->head_dim;
    if (m->n_rot < 2 || m->n_rot % 2 || m->n_rot > p->head_dim)
        return engine_fail(STRATA_ERR_INVALID_ARG, "rope.dimension_count %d: expected an even number in [2, %d]",
                           m->n_rot, p->head_dim);
    int n = m->n_rot / 2;
    m->inv_freq = malloc(sizeof(float) * n);
    if (!m->inv_freq) return engine_fail(STRATA_ERR_NOMEM, "out of memory");
    for (int i = 0; i < n; i++) m->inv_freq[i] = (float)(1.0 / pow(p->rope_base, (2.0 * i) / m->n_rot));
    const strata_tensor_info *t = find_tensor(p, "rope_freqs");
    if (!t) return STRATA_OK;
    if (t->type != STRATA_TYPE_F32 || t->n_dims != 1 || t->ne[0] != n ||
        t->n_bytes < (long long)(sizeof(float) * n))
        return engine_fail(STRATA_ERR_INVALID_ARG, "tensor %s: expected %d F32 values (n_rot / 2)", t->name, n);
    const float *factors = t->data;
    for (int i = 0; i < n; i++) {
        if (!(factors[i] > 0))
            return engine_fail(STRATA_ERR_INVALID_ARG, "tensor %s: factor %d is not positive", t->name, i);
        m->inv_freq[i] /= factors[i];
    }
    return STRATA_OK;
}

/* rope_axis[i]: the position component pair i turns by, Qwen3-VL's interleaving (Hugging Face's
 * apply_interleaved_mrope: h on pairs 1, 4, 7, ... below 3 sections[1], w on 2, 5, 8, ... below 3 sections[2],
 * t on the rest); and the deepstack count, which only those models have. */
static strata_status build_mrope(strata_model *m, const strata_model_params *p) {
    const int *sec = p->rope_sections;
    int n = m->n_rot / 2, any = sec[0] || sec[1] || sec[2] || sec[3];
    if (sec[0] < 0 || sec[1] < 0 || sec[2] < 0 || sec[3] != 0 || sec[0] + sec[1] + sec[2] > n)
        return engine_fail(STRATA_ERR_UNSUPPORTED, "rope.dimension_sections [%d, %d, %d, %d]: expected three sections of "
                    "at most n_rot / 2 = %d pairs in all, the fourth 0", sec[0], sec[1], sec[2], sec[3], n);
    if (!m->mrope && any)
        return engine_fail(STRATA_ERR_UNSUPPORTED, "rope.dimension_sections on %s, whose RoPE has one axis", m->arch);
    if (p->n_deepstack < 0 || p->n_deepstack > p->n_layer || (!m->mrope && p->n_deepstack))
        return engine_fail(STRATA_ERR_INVALID_ARG, "n_deepstack_layers %d on %s with %d layers", p->n_deepstack, m->arch,
                    p->n_layer);
    m->rope_axis = calloc(n, 1);
    if (!m->rope_axis) return engine_fail(STRATA_ERR_NOMEM, "out of memory");
    for (int i = 0; m->mrope && i < n; i++)
        m->rope_axis[i] = i % 3 == 1 && i < 3 * sec[1] ? 1 : i % 3 == 2 && i < 3 * sec[2] ? 2 : 0;
    return STRATA_OK;
}

/* Which layers are recurrent (hybrid models name them; every other model has attention layers only), and each
 * layer's index among its kind: the KV cache holds attention layers' rows, the recurrent state the others'. */
static strata_status build_layer_kinds(strata_model *m, const strata_model_params *p) {
    int n = p->n_layer;
    m->recurrent = calloc(n, sizeof(int));
    m->kv_layer = malloc(sizeof(int) * (n + (p->n_nextn > 0 ? p->n_nextn : 0)));
    m->rec_layer = malloc(sizeof(int) * n);
    if (!m->recurrent || !m->kv_layer || !m->rec_layer) return engine_fail(STRATA_ERR_NOMEM, "out of memory");
    if (p->n_nextn < 0) return engine_fail(STRATA_ERR_INVALID_ARG, "nextn_predict_layers %d is negative", p->n_nextn);
    for (int il = 0; il < n; il++) {
        m->recurrent[il] = p->recurrent_layers ? p->recurrent_layers[il] != 0 : 0;
        m->kv_layer[il] = m->recurrent[il] ? -1 : m->n_kv_layer++;
        m->rec_layer[il] = m->recurrent[il] ? m->n_rec_layer++ : -1;
    }
    for (int j = 0; j < p->n_nextn; j++) m->kv_layer[n + j] = m->n_kv_layer + j;
    return STRATA_OK;
}

static strata_status check_moe_hparams(const strata_model *m) {
    const strata_model_params *p = &m->hp;
    if (m->is_moe && (p->n_expert <= 0 || p->n_expert_used <= 0 || p->n_expert_used > p->n_expert ||
                      p->n_expert_used > MAX_EXPERT_USED || p->n_ff_exp <= 0))
        return engine_fail(STRATA_ERR_INVALID_ARG, "inconsistent expert counts (n_expert %d, n_expert_used %d, "
                    "n_ff_exp %d)", p->n_expert, p->n_expert_used, p->n_ff_exp);
    if (!m->is_moe && p->n_ff <= 0) return engine_fail(STRATA_ERR_INVALID_ARG, "feed_forward_length must be positive");
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
    if (!m->output_bands) return engine_fail(STRATA_ERR_NOMEM, "out of memory for the output weight's bands (%zu bytes)", n);
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
                        &L->gate_exps, &L->up_exps, &L->down_exps, &L->gate_shexp,
                        &L->up_shexp, &L->down_shexp, &L->ssm_qkv, &L->ssm_z, &L->ssm_alpha, &L->ssm_beta,
                        &L->ssm_out};
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
    const size_t cap = (size_t)m->hp.n_layer * 20 + 1;  // streamed_matrices' per layer, and the output
    matrix **ws = malloc(sizeof(matrix *) * cap);
    char **dst = malloc(sizeof(char *) * cap);
    int *first_unit = malloc(sizeof(int) * (cap + 1));
    if (!ws || !dst || !first_unit) {
        free(ws), free(dst), free(first_unit);
        return engine_fail(STRATA_ERR_NOMEM, "out of memory");
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
        return engine_fail(STRATA_ERR_NOMEM, "out of memory for a copy of the weights (%zu MiB)", total >> 20);
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
        (st = check_moe_hparams(m)) != STRATA_OK || (st = build_rope(m, p)) != STRATA_OK ||
        (st = build_mrope(m, p)) != STRATA_OK)
        return st;
    m->hp.arch = m->arch;
    m->hp.tensors = NULL;
    m->hp.n_tensors = 0;
    if ((st = load_matrix(p, &m->tok_embd, 0, p->n_embd, p->n_vocab, 0, "token_embd", 0)) != STRATA_OK ||
        (st = load_matrix(p, &m->output, 1, p->n_embd, p->n_vocab, 0, "output", 0)) != STRATA_OK ||
        (st = load_vector(p, &m->output_norm, 0, p->n_embd, "output_norm", 0)) != STRATA_OK)
        return st;
    if (!m->output.data) m->output = m->tok_embd;  // tied embeddings
    if ((st = prepare_output(m)) != STRATA_OK) return st;
    if ((st = build_layer_kinds(m, p)) != STRATA_OK) return st;
    m->layers = calloc(p->n_layer + p->n_nextn, sizeof(layer_weights));
    if (!m->layers) return engine_fail(STRATA_ERR_NOMEM, "out of memory");
    m->mtp = p->n_nextn ? m->layers + p->n_layer : NULL;
    if ((st = m->load(m, p)) != STRATA_OK) return st;
    return p->copy_weights ? copy_weights(m, p->load_threads) : STRATA_OK;
}

strata_status strata_model_create(const strata_model_params *params, strata_model **out) {
    *out = NULL;
    if (!params) return engine_fail(STRATA_ERR_INVALID_ARG, "no model parameters");
    strata_model *m = calloc(1, sizeof *m);
    if (!m) return engine_fail(STRATA_ERR_NOMEM, "out of memory");
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
        for (int il = 0; il < m->hp.n_layer + m->hp.n_nextn; il++) {
            layer_weights *L = &m->layers[il];
            free(L->attn_norm); free(L->q_norm); free(L->k_norm); free(L->ffn_norm);
            free(L->gate_inp_shexp); free(L->ssm_conv); free(L->ssm_a); free(L->ssm_dt); free(L->ssm_norm);
            free(L->nextn_enorm); free(L->nextn_hnorm); free(L->nextn_head_norm);
        }
    free(m->layers);
    free(m->output_norm);
    free(m->output_bands);
    free(m->weights);
    free(m->inv_freq);
    free(m->rope_axis);
    free(m->recurrent);
    free(m->kv_layer);
    free(m->rec_layer);
    free(m);
}

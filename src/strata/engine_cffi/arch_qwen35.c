/* arch_qwen35.c — Qwen3.5 / Qwen3.6 (qwen35 dense, qwen35moe): hybrid layers, as llama.cpp's converter writes
 * them. Most layers are Gated DeltaNet (linear attention with a recurrent state, blocks_deltanet.c), the others
 * gated full attention (each head's output times the sigmoid of a gate the q projection also yields; RMS-normed
 * q and k; NEOX RoPE on the first n_rot values of a head, multi-axis over pictures); then the feed-forward, dense
 * or routed experts plus a gated shared expert. Which layers are which comes from the file. The file's MTP blocks
 * (nextn) are loaded and checked for speculative decoding; the forward pass does not run them. Every tensor of
 * the file must be one this loader reads: anything else would change the maths unseen, and is refused. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"

// --- the layer

int qwen35_layer(const team *tm, strata_context *c, int il, const float *embd_rows, int n_tok) {
    (void)embd_rows;
    // x += the token mixer of rmsnorm(x): the Gated DeltaNet or gated attention; the chunk stops here when every
    // sequence was dropped
    if (c->model->recurrent[il]) block_deltanet(tm, c, il, n_tok);
    else block_attention(tm, c, il, n_tok);
    if (team_stopped(c, 1)) return 1;
    // x += the feed-forward of rmsnorm(x) (the file's post_attention_norm)
    if (c->model->is_moe) block_moe_ffn(tm, c, il, n_tok);
    else block_dense_ffn(tm, c, il, n_tok);
    return 0;
}

// --- the tensors

/* The names (after "blk.N.", without ".weight") each kind of block reads. */
static const char *const COMMON[] = {"attn_norm", "post_attention_norm", NULL};
static const char *const ATTENTION[] = {"attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                                        NULL};
static const char *const DELTANET[] = {"attn_qkv", "attn_gate", "ssm_conv1d", "ssm_dt.bias", "ssm_a", "ssm_alpha",
                                       "ssm_beta", "ssm_norm", "ssm_out", NULL};
static const char *const MOE[] = {"ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                                  "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", NULL};
static const char *const DENSE[] = {"ffn_gate", "ffn_up", "ffn_down", NULL};
static const char *const NEXTN[] = {"nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "nextn.embed_tokens",
                                    "nextn.shared_head_head", "nextn.shared_head_norm", NULL};

static int listed(const char *const *names, const char *name) {
    for (; *names; names++)
        if (strcmp(*names, name) == 0) return 1;
    return 0;
}

/* Whether the loader reads tensor `full` (a GGUF tensor name). */
static int known_tensor(const strata_model *m, const char *full) {
    char name[96];
    snprintf(name, sizeof name, "%s", full);
    size_t n = strlen(name);
    if (n > 7 && strcmp(name + n - 7, ".weight") == 0) name[n - 7] = '\0';
    if (!strcmp(name, "token_embd") || !strcmp(name, "output") || !strcmp(name, "output_norm")) return 1;
    int il, at = 0;
    if (sscanf(name, "blk.%d.%n", &il, &at) != 1 || at == 0 || il < 0 || il >= m->hp.n_layer + m->hp.n_nextn)
        return 0;
    const char *rest = name + at;
    int mtp = il >= m->hp.n_layer, rec = !mtp && m->recurrent[il];
    return listed(COMMON, rest) || listed(rec ? DELTANET : ATTENTION, rest) ||
           listed(m->is_moe ? MOE : DENSE, rest) || (mtp && listed(NEXTN, rest));
}

/* A small matrix (n_rows, n) of any supported type as a new f32 array. */
static strata_status load_floats(const strata_model_params *p, float **out, int64_t n, int64_t n_rows,
                                 const char *fmt, int il) {
    matrix w;
    strata_status st = load_matrix(p, &w, 0, n, n_rows, 0, fmt, il);
    if (st != STRATA_OK) return st;
    *out = malloc(sizeof(float) * n * n_rows);
    if (!*out) return engine_fail(STRATA_ERR_NOMEM, "out of memory");
    for (int64_t r = 0; r < n_rows; r++)
        strata_dequantize_row_any(w.type, (const char *)w.data + r * w.row_bytes, *out + r * n, n);
    return STRATA_OK;
}

static strata_status check_deltanet_hparams(strata_model *m) {
    const strata_model_params *p = &m->hp;
    int any = m->n_rec_layer > 0;
    if (any && (p->ssm_d_conv < 1 || p->ssm_d_state <= 0 || p->ssm_n_group <= 0 || p->ssm_dt_rank <= 0 ||
                p->ssm_dt_rank % p->ssm_n_group != 0 || p->ssm_d_inner != p->ssm_dt_rank * p->ssm_d_state))
        return engine_fail(STRATA_ERR_INVALID_ARG, "inconsistent Gated DeltaNet sizes (ssm.conv_kernel %d, "
                           "ssm.state_size %d, ssm.group_count %d, ssm.time_step_rank %d, ssm.inner_size %d)",
                           p->ssm_d_conv, p->ssm_d_state, p->ssm_n_group, p->ssm_dt_rank, p->ssm_d_inner);
    if (m->is_moe && p->n_ff_shexp <= 0)
        return engine_fail(STRATA_ERR_INVALID_ARG, "expert_shared_feed_forward_length must be positive");
    m->gated_attn = 1;
    m->conv_dim = any ? 2 * (int64_t)p->ssm_n_group * p->ssm_d_state + p->ssm_d_inner : 0;
    m->conv_state_floats = any ? (size_t)(p->ssm_d_conv - 1) * m->conv_dim : 0;
    m->ssm_state_floats = any ? (size_t)p->ssm_dt_rank * p->ssm_d_state * p->ssm_d_state : 0;
    return STRATA_OK;
}

/* Block il: a trunk layer (recurrent or attention), or an MTP block (il >= n_layer: attention, feed-forward and
 * its nextn tensors). */
static strata_status load_block(const strata_model *m, const strata_model_params *p, int il, layer_weights *L) {
    int64_t E = p->n_embd, hd = p->head_dim, q_dim = (int64_t)p->n_head * hd, kv_dim = (int64_t)p->n_head_kv * hd;
    int64_t hv = p->ssm_dt_rank, value_dim = p->ssm_d_inner, dk = p->ssm_d_state;
    int mtp = il >= p->n_layer;
    strata_status st;
#define TRY(call) do { if ((st = (call)) != STRATA_OK) return st; } while (0)
    TRY(load_vector(p, &L->attn_norm, 0, E, "blk.%d.attn_norm", il));
    TRY(load_vector(p, &L->ffn_norm, 0, E, "blk.%d.post_attention_norm", il));
    if (!mtp && m->recurrent[il]) {
        TRY(load_matrix(p, &L->ssm_qkv, 0, E, m->conv_dim, 0, "blk.%d.attn_qkv", il));
        TRY(load_matrix(p, &L->ssm_z, 0, E, value_dim, 0, "blk.%d.attn_gate", il));
        TRY(load_matrix(p, &L->ssm_alpha, 0, E, hv, 0, "blk.%d.ssm_alpha", il));
        TRY(load_matrix(p, &L->ssm_beta, 0, E, hv, 0, "blk.%d.ssm_beta", il));
        TRY(load_floats(p, &L->ssm_conv, p->ssm_d_conv, m->conv_dim, "blk.%d.ssm_conv1d", il));
        TRY(load_vector(p, &L->ssm_a, 0, hv, "blk.%d.ssm_a", il));
        TRY(load_vector(p, &L->ssm_dt, 0, hv, "blk.%d.ssm_dt.bias", il));
        TRY(load_vector(p, &L->ssm_norm, 0, dk, "blk.%d.ssm_norm", il));
        TRY(load_matrix(p, &L->ssm_out, 0, value_dim, E, 0, "blk.%d.ssm_out", il));
    } else {
        TRY(load_matrix(p, &L->wq, 0, E, 2 * q_dim, 0, "blk.%d.attn_q", il));
        TRY(load_matrix(p, &L->wk, 0, E, kv_dim, 0, "blk.%d.attn_k", il));
        TRY(load_matrix(p, &L->wv, 0, E, kv_dim, 0, "blk.%d.attn_v", il));
        TRY(load_matrix(p, &L->wo, 0, q_dim, E, 0, "blk.%d.attn_output", il));
        TRY(load_vector(p, &L->q_norm, 0, hd, "blk.%d.attn_q_norm", il));
        TRY(load_vector(p, &L->k_norm, 0, hd, "blk.%d.attn_k_norm", il));
    }
    if (m->is_moe) {
        TRY(load_routed_experts(p, L, il));
        TRY(load_vector(p, &L->gate_inp_shexp, 0, E, "blk.%d.ffn_gate_inp_shexp", il));
        TRY(load_matrix(p, &L->gate_shexp, 0, E, p->n_ff_shexp, 0, "blk.%d.ffn_gate_shexp", il));
        TRY(load_matrix(p, &L->up_shexp, 0, E, p->n_ff_shexp, 0, "blk.%d.ffn_up_shexp", il));
        TRY(load_matrix(p, &L->down_shexp, 0, p->n_ff_shexp, E, 0, "blk.%d.ffn_down_shexp", il));
    } else {
        TRY(load_matrix(p, &L->ffn_gate, 0, E, p->n_ff, 0, "blk.%d.ffn_gate", il));
        TRY(load_matrix(p, &L->ffn_up, 0, E, p->n_ff, 0, "blk.%d.ffn_up", il));
        TRY(load_matrix(p, &L->ffn_down, 0, p->n_ff, E, 0, "blk.%d.ffn_down", il));
    }
    if (mtp) {
        TRY(load_matrix(p, &L->nextn_eh_proj, 0, 2 * E, E, 0, "blk.%d.nextn.eh_proj", il));
        TRY(load_vector(p, &L->nextn_enorm, 0, E, "blk.%d.nextn.enorm", il));
        TRY(load_vector(p, &L->nextn_hnorm, 0, E, "blk.%d.nextn.hnorm", il));
        TRY(load_matrix(p, &L->nextn_embed, 1, E, p->n_vocab, 0, "blk.%d.nextn.embed_tokens", il));
        TRY(load_matrix(p, &L->nextn_head, 1, E, p->n_vocab, 0, "blk.%d.nextn.shared_head_head", il));
        TRY(load_vector(p, &L->nextn_head_norm, 1, E, "blk.%d.nextn.shared_head_norm", il));
    }
#undef TRY
    return STRATA_OK;
}

strata_status qwen35_load(strata_model *m, const strata_model_params *p) {
    strata_status st = check_deltanet_hparams(m);
    for (int il = 0; st == STRATA_OK && il < p->n_layer + p->n_nextn; il++) st = load_block(m, p, il, &m->layers[il]);
    for (int i = 0; st == STRATA_OK && i < p->n_tensors; i++)
        if (!known_tensor(m, p->tensors[i].name))
            st = engine_fail(STRATA_ERR_UNSUPPORTED, "tensor %s is not part of %s as this engine runs it (refused: "
                             "it would change the model's output unseen)", p->tensors[i].name, m->arch);
    return st;
}

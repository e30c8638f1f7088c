/* arch_qwen3.c — the layer of Qwen3 (qwen3, qwen3moe) and of Qwen3-VL's text side (qwen3vl, qwen3vlmoe):
 * attention with RMS-normed q and k heads and NEOX RoPE (multi-axis for Qwen3-VL, by the table's traits), then a
 * SwiGLU feed-forward, dense or a mixture of experts; Qwen3-VL adds the pictures' deepstack rows after each of its
 * first n_deepstack layers. */
#include "blocks.h"

// --- the layer

static int layer(const team *tm, strata_context *c, int il, const float *embd_rows, int n_tok, int moe) {
    // x += attention(rmsnorm(x)); the chunk stops here when every sequence was dropped
    block_attention(tm, c, il, n_tok);
    if (team_stopped(c, 1)) return 1;
    // x += SwiGLU(rmsnorm(x)): the dense weights, or the router's top-k experts
    if (moe) block_moe_ffn(tm, c, il, n_tok);
    else block_dense_ffn(tm, c, il, n_tok);
    // Qwen3-VL: picture rows += the vision tower's features for this layer
    if (il < c->model->hp.n_deepstack) block_add_deepstack(tm, c, embd_rows, il, n_tok);
    return 0;
}

int qwen3_layer(const team *tm, strata_context *c, int il, const float *embd_rows, int n_tok) {
    return layer(tm, c, il, embd_rows, n_tok, 0);
}

int qwen3moe_layer(const team *tm, strata_context *c, int il, const float *embd_rows, int n_tok) {
    return layer(tm, c, il, embd_rows, n_tok, 1);
}

/* arch_llama.c — the layer of Llama (llama: Llama 2 and 3, and the models written as it): attention with RoPE
 * on adjacent pairs (Llama 3's frequency factors are the loader's), then a dense SwiGLU feed-forward. */
#include "blocks.h"

// --- the layer

int llama_layer(const team *tm, strata_context *c, int il, const float *embd_rows, int n_tok) {
    (void)embd_rows;
    // x += attention(rmsnorm(x)); the chunk stops here when every sequence was dropped
    block_attention(tm, c, il, n_tok);
    if (team_stopped(c, 1)) return 1;
    // x += SwiGLU(rmsnorm(x))
    block_dense_ffn(tm, c, il, n_tok);
    return 0;
}

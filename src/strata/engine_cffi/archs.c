/* archs.c — the architectures the engine runs: one row per `general.architecture`, its traits and its layer.
 * Each family's layer is its own file (arch_<family>.c), made of blocks.c's building blocks: a new architecture
 * is a new file and a row here. */
#include <stdio.h>
#include <string.h>

#include "engine_internal.h"

// --- the table

static const arch ARCHS[] = {
    {"qwen3moe", ROPE_NEOX, 1, 1, 0, qwen3moe_layer, transformer_load},
    {"qwen3", ROPE_NEOX, 1, 0, 0, qwen3_layer, transformer_load},
    {"llama", ROPE_NORMAL, 0, 0, 0, llama_layer, transformer_load},
    /* Qwen3-VL's text side: Qwen3 with multi-axis RoPE over pictures and deepstack rows */
    {"qwen3vl", ROPE_NEOX, 1, 0, 1, qwen3_layer, transformer_load},
    {"qwen3vlmoe", ROPE_NEOX, 1, 1, 1, qwen3moe_layer, transformer_load},
    /* Qwen3.5 / Qwen3.6: Gated DeltaNet layers between gated attention ones, partial multi-axis RoPE */
    {"qwen35", ROPE_NEOX, 1, 0, 1, qwen35_layer, qwen35_load},
    {"qwen35moe", ROPE_NEOX, 1, 1, 1, qwen35_layer, qwen35_load},
};
#define N_ARCHS ((int)(sizeof ARCHS / sizeof ARCHS[0]))

const arch *arch_find(const char *name) {
    for (int i = 0; i < N_ARCHS; i++)
        if (strcmp(name, ARCHS[i].name) == 0) return &ARCHS[i];
    return NULL;
}

void arch_names(char *out, size_t n) {
    size_t at = 0;
    out[0] = '\0';
    for (int i = 0; i < N_ARCHS && at < n; i++)
        at += (size_t)snprintf(out + at, n - at, "%s%s", i ? ", " : "", ARCHS[i].name);
}

/* kv_rows.c — a sequence's cached positions as bytes, out of the context and back in: what a KV tier under the
 * prefix cache (a directory of blocks, `strata.kv_disk`) stores. The bytes of n positions [first, first + n):
 * for each attention layer (a hybrid model's recurrent layers have no rows: their state is saved whole, by
 * strata_state_save) and KV head, its K rows then its V rows (n x head_dim values of the cache's type each); with
 * an int8 cache, for each attention layer and KV head, the K scales then the V scales (n floats each); with
 * multi-axis RoPE,
 * the n positions' t components then their "next" values (ints). Each part is one memcpy of adjacent rows: a KV
 * head's positions are adjacent in the cache (kv_base). The layout depends on n: bytes exported with n are
 * imported with the same n, at the same first position (the RoPE components are absolute). */
#include <string.h>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

#include "engine_internal.h"

size_t strata_kv_position_bytes(const strata_context *c) {
    const strata_model_params *p = &c->model->hp;
    size_t heads = (size_t)c->model->n_kv_layer * p->n_head_kv;
    size_t bytes = 2 * heads * p->head_dim * c->kv_elem;
    if (c->kv_type == STRATA_KV_INT8) bytes += 2 * heads * sizeof(float);
    if (c->model->mrope) bytes += 2 * sizeof(int);
    return bytes;
}

/* Copy n positions from `first` between the cache of `seq` and `buf`, in the layout above; to_cache picks the
 * direction. */
static void move_rows(strata_context *c, int seq, int first, int n, char *buf, int to_cache) {
    const strata_model_params *p = &c->model->hp;
    size_t row = p->head_dim * c->kv_elem, run = (size_t)n * row;
    for (int il = 0; il < p->n_layer; il++)
        for (int h = 0; h < p->n_head_kv && c->model->kv_layer[il] >= 0; h++) {
            size_t at = (kv_base(c, seq, il, h) + first) * row;
            char *k = (char *)c->k_cache + at, *v = (char *)c->v_cache + at;
            if (to_cache) memcpy(k, buf, run), memcpy(v, buf + run, run);
            else memcpy(buf, k, run), memcpy(buf + run, v, run);
            buf += 2 * run;
        }
    if (c->kv_type == STRATA_KV_INT8) {
        size_t run_scales = sizeof(float) * n;
        for (int il = 0; il < p->n_layer; il++)
            for (int h = 0; h < p->n_head_kv && c->model->kv_layer[il] >= 0; h++) {
                size_t at = kv_base(c, seq, il, h) + first;
                float *ks = c->k_scale + at, *vs = c->v_scale + at;
                if (to_cache) memcpy(ks, buf, run_scales), memcpy(vs, buf + run_scales, run_scales);
                else memcpy(buf, ks, run_scales), memcpy(buf + run_scales, vs, run_scales);
                buf += 2 * run_scales;
            }
    }
    if (c->model->mrope) {
        size_t run_ints = sizeof(int) * n, at = (size_t)seq * c->n_ctx + first;
        int *t = c->rope_t + at, *next = c->rope_next + at;
        if (to_cache) memcpy(t, buf, run_ints), memcpy(next, buf + run_ints, run_ints);
        else memcpy(buf, t, run_ints), memcpy(buf + run_ints, next, run_ints);
    }
}

strata_status strata_kv_export(strata_context *c, int seq, int first, int n, void *buf) {
    if (seq < 0 || seq >= c->n_seq)
        return engine_fail(STRATA_ERR_INVALID_ARG, "sequence %d outside [0, %d)", seq, c->n_seq);
    if (first < 0 || n < 0 || first + n > c->n_past[seq] || (n > 0 && !buf))
        return engine_fail(STRATA_ERR_INVALID_ARG, "export of positions [%d, %d): sequence %d holds %d", first,
                           first + n, seq, c->n_past[seq]);
    move_rows(c, seq, first, n, buf, 0);
    return STRATA_OK;
}

strata_status strata_kv_import(strata_context *c, int seq, int first, int n, const void *buf) {
    if (seq < 0 || seq >= c->n_seq)
        return engine_fail(STRATA_ERR_INVALID_ARG, "sequence %d outside [0, %d)", seq, c->n_seq);
    if (first != c->n_past[seq] || n < 0 || first + n > c->n_ctx || (n > 0 && !buf))
        return engine_fail(STRATA_ERR_INVALID_ARG, "import of positions [%d, %d): sequence %d continues at %d of %d",
                           first, first + n, seq, c->n_past[seq], c->n_ctx);
    move_rows(c, seq, first, n, (char *)buf, 1);
    if (n > 0 && c->state_floats) c->state_valid[seq] = 0;  // the rows came without a state: strata_state_load
    if (n > 0) c->ckpt[seq] = CKPT_NONE;
    c->n_past[seq] = first + n;
    if (c->mtp) mtp_skip(c, seq, first + n);
    return STRATA_OK;
}

/* CRC-32C (Castagnoli), as iSCSI and ext4 use it: the SSE4.2 instruction, 8 bytes at a time, where the build has
 * it (2-10x zlib's crc32 here), else bit by bit. Continues from `crc` (0 to start). */
uint32_t strata_crc32c(const void *data, size_t n, uint32_t crc) {
    const unsigned char *p = data;
    crc = ~crc;
#if defined(__SSE4_2__)
    uint64_t c = crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = _mm_crc32_u64(c, word);
    }
    crc = (uint32_t)c;
    for (; n; n--) crc = _mm_crc32_u8(crc, *p++);
#else
    for (; n; n--) {
        crc ^= *p++;
        for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    }
#endif
    return ~crc;
}

/* quants_ref.c — the scalar reference kernels: dequantisation (bit for bit what the gguf package computes: the
 * same f32 operations in the same order) and one-row dot products. */
#include "quants.h"

// --- f16 / bf16 scalars

float strata_f16_to_f32(uint16_t h) {
    return f16_to_f32(h);
}

uint16_t strata_f32_to_f16(float f) {
    return f32_to_f16(f);
}

float strata_bf16_to_f32(uint16_t h) {
    return bf16_to_f32(h);
}

// --- dequantisation

void strata_to_float_f32(const void *src, float *y, int64_t n) {
    memcpy(y, src, (size_t)n * sizeof(float));
}

void strata_to_float_f16(const void *src, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = F16(((const uint16_t *)src)[i]);
}

void strata_to_float_bf16(const void *src, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = bf16_to_f32(((const uint16_t *)src)[i]);
}

void strata_to_float_q8_0(const void *src, float *y, int64_t n) {
    const block_q8_0 *b = src;
    for (int64_t i = 0; i < n / QK; i++)
        for (int j = 0; j < QK; j++) y[i * QK + j] = (float)b[i].qs[j] * F16(b[i].d);
}

void strata_to_float_q4_0(const void *src, float *y, int64_t n) {
    const block_q4_0 *b = src;
    for (int64_t i = 0; i < n / QK; i++) {
        float d = F16(b[i].d);
        for (int j = 0; j < QK / 2; j++) {
            y[i * QK + j] = d * (float)((b[i].qs[j] & 0xf) - 8);
            y[i * QK + j + QK / 2] = d * (float)((b[i].qs[j] >> 4) - 8);
        }
    }
}

// No fused multiply-add here: the reference rounds d * q before subtracting the min.
__attribute__((optimize("fp-contract=off")))
void strata_to_float_q4_K(const void *src, float *y, int64_t n) {
    const block_q4_K *b = src;
    for (int64_t i = 0; i < n / QKK; i++, y += QKK) {
        uint8_t sc[8], m[8];
        q4k_scale_min(b[i].scales, sc, m);
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        for (int s = 0; s < 8; s++) {
            float dl = d * (float)sc[s], ml = dmin * (float)m[s];
            for (int j = 0; j < 32; j++) {
                int q = (b[i].qs[(s / 2) * 32 + j] >> (4 * (s % 2))) & 0xf;
                y[s * 32 + j] = dl * (float)q - ml;
            }
        }
    }
}

void strata_to_float_q6_K(const void *src, float *y, int64_t n) {
    const block_q6_K *b = src;
    for (int64_t i = 0; i < n / QKK; i++, y += QKK) {
        float d = F16(b[i].d);
        for (int e = 0; e < QKK; e++) y[e] = (d * (float)b[i].scales[e / 16]) * (float)(q6k_value(&b[i], e) - 32);
    }
}

void strata_to_float_q8_K(const void *src, float *y, int64_t n) {
    const block_q8_K *b = src;
    for (int64_t i = 0; i < n / QKK; i++)
        for (int j = 0; j < QKK; j++) y[i * QKK + j] = (float)b[i].qs[j] * b[i].d;
}

// --- scalar dot products: one weight row with one activation row in its vec_dot_type (the vector paths'
// tiles fall back to these)

float strata_vec_dot_f32(const void *wv, const void *xv, int64_t n) {
    const float *w = wv;
    const float *x = xv;
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += w[i] * x[i];
    return s;
}

float strata_vec_dot_f16(const void *wv, const void *xv, int64_t n) {
    const uint16_t *w = wv;
    const float *x = xv;
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += F16(w[i]) * x[i];
    return s;
}

float strata_vec_dot_bf16(const void *wv, const void *xv, int64_t n) {
    const uint16_t *w = wv;
    const float *x = xv;
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += bf16_to_f32(w[i]) * x[i];
    return s;
}

float strata_vec_dot_q8_0(const void *wv, const void *xv, int64_t n) {
    const block_q8_0 *w = wv;
    const block_q8_0 *x = xv;
    int64_t nb = n / QK;
    float s = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int acc = 0;
        for (int j = 0; j < QK; j++) acc += w[i].qs[j] * x[i].qs[j];
        s += F16(w[i].d) * F16(x[i].d) * (float)acc;
    }
    return s;
}

float strata_vec_dot_q4_0(const void *wv, const void *xv, int64_t n) {
    const block_q4_0 *w = wv;
    const block_q8_0 *x = xv;
    int64_t nb = n / QK;
    float s = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int acc = 0;
        for (int j = 0; j < QK / 2; j++)
            acc += ((w[i].qs[j] & 0xf) - 8) * x[i].qs[j] + ((w[i].qs[j] >> 4) - 8) * x[i].qs[j + QK / 2];
        s += F16(w[i].d) * F16(x[i].d) * (float)acc;
    }
    return s;
}

// sum_s d*sc_s * sum(q a) * da - dmin*m_s * sum(a) * da: the mins need only the activation sums (bsums).
float strata_vec_dot_q4_K(const void *wv, const void *xv, int64_t n) {
    const block_q4_K *w = wv;
    const block_q8_K *x = xv;
    int64_t nb = n / QKK;
    float s = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        uint8_t sc[8], m[8];
        q4k_scale_min(w[i].scales, sc, m);
        int isum = 0, msum = 0;
        for (int sb = 0; sb < 8; sb++) {
            int acc = 0;
            for (int j = 0; j < 32; j++)
                acc += ((w[i].qs[(sb / 2) * 32 + j] >> (4 * (sb % 2))) & 0xf) * x[i].qs[sb * 32 + j];
            isum += sc[sb] * acc;
            msum += m[sb] * (x[i].bsums[2 * sb] + x[i].bsums[2 * sb + 1]);
        }
        s += x[i].d * (F16(w[i].d) * (float)isum - F16(w[i].dmin) * (float)msum);
    }
    return s;
}

float strata_vec_dot_q6_K(const void *wv, const void *xv, int64_t n) {
    const block_q6_K *w = wv;
    const block_q8_K *x = xv;
    int64_t nb = n / QKK;
    float s = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int isum = 0;
        for (int g = 0; g < QKK / 16; g++) {
            int acc = 0;
            for (int j = 0; j < 16; j++) acc += (q6k_value(&w[i], g * 16 + j) - 32) * x[i].qs[g * 16 + j];
            isum += w[i].scales[g] * acc;
        }
        s += x[i].d * F16(w[i].d) * (float)isum;
    }
    return s;
}


// --- the other weight types: dequantisation in gguf's order of f32 operations (no fused multiply-adds)

#define EXACT __attribute__((optimize("fp-contract=off")))

// Element j of a 32-block of nibbles: j < 16 the low nibble of qs[j], else the high nibble of qs[j - 16].
static inline int nibble32(const uint8_t *qs, int j) {
    return j < 16 ? qs[j] & 0xf : qs[j - 16] >> 4;
}

EXACT void strata_to_float_q4_1(const void *src, float *y, int64_t n) {
    const block_q4_1 *b = src;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        float d = F16(b[i].d), m = F16(b[i].m);
        for (int j = 0; j < QK; j++) y[j] = d * (float)nibble32(b[i].qs, j) + m;
    }
}

static inline int q5_value(const uint8_t *qs, const uint8_t qh[4], int j) {
    uint32_t h;
    memcpy(&h, qh, 4);
    return nibble32(qs, j) | (int)((h >> j) & 1) << 4;
}

EXACT void strata_to_float_q5_0(const void *src, float *y, int64_t n) {
    const block_q5_0 *b = src;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        float d = F16(b[i].d);
        for (int j = 0; j < QK; j++) y[j] = d * (float)(q5_value(b[i].qs, b[i].qh, j) - 16);
    }
}

EXACT void strata_to_float_q5_1(const void *src, float *y, int64_t n) {
    const block_q5_1 *b = src;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        float d = F16(b[i].d), m = F16(b[i].m);
        for (int j = 0; j < QK; j++) y[j] = d * (float)q5_value(b[i].qs, b[i].qh, j) + m;
    }
}

// Element e of a super-block of 2-bit fields: half e / 128, byte e % 32 of its 32, field (e % 128) / 32.
static inline int q2_field(const uint8_t *qs, int e) {
    return (qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
}

EXACT void strata_to_float_q2_K(const void *src, float *y, int64_t n) {
    const block_q2_K *b = src;
    for (int64_t i = 0; i < n / QKK; i++, y += QKK) {
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        for (int g = 0; g < 16; g++) {
            float dl = d * (float)(b[i].scales[g] & 0xf), ml = dmin * (float)(b[i].scales[g] >> 4);
            for (int k = 0; k < 16; k++) y[16 * g + k] = dl * (float)q2_field(b[i].qs, 16 * g + k) - ml;
        }
    }
}


// Q3_K value e: 2 low bits as Q2_K's, minus 4 unless bit e / 32 of hmask byte e % 32 is set.
static inline int q3k_value(const block_q3_K *b, int e) {
    return q2_field(b->qs, e) - ((b->hmask[e % 32] >> (e / 32)) & 1 ? 0 : 4);
}

EXACT void strata_to_float_q3_K(const void *src, float *y, int64_t n) {
    const block_q3_K *b = src;
    for (int64_t i = 0; i < n / QKK; i++, y += QKK) {
        int8_t sc[16];
        strata_q3k_scales(b[i].scales, sc);
        float d = F16(b[i].d);
        for (int g = 0; g < 16; g++) {
            float dl = d * (float)sc[g];
            for (int k = 0; k < 16; k++) y[16 * g + k] = dl * (float)q3k_value(&b[i], 16 * g + k);
        }
    }
}

// Q5_K value e: Q4_K's nibble (chunk e / 64, low or high by sub-block) and bit e / 32 of qh byte e % 32.
static inline int q5k_value(const block_q5_K *b, int e) {
    return ((b->qs[(e / 64) * 32 + e % 32] >> (4 * ((e / 32) % 2))) & 0xf) | ((b->qh[e % 32] >> (e / 32)) & 1) << 4;
}

EXACT void strata_to_float_q5_K(const void *src, float *y, int64_t n) {
    const block_q5_K *b = src;
    for (int64_t i = 0; i < n / QKK; i++, y += QKK) {
        uint8_t sc[8], m[8];
        q4k_scale_min(b[i].scales, sc, m);
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        for (int s = 0; s < 8; s++) {
            float dl = d * (float)sc[s], ml = dmin * (float)m[s];
            for (int j = 0; j < 32; j++) y[32 * s + j] = dl * (float)q5k_value(&b[i], 32 * s + j) - ml;
        }
    }
}

EXACT void strata_to_float_iq4_nl(const void *src, float *y, int64_t n) {
    const block_iq4_nl *b = src;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        float d = F16(b[i].d);
        for (int j = 0; j < QK; j++) y[j] = d * (float)KVALUES_IQ4NL[nibble32(b[i].qs, j)];
    }
}


EXACT void strata_to_float_iq4_xs(const void *src, float *y, int64_t n) {
    const block_iq4_xs *b = src;
    for (int64_t i = 0; i < n / QKK; i++, y += QKK) {
        float d = F16(b[i].d);
        for (int s = 0; s < 8; s++) {
            float dl = d * (float)strata_iq4xs_scale(&b[i], s);
            for (int j = 0; j < 32; j++) y[32 * s + j] = dl * (float)KVALUES_IQ4NL[nibble32(b[i].qs + 16 * s, j)];
        }
    }
}


EXACT void strata_to_float_mxfp4(const void *src, float *y, int64_t n) {
    const block_mxfp4 *b = src;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        float d = strata_e8m0_half(b[i].e);
        for (int j = 0; j < QK; j++) y[j] = d * (float)KVALUES_MXFP4[nibble32(b[i].qs, j)];
    }
}

// Byte k of a grid entry is element k of its group.
static inline int grid_byte(uint64_t entry, int k) {
    return (int)((entry >> (8 * k)) & 0xff);
}

// sign bit k of an 8-bit pattern: -1.0 or 1.0
static inline float sign_of(unsigned bits, int k) {
    return (bits >> k) & 1 ? -1.0f : 1.0f;
}

EXACT void strata_to_float_iq2_xxs(const void *src, float *y, int64_t n) {
    const block_iq2_xxs *b = src;
    for (int64_t i = 0; i < n / QKK; i++) {
        float d = F16(b[i].d);
        for (int s = 0; s < 8; s++, y += 32) {
            uint32_t aux[2];
            memcpy(aux, b[i].qs + 4 * s, 8);
            float db = d * (0.5f + (float)(aux[1] >> 28)) * 0.25f;
            for (int l = 0; l < 4; l++) {
                uint64_t g = strata_iq2xxs_grid[(aux[0] >> (8 * l)) & 0xff];
                unsigned signs = strata_ksigns_iq2xs[(aux[1] >> (7 * l)) & 127];
                for (int k = 0; k < 8; k++) y[8 * l + k] = db * (float)grid_byte(g, k) * sign_of(signs, k);
            }
        }
    }
}

EXACT void strata_to_float_iq2_xs(const void *src, float *y, int64_t n) {
    const block_iq2_xs *b = src;
    for (int64_t i = 0; i < n / QKK; i++) {
        float d = F16(b[i].d);
        for (int l = 0; l < 32; l++, y += 8) {
            int sc = (b[i].scales[l / 4] >> (4 * ((l / 2) % 2))) & 0xf;
            float db = d * (0.5f + (float)sc) * 0.25f;
            uint64_t g = strata_iq2xs_grid[b[i].qs[l] & 511];
            unsigned signs = strata_ksigns_iq2xs[b[i].qs[l] >> 9];
            for (int k = 0; k < 8; k++) y[k] = db * (float)grid_byte(g, k) * sign_of(signs, k);
        }
    }
}

EXACT void strata_to_float_iq2_s(const void *src, float *y, int64_t n) {
    const block_iq2_s *b = src;
    for (int64_t i = 0; i < n / QKK; i++) {
        float d = F16(b[i].d);
        for (int l = 0; l < 32; l++, y += 8) {
            int sc = (b[i].scales[l / 4] >> (4 * ((l / 2) % 2))) & 0xf;
            float db = d * (0.5f + (float)sc) * 0.25f;
            uint64_t g = strata_iq2s_grid[b[i].qs[l] | ((b[i].qh[l / 4] >> (2 * (l % 4))) & 3) << 8];
            for (int k = 0; k < 8; k++) y[k] = db * (float)grid_byte(g, k) * sign_of(b[i].signs[l], k);
        }
    }
}

EXACT void strata_to_float_iq3_xxs(const void *src, float *y, int64_t n) {
    const block_iq3_xxs *b = src;
    for (int64_t i = 0; i < n / QKK; i++) {
        float d = F16(b[i].d);
        for (int s = 0; s < 8; s++, y += 32) {
            uint32_t aux;
            memcpy(&aux, b[i].aux + 4 * s, 4);
            float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
            for (int l = 0; l < 4; l++) {
                unsigned signs = strata_ksigns_iq2xs[(aux >> (7 * l)) & 127];
                for (int h = 0; h < 2; h++) {
                    uint32_t g = strata_iq3xxs_grid[b[i].qs[8 * s + 2 * l + h]];
                    for (int k = 0; k < 4; k++)
                        y[8 * l + 4 * h + k] = db * (float)grid_byte(g, k) * sign_of(signs, 4 * h + k);
                }
            }
        }
    }
}

EXACT void strata_to_float_iq3_s(const void *src, float *y, int64_t n) {
    const block_iq3_s *b = src;
    for (int64_t i = 0; i < n / QKK; i++) {
        float d = F16(b[i].d);
        for (int s = 0; s < 8; s++) {
            float db = d * (float)(1 + 2 * ((b[i].scales[s / 2] >> (4 * (s % 2))) & 0xf));
            for (int q = 8 * s; q < 8 * s + 8; q++, y += 4) {  // 4-value groups
                uint32_t g = strata_iq3s_grid[b[i].qs[q] | ((b[i].qh[q / 8] >> (q % 8)) & 1) << 8];
                for (int k = 0; k < 4; k++) y[k] = db * (float)grid_byte(g, k) * sign_of(b[i].signs[q / 2], 4 * (q % 2) + k);
            }
        }
    }
}

#define IQ1_DELTA 0.125f

EXACT void strata_to_float_iq1_s(const void *src, float *y, int64_t n) {
    const block_iq1_s *b = src;
    for (int64_t i = 0; i < n / QKK; i++) {
        float d = F16(b[i].d);
        for (int s = 0; s < 8; s++) {
            unsigned qh = b[i].qh[s];
            float dl = d * (float)(2 * ((qh >> 12) & 7) + 1), delta = qh & 0x8000 ? -IQ1_DELTA : IQ1_DELTA;
            for (int l = 0; l < 4; l++, y += 8) {
                uint64_t g = strata_iq1s_grid[b[i].qs[4 * s + l] | ((qh >> (3 * l)) & 7) << 8];
                for (int k = 0; k < 8; k++) y[k] = dl * ((float)(int8_t)grid_byte(g, k) + delta);
            }
        }
    }
}


EXACT void strata_to_float_iq1_m(const void *src, float *y, int64_t n) {
    const block_iq1_m *b = src;
    for (int64_t i = 0; i < n / QKK; i++) {
        uint16_t sc[4];
        memcpy(sc, b[i].scales, 8);
        float d = F16(strata_iq1m_d(&b[i]));
        for (int l = 0; l < 32; l++, y += 8) {  // 8-value groups; a scale per 16 values
            float dl = d * (float)(2 * ((sc[l / 8] >> (3 * ((l / 2) % 4))) & 7) + 1);
            unsigned h = (b[i].qh[l / 2] >> (4 * (l % 2))) & 0xf;
            float delta = h & 8 ? -IQ1_DELTA : IQ1_DELTA;
            uint64_t g = strata_iq1s_grid[b[i].qs[l] | (h & 7) << 8];
            for (int k = 0; k < 8; k++) y[k] = dl * ((float)(int8_t)grid_byte(g, k) + delta);
        }
    }
}

// Their scalar dots dequantise a block of each side and sum in f32: the reference the vector paths fall back to.
#define DOT_BY_DEQUANT(t, xt, BLOCK) \
    float strata_vec_dot_##t(const void *w, const void *x, int64_t n) { \
        float wf[BLOCK], xf[BLOCK], s = 0.0f; \
        for (int64_t i = 0; i < n / BLOCK; i++) { \
            strata_to_float_##t((const block_##t *)w + i, wf, BLOCK); \
            strata_to_float_##xt((const block_##xt *)x + i, xf, BLOCK); \
            for (int j = 0; j < BLOCK; j++) s += wf[j] * xf[j]; \
        } \
        return s; \
    }
DOT_BY_DEQUANT(q4_1, q8_0, QK)
DOT_BY_DEQUANT(q5_0, q8_0, QK)
DOT_BY_DEQUANT(q5_1, q8_0, QK)
DOT_BY_DEQUANT(iq4_nl, q8_0, QK)
DOT_BY_DEQUANT(mxfp4, q8_0, QK)
DOT_BY_DEQUANT(q2_K, q8_K, QKK)
DOT_BY_DEQUANT(q3_K, q8_K, QKK)
DOT_BY_DEQUANT(q5_K, q8_K, QKK)
DOT_BY_DEQUANT(iq4_xs, q8_K, QKK)
DOT_BY_DEQUANT(iq3_s, q8_K, QKK)
DOT_BY_DEQUANT(iq3_xxs, q8_K, QKK)
DOT_BY_DEQUANT(iq2_xxs, q8_K, QKK)
DOT_BY_DEQUANT(iq2_xs, q8_K, QKK)
DOT_BY_DEQUANT(iq2_s, q8_K, QKK)
DOT_BY_DEQUANT(iq1_s, q8_K, QKK)
DOT_BY_DEQUANT(iq1_m, q8_K, QKK)

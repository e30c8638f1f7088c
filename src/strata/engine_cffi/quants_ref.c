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


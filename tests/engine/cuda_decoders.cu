/* cuda_decoders.cu — the CUDA backend's weight decoders and the fast products' arithmetic (engine_cffi/cuda/
 * blocks.cuh) built for the host, so that test_device.py holds them to the gguf package and numpy without a GPU.
 * Usage: cuda_decoders TYPE N_ROWS N ROW_BYTES, with rows of weights then one activation row (n f32) on stdin;
 * writes to stdout, f32: every value as value_at decodes it; every value rebuilt from chunk_at's int8s and scales
 * (d_lo q - m for a chunk's first 16, d_hi q - m for the rest); and each row's product with the activations as
 * the dp4a kernel computes it (activations in act_blocks, chunk_dot per chunk; quantised types only). */
#include <stdio.h>
#include <stdlib.h>
#include <vector>
#include "blocks.cuh"

using namespace strata_cuda;

/* x (n) as act_blocks, as the quantize_acts kernel makes them (its warp's maximum and sum are exact here too). */
static std::vector<act_block> quantize(const float *x, long n) {
    std::vector<act_block> out(n / 32);
    for (long b = 0; b < n / 32; b++) {
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[b * 32 + j]));
        out[b].d = amax / 127.0f;
        for (int j = 0; j < 32; j++) sum += (float)(out[b].q[j] = (int8_t)act_quant(x[b * 32 + j], out[b].d));
        out[b].s = out[b].d * sum;
    }
    return out;
}

template <int T>
static void decode(const uint8_t *rows, long n_rows, long n, size_t row_bytes, const float *x, float *by_value,
                   float *by_chunk, float *y) {
    for (long r = 0; r < n_rows; r++) {
        const uint8_t *row = rows + r * row_bytes;
        for (long i = 0; i < n; i++) by_value[r * n + i] = value_at<T>(row, i);
        if constexpr (T == STRATA_TYPE_F32 || T == STRATA_TYPE_F16 || T == STRATA_TYPE_BF16) {
            for (long i = 0; i < n; i++) by_chunk[r * n + i] = by_value[r * n + i];
        } else {
            std::vector<act_block> xq = quantize(x, n);
            y[r] = 0.0f;
            for (long c = 0; c < n / 32; c++) {
                chunk k = chunk_at<T>(row, c);
                y[r] += chunk_dot(k, xq[c]);
                for (int j = 0; j < 32; j++) {
                    int q = (int8_t)(uint8_t)((uint32_t)k.q[j / 4] >> (8 * (j % 4)));
                    by_chunk[r * n + c * 32 + j] = (j < 16 ? k.d_lo : k.d_hi) * (float)q - k.m;
                }
            }
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 5) return 2;
    int type = atoi(argv[1]);
    long n_rows = atol(argv[2]), n = atol(argv[3]);
    size_t row_bytes = strtoul(argv[4], nullptr, 10);
    std::vector<uint8_t> rows(n_rows * row_bytes);
    std::vector<float> x(n), by_value(n_rows * n), by_chunk(n_rows * n), y(n_rows);
    if (fread(rows.data(), 1, rows.size(), stdin) != rows.size()) return 3;
    if (fread(x.data(), sizeof(float), n, stdin) != (size_t)n) return 3;
    const uint8_t *w = rows.data();
    switch (type) {
    case STRATA_TYPE_F32: decode<STRATA_TYPE_F32>(w, n_rows, n, row_bytes, x.data(), by_value.data(), by_chunk.data(), y.data()); break;
    case STRATA_TYPE_F16: decode<STRATA_TYPE_F16>(w, n_rows, n, row_bytes, x.data(), by_value.data(), by_chunk.data(), y.data()); break;
    case STRATA_TYPE_BF16: decode<STRATA_TYPE_BF16>(w, n_rows, n, row_bytes, x.data(), by_value.data(), by_chunk.data(), y.data()); break;
    case STRATA_TYPE_Q8_0: decode<STRATA_TYPE_Q8_0>(w, n_rows, n, row_bytes, x.data(), by_value.data(), by_chunk.data(), y.data()); break;
    case STRATA_TYPE_Q4_K: decode<STRATA_TYPE_Q4_K>(w, n_rows, n, row_bytes, x.data(), by_value.data(), by_chunk.data(), y.data()); break;
    case STRATA_TYPE_Q5_K: decode<STRATA_TYPE_Q5_K>(w, n_rows, n, row_bytes, x.data(), by_value.data(), by_chunk.data(), y.data()); break;
    case STRATA_TYPE_Q6_K: decode<STRATA_TYPE_Q6_K>(w, n_rows, n, row_bytes, x.data(), by_value.data(), by_chunk.data(), y.data()); break;
    case STRATA_TYPE_IQ4_XS:
        decode<STRATA_TYPE_IQ4_XS>(w, n_rows, n, row_bytes, x.data(), by_value.data(), by_chunk.data(), y.data());
        break;
    case STRATA_TYPE_MXFP4: decode<STRATA_TYPE_MXFP4>(w, n_rows, n, row_bytes, x.data(), by_value.data(), by_chunk.data(), y.data()); break;
    default: return 4;
    }
    fwrite(by_value.data(), sizeof(float), by_value.size(), stdout);
    fwrite(by_chunk.data(), sizeof(float), by_chunk.size(), stdout);
    fwrite(y.data(), sizeof(float), y.size(), stdout);
    return 0;
}

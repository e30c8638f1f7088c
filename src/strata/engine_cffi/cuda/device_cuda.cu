/* device_cuda.cu — the CUDA implementation of the device interface, built by nvcc into libstrata_cuda.so and
 * loaded by device.c with dlopen. Streams are CUDA streams that do not synchronise with the legacy default
 * stream; events are CUDA events; each stream has its own scratch for the products' quantised activations
 * (grown after the stream has drained, so no queued kernel still reads the old one). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cuda_runtime.h>
#include "kernels.cuh"  // and through it strata_engine.h, which has no include guard
#include "device_impl.h"

namespace {

struct cuda_device {
    cudaStream_t streams[STRATA_DEV_MAX_STREAMS];
    cudaEvent_t events[STRATA_DEV_MAX_EVENTS];
    void *scratch[STRATA_DEV_MAX_STREAMS];
    size_t scratch_bytes[STRATA_DEV_MAX_STREAMS];
    strata_dev_backend *be;
};

int fail(cuda_device *c, cudaError_t e, const char *what) {
    snprintf(c->be->err, c->be->err_len, "cuda: %s: %s", what, cudaGetErrorString(e));
    return e == cudaErrorMemoryAllocation ? STRATA_ERR_NOMEM : STRATA_ERR_INVALID_ARG;
}

int check(cuda_device *c, cudaError_t e, const char *what) { return e == cudaSuccess ? STRATA_OK : fail(c, e, what); }

void *cuda_alloc(void *self, size_t bytes) {
    void *p = nullptr;
    return check((cuda_device *)self, cudaMalloc(&p, bytes), "cudaMalloc") ? nullptr : p;
}

void cuda_free(void *self, void *p) {
    (void)self;
    cudaFree(p);
}

int cuda_copy(void *self, int stream, void *dst, const void *src, size_t bytes, int direction) {
    cuda_device *c = (cuda_device *)self;
    cudaMemcpyKind kind = direction == DEV_TO_DEVICE ? cudaMemcpyHostToDevice
                          : direction == DEV_TO_HOST ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
    return check(c, cudaMemcpyAsync(dst, src, bytes, kind, c->streams[stream]), "cudaMemcpyAsync");
}

int cuda_memset(void *self, int stream, void *dst, int value, size_t bytes) {
    cuda_device *c = (cuda_device *)self;
    return check(c, cudaMemsetAsync(dst, value, bytes, c->streams[stream]), "cudaMemsetAsync");
}

int cuda_stream_create(void *self, int stream) {
    cuda_device *c = (cuda_device *)self;
    return check(c, cudaStreamCreateWithFlags(&c->streams[stream], cudaStreamNonBlocking), "cudaStreamCreate");
}

int cuda_stream_sync(void *self, int stream) {
    cuda_device *c = (cuda_device *)self;
    return check(c, cudaStreamSynchronize(c->streams[stream]), "cudaStreamSynchronize");
}

int cuda_event_record(void *self, int event, int stream) {
    cuda_device *c = (cuda_device *)self;
    int status = c->events[event] ? 0 : check(c, cudaEventCreate(&c->events[event]), "cudaEventCreate");
    return status ? status : check(c, cudaEventRecord(c->events[event], c->streams[stream]), "cudaEventRecord");
}

int cuda_wait(void *self, int stream, int event) {
    cuda_device *c = (cuda_device *)self;
    return check(c, cudaStreamWaitEvent(c->streams[stream], c->events[event], 0), "cudaStreamWaitEvent");
}

int cuda_event_sync(void *self, int event) {
    cuda_device *c = (cuda_device *)self;
    return check(c, cudaEventSynchronize(c->events[event]), "cudaEventSynchronize");
}

double cuda_elapsed(void *self, int start, int end) {
    cuda_device *c = (cuda_device *)self;
    float ms = -1.0f;
    return check(c, cudaEventElapsedTime(&ms, c->events[start], c->events[end]), "cudaEventElapsedTime") ? -1.0 : ms;
}

/* The stream's scratch, at least `bytes` of it. */
void *scratch(cuda_device *c, int stream, size_t bytes) {
    if (bytes <= c->scratch_bytes[stream]) return c->scratch[stream];
    if (check(c, cudaStreamSynchronize(c->streams[stream]), "cudaStreamSynchronize")) return nullptr;
    cudaFree(c->scratch[stream]);
    c->scratch[stream] = nullptr;
    c->scratch_bytes[stream] = 0;
    if (check(c, cudaMalloc(&c->scratch[stream], bytes), "cudaMalloc (a product's scratch)")) return nullptr;
    c->scratch_bytes[stream] = bytes;
    return c->scratch[stream];
}

int cuda_launch(void *self, int stream, strata_dev_kernel kernel, int reference, const void *args) {
    namespace k = strata_cuda;
    cuda_device *c = (cuda_device *)self;
    cudaStream_t s = c->streams[stream];
    cudaError_t e = cudaErrorInvalidValue;
    switch (kernel) {
    case DEV_KERNEL_MATMUL: {
        const strata_dev_matmul_args *a = (const strata_dev_matmul_args *)args;
        if (reference) {
            e = k::matmul_ref(a, s);
            break;
        }
        size_t bytes = k::matmul_scratch_bytes(a);
        void *xq = bytes ? scratch(c, stream, bytes) : nullptr;
        if (bytes && !xq) return STRATA_ERR_NOMEM;
        e = k::matmul(a, xq, s);
        break;
    }
    case DEV_KERNEL_RMS_NORM: {
        auto a = (const strata_dev_rms_norm_args *)args;
        e = reference ? k::rms_norm_ref(a, s) : k::rms_norm(a, s);
        break;
    }
    case DEV_KERNEL_ROPE: {
        auto a = (const strata_dev_rope_args *)args;
        e = reference ? k::rope_ref(a, s) : k::rope(a, s);
        break;
    }
    case DEV_KERNEL_ATTENTION: {
        auto a = (const strata_dev_attention_args *)args;
        e = reference ? k::attention_ref(a, s) : k::attention(a, s);
        break;
    }
    case DEV_KERNEL_SWIGLU: {
        auto a = (const strata_dev_swiglu_args *)args;
        e = reference ? k::swiglu_ref(a, s) : k::swiglu(a, s);
        break;
    }
    case DEV_KERNEL_TOPK: {
        auto a = (const strata_dev_topk_args *)args;
        e = reference ? k::topk_ref(a, s) : k::topk(a, s);
        break;
    }
    case DEV_KERNEL_ADD_ROWS: {
        auto a = (const strata_dev_add_rows_args *)args;
        e = reference ? k::add_rows_ref(a, s) : k::add_rows(a, s);
        break;
    }
    case DEV_KERNEL_KV_STORE: {
        auto a = (const strata_dev_kv_store_args *)args;
        e = reference ? k::kv_store_ref(a, s) : k::kv_store(a, s);
        break;
    }
    case DEV_KERNEL_DN_CONV: {
        auto a = (const strata_dev_dn_conv_args *)args;
        e = reference ? k::dn_conv_ref(a, s) : k::dn_conv(a, s);
        break;
    }
    case DEV_KERNEL_L2_NORM: {
        auto a = (const strata_dev_l2_norm_args *)args;
        e = reference ? k::l2_norm_ref(a, s) : k::l2_norm(a, s);
        break;
    }
    case DEV_KERNEL_DN_GATES: {
        auto a = (const strata_dev_dn_gates_args *)args;
        e = reference ? k::dn_gates_ref(a, s) : k::dn_gates(a, s);
        break;
    }
    case DEV_KERNEL_DELTA_RULE: {
        auto a = (const strata_dev_delta_rule_args *)args;
        e = reference ? k::delta_rule_ref(a, s) : k::delta_rule(a, s);
        break;
    }
    case DEV_KERNEL_DELTA_RULE_CHUNKED: {
        auto a = (const strata_dev_delta_rule_args *)args;
        e = reference ? k::delta_rule_chunked_ref(a, s) : k::delta_rule_chunked(a, s);
        break;
    }
    case DEV_KERNEL_GATED_RMS_NORM: {
        auto a = (const strata_dev_gated_rms_norm_args *)args;
        e = reference ? k::gated_rms_norm_ref(a, s) : k::gated_rms_norm(a, s);
        break;
    }
    case DEV_KERNEL_SIGMOID_GATE: {
        auto a = (const strata_dev_sigmoid_gate_args *)args;
        e = reference ? k::sigmoid_gate_ref(a, s) : k::sigmoid_gate(a, s);
        break;
    }
    case DEV_KERNEL_LAYER_NORM: {
        auto a = (const strata_dev_layer_norm_args *)args;
        e = reference ? k::layer_norm_ref(a, s) : k::layer_norm(a, s);
        break;
    }
    case DEV_KERNEL_GELU: {
        auto a = (const strata_dev_gelu_args *)args;
        e = reference ? k::gelu_ref(a, s) : k::gelu(a, s);
        break;
    }
    case DEV_KERNEL_VIT_ATTENTION: {
        auto a = (const strata_dev_vit_attention_args *)args;
        e = reference ? k::vit_attention_ref(a, s) : k::vit_attention(a, s);
        break;
    }
    case DEV_KERNEL_MOE_GROUP: {
        auto a = (const strata_dev_moe_group_args *)args;
        e = reference ? k::moe_group_ref(a, s) : k::moe_group(a, s);
        break;
    }
    case DEV_KERNEL_MOE_MATMUL: {
        auto a = (const strata_dev_moe_matmul_args *)args;
        if (reference) {
            e = k::moe_matmul_ref(a, s);
            break;
        }
        size_t bytes = k::moe_matmul_scratch_bytes(a);
        void *xq = bytes ? scratch(c, stream, bytes) : nullptr;
        if (bytes && !xq) return STRATA_ERR_NOMEM;
        e = k::moe_matmul(a, xq, s);
        break;
    }
    default: break;
    }
    return check(c, e, "kernel launch");
}

void cuda_close(void *self) {
    cuda_device *c = (cuda_device *)self;
    cudaDeviceSynchronize();
    for (int i = 0; i < STRATA_DEV_MAX_STREAMS; i++) {
        if (c->streams[i]) cudaStreamDestroy(c->streams[i]);
        cudaFree(c->scratch[i]);
    }
    for (int i = 0; i < STRATA_DEV_MAX_EVENTS; i++)
        if (c->events[i]) cudaEventDestroy(c->events[i]);
    delete c;
}

}  // namespace

/* Bandwidth in bytes per second: the memory clock (kHz, double data rate) times the bus width. */
static double bandwidth(int dev) {
    int clock_khz = 0, bus_bits = 0;
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev);
    cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev);
    return 2.0 * clock_khz * 1e3 * (bus_bits / 8.0);
}

extern "C" __attribute__((visibility("default"))) int strata_cuda_backend_open(strata_dev_backend *b, char *err, size_t err_len) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        snprintf(err, err_len, "cuda: no usable GPU (%s)", e != cudaSuccess ? cudaGetErrorString(e) : "none found");
        return STRATA_ERR_UNSUPPORTED;
    }
    cudaDeviceProp prop;
    size_t free_mem = 0, total = 0;
    if ((e = cudaGetDeviceProperties(&prop, 0)) != cudaSuccess || (e = cudaMemGetInfo(&free_mem, &total)) != cudaSuccess) {
        snprintf(err, err_len, "cuda: %s", cudaGetErrorString(e));
        return STRATA_ERR_UNSUPPORTED;
    }
    cuda_device *c = new cuda_device();
    *b = strata_dev_backend{};
    c->be = b;
    b->err = err;  // until device.c sets its own
    b->err_len = err_len;
    if (cuda_stream_create(c, 0)) {
        delete c;
        return STRATA_ERR_UNSUPPORTED;
    }
    b->self = c;
    snprintf(b->name, sizeof b->name, "%s (sm_%d%d)", prop.name, prop.major, prop.minor);
    b->bandwidth = bandwidth(0);
    b->free_memory = free_mem;
    b->alloc = cuda_alloc;
    b->free = cuda_free;
    b->copy = cuda_copy;
    b->memset = cuda_memset;
    b->stream_create = cuda_stream_create;
    b->stream_sync = cuda_stream_sync;
    b->event_record = cuda_event_record;
    b->stream_wait_event = cuda_wait;
    b->event_sync = cuda_event_sync;
    b->event_elapsed_ms = cuda_elapsed;
    b->launch = cuda_launch;
    b->close = cuda_close;
    return STRATA_OK;
}

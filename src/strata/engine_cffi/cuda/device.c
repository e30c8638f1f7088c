/* device.c — the device interface (device.h): checks its rules and keeps its accounts (memory against the
 * budget, streams, recorded events), then calls the implementation: the host one, or the CUDA library loaded
 * with dlopen when "cuda" is asked for. */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "../kernels.h"
#include "device_impl.h"

typedef struct {
    void *p;
    size_t bytes;
} allocation;

struct strata_device {
    strata_dev_backend be;
    void *library;                         /* the CUDA library's handle, NULL for the host */
    size_t budget, used;
    allocation *allocs;                    // (n_allocs,) live allocations
    int n_allocs, cap_allocs;
    int n_streams;                         /* streams 0 .. n_streams - 1 exist */
    int n_events;                          /* events 0 .. n_events - 1 were recorded */
    int *journal, n_journal, cap_journal;  // (what, stream, event) of each ordering call, while kept
    int journal_lost;                      /* entries the journal had no room for */
    int time_work;                         /* whether the work calls are timed, into work */
    double work[3];                        /* their wall and calling thread's CPU seconds, and how many */
    char err[256];
};

static const char *const KERNEL_NAMES[DEV_N_KERNELS] = {"matmul", "rms_norm", "rope", "attention", "swiglu",
                                                        "topk", "add_rows", "kv_store", "dn_conv", "l2_norm",
                                                        "dn_gates", "delta_rule", "delta_rule_chunked",
                                                        "gated_rms_norm", "sigmoid_gate", "layer_norm", "gelu",
                                                        "vit_attention", "moe_group", "moe_matmul"};

static int fail(strata_device *d, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->err, sizeof d->err, fmt, ap);
    va_end(ap);
    return status;
}

// --- open and close

static int open_cuda(strata_device *d, const char *library, char *err, size_t err_len) {
    if (!library) {
        snprintf(err, err_len, "cuda: no CUDA library was built (nvcc was not found at build time)");
        return STRATA_ERR_UNSUPPORTED;
    }
    d->library = dlopen(library, RTLD_NOW | RTLD_LOCAL);
    if (!d->library) {
        snprintf(err, err_len, "cuda: cannot load %s: %s", library, dlerror());
        return STRATA_ERR_UNSUPPORTED;
    }
    strata_cuda_open_fn open = (strata_cuda_open_fn)dlsym(d->library, "strata_cuda_backend_open");
    if (!open) {
        snprintf(err, err_len, "cuda: %s has no strata_cuda_backend_open", library);
        return STRATA_ERR_UNSUPPORTED;
    }
    return open(&d->be, err, err_len);
}

strata_device *strata_dev_open(const char *kind, const char *cuda_library, size_t budget, char *err,
                               size_t err_len) {
    strata_device *d = calloc(1, sizeof *d);
    if (!d) {
        snprintf(err, err_len, "out of memory");
        return NULL;
    }
    int status;
    if (strcmp(kind, "host") == 0) status = strata_host_backend_open(&d->be, err, err_len);
    else if (strcmp(kind, "cuda") == 0) status = open_cuda(d, cuda_library, err, err_len);
    else status = (snprintf(err, err_len, "device kind '%s': expected host or cuda", kind), STRATA_ERR_INVALID_ARG);
    if (status == STRATA_OK && budget == 0) budget = d->be.free_memory ? d->be.free_memory : SIZE_MAX;
    if (status == STRATA_OK && d->be.free_memory && budget > d->be.free_memory) {
        snprintf(err, err_len, "budget %zu bytes is more than the device's free %zu", budget, d->be.free_memory);
        d->be.close(d->be.self);
        status = STRATA_ERR_INVALID_ARG;
    }
    if (status != STRATA_OK) {
        if (d->library) dlclose(d->library);
        free(d);
        return NULL;
    }
    d->be.err = d->err;
    d->be.err_len = sizeof d->err;
    d->budget = budget;
    d->n_streams = 1;
    return d;
}

void strata_dev_close(strata_device *d) {
    if (!d) return;
    free(d->journal);
    for (int i = 0; i < d->n_allocs; i++) d->be.free(d->be.self, d->allocs[i].p);
    d->be.close(d->be.self);
    if (d->library) dlclose(d->library);
    free(d->allocs);
    free(d);
}

const char *strata_dev_error(const strata_device *d) { return d->err; }
void strata_dev_set_error(strata_device *d, const char *reason) { snprintf(d->err, sizeof d->err, "%s", reason); }

// --- the journal of ordering calls, and the work clock (for tests and benchmarks)

int strata_dev_journal(strata_device *d, int capacity) {
    free(d->journal);
    d->journal = NULL, d->n_journal = d->cap_journal = d->journal_lost = 0;
    if (capacity <= 0) return STRATA_OK;
    if (!(d->journal = malloc(sizeof(int) * 3 * (size_t)capacity)))
        return fail(d, STRATA_ERR_NOMEM, "a journal of %d entries", capacity);
    d->cap_journal = capacity;
    return STRATA_OK;
}

int strata_dev_journal_take(strata_device *d, int *out, int capacity) {
    int n = d->n_journal, lost = d->journal_lost || n > capacity;
    memcpy(out, d->journal, sizeof(int) * 3 * (size_t)(n < capacity ? n : capacity));
    d->n_journal = d->journal_lost = 0;
    return lost ? -1 : n;
}

static void journal(strata_device *d, int what, int stream, int event) {
    if (!d->journal) return;
    if (d->n_journal == d->cap_journal) {
        d->journal_lost++;
        return;
    }
    int *at = d->journal + 3 * d->n_journal++;
    at[0] = what, at[1] = stream, at[2] = event;
}

static double clock_seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void strata_dev_time_work(strata_device *d, int on) { d->time_work = on; }
void strata_dev_work_seconds(const strata_device *d, double *work) { memcpy(work, d->work, sizeof d->work); }

strata_dev_clock strata_dev_work_started(const strata_device *d) {
    if (!d->time_work) return (strata_dev_clock){0.0, 0.0};
    return (strata_dev_clock){clock_seconds(CLOCK_MONOTONIC), clock_seconds(CLOCK_THREAD_CPUTIME_ID)};
}

int strata_dev_work_done(strata_device *d, strata_dev_clock started, int status) {
    if (d->time_work) {
        d->work[1] += clock_seconds(CLOCK_THREAD_CPUTIME_ID) - started.cpu;
        d->work[0] += clock_seconds(CLOCK_MONOTONIC) - started.wall;
        d->work[2]++;
    }
    return status;
}
const char *strata_dev_name(const strata_device *d) { return d->be.name; }
double strata_dev_bandwidth(const strata_device *d) { return d->be.bandwidth; }

// --- memory

void *strata_dev_alloc(strata_device *d, size_t bytes) {
    if (bytes == 0 || bytes > d->budget - d->used) {
        fail(d, STRATA_ERR_NOMEM, "allocating %zu bytes: %zu of the budget's %zu are in use", bytes, d->used,
             d->budget);
        return NULL;
    }
    if (d->n_allocs == d->cap_allocs) {
        int cap = d->cap_allocs ? 2 * d->cap_allocs : 64;
        allocation *a = realloc(d->allocs, sizeof *a * cap);
        if (!a) return fail(d, STRATA_ERR_NOMEM, "out of host memory"), NULL;
        d->allocs = a;
        d->cap_allocs = cap;
    }
    void *p = d->be.alloc(d->be.self, bytes);
    if (!p) return fail(d, STRATA_ERR_NOMEM, "the device could not allocate %zu bytes", bytes), NULL;
    d->allocs[d->n_allocs++] = (allocation){p, bytes};
    d->used += bytes;
    return p;
}

int strata_dev_free(strata_device *d, void *p) {
    for (int i = 0; i < d->n_allocs; i++)
        if (d->allocs[i].p == p) {
            d->be.free(d->be.self, p);
            d->used -= d->allocs[i].bytes;
            d->allocs[i] = d->allocs[--d->n_allocs];
            return STRATA_OK;
        }
    return fail(d, STRATA_ERR_INVALID_ARG, "freeing %p, which this device did not allocate (or freed already)", p);
}

size_t strata_dev_used(const strata_device *d) { return d->used; }
size_t strata_dev_budget(const strata_device *d) { return d->budget; }

/* Whether [p, p + bytes) lies inside one live allocation. */
static int owned(const strata_device *d, const void *p, size_t bytes) {
    for (int i = 0; i < d->n_allocs; i++) {
        const char *a = d->allocs[i].p, *q = p;
        if (q >= a && q <= a + d->allocs[i].bytes && bytes <= d->allocs[i].bytes - (size_t)(q - a)) return 1;
    }
    return 0;
}

static int check_stream(strata_device *d, int stream) {
    if (stream < 0 || stream >= d->n_streams)
        return fail(d, STRATA_ERR_INVALID_ARG, "stream %d does not exist (%d streams)", stream, d->n_streams);
    return STRATA_OK;
}

static int copy(strata_device *d, int stream, void *dst, const void *src, size_t bytes, int direction) {
    int status = check_stream(d, stream);
    if (status) return status;
    const void *dev = direction == DEV_TO_DEVICE ? dst : src;
    if (!owned(d, dev, bytes))
        return fail(d, STRATA_ERR_INVALID_ARG, "%zu bytes at %p are not inside one allocation of this device",
                    bytes, dev);
    if (direction == DEV_ON_DEVICE && !owned(d, dst, bytes))
        return fail(d, STRATA_ERR_INVALID_ARG, "%zu bytes at %p are not inside one allocation of this device",
                    bytes, dst);
    if (direction == DEV_ON_DEVICE && (const char *)dst < (const char *)src + bytes &&
        (const char *)src < (const char *)dst + bytes)
        return fail(d, STRATA_ERR_INVALID_ARG, "a copy of %zu bytes from %p to %p overlaps itself", bytes, src, dst);
    strata_dev_clock started = strata_dev_work_started(d);
    return strata_dev_work_done(d, started, d->be.copy(d->be.self, stream, dst, src, bytes, direction));
}

int strata_dev_copy(strata_device *d, int stream, void *dst, const void *src, size_t bytes) {
    return copy(d, stream, dst, src, bytes, DEV_ON_DEVICE);
}

int strata_dev_upload(strata_device *d, int stream, void *dst, const void *src, size_t bytes) {
    return copy(d, stream, dst, src, bytes, DEV_TO_DEVICE);
}

int strata_dev_upload_rows(strata_device *d, int stream, void *dst, const void *src, size_t row_bytes, int n,
                           const int *first, const int *count) {
    if (n < 0 || (n > 0 && (!first || !count)))
        return fail(d, STRATA_ERR_INVALID_ARG, "upload_rows: %d runs", n);
    for (int i = 0; i < n; i++) {
        if (first[i] < 0 || count[i] < 0)
            return fail(d, STRATA_ERR_INVALID_ARG, "upload_rows: run %d of %d: rows %d + %d", i, n, first[i], count[i]);
        size_t at = (size_t)first[i] * row_bytes;
        int status = strata_dev_upload(d, stream, (char *)dst + at, (const char *)src + at,
                                       (size_t)count[i] * row_bytes);
        if (status) return status;
    }
    return 0;
}

int strata_dev_upload_expert(strata_device *d, int stream, void *dst, const strata_host_layer_experts *layer,
                             int expert) {
    if (!layer || expert < 0) return fail(d, STRATA_ERR_INVALID_ARG, "upload_expert: expert %d", expert);
    const char *from[3] = {layer->gate, layer->up, layer->down};
    size_t bytes[3] = {layer->gate_bytes, layer->up_bytes, layer->down_bytes};
    char *at = dst;
    for (int which = 0; which < 3; which++) {
        int status = strata_dev_upload(d, stream, at, from[which] + (size_t)expert * bytes[which], bytes[which]);
        if (status) return status;
        at += bytes[which];
    }
    return 0;
}

int strata_dev_download(strata_device *d, int stream, void *dst, const void *src, size_t bytes) {
    return copy(d, stream, dst, src, bytes, DEV_TO_HOST);
}

int strata_dev_memset(strata_device *d, int stream, void *dst, int value, size_t bytes) {
    int status = check_stream(d, stream);
    if (status) return status;
    if (!owned(d, dst, bytes))
        return fail(d, STRATA_ERR_INVALID_ARG, "%zu bytes at %p are not inside one allocation of this device",
                    bytes, dst);
    strata_dev_clock started = strata_dev_work_started(d);
    return strata_dev_work_done(d, started, d->be.memset(d->be.self, stream, dst, value, bytes));
}

// --- streams and events

int strata_dev_stream_create(strata_device *d) {
    if (d->n_streams == STRATA_DEV_MAX_STREAMS)
        return fail(d, STRATA_ERR_INVALID_ARG, "no more than %d streams", STRATA_DEV_MAX_STREAMS), -1;
    if (d->be.stream_create(d->be.self, d->n_streams)) return -1;
    return d->n_streams++;
}

int strata_dev_stream_sync(strata_device *d, int stream) {
    int status = check_stream(d, stream);
    if (status) return status;
    journal(d, 3, stream, -1);
    strata_dev_clock started = strata_dev_work_started(d);
    return strata_dev_work_done(d, started, d->be.stream_sync(d->be.self, stream));
}

int strata_dev_event_record(strata_device *d, int stream) {
    if (check_stream(d, stream)) return -1;
    if (d->n_events == STRATA_DEV_MAX_EVENTS)
        return fail(d, STRATA_ERR_INVALID_ARG, "no more than %d events", STRATA_DEV_MAX_EVENTS), -1;
    if (d->be.event_record(d->be.self, d->n_events, stream)) return -1;
    journal(d, 1, stream, d->n_events);
    return d->n_events++;
}

static int check_event(strata_device *d, int event) {
    if (event < 0 || event >= d->n_events)
        return fail(d, STRATA_ERR_INVALID_ARG, "event %d was never recorded", event);
    return STRATA_OK;
}

int strata_dev_event_rerecord(strata_device *d, int stream, int event) {
    int status = check_stream(d, stream);
    if (!status) status = check_event(d, event);
    if (status) return status;
    journal(d, 1, stream, event);
    return d->be.event_record(d->be.self, event, stream);
}

int strata_dev_stream_wait_event(strata_device *d, int stream, int event) {
    int status = check_stream(d, stream);
    if (!status) status = check_event(d, event);
    if (status) return status;
    journal(d, 2, stream, event);
    return d->be.stream_wait_event(d->be.self, stream, event);
}

int strata_dev_event_sync(strata_device *d, int event) {
    int status = check_event(d, event);
    if (status) return status;
    strata_dev_clock started = strata_dev_work_started(d);
    return strata_dev_work_done(d, started, d->be.event_sync(d->be.self, event));
}

double strata_dev_event_elapsed_ms(strata_device *d, int start, int end) {
    if (check_event(d, start) || check_event(d, end)) return -1.0;
    return d->be.event_elapsed_ms(d->be.self, start, end);
}

// --- kernels

/* The weight types the products take (kernels_*.cu has a block decoder for each). */
static const int MATMUL_TYPES[] = {STRATA_TYPE_F32, STRATA_TYPE_F16, STRATA_TYPE_BF16, STRATA_TYPE_Q8_0, STRATA_TYPE_Q4_K,
                                   STRATA_TYPE_Q5_K, STRATA_TYPE_Q6_K, STRATA_TYPE_IQ4_XS, STRATA_TYPE_MXFP4};

static int matmul_type(int type) {
    int known = 0;
    for (size_t i = 0; i < sizeof MATMUL_TYPES / sizeof *MATMUL_TYPES; i++) known |= MATMUL_TYPES[i] == type;
    return known;
}

static int check_matmul(strata_device *d, const strata_dev_matmul_args *a) {
    if (!matmul_type(a->type))
        return fail(d, STRATA_ERR_UNSUPPORTED, "matmul: weight type %d has no device kernel", a->type);
    const strata_type_traits *tr = strata_traits(a->type);
    if (a->n <= 0 || a->n % tr->block_size || a->rows <= 0 || a->n_tok <= 0)
        return fail(d, STRATA_ERR_INVALID_ARG, "matmul: n %lld (a positive multiple of %lld), rows %lld, n_tok %lld",
                    (long long)a->n, (long long)tr->block_size, (long long)a->rows, (long long)a->n_tok);
    size_t packed = tr->block_bytes * (size_t)(a->n / tr->block_size);
    if (a->row_bytes != packed)  // the host's kernels (the CPU engine's) take packed rows
        return fail(d, STRATA_ERR_INVALID_ARG, "matmul: row_bytes %zu, where a row of %lld %s values is %zu",
                    a->row_bytes, (long long)a->n, tr->name, packed);
    return STRATA_OK;
}

/* What the kernels assume of their arguments (the fast attention kernel: whole warps over a head of at most
 * 256 values; the fast top-k: one warp's choices; the convolution: a window of at most 8 in registers; the fast
 * delta rule, both forms: a thread per column of a head's state, held in registers, at most 128). */
static int check_args(strata_device *d, strata_dev_kernel k, const void *args) {
    switch (k) {
    case DEV_KERNEL_MATMUL: return check_matmul(d, args);
    case DEV_KERNEL_ROPE: {
        const strata_dev_rope_args *a = args;
        if (a->head_dim <= 0 || a->head_dim % 2) return fail(d, STRATA_ERR_INVALID_ARG, "rope: head_dim %d is odd", a->head_dim);
        if (a->n_rot < 0 || a->n_rot % 2 || a->n_rot > a->head_dim)
            return fail(d, STRATA_ERR_INVALID_ARG, "rope: n_rot %d (even, at most head_dim %d)", a->n_rot, a->head_dim);
        return STRATA_OK;
    }
    case DEV_KERNEL_ATTENTION: {
        const strata_dev_attention_args *a = args;
        if (a->head_dim % 32 || a->head_dim <= 0 || a->head_dim > 256)
            return fail(d, STRATA_ERR_UNSUPPORTED, "attention: head_dim %d (a multiple of 32 up to 256)", a->head_dim);
        if (a->n_head_kv <= 0 || a->n_head % a->n_head_kv)
            return fail(d, STRATA_ERR_INVALID_ARG, "attention: n_head %d is not a multiple of n_head_kv %d", a->n_head,
                        a->n_head_kv);
        if (a->kv_type < STRATA_KV_F32 || a->kv_type > STRATA_KV_INT8)
            return fail(d, STRATA_ERR_INVALID_ARG, "attention: kv_type %d", a->kv_type);
        return STRATA_OK;
    }
    case DEV_KERNEL_KV_STORE: {
        const strata_dev_kv_store_args *a = args;
        if (a->kv_type < STRATA_KV_F32 || a->kv_type > STRATA_KV_INT8)
            return fail(d, STRATA_ERR_INVALID_ARG, "kv_store: kv_type %d", a->kv_type);
        if (a->head_dim <= 0 || a->il < 0 || a->il >= a->n_layer)
            return fail(d, STRATA_ERR_INVALID_ARG, "kv_store: head_dim %d, layer %d of %d", a->head_dim, a->il,
                        a->n_layer);
        return STRATA_OK;
    }
    case DEV_KERNEL_ADD_ROWS: {
        const strata_dev_add_rows_args *a = args;
        if (a->k < 1) return fail(d, STRATA_ERR_INVALID_ARG, "add_rows: k %d (at least 1)", a->k);
        return STRATA_OK;
    }
    case DEV_KERNEL_TOPK: {
        const strata_dev_topk_args *a = args;
        if (a->k <= 0 || a->k > a->n_expert || a->k > 32)
            return fail(d, STRATA_ERR_INVALID_ARG, "topk: k %d (1 to 32, at most n_expert %d)", a->k, a->n_expert);
        return STRATA_OK;
    }
    case DEV_KERNEL_DN_CONV: {
        const strata_dev_dn_conv_args *a = args;
        if (a->d_conv < 2 || a->d_conv > 8 || a->channels <= 0 || a->n_seq <= 0)
            return fail(d, STRATA_ERR_INVALID_ARG, "dn_conv: d_conv %d (2 to 8), channels %lld, n_seq %d", a->d_conv,
                        (long long)a->channels, a->n_seq);
        if (a->state_stride < a->channels * (a->d_conv - 1))
            return fail(d, STRATA_ERR_INVALID_ARG, "dn_conv: state_stride %lld is less than a conv state's %lld",
                        (long long)a->state_stride, (long long)(a->channels * (a->d_conv - 1)));
        return STRATA_OK;
    }
    case DEV_KERNEL_DELTA_RULE:
    case DEV_KERNEL_DELTA_RULE_CHUNKED: {
        const strata_dev_delta_rule_args *a = args;
        const char *name = KERNEL_NAMES[k];
        if (a->head_dim <= 0 || a->head_dim > 128 || a->n_seq < 0 || a->n_k_heads <= 0 ||
            a->n_v_heads % a->n_k_heads)
            return fail(d, STRATA_ERR_INVALID_ARG,
                        "%s: head_dim %d (up to 128), %d v heads over %d q/k heads, n_seq %d", name, a->head_dim,
                        a->n_v_heads, a->n_k_heads, a->n_seq);
        int64_t width = (int64_t)a->n_v_heads * a->head_dim;
        if (a->row_stride < width || a->state_stride < width * a->head_dim)
            return fail(d, STRATA_ERR_INVALID_ARG, "%s: row_stride %lld, state_stride %lld (at least %lld, %lld)",
                        name, (long long)a->row_stride, (long long)a->state_stride, (long long)width,
                        (long long)(width * a->head_dim));
        return STRATA_OK;
    }
    case DEV_KERNEL_L2_NORM: {
        const strata_dev_l2_norm_args *a = args;
        if (a->head_dim <= 0 || a->row_stride < (int64_t)a->n_head * a->head_dim)
            return fail(d, STRATA_ERR_INVALID_ARG, "l2_norm: %d heads of %d in rows %lld apart", a->n_head,
                        a->head_dim, (long long)a->row_stride);
        return STRATA_OK;
    }
    case DEV_KERNEL_SIGMOID_GATE: {
        const strata_dev_sigmoid_gate_args *a = args;
        if (a->n <= 0 || a->n_rows < 0 || a->gate_stride < (a->per_value ? a->n : 1))
            return fail(d, STRATA_ERR_INVALID_ARG, "sigmoid_gate: n %lld, n_rows %lld, gate_stride %lld (at least %s)",
                        (long long)a->n, (long long)a->n_rows, (long long)a->gate_stride, a->per_value ? "n" : "1");
        return STRATA_OK;
    }
    case DEV_KERNEL_VIT_ATTENTION: {
        const strata_dev_vit_attention_args *a = args;
        if (a->head_dim <= 0 || a->head_dim > 256 || a->n_head <= 0 || a->n_tok <= 0)
            return fail(d, STRATA_ERR_INVALID_ARG, "vit_attention: head_dim %d (up to 256), %d heads, %d tokens",
                        a->head_dim, a->n_head, a->n_tok);
        return STRATA_OK;
    }
    case DEV_KERNEL_MOE_GROUP: {
        const strata_dev_moe_group_args *a = args;
        if (a->n_tok < 1 || a->k < 1 || a->k > a->n_expert || a->n < 1)
            return fail(d, STRATA_ERR_INVALID_ARG, "moe_group: %d tokens choosing %d of %d experts, rows of %lld",
                        a->n_tok, a->k, a->n_expert, (long long)a->n);
        return STRATA_OK;
    }
    case DEV_KERNEL_MOE_MATMUL: {  // each expert's product is a "matmul" of up to n_slots rows
        const strata_dev_moe_matmul_args *a = args;
        if (a->n_expert < 1 || a->max_rows < 1 || a->n_slots < a->max_rows || !a->slots || !a->first || !a->count)
            return fail(d, STRATA_ERR_INVALID_ARG, "moe_matmul: %d experts, at most %lld of %lld rows each, tables %p",
                        a->n_expert, (long long)a->max_rows, (long long)a->n_slots, (const void *)a->slots);
        strata_dev_matmul_args m = {a->type, a->n, a->rows, a->n_slots, a->row_bytes, a->slots, a->x, a->y};
        return check_matmul(d, &m);
    }
    default: return STRATA_OK;
    }
}

/* Whether a launch has no work and is not made: a delta rule over no runs (a chunk's runs all taken by the
 * other form). */
static int no_work(strata_dev_kernel k, const void *args) {
    return (k == DEV_KERNEL_DELTA_RULE || k == DEV_KERNEL_DELTA_RULE_CHUNKED) &&
           ((const strata_dev_delta_rule_args *)args)->n_seq == 0;
}

/* Kernel `name`'s number ("<name>_ref": the same, with *reference set), or -1. */
static int find_kernel(const char *name, int *reference) {
    size_t len = strlen(name);
    *reference = len > 4 && strcmp(name + len - 4, "_ref") == 0;
    for (int k = 0; k < DEV_N_KERNELS; k++)
        if (strlen(KERNEL_NAMES[k]) == len - 4 * *reference && strncmp(KERNEL_NAMES[k], name, len - 4 * *reference) == 0)
            return k;
    return -1;
}

int strata_dev_launch(strata_device *d, int stream, const char *name, const void *args) {
    int status = check_stream(d, stream);
    if (status) return status;
    int reference, k = find_kernel(name, &reference);
    if (k < 0) return fail(d, STRATA_ERR_INVALID_ARG, "no kernel named '%s'", name);
    status = check_args(d, (strata_dev_kernel)k, args);
    if (status || no_work((strata_dev_kernel)k, args)) return status;
    strata_dev_clock started = strata_dev_work_started(d);
    return strata_dev_work_done(d, started, d->be.launch(d->be.self, stream, (strata_dev_kernel)k, reference, args));
}

// --- launch lists and the expert cache's hits (the backend's layer loop: a run of launches queued by one call)

/* d->err prefixed with what failed (the item of a list, the hit of a layer). */
static int fail_in(strata_device *d, int status, const char *what, int i) {
    char reason[sizeof d->err];
    memcpy(reason, d->err, sizeof reason);
    return fail(d, status, "%s %d: %s", what, i, reason);
}

int strata_dev_launch_list(strata_device *d, int stream, const strata_dev_launch_item *items, int n) {
    int status = check_stream(d, stream);
    if (status) return status;
    if (n < 0 || (n > 0 && !items)) return fail(d, STRATA_ERR_INVALID_ARG, "a launch list of %d items", n);
    for (int i = 0; i < n; i++) {  // every item checked before any is queued
        int reference, k = items[i].name ? find_kernel(items[i].name, &reference) : -1;
        if (k < 0)
            return fail(d, STRATA_ERR_INVALID_ARG, "launch list item %d: no kernel named '%s'", i,
                        items[i].name ? items[i].name : "(null)");
        if (!items[i].args) return fail(d, STRATA_ERR_INVALID_ARG, "launch list item %d: no arguments", i);
        status = check_args(d, (strata_dev_kernel)k, items[i].args);
        if (status) return fail_in(d, status, "launch list item", i);
    }
    strata_dev_clock started = strata_dev_work_started(d);
    for (int i = 0; i < n; i++) {
        int reference, k = find_kernel(items[i].name, &reference);
        if (no_work((strata_dev_kernel)k, items[i].args)) continue;
        status = d->be.launch(d->be.self, stream, (strata_dev_kernel)k, reference, items[i].args);
        if (status) return strata_dev_work_done(d, started, fail_in(d, status, "launch list item", i));
    }
    return strata_dev_work_done(d, started, STRATA_OK);
}

/* Hit i's four launches: gate and up products into hb, hb2, their SwiGLU into hb, the down product into y. */
typedef struct {
    strata_dev_matmul_args gate, up, down;
    strata_dev_swiglu_args swiglu;
} expert_launches;

static expert_launches expert_args(const strata_dev_experts_args *a, const void *slot, int first, int count) {
    const strata_type_traits *g = strata_traits(a->gate_type), *u = strata_traits(a->up_type),
                             *w = strata_traits(a->down_type);
    size_t gate_row = g->block_bytes * (size_t)(a->n_embd / g->block_size),
           up_row = u->block_bytes * (size_t)(a->n_embd / u->block_size),
           down_row = w->block_bytes * (size_t)(a->n_ff / w->block_size);
    const char *base = slot;
    const void *up = base + gate_row * a->n_ff, *down = base + (gate_row + up_row) * a->n_ff;
    float *hb = a->hb + (int64_t)first * a->n_ff, *hb2 = a->hb2 + (int64_t)first * a->n_ff;
    return (expert_launches){
        .gate = {a->gate_type, a->n_embd, a->n_ff, count, gate_row, slot, a->x + (int64_t)first * a->n_embd, hb},
        .up = {a->up_type, a->n_embd, a->n_ff, count, up_row, up, a->x + (int64_t)first * a->n_embd, hb2},
        .swiglu = {(int64_t)count * a->n_ff, hb, hb2, hb},
        .down = {a->down_type, a->n_ff, a->n_embd, count, down_row, down, hb, a->y + (int64_t)first * a->n_embd},
    };
}

int strata_dev_launch_experts(strata_device *d, int stream, const strata_dev_experts_args *a, int n_hits,
                              void *const *slot, const int *first, const int *count) {
    int status = check_stream(d, stream);
    if (status) return status;
    if (n_hits < 0 || (n_hits > 0 && (!slot || !first || !count)))
        return fail(d, STRATA_ERR_INVALID_ARG, "launch_experts: %d hits", n_hits);
    if (!matmul_type(a->gate_type) || !matmul_type(a->up_type) || !matmul_type(a->down_type))
        return fail(d, STRATA_ERR_UNSUPPORTED, "launch_experts: weight types %d, %d, %d (one has no device kernel)",
                    a->gate_type, a->up_type, a->down_type);
    for (int i = 0; i < n_hits; i++) {  // every hit checked before any is queued
        if (!slot[i] || first[i] < 0 || count[i] < 1)
            return fail(d, STRATA_ERR_INVALID_ARG, "launch_experts: hit %d: slot %p, rows %d, count %d", i, slot[i],
                        first[i], count[i]);
        expert_launches e = expert_args(a, slot[i], first[i], count[i]);
        if ((status = check_matmul(d, &e.gate)) || (status = check_matmul(d, &e.up)) ||
            (status = check_matmul(d, &e.down)))
            return fail_in(d, status, "launch_experts: hit", i);
    }
    strata_dev_clock started = strata_dev_work_started(d);
    for (int i = 0; i < n_hits; i++) {
        expert_launches e = expert_args(a, slot[i], first[i], count[i]);
        if ((status = d->be.launch(d->be.self, stream, DEV_KERNEL_MATMUL, 0, &e.gate)) ||
            (status = d->be.launch(d->be.self, stream, DEV_KERNEL_MATMUL, 0, &e.up)) ||
            (status = d->be.launch(d->be.self, stream, DEV_KERNEL_SWIGLU, 0, &e.swiglu)) ||
            (status = d->be.launch(d->be.self, stream, DEV_KERNEL_MATMUL, 0, &e.down)))
            return strata_dev_work_done(d, started, fail_in(d, status, "launch_experts: hit", i));
    }
    return strata_dev_work_done(d, started, STRATA_OK);
}

/* device_impl.h — what an implementation of the device interface provides (device.c checks the rules of
 * device.h, then calls these). Shared by the host implementation (C) and the CUDA one (C++ under nvcc). */
#ifndef STRATA_DEVICE_IMPL_H
#define STRATA_DEVICE_IMPL_H
#include "device.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    DEV_KERNEL_MATMUL,
    DEV_KERNEL_RMS_NORM,
    DEV_KERNEL_ROPE,
    DEV_KERNEL_ATTENTION,
    DEV_KERNEL_SWIGLU,
    DEV_KERNEL_TOPK,
    DEV_KERNEL_ADD_ROWS,
    DEV_KERNEL_KV_STORE,
    DEV_KERNEL_DN_CONV,
    DEV_KERNEL_L2_NORM,
    DEV_KERNEL_DN_GATES,
    DEV_KERNEL_DELTA_RULE,
    DEV_KERNEL_DELTA_RULE_CHUNKED,
    DEV_KERNEL_GATED_RMS_NORM,
    DEV_KERNEL_SIGMOID_GATE,
    DEV_KERNEL_LAYER_NORM,
    DEV_KERNEL_GELU,
    DEV_KERNEL_VIT_ATTENTION,
    DEV_KERNEL_MOE_GROUP,
    DEV_KERNEL_MOE_MATMUL,
    DEV_N_KERNELS
} strata_dev_kernel;

enum { DEV_TO_DEVICE, DEV_TO_HOST, DEV_ON_DEVICE };

/* Each call returns 0 or a strata_status, with the reason written into err. Streams and events are the
 * interface's ids, already checked (a stream exists, an event was recorded). */
typedef struct {
    void *self;
    char name[300];
    double bandwidth;      /* bytes per second, 0 unknown */
    size_t free_memory;    /* at open; 0 unknown (no limit) */
    void *(*alloc)(void *self, size_t bytes);
    void (*free)(void *self, void *p);
    int (*copy)(void *self, int stream, void *dst, const void *src, size_t bytes, int direction);
    int (*memset)(void *self, int stream, void *dst, int value, size_t bytes);
    int (*stream_create)(void *self, int stream);
    int (*stream_sync)(void *self, int stream);
    int (*event_record)(void *self, int event, int stream);
    int (*stream_wait_event)(void *self, int stream, int event);
    int (*event_sync)(void *self, int event);
    double (*event_elapsed_ms)(void *self, int start, int end);
    int (*launch)(void *self, int stream, strata_dev_kernel kernel, int reference, const void *args);
    void (*close)(void *self);
    char *err;             /* set by device.c: where the implementation writes its reasons */
    size_t err_len;
} strata_dev_backend;

/* Set d's reason for a failure (what strata_dev_error returns): for the host's side built on the interface. */
void strata_dev_set_error(strata_device *d, const char *reason);
/* The work clock (strata_dev_time_work): a start's wall and thread CPU times (0 when off), and a piece of work
 * done since `started` added to it (returns `status`). */
typedef struct {
    double wall, cpu;
} strata_dev_clock;
strata_dev_clock strata_dev_work_started(const strata_device *d);
int strata_dev_work_done(strata_device *d, strata_dev_clock started, int status);

/* Fill b with an implementation; 0, or a strata_status with the reason in err. */
int strata_host_backend_open(strata_dev_backend *b, char *err, size_t err_len);
/* The CUDA library's one export (looked up with dlsym). */
typedef int (*strata_cuda_open_fn)(strata_dev_backend *b, char *err, size_t err_len);
int strata_cuda_backend_open(strata_dev_backend *b, char *err, size_t err_len);

#ifdef __cplusplus
}
#endif
#endif

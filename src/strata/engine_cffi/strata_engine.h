/* strata_engine.h — the C API of Strata's inference engine.
 * cffi reads this file as its cdef, so it holds plain declarations only: no macros, no includes, no inline code.
 * Every symbol starts with strata_; calls return a strata_status and never exit the process. */

typedef enum {
    STRATA_OK = 0,
    STRATA_ERR_INVALID_ARG = 1,   /* a bad argument from the caller: token out of range, size mismatch, ... */
    STRATA_ERR_UNSUPPORTED = 2,   /* an architecture, tensor type or shape this engine does not implement */
    STRATA_ERR_NOMEM = 3,
    STRATA_ERR_CONTEXT_FULL = 4,  /* the call would write past the context's n_ctx positions */
    STRATA_ABORTED = 5            /* the abort flag was raised during the call */
} strata_status;

const char *strata_status_string(strata_status status);

/* Tensor types. The values are GGML's type ids, so a GGUF tensor's type maps directly. */
enum {
    STRATA_TYPE_F32 = 0,
    STRATA_TYPE_F16 = 1,
    STRATA_TYPE_Q4_0 = 2,
    STRATA_TYPE_Q8_0 = 8,
    STRATA_TYPE_Q4_K = 12,
    STRATA_TYPE_Q6_K = 14,
    STRATA_TYPE_Q8_K = 15,        /* activations only: the partner of the K-quants in dot products */
    STRATA_TYPE_BF16 = 30
};

/* --- kernels: block formats and dot products (also used by tests and the image encoder) */

/* 1 when `type` is a weight type the engine reads. */
int strata_type_supported(int type);
/* Bytes of one row of n elements of `type` (n a multiple of the type's block size), or 0 if unsupported. */
size_t strata_row_bytes(int type, long long n);
/* dst[0..n) = the values of one row of `type`. */
strata_status strata_dequantize_row(int type, const void *src, float *dst, long long n);
/* y (n_tok, n_rows) = x (n_tok, n_cols) @ w^T, w (n_rows, n_cols) of `type`: the fast path, n_threads threads. */
strata_status strata_matmul(int type, const void *w, long long n_rows, long long n_cols,
                            const float *x, long long n_tok, float *y, int n_threads);
/* The same product by the naive reference: dequantise, then sum in double. */
strata_status strata_matmul_naive(int type, const void *w, long long n_rows, long long n_cols,
                                  const float *x, long long n_tok, float *y);

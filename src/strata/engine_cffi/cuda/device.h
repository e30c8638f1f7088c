/* device.h — the device interface the GPU backend is written against: memory, streams and events, and the
 * launch of each kernel by name. Two implementations sit behind it: "cuda" (device_cuda.cu, built by nvcc into
 * its own shared library, loaded with dlopen only when asked for) and "host" (device_host.c: plain memory,
 * synchronous streams, each kernel run by the CPU engine's own C kernel or a C port of the reference kernel).
 *
 * Rules, the same for both implementations (device.c checks them before the implementation sees a call):
 *   - memory: every allocation counts against the budget given at open; one that would pass it fails with
 *     STRATA_ERR_NOMEM and allocates nothing. Freeing a pointer this device did not allocate is an error.
 *   - streams: stream 0 always exists; strata_dev_stream_create adds more (up to STRATA_DEV_MAX_STREAMS). Work on
 *     one stream runs in the order it was queued; work on two streams is unordered unless an event joins them.
 *   - events: strata_dev_event_record marks the point a stream has reached and returns the event's id; a
 *     stream that waits on it (strata_dev_stream_wait_event) runs nothing queued after the wait before that
 *     point. Waiting on an event that was never recorded is an error (it would wait on nothing).
 *   - copies and memsets are queued on a stream like kernels; the host's buffer must stay valid until the
 *     stream is synchronised. A kernel's arguments are read when it is queued.
 * Pointers inside the argument structs are device pointers (host memory on the host device).
 *
 * This header is not part of strata_engine.h: the tests and the check driver reach it through the engine's
 * shared library with their own cdef (its lines without a leading '#'). */
#ifndef STRATA_DEVICE_H
#define STRATA_DEVICE_H
#include <stddef.h>
#include <stdint.h>

#define STRATA_DEV_MAX_STREAMS 8
#define STRATA_DEV_MAX_EVENTS 4096

typedef struct strata_device strata_device;

/* --- kernel arguments (one struct per kernel; the "_ref" name of a kernel takes the same struct) */

/* "matmul": y[t * rows + r] = dot(w row r, x row t). w: rows of `type` (strata weight type) with n elements
 * each, packed (row_bytes: a row's size, checked); x: (n_tok, n) f32; y: (n_tok, rows) f32. F32, F16 and BF16
 * rows meet f32 activations; the quantised types, activations quantised in blocks. */
typedef struct {
    int type;
    int64_t n, rows, n_tok;
    size_t row_bytes;
    const void *w;
    const float *x;
    float *y;
} strata_dev_matmul_args;

/* "rms_norm": out row t = x row t / sqrt(mean(x row t ^ 2) + eps) * w. x, out: (n_tok, n); w: (n,). */
typedef struct {
    int64_t n, n_tok;
    float eps;
    const float *x, *w;
    float *out;
} strata_dev_rms_norm_args;

/* "rope": x (n_tok, n_head, head_dim) turned in place, the first n_rot values of each head (0: all of them; the
 * rest stay as they are: partial RoPE). Pair i turns by the angle pos[3 t + axis[i]] * inv_freq[i]; pairs are
 * (2i, 2i + 1), or with neox (i, i + n_rot / 2). One axis: every axis[i] = 0; multi-section RoPE: axis[i] in
 * {0, 1, 2} (the position's t, h, w component). */
typedef struct {
    int n_tok, n_head, head_dim, neox, n_rot;
    float *x;
    const int *pos;              // (n_tok, 3)
    const float *inv_freq;       // (n_rot / 2,)
    const unsigned char *axis;   // (n_rot / 2,)
} strata_dev_rope_args;

/* "attention": decode attention of n_tok query tokens over their sequences' cached rows, in the CPU engine's
 * layout: k, v (n_seq, n_layer, n_head_kv, n_ctx, head_dim) of kv_type (STRATA_KV_F32, _F16 or _INT8 with
 * k_scale, v_scale (n_seq, n_layer, n_head_kv, n_ctx)). Token t attends to positions [first[t], n_pos[t]) of
 * sequence seq[t] in layer il (first NULL: from 0; the MTP block's window sets it): out (n_tok, n_head,
 * head_dim) = softmax(q . K / sqrt(head_dim)) . V, query head h reading kv head h / (n_head / n_head_kv).
 * 0 <= first[t] < n_pos[t] <= n_ctx (the host device checks it; the card cannot, as they lie in device memory).
 * A prompt chunk's causal attention is the same call, n_pos[t] = position + 1. */
typedef struct {
    int n_tok, n_head, n_head_kv, head_dim, kv_type, n_layer, il, n_ctx;
    const float *q;              // (n_tok, n_head, head_dim)
    const void *k, *v;
    const float *k_scale, *v_scale;
    const int *seq, *n_pos;      // (n_tok,)
    const int *first;            // (n_tok,) or NULL
    float *out;
} strata_dev_attention_args;

/* "swiglu": out = silu(g) * u = g / (1 + e^-g) * u, over n values (out may be g). */
typedef struct {
    int64_t n;
    const float *g, *u;
    float *out;
} strata_dev_swiglu_args;

/* "topk": per token, softmax of its router logits (n_expert), the k most probable in descending order (the
 * lower index wins a tie), their probabilities renormalised to sum to 1. ids, weights: (n_tok, k). */
typedef struct {
    int n_tok, n_expert, k;
    const float *logits;         // (n_tok, n_expert)
    int *ids;
    float *weights;
} strata_dev_topk_args;

/* "add_rows": out row t (n) += sum over j < k of weight[t k + j] * y row idx[t k + j]: a residual (k = 1,
 * idx and weight NULL: y row t, weight 1) or the mixture of a token's k experts (their output rows by slot, the
 * router's weights). out: (n_tok, n); y: rows of n; idx, weight: (n_tok, k) or NULL (row t k + j, weight 1). */
typedef struct {
    int n_tok, k;
    int64_t n;
    const float *y;
    const int *idx;
    const float *weight;
    float *out;
} strata_dev_add_rows_args;

/* "kv_store": the k and v rows of n_tok tokens into layer il of the cache in attention's layout, token t's at
 * position pos[t] of sequence seq[t], converted as the CPU engine stores them: f16 rounded to nearest, int8 with
 * scale = max|row| / 127 and values rounded to nearest even. k_in, v_in: (n_tok, n_head_kv, head_dim) f32. */
typedef struct {
    int n_tok, n_head_kv, head_dim, kv_type, n_layer, il, n_ctx;
    const float *k_in, *v_in;
    void *k, *v;
    float *k_scale, *v_scale;    // int8 only
    const int *seq, *pos;        // (n_tok,)
} strata_dev_kv_store_args;

/* --- Gated DeltaNet (Qwen3.5's recurrent layers; blocks_deltanet.c has the maths). The tokens of a chunk come
 * grouped by sequence: sequence s's are rows seq_first[s] .. seq_first[s + 1] - 1, in order (seq_first:
 * (n_seq + 1,), starting at 0, never decreasing: the host device checks it, the card cannot), and its recurrent
 * state is slot seq[s] (seq: (n_seq,)) of a state array whose slots lie state_stride floats apart (so the CPU
 * engine's layout, a sequence's conv state then its delta-rule state per layer, can be used as it is). */

/* "dn_conv": the short causal convolution. out row t (channels) = silu(sum_j w[ch, j] win[j]) where win is the
 * d_conv last inputs of channel ch up to and including x row t's; a slot's conv state (channels, d_conv - 1)
 * holds, per channel oldest first, the inputs before the chunk, and after it the last d_conv - 1 inputs.
 * x, out: (n_tok, channels); w: (channels, d_conv). */
typedef struct {
    int n_seq, d_conv;
    int64_t channels, state_stride;
    const float *x, *w;
    float *state, *out;
    const int *seq, *seq_first;
} strata_dev_dn_conv_args;

/* "l2_norm": in place, each head of head_dim values x *= scale / sqrt(sum(x^2) + 1e-6): n_head adjacent heads
 * per token, tokens' rows row_stride floats apart (q or k heads inside the convolution's rows). */
typedef struct {
    int n_tok, n_head, head_dim;
    int64_t row_stride;
    float scale;
    float *x;
} strata_dev_l2_norm_args;

/* "dn_gates": each token's gates per v head, in place: alpha -> g = a softplus(alpha + dt_bias) (the decay's log;
 * a < 0), beta -> sigmoid(beta) (the write strength; beta holds the projection b). alpha, beta: (n_tok, n_head);
 * a, dt_bias: (n_head,). softplus(x) is x above 20, as torch's. */
typedef struct {
    int n_tok, n_head;
    float *alpha, *beta;
    const float *a, *dt_bias;
} strata_dev_dn_gates_args;

/* "delta_rule": the gated delta rule per (sequence, v head), heads of head_dim (= d_k = d_v) values, by its
 * recurrent form: for each token in order, on v head h's state S (head_dim x head_dim, row-major, at state +
 * seq[s] state_stride + h head_dim^2), reading q and k head h % n_k_heads:
 *     S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q.
 * q, k, v: token t's q head j at q + t row_stride + j head_dim (k, v likewise); g, beta: (n_tok, n_v_heads);
 * out: (n_tok, n_v_heads, head_dim). A run whose slot seq[s] is negative is skipped (its rows left as they are),
 * so that a chunk's runs can be split between the two forms without moving rows; n_seq 0 is no work (nothing is
 * launched: a chunk whose runs all take the other form).
 * "delta_rule_chunked": the same rule and arguments by the chunked form (blocks_deltanet.c's chunk_step): a run's
 * tokens in chunks of 64, within a chunk the updates from one unit lower-triangular solve and the state read and
 * written once. The same sums in another order: the outputs and state agree with the recurrent form's to float
 * rounding. The CPU engine takes a run by the chunked form where strata_deltanet_chunked(its tokens) says so. */
typedef struct {
    int n_seq, n_k_heads, n_v_heads, head_dim;
    int64_t row_stride, state_stride;
    const float *q, *k, *v, *g, *beta;
    float *state, *out;
    const int *seq, *seq_first;
} strata_dev_delta_rule_args;
typedef strata_dev_delta_rule_args strata_dev_delta_rule_chunked_args;

/* "gated_rms_norm": out row r (n values) = x row r / sqrt(mean(x row r ^ 2) + eps) * w * silu(z row r), over
 * n_rows rows (each token's v heads). x, z, out: (n_rows, n); w: (n,). out may be x. */
typedef struct {
    int64_t n, n_rows;
    float eps;
    const float *x, *z, *w;
    float *out;
} strata_dev_gated_rms_norm_args;

/* --- Qwen3.5's gates (gated attention, the gated shared expert) */

/* "sigmoid_gate": in place, x row r (n values) value i /= 1 + e^-g, g = gate[r gate_stride + i] with per_value
 * (gated attention: each head's output by its gate, which the q projection gives beside the query: n_rows =
 * tokens x heads, gate_stride = 2 head_dim) or gate[r gate_stride] without (one gate a row: the shared expert's
 * output times the sigmoid of its gate's product, gate_stride 1). x: (n_rows, n). */
typedef struct {
    int64_t n, n_rows, gate_stride;
    int per_value;
    const float *gate;
    float *x;
} strata_dev_sigmoid_gate_args;

/* --- a vision encoder's pieces (the ViT of strata-vision --gpu) */

/* "layer_norm": out row t = (x row t - mean) / sqrt(var + eps) * w + b, var the mean of the centred squares.
 * x, out: (n_tok, n); w, b: (n,). out may be x. */
typedef struct {
    int64_t n, n_tok;
    float eps;
    const float *x, *w, *b;
    float *out;
} strata_dev_layer_norm_args;

/* "gelu": out = gelu(x) over n values: with erf set the exact x / 2 (1 + erf(x / sqrt 2)), else the tanh
 * approximation x / 2 (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). out may be x. */
typedef struct {
    int64_t n;
    int erf;
    const float *x;
    float *out;
} strata_dev_gelu_args;

/* "vit_attention": full (non-causal) attention over the n_tok patches of one picture, every token attending to
 * every token: out = softmax(q . K / sqrt(head_dim)) . V per head. q, k, v, out: (n_tok, n_head, head_dim) f32;
 * head_dim at most 256. */
typedef struct {
    int n_tok, n_head, head_dim;
    const float *q, *k, *v;
    float *out;
} strata_dev_vit_attention_args;

/* --- a layer's routed experts on the device, all in one launch each (the expert cache holds every expert) */

/* "moe_group": a chunk's (token, choice) slots grouped by expert, as strata_host_group_slots groups them (experts
 * ascending, each expert's slots in token order). ids: (n_tok, k) experts, each in [0, n_expert) (the host device
 * checks it; the card cannot, as ids lie in device memory). slot_of[t k + j]: slot (t, j)'s place in that order;
 * x_out row i = x row (token of the i-th slot), rows of n floats; first[e], count[e]: the run of expert e's slots
 * in the order (count 0, first where the run would begin, for an expert no token chose). */
typedef struct {
    int n_tok, k, n_expert;
    int64_t n;
    const int *ids;              // (n_tok, k)
    const float *x;              // (n_tok, n)
    float *x_out;                // (n_tok k, n)
    int *slot_of;                // (n_tok k,)
    int *first, *count;          // (n_expert,)
} strata_dev_moe_group_args;

/* "moe_matmul": every expert's "matmul" over its run of rows at once: y rows first[e] .. first[e] + count[e] - 1
 * (rows of `rows`) = the matrix at slots[e] + offset (rows of `type`, n elements each, packed: row_bytes) times
 * the same rows of x (rows of n). slots: (n_expert,) device pointers to the experts' slots (gate, up and down
 * matrices one after another: offset picks one); an expert whose count is 0 is not read (its slot may be NULL).
 * max_rows: the most rows an expert has (the chunk's tokens: a token chooses an expert once); n_slots: x's and
 * y's rows (n_tok k). */
typedef struct {
    int type, n_expert;
    int64_t n, rows, max_rows, n_slots;
    size_t row_bytes, offset;
    const void *const *slots;
    const int *first, *count;    // (n_expert,)
    const float *x;              // (n_slots, n)
    float *y;                    // (n_slots, rows)
} strata_dev_moe_matmul_args;

/* --- the interface. Functions returning int return a strata_status (0: STRATA_OK); on failure
 * strata_dev_error says why. */

/* Open the device `kind` ("host" or "cuda") with `budget` bytes of memory (0: the card's free memory, or
 * unlimited on the host). cuda_library: the path of libstrata_cuda.so (NULL for the host). NULL on failure, with
 * the reason in err (one line). */
strata_device *strata_dev_open(const char *kind, const char *cuda_library, size_t budget, char *err, size_t err_len);
void strata_dev_close(strata_device *d);
const char *strata_dev_error(const strata_device *d);
/* The device's name (the card's, or "host"), its memory bandwidth in bytes per second (0 unknown). */
const char *strata_dev_name(const strata_device *d);
double strata_dev_bandwidth(const strata_device *d);

void *strata_dev_alloc(strata_device *d, size_t bytes);
int strata_dev_free(strata_device *d, void *p);
size_t strata_dev_used(const strata_device *d);
size_t strata_dev_budget(const strata_device *d);

int strata_dev_upload(strata_device *d, int stream, void *dst, const void *src, size_t bytes);
int strata_dev_download(strata_device *d, int stream, void *dst, const void *src, size_t bytes);
int strata_dev_memset(strata_device *d, int stream, void *dst, int value, size_t bytes);
/* A copy between two places of the device (both inside allocations, not overlapping). */
int strata_dev_copy(strata_device *d, int stream, void *dst, const void *src, size_t bytes);

/* A new stream's id (> 0), or -1. */
int strata_dev_stream_create(strata_device *d);
int strata_dev_stream_sync(strata_device *d, int stream);
/* An event marking what `stream` has queued so far: its id (>= 0), or -1. */
int strata_dev_event_record(strata_device *d, int stream);
/* Event `event` (recorded before) moved to what `stream` has queued so far: one event marks a recurring point (each
 * step's uploads) without using up the device's bounded number of them. A wait queued earlier keeps the point it
 * was queued for. */
int strata_dev_event_rerecord(strata_device *d, int stream, int event);
int strata_dev_stream_wait_event(strata_device *d, int stream, int event);
int strata_dev_event_sync(strata_device *d, int event);
/* Wall time between two recorded events in milliseconds (after both completed), or a negative value. */
double strata_dev_event_elapsed_ms(strata_device *d, int start, int end);

/* A journal of the calls that order the streams, for the tests of that order: while one is kept, each record (and
 * re-record), wait and stream synchronisation appends (what, stream, event) (what: 1 record, 2 wait, 3 sync; event
 * -1 for a sync). strata_dev_journal keeps one of up to `capacity` entries (0: none); strata_dev_journal_take moves
 * the entries so far into out (3 ints each, room for `capacity`) and returns how many, or -1 where some were lost
 * (the journal or out was full). */
int strata_dev_journal(strata_device *d, int capacity);
int strata_dev_journal_take(strata_device *d, int *out, int capacity);
/* The work clock, for the benchmarks' split of a step's time between the work and the host's own: while `on`
 * (strata_dev_time_work), each call that does work (a copy, memset, launch or synchronisation, and the CPU's part
 * of a layer's experts: its misses) adds its wall seconds, the calling thread's CPU seconds and 1 to work[0 .. 3)
 * (strata_dev_work_seconds reads them). */
void strata_dev_time_work(strata_device *d, int on);
void strata_dev_work_seconds(const strata_device *d, double *work);

/* Queue kernel `name` (see the argument structs above; "<name>_ref" runs the reference kernel) on `stream`. */
int strata_dev_launch(strata_device *d, int stream, const char *name, const void *args);

/* Runs of rows uploaded in one call: rows first[i] .. first[i] + count[i] - 1 (i < n) of src (host), rows of
 * row_bytes, to the same rows of dst (device) on `stream`, each as strata_dev_upload; the first failure stops it. A
 * layer's misses go into the rows of moe_out its hits do not fill. */
int strata_dev_upload_rows(strata_device *d, int stream, void *dst, const void *src, size_t row_bytes, int n,
                           const int *first, const int *count);

/* --- the host's side of a step: a routed expert computed by the CPU (a miss of the expert cache)
 * y (n_tok, n_embd) = (silu(x Wg^T) * (x Wu^T)) Wd^T for x (n_tok, n_embd) f32 rows, each product the CPU
 * engine's (activations converted per token as the host device's "matmul" does) and the SwiGLU the host device's,
 * so that a miss gives the bits a hit gives on the host device. gate, up: (n_ff, n_embd) rows of their types;
 * down: (n_embd, n_ff). Thread-safe (the caller's threads each take experts); 0 or a strata_status, with the
 * reason in strata_last_error. */
int strata_host_expert_ffn(int gate_type, const void *gate, int up_type, const void *up, int down_type,
                           const void *down, int64_t n_embd, int64_t n_ff, const float *x, int n_tok, float *y);

/* --- launch lists: the GPU backend's layer loop, its argument structs built once and a run of launches queued by
 * one call (each launch is the one strata_dev_launch makes: the same checks, the same implementation's launch) */

/* One launch: a kernel's name as strata_dev_launch takes it, and its argument struct. */
typedef struct {
    const char *name;
    const void *args;
} strata_dev_launch_item;

/* Queue items[0 .. n) on `stream` in order. Every item's name and arguments are checked before any is queued, so a
 * list with a bad item queues nothing; the error names the item. */
int strata_dev_launch_list(strata_device *d, int stream, const strata_dev_launch_item *items, int n);

/* The expert cache's hits of a layer: for hit i, rows first[i] .. first[i] + count[i] - 1 of x (rows of n_embd)
 * through the expert held at slot[i] (its gate, up and down matrices one after another, packed rows of their types:
 * gate and up (n_ff, n_embd), down (n_embd, n_ff)): "matmul" gate into hb and up into hb2 (the same rows, of n_ff),
 * "swiglu" into hb, "matmul" down into the same rows of y. Queued as those four launches a hit, hit by hit; every hit
 * is checked before any is queued. */
typedef struct {
    int gate_type, up_type, down_type;
    int64_t n_embd, n_ff;
    const float *x;
    float *hb, *hb2, *y;
} strata_dev_experts_args;

int strata_dev_launch_experts(strata_device *d, int stream, const strata_dev_experts_args *a, int n_hits,
                              void *const *slot, const int *first, const int *count);

/* The host's side of a layer: a chunk's (token, choice) slots grouped by expert, as blocks.c groups them. ids:
 * (n_tok, k) experts in [0, n_expert). The slots in order of their expert, ascending, each expert's in token order;
 * slot_of[t k + j]: slot (t, j)'s place in that order; x_out row i = x row (token of the i-th slot), rows of n
 * floats; experts[0 .. *m): the distinct experts ascending, first[i], count[i] the run of expert i's slots in the
 * order (each array n_tok k long at most). 0, or a strata_status with the reason in strata_last_error (an id outside
 * [0, n_expert)). */
int strata_host_group_slots(int n_tok, int k, int n_expert, const int *ids, const float *x, int64_t n, float *x_out,
                            int *slot_of, int *experts, int *first, int *count, int *m);

/* A layer's misses on the CPU's threads at once: each expert's rows through strata_host_expert_ffn (its bits), the
 * experts shared out over a pool's threads, the calling thread one of them (no interpreter between them: one call
 * a layer where each miss was a task of a thread pool). x and y: expert i's n_tok rows in and out. */
typedef struct {
    int gate_type, up_type, down_type;
    const void *gate, *up, *down;
    const float *x;
    int n_tok;
    float *y;
} strata_host_expert;

typedef struct strata_pool strata_pool;

/* A pool of n_threads threads (n_threads - 1 workers and the caller of strata_host_experts_ffn), or NULL. */
strata_pool *strata_host_pool_create(int n_threads);
void strata_host_pool_free(strata_pool *pool);
/* Compute experts[0 .. n) (see strata_host_expert_ffn) on the pool; 0, or the first failure's strata_status with
 * its reason in strata_last_error. One caller at a time. */
int strata_host_experts_ffn(strata_pool *pool, int64_t n_embd, int64_t n_ff, const strata_host_expert *experts,
                            int n);

/* A layer's routed experts in host memory (the mapped file): expert e's gate at gate + e * gate_bytes, its up and
 * down likewise. */
typedef struct {
    int gate_type, up_type, down_type;
    const char *gate, *up, *down;
    size_t gate_bytes, up_bytes, down_bytes;
} strata_host_layer_experts;

/* A layer's misses as strata_host_experts_ffn computes them, named by arrays (no struct a miss to fill): miss i is
 * expert experts[i] of `layer` over rows first[i] .. first[i] + count[i] - 1 of x into the same rows of y (rows of
 * n_embd floats). 0, or a strata_status with the reason in strata_last_error. */
int strata_host_layer_misses(strata_pool *pool, int64_t n_embd, int64_t n_ff, const strata_host_layer_experts *layer,
                             int n, const int *experts, const int *first, const int *count, const float *x, float *y);

/* Expert `expert` of `layer` uploaded from host memory into the slot at dst (device): its gate, up and down one after
 * another, three uploads on `stream` (the expert cache's). */
int strata_dev_upload_expert(strata_device *d, int stream, void *dst, const strata_host_layer_experts *layer,
                             int expert);

/* --- the expert cache's host side (expert_cache.c): the slots holding experts in device memory as the policy
 * (strata_engine.h's strata_expert_policy) chooses them, and a layer's routed experts split between the device and
 * the CPU, one call a layer. The rules are expert_slots.py's. Failures return a strata_status with the reason in
 * strata_dev_error. */

struct strata_expert_policy;
typedef struct strata_expert_slots strata_expert_slots;

/* Slots for `capacity` experts of n_layer x n_expert, each of slot_bytes (an expert's gate, up and down one after
 * another), stepped with `policy` (kept by the caller, which frees it after the slots). layers: per layer, where
 * its experts lie on the host (copied: the structs must outlive the slots). Uploads go on upload_stream; the hits'
 * stream, compute_stream, waits for them. uploads_per_step: the budget a step (< 0: no bound); with link_rate > 0
 * (bytes a second), from the first step with misses the budget is what the link moves in the time the last step's
 * misses took, at least min_uploads. prior: n_prior keys (layer n_expert + expert) uploaded now into one
 * allocation, which the policy must hold too. NULL on failure. */
strata_expert_slots *strata_expert_slots_new(strata_device *d, struct strata_expert_policy *policy, int n_layer,
                                             int n_expert, int capacity, size_t slot_bytes,
                                             const strata_host_layer_experts *const *layers, int upload_stream,
                                             int compute_stream, double uploads_per_step, double link_rate,
                                             double min_uploads, const int *prior, int n_prior);
/* Frees the host's side (the slots' memory is the device's, freed when it closes). */
void strata_expert_slots_free(strata_expert_slots *s);
/* A step begins: the uploads queued so far are marked by the event, and the policy's step begins with the
 * budget, which goes to *uploads_per_step (may be NULL). */
int strata_expert_slots_begin_step(strata_expert_slots *s, double *uploads_per_step);
/* The layer needs experts[0 .. n) (distinct): the policy's hits, misses, uploads and evictions (keys) into out[0 ..
 * 4) (each room for n_expert; out NULL: the slots' own) and their lengths into counts (4; NULL: the slots' own);
 * the compute stream made to wait before the first hit of an expert still arriving; evicted slots freed for reuse;
 * the uploads queued. */
int strata_expert_slots_step(strata_expert_slots *s, int layer, const int *experts, int n, int *const *out,
                             int *counts);
/* The misses of this step kept the CPU busy for `seconds` more (what paces the next step's budget). */
void strata_expert_slots_took(strata_expert_slots *s, double seconds);
/* Each expert's slot address by layer n_expert + expert, 0 where it is not held (n_layer n_expert values). */
const uint64_t *strata_expert_slots_table(const strata_expert_slots *s);
/* hits, misses, uploads counted so far (3 values). */
void strata_expert_slots_counts(const strata_expert_slots *s, long long *counts);

/* A layer's routed experts where the cache holds some: built once a layer, pointers that never change. */
typedef struct {
    int layer;                                 // its layer in the slots; -1: none cached (every expert a miss)
    int n_expert, k, stream;
    int64_t n_embd, n_ff;
    const int *ids;                            // device: the top-k's ids (n_tok, k)
    const float *xb;                           // device: the normed rows (n_tok, n_embd)
    float *slot_x, *moe_out;                   // device: rows by slot (n_tok k, n_embd), in and out
    int *slot_of;                              // device: each slot's place in the grouped order (n_tok k,)
    const strata_dev_experts_args *hits;       // the hits' launches (x slot_x, y moe_out)
    const strata_host_layer_experts *experts;  // where the layer's experts lie on the host
    strata_pool *pool;                         // the misses' threads
    int *host_ids, *host_slot_of, *host_experts, *host_first, *host_count;  // host buffers, n_batch k each
    float *host_xb, *host_slot_x, *host_miss_y;                            // (n_batch, n_embd), (n_batch k, n_embd) x 2
} strata_moe_layer;

/* Layer L's experts for n_tok tokens, after its top-k was queued: the ids and normed rows read back (the one
 * synchronisation: record, if not NULL, gets the ids), the slots grouped by expert and uploaded, the policy stepped
 * (where L->layer >= 0), the hits queued on the device, the misses computed on the pool's threads (their time
 * counted for the pace) and their rows uploaded into moe_out, each slot's place uploaded: what "add_rows" mixes
 * into the residual next. */
int strata_dev_moe_layer(strata_device *d, strata_expert_slots *s, const strata_moe_layer *L, int n_tok,
                         int *record);

/* A step's pass where the cache holds some experts, queued and computed by one call: operations in order, each a
 * launch list (strata_dev_launch_list), a memset to zero or a layer's experts (strata_dev_moe_layer), all on
 * `stream` (a layer's too). records, if not NULL: the i-th experts operation's ids at records + i n_tok k. The first
 * failure stops the pass; its reason names the operation. */
#define STRATA_DEV_OP_LAUNCHES 0
#define STRATA_DEV_OP_MEMSET 1
#define STRATA_DEV_OP_EXPERTS 2
typedef struct {
    int kind;                                  // one of STRATA_DEV_OP_*
    int n;                                     // launches: how many items
    const strata_dev_launch_item *items;
    void *dst;                                 // memset: where, and how many bytes
    size_t bytes;
    const strata_moe_layer *layer;             // experts
} strata_dev_op;

int strata_dev_run_pass(strata_device *d, strata_expert_slots *s, int stream, const strata_dev_op *ops, int n_ops,
                        int n_tok, int *records);

#endif

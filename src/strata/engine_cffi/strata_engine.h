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
    STRATA_TYPE_Q4_1 = 3,
    STRATA_TYPE_Q5_0 = 6,
    STRATA_TYPE_Q5_1 = 7,
    STRATA_TYPE_Q8_0 = 8,
    STRATA_TYPE_Q2_K = 10,
    STRATA_TYPE_Q3_K = 11,
    STRATA_TYPE_Q4_K = 12,
    STRATA_TYPE_Q5_K = 13,
    STRATA_TYPE_Q6_K = 14,
    STRATA_TYPE_Q8_K = 15,        /* activations only: the partner of the K-quants in dot products */
    STRATA_TYPE_IQ2_XXS = 16,
    STRATA_TYPE_IQ2_XS = 17,
    STRATA_TYPE_IQ3_XXS = 18,
    STRATA_TYPE_IQ1_S = 19,
    STRATA_TYPE_IQ4_NL = 20,
    STRATA_TYPE_IQ3_S = 21,
    STRATA_TYPE_IQ2_S = 22,
    STRATA_TYPE_IQ4_XS = 23,
    STRATA_TYPE_IQ1_M = 29,
    STRATA_TYPE_BF16 = 30,
    STRATA_TYPE_MXFP4 = 39
};

/* --- sampling */

typedef struct {
    float temperature;  /* > 0: divides the logits, in f32 */
    int top_k;          /* keep the k most likely tokens; 0 (or k >= n): off */
    double top_p;       /* in (0, 1]: keep the most likely tokens until their probability reaches it; 1: off */
    double min_p;       /* in [0, 1]: keep tokens at least this fraction of the most likely one's probability */
} strata_sampling;

/* The index of the token drawn from logits[0..n) under `s` by u in [0, 1): the kept tokens in id order, the first
 * whose running probability passes u (the candidates are strata.text.sampling's numpy pipeline's). work: n floats,
 * idx: n ints of scratch. -1: n <= 0, a temperature not above 0, or no memory. */
int strata_sample(const float *logits, int n, const strata_sampling *s, double u, float *work, int *idx);
/* numpy's arg-max of x[0..n): the index of the first NaN if there is one, else of the first largest value. */
int strata_argmax(const float *x, int n);

/* --- kernels: block formats and dot products (also used by tests and the image encoder) */

/* 1 when `type` is a weight type the engine reads. */
int strata_type_supported(int type);
/* Bytes of one row of n elements of `type` (n a multiple of the type's block size), or 0 if unsupported. */
size_t strata_row_bytes(int type, long long n);
/* dst[0..n) = the values of one row of `type`. */
strata_status strata_dequantize_row(int type, const void *src, float *dst, long long n);
/* out (n_ids, n_cols) = rows ids[0..n_ids) of the table w (n_rows, n_cols) of `type` (rows strata_row_bytes apart),
 * in f32, each as strata_dequantize_row writes it: a model's token embeddings as its forward pass looks them up.
 * INVALID_ARG names an id outside [0, n_rows) (nothing is written then). */
strata_status strata_get_rows(int type, const void *w, long long n_rows, long long n_cols, const int *ids, int n_ids,
                              float *out);
/* y (n_tok, n_rows) = x (n_tok, n_cols) @ w^T, w (n_rows, n_cols) of `type`: the fast path, n_threads threads. */
strata_status strata_matmul(int type, const void *w, long long n_rows, long long n_cols,
                            const float *x, long long n_tok, float *y, int n_threads);
/* The band layout the engine keeps of a Q8_0 output weight (AVX-512 VNNI builds): its bytes for w (n_rows,
 * n_cols), 0 where this build has none for `type` (UNSUPPORTED from the two below); the layout built from w's rows
 * into `bands`; and strata_matmul's product read from it. */
size_t strata_bands_bytes(int type, long long n_rows, long long n_cols);
strata_status strata_bands_prepare(int type, const void *w, long long n_rows, long long n_cols, void *bands);
strata_status strata_matmul_bands(int type, const void *bands, long long n_rows, long long n_cols,
                                  const float *x, long long n_tok, float *y, int n_threads);
/* The least tokens of a product from the bands that the tile unit (AMX) takes, where this build and machine have
 * it (0 where not): fewer take the VNNI tiles, and both give the same bits. min_tokens > 0 sets it first. */
int strata_bands_amx(int min_tokens);
/* The same product by the naive reference: dequantise, then sum in double. */
strata_status strata_matmul_naive(int type, const void *w, long long n_rows, long long n_cols,
                                  const float *x, long long n_tok, float *y);

/* The gated delta rule of the engine's Gated DeltaNet layers, alone (for tests): n_tok tokens of one sequence,
 * q and k (n_tok, n_k_heads, head_dim) as the rule reads them (L2-normed, q also by 1/sqrt(head_dim)), v (n_tok,
 * n_v_heads, head_dim), g (the decay's log) and beta (n_tok, n_v_heads); v head h reads q/k head h % n_k_heads.
 * state (n_v_heads, head_dim, head_dim) is taken on in place; out (n_tok, n_v_heads, head_dim). chunked: 1 for
 * the chunked form (blocks of 64 tokens, as a prompt takes it), 0 for the recurrent form token by token. */
strata_status strata_delta_rule(const float *q, const float *k, const float *v, const float *g, const float *beta,
                                int n_tok, int n_k_heads, int n_v_heads, int head_dim, int chunked, float *state,
                                float *out);
/* Whether the engine takes a sequence's run of n_tok tokens in a chunk by the chunked form (1) or by the recurrent
 * one token by token (0): the rule the device backend follows too. */
int strata_deltanet_chunked(int n_tok);

/* --- engine: a model built from a tensor table, a context (several sequences), the forward pass
 * The caller owns the tensor data (a memory-mapped GGUF file) and must keep it mapped until strata_model_free:
 * the model keeps pointers into it, except for the weights it lays out again (strata_model_prepared_bytes) and
 * those it copies at load (copy_weights, strata_model_copied_bytes): with copy_weights, token_embd is the only
 * tensor it reads where mapped after strata_model_create. */

typedef struct strata_model strata_model;
typedef struct strata_context strata_context;

/* The message of the last failed call on this thread ("" if none). */
const char *strata_last_error(void);

/* One GGUF tensor as the file stores it. */
typedef struct {
    const char *name;      /* GGUF tensor name, with or without ".weight": "blk.3.attn_q.weight" */
    int type;              /* GGML type id */
    int n_dims;            /* 1 to 4 */
    long long ne[4];       /* GGML order: ne[0] is the row length; unused dims are 1 */
    const void *data;      /* the tensor's bytes, rows strata_row_bytes(type, ne[0]) apart */
    long long n_bytes;     /* bytes available at data (checked against the shape) */
} strata_tensor_info;

/* Hyper-parameters, named after the GGUF metadata keys they come from. */
typedef struct {
    const char *arch;          /* general.architecture: "qwen3moe" | "qwen3" | "llama" | "qwen3vl" | "qwen3vlmoe" |
                                * "qwen35" | "qwen35moe" */
    int n_vocab;               /* rows of token_embd */
    int n_ctx_train;           /* {arch}.context_length */
    int n_embd;                /* {arch}.embedding_length */
    int n_layer;               /* {arch}.block_count, less n_nextn: the layers the forward pass runs */
    int n_head;                /* {arch}.attention.head_count */
    int n_head_kv;             /* {arch}.attention.head_count_kv */
    int head_dim;              /* {arch}.attention.key_length (= value_length) */
    int n_ff;                  /* {arch}.feed_forward_length (dense FFN) */
    int n_expert;              /* {arch}.expert_count (0 for dense) */
    int n_expert_used;         /* {arch}.expert_used_count */
    int n_ff_exp;              /* {arch}.expert_feed_forward_length */
    float rope_base;           /* {arch}.rope.freq_base */
    float rms_eps;             /* {arch}.attention.layer_norm_rms_epsilon */
    int rope_sections[4];      /* {arch}.rope.dimension_sections (qwen3vl, qwen3vlmoe): the frequency pairs of the
                                * t, h, w axes of the interleaved multi-axis RoPE, Qwen3-VL's rule (pair i takes h
                                * if i % 3 == 1 and i < 3 h, w if i % 3 == 2 and i < 3 w, else t); the fourth is
                                * unused and must be 0. All 0 (and for every other architecture): one axis. */
    int n_deepstack;           /* {arch}.n_deepstack_layers (qwen3vl, qwen3vlmoe): picture rows carry this many
                                * extra n_embd slices, slice k added to the row's hidden state after layer k */
    int n_rot;                 /* {arch}.rope.dimension_count: the leading dimensions of each head that RoPE turns
                                * (pairs i and i + n_rot / 2 with NEOX); 0: head_dim */
    /* Qwen3.5 / Qwen3.6 (qwen35, qwen35moe): Gated DeltaNet layers between gated attention ones */
    const int *recurrent_layers; /* (n_layer,): 1 for a Gated DeltaNet layer ({arch}.attention.recurrent_layers, or
                                  * all but every {arch}.full_attention_interval-th); NULL for other models */
    int ssm_d_conv;            /* {arch}.ssm.conv_kernel: taps of the short causal convolution */
    int ssm_d_state;           /* {arch}.ssm.state_size: the size of a DeltaNet q, k (and v) head */
    int ssm_n_group;           /* {arch}.ssm.group_count: DeltaNet q/k heads */
    int ssm_dt_rank;           /* {arch}.ssm.time_step_rank: DeltaNet v heads (a multiple of the q/k heads) */
    int ssm_d_inner;           /* {arch}.ssm.inner_size: v heads x v head size */
    int n_ff_shexp;            /* {arch}.expert_shared_feed_forward_length: the MoE's shared expert (0: none) */
    int n_nextn;               /* {arch}.nextn_predict_layers: MTP blocks stored after the n_layer layers */
    const strata_tensor_info *tensors;
    int n_tensors;
    int copy_weights;          /* 1: copy the matrices a decode step reads whole (every layer's, and the output
                                * unless laid out in bands) into memory in huge pages, Q8_0 ones in bands where
                                * the build has them (the same bits); 0: read them where mapped */
    int load_threads;          /* threads that make that copy (at most 1: the caller's alone) */
} strata_model_params;

strata_status strata_model_create(const strata_model_params *params, strata_model **out);
void strata_model_free(strata_model *model);
/* Bytes the model allocates besides the caller's tensors: weights laid out for its kernels at load (the output
 * weight's bands, where the build has them for its type). */
size_t strata_model_prepared_bytes(const strata_model *model);
/* Bytes of the weights copied at load (copy_weights). */
size_t strata_model_copied_bytes(const strata_model *model);

enum {
    STRATA_KV_F32 = 0,
    STRATA_KV_F16 = 1,
    STRATA_KV_INT8 = 2     /* int8 with one f32 scale per (position, kv head) row */
};

typedef struct {
    int n_ctx;             /* positions each sequence holds; at most the model's n_ctx_train */
    int n_seq;             /* sequences (slots) the context holds: its KV cache is n_seq x n_ctx positions */
    int n_batch;           /* tokens per forward: a call's tokens run in chunks of n_batch */
    int n_threads;
    int kv_type;           /* STRATA_KV_* */
    int mtp;               /* 1: the context runs the model's first MTP block for strata_mtp_draft (its own KV rows,
                            * filled for every evaluated pair before a draft reads them; the trunk's recent hidden
                            * states kept); the model must have one */
    int mtp_window;        /* with mtp: 0, the block attends over every pair of each sequence's history (an eval
                            * fills the waiting pairs its kept hidden states would lose); N > 0, over the pairs
                            * filled since its drafts last started, at least the last N: pairs the kept hidden
                            * states lose lapse unfilled, and a draft fills the last N waiting pairs at most
                            * (STRATA_MTP_HISTORY at most) */
} strata_context_params;

/* The model must outlive its contexts. */
strata_status strata_context_create(const strata_model *model, const strata_context_params *params,
                                    strata_context **out);
void strata_context_free(strata_context *ctx);

int strata_n_seq(const strata_context *ctx);
int strata_n_ctx(const strata_context *ctx);
/* Bytes of the KV cache of all sequences (allocated once, at strata_context_create): K and V rows of the
 * attention layers only, for a hybrid model. */
size_t strata_kv_bytes(const strata_context *ctx);
/* Bytes of one sequence's recurrent state: every recurrent layer's convolution rows and delta-rule state, f32
 * (0 for a model without recurrent layers). The context holds one per sequence, allocated with the KV cache. */
size_t strata_state_bytes(const strata_context *ctx);
/* buf (strata_state_bytes) = sequence seq's recurrent state as it is at its n_past. INVALID_ARG where the state is
 * invalid (see strata_keep). */
strata_status strata_state_save(const strata_context *ctx, int seq, void *buf);
/* Sequence seq's recurrent state = buf, which the caller guarantees belongs at its current n_past (after
 * strata_keep or strata_copy_prefix to that n); the state is valid again. */
strata_status strata_state_load(strata_context *ctx, int seq, const void *buf);
/* A checkpoint of sequence seq's recurrent state as it is now, at its n_past: the next eval with its tokens copies
 * each recurrent layer's state to the sequence's spare before changing it (the layer reads it anyway: the copy
 * costs its writes, spread over the layers and threads, against a save's and a load's whole passes), and
 * strata_state_restore, after strata_keep back to that n_past, makes the spare the state again, valid (the two
 * change places: no copy). For a speculative step's rollback. The spares, one state a sequence, are allocated at
 * the first checkpoint (NOMEM where they cannot be). A later checkpoint replaces it; a load, a clear, an import,
 * a copy into the sequence or a drop in that eval ends it. INVALID_ARG where the state is invalid. No-op without
 * recurrent layers. */
strata_status strata_state_checkpoint(strata_context *ctx, int seq);
/* Sequence seq's recurrent state = its checkpoint's, valid; INVALID_ARG where no checkpoint was taken at the
 * position it holds. */
strata_status strata_state_restore(strata_context *ctx, int seq);
/* Positions sequence `seq` holds (-1 for a sequence out of range). */
int strata_n_past(const strata_context *ctx, int seq);
/* Truncate sequence `seq` to its first n positions (n <= its n_past); n = 0 clears it. A recurrent model's state
 * cannot be cut back: n < n_past leaves it invalid, and an eval with tokens of the sequence fails (INVALID_ARG)
 * until strata_state_load or strata_keep(seq, 0), which clears it. */
strata_status strata_keep(strata_context *ctx, int seq, int n);
/* Sequence dst = the first n positions of sequence src (a prompt prefix computed once, used by both). A recurrent
 * model's state goes with it when n = src's n_past; a shorter n leaves dst's state invalid (see strata_keep). */
strata_status strata_copy_prefix(strata_context *ctx, int src, int dst, int n);
/* Raise sequence `seq`'s abort flag (any thread). The call in flight, or the next call that has tokens of `seq`,
 * drops the sequence at its next check (before each layer of a chunk) and lowers the flag; the call's other
 * sequences go on. */
strata_status strata_abort(strata_context *ctx, int seq);
/* Lower the flag, e.g. one raised after the call it meant to stop had already returned. */
strata_status strata_clear_abort(strata_context *ctx, int seq);

/* The tokens of one eval call, of any of the context's sequences, in any order. Each sequence's tokens continue
 * its positions: the first of them is at its n_past, the next at n_past + 1, ... The call's tokens run in chunks
 * of n_batch, each chunk through every layer at once: every weight is read once per chunk for all its sequences,
 * and a MoE layer groups the chunk's tokens by expert whatever their sequence.
 *
 * A position is the token's index in its sequence's cache (its KV row, and what causal attention counts). Its
 * RoPE position is the same number, except with multi-axis RoPE (rope_sections) after a picture: a picture row at
 * (row, column) of its picture's grid takes (t, h, w) = (S, S + row, S + column), S being where the picture
 * starts (the row at (0, 0) starts one: S = what the next text token would take; any other row continues the
 * picture of the position before it), and every other token takes (p, p, p), p = 1 + the largest component of
 * the position before it (0 first). So text after a picture of h x w rows continues at S + max(h, w), as
 * Hugging Face's Qwen3-VL and llama.cpp count. The engine keeps each position's RoPE components with the cache
 * (strata_keep, strata_copy_prefix keep them too). A sequence that never had a row with embd_grid, and every
 * sequence of any other model, has RoPE position = position. */
typedef struct {
    int n_tokens;
    const int *tokens;        /* (n_tokens,) token ids (placeholders where an embedding row replaces them) */
    const int *seq;           /* (n_tokens,) sequence of each token */
    const int *pos;           /* (n_tokens,) position of each token in its sequence */
    const float *embd_rows;   /* (n_embd_rows, n_embd * (1 + n_deepstack)) rows replacing the token embeddings at
                               * embd_index: the embedding, then the model's deepstack slices */
    const int *embd_index;    /* (n_embd_rows,) call indices */
    const int *embd_grid;     /* (n_embd_rows, 2) or NULL: (row, column) of each row in its picture's grid, for
                               * multi-axis RoPE (see above); (-1, -1) or NULL: placed as a text token */
    int n_embd_rows;
    const int *out_index;     /* (n_out,) increasing call indices of the tokens whose logits are wanted */
    int n_out;
    float *logits;            /* (n_out, n_vocab) */
    int *seq_dropped;         /* (n_seq,) or NULL: set to 1 for each sequence an abort dropped */
    int notify_fd;            /* an eventfd the call adds 1 to as it starts, or -1 (none) */
} strata_batch;

/* Evaluate a batch. A sequence whose abort flag is seen is dropped from the rest of the call: its chunks that
 * finished stay in its cache, the rest is not (a recurrent model's dropped sequence is cleared, n_past 0: its
 * state had taken in part of the chunk); its logits rows are undefined. A sequence whose recurrent state is
 * invalid (strata_keep) is refused: INVALID_ARG. Returns STRATA_ABORTED when any
 * sequence was dropped (seq_dropped says which; the others' positions and logits are complete). */
strata_status strata_eval_batch(strata_context *ctx, const strata_batch *batch);

/* Speculative decoding's drafts from the model's MTP block (a context created with mtp): for each of n sequences
 * seqs[i], whose history ends with tokens[i] at position pos[i] (pos[i] - 1 evaluated by an earlier eval, with its
 * hidden state among the last STRATA_MTP_HISTORY positions an eval computed for it), drafts (n, n_draft) = n_draft
 * tokens chained greedily: the block reads the trunk's hidden state at pos[i] - 1 and tokens[i], then its own
 * hidden state and its last draft. -1s for a sequence whose hidden state is not held. logits (n, n_draft,
 * n_vocab), or NULL: each draft's logits. First fills the block's KV rows of the sequences' evaluated pairs that
 * wait (evals fill them lazily: see strata_mtp_counts), all in one pass over its weights (n_batch rows at a
 * time; with mtp_window N, the last N of them, the block's history then starting there); then writes its rows past
 * pos[i] - 2 (scratch until the next fill writes them); pos[i] + n_draft must
 * be at most n_ctx + 1, n at most n_batch and the sequences distinct. An abort raised meanwhile is left for the
 * next eval. */
#define STRATA_MTP_HISTORY 128
strata_status strata_mtp_draft(strata_context *ctx, int n, const int *seqs, const int *pos, const int *tokens,
                               int n_draft, int *drafts, float *logits);

/* How often the MTP block filled its rows. An eval keeps its hidden states and tokens, and fills the pairs (the
 * hidden state at p, the token at p + 1) it completes only where they could not wait: a chunk that would push a
 * waiting pair's hidden state out of the last STRATA_MTP_HISTORY positions kept, or one with embedding rows;
 * strata_mtp_draft fills the rest. So a sequence that drafts nothing costs one batched fill every
 * STRATA_MTP_HISTORY positions, not a block run at every eval; with mtp_window, nothing (its pairs lapse). */
typedef struct {
    long long fill_runs;   /* passes of the block over waiting pairs, each of up to n_batch rows */
    long long pairs;       /* the pairs they filled */
} strata_mtp_counts;

/* The counts since the context was created. */
void strata_mtp_get_counts(const strata_context *ctx, strata_mtp_counts *out);

typedef struct {
    int n_tokens;          /* tokens the last call processed */
    int n_chunks;
    double total_ms;       /* the whole call */
    double output_ms;      /* final norm and output projection */
} strata_timings;

void strata_get_timings(const strata_context *ctx, strata_timings *out);
/* CPU seconds the context's threads have run so far: the calling thread (call it from the thread that evaluates:
 * it runs its share of every call) and the pool's workers. Other threads of the process are not counted. */
double strata_cpu_seconds(const strata_context *ctx);

/* tokens[i] = strata_sample(rows[i], n, &settings[i], u[i], ...) for i < n_rows, or strata_argmax(rows[i], n)
 * where settings[i] has a temperature of 0, the rows shared out among the context's threads (a step's sequences
 * draw at once: each draw reads the whole vocabulary). Call it between evals, from the thread that evaluates. A
 * token of -1: no memory for a top-k draw. */
strata_status strata_sample_rows(strata_context *ctx, int n_rows, const float *const *rows, int n,
                                 const strata_sampling *settings, const double *u, int *tokens);

/* --- routing record: which experts each MoE layer chose, for the expert cache's traces */

/* Record the choices of every MoE layer of the following evals into buf (capacity ints), from its start: one
 * record per (chunk, layer) as the chunk runs, [layer, chunk, n_tok, then n_tok x n_expert_used expert ids], the
 * chunk's tokens in order and each token's experts in the router's order (the most probable first); chunk is the
 * chunk's index within its eval call. The buffer must stay valid until recording is turned off; NULL turns it
 * off (the default: the layers then only test a pointer). Dense models record nothing. */
strata_status strata_record_routing(strata_context *ctx, int *buf, long long capacity);
/* Ints written to the record since strata_record_routing; -1 when a record did not fit (nothing is written
 * after it: set a larger buffer, by the call's tokens, chunks and layers). */
long long strata_routing_used(const strata_context *ctx);

/* --- a sequence's cached positions as bytes (kv_rows.c): what the disk tier under the prefix cache stores */

/* Bytes of one position across every attention layer (a recurrent layer has no rows): K and V rows of each KV head, their int8 scales, and with multi-axis
 * RoPE its (t, next) components. n positions take n times this. */
size_t strata_kv_position_bytes(const strata_context *ctx);
/* Copy positions [first, first + n) of sequence `seq` (all of them held) into buf (n x strata_kv_position_bytes
 * bytes, laid out per layer and KV head: see kv_rows.c). */
strata_status strata_kv_export(strata_context *ctx, int seq, int first, int n, void *buf);
/* Append the n positions in buf, exported with the same n from position `first`, to sequence `seq`, which must
 * hold exactly `first` positions; its n_past becomes first + n. Nothing is computed. A hybrid model's recurrent
 * state is then invalid, as after a cut (strata_keep), until strata_state_load sets the state at first + n. */
strata_status strata_kv_import(strata_context *ctx, int seq, int first, int n, const void *buf);
/* CRC-32C of n bytes, continued from crc (0 to start): the disk tier's checksum of a block. */
uint32_t strata_crc32c(const void *data, size_t n, uint32_t crc);

/* --- the expert cache's replacement policy (expert_policy.c): strata.experts.simulate.AdaptiveLrfuCache's
 * decisions with one budget over every layer, for the GPU backend's steps */

typedef struct strata_expert_policy strata_expert_policy;
/* A cache of `capacity` experts over n_layer x n_expert, one LRFU shadow per half-life (steps), their hits
 * decayed by half every `window` steps, another shadow followed when its hits lead by switch_z standard
 * deviations; it starts holding `prior` (n_prior distinct keys layer * n_expert + expert, at most capacity) and
 * following it. NULL for a bad argument or no memory. */
strata_expert_policy *strata_expert_policy_new(int n_layer, int n_expert, int capacity, const double *half_lives,
                                               int n_half_lives, double window, double switch_z, const int *prior,
                                               int n_prior);
void strata_expert_policy_free(strata_expert_policy *p);
/* The next step begins; it may start uploads_per_step uploads over its layers (< 0: no bound). */
void strata_expert_policy_begin_step(strata_expert_policy *p, double uploads_per_step);
/* The step needs experts[0..n) (any order, repeats allowed) in `layer`: hits and misses (ascending), the misses
 * uploaded (in the order admitted) and the keys they evicted, each array room for n_expert; counts gets the four
 * lengths. INVALID_ARG for a layer or an expert out of range. */
strata_status strata_expert_policy_step(strata_expert_policy *p, int layer, const int *experts, int n,
                                        int *hits, int *misses, int *uploads, int *evictions, int *counts);
/* The shadow followed (0 .. n_half_lives - 1), n_half_lives while the prior is. */
int strata_expert_policy_chosen(const strata_expert_policy *p);
/* The keys held, ascending, into keys (room for n_layer x n_expert); returns how many. */
int strata_expert_policy_held(const strata_expert_policy *p, int *keys);

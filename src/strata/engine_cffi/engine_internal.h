/* engine_internal.h — what the engine's files share, not seen by cffi: a view of a weight, a layer's weights, the
 * model, the context, a thread's part of a job, and the table of architectures (archs.c). The files: engine.c
 * (context, batch step, public API), model_load.c (tensor table, hyper-parameters, weight copy, the transformer
 * layers' tensors), blocks.c (norms, RoPE, attention, the feed-forwards, embeddings and output), blocks_deltanet.c
 * (the Gated DeltaNet layer and its recurrent state), archs.c and one arch_<family>.c per family's layer (and its
 * tensors where they are its own). */
#ifndef STRATA_ENGINE_INTERNAL_H
#define STRATA_ENGINE_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "threadpool.h"

#define ROWS_PER_TASK 16   /* output rows per unit of work in a product: small enough to balance threads */
_Static_assert(ROWS_PER_TASK % STRATA_BAND_ROWS == 0, "a unit of rows starts a band");
#define MAX_EXPERT_USED 64
#define FEW_TOKENS 64      /* chunks up to this many tokens are decode-shaped: products read rows as long runs
                            * (the kernels keep a tile of rows in cache while up to 64 tokens pass over it) */
#define RUNS_PER_THREAD 8  /* units of a decode-shaped product per thread: enough for one to take up another's */
#define MIN_RUN_BLOCKS 8   /* ROWS_PER_TASK blocks per unit at least: a run long enough to stream */
#define PACKED_RUN_BLOCKS 32 /* a prompt's unit of a product that packs its tokens per call (strata_gemm_packs_tokens),
                              * bounded as decode's by RUNS_PER_THREAD: a 256-token prompt of the small Q8_0 MoE at 2
                              * threads took 71.7 ms in units of 1 block (each repacking every token), 53 in 8, 48 */

// --- errors

/* Record a message for strata_last_error and return `status` (engine.c). */
strata_status engine_fail(strata_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// --- weights: a view of one GGUF tensor

typedef struct {
    const void *data;      /* NULL when the tensor is absent */
    int type;              /* GGML type id */
    int vec_dot_type;      /* the activation type its products read */
    int64_t n_in;          /* ne[0]: elements per row */
    int64_t n_out;         /* ne[1]: rows (per expert for 3-D tensors) */
    size_t row_bytes;
    size_t matrix_bytes;   /* n_out rows: the stride between the experts of a 3-D tensor */
    size_t bytes;          /* every expert's rows */
    const void *bands;     /* NULL, or the rows laid out in bands (strata_bands_fill): every product reads that */
    size_t bands_bytes;    /* one expert's bands: the stride between the experts' bands of a 3-D tensor */
    int packs;             /* its products pack the tokens anew per call (strata_gemm_packs_tokens) */
} matrix;

/* The matrix of expert e in a 3-D expert tensor. */
static inline const void *expert_data(const matrix *w, int e) {
    return (const char *)w->data + (size_t)e * w->matrix_bytes;
}

typedef struct {
    float *attn_norm;      // (n_embd,)
    matrix wq;             // (n_head * head_dim, n_embd)
    matrix wk;             // (n_head_kv * head_dim, n_embd)
    matrix wv;             // (n_head_kv * head_dim, n_embd)
    float *q_norm;         // (head_dim,) qwen3 and qwen3moe only
    float *k_norm;         // (head_dim,) qwen3 and qwen3moe only
    matrix wo;             // (n_embd, n_head * head_dim)
    float *ffn_norm;       // (n_embd,)
    matrix ffn_gate;       // (n_ff, n_embd) dense only
    matrix ffn_up;         // (n_ff, n_embd) dense only
    matrix ffn_down;       // (n_embd, n_ff) dense only
    matrix router;         // (n_expert, n_embd) MoE only
    matrix gate_exps;      // (n_expert, n_ff_exp, n_embd) MoE only
    matrix up_exps;        // (n_expert, n_ff_exp, n_embd) MoE only
    matrix down_exps;      // (n_expert, n_embd, n_ff_exp) MoE only
    /* Qwen3.5 (qwen35, qwen35moe): wq's rows are each head's query then its output gate (n_head * head_dim * 2);
     * ffn_norm is the file's post_attention_norm */
    float *gate_inp_shexp; // (n_embd,) the shared expert's gate: sigmoid(x . w) scales its output
    matrix gate_shexp;     // (n_ff_shexp, n_embd) shared expert
    matrix up_shexp;       // (n_ff_shexp, n_embd)
    matrix down_shexp;     // (n_embd, n_ff_shexp)
    /* Gated DeltaNet layers (recurrent) instead of wq, wk, wv, wo */
    matrix ssm_qkv;        // (2 * key_dim + value_dim, n_embd) attn_qkv: q, k, then v heads
    matrix ssm_z;          // (value_dim, n_embd) attn_gate: the output norm's gate
    matrix ssm_alpha;      // (n_v_heads, n_embd) the decay's input
    matrix ssm_beta;       // (n_v_heads, n_embd) the write strength's input
    float *ssm_conv;       // (conv_dim, d_conv) short causal convolution over q, k, v channels
    float *ssm_a;          // (n_v_heads,) -exp(A_log): the decay rate
    float *ssm_dt;         // (n_v_heads,) the decay's bias
    float *ssm_norm;       // (head_v_dim,) the gated RMS norm
    matrix ssm_out;        // (n_embd, value_dim)
    /* MTP (nextn) blocks only: speculative decoding's drafts (mtp.c), not run by the forward pass */
    matrix nextn_eh_proj;  // (n_embd, 2 * n_embd)
    float *nextn_enorm;    // (n_embd,)
    float *nextn_hnorm;    // (n_embd,)
    matrix nextn_embed;    // (n_vocab, n_embd) optional
    matrix nextn_head;     // (n_vocab, n_embd) optional
    float *nextn_head_norm; // (n_embd,) optional
} layer_weights;

// --- the team: every thread of the pool runs each building block, on its share of the rows

/* One thread's view of the job it runs with the others. */
typedef struct {
    strata_pool *pool;
    int ith, nth;                  /* this thread, of nth */
} team;

typedef struct { int64_t lo, hi; } range;

// --- architectures: each family's layer in its own file (arch_*.c), found by name in archs.c

typedef enum { ROPE_NORMAL, ROPE_NEOX } rope_mode;  /* rotate adjacent pairs, or pairs half a head apart */

/* One layer over the chunk's tokens, run by every thread of the team: 1 when every sequence of the chunk was
 * dropped inside it (the chunk stops there), else 0. embd_rows: the caller's (n_embd_rows, n_embd * (1 +
 * n_deepstack)). */
typedef int (*arch_layer_fn)(const team *tm, strata_context *c, int il, const float *embd_rows, int n_tok);

/* Every layer's tensors (m->layers, allocated) from the file's table, each checked against the hyper-parameters. */
typedef strata_status (*arch_load_fn)(strata_model *m, const strata_model_params *p);

typedef struct {
    const char *name;      /* general.architecture */
    rope_mode rope;
    int has_qk_norm;       /* q and k heads RMS-normed before RoPE */
    int is_moe;            /* the feed-forward is a mixture of experts */
    int mrope;             /* positions have (t, h, w) components (multi-axis RoPE) */
    arch_layer_fn layer;
    arch_load_fn load;
} arch;

size_t deltanet_work_floats(const strata_model *m);  /* a thread's scratch for the DeltaNet (blocks_deltanet.c) */
/* The DeltaNet's pieces (blocks_deltanet.c, where each is described), which the host device runs as its kernels. */
size_t deltanet_head_floats(size_t head_dim);
void deltanet_conv_channel(const float *w, int d_conv, float *state, const float *in, float *out, size_t stride,
                           const int *tokens, int n);
void deltanet_l2norm(float *x, int n, float scale);
void deltanet_gates(float *alpha, float *beta, const float *a, const float *dt_bias, int n_heads);
void deltanet_head(float *S, int n, int head_dim, const float *q, const float *k, size_t qk_stride, const float *v,
                   size_t v_stride, const float *g, const float *beta, size_t gb_stride, float *out, size_t out_stride,
                   int chunked, float *work);
void deltanet_gated_norm(float *out, const float *x, const float *z, const float *w, int n, float eps);

// --- the MTP block (mtp.c), in a context with mtp

int mtp_alloc(strata_context *c);  /* its buffers: 0 when out of memory */
void mtp_free(strata_context *c);
/* After the trunk's pass over a chunk: its hidden states and tokens kept, and the MTP block run over its
 * sequences' pending pairs where they could not wait for the next draft (mtp.c); every thread of the team. */
void mtp_fill(const team *tm, strata_context *c, const float *embd_rows, int n_tok);
/* dst's held hidden states and tokens of positions < n = src's, and its pending pairs (strata_copy_prefix). */
void mtp_copy_prefix(strata_context *c, int src, int dst, int n);
/* seq holds n positions now (strata_keep, or an eval that dropped it): no pair past them counts as filled. */
void mtp_keep(strata_context *c, int seq, int n);
/* seq's first n positions came without hidden states (strata_kv_import): their pairs count as filled, the block's
 * rows there stale (which costs drafts their accuracy, never the answer). */
void mtp_skip(strata_context *c, int seq, int n);

const arch *arch_find(const char *name);  /* NULL for a name no row has */
void arch_names(char *out, size_t n);     /* every row's name, ", " between them */

int qwen3_layer(const team *tm, strata_context *c, int il, const float *embd_rows, int n_tok);     // arch_qwen3.c
int qwen3moe_layer(const team *tm, strata_context *c, int il, const float *embd_rows, int n_tok);  // arch_qwen3.c
int llama_layer(const team *tm, strata_context *c, int il, const float *embd_rows, int n_tok);     // arch_llama.c
int qwen35_layer(const team *tm, strata_context *c, int il, const float *embd_rows, int n_tok);    // arch_qwen35.c
strata_status transformer_load(strata_model *m, const strata_model_params *p);                   // model_load.c
strata_status qwen35_load(strata_model *m, const strata_model_params *p);                        // arch_qwen35.c

// --- tensors from the file's table (model_load.c)

/* The tensor `name` (printf-style, with the layer index) as a matrix of ne0 x ne1 (x ne2) (0: no such
 * dimension); absent is an error unless optional. */
strata_status load_matrix(const strata_model_params *p, matrix *w, int optional, int64_t ne0, int64_t ne1,
                          int64_t ne2, const char *fmt, int il);
/* A vector (n,) of any supported type, dequantised into a new f32 array; absent is an error unless optional. */
strata_status load_vector(const strata_model_params *p, float **out, int optional, int64_t n, const char *fmt,
                          int il);
/* Layer il's router and routed experts (ffn_gate_inp, ffn_{gate,up,down}_exps), for every MoE family. */
strata_status load_routed_experts(const strata_model_params *p, layer_weights *L, int il);

// --- model (model_load.c)

struct strata_model {
    strata_model_params hp;    /* tensors and arch are not kept: they belong to the caller */
    char arch[16];
    rope_mode rope;
    int has_qk_norm;
    int is_moe;
    int mrope;                 /* positions have (t, h, w) components (multi-axis RoPE) */
    arch_layer_fn layer;       /* its family's layer (archs.c) */
    arch_load_fn load;         /* its family's tensors */
    int n_rot;                 /* the leading dimensions of a head that RoPE turns (head_dim but for partial RoPE) */
    unsigned char *rope_axis;  // (n_rot / 2,) the component each frequency pair turns by (0 without mrope)
    matrix tok_embd;           // (n_vocab, n_embd)
    matrix output;             // (n_vocab, n_embd): token_embd when the model ties them
    void *output_bands;        // output's rows in bands, built at load where the build has them for its type
    size_t prepared_bytes;     /* what output_bands takes */
    void *weights;             // the copy of the matrices decode reads whole (copy_weights), in huge pages
    size_t copied_bytes;       /* what weights holds */
    float *output_norm;        // (n_embd,)
    float *inv_freq;           // (n_rot / 2,) rope frequencies, scaled (build_rope)
    layer_weights *layers;     // (n_layer + n_nextn,): the forward pass's layers, then the MTP blocks
    layer_weights *mtp;        /* layers + n_layer: the file's n_nextn MTP blocks (NULL without), for speculative
                                * decoding: the first one runs in a context with mtp (mtp.c) */
    /* hybrid models (Qwen3.5): which layers are Gated DeltaNet ones; KV rows exist for the others only */
    int *recurrent;            // (n_layer,) 1 for a recurrent layer (all 0 for every other architecture)
    int *kv_layer;             // (n_layer + n_nextn,) a layer's index among the attention layers (-1 for a recurrent
                               // one); the MTP blocks' follow the trunk's (their rows exist in a context with mtp)
    int *rec_layer;            // (n_layer,) a layer's index among the recurrent layers (-1 for an attention one)
    int n_kv_layer, n_rec_layer;
    int gated_attn;            /* attention's q rows carry an output gate per head (Qwen3.5) */
    int64_t conv_dim;          /* DeltaNet: channels of the convolution: 2 * key_dim + value_dim */
    size_t conv_state_floats;  /* per sequence and recurrent layer: (d_conv - 1) * conv_dim */
    size_t ssm_state_floats;   /* per sequence and recurrent layer: n_v_heads * head_k_dim * head_v_dim */
};

// --- context: the sequences' KV cache and scratch for one chunk

struct strata_context {
    const strata_model *model;
    int n_ctx, n_seq, n_batch, n_threads, kv_type;
    strata_pool *pool;             /* n_threads threads, the caller's included */
    int *n_past;                   // (n_seq,) positions each sequence holds
    atomic_int *abort_flag;        // (n_seq,) raised by strata_abort, lowered when a call drops the sequence
    int *dropped;                  // (n_seq,) the call in flight dropped the sequence (its flag was seen)
    int stop;                      /* every sequence of the chunk was dropped: the chunk stopped */
    int stop_at[2];                /* the answers of the two alternating polls of the abort flags */
    strata_timings timings;
    /* recurrent layers' state per sequence: strata_state_bytes's layout, conv rows then delta-rule states */
    float *rec_state;              // (n_seq, state_floats): the states' first block
    float **rec_seq;               // (n_seq,) each sequence's state (state_floats), in rec_state or rec_spare_block
    float *rec_spare_block;        // (n_seq, state_floats), allocated at the first checkpoint (NULL before)
    float **rec_spare;             // (n_seq,) each sequence's spare: its checkpoint (strata_state_checkpoint)
    unsigned char *ckpt;           // (n_seq,) CKPT_*: the sequence's checkpoint
    int *ckpt_pos;                 // (n_seq,) the position a taken checkpoint's state belongs at
    size_t state_floats;           /* per sequence: n_rec_layer * (conv_state_floats + ssm_state_floats) */
    int *state_valid;              // (n_seq,) 0 after a cut that the state cannot follow (strata_keep, copy_prefix)
    float *qg;                     // (n_batch, n_head * head_dim * 2) gated attention: queries with their gates
    float *shexp_out;              // (n_batch, n_embd) the shared expert's output
    float *shexp_gate;             // (n_batch,) its gate's logit
    float *dn_qkv;                 // (n_batch, conv_dim) DeltaNet: q, k, v channels before the convolution
    float *dn_conv;                // (n_batch, conv_dim) after it (then q, k l2-normed)
    float *dn_z;                   // (n_batch, value_dim)
    float *dn_alpha;               // (n_batch, n_v_heads) the decay's input, then g, the decay's log
    float *dn_beta;                // (n_batch, n_v_heads) the write strength's input, then beta
    float *dn_out;                 // (n_batch, value_dim) delta rule's output, then gated-normed
    float *dn_work;                // (n_threads, dn_work_floats) a thread's scratch for a head's chunk
    size_t dn_work_floats;
    int *seq_tokens;               // (n_batch,) the chunk's token indices grouped by sequence, in order
    int *seq_first;                // (n_seq + 1,) sequence s's tokens are seq_tokens[seq_first[s] .. seq_first[s+1])
    int *chunk_seqs;               // (n_seq,) the sequences with tokens in the chunk
    int n_chunk_seqs;
    double output_t0;              /* when the current output projection began (ms) */
    size_t kv_elem;                /* bytes per cached value */
    void *k_cache;                 // (n_seq, n_kv_layer, n_head_kv, n_ctx, head_dim) of kv_type
    void *v_cache;                 // (n_seq, n_kv_layer, n_head_kv, n_ctx, head_dim) of kv_type
    float *k_scale;                // (n_seq, n_kv_layer, n_head_kv, n_ctx) int8 only
    float *v_scale;                // (n_seq, n_kv_layer, n_head_kv, n_ctx) int8 only
    /* multi-axis RoPE only: each cached position's t component, and 1 + its largest (where text goes on) */
    int *rope_t;                   // (n_seq, n_ctx)
    int *rope_next;                // (n_seq, n_ctx)
    /* the chunk in flight: its tokens gathered from the call, in call order */
    int *chunk_token;              // (n_batch,) token ids
    int *chunk_seq;                // (n_batch,) sequence of each token
    int *chunk_pos;                // (n_batch,) position of each token in its sequence
    int *chunk_rope;               // (n_batch, 3) its RoPE position's (t, h, w) components (all = pos: one axis)
    int *chunk_embd;               // (n_batch,) the caller's embedding row replacing the token, or -1
    int *chunk_out;                // (n_batch,) the caller's logits row of the token, or -1
    float *x;                      // (n_batch, n_embd) residual stream
    float *xb;                     // (n_batch, n_embd) normed input of a block, then its output
    float *q;                      // (n_batch, n_head * head_dim)
    float *k;                      // (n_batch, n_head_kv * head_dim)
    float *v;                      // (n_batch, n_head_kv * head_dim)
    float *att;                    // (n_batch, n_head * head_dim) attention output
    float *scores;                 // (n_threads, n_head / n_head_kv, n_ctx) attention weights
    float *hb;                     // (n_rows_ff, n_ff_max) gate, then the SwiGLU product
    float *hb2;                    // (n_rows_ff, n_ff_max) up
    float *moe_out;                // (n_batch * n_expert_used, n_embd) each expert's output per slot
    float *router;                 // (n_batch, n_expert) router logits
    float *draw_work;              // (n_threads, draw_n) strata_sample_rows' scratch
    int *draw_idx;                 // (n_threads, draw_n)
    int draw_n;
    void *xq;                      // (n_rows_ff, act_row_max) activations in a product's partner type
    void *xq_slots;                // (n_batch * n_expert_used, act_row_max) token rows gathered per slot
    size_t act_row_max;            /* bytes of the widest activation row */
    /* MoE routing of the current chunk */
    int *slot_of;                  // (n_batch, n_expert_used) slot of each (token, choice)
    float *choice_weight;          // (n_batch, n_expert_used) renormalised router weight
    int *slot_token;               // (n_batch * n_expert_used) token of each slot; slots are grouped by expert
    int *expert_start;             // (n_expert,) first slot of each expert
    int *expert_count;             // (n_expert,) slots of each expert
    int *tasks;                    // (n_expert * (blocks of n_ff_exp + blocks of n_embd), 2) (expert, row block);
                                   // a block is task_rows rows, ROWS_PER_TASK or more
    int n_tasks_up, n_tasks_down;  /* tasks for the gate/up products, then for the down product */
    int64_t task_rows[2];          /* rows per gate/up task, per down task */
    /* the MTP block (mtp.c), with mtp on: the trunk's recent post-norm hidden states per sequence, and the pairs
     * (hidden state at position p, token at p + 1) the block runs on, at position p */
    int mtp;
    int n_kv_layer;                /* the KV cache's layers: the trunk's attention layers, then the MTP block's */
    float *mtp_hidden;             // (n_seq, STRATA_MTP_HISTORY, n_embd) hidden state of position p at p % HISTORY
    int *mtp_hidden_pos;           // (n_seq, STRATA_MTP_HISTORY) the position each row holds, or -1
    int *mtp_hidden_rope;          // (n_seq, STRATA_MTP_HISTORY, 3) its RoPE position
    int *mtp_hidden_tok;           // (n_seq, STRATA_MTP_HISTORY) its token id (-1: an embedding row replaced it)
    int *mtp_filled;               // (n_seq,) the block's rows hold the pairs of positions < this; later ones wait
    int *mtp_from;                 // (n_seq,) ... from this position on: the block attends over [from, p]
    int mtp_window;                /* 0: the whole history; N: pairs lapse, a draft fills the last N (mtp.c) */
    const int *attn_from;          /* (n_seq,) while the block runs: each sequence's first position attended */
    int *mtp_upto;                 // (n_seq,) scratch: a fill's end, each sequence's pairs [mtp_filled, mtp_upto)
    strata_mtp_counts mtp_counts;  /* the fills so far (strata_mtp_get_counts) */
    float *mtp_h;                  // (n_batch, n_embd) the chunk's hidden states: output_norm(x)
    float *mtp_in;                 // (n_batch, 2 * n_embd) a pair's [enorm(embedding), hnorm(hidden)]
    const float **mtp_hrow;        // (n_batch,) a pair's hidden state (NULL: none held, zeros)
    int *mtp_tok;                  // (n_batch,) a pair's token id
    int *mtp_embd;                 // (n_batch,) the caller's embedding row replacing it, or -1
    int *mtp_seq;                  // (n_batch,) a pair's sequence
    int *mtp_pos;                  // (n_batch,) its position
    int *mtp_rope;                 // (n_batch, 3) its RoPE position
    int *mtp_row;                  // (n_batch,) a draft row's index in the caller's arrays
    int *mtp_base;                 // (n_batch,) a draft row's RoPE position after pos - 1
    float *mtp_g;                  // (n_batch, n_embd) a draft's hidden state: shared_head_norm(x)
    float *mtp_logits;             // (n_batch, n_vocab) the drafts' logits
    int *mtp_next;                 // (n_batch,) each row's draft
    int mtp_n;                     /* pairs of the current step */
    int mtp_due;                   /* the eval's chunk has pairs to fill at once */
    /* the caller's routing record (strata_record_routing), NULL when off */
    int *route_rec;                // (route_cap,) records of [layer, chunk, n_tok, n_tok x n_expert_used ids]
    long long route_cap, route_used;  /* ints it holds, ints written (-1: a record did not fit) */
};

static inline size_t act_row_bytes(int vec_dot_type, int64_t n) {
    const strata_type_traits *tr = strata_traits(vec_dot_type);
    return tr->block_bytes * (size_t)(n / tr->block_size);
}

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Index of row (seq, il, kvh, position 0) in the cache, and of its int8 scale; position p is row base + p. A kv
 * head's positions are adjacent, so attention reads each head's rows as one sequential stream. il >= n_layer: the
 * MTP block's rows (a context with mtp). */
static inline size_t kv_base(const strata_context *c, int seq, int il, int kvh) {
    const strata_model *m = c->model;
    return (((size_t)seq * c->n_kv_layer + m->kv_layer[il]) * m->hp.n_head_kv + kvh) * c->n_ctx;
}

/* Sequence seq's state of recurrent layer il: its conv rows ((d_conv - 1) * conv_dim), then its delta-rule state
 * (n_v_heads, head_k_dim, head_v_dim). */
static inline float *rec_state_of(const strata_context *c, int seq, int il) {
    const strata_model *m = c->model;
    return c->rec_seq[seq] + (size_t)m->rec_layer[il] * (m->conv_state_floats + m->ssm_state_floats);
}

/* A sequence's checkpoint (strata_state_checkpoint): none; due (the next eval with its tokens copies each
 * recurrent layer's state to the spare before changing it); taken (the spare holds its state at ckpt_pos). */
enum { CKPT_NONE, CKPT_DUE, CKPT_TAKEN };

/* Where layer il's state of a sequence whose checkpoint is due goes before the layer changes it; NULL where none
 * is due. */
static inline float *rec_spare_of(const strata_context *c, int seq, int il) {
    if (c->ckpt[seq] != CKPT_DUE) return NULL;
    const strata_model *m = c->model;
    return c->rec_spare[seq] + (size_t)m->rec_layer[il] * (m->conv_state_floats + m->ssm_state_floats);
}

#endif

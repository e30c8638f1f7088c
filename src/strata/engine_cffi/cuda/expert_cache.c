/* expert_cache.c — the expert cache's host side in C (device.h): the slots that hold experts in device memory, as
 * the policy (expert_policy.c) chooses them, and a layer's routed experts split between the device (the hits,
 * from their slots) and the CPU's threads (the misses, from the mapped file), one call a layer.
 *
 * The rules are expert_slots.py's (its docstring says why): an upload is queued on the upload stream into an
 * evicted expert's slot or a new one; when the next step begins, one event (recorded again each step) marks the
 * uploads queued so far, and the compute stream waits on it just before the first hit of an expert it marks. The
 * host never waits on the link. A step's upload budget is `uploads_per_step`, or with a link rate what the link
 * moves in the time the last step's misses took (at least min_uploads). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "../engine_internal.h"
#include "device_impl.h"

enum { QUEUED = 1, ARRIVING = 2 };  /* an expert's upload: queued since the event was last recorded; or marked by it */

struct strata_expert_slots {
    strata_device *d;
    strata_expert_policy *policy;
    int n_layer, n_expert, capacity, upload_stream, compute_stream;
    size_t slot_bytes;
    const strata_host_layer_experts **layers;  // (n_layer,)
    uint64_t *table;          // (n_layer n_expert,) each expert's slot address, 0 where it is not held
    unsigned char *flags;     // (n_layer n_expert,) QUEUED | ARRIVING
    int n_queued, n_arriving; // keys flagged so
    void **free_slots;        // evicted experts' slots, to be reused: (capacity,)
    int n_free;
    int event;                // the uploads' event, -1 until first recorded
    double uploads_per_step;  // the budget (< 0: no bound); paced from the first step with misses
    double link_rate, min_uploads, miss_seconds;
    int paced;                // a step has had misses: the budget follows their time from here on
    long long counts[3];      // hits, misses, uploads
    // a layer-step's outcome: the policy's four lists, and the hits' slots and runs, the misses' runs
    int *out[4], n_out[4];
    void **hit_slot;
    int *hit_first, *hit_count, *miss_first, *miss_count;
};

static int fail(strata_device *d, int status, const char *fmt, ...) {
    char reason[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
    strata_dev_set_error(d, reason);
    return status;
}

void strata_expert_slots_free(strata_expert_slots *s) {
    if (!s) return;
    free(s->layers), free(s->table), free(s->flags), free(s->free_slots), free(s->hit_slot);
    free(s->hit_first), free(s->hit_count), free(s->miss_first), free(s->miss_count);
    for (int i = 0; i < 4; i++) free(s->out[i]);
    free(s);
}

static int upload(strata_expert_slots *s, int layer, int expert, void *slot) {
    if (!slot) slot = s->n_free ? s->free_slots[--s->n_free] : strata_dev_alloc(s->d, s->slot_bytes);
    if (!slot) return STRATA_ERR_NOMEM;  // the device's reason stands
    int key = layer * s->n_expert + expert;
    s->table[key] = (uint64_t)(uintptr_t)slot;
    if (!(s->flags[key] & QUEUED)) s->n_queued++;
    s->flags[key] |= QUEUED;
    return strata_dev_upload_expert(s->d, s->upload_stream, slot, s->layers[layer], expert);
}

strata_expert_slots *strata_expert_slots_new(strata_device *d, strata_expert_policy *policy, int n_layer,
                                             int n_expert, int capacity, size_t slot_bytes,
                                             const strata_host_layer_experts *const *layers, int upload_stream,
                                             int compute_stream, double uploads_per_step, double link_rate,
                                             double min_uploads, const int *prior, int n_prior) {
    if (!policy || n_layer < 1 || n_expert < 1 || capacity < 0 || n_prior < 0 || n_prior > capacity || !slot_bytes) {
        fail(d, STRATA_ERR_INVALID_ARG, "expert slots: %d x %d experts, capacity %d, a prior of %d, slots of %zu bytes",
             n_layer, n_expert, capacity, n_prior, slot_bytes);
        return NULL;
    }
    strata_expert_slots *s = calloc(1, sizeof *s);
    size_t keys = (size_t)n_layer * n_expert;
    if (s) {
        *s = (strata_expert_slots){.d = d, .policy = policy, .n_layer = n_layer, .n_expert = n_expert,
                                   .capacity = capacity, .upload_stream = upload_stream,
                                   .compute_stream = compute_stream, .slot_bytes = slot_bytes, .event = -1,
                                   .uploads_per_step = uploads_per_step, .link_rate = link_rate,
                                   .min_uploads = min_uploads};
        s->layers = malloc(sizeof *s->layers * (size_t)n_layer);
        s->table = calloc(keys, sizeof *s->table);
        s->flags = calloc(keys, 1);
        s->free_slots = malloc(sizeof *s->free_slots * ((size_t)capacity + 1));
        s->hit_slot = malloc(sizeof *s->hit_slot * (size_t)n_expert);
        s->hit_first = malloc(sizeof(int) * (size_t)n_expert), s->hit_count = malloc(sizeof(int) * (size_t)n_expert);
        s->miss_first = malloc(sizeof(int) * (size_t)n_expert), s->miss_count = malloc(sizeof(int) * (size_t)n_expert);
        for (int i = 0; i < 4; i++) s->out[i] = malloc(sizeof(int) * (size_t)n_expert);
    }
    int complete = s && s->layers && s->table && s->flags && s->free_slots && s->hit_slot && s->hit_first &&
                   s->hit_count && s->miss_first && s->miss_count && s->out[0] && s->out[1] && s->out[2] && s->out[3];
    if (!complete) {
        strata_expert_slots_free(s);
        fail(d, STRATA_ERR_NOMEM, "expert slots: out of host memory for %zu experts", keys);
        return NULL;
    }
    for (int il = 0; il < n_layer; il++) s->layers[il] = layers[il];
    if (n_prior) {  // the prior's slots in one allocation
        char *block = strata_dev_alloc(d, (size_t)n_prior * slot_bytes);
        int status = block ? STRATA_OK : STRATA_ERR_NOMEM;
        for (int i = 0; !status && i < n_prior; i++) {
            int layer = prior[i] / n_expert, expert = prior[i] % n_expert;
            if (prior[i] < 0 || layer >= n_layer)
                status = fail(d, STRATA_ERR_INVALID_ARG, "expert slots: prior key %d of %zu", prior[i], keys);
            else
                status = upload(s, layer, expert, block + (size_t)i * slot_bytes);
        }
        if (status) {
            strata_expert_slots_free(s);
            return NULL;
        }
    }
    return s;
}

int strata_expert_slots_begin_step(strata_expert_slots *s, double *uploads_per_step) {
    if (s->n_queued) {  // the event marks every upload queued so far; they become readable from this step
        int status = STRATA_OK;
        if (s->event < 0)
            status = (s->event = strata_dev_event_record(s->d, s->upload_stream)) < 0 ? STRATA_ERR_INVALID_ARG : 0;
        else
            status = strata_dev_event_rerecord(s->d, s->upload_stream, s->event);
        if (status) return status;
        for (size_t key = 0; key < (size_t)s->n_layer * s->n_expert; key++)
            if (s->flags[key] & QUEUED) s->flags[key] = ARRIVING, s->n_arriving++;
        s->n_queued = 0;
    }
    if (s->link_rate > 0 && s->paced) {
        double paced = s->miss_seconds * s->link_rate / (double)s->slot_bytes;
        s->uploads_per_step = paced > s->min_uploads ? paced : s->min_uploads;
        s->miss_seconds = 0.0;
    }
    strata_expert_policy_begin_step(s->policy, s->uploads_per_step);
    if (uploads_per_step) *uploads_per_step = s->uploads_per_step;
    return STRATA_OK;
}

void strata_expert_slots_took(strata_expert_slots *s, double seconds) {
    s->miss_seconds += seconds;
    s->paced = 1;
}

static void forget(strata_expert_slots *s, int key) {
    s->n_queued -= (s->flags[key] & QUEUED) != 0;
    s->n_arriving -= (s->flags[key] & ARRIVING) != 0;
    s->flags[key] = 0;
}

int strata_expert_slots_step(strata_expert_slots *s, int layer, const int *experts, int n, int *const *out,
                             int *counts) {
    int *const lists[4] = {out ? out[0] : s->out[0], out ? out[1] : s->out[1], out ? out[2] : s->out[2],
                           out ? out[3] : s->out[3]};
    int *n_out = counts ? counts : s->n_out;
    if (strata_expert_policy_step(s->policy, layer, experts, n, lists[0], lists[1], lists[2], lists[3], n_out))
        return fail(s->d, STRATA_ERR_INVALID_ARG, "expert slots: layer %d of %d, %d experts of %d", layer,
                    s->n_layer, n, s->n_expert);
    int base = layer * s->n_expert;
    if (s->n_arriving) {  // the first hit of an expert still arriving: the compute stream waits for every upload
        for (int i = 0; i < n_out[0]; i++) {
            if (!(s->flags[base + lists[0][i]] & ARRIVING)) continue;
            int status = strata_dev_stream_wait_event(s->d, s->compute_stream, s->event);
            if (status) return status;
            for (size_t key = 0; key < (size_t)s->n_layer * s->n_expert; key++) s->flags[key] &= ~ARRIVING;
            s->n_arriving = 0;
            break;
        }
    }
    s->counts[0] += n_out[0], s->counts[1] += n_out[1], s->counts[2] += n_out[2];
    for (int i = 0; i < n_out[3]; i++) {
        int key = lists[3][i];
        s->free_slots[s->n_free++] = (void *)(uintptr_t)s->table[key];
        s->table[key] = 0;
        forget(s, key);
    }
    for (int i = 0; i < n_out[2]; i++) {
        int status = upload(s, layer, lists[2][i], NULL);
        if (status) return status;
    }
    return STRATA_OK;
}

const uint64_t *strata_expert_slots_table(const strata_expert_slots *s) { return s->table; }

void strata_expert_slots_counts(const strata_expert_slots *s, long long *counts) {
    memcpy(counts, s->counts, sizeof s->counts);
}

// --- a layer's routed experts: the hits on the device, the misses on the CPU's threads

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The runs (first, count) of `subset` (ascending, inside experts[0 .. m), ascending too) into first_out, count_out. */
static void runs_of(const int *subset, int n, const int *experts, const int *first, const int *count, int m,
                    int *first_out, int *count_out) {
    for (int i = 0, j = 0; i < n; i++) {
        while (j < m && experts[j] < subset[i]) j++;
        first_out[i] = first[j], count_out[i] = count[j];
    }
}

static int engine_reason(strata_device *d, int status) {
    return fail(d, status, "%s", strata_last_error());
}

int strata_dev_moe_layer(strata_device *d, strata_expert_slots *s, const strata_moe_layer *L, int n_tok,
                         int *record) {
    int k = L->k, n_slots = n_tok * k, m = 0, status;
    int64_t E = L->n_embd;
    if (n_tok < 1) return fail(d, STRATA_ERR_INVALID_ARG, "moe layer: %d tokens", n_tok);
    if ((status = strata_dev_download(d, L->stream, L->host_ids, L->ids, sizeof(int) * (size_t)n_slots)) ||
        (status = strata_dev_download(d, L->stream, L->host_xb, L->xb, sizeof(float) * (size_t)(n_tok * E))) ||
        (status = strata_dev_stream_sync(d, L->stream)))
        return status;
    if (record) memcpy(record, L->host_ids, sizeof(int) * (size_t)n_slots);
    // the slots grouped by expert, ascending: expert e's tokens' rows, in token order
    if ((status = strata_host_group_slots(n_tok, k, L->n_expert, L->host_ids, L->host_xb, E, L->host_slot_x,
                                          L->host_slot_of, L->host_experts, L->host_first, L->host_count, &m)))
        return engine_reason(d, status);
    const int *misses = L->host_experts, *miss_first = L->host_first, *miss_count = L->host_count;
    int n_misses = m, n_hits = 0;
    if (s && L->layer >= 0) {
        if ((status = strata_expert_slots_step(s, L->layer, L->host_experts, m, NULL, NULL))) return status;
        n_hits = s->n_out[0], n_misses = s->n_out[1];
        runs_of(s->out[0], n_hits, L->host_experts, L->host_first, L->host_count, m, s->hit_first, s->hit_count);
        runs_of(s->out[1], n_misses, L->host_experts, L->host_first, L->host_count, m, s->miss_first, s->miss_count);
        for (int i = 0; i < n_hits; i++)
            s->hit_slot[i] = (void *)(uintptr_t)s->table[L->layer * s->n_expert + s->out[0][i]];
        misses = s->out[1], miss_first = s->miss_first, miss_count = s->miss_count;
    }
    if ((status = strata_dev_upload(d, L->stream, L->slot_x, L->host_slot_x, sizeof(float) * (size_t)(n_slots * E))))
        return status;
    // the hits queued: on a card they run while the CPU computes the misses
    if (n_hits && (status = strata_dev_launch_experts(d, L->stream, L->hits, n_hits, s->hit_slot, s->hit_first,
                                                      s->hit_count)))
        return status;
    if (n_misses) {  // on the CPU's threads, from the mapped file, into miss_y at the slots' rows
        double started = seconds_now();
        strata_dev_clock timed = strata_dev_work_started(d);
        status = strata_host_layer_misses(L->pool, E, L->n_ff, L->experts, n_misses, misses, miss_first, miss_count,
                                          L->host_slot_x, L->host_miss_y);
        if (strata_dev_work_done(d, timed, status)) return engine_reason(d, status);
        if (s && L->layer >= 0) strata_expert_slots_took(s, seconds_now() - started);
        if ((status = strata_dev_upload_rows(d, L->stream, L->moe_out, L->host_miss_y, sizeof(float) * (size_t)E,
                                             n_misses, miss_first, miss_count)))
            return status;
    }
    return strata_dev_upload(d, L->stream, L->slot_of, L->host_slot_of, sizeof(int) * (size_t)n_slots);
}

// --- a step's pass where the cache holds some experts: every layer's launches, memsets and experts in one call

int strata_dev_run_pass(strata_device *d, strata_expert_slots *s, int stream, const strata_dev_op *ops, int n_ops,
                        int n_tok, int *records) {
    if (n_ops < 0 || (n_ops > 0 && !ops)) return fail(d, STRATA_ERR_INVALID_ARG, "a pass of %d operations", n_ops);
    for (int i = 0, experts = 0; i < n_ops; i++) {
        const strata_dev_op *op = &ops[i];
        int status;
        switch (op->kind) {
        case STRATA_DEV_OP_LAUNCHES:
            status = strata_dev_launch_list(d, stream, op->items, op->n);
            break;
        case STRATA_DEV_OP_MEMSET:
            status = strata_dev_memset(d, stream, op->dst, 0, op->bytes);
            break;
        case STRATA_DEV_OP_EXPERTS:
            if (!op->layer || op->layer->stream != stream) {
                status = fail(d, STRATA_ERR_INVALID_ARG, "no layer, or one on another stream");
                break;
            }
            status = strata_dev_moe_layer(d, s, op->layer, n_tok,
                                          records ? records + (size_t)experts * n_tok * op->layer->k : NULL);
            experts++;
            break;
        default:
            status = fail(d, STRATA_ERR_INVALID_ARG, "kind %d", op->kind);
        }
        if (status) {
            char reason[256];
            snprintf(reason, sizeof reason, "%s", strata_dev_error(d));
            return fail(d, status, "pass operation %d: %s", i, reason);
        }
    }
    return STRATA_OK;
}

/* The expert cache's replacement policy in C: the decisions of strata.experts.simulate.AdaptiveLrfuCache (with
 * one budget over every layer), made for the GPU backend at each layer of each step without Python's cost.
 *
 * The Python class is the reference: the same steps give the same hits, misses, uploads and evictions (the
 * tests replay traces through both). It holds one LRFU "shadow" cache per half-life, each with its own experts
 * and scores (log2 of the decayed use count plus step / half-life, which orders experts as their scores do now
 * without touching the others each step), a static shadow of the prior placement, and the cache itself, which
 * evicts and admits by the scores of the shadow whose hits (decayed) lead.
 *
 * The victim of an eviction is the held expert of least priority, ties to the lower layer, then the lower expert.
 * Each cache keeps, per layer, its held expert of least priority: a touch only raises a score, so it changes
 * that minimum only when it touches the minimum itself, and an eviction then scans two layers at most (the step's
 * own, without the experts it computes with, where its minimum is one of them; and the minimum's), not every held
 * expert.
 *
 * Floating point follows the reference operation by operation (pow and log2 of libm, as CPython's float power
 * and math.log2 call them; no expression here is an a * b + c that a compiler could fuse). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "strata_engine.h"

typedef struct {
    uint8_t *held;    /* per key (layer * n_expert + expert) */
    int *least;       /* per layer: the held expert of least priority; -1 none held; -2 to be found again */
    int size;
    double credit;    /* uploads the step may start in all */
    int uploaded;     /* by the current step so far */
} cache;

struct strata_expert_policy {
    int n_layer, n_expert, capacity, n_shadow;
    double uploads_per_step;  /* < 0: no bound */
    int now;
    double *half_life;        /* per shadow */
    double **scores;          /* per shadow, per key */
    cache *shadow;            /* n_shadow of them */
    cache main;
    uint8_t *prior;           /* per key: in the prior placement */
    int has_prior, longest;   /* the shadow of the longest half-life */
    double *merit;            /* per shadow, then the prior's */
    double keep, switch_z;
    int chosen;               /* the shadow the cache follows; n_shadow: the prior */
    int *needed, *misses, *order;  /* a step's scratch, n_expert each */
    uint8_t *protect;         /* n_expert: the step's experts in its layer */
};

/* --- priorities */

/* Which cache a comparison is for: a shadow's own scores, or the main cache's (the followed shadow's scores,
 * or while it follows the prior: in the prior first, then the longest half-life's scores). */
typedef struct {
    const strata_expert_policy *p;
    int shadow;  /* -1: the main cache */
} ranking;

static int follows_prior(const strata_expert_policy *p) { return p->chosen == p->n_shadow; }

/* -1, 0, 1 as key a's score is below, equal to or above key b's (the admission's comparison; no key order) */
static int compare_scores(ranking r, int a, int b) {
    const strata_expert_policy *p = r.p;
    if (r.shadow < 0 && follows_prior(p)) {
        if (p->prior[a] != p->prior[b]) return p->prior[a] < p->prior[b] ? -1 : 1;
        const double *s = p->scores[p->longest];
        return s[a] < s[b] ? -1 : s[a] > s[b];
    }
    const double *s = p->scores[r.shadow < 0 ? p->chosen : r.shadow];
    return s[a] < s[b] ? -1 : s[a] > s[b];
}

/* key a goes before key b as a victim: lower priority, or equal and a lower key */
static int evicts_first(ranking r, int a, int b) {
    int c = compare_scores(r, a, b);
    return c < 0 || (c == 0 && a < b);
}

static cache *cache_of(strata_expert_policy *p, ranking r) { return r.shadow < 0 ? &p->main : &p->shadow[r.shadow]; }

/* The held expert of least priority in `layer`, skipping those marked in `skip` (NULL: none); -1 if none. */
static int least_in_layer(strata_expert_policy *p, ranking r, int layer, const uint8_t *skip) {
    const cache *c = cache_of(p, r);
    int base = layer * p->n_expert, best = -1;
    for (int e = 0; e < p->n_expert; e++) {
        if (!c->held[base + e] || (skip && skip[e])) continue;
        if (best < 0 || evicts_first(r, base + e, base + best)) best = e;
    }
    return best;
}

/* The key to evict for a step in `layer`, not one of the step's experts there (p->protect); -1 if none. */
static int victim(strata_expert_policy *p, ranking r, int layer) {
    cache *c = cache_of(p, r);
    int best = -1;
    for (int l = 0; l < p->n_layer; l++) {
        if (c->least[l] == -2) c->least[l] = least_in_layer(p, r, l, NULL);
        int e = c->least[l];
        /* the step's own layer without the experts it computes with: its least, unless that is one of them */
        if (l == layer && e >= 0 && p->protect[e]) e = least_in_layer(p, r, l, p->protect);
        if (e >= 0 && (best < 0 || evicts_first(r, l * p->n_expert + e, best))) best = l * p->n_expert + e;
    }
    return best;
}

static void hold(strata_expert_policy *p, ranking r, int key) {
    cache *c = cache_of(p, r);
    int layer = key / p->n_expert, e = key % p->n_expert;
    c->held[key] = 1;
    c->size++;
    int least = c->least[layer];
    if (least == -1 || (least >= 0 && evicts_first(r, key, layer * p->n_expert + least))) c->least[layer] = e;
}

static void release(strata_expert_policy *p, ranking r, int key) {
    cache *c = cache_of(p, r);
    int layer = key / p->n_expert;
    c->held[key] = 0;
    c->size--;
    if (c->least[layer] == key % p->n_expert) c->least[layer] = -2;
}

/* Key `key`'s priority rose in cache r: its layer's least is found again if it was that one. */
static void raised(strata_expert_policy *p, ranking r, int key) {
    cache *c = cache_of(p, r);
    int layer = key / p->n_expert;
    if (c->least[layer] == key % p->n_expert) c->least[layer] = -2;
}

static void forget_least(strata_expert_policy *p, cache *c) {
    for (int l = 0; l < p->n_layer; l++) c->least[l] = -2;
}

/* --- steps */

static void begin(cache *c, double budget) {
    if (budget >= 0.0) {
        double most = (budget > 1.0 ? budget : 1.0) + 1.0 - 1e-6;
        double credit = c->credit - c->uploaded + budget;
        c->credit = credit < most ? credit : most;
    }
    c->uploaded = 0;
}

/* Uploads a step in `layer` may still start (INT32_MAX: no bound). */
static long allowance(const strata_expert_policy *p, const cache *c, int layer) {
    if (p->uploads_per_step < 0.0) return INT32_MAX;
    double unreleased = p->uploads_per_step * (p->n_layer - layer - 1) / p->n_layer;
    return (long)floor(c->credit - unreleased + 1e-9) - c->uploaded;
}

/* The LRFU shadow's touch of each needed expert: its score gains a use at this step. */
static void touch(strata_expert_policy *p, int s, int layer, const int *needed, int n) {
    double now = (double)p->now / p->half_life[s];
    double *row = p->scores[s] + (size_t)layer * p->n_expert;
    ranking own = {p, s}, main = {p, -1};
    int main_reads = !follows_prior(p) ? p->chosen == s : p->longest == s;
    for (int i = 0; i < n; i++) {
        int e = needed[i];
        row[e] = now + log2(1.0 + pow(2.0, row[e] - now));
        raised(p, own, layer * p->n_expert + e);
        if (main_reads) raised(p, main, layer * p->n_expert + e);
    }
}

/* One cache's step in `layer` over the sorted distinct `needed`: its hits counted, its misses considered for
 * upload best-scored first within the budget, each evicting the least-priority expert when the cache is full
 * and admitted only when it outscores it. Returns the hits. With `out` (the main cache's step), fills its hits,
 * misses, uploads and evicted keys, and their lengths in counts. */
static int cache_step(strata_expert_policy *p, ranking r, int layer, const int *needed, int n, int *const *out,
                      int *counts) {
    cache *c = cache_of(p, r);
    int base = layer * p->n_expert, hits = 0, m = 0;
    for (int i = 0; i < n; i++) {
        if (!c->held[base + needed[i]]) p->misses[m++] = needed[i];
        else if (out) out[0][hits++] = needed[i];
        else hits++;
    }
    if (r.shadow >= 0) touch(p, r.shadow, layer, needed, n);
    if (out) memcpy(out[1], p->misses, (size_t)m * sizeof(int));
    int up = 0, ev = 0;
    if (m) {
        /* best-scored first, a stable sort: equal scores keep the lower expert first */
        int *order = p->order;
        for (int i = 0; i < m; i++) {
            int e = p->misses[i], j = i;
            while (j > 0 && compare_scores(r, base + order[j - 1], base + e) < 0) {
                order[j] = order[j - 1];
                j--;
            }
            order[j] = e;
        }
        for (int i = 0; i < m; i++) {
            if (up >= allowance(p, c, layer)) break;
            int key = base + order[i];
            if (c->size >= p->capacity) {
                int v = victim(p, r, layer);
                if (v < 0 || compare_scores(r, key, v) <= 0) continue;
                release(p, r, v);
                if (out) out[3][ev] = v;
                ev++;
            }
            hold(p, r, key);
            if (out) out[2][up] = order[i];
            up++;
        }
    }
    c->uploaded += up;
    if (out) {
        counts[0] = hits;
        counts[1] = m;
        counts[2] = up;
        counts[3] = ev;
    }
    return hits;
}

/* --- the interface */

void strata_expert_policy_free(strata_expert_policy *p) {
    if (!p) return;
    for (int s = 0; s < p->n_shadow; s++) {
        if (p->scores) free(p->scores[s]);
        if (p->shadow) {
            free(p->shadow[s].held);
            free(p->shadow[s].least);
        }
    }
    free(p->scores);
    free(p->shadow);
    free(p->main.held);
    free(p->main.least);
    free(p->half_life);
    free(p->prior);
    free(p->merit);
    free(p->needed);
    free(p->misses);
    free(p->order);
    free(p->protect);
    free(p);
}

static int cache_init(cache *c, int n_keys, int n_layer) {
    c->held = calloc((size_t)n_keys, 1);
    c->least = malloc((size_t)n_layer * sizeof(int));
    if (!c->held || !c->least) return 0;
    for (int l = 0; l < n_layer; l++) c->least[l] = -1;
    return 1;
}

strata_expert_policy *strata_expert_policy_new(int n_layer, int n_expert, int capacity, const double *half_lives,
                                               int n_half_lives, double window, double switch_z, const int *prior,
                                               int n_prior) {
    if (n_layer < 1 || n_expert < 1 || capacity < 0 || n_half_lives < 1 || !(window > 0.0) || n_prior < 0 ||
        n_prior > capacity || (long long)n_layer * n_expert > INT32_MAX)
        return NULL;
    for (int s = 0; s < n_half_lives; s++)
        if (!(half_lives[s] > 0.0)) return NULL;
    int n_keys = n_layer * n_expert;
    for (int i = 0; i < n_prior; i++)
        if (prior[i] < 0 || prior[i] >= n_keys) return NULL;
    strata_expert_policy *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_layer = n_layer;
    p->n_expert = n_expert;
    p->capacity = capacity;
    p->n_shadow = n_half_lives;
    p->uploads_per_step = -1.0;
    p->now = -1;
    p->half_life = malloc((size_t)n_half_lives * sizeof(double));
    p->scores = calloc((size_t)n_half_lives, sizeof(double *));
    p->shadow = calloc((size_t)n_half_lives, sizeof(cache));
    p->prior = calloc((size_t)n_keys, 1);
    p->merit = calloc((size_t)n_half_lives + 1, sizeof(double));
    p->needed = malloc((size_t)n_expert * sizeof(int));
    p->misses = malloc((size_t)n_expert * sizeof(int));
    p->order = malloc((size_t)n_expert * sizeof(int));
    p->protect = calloc((size_t)n_expert, 1);
    int ok = p->half_life && p->scores && p->shadow && p->prior && p->merit && p->needed && p->misses && p->order &&
             p->protect && cache_init(&p->main, n_keys, n_layer);
    for (int s = 0; ok && s < n_half_lives; s++) {
        p->half_life[s] = half_lives[s];
        p->scores[s] = malloc((size_t)n_keys * sizeof(double));
        ok = p->scores[s] && cache_init(&p->shadow[s], n_keys, n_layer);
        for (int k = 0; ok && k < n_keys; k++) p->scores[s][k] = -INFINITY;
        if (ok && half_lives[s] > half_lives[p->longest]) p->longest = s;
    }
    if (!ok) {
        strata_expert_policy_free(p);
        return NULL;
    }
    for (int i = 0; i < n_prior; i++) p->prior[prior[i]] = 1;
    for (int k = 0; k < n_keys; k++) p->has_prior |= p->prior[k];
    p->keep = pow(2.0, -1.0 / window);
    p->switch_z = switch_z;
    p->chosen = p->has_prior ? n_half_lives : n_half_lives / 2;
    ranking main = {p, -1};
    for (int k = 0; k < n_keys; k++)
        if (p->prior[k]) hold(p, main, k);
    return p;
}

void strata_expert_policy_begin_step(strata_expert_policy *p, double uploads_per_step) {
    p->uploads_per_step = uploads_per_step;
    p->now++;
    begin(&p->main, uploads_per_step);
    int best = 0;
    for (int i = 0; i <= p->n_shadow; i++) {
        p->merit[i] *= p->keep;
        if (p->merit[i] > p->merit[best]) best = i;
    }
    double most = p->merit[best], followed = p->merit[p->chosen];
    if (most - followed > p->switch_z * sqrt(most + followed)) {
        if (best != p->chosen) forget_least(p, &p->main);  /* its priorities are another shadow's now */
        p->chosen = best;
    }
    for (int s = 0; s < p->n_shadow; s++) begin(&p->shadow[s], uploads_per_step);
}

strata_status strata_expert_policy_step(strata_expert_policy *p, int layer, const int *experts, int n,
                                        int *hits, int *misses, int *uploads, int *evictions, int *counts) {
    if (layer < 0 || layer >= p->n_layer || n < 0) return STRATA_ERR_INVALID_ARG;
    /* the distinct experts, ascending */
    memset(p->protect, 0, (size_t)p->n_expert);
    for (int i = 0; i < n; i++) {
        if (experts[i] < 0 || experts[i] >= p->n_expert) return STRATA_ERR_INVALID_ARG;
        p->protect[experts[i]] = 1;
    }
    int m = 0, base = layer * p->n_expert;
    for (int e = 0; e < p->n_expert; e++)
        if (p->protect[e]) p->needed[m++] = e;
    for (int s = 0; s < p->n_shadow; s++)
        p->merit[s] += cache_step(p, (ranking){p, s}, layer, p->needed, m, NULL, NULL);
    if (p->has_prior) {
        int prior_hits = 0;
        for (int i = 0; i < m; i++) prior_hits += p->prior[base + p->needed[i]];
        p->merit[p->n_shadow] += prior_hits;
    }
    int *const out[4] = {hits, misses, uploads, evictions};
    cache_step(p, (ranking){p, -1}, layer, p->needed, m, out, counts);
    return STRATA_OK;
}

int strata_expert_policy_chosen(const strata_expert_policy *p) { return p->chosen; }

int strata_expert_policy_held(const strata_expert_policy *p, int *keys) {
    int n = 0;
    for (int k = 0; k < p->n_layer * p->n_expert; k++)
        if (p->main.held[k]) keys[n++] = k;
    return n;
}

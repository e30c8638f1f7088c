/* sample.c — a token drawn from logits after temperature, top-k, top-p and min-p: strata.text.sampling's draw.
 *
 * The candidates are those of the sampler's numpy pipeline (`Sampler.distribution`, which the tests hold against
 * Hugging Face's warpers), found without sorting the vocabulary:
 * - top-k keeps a heap of the k best values seen, and skips a vector of values at once when none beats its worst;
 * - top-p (without top-k) needs the most likely tokens until their probability reaches p. Only tokens of weight at
 *   least (1 - p) / 2n of the total can be among them (the others together weigh less than 1 - p): in a trained
 *   model's distribution a few hundred of a vocabulary. The cut among those is found by histograms of the weights'
 *   bits (a weight is in [0, 1]: its bits order as its value does): 10 bits over them all, the next 12 over those
 *   of the bin where p is reached, the last 8 over those of its bin, whose weights are then equal and taken in id
 *   order (as numpy's stable sort takes them).
 * The kept tokens are walked in id order until their running weight passes u times their total, the blocks of
 * DRAW_BLOCK tokens before the one where that happens summed by vector.
 *
 * numpy took ~1.4 ms a token for the default settings (temperature alone) over 151,936 logits, and 15 ms for top-p
 * 0.95 of a flat distribution: on the engine thread, between two steps of every sequence. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "strata_engine.h"

#define DRAW_BLOCK 1024  /* tokens per summed block of the draw */
#define MAX_BLOCKS 4096  /* blocks at most: longer rows take longer blocks */

/* --- top-p: the cut */

static inline uint32_t bits_of(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

/* The bin, from the highest down, in which the running weight `above` + w[bin] reaches need; above is left
 * holding the weight of the bins above it. Falling short (rounding): the lowest bin with weight. */
static int crossing_bin(const double *w, int n_bins, double need, double *above) {
    int last = 0;
    for (int b = n_bins - 1; b >= 0; b--) {
        if (w[b] == 0.0) continue;
        if (*above + w[b] >= need) return b;
        *above += w[b];
        last = b;
    }
    *above -= w[last];
    return last;
}

/* The tokens whose weight is at least theta, into idx (ascending): how many, or -1 once there are more than
 * `most` (a flat distribution: the whole vocabulary is read faster in order than through a long list). A vector
 * of weights none of which reaches theta is passed over at once. */
static int candidates(const float *w, int n, float theta, int most, int *idx) {
    int m = 0, i = 0;
    const float floor = nextafterf(theta, -INFINITY);  // w >= theta: w > floor
#if defined(AV)
    const avec f = av_set1(floor);
    for (; i + AV <= n; i += AV) {
        if (!av_any_above(av_load(w + i), f)) continue;
        for (int l = i; l < i + AV; l++)
            if (w[l] > floor) idx[m++] = l;
        if (m > most) return -1;
    }
#endif
    for (; i < n; i++)
        if (w[i] > floor) idx[m++] = i;
    return m > most ? -1 : m;
}

/* The most likely tokens (ties: the lower index first), as few as reach `need` in weight (their whole weight if it
 * falls short by rounding), among idx[0..m) (ascending), or among all n with m < 0; weights w[i] in [0, 1].
 * Returns the last one taken, the cut: a token of those is in iff w[i] > w[cut], or equal and i <= cut.
 * idx[0..*n_ties) is left holding the tokens of the cut's weight that are in (the cut last). idx: n ints. */
static int top_cut(const float *w, int n, int *idx, int m, double need, int *n_ties) {
    static const int shift[3] = {20, 8, 0}, width[3] = {10, 12, 8};  // bits 30 and 31 of a weight are 0
    double quad[4][1 << 10] = {{0}}, hist[1 << 12];
    double above = 0.0;
    // level 0, in 4 interleaved histograms: no add waits for the one before it in the same bin
    const int all = m < 0, count = all ? n : m;
#define AT(j) (all ? (j) : idx[j])
    int j = 0;
    for (; j + 4 <= count; j += 4)
        for (int q = 0; q < 4; q++) quad[q][bits_of(w[AT(j + q)]) >> shift[0]] += w[AT(j + q)];
    for (; j < count; j++) quad[0][bits_of(w[AT(j)]) >> shift[0]] += w[AT(j)];
    for (int b = 0; b < 1 << width[0]; b++) quad[0][b] += quad[1][b] + quad[2][b] + quad[3][b];
    uint32_t prefix = (uint32_t)crossing_bin(quad[0], 1 << width[0], need, &above);
    m = 0;  // the bin's tokens, in index order
    for (j = 0; j < count; j++)
        if (bits_of(w[AT(j)]) >> shift[0] == prefix) idx[m++] = AT(j);
#undef AT
    for (int level = 1; level < 3; level++) {
        const int s = shift[level], bins = 1 << width[level];
        memset(hist, 0, sizeof(double) * bins);
        for (j = 0; j < m; j++) hist[(bits_of(w[idx[j]]) >> s) & (bins - 1)] += w[idx[j]];
        prefix = prefix << width[level] | (uint32_t)crossing_bin(hist, bins, need, &above);
        int kept = 0;
        for (j = 0; j < m; j++)
            if (bits_of(w[idx[j]]) >> s == prefix) idx[kept++] = idx[j];
        m = kept;
    }
    for (j = 0; j < m; j++) {  // equal weights now, in index order
        above += w[idx[j]];
        *n_ties = j + 1;
        if (above >= need) break;
    }
    return idx[*n_ties - 1];
}

/* --- the weights and the draw */

/* work = logits / t; returns their maximum. */
static float scale_logits(const float *logits, int n, float t, float *work) {
    float mx = -INFINITY;
    int i = 0;
#if defined(AV)
    const avec vt = av_set1(t);
    avec vm = av_set1(-INFINITY);
    for (; i + AV <= n; i += AV) {
        const avec x = av_div(av_load(logits + i), vt);
        av_store(work + i, x);
        vm = av_max(vm, x);
    }
    float lanes[AV];
    av_store(lanes, vm);
    for (int l = 0; l < AV; l++) mx = lanes[l] > mx ? lanes[l] : mx;
#endif
    for (; i < n; i++) {
        work[i] = logits[i] / t;
        mx = work[i] > mx ? work[i] : mx;
    }
    return mx;
}

/* work = e^(work - mx), 0 below e^-87 (a weight under 1e-38 of the top one's; masked tokens get exactly 0);
 * returns their sum. */
static double relative_weights(float *work, int n, float mx) {
    double total = 0.0;
    int i = 0;
#if defined(AV)
    const avec vm = av_set1(mx), lowest = av_set1(-87.0f);
    while (i + AV <= n) {
        const int stop = i + DRAW_BLOCK <= n ? i + DRAW_BLOCK : n - (n - i) % AV;
        avec acc = av_zero();
        for (; i < stop; i += AV) {
            const avec x = av_sub(av_load(work + i), vm), e = av_where_above(x, lowest, av_exp_neg(x));
            av_store(work + i, e);
            acc = av_add(acc, e);
        }
        total += av_sum(acc);
    }
#endif
    for (; i < n; i++) {
        const float x = work[i] - mx;
        work[i] = x > -87.0f ? expf(x) : 0.0f;
        total += work[i];
    }
    return total;
}

/* The largest float below x: a float w is >= x iff w > below(x). */
static float below(double x) {
    float f = (float)x;
    return (double)f >= x ? nextafterf(f, -INFINITY) : f;
}

/* Sum of the weights of w[lo..hi) above `floor`. */
static double block_weight(const float *w, int lo, int hi, float floor) {
    double sum = 0.0;
    int i = lo;
#if defined(AV)
    const avec f = av_set1(floor);
    avec acc = av_zero();
    for (; i + AV <= hi; i += AV) {
        const avec x = av_load(w + i);
        acc = av_add(acc, av_where_above(x, f, x));
    }
    sum = av_sum(acc);
#endif
    for (; i < hi; i++) sum += w[i] > floor ? w[i] : 0.0f;
    return sum;
}

/* Draw from the weights w[0..n) above `floor` and the n_ties tokens ties[] (ascending, of weight `tie` each):
 * walked in id order until the running weight passes u times the total. */
static int draw_above(const float *w, int n, float floor, const int *ties, int n_ties, float tie, double u) {
    const int block = n / MAX_BLOCKS >= DRAW_BLOCK ? n / MAX_BLOCKS + 1 : DRAW_BLOCK;
    const int n_blocks = (n + block - 1) / block;
    double sums[MAX_BLOCKS + 1], total = 0.0;
    for (int b = 0; b < n_blocks; b++) sums[b] = block_weight(w, b * block, b < n_blocks - 1 ? (b + 1) * block : n, floor);
    for (int t = 0; t < n_ties; t++) sums[ties[t] / block] += tie;
    for (int b = 0; b < n_blocks; b++) total += sums[b];
    const double target = u * total;
    double acc = 0.0;
    int b = 0;
    for (; b < n_blocks - 1 && acc + sums[b] <= target; b++) acc += sums[b];
    int t = 0, last = -1;
    while (t < n_ties && ties[t] < b * block) t++;
    for (int i = b * block; i < n; i++) {  // one block, unless rounding carries the walk past it
        float x = w[i] > floor ? w[i] : 0.0f;
        if (t < n_ties && ties[t] == i) x = tie, t++;
        if (x <= 0.0f) continue;
        last = i;
        acc += x;
        if (acc > target) return i;
    }
    if (last >= 0) return last;
    for (int i = n - 1; i >= 0; i--)  // the block's sum came from rounding alone: the last kept token before it
        if (w[i] > floor) return i;
    return n_ties ? ties[n_ties - 1] : 0;
}

/* --- top-k */

typedef struct {
    int i;
    float v;
    double w;
} candidate;

/* a ranks below b: a lower value, or the same at a later index */
static inline int ranks_below(const candidate *a, const candidate *b) { return a->v < b->v || (a->v == b->v && a->i > b->i); }

static void sift_down(candidate *h, int m, int at) {
    for (;;) {
        int low = at, l = 2 * at + 1, r = l + 1;
        if (l < m && ranks_below(&h[l], &h[low])) low = l;
        if (r < m && ranks_below(&h[r], &h[low])) low = r;
        if (low == at) return;
        candidate x = h[at];
        h[at] = h[low], h[low] = x, at = low;
    }
}

static void sift_up(candidate *h, int at) {
    while (at > 0 && ranks_below(&h[at], &h[(at - 1) / 2])) {
        candidate x = h[at];
        h[at] = h[(at - 1) / 2], h[(at - 1) / 2] = x, at = (at - 1) / 2;
    }
}

/* c[0..k) = the k highest of v[0..n) (ties: the lower index first), as a heap whose root ranks lowest. Once it is
 * full, a vector of values none of which beats the root is passed over at once (a value equal to the root's comes
 * later, so it ranks below it). */
static void top_k_of(const float *v, int n, int k, candidate *c) {
    int m = 0, i = 0;
    for (; i < n && m < k; i++) {
        c[m] = (candidate){i, v[i], 0.0};
        sift_up(c, m++);
    }
    while (i < n) {
#if defined(AV)
        if (i + AV <= n && !av_any_above(av_load(v + i), av_set1(c[0].v))) {
            i += AV;
            continue;
        }
        for (const int end = i + AV <= n ? i + AV : n; i < end; i++)
#else
        for (; i < n; i++)
#endif
            if (v[i] > c[0].v) {
                c[0] = (candidate){i, v[i], 0.0};
                sift_down(c, k, 0);
            }
    }
}

static int by_value(const void *a, const void *b) { return ranks_below(a, b) - ranks_below(b, a); }  // best first

static int by_index(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    return (x->i > y->i) - (x->i < y->i);
}

/* Top-k (0 < k < n) of the scaled logits in work, their weights e^(v - top) in double, top-p and min-p on them in
 * order of value, the draw in id order. */
static int draw_top_k(const float *work, int n, const strata_sampling *s, double u) {
    const int k = s->top_k;
    candidate *c = malloc(sizeof(candidate) * (size_t)k);
    if (!c) return -1;
    top_k_of(work, n, k, c);
    qsort(c, (size_t)k, sizeof *c, by_value);
    double total = 0.0;
    for (int j = 0; j < k; j++) total += c[j].w = exp((double)c[j].v - (double)c[0].v);
    int keep = k;
    if (s->top_p < 1.0) {
        double cum = 0.0;
        for (int j = 0; j < k; j++)
            if ((cum += c[j].w) / total >= s->top_p) {
                keep = j + 1;
                break;
            }
    }
    qsort(c, (size_t)keep, sizeof *c, by_index);
    double kept = 0.0;
    for (int j = 0; j < keep; j++) kept += c[j].w = c[j].w >= s->min_p ? c[j].w : 0.0;
    const double target = u * kept;
    double acc = 0.0;
    int pick = c[0].i;
    for (int j = 0; j < keep; j++) {
        if (c[j].w <= 0.0) continue;
        pick = c[j].i;
        if ((acc += c[j].w) > target) break;
    }
    free(c);
    return pick;
}

/* numpy's arg-max of x[0..n): the first NaN if there is one, else the first of the largest. */
int strata_argmax(const float *x, int n) {
    float best = -INFINITY;
    int i = 0;
#if defined(AV)
    avec top = av_set1(-INFINITY);
    for (; i + AV <= n; i += AV) {
        avec v = av_load(x + i);
        if (av_nan_lanes(v)) break;  // the NaN's index: found one by one below
        top = av_max(top, v);
    }
    best = av_hmax(top);
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > best) best = x[i];
    }
    i = 0;
#if defined(AV)
    for (const avec want = av_set1(best); i + AV <= n; i += AV) {
        unsigned equal = av_equal_lanes(av_load(x + i), want);
        if (equal) return i + __builtin_ctz(equal);
    }
#endif
    while (i < n && x[i] != best) i++;
    return i < n ? i : 0;  // i == n only for n <= 0: best is one of the values (-inf where all are)
}

int strata_sample(const float *logits, int n, const strata_sampling *s, double u, float *work, int *idx) {
    if (n <= 0 || !(s->temperature > 0.0f)) return -1;
    const float mx = scale_logits(logits, n, s->temperature, work);
    if (s->top_k > 0 && s->top_k < n) return draw_top_k(work, n, s, u);
    const double total = relative_weights(work, n, mx);
    const float min_floor = below(s->min_p);
    if (!(s->top_p < 1.0)) return draw_above(work, n, min_floor, idx, 0, 0.0f, u);
    // Tokens under theta weigh less than (1 - top_p) of the total together, so those at theta or above hold top_p
    // of it, and the cut is among them (a half, against rounding).
    const float theta = (float)(0.5 * (1.0 - s->top_p) * total / n);
    int n_ties = 0;
    const int cut = top_cut(work, n, idx, candidates(work, n, theta, n / 16, idx), s->top_p * total, &n_ties);
    // above the cut's weight, and the ties taken at it (if it passes min-p)
    const float value = work[cut], floor = value > min_floor ? value : min_floor;
    return draw_above(work, n, floor, idx, value > min_floor ? n_ties : 0, value, u);
}

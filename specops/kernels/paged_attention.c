/* Paged attention for CPU: queries against keys/values read in place from a slot-major
 * KV store, without gathering them into a padded copy first.
 *
 * Built by specops/kernels/cpu_paged.py with the system C compiler and called through
 * ctypes (which releases the GIL for the call). fp32 only.
 *
 * Layout (all contiguous):
 *   q         [N, Hq, D]     every token's queries (flat batch rows; row r starts at q + r * q_stride)
 *   k, v      [S, Hkv, D]    one layer's key / value store, slot-major
 *   q_index   [G, Tq]        flat row of each query of each sequence (padded entries unused)
 *   visible   [G, Tq]        how many keys each query sees: its prefix, slots kv_slots[g, :visible]
 *                            (0: a padded query, skipped)
 *   kv_slots  [G, Lk]        the store slot of each key position of each sequence
 *   out       [N, Hq, D]     written at the rows q_index names (others untouched)
 *
 * Causal and chain-draft masks are "query t sees the first visible[g, t] keys", which
 * is all this kernel supports; a tree's mask stays on the SDPA path.
 *
 * Per query, each key/value slot row (every kv head, contiguous) is read once for all
 * query heads (query head h uses kv head h / (Hq / Hkv), as SDPA's enable_gqa does);
 * the softmax is exact (max-subtracted, two passes over the scores): the same math as
 * scaled_dot_product_attention in fp32 up to rounding (built with reassociation allowed,
 * so sums are vectorized; never with -ffast-math, whose startup code would set
 * flush-to-zero for the whole process).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 256
#define MAX_THREADS 64
#define MIN_KEYS_PER_THREAD 512 /* below this a thread costs more than it saves */

typedef struct {
    const float *q, *k, *v;
    const int64_t *q_index, *visible, *kv_slots;
    float *out;
    int64_t G, Tq, Lk, Hq, Hkv, D, q_stride;
    float scale;
    int64_t first, last; /* this worker's queries: flat (g, t) indices [first, last) */
    int rc;
} Work;

static void *run(void *arg) {
    Work *w = (Work *)arg;
    const int64_t Tq = w->Tq, Lk = w->Lk, Hq = w->Hq, D = w->D;
    const int64_t group = Hq / w->Hkv;
    const int64_t row_elems = w->Hkv * D; /* one slot's keys (or values) for every kv head, contiguous */
    const float scale = w->scale;
    float *scores = (float *)malloc(sizeof(float) * (size_t)(Hq * (Lk > 0 ? Lk : 1))); /* [Hq, n] */
    float *acc = (float *)malloc(sizeof(float) * (size_t)(Hq * D));
    if (scores == NULL || acc == NULL) {
        free(scores);
        free(acc);
        w->rc = 2;
        return NULL;
    }
    for (int64_t i = w->first; i < w->last; i++) {
        const int64_t g = i / Tq;
        const int64_t n = w->visible[i];
        if (n <= 0) continue;
        const int64_t *slots = w->kv_slots + g * Lk;
        const float *qr = w->q + w->q_index[i] * w->q_stride; /* [Hq, D] */
        float mx[MAX_HEADS];
        for (int64_t h = 0; h < Hq; h++) mx[h] = -INFINITY;
        /* scores: each slot's key row (all kv heads) is read once, for every query head */
        for (int64_t s = 0; s < n; s++) {
            const float *kr = w->k + slots[s] * row_elems;
            for (int64_t h = 0; h < Hq; h++) {
                const float *kp = kr + (h / group) * D;
                const float *qh = qr + h * D;
                float dot = 0.0f;
                for (int64_t d = 0; d < D; d++) dot += qh[d] * kp[d];
                dot *= scale;
                scores[h * n + s] = dot;
                mx[h] = dot > mx[h] ? dot : mx[h];
            }
        }
        float inv[MAX_HEADS];
        for (int64_t h = 0; h < Hq; h++) {
            float *sh = scores + h * n;
            const float m = mx[h];
            float total = 0.0f;
            for (int64_t s = 0; s < n; s++) {
                sh[s] = expf(sh[s] - m);
                total += sh[s];
            }
            inv[h] = 1.0f / total;
        }
        memset(acc, 0, sizeof(float) * (size_t)(Hq * D));
        for (int64_t s = 0; s < n; s++) {
            const float *vr = w->v + slots[s] * row_elems;
            for (int64_t h = 0; h < Hq; h++) {
                const float *vp = vr + (h / group) * D;
                const float p = scores[h * n + s];
                float *ah = acc + h * D;
                for (int64_t d = 0; d < D; d++) ah[d] += p * vp[d];
            }
        }
        float *o = w->out + w->q_index[i] * Hq * D;
        for (int64_t h = 0; h < Hq; h++)
            for (int64_t d = 0; d < D; d++) o[h * D + d] = acc[h * D + d] * inv[h];
    }
    free(scores);
    free(acc);
    return NULL;
}

/* threads: how many workers share the queries (the caller passes torch's intra-op thread
 * count; 1 runs on the calling thread). Work is split by visible key count, not by
 * query count, so a long sequence does not leave the other workers idle. */
int specops_paged_attention(const float *q, const float *k, const float *v, const int64_t *q_index,
                            const int64_t *visible, const int64_t *kv_slots, float *out, int64_t G,
                            int64_t Tq, int64_t Lk, int64_t Hq, int64_t Hkv, int64_t D, int64_t q_stride,
                            int64_t threads, float scale) {
    if (Hkv <= 0 || Hq % Hkv != 0 || Hq > MAX_HEADS) return 1;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const int64_t total_q = G * Tq;
    int64_t keys = 0;
    for (int64_t i = 0; i < total_q; i++) keys += visible[i] > 0 ? visible[i] : 0;
    if (keys < MIN_KEYS_PER_THREAD * threads) threads = keys / MIN_KEYS_PER_THREAD > 1 ? keys / MIN_KEYS_PER_THREAD : 1;
    Work work[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int64_t first = 0, seen = 0;
    for (int64_t t = 0; t < threads; t++) {
        Work w = {q, k, v, q_index, visible, kv_slots, out, G, Tq, Lk, Hq, Hkv, D, q_stride, scale, first, total_q, 0};
        if (t < threads - 1) { /* take queries until this worker has its share of the keys */
            const int64_t target = keys * (t + 1) / threads;
            int64_t last = first;
            while (last < total_q && seen < target) {
                seen += visible[last] > 0 ? visible[last] : 0;
                last++;
            }
            w.last = last;
        }
        work[t] = w;
        first = w.last;
    }
    int started[MAX_THREADS] = {0};
    for (int64_t t = 1; t < threads; t++) { /* worker 0 runs on this thread */
        started[t] = pthread_create(&tid[t], NULL, run, &work[t]) == 0;
        if (!started[t]) run(&work[t]); /* no thread to be had: do its share here */
    }
    run(&work[0]);
    int rc = work[0].rc;
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        if (work[t].rc != 0) rc = work[t].rc;
    }
    return rc;
}

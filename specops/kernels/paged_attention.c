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
 * Two shapes of work (chosen by the call's Tq, never by how queries fall to threads, so a
 * query's rounding does not depend on its neighbours: any thread count gives the same bits):
 *  - Tq == 1 (plain decoding): per query, each key/value slot row (every kv head, contiguous)
 *    is read once for all query heads (query head h uses kv head h / (Hq / Hkv), as SDPA's
 *    enable_gqa does);
 *  - Tq > 1 (a verification's pending token and its drafts, a short prefill): up to
 *    RP / group queries of a sequence at once; the (query, head) rows that share a kv head
 *    are the lanes of a vector, so one key's scores for all of them are broadcast-multiply-
 *    adds without horizontal sums, and each key/value slot row is read once, in slot order,
 *    for all those queries and heads (not once per query: rows evicted since the previous
 *    layer's step are fetched once).
 * The softmax is exact in form (max-subtracted, two passes) with a vectorized exp (Cody-Waite
 * range reduction and Cephes' degree-5 polynomial, within 2 ulp, as the SIMD exp of torch's
 * own CPU softmax is not exact either): scaled_dot_product_attention's math in fp32 up to
 * rounding. Built with reassociation allowed, so sums are vectorized; never with
 * -ffast-math, whose startup code would set flush-to-zero for the whole process.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 256
#define MAX_THREADS 64
#define MIN_KEYS_PER_THREAD 512 /* below this a thread costs more than it saves */
#define RP 16                   /* (query, head) rows of one kv head processed together (vector lanes) */

#define PREFETCH_AHEAD 4 /* key/value rows requested this many slots before they are read */

/* ask for one slot row (every kv head) ahead of its use: slots are scattered by the block table,
 * and rows evicted since the previous layer's step otherwise arrive one miss at a time */
static inline void prefetch_row(const float *row, int64_t elems) {
    for (int64_t i = 0; i < elems; i += 16) __builtin_prefetch(row + i, 0, 3);
}

typedef struct {
    const float *q, *k, *v;
    const int64_t *q_index, *visible, *kv_slots;
    float *out;
    int64_t G, Tq, Lk, Hq, Hkv, D, q_stride;
    float scale;
    int64_t first, last; /* this worker's queries: flat (g, t) indices [first, last) */
    int rc;
} Work;

#include "vexp.h" /* exp_nonpos */

/* One query against its n keys, every query head (Tq == 1: plain decoding). Each key row
 * (all kv heads, contiguous) is read once for all query heads. scores: [Hq, Lk], acc: [Hq, D]. */
static inline __attribute__((always_inline)) void one_query(const Work *w, const float *qr, const int64_t *slots,
                                                            int64_t n, float *o, float *scores, float *acc,
                                                            const int64_t D) {
    const int64_t Hq = w->Hq, group = Hq / w->Hkv, Lk = w->Lk;
    const int64_t row_elems = w->Hkv * D;
    for (int64_t s = 0; s < n; s++) {
        const float *kr = w->k + slots[s] * row_elems;
        if (s + PREFETCH_AHEAD < n) prefetch_row(w->k + slots[s + PREFETCH_AHEAD] * row_elems, row_elems);
        for (int64_t h = 0; h < Hq; h++) {
            const float *kp = kr + (h / group) * D;
            const float *qh = qr + h * D;
            float dot = 0.0f;
            for (int64_t d = 0; d < D; d++) dot += qh[d] * kp[d];
            scores[h * Lk + s] = dot * w->scale;
        }
    }
    float inv[MAX_HEADS];
    for (int64_t h = 0; h < Hq; h++) {
        float *sh = scores + h * Lk;
        float m = sh[0];
        for (int64_t s = 1; s < n; s++) m = sh[s] > m ? sh[s] : m;
        float total = 0.0f;
        for (int64_t s = 0; s < n; s++) {
            const float e = exp_nonpos(sh[s] - m);
            sh[s] = e;
            total += e;
        }
        inv[h] = 1.0f / total;
    }
    memset(acc, 0, sizeof(float) * (size_t)(Hq * D));
    for (int64_t s = 0; s < n; s++) {
        const float *vr = w->v + slots[s] * row_elems;
        if (s + PREFETCH_AHEAD < n) prefetch_row(w->v + slots[s + PREFETCH_AHEAD] * row_elems, row_elems);
        for (int64_t h = 0; h < Hq; h++) {
            const float *vp = vr + (h / group) * D;
            const float p = scores[h * Lk + s];
            float *ah = acc + h * D;
            for (int64_t d = 0; d < D; d++) ah[d] += p * vp[d];
        }
    }
    for (int64_t h = 0; h < Hq; h++)
        for (int64_t d = 0; d < D; d++) o[h * D + d] = acc[h * D + d] * inv[h];
}

/* Vectors of RP lanes (GCC / clang vector extensions: one AVX-512 register, or split into
 * narrower ones by the compiler where the machine has none). */
typedef float vf __attribute__((vector_size(RP * 4)));
typedef int32_t vi __attribute__((vector_size(RP * 4)));
typedef uint32_t vu __attribute__((vector_size(RP * 4)));

static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* exp_nonpos on every lane (same steps, same bounds) */
static inline vf vexp_nonpos(vf x) {
    vu u = (vu)x;
    const vu lo = (vu){0} + 0xC2AE0000u;
    x = (vf)vselect((vi)(u < lo), (vf)u, (vf)lo);
    const vi n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi);
    const vf fn = __builtin_convertvector(n, vf);
    vf r = x - fn * 0.693359375f; /* exact: n has at most 7 bits, 0.693359375 9 */
    r = r + fn * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return p * (vf)((n + 127) << 23);
}

/* Up to RP / group queries of one sequence (a draft block, a short prefill) against their keys,
 * every kv head. The (query, head) rows that share kv head j are the lanes of one vector, so one
 * key's scores for all of them are broadcast-multiply-adds (no horizontal sums); each key/value
 * slot row (every kv head, contiguous) is read once, in slot order, for all the queries.
 * Every lane's arithmetic is independent of the other lanes.
 * sT: [Lk, Hkv] vectors of scores, qT: [Hkv, D] vectors, mt: [2 Hkv] vectors, acc: [Hkv, RP, D]. */
static inline __attribute__((always_inline)) void query_block(const Work *w, const int64_t *slots,
                                                              const float *const *qrow, const int64_t *vis,
                                                              const int64_t *rowi, int64_t nq, vf *sT, vf *qT,
                                                              vf *mt, float *acc, const int64_t D) {
    const int64_t Hq = w->Hq, Hkv = w->Hkv, group = Hq / Hkv, R = nq * group;
    const int64_t row_elems = Hkv * D;
    vi visr = (vi){0};
    int64_t nmax = 0;
    for (int64_t r = 0; r < R; r++) {
        visr[r] = (int32_t)vis[r / group];
        nmax = vis[r / group] > nmax ? vis[r / group] : nmax;
    }
    for (int64_t i = 0; i < Hkv * D; i++) qT[i] = (vf){0};
    for (int64_t j = 0; j < Hkv; j++)
        for (int64_t r = 0; r < R; r++) {
            const float *qh = qrow[r / group] + (j * group + r % group) * D;
            for (int64_t d = 0; d < D; d++) qT[j * D + d][r] = qh[d];
        }
    const vf masked = (vf){0} - 1e30f;
    vf *m = mt, *total = mt + Hkv;
    for (int64_t j = 0; j < Hkv; j++) m[j] = masked;
    for (int64_t s = 0; s < nmax; s++) {
        const float *kr = w->k + slots[s] * row_elems;
        if (s + PREFETCH_AHEAD < nmax) prefetch_row(w->k + slots[s + PREFETCH_AHEAD] * row_elems, row_elems);
        const vi live = (vi){0} + (int32_t)s < visr; /* keys past a row's prefix are masked */
        for (int64_t j = 0; j < Hkv; j++) {
            const float *kp = kr + j * D;
            const vf *qj = qT + j * D;
            vf a = (vf){0};
            for (int64_t d = 0; d < D; d++) a += qj[d] * kp[d];
            const vf x = vselect(live, a * w->scale, masked);
            sT[s * Hkv + j] = x;
            m[j] = vselect(x > m[j], x, m[j]);
        }
    }
    for (int64_t j = 0; j < Hkv; j++) total[j] = (vf){0};
    for (int64_t s = 0; s < nmax; s++) {
        const vi live = (vi){0} + (int32_t)s < visr;
        for (int64_t j = 0; j < Hkv; j++) {
            const vf e = vselect(live, vexp_nonpos(sT[s * Hkv + j] - m[j]), (vf){0});
            sT[s * Hkv + j] = e;
            total[j] += e;
        }
    }
    for (int64_t i = 0; i < Hkv * RP * D; i++) acc[i] = 0.0f;
    for (int64_t s = 0; s < nmax; s++) {
        const float *vr = w->v + slots[s] * row_elems;
        if (s + PREFETCH_AHEAD < nmax) prefetch_row(w->v + slots[s + PREFETCH_AHEAD] * row_elems, row_elems);
        for (int64_t j = 0; j < Hkv; j++) {
            const float *vp = vr + j * D;
            const vf st = sT[s * Hkv + j];
            float *aj = acc + j * RP * D;
            for (int64_t r = 0; r < R; r++) {
                if (s >= visr[r]) continue;
                const float p = st[r];
                float *ar = aj + r * D;
                for (int64_t d = 0; d < D; d++) ar[d] += p * vp[d];
            }
        }
    }
    for (int64_t j = 0; j < Hkv; j++)
        for (int64_t r = 0; r < R; r++) {
            const float inv = 1.0f / total[j][r];
            float *o = w->out + (rowi[r / group] * Hq + j * group + r % group) * D;
            const float *ar = acc + (j * RP + r) * D;
            for (int64_t d = 0; d < D; d++) o[d] = ar[d] * inv;
        }
}

typedef struct {
    float *scores, *acc; /* per-query path: [Hq, Lk], [Hq, D] */
    vf *sT, *qT, *mt;    /* query blocks: [Lk, Hkv], [Hkv, D], [2 Hkv] */
    float *bacc;         /* query blocks: [Hkv, RP, D] */
} Scratch;

/* Queries [t0, t1) of sequence g (padded ones skipped). */
static inline __attribute__((always_inline)) void run_block(const Work *w, int64_t g, int64_t t0, int64_t t1,
                                                            Scratch *sc, const int64_t D) {
    const int64_t Tq = w->Tq, Hq = w->Hq, Hkv = w->Hkv, group = Hq / Hkv;
    const int64_t *slots = w->kv_slots + g * w->Lk;
    if (Tq == 1 || group > RP) { /* chosen by the call's shape, so a query's rounding never depends on its neighbours */
        for (int64_t t = t0; t < t1; t++) {
            const int64_t n = w->visible[g * Tq + t];
            if (n <= 0) continue;
            const int64_t row = w->q_index[g * Tq + t];
            one_query(w, w->q + row * w->q_stride, slots, n, w->out + row * Hq * D, sc->scores, sc->acc, D);
        }
        return;
    }
    const int64_t per = RP / group; /* queries per pass */
    const float *qrow[RP];
    int64_t vis[RP], rowi[RP];
    int64_t nq = 0;
    for (int64_t t = t0; t <= t1; t++) {
        if (t < t1) {
            const int64_t n = w->visible[g * Tq + t];
            if (n <= 0) continue;
            rowi[nq] = w->q_index[g * Tq + t];
            qrow[nq] = w->q + rowi[nq] * w->q_stride;
            vis[nq++] = n;
        }
        if (nq > 0 && (nq == per || t == t1)) {
            query_block(w, slots, qrow, vis, rowi, nq, sc->sT, sc->qT, sc->mt, sc->bacc, D);
            nq = 0;
        }
    }
}

/* bytes for n floats, rounded up to whole 64-byte lines (aligned_alloc's rule; vectors are 64-byte aligned) */
static size_t bytes64(int64_t n) { return ((size_t)n * sizeof(float) + 63) & ~(size_t)63; }

static void *run(void *arg) {
    Work *w = (Work *)arg;
    const int64_t Tq = w->Tq, Lk = w->Lk > 0 ? w->Lk : 1, Hq = w->Hq, D = w->D;
    const int64_t Hkv = w->Hkv;
    Scratch sc;
    sc.scores = (float *)malloc(bytes64(Hq * Lk));
    sc.acc = (float *)malloc(bytes64(Hq * D));
    sc.sT = (vf *)aligned_alloc(64, bytes64(Lk * Hkv * RP));
    sc.qT = (vf *)aligned_alloc(64, bytes64(Hkv * D * RP));
    sc.mt = (vf *)aligned_alloc(64, bytes64(2 * Hkv * RP));
    sc.bacc = (float *)malloc(bytes64(Hkv * RP * D));
    if (sc.scores == NULL || sc.acc == NULL || sc.sT == NULL || sc.qT == NULL || sc.mt == NULL || sc.bacc == NULL) {
        w->rc = 2;
    }
    for (int64_t i = w->first; w->rc == 0 && i < w->last;) { /* runs of queries of one sequence */
        const int64_t g = i / Tq;
        const int64_t end = (g + 1) * Tq < w->last ? (g + 1) * Tq : w->last;
        switch (D) { /* common head sizes as constants: unrolled, register-resident inner loops */
            case 32: run_block(w, g, i - g * Tq, end - g * Tq, &sc, 32); break;
            case 64: run_block(w, g, i - g * Tq, end - g * Tq, &sc, 64); break;
            case 128: run_block(w, g, i - g * Tq, end - g * Tq, &sc, 128); break;
            default: run_block(w, g, i - g * Tq, end - g * Tq, &sc, D);
        }
        i = end;
    }
    free(sc.scores);
    free(sc.acc);
    free(sc.sT);
    free(sc.qT);
    free(sc.mt);
    free(sc.bacc);
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

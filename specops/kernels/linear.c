/* y = x W^T (+ b) (+ residual) for a few rows: the decode-step and short-verify linear
 * layers of a small fp32 model on CPU.
 *
 * Built by specops/kernels/cpu_linear.py with the system C compiler and called through
 * ctypes (which releases the GIL for the call).
 *
 * Why not MKL / oneDNN: at 1-8 rows these layers are bound by reading the weights, which
 * a decoding step streams from L3 / memory (the bundled 8-layer target's 33 matrices are
 * 27 MB). MKL's small-GEMM path reached about half the bandwidth this simple streaming
 * loop does, and torch's intra-op pool does not split a one-row matmul over threads at
 * all, so a second core did nothing for plain decoding. Here each weight row is read once
 * for all the rows of x, and the output rows are split over a persistent pool of threads.
 *
 * Arithmetic is fixed per output element, whatever the number of rows of x or of
 * threads: the dot product runs over k in the same order (two 8-lane accumulators over
 * blocks of 16, a last block of 8 into the first, a fixed horizontal sum, then a scalar
 * tail; a plain loop without AVX2/FMA), then + bias, then + residual. So a verification
 * forward of 5 positions computes bit for bit what 5 one-position forwards would, and
 * the result does not depend on the thread count.
 *
 * Layout (all contiguous, fp32): x [T, K], w [N, K] (nn.Linear's layout), bias [N] or
 * NULL, add [T, N] or NULL (may alias y), y [T, N].
 *
 * The input may first be transformed, per row, which saves a decoding step a dozen small
 * torch ops per layer:
 *   mode 1, RMSNorm:  x'[k] = g[k] * (x[k] / sqrt(mean_k x^2 + eps))      (g [K])
 *   mode 2, SwiGLU:   x is [T, 2K] (gate | up), x'[k] = silu(gate[k]) * up[k]
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vexp.h" /* exp_nonpos */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECOPS_AVX2 1
#endif

#define MAX_THREADS 64
#define SPIN_ROUNDS 4000 /* pause loops a worker spins before it sleeps (tens of microseconds) */

typedef struct {
    const float *x, *w, *bias, *add;
    float *y;
    int64_t T, K, N;
} Job;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

#ifdef SPECOPS_AVX2
static inline float hsum(__m256 a0, __m256 a1) {
    __m256 s = _mm256_add_ps(a0, a1);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}

/* dots of tb rows of x (tb <= 4, a compile-time constant after inlining) with one weight row */
static inline __attribute__((always_inline)) void dots(const float *const *xs, const float *w, int64_t K,
                                                        const int tb, float *out) {
    __m256 a0[4], a1[4];
    for (int t = 0; t < tb; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
        for (int t = 0; t < tb; t++) {
            a0[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[t] + k), w0, a0[t]);
            a1[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[t] + k + 8), w1, a1[t]);
        }
    }
    if (k + 8 <= K) {
        __m256 w0 = _mm256_loadu_ps(w + k);
        for (int t = 0; t < tb; t++) a0[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[t] + k), w0, a0[t]);
        k += 8;
    }
    for (int t = 0; t < tb; t++) {
        float r = hsum(a0[t], a1[t]);
        for (int64_t j = k; j < K; j++) r = __builtin_fmaf(xs[t][j], w[j], r);
        out[t] = r;
    }
}
#else
static inline void dots(const float *const *xs, const float *w, int64_t K, const int tb, float *out) {
    for (int t = 0; t < tb; t++) {
        float r = 0.f;
        for (int64_t j = 0; j < K; j++) r += xs[t][j] * w[j];
        out[t] = r;
    }
}
#endif

static void run_rows(const Job *j, int64_t n0, int64_t n1) {
    const int64_t T = j->T, K = j->K, N = j->N;
    for (int64_t n = n0; n < n1; n++) { /* each weight row streamed from memory once, for every row of x */
        const float *wn = j->w + n * K;
        const float bias = j->bias ? j->bias[n] : 0.f;
        for (int64_t t0 = 0; t0 < T; t0 += 4) {
            const int tb = (int)(T - t0 < 4 ? T - t0 : 4);
            const float *xs[4];
            float r[4];
            for (int t = 0; t < tb; t++) xs[t] = j->x + (t0 + t) * K;
            switch (tb) { /* constant block sizes, so the accumulators stay in registers */
                case 4: dots(xs, wn, K, 4, r); break;
                case 3: dots(xs, wn, K, 3, r); break;
                case 2: dots(xs, wn, K, 2, r); break;
                default: dots(xs, wn, K, 1, r); break;
            }
            for (int t = 0; t < tb; t++) {
                float v = r[t];
                if (j->bias) v += bias;
                const int64_t at = (t0 + t) * N + n;
                if (j->add) v += j->add[at];
                j->y[at] = v;
            }
        }
    }
}

/* -- a persistent pool ------------------------------------------------------------------
 * The output rows are cut into chunks of CHUNK_ROWS; the caller and the workers claim
 * chunks from one atomic ticket (generation | chunks | next), so a worker the OS has not
 * scheduled yet costs nothing: the caller takes its chunks. Workers spin a little after
 * a job (a decoding step calls every few tens of microseconds), then sleep on a
 * condition variable. The caller waits only for chunks already claimed, yielding the
 * CPU while it waits.
 */
#define CHUNK_ROWS 64
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER; /* one caller at a time */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static atomic_ulong ticket; /* generation << 32 | chunks << 16 | next chunk */
static atomic_int done, sleepers;
static atomic_uint generation;
static int workers; /* started */
static Job job;

static int claim(unsigned gen) { /* the next chunk of job `gen`, or -1 */
    unsigned long t = atomic_load(&ticket);
    for (;;) {
        unsigned next = (unsigned)(t & 0xffff), chunks = (unsigned)((t >> 16) & 0xffff);
        if ((unsigned)(t >> 32) != gen || next >= chunks) return -1;
        if (atomic_compare_exchange_weak(&ticket, &t, t + 1)) return (int)next;
    }
}

static void work(unsigned gen) {
    int c;
    while ((c = claim(gen)) >= 0) { /* job is stable while a chunk of it is claimed and not done */
        int64_t n0 = (int64_t)c * CHUNK_ROWS, n1 = n0 + CHUNK_ROWS;
        run_rows(&job, n0, n1 < job.N ? n1 : job.N);
        atomic_fetch_add(&done, 1);
    }
}

static void *worker(void *arg) {
    unsigned seen = (unsigned)(uintptr_t)arg; /* the generation when it was started */
    for (;;) {
        int spins = 0;
        while (atomic_load(&generation) == seen) {
            if (++spins < SPIN_ROUNDS) {
                cpu_relax();
                continue;
            }
            atomic_fetch_add(&sleepers, 1);
            pthread_mutex_lock(&sleep_lock);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &sleep_lock);
            pthread_mutex_unlock(&sleep_lock);
            atomic_fetch_sub(&sleepers, 1);
        }
        seen = atomic_load(&generation);
        work(seen);
    }
    return NULL;
}

static void after_fork_child(void) { /* the workers did not survive the fork */
    workers = 0;
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&pool_lock, NULL);
    pthread_mutex_init(&sleep_lock, NULL);
    pthread_cond_init(&wake, NULL);
}

static int ensure_workers(int wanted) {
    static int registered = 0;
    if (!registered) {
        pthread_atfork(NULL, NULL, after_fork_child);
        registered = 1;
    }
    while (workers < wanted && workers + 1 < MAX_THREADS) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&tid, &attr, worker, (void *)(uintptr_t)atomic_load(&generation));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        workers++;
    }
    return workers;
}

static void rms_norm_rows(const float *x, const float *g, float eps, int64_t T, int64_t K, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * K;
        float ss = 0.f;
        for (int64_t k = 0; k < K; k++) ss += r[k] * r[k];
        const float inv = 1.0f / sqrtf(ss / (float)K + eps);
        for (int64_t k = 0; k < K; k++) out[t * K + k] = g[k] * (r[k] * inv);
    }
}

static void swiglu_rows(const float *x, int64_t T, int64_t K, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *gate = x + t * 2 * K, *up = gate + K;
        for (int64_t k = 0; k < K; k++) out[t * K + k] = gate[k] / (1.0f + expf(-gate[k])) * up[k];
    }
}

static int linear_job(Job j, int threads);

/* Returns 0, or 2 when a buffer could not be allocated; threads: how many threads may share
 * the rows (1: the caller alone); mode 0 plain, 1 RMSNorm(g, eps) first, 2 SwiGLU first. */
int specops_linear(const float *x, const float *w, const float *bias, const float *add, float *y, int64_t T,
                   int64_t K, int64_t N, int threads, int mode, const float *g, float eps) {
    Job j = {x, w, bias, add, y, T, K, N};
    if (mode == 0) return linear_job(j, threads);
    float stack[4096];
    float *buf = T * K <= 4096 ? stack : (float *)malloc(sizeof(float) * (size_t)(T * K));
    if (buf == NULL) return 2;
    if (mode == 1)
        rms_norm_rows(x, g, eps, T, K, buf);
    else
        swiglu_rows(x, T, K, buf);
    j.x = buf;
    int rc = linear_job(j, threads);
    if (buf != stack) free(buf);
    return rc;
}

static int linear_job(Job j, int threads) {
    const int64_t N = j.N;
    const int64_t chunks = (N + CHUNK_ROWS - 1) / CHUNK_ROWS;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || chunks < 2 || chunks > 0xffff || pthread_mutex_trylock(&pool_lock) != 0) {
        run_rows(&j, 0, N); /* one thread, or another caller holds the pool: run here */
        return 0;
    }
    if (ensure_workers(threads - 1) < 1) {
        pthread_mutex_unlock(&pool_lock);
        run_rows(&j, 0, N);
        return 0;
    }
    job = j;
    atomic_store(&done, 0);
    unsigned gen = atomic_load(&generation) + 1;
    atomic_store(&ticket, ((unsigned long)gen << 32) | ((unsigned long)chunks << 16));
    atomic_store(&generation, gen);
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&sleep_lock);
    }
    work(gen);
    for (int spins = 0; atomic_load(&done) < chunks; spins++) {
        if (spins < 1000)
            cpu_relax();
        else
            sched_yield(); /* a worker holds a chunk but has no CPU: give it ours */
    }
    pthread_mutex_unlock(&pool_lock);
    return 0;
}

/* -- attention over a dense (contiguous per head) KV cache --------------------------------
 * The fast runner's decoding step and chain verification: T new queries per sequence
 * after L - T cached positions, query t seeing the first L - T + t + 1 keys (causal).
 *   q    row (b, t) at q + b * q_b + t * q_row, head h at + h * D     (heads, dims contiguous)
 *   k, v sequence b, kv head g, position j at k + b * kv_b + g * kv_h + j * D
 *   out  [B * T, Hq * D]
 * Query head h reads kv head h / (Hq / Hkv). Each query's arithmetic is the same whatever
 * T is (a verification of 5 positions equals 5 decoding steps bit for bit), one thread.
 * Returns 0, or 2 when no score buffer could be allocated.
 */
static int attention(const float *q, int64_t q_b, int64_t q_row, const float *k, const float *v, int64_t kv_b,
                     int64_t kv_h, float *out, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t L,
                     float scale) {
    float stack[4096];
    float *scores = L <= 4096 ? stack : (float *)malloc(sizeof(float) * (size_t)L);
    if (scores == NULL) return 2;
    const int64_t group = Hq / Hkv;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = 0; t < T; t++) {
            const int64_t visible = L - T + t + 1;
            const float *qrow = q + b * q_b + t * q_row;
            float *orow = out + (b * T + t) * Hq * D;
            for (int64_t h = 0; h < Hq; h++) {
                const float *qh = qrow + h * D;
                const float *kh = k + b * kv_b + (h / group) * kv_h;
                const float *vh = v + b * kv_b + (h / group) * kv_h;
                float m = -INFINITY;
                for (int64_t j = 0; j < visible; j++) {
                    const float *kj = kh + j * D;
                    float s = 0.f;
                    for (int64_t d = 0; d < D; d++) s += qh[d] * kj[d];
                    s *= scale;
                    scores[j] = s;
                    if (s > m) m = s;
                }
                float total = 0.f;
                for (int64_t j = 0; j < visible; j++) {
                    scores[j] = exp_nonpos(scores[j] - m);
                    total += scores[j];
                }
                float *oh = orow + h * D;
                for (int64_t d = 0; d < D; d++) oh[d] = 0.f;
                for (int64_t j = 0; j < visible; j++) {
                    const float p = scores[j];
                    const float *vj = vh + j * D;
                    for (int64_t d = 0; d < D; d++) oh[d] += p * vj[d];
                }
                const float inv = 1.0f / total;
                for (int64_t d = 0; d < D; d++) oh[d] *= inv;
            }
        }
    }
    if (scores != stack) free(scores);
    return 0;
}

int specops_attention(const float *q, int64_t q_b, int64_t q_row, const float *k, const float *v, int64_t kv_b,
                      int64_t kv_h, float *out, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t L,
                      float scale) {
    return attention(q, q_b, q_row, k, v, kv_b, kv_h, out, B, T, Hq, Hkv, D, L, scale);
}

/* The whole attention block of a decoding step / chain verification after the linear
 * q/k/v projection: rotary embeddings on the q and k heads (in place in qkv), the new keys
 * and values written into the cache at positions start..start+T-1, then causal attention
 * over start + T keys.
 *   qkv        [B, T, Hq + 2 Hkv, D] contiguous: q heads, k heads, v heads
 *   cos, sin   [T, D] the rows of positions start.. (sin with its first half negated:
 *              rotate_half(x) * sin == x[(d + D/2) % D] * signed_sin[d])
 *   k_cache, v_cache  position j of sequence b, kv head g at + b * kv_b + g * kv_h + j * D
 */
int specops_rope_cache_attention(float *qkv, const float *cos, const float *sin, float *k_cache, float *v_cache,
                                 int64_t kv_b, int64_t kv_h, int64_t start, float *out, int64_t B, int64_t T,
                                 int64_t Hq, int64_t Hkv, int64_t D, float scale) {
    const int64_t H = Hq + 2 * Hkv, half = D / 2;
    float tmp[1024];
    if (D > 1024 || D % 2) return 3;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = 0; t < T; t++) {
            float *row = qkv + (b * T + t) * H * D;
            const float *c = cos + t * D, *s = sin + t * D;
            for (int64_t h = 0; h < Hq + Hkv; h++) { /* q and k heads */
                float *x = row + h * D;
                for (int64_t d = 0; d < D; d++) tmp[d] = x[d] * c[d] + x[(d + half) % D] * s[d];
                memcpy(x, tmp, sizeof(float) * (size_t)D);
            }
            for (int64_t g = 0; g < Hkv; g++) {
                const int64_t at = b * kv_b + g * kv_h + (start + t) * D;
                memcpy(k_cache + at, row + (Hq + g) * D, sizeof(float) * (size_t)D);
                memcpy(v_cache + at, row + (Hq + Hkv + g) * D, sizeof(float) * (size_t)D);
            }
        }
    }
    return attention(qkv, T * H * D, H * D, k_cache, v_cache, kv_b, kv_h, out, B, T, Hq, Hkv, D, start + T, scale);
}

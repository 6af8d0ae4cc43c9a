/* y = x W^T (+ b) (+ residual) for a few rows: the decode-step and short-verify linear
 * layers of a small fp32 model on CPU.
 *
 * Part of the CPU kernels' library (linear.c includes it), called through ctypes from
 * specops/kernels/cpu_linear.py (which releases the GIL for the call).
 *
 * Why not MKL / oneDNN: at 1-8 rows these layers are bound by reading the weights, which
 * a decoding step streams from L3 / memory (the bundled 8-layer target's 33 matrices are
 * 27 MB). MKL's small-GEMM path reached about half the bandwidth this simple streaming
 * loop does, and torch's intra-op pool does not split a one-row matmul over threads at
 * all, so a second core did nothing for plain decoding. Here the weights are read once for
 * all the rows of x, and the output rows are split over a persistent pool of threads.
 *
 * Arithmetic is fixed per output element, whatever the number of rows of x or of
 * threads: one accumulator lane per output, which adds x[t, k] w[n, k] for k = 0, 1, ...
 * in order with fused multiply-adds (one fmaf per k in the plain C build), then + bias,
 * then + residual. So a verification forward of 5 positions computes bit for bit what 5
 * one-position forwards would, and the result does not depend on the thread count.
 *
 * Layout (all contiguous, fp32): x [T, K]; w [N, K] in panels (see "the weight panels"
 * below: `cpu_linear.pack` turns nn.Linear's [N, K] into it); bias [N] or NULL; add [T, N]
 * or NULL (may alias y); y [T, N].
 *
 * The input may first be transformed, per row, which saves a decoding step a dozen small
 * torch ops per layer:
 *   mode 1, RMSNorm:  x'[k] = g[k] * (x[k] / sqrt(mean_k x^2 + eps))      (g [K])
 *   mode 2, SwiGLU:   x is [T, 2K] (gate | up), x'[k] = silu(gate[k]) * up[k]
 */
#include "gemv.h"
#include "pool.h"

/* -- the weight panels ------------------------------------------------------------------
 * W [N, K] is stored in panels of PANEL output rows (`cpu_linear.pack`): panel p holds rows
 * PANEL p .. PANEL p + PANEL - 1 as [K][PANEL] (for each k, the panel's PANEL weights side
 * by side), and the last N % PANEL rows, when there are any, form a narrower panel
 * [K][N % PANEL]. Same element count and shape as W, so a packed weight is a drop-in
 * tensor of the same [N, K] shape whose buffer is permuted.
 * Why: with W's own layout each output is a dot product over k, whose 16 lanes must be
 * summed across at the end; at K = 256 those horizontal sums (and the scalar stores) cost
 * about as much as the multiply-adds of a one-row call. Over panels, output n of the panel
 * is lane n of the accumulators: for each k, one broadcast of x[t, k] times the panel's row
 * k of weights, no horizontal sum, and outputs stored as vectors. Measured on the bundled
 * target's 33 matrices (AVX-512 host, one thread, medians of 400 interleaved passes against
 * the row-major kernel this replaced): 1 row 2.23 -> 1.46 ms, 8 rows 2.71 -> 2.13 ms. At 8
 * rows a core is then at its multiply-add peak (one 16-lane FMA per cycle on this host:
 * 58 GMAC/s in cache), so 8 rows cost more than 1 wherever the weights stream faster than
 * that (c(T) in `specops bench decode`). */

#ifdef SPECOPS_AVX512
/* The weights stream from L3 / memory: each k step reads PANEL weights (two cache lines in
 * fp32), so both lines are fetched this far ahead. */
#define PANEL_PREFETCH 4096
/* ... and into L2 this far ahead. At 8 rows a core spends 16 cycles of multiply-adds per k
 * step, and with L1 prefetches alone the stream did not keep up while the FMAs ran (the
 * bundled target's matrices at 8 rows, 2 threads: 1.04 ms against 0.74 at 1 row, where
 * memory alone bounds it). Requests into L2 use its own, deeper miss queue. Measured in one
 * process, two builds alternated in rotating order, 300 passes each, two runs: 8 rows
 * median 1.138 / 1.159 -> 1.037 / 1.045 ms, 4 rows 0.926 / 0.940 -> 0.885 / 0.922, 1 row
 * 0.914 / 0.883 -> 0.902 / 0.873. */
#define PANEL_PREFETCH_L2 16384
#define WIDEN_BF16(h) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
/* acc0 / acc1: lanes 0-15 / 16-31 of the panel for each of tb rows of x (tb <= 8, a
 * compile-time constant after inlining, as is `full`: a whole panel, no masks). */
#define DEFINE_PANEL(NAME, WT, LINES, LOAD)                                                                  \
    static inline __attribute__((always_inline)) void NAME(const float *x, int64_t K, const WT *p, int64_t ps,   \
                                                           uint32_t mask, const int tb, const int full,         \
                                                           __m512 *acc0, __m512 *acc1) {                        \
        __m512 a0[8], a1[8];                                                                                   \
        const __mmask16 m0 = (__mmask16)(mask & 0xffffu), m1 = (__mmask16)(mask >> 16);                        \
        (void)m0, (void)m1;                                                                                    \
        for (int t = 0; t < tb; t++) a0[t] = a1[t] = _mm512_setzero_ps();                                     \
        for (int64_t k = 0; k < K; k++) {                                                                      \
            const WT *pk = p + k * ps;                                                                         \
            for (int line = 0; line < LINES; line++) {                                                         \
                _mm_prefetch((const char *)pk + 64 * line + PANEL_PREFETCH, _MM_HINT_T0);                      \
                _mm_prefetch((const char *)pk + 64 * line + PANEL_PREFETCH_L2, _MM_HINT_T1);                   \
            }                                                                                                  \
            __m512 w0, w1;                                                                                     \
            LOAD(pk, full, mask, m0, m1, w0, w1);                                                              \
            for (int t = 0; t < tb; t++) {                                                                     \
                const __m512 xb = _mm512_set1_ps(x[t * K + k]);                                                \
                a0[t] = _mm512_fmadd_ps(xb, w0, a0[t]);                                                        \
                a1[t] = _mm512_fmadd_ps(xb, w1, a1[t]);                                                        \
            }                                                                                                  \
        }                                                                                                      \
        for (int t = 0; t < tb; t++) acc0[t] = a0[t], acc1[t] = a1[t];                                        \
    }
#define LOAD_F32(pk, full, mask, m0, m1, w0, w1)                                \
    if (full) {                                                                 \
        w0 = _mm512_loadu_ps(pk);                                               \
        w1 = _mm512_loadu_ps(pk + 16);                                          \
    } else {                                                                    \
        w0 = _mm512_maskz_loadu_ps(m0, pk);                                     \
        w1 = _mm512_maskz_loadu_ps(m1, pk + 16);                                \
    }
DEFINE_PANEL(panel_f32, float, 2, LOAD_F32)
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPECOPS_BF16_WEIGHTS 1
/* bfloat16 weights (drafters: half the bytes streamed), widened to fp32 in registers */
#define LOAD_BF16(pk, full, mask, m0, m1, w0, w1)                                                     \
    {                                                                                                 \
        const __m512i h = full ? _mm512_loadu_si512((const void *)(pk))                               \
                               : _mm512_maskz_loadu_epi16((__mmask32)(mask), (const void *)(pk));     \
        w0 = WIDEN_BF16(_mm512_castsi512_si256(h));                                                   \
        w1 = WIDEN_BF16(_mm512_extracti64x4_epi64(h, 1));                                             \
    }
DEFINE_PANEL(panel_bf16, uint16_t, 1, LOAD_BF16)
#endif

/* y[t, n + lane] = acc (+ bias) (+ add) for the panel's width lanes */
static inline void store_panel(const Job *j, int64_t n, int64_t t0, int tb, int64_t width, const __m512 *acc0,
                               const __m512 *acc1) {
    for (int half = 0; half < 2; half++) {
        const int64_t lanes = width - 16 * half;
        if (lanes <= 0) break;
        const __mmask16 m = lanes >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << lanes) - 1u);
        const int64_t col = n + 16 * half;
        const __m512 b = j->bias ? _mm512_maskz_loadu_ps(m, j->bias + col) : _mm512_setzero_ps();
        for (int t = 0; t < tb; t++) {
            __m512 v = half ? acc1[t] : acc0[t];
            const int64_t at = (t0 + t) * j->N + col;
            if (j->bias) v = _mm512_add_ps(v, b);
            if (j->add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, j->add + at));
            _mm512_mask_storeu_ps(j->y + at, m, v);
        }
    }
}

#define PANEL_CASE(FN, WT, TB)                                                                          \
    case TB:                                                                                            \
        if (full) FN(j->x + t0 * K, K, (const WT *)j->w + n * K, width, mask, TB, 1, acc0, acc1);       \
        else FN(j->x + t0 * K, K, (const WT *)j->w + n * K, width, mask, TB, 0, acc0, acc1);            \
        break;

/* output rows [n0, n1) of the job (n0 a multiple of PANEL), every row of x */
#define DEFINE_RUN_ROWS(NAME, WT, FN)                                                                       \
    static void NAME(const Job *j, int64_t n0, int64_t n1) {                                               \
        const int64_t T = j->T, K = j->K;                                                                   \
        for (int64_t n = n0; n < n1; n += PANEL) {                                                          \
            const int64_t width = j->N - n < PANEL ? j->N - n : PANEL;                                      \
            const int full = width == PANEL;                                                                \
            const uint32_t mask = full ? 0xffffffffu : (uint32_t)((1ull << width) - 1ull);                  \
            for (int64_t t0 = 0; t0 < T; t0 += 8) {                                                         \
                const int tb = (int)(T - t0 < 8 ? T - t0 : 8);                                              \
                __m512 acc0[8], acc1[8];                                                                    \
                switch (tb) { /* constant block sizes, so the accumulators stay in registers */             \
                    PANEL_CASE(FN, WT, 8) PANEL_CASE(FN, WT, 7) PANEL_CASE(FN, WT, 6) PANEL_CASE(FN, WT, 5) \
                    PANEL_CASE(FN, WT, 4) PANEL_CASE(FN, WT, 3) PANEL_CASE(FN, WT, 2) PANEL_CASE(FN, WT, 1) \
                }                                                                                           \
                store_panel(j, n, t0, tb, width, acc0, acc1);                                               \
            }                                                                                               \
        }                                                                                                   \
    }
DEFINE_RUN_ROWS(run_rows_f32, float, panel_f32)
#ifdef SPECOPS_BF16_WEIGHTS
DEFINE_RUN_ROWS(run_rows_bf16, uint16_t, panel_bf16)
#endif

static void run_rows(const Job *j, int64_t n0, int64_t n1) {
#ifdef SPECOPS_BF16_WEIGHTS
    if (j->bf16) {
        run_rows_bf16(j, n0, n1);
        return;
    }
#endif
    run_rows_f32(j, n0, n1);
}
#elif defined(SPECOPS_AVX2)
/* AVX2: the panel's 32 lanes in four 8-lane accumulators per row of x, two rows at a time
 * (13 of the 16 vector registers), over k in [k0, k1): `acc` holds the running sums in and
 * out (so a row's k order, and its bits, are the same however k is cut). */
static inline __attribute__((always_inline)) void panel_avx2(const float *x, int64_t K, const float *p, int64_t ps,
                                                             const __m256i *masks, const int tb, const int full,
                                                             int64_t k0, int64_t k1, int64_t ahead,
                                                             __m256 acc[2][4]) {
    __m256 a[2][4];
    for (int t = 0; t < tb; t++)
        for (int v = 0; v < 4; v++) a[t][v] = acc[t][v];
    for (int64_t k = k0; k < k1; k++) {
        const float *pk = p + k * ps;
        _mm_prefetch((const char *)pk + ahead, _MM_HINT_T0);
        _mm_prefetch((const char *)pk + 64 + ahead, _MM_HINT_T0);
        __m256 w[4];
        for (int v = 0; v < 4; v++) w[v] = full ? _mm256_loadu_ps(pk + 8 * v) : _mm256_maskload_ps(pk + 8 * v, masks[v]);
        for (int t = 0; t < tb; t++) {
            const __m256 xb = _mm256_broadcast_ss(x + t * K + k);
            for (int v = 0; v < 4; v++) a[t][v] = _mm256_fmadd_ps(xb, w[v], a[t][v]);
        }
    }
    for (int t = 0; t < tb; t++)
        for (int v = 0; v < 4; v++) acc[t][v] = a[t][v];
}

/* Rows of x beyond two: with two rows per pass, T rows read each panel T / 2 times. Read
 * whole, pass after pass, the first pass waits on memory while the others only multiply. So
 * the panel is walked in chunks of AVX2_KCHUNK k steps: every pair of rows (up to AVX2_GROUP
 * rows, their sums kept in memory between chunks) takes the chunk while it is in L1, and
 * each pass prefetches the next chunk, so the stream from memory runs under the
 * multiply-adds. Measured on a Zen 1 host (AVX2, 8 MB L3; the bundled target's 33 matrices,
 * both walks alternated in one process, 30 rounds each, with the host's memory slow: T = 1
 * at 2.6-2.9 ms): 3-8 rows 2-7% faster on 2 threads and 4-9% on one, 1, 2 and 16 rows the
 * same. Same bits: each output still adds its k terms in order into one accumulator. */
#define AVX2_KCHUNK 64
#define AVX2_GROUP 16

#define AVX2_CALL(TB, FULL) panel_avx2(j->x + (t0 + 2 * q) * K, K, p, width, masks, TB, FULL, k0, k1, ahead, acc[q])

static void run_rows(const Job *j, int64_t n0, int64_t n1) {
    const int64_t T = j->T, K = j->K, N = j->N;
    for (int64_t n = n0; n < n1; n += PANEL) {
        const int64_t width = N - n < PANEL ? N - n : PANEL;
        const int full = width == PANEL;
        __m256i masks[4];
        for (int v = 0; v < 4; v++) {
            int32_t m[8];
            for (int l = 0; l < 8; l++) m[l] = 8 * v + l < width ? -1 : 0;
            masks[v] = _mm256_loadu_si256((const __m256i *)m);
        }
        const float *p = j->w + n * K;
        for (int64_t t0 = 0; t0 < T; t0 += AVX2_GROUP) {
            const int64_t rows = T - t0 < AVX2_GROUP ? T - t0 : AVX2_GROUP;
            const int pairs = (int)((rows + 1) / 2);
            /* one pass (at most two rows): the whole panel, prefetching 4 KB ahead */
            const int64_t step = pairs == 1 ? K : AVX2_KCHUNK;
            const int64_t ahead = pairs == 1 ? 4096 : AVX2_KCHUNK * width * (int64_t)sizeof(float);
            __m256 acc[AVX2_GROUP / 2][2][4];
            for (int q = 0; q < pairs; q++)
                for (int t = 0; t < 2; t++)
                    for (int v = 0; v < 4; v++) acc[q][t][v] = _mm256_setzero_ps();
            for (int64_t k0 = 0; k0 < K; k0 += step) {
                const int64_t k1 = K - k0 < step ? K : k0 + step;
                for (int q = 0; q < pairs; q++) {
                    const int tb = rows - 2 * q < 2 ? 1 : 2;
                    if (tb == 2) {
                        if (full) AVX2_CALL(2, 1);
                        else AVX2_CALL(2, 0);
                    } else {
                        if (full) AVX2_CALL(1, 1);
                        else AVX2_CALL(1, 0);
                    }
                }
            }
            for (int64_t t = 0; t < rows; t++) {
                float r[PANEL];
                for (int v = 0; v < 4; v++) _mm256_storeu_ps(r + 8 * v, acc[t / 2][t % 2][v]);
                for (int64_t i = 0; i < width; i++) {
                    float v = r[i];
                    if (j->bias) v += j->bias[n + i];
                    const int64_t at = (t0 + t) * N + n + i;
                    if (j->add) v += j->add[at];
                    j->y[at] = v;
                }
            }
        }
    }
}
#else
static void run_rows(const Job *j, int64_t n0, int64_t n1) {
    const int64_t T = j->T, K = j->K, N = j->N;
    for (int64_t n = n0; n < n1; n += PANEL) {
        const int64_t width = N - n < PANEL ? N - n : PANEL;
        const float *p = j->w + n * K;
        for (int64_t t = 0; t < T; t++) {
            float acc[PANEL] = {0.f};
            for (int64_t k = 0; k < K; k++) {
                const float xv = j->x[t * K + k];
                for (int64_t i = 0; i < width; i++) acc[i] = fmaf(xv, p[k * width + i], acc[i]);
            }
            for (int64_t i = 0; i < width; i++) {
                float v = acc[i];
                if (j->bias) v += j->bias[n + i];
                const int64_t at = t * N + n + i;
                if (j->add) v += j->add[at];
                j->y[at] = v;
            }
        }
    }
}
#endif

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
        for (int64_t k = 0; k < K; k++) { /* silu(g) = g / (1 + e^-g) = g e^g / (1 + e^g): e^-|g| never overflows */
            const float g = gate[k], e = exp_nonpos(g < 0.f ? g : -g);
            out[t * K + k] = (g < 0.f ? g * e : g) / (1.0f + e) * up[k];
        }
    }
}

static int linear_job(Job j, int threads);

/* Returns 0, 2 when a buffer could not be allocated, 4 for bf16 weights this build cannot
 * read; threads: how many threads may share the rows (1: the caller alone; fewer when the
 * rows give a thread less than MIN_ROWS_PER_THREAD outputs); mode 0 plain,
 * 1 RMSNorm(g, eps) first, 2 SwiGLU first, | WEIGHTS_BF16 when w is bfloat16. */

/* Whether this build reads bfloat16 weights (AVX-512 BW/VL). */
int specops_bf16_weights(void) {
#ifdef SPECOPS_BF16_WEIGHTS
    return 1;
#else
    return 0;
#endif
}

int specops_linear(const float *x, const float *w, const float *bias, const float *add, float *y, int64_t T,
                   int64_t K, int64_t N, int threads, int mode, const float *g, float eps) {
    Job j = {x, w, bias, add, y, T, K, N, (mode & WEIGHTS_BF16) != 0};
    mode &= ~WEIGHTS_BF16;
    if (j.bf16 && !specops_bf16_weights()) return 4;
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

#define MIN_ROWS_PER_THREAD 128 /* output rows a thread must get for a split to pay */

static int linear_job(Job j, int threads) {
    const int64_t N = j.N;
    const int64_t most = N / MIN_ROWS_PER_THREAD;
    if (most < threads) threads = most < 1 ? 1 : (int)most;
    const int64_t chunks = (N + CHUNK_ROWS - 1) / CHUNK_ROWS;
    if (!pool_take(chunks, threads)) {
        run_rows(&j, 0, N);
        return 0;
    }
    job_kind = JOB_LINEAR;
    job = j;
    pool_run(chunks, threads);
    return 0;
}

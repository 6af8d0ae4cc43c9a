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
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
    int bf16; /* w holds bfloat16 weights (uint16 bit patterns; AVX-512 builds only) */
} Job;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

#if defined(__AVX512F__) && defined(SPECOPS_AVX2)
#define SPECOPS_AVX512 1
#endif

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
#define PANEL 32

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

/* -- attention over a dense (contiguous per head) KV cache --------------------------------
 * The fast runner's decoding step, chain verification and tree verification: T new queries
 * per sequence after P = L - T cached positions. Query t sees every cached position and,
 * of the T new ones, those before it and itself (causal), or those whose bit is set in
 * mask[t] (a Medusa tree: bit i of mask[t] = new position i is t or an ancestor of t).
 *   q    row (b, t) at q + b * q_b + t * q_row, head h at + h * D     (heads, dims contiguous)
 *   k, v sequence b, kv head g, position j at k + b * kv_b + g * kv_h + j * D
 *   out  [B * T, Hq * D]
 * Query head h reads kv head h / (Hq / Hkv).
 *
 * Arithmetic, fixed per query whatever T, the mask's other rows or the thread count: the
 * visible keys are listed in position order; each score is a dot over d in 8-lane blocks
 * (lane l sums d = l, l + 8, ... in order) then a fixed 8-lane reduction; the softmax
 * denominator sums the visible terms in 8 lanes by their rank in the list, then a fixed
 * reduction; the output sums p_j v_j over the list in order. A query that sees the same
 * keys (a tree node and the decoding step of the same token after its ancestors) gets the
 * same bits, so a verification equals decoding steps bit for bit.
 */
#define ATTN_STACK_KEYS 4096
#ifdef SPECOPS_AVX512
#define PAIR_ROWS 1 /* attn_rows pairs the heads of a kv head (attend_pair) */
#else
#define PAIR_ROWS 0
#endif

/* A ragged batch over a block-paged store (`specops_paged_layers`): sequence s owns flat
 * tokens first[s] .. first[s+1]-1, which follow start[s] cached ones; cache position p of
 * s lives in slot tables[s * tstride + p / bs] * bs + p % bs of a slot-major [S, Hkv, D]
 * store; its new tokens see each other causally, or by words[token] when masked[s]. */
typedef struct {
    const int64_t *first, *start;
    const int32_t *tables;
    int64_t tstride, bs;
    const uint64_t *words;
    const int8_t *masked;
    const int32_t *tok_seq; /* [N] the sequence of each flat token */
} PagedMeta;

typedef struct {
    const float *q, *k, *v;
    const uint64_t *mask; /* [T] or NULL (causal) */
    float *out;
    int64_t q_b, q_row, kv_b, kv_h, B, T, Hq, Hkv, D, L;
    float scale;
    int failed;
    const PagedMeta *pg; /* NULL: a dense cache; else B = 1, T = N flat tokens, L = most keys of a token */
} AttnJob;

#ifdef SPECOPS_AVX2
/* the 8 horizontal sums of a[0..7], lane i = ((a_i0 + a_i1) + (a_i2 + a_i3)) + ((a_i4 + a_i5) + (a_i6 + a_i7)) */
static inline __m256 hsum8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* Keys and values are read by position from a cache laid out by slot (a paged store puts a
 * kv head's rows Hkv * D apart): at batch 16 they are more bytes per step than the weights,
 * and without a prefetch the loads of each next block waited on memory (perf, bench mix at
 * concurrency 16: the attention's first loads of a block were the kernel's hottest spot).
 * So each block fetches the rows ATTN_PREFETCH_KEYS keys ahead: a batch-16 decoding step of
 * that mix, in-process, median 4.16 / 3.86 / 3.74 ms without against 3.53 / 3.41 / 3.77 with
 * (three alternating pairs). A dense cache (stride == D: a head's rows back to back) is read
 * in order, which the hardware prefetcher follows: there the explicit prefetches were only
 * instructions (a T = 8 verification's attention 0.281 -> 0.252 ms without them, medians of
 * 400 alternations; the bits are the same). */
#define ATTN_PREFETCH_KEYS 16
static inline void prefetch_row(const float *row, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(row + d, 0, 3);
}

/* whether keys[c0 .. c0 + 7] exist and are 8 consecutive positions (slots): their rows then
 * sit at one base pointer plus multiples of the stride, with no per-key address arithmetic */
static inline int consecutive8(const int32_t *keys, int64_t c0, int64_t n) {
    if (c0 + 8 > n) return 0;
    int same = 1;
    for (int i = 1; i < 8; i++) same &= keys[c0 + i] == keys[c0] + i;
    return same;
}

/* scores[c] = scale * q . k[keys[c]] for c < n (keys: position of each visible key) */
static inline __attribute__((always_inline)) void attn_scores(const float *qh, const float *kh, const int32_t *keys,
                                                              int64_t n, const int64_t D, int64_t stride, float scale,
                                                              float *scores) {
#ifdef SPECOPS_AVX2
    if (D % 8 == 0) {
        const __m256 vs = _mm256_set1_ps(scale);
        for (int64_t c0 = 0; c0 < n; c0 += 8) {
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            if (stride != D) for (int64_t i = c0 + ATTN_PREFETCH_KEYS; i < c0 + ATTN_PREFETCH_KEYS + 8 && i < n; i++)
                prefetch_row(kh + (int64_t)keys[i] * stride, D);
            if (consecutive8(keys, c0, n)) { /* one base pointer */
                const float *kr = kh + (int64_t)keys[c0] * stride;
                for (int64_t d = 0; d < D; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qh + d);
                    for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + i * stride + d), acc[i]);
                }
            } else {
                const float *kr[8];
                for (int i = 0; i < 8; i++) kr[i] = kh + (int64_t)keys[c0 + i < n ? c0 + i : c0] * stride; /* pad: a real key, result dropped */
                for (int64_t d = 0; d < D; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qh + d);
                    for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[i] + d), acc[i]);
                }
            }
            const __m256 sc = _mm256_mul_ps(hsum8(acc), vs);
            if (c0 + 8 <= n) {
                _mm256_storeu_ps(scores + c0, sc);
            } else {
                float tmp[8];
                _mm256_storeu_ps(tmp, sc);
                for (int64_t i = 0; c0 + i < n; i++) scores[c0 + i] = tmp[i];
            }
        }
        return;
    }
#endif
    for (int64_t c = 0; c < n; c++) {
        const float *kj = kh + (int64_t)keys[c] * stride;
        float s = 0.f;
        for (int64_t d = 0; d < D; d++) s += qh[d] * kj[d];
        scores[c] = s * scale;
    }
}

#ifdef SPECOPS_AVX2
/* scores[0..n) <- exp(score - max) in place; returns their sum, in 8 lanes by rank (a
 * zero-padded last block) then a fixed reduction */
static inline __attribute__((always_inline)) float softmax_terms(float *scores, int64_t n) {
    __m256 vm = _mm256_set1_ps(-INFINITY);
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(scores + c));
    float mx[8];
    _mm256_storeu_ps(mx, vm);
    float m = mx[0];
    for (int i = 1; i < 8; i++) m = mx[i] > m ? mx[i] : m;
    for (; c < n; c++) m = scores[c] > m ? scores[c] : m;
    for (int64_t cc = 0; cc < n; cc++) scores[cc] = exp_nonpos(scores[cc] - m);
    __m256 lanes = _mm256_setzero_ps();
    for (c = 0; c + 8 <= n; c += 8) lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(scores + c));
    if (c < n) {
        float tail[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int i = 0; c + i < n; i++) tail[i] = scores[c + i];
        lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(tail));
    }
    float l[8];
    _mm256_storeu_ps(l, lanes);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}
#endif

#ifdef SPECOPS_AVX512
#define PAIR_MAX_D 32 /* head sizes whose two rows' accumulators fit the 32 vector registers */
/* Two rows that share their keys (query heads of one kv head, one token) in one pass over the
 * keys and values: each key and value vector is loaded once for both. Each row's arithmetic
 * is attend_d's exactly (the same sums in the same order), so a row's bits do not depend on
 * whether it was paired. D % 8 == 0, D <= PAIR_MAX_D. */
static inline __attribute__((always_inline)) void attend_pair_d(const float *qa, const float *qb, const float *kh,
                                                                const float *vh, const int32_t *keys, int64_t n,
                                                                const int64_t D, int64_t stride, float scale,
                                                                float *sa, float *sb, float *oa, float *ob) {
    const __m256 vs = _mm256_set1_ps(scale);
    for (int64_t c0 = 0; c0 < n; c0 += 8) {
        __m256 aa[8], ab[8];
        for (int i = 0; i < 8; i++) aa[i] = ab[i] = _mm256_setzero_ps();
        const float *kr[8];
        if (stride != D) for (int64_t i = c0 + ATTN_PREFETCH_KEYS; i < c0 + ATTN_PREFETCH_KEYS + 8 && i < n; i++)
            prefetch_row(kh + (int64_t)keys[i] * stride, D);
        if (consecutive8(keys, c0, n)) {
            for (int i = 0; i < 8; i++) kr[i] = kh + ((int64_t)keys[c0] + i) * stride;
        } else {
            for (int i = 0; i < 8; i++) kr[i] = kh + (int64_t)keys[c0 + i < n ? c0 + i : c0] * stride; /* pad: a real key, result dropped */
        }
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qva = _mm256_loadu_ps(qa + d), qvb = _mm256_loadu_ps(qb + d);
            for (int i = 0; i < 8; i++) {
                const __m256 kv = _mm256_loadu_ps(kr[i] + d);
                aa[i] = _mm256_fmadd_ps(qva, kv, aa[i]);
                ab[i] = _mm256_fmadd_ps(qvb, kv, ab[i]);
            }
        }
        const __m256 xa = _mm256_mul_ps(hsum8(aa), vs), xb = _mm256_mul_ps(hsum8(ab), vs);
        if (c0 + 8 <= n) {
            _mm256_storeu_ps(sa + c0, xa);
            _mm256_storeu_ps(sb + c0, xb);
        } else {
            float ta[8], tb[8];
            _mm256_storeu_ps(ta, xa);
            _mm256_storeu_ps(tb, xb);
            for (int64_t i = 0; c0 + i < n; i++) sa[c0 + i] = ta[i], sb[c0 + i] = tb[i];
        }
    }
    const float total_a = softmax_terms(sa, n), total_b = softmax_terms(sb, n);
    __m256 ea[PAIR_MAX_D / 8], fa[PAIR_MAX_D / 8], eb[PAIR_MAX_D / 8], fb[PAIR_MAX_D / 8];
    const int64_t nv = D / 8;
    for (int64_t i = 0; i < nv; i++) ea[i] = fa[i] = eb[i] = fb[i] = _mm256_setzero_ps();
    int64_t cc = 0;
    for (; cc + 2 <= n; cc += 2) {
        if (stride != D) for (int64_t i = cc + ATTN_PREFETCH_KEYS; i < cc + ATTN_PREFETCH_KEYS + 2 && i < n; i++)
            prefetch_row(vh + (int64_t)keys[i] * stride, D);
        const __m256 pa0 = _mm256_set1_ps(sa[cc]), pa1 = _mm256_set1_ps(sa[cc + 1]);
        const __m256 pb0 = _mm256_set1_ps(sb[cc]), pb1 = _mm256_set1_ps(sb[cc + 1]);
        const float *v0 = vh + (int64_t)keys[cc] * stride, *v1 = vh + (int64_t)keys[cc + 1] * stride;
        for (int64_t i = 0; i < nv; i++) {
            const __m256 x0 = _mm256_loadu_ps(v0 + 8 * i), x1 = _mm256_loadu_ps(v1 + 8 * i);
            ea[i] = _mm256_fmadd_ps(pa0, x0, ea[i]);
            fa[i] = _mm256_fmadd_ps(pa1, x1, fa[i]);
            eb[i] = _mm256_fmadd_ps(pb0, x0, eb[i]);
            fb[i] = _mm256_fmadd_ps(pb1, x1, fb[i]);
        }
    }
    if (cc < n) {
        const __m256 pa0 = _mm256_set1_ps(sa[cc]), pb0 = _mm256_set1_ps(sb[cc]);
        const float *v0 = vh + (int64_t)keys[cc] * stride;
        for (int64_t i = 0; i < nv; i++) {
            const __m256 x0 = _mm256_loadu_ps(v0 + 8 * i);
            ea[i] = _mm256_fmadd_ps(pa0, x0, ea[i]);
            eb[i] = _mm256_fmadd_ps(pb0, x0, eb[i]);
        }
    }
    const __m256 ia = _mm256_set1_ps(1.0f / total_a), ib = _mm256_set1_ps(1.0f / total_b);
    for (int64_t i = 0; i < nv; i++) {
        _mm256_storeu_ps(oa + 8 * i, _mm256_mul_ps(_mm256_add_ps(ea[i], fa[i]), ia));
        _mm256_storeu_ps(ob + 8 * i, _mm256_mul_ps(_mm256_add_ps(eb[i], fb[i]), ib));
    }
}
#endif

/* One (query, head) row over its n keys (key c at kh / vh + keys[c] * stride). One compiled
 * copy serves the dense and the paged batches, so both round alike. */
static inline __attribute__((always_inline)) void attend_d(const float *qh, const float *kh, const float *vh,
                                                           const int32_t *keys, int64_t n, const int64_t D,
                                                           int64_t stride, float scale, float *scores, float *oh) {
    attn_scores(qh, kh, keys, n, D, stride, scale, scores);
#ifdef SPECOPS_AVX2
    if (D % 8 == 0 && D <= 128) {
        /* max, exp and the denominator in 8 lanes by rank (a zero-padded last block), then the
         * output in two interleaved sums (even / odd ranks) added at the end: two chains of
         * FMAs, not one, per output vector */
        const float total = softmax_terms(scores, n);
        __m256 e[16], o[16];
        const int64_t nv = D / 8;
        for (int64_t i = 0; i < nv; i++) e[i] = o[i] = _mm256_setzero_ps();
        int64_t cc = 0;
        for (; cc + 2 <= n; cc += 2) {
            if (stride != D) for (int64_t i = cc + ATTN_PREFETCH_KEYS; i < cc + ATTN_PREFETCH_KEYS + 2 && i < n; i++)
                prefetch_row(vh + (int64_t)keys[i] * stride, D);
            const __m256 p0 = _mm256_set1_ps(scores[cc]), p1 = _mm256_set1_ps(scores[cc + 1]);
            const float *v0 = vh + (int64_t)keys[cc] * stride, *v1 = vh + (int64_t)keys[cc + 1] * stride;
            for (int64_t i = 0; i < nv; i++) {
                e[i] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * i), e[i]);
                o[i] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + 8 * i), o[i]);
            }
        }
        if (cc < n) {
            const __m256 p0 = _mm256_set1_ps(scores[cc]);
            const float *v0 = vh + (int64_t)keys[cc] * stride;
            for (int64_t i = 0; i < nv; i++) e[i] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * i), e[i]);
        }
        const __m256 vi = _mm256_set1_ps(1.0f / total);
        for (int64_t i = 0; i < nv; i++) _mm256_storeu_ps(oh + 8 * i, _mm256_mul_ps(_mm256_add_ps(e[i], o[i]), vi));
        return;
    }
#endif
    float m = -INFINITY;
    for (int64_t c = 0; c < n; c++) m = scores[c] > m ? scores[c] : m;
    float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t c = 0; c < n; c++) {
        scores[c] = exp_nonpos(scores[c] - m);
        lanes[c % 8] += scores[c];
    }
    const float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; d++) oh[d] = 0.f;
    for (int64_t cc = 0; cc < n; cc++) {
        const float p = scores[cc];
        const float *vj = vh + (int64_t)keys[cc] * stride;
        for (int64_t d = 0; d < D; d++) oh[d] = __builtin_fmaf(p, vj[d], oh[d]);
    }
    for (int64_t d = 0; d < D; d++) oh[d] *= inv;
}

/* attend_d with the usual head sizes as constants, so its loops over D unroll (a runtime D
 * left a compare and branch after every vector of the output's sums: 0.6 of the time of a
 * T = 8 verification's attention, measured with perf on the bundled target's shapes). The
 * arithmetic is attend_d's either way. */
static __attribute__((noinline)) void attend(const float *qh, const float *kh, const float *vh, const int32_t *keys,
                                             int64_t n, int64_t D, int64_t stride, float scale, float *scores,
                                             float *oh) {
    switch (D) {
        case 32: attend_d(qh, kh, vh, keys, n, 32, stride, scale, scores, oh); break;
        case 64: attend_d(qh, kh, vh, keys, n, 64, stride, scale, scores, oh); break;
        case 128: attend_d(qh, kh, vh, keys, n, 128, stride, scale, scores, oh); break;
        default: attend_d(qh, kh, vh, keys, n, D, stride, scale, scores, oh); break;
    }
}

/* Rows h and h + 1 of one token (query pointer qh, outputs oh, each next head D further on),
 * which share the key list and kv head: attend_pair_d where it applies, else two attend calls. */
static void attend_pair(const float *qh, const float *kh, const float *vh, const int32_t *keys, int64_t n, int64_t D,
                        int64_t stride, float scale, float *scores, float *scores2, float *oh) {
#ifdef SPECOPS_AVX512
    if (D == 32) {
        attend_pair_d(qh, qh + D, kh, vh, keys, n, 32, stride, scale, scores, scores2, oh, oh + D);
        return;
    }
#endif
    (void)scores2;
    attend(qh, kh, vh, keys, n, D, stride, scale, scores, oh);
    attend(qh + D, kh, vh, keys, n, D, stride, scale, scores, oh + D);
}

/* Row `row` = (token, head) of a job, and with `pair` row + 1 too (the next head of the same
 * token and kv head: see attend_pair_d); the key list is built once per token (*have names the
 * token keys[0..*n) belong to) and shared by its heads. scores2: the second row's scores. */
static void attn_row(const AttnJob *a, int64_t row, int pair, float *scores, float *scores2, int32_t *keys,
                     int64_t *have, int64_t *n) {
    const int64_t Hq = a->Hq, D = a->D;
    const int64_t h = row % Hq, tok = row / Hq;
    const int64_t g = h / (Hq / a->Hkv);
    const PagedMeta *pg = a->pg;
    if (pg != NULL) { /* flat token tok of sequence s: its prefix, then its visible new tokens, as slots */
        const int64_t s = pg->tok_seq[tok], t = tok - pg->first[s], P = pg->start[s];
        const int64_t T = pg->first[s + 1] - pg->first[s], bs = pg->bs;
        if (*have != tok) {
            const int32_t *table = pg->tables + s * pg->tstride;
            int64_t c = 0;
            for (int64_t j = 0; j < P; j++) keys[c++] = (int32_t)((int64_t)table[j / bs] * bs + j % bs);
            const int masked = pg->masked[s] != 0;
            const uint64_t bits = masked ? pg->words[tok] : 0;
            for (int64_t i = 0; i < (masked ? T : t + 1); i++) {
                if (masked && !((bits >> i) & 1u)) continue;
                const int64_t p = P + i;
                keys[c++] = (int32_t)((int64_t)table[p / bs] * bs + p % bs);
            }
            *n = c;
            *have = tok;
        }
        const int64_t stride = a->Hkv * D;
        if (pair)
            attend_pair(a->q + tok * a->q_row + h * D, a->k + g * D, a->v + g * D, keys, *n, D, stride, a->scale,
                        scores, scores2, a->out + tok * Hq * D + h * D);
        else
            attend(a->q + tok * a->q_row + h * D, a->k + g * D, a->v + g * D, keys, *n, D, stride, a->scale, scores,
                   a->out + tok * Hq * D + h * D);
        return;
    }
    const int64_t T = a->T, L = a->L, P = L - T;
    const int64_t t = tok % T, b = tok / T;
    if (*have != t) { /* the same positions for every sequence of the batch */
        int64_t c = 0;
        for (int64_t j = 0; j < P; j++) keys[c++] = (int32_t)j;
        if (a->mask == NULL) {
            for (int64_t i = 0; i <= t; i++) keys[c++] = (int32_t)(P + i);
        } else {
            const uint64_t bits = a->mask[t];
            for (int64_t i = 0; i < T; i++)
                if ((bits >> i) & 1u) keys[c++] = (int32_t)(P + i);
        }
        *n = c;
        *have = t;
    }
    if (pair)
        attend_pair(a->q + b * a->q_b + t * a->q_row + h * D, a->k + b * a->kv_b + g * a->kv_h,
                    a->v + b * a->kv_b + g * a->kv_h, keys, *n, D, D, a->scale, scores, scores2,
                    a->out + (b * T + t) * Hq * D + h * D);
    else
        attend(a->q + b * a->q_b + t * a->q_row + h * D, a->k + b * a->kv_b + g * a->kv_h,
               a->v + b * a->kv_b + g * a->kv_h, keys, *n, D, D, a->scale, scores, a->out + (b * T + t) * Hq * D + h * D);
}

static void attn_rows(AttnJob *a, int64_t r0, int64_t r1) {
    float stack_scores[2 * ATTN_STACK_KEYS];
    int32_t stack_keys[ATTN_STACK_KEYS];
    float *scores = stack_scores;
    int32_t *keys = stack_keys;
    if (a->L > ATTN_STACK_KEYS) {
        scores = (float *)malloc(sizeof(float) * 2 * (size_t)a->L);
        keys = (int32_t *)malloc(sizeof(int32_t) * (size_t)a->L);
        if (scores == NULL || keys == NULL) {
            free(scores);
            free(keys);
            a->failed = 1;
            return;
        }
    }
    float *scores2 = scores + (a->L > ATTN_STACK_KEYS ? a->L : ATTN_STACK_KEYS);
    int64_t have = -1, n = 0;
    const int64_t group = a->Hq / a->Hkv; /* query heads per kv head */
    for (int64_t r = r0; r < r1; r++) {
        const int64_t h = r % a->Hq;
        const int pair = PAIR_ROWS && group % 2 == 0 && h % 2 == 0 && r + 1 < r1; /* h, h + 1: one kv head */
        attn_row(a, r, pair, scores, scores2, keys, &have, &n);
        r += pair;
    }
    if (scores != stack_scores) {
        free(scores);
        free(keys);
    }
}

/* -- a persistent pool ------------------------------------------------------------------
 * The output rows are cut into chunks of CHUNK_ROWS; the caller and the workers claim
 * chunks from one atomic ticket (job word | chunks | next), so a worker the OS has not
 * scheduled yet costs nothing: the caller takes its chunks. A job runs on at most the
 * `threads` it was given: the caller and workers 0 .. threads - 2. The job word carries
 * that helper count, and a worker whose index is not below it leaves the job alone (and
 * keeps sleeping, if it sleeps: each worker has its own condition variable, and the
 * caller signals only the helpers it wants). Workers spin a little after a job they took
 * part in (a decoding step calls every few tens of microseconds), then sleep. The caller
 * waits only for chunks already claimed, yielding the CPU while it waits.
 * Fixed-width types throughout: the ticket is a 64-bit word on every platform.
 */
#define CHUNK_ROWS 64
#define HELPER_BITS 8 /* low bits of a job word: how many workers may help (< MAX_THREADS) */
#define HELPER_MASK ((1u << HELPER_BITS) - 1u)
_Static_assert(MAX_THREADS <= (1 << HELPER_BITS), "a job word holds the helper count");
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER; /* one caller at a time */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t ticket; /* job word << 32 | chunks << 16 | next chunk */
static atomic_int done;
static _Atomic uint32_t generation; /* the job word: sequence number << HELPER_BITS | helpers */
static atomic_int helped; /* workers that ran at least one chunk of the last pooled job */
static atomic_int last_threads; /* threads (the caller included) that ran the last pooled job */
static int workers; /* started */
static struct {
    pthread_cond_t wake;
    atomic_int asleep;
    uint32_t start; /* the job word when it was started: jobs before it are not its own */
} slot[MAX_THREADS];
static int job_kind; /* JOB_LINEAR or JOB_ATTENTION */
static int64_t job_chunk; /* attention rows per chunk */
static Job job;
static AttnJob attn_job;
enum { JOB_LINEAR, JOB_ATTENTION };

static int claim(uint32_t gen) { /* the next chunk of job `gen`, or -1 */
    uint64_t t = atomic_load(&ticket);
    for (;;) {
        const uint32_t next = (uint32_t)(t & 0xffffu), chunks = (uint32_t)((t >> 16) & 0xffffu);
        if ((uint32_t)(t >> 32) != gen || next >= chunks) return -1;
        if (atomic_compare_exchange_weak(&ticket, &t, t + 1)) return (int)next;
    }
}

static void work(uint32_t gen, int helper) {
    int c, first = 1;
    while ((c = claim(gen)) >= 0) { /* the job is stable while a chunk of it is claimed and not done */
        if (helper && first) atomic_fetch_add(&helped, 1); /* before `done`: the caller sees it */
        first = 0;
        if (job_kind == JOB_LINEAR) {
            int64_t n0 = (int64_t)c * CHUNK_ROWS, n1 = n0 + CHUNK_ROWS;
            run_rows(&job, n0, n1 < job.N ? n1 : job.N);
        } else {
            const int64_t rows = attn_job.B * attn_job.T * attn_job.Hq;
            int64_t r0 = (int64_t)c * job_chunk, r1 = r0 + job_chunk;
            attn_rows(&attn_job, r0, r1 < rows ? r1 : rows);
        }
        atomic_fetch_add(&done, 1);
    }
}

/* Whether job word `gen` is a new job (not `seen`) that worker `me` helps with. */
static inline int wanted(uint32_t gen, uint32_t seen, int me) {
    return gen != seen && (uint32_t)me < (gen & HELPER_MASK);
}

static void *worker(void *arg) {
    const int me = (int)(intptr_t)arg;
    uint32_t seen = slot[me].start;
    for (;;) {
        int spins = 0;
        uint32_t gen;
        while (!wanted(gen = atomic_load(&generation), seen, me)) {
            seen = gen; /* a job without this worker: skipped, the spin count goes on */
            if (++spins < SPIN_ROUNDS) {
                cpu_relax();
                continue;
            }
            atomic_store(&slot[me].asleep, 1); /* before the check below: pool_run sees it or we see the job */
            pthread_mutex_lock(&sleep_lock);
            while (!wanted(gen = atomic_load(&generation), seen, me)) pthread_cond_wait(&slot[me].wake, &sleep_lock);
            pthread_mutex_unlock(&sleep_lock);
            atomic_store(&slot[me].asleep, 0);
            break;
        }
        seen = gen;
        work(gen, 1);
    }
    return NULL;
}

static void after_fork_child(void) { /* the workers did not survive the fork */
    workers = 0;
    pthread_mutex_init(&pool_lock, NULL);
    pthread_mutex_init(&sleep_lock, NULL);
    for (int i = 0; i < MAX_THREADS; i++) {
        pthread_cond_init(&slot[i].wake, NULL);
        atomic_store(&slot[i].asleep, 0);
    }
}

static int ensure_workers(int wanted_workers) {
    static int registered = 0;
    if (!registered) {
        for (int i = 0; i < MAX_THREADS; i++) pthread_cond_init(&slot[i].wake, NULL);
        pthread_atfork(NULL, NULL, after_fork_child);
        registered = 1;
    }
    while (workers < wanted_workers && workers + 1 < MAX_THREADS) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        slot[workers].start = atomic_load(&generation);
        atomic_store(&slot[workers].asleep, 0);
        int rc = pthread_create(&tid, &attr, worker, (void *)(intptr_t)workers);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        workers++;
    }
    return workers;
}

/* The pool's workers started so far (they stay for the life of the process). */
int specops_pool_workers(void) { return workers; }

/* How many threads, the caller included, ran chunks of the last job split over the pool
 * (at most the job's `threads`; 0 before the first). */
int specops_pool_last_threads(void) { return atomic_load(&last_threads); }

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
#define WEIGHTS_BF16 8 /* a mode flag: w holds bfloat16 weights */

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

/* Runs the job set in `job` / `attn_job` (kind, chunks) on the caller and threads - 1
 * workers (0 .. threads - 2; pool_take started them); the caller holds pool_lock. */
static void pool_run(int64_t chunks, int threads) {
    const uint32_t helpers = (uint32_t)(threads - 1 < workers ? threads - 1 : workers);
    atomic_store(&done, 0);
    atomic_store(&helped, 0);
    const uint32_t gen = ((atomic_load(&generation) >> HELPER_BITS) + 1u) << HELPER_BITS | helpers;
    atomic_store(&ticket, (uint64_t)gen << 32 | (uint64_t)chunks << 16);
    atomic_store(&generation, gen);
    for (uint32_t i = 0; i < helpers; i++) {
        if (!atomic_load(&slot[i].asleep)) continue; /* spinning: it sees the new word */
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_signal(&slot[i].wake);
        pthread_mutex_unlock(&sleep_lock);
    }
    work(gen, 0);
    for (int spins = 0; atomic_load(&done) < chunks; spins++) {
        if (spins < 1000)
            cpu_relax();
        else
            sched_yield(); /* a worker holds a chunk but has no CPU: give it ours */
    }
    atomic_store(&last_threads, 1 + atomic_load(&helped));
    pthread_mutex_unlock(&pool_lock);
}

/* Takes the pool for a job of `chunks` chunks over `threads` threads; 0 when it should run
 * on the caller alone (one thread, one chunk, or another caller holds the pool). */
static int pool_take(int64_t chunks, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || chunks < 2 || chunks > 0xffff || pthread_mutex_trylock(&pool_lock) != 0) return 0;
    if (ensure_workers(threads - 1) < 1) {
        pthread_mutex_unlock(&pool_lock);
        return 0;
    }
    return 1;
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

#define ATTN_SPLIT_WORK 2048 /* query rows x keys from which attention is split over threads */

static int attention(AttnJob a, int threads) {
    const int64_t rows = a.B * a.T * a.Hq;
    a.failed = 0;
    if (rows * a.L < ATTN_SPLIT_WORK) threads = 1;
    int64_t per = rows / (4 * (threads > 1 ? threads : 1));
    if (per < 1) per = 1;
    if (PAIR_ROWS && per % 2) per++; /* a chunk never splits the two heads of a pair (attn_rows) */
    const int64_t chunks = (rows + per - 1) / per;
    if (!pool_take(chunks, threads)) {
        attn_rows(&a, 0, rows);
        return a.failed ? 2 : 0;
    }
    job_kind = JOB_ATTENTION;
    job_chunk = per;
    attn_job = a;
    pool_run(chunks, threads);
    return attn_job.failed ? 2 : 0;
}

/* Returns 0, or 2 when no score buffer could be allocated (L > ATTN_STACK_KEYS). mask: [T]
 * visibility bits over the new positions, or NULL for causal; T <= 64 with a mask. */
int specops_attention(const float *q, int64_t q_b, int64_t q_row, const float *k, const float *v, int64_t kv_b,
                      int64_t kv_h, float *out, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t L,
                      float scale, const uint64_t *mask, int threads) {
    if (mask != NULL && T > 64) return 3;
    AttnJob a = {q, k, v, mask, out, q_b, q_row, kv_b, kv_h, B, T, Hq, Hkv, D, L, scale, 0, NULL};
    return attention(a, threads);
}

#define ROPE_MAX_D 1024
/* Rotary embeddings on `heads` heads of one token's row (in place; sin with its first half
 * negated). One compiled copy for the dense and the paged paths: the same bits. */
static __attribute__((noinline)) void rope_row(float *row, const float *c, const float *s, int64_t heads, int64_t D) {
    const int64_t half = D / 2;
    float tmp[ROPE_MAX_D];
    for (int64_t h = 0; h < heads; h++) {
        float *x = row + h * D;
        for (int64_t d = 0; d < half; d++) tmp[d] = x[d] * c[d] + x[d + half] * s[d];
        for (int64_t d = half; d < D; d++) tmp[d] = x[d] * c[d] + x[d - half] * s[d];
        memcpy(x, tmp, sizeof(float) * (size_t)D);
    }
}

/* The whole attention block of a decoding step / chain or tree verification after the
 * linear q/k/v projection: rotary embeddings on the q and k heads (in place in qkv), the new
 * keys and values written into the cache at slots start..start+T-1, then attention over
 * start + T keys, causal or by `mask` (see specops_attention).
 *   qkv        [B, T, Hq + 2 Hkv, D] contiguous: q heads, k heads, v heads
 *   cos, sin   [T, D] the rows of the new tokens' positions (start.. for a chain, start +
 *              depth for a tree node; sin with its first half negated:
 *              rotate_half(x) * sin == x[(d + D/2) % D] * signed_sin[d])
 *   k_cache, v_cache  position j of sequence b, kv head g at + b * kv_b + g * kv_h + j * D
 */
int specops_rope_cache_attention(float *qkv, const float *cos, const float *sin, float *k_cache, float *v_cache,
                                 int64_t kv_b, int64_t kv_h, int64_t start, float *out, int64_t B, int64_t T,
                                 int64_t Hq, int64_t Hkv, int64_t D, float scale, const uint64_t *mask,
                                 int threads) {
    const int64_t H = Hq + 2 * Hkv;
    if (mask != NULL && T > 64) return 3;
    if (D > ROPE_MAX_D || D % 2) return 3;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = 0; t < T; t++) {
            float *row = qkv + (b * T + t) * H * D;
            rope_row(row, cos + t * D, sin + t * D, Hq + Hkv, D);
            for (int64_t g = 0; g < Hkv; g++) {
                const int64_t at = b * kv_b + g * kv_h + (start + t) * D;
                memcpy(k_cache + at, row + (Hq + g) * D, sizeof(float) * (size_t)D);
                memcpy(v_cache + at, row + (Hq + Hkv + g) * D, sizeof(float) * (size_t)D);
            }
        }
    }
    AttnJob a = {qkv, k_cache, v_cache, mask, out, T * H * D, H * D, kv_b, kv_h, B, T, Hq, Hkv, D, start + T, scale, 0,
                 NULL};
    return attention(a, threads);
}

/* -- a whole forward of a Llama-family layer stack -----------------------------------------
 * One sequence (B = 1), T new tokens after `start` cached ones, every layer:
 *   x += o(attention(rope(qkv(rmsnorm(x, ln1)))))      (the new keys / values into the cache)
 *   x += down(silu(gate) * up),  gate | up = gate_up(rmsnorm(x, ln2))
 * with the calls above, so each step computes exactly what the per-call path computes.
 * Saves the Python side a dozen calls per layer. x [T, E] is updated in place (the
 * residual stream after the last layer); then, when given, hidden [T, E] = rmsnorm(x, norm)
 * and logits [R, V] = hidden head_w^T (+ head_b) for the last R = logit_rows rows of hidden
 * (R = T: every row; a prompt pass reads only its last row, or none, and the LM head over
 * the rest is wasted work: 2 of a 24 ms 190-token pass of the bundled target), and when
 * argmax is given, argmax [R] = each logit row's `specops_argmax_rows` (a greedy caller's
 * choice, read while the rows are still in cache rather than by another call from Python).
 *   scratch  at least T * (Hq + 2 Hkv) * D + T * Hq * D + T * 2 * I floats
 * Returns 0, or the first failing call's code. */
typedef struct {
    const float *ln1, *qkv_w, *qkv_b, *o_w, *o_b, *ln2, *gu_w, *gu_b, *down_w, *down_b;
    float *k_cache, *v_cache; /* [B, Hkv, S, D] views of this layer's cache */
    int64_t flags;            /* WEIGHTS_BF16 when the four matrices are bfloat16 */
} LayerWeights;

void specops_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out); /* below */

/* The rest of a layer after attention, the same calls for both stacks: x += o(att), then
 * x += down(silu(gate) * up) with gate | up = gate_up(rmsnorm(x, ln2)); gu is [T, 2 I] scratch. */
static int layer_tail(const LayerWeights *l, const float *att, float *x, float *gu, int64_t T, int64_t E, int64_t A,
                      int64_t I, float eps, int threads) {
    const int f = (int)l->flags;
    int rc = specops_linear(att, l->o_w, l->o_b, x, x, T, A, E, threads, f, NULL, 0.f);
    if (rc == 0) rc = specops_linear(x, l->gu_w, l->gu_b, NULL, gu, T, E, 2 * I, threads, 1 | f, l->ln2, eps);
    if (rc == 0) rc = specops_linear(gu, l->down_w, l->down_b, x, x, T, I, E, threads, 2 | f, NULL, 0.f);
    return rc;
}

int specops_llama_layers(const LayerWeights *layers, int64_t n_layers, float *x, int64_t T, int64_t E, int64_t Hq,
                         int64_t Hkv, int64_t D, int64_t I, float eps, float scale, const float *cos,
                         const float *sin, int64_t kv_b, int64_t kv_h, int64_t start, const uint64_t *mask,
                         float *scratch, int threads, const float *norm, const float *head_w, const float *head_b,
                         int64_t V, float *hidden, float *logits, int head_flags, int64_t logit_rows,
                         int64_t *argmax) {
    const int64_t H = Hq + 2 * Hkv;
    float *qkv = scratch, *att = qkv + T * H * D, *gu = att + T * Hq * D;
    if (logit_rows < 0 || logit_rows > T) return 3; /* before any cache write */
    for (int64_t i = 0; i < n_layers; i++) {
        const LayerWeights *l = layers + i;
        const int f = (int)l->flags;
        int rc = specops_linear(x, l->qkv_w, l->qkv_b, NULL, qkv, T, E, H * D, threads, 1 | f, l->ln1, eps);
        if (rc == 0)
            rc = specops_rope_cache_attention(qkv, cos, sin, l->k_cache, l->v_cache, kv_b, kv_h, start, att, 1, T, Hq,
                                              Hkv, D, scale, mask, threads);
        if (rc == 0) rc = layer_tail(l, att, x, gu, T, E, Hq * D, I, eps, threads);
        if (rc != 0) return rc;
    }
    if (hidden != NULL) rms_norm_rows(x, norm, eps, T, E, hidden);
    if (logits != NULL && logit_rows > 0) {
        const int rc = specops_linear(hidden + (T - logit_rows) * E, head_w, head_b, NULL, logits, logit_rows, E, V,
                                      threads, head_flags, NULL, 0.f);
        if (rc == 0 && argmax != NULL) specops_argmax_rows(logits, logit_rows, V, argmax);
        return rc;
    }
    return 0;
}

/* The index drawn from the non-negative weights w[0..V-1] (a positive total) by inverse
 * CDF with the uniform u: the first index whose running sum, in double, exceeds u times the
 * total (summed in the same order). A zero weight is never drawn (the running sum does not
 * move past it); u * total rounded up to the total gives the last nonzero entry. */
static int64_t draw_cdf(const float *w, int64_t V, double u) {
    double total = 0.0;
    for (int64_t v = 0; v < V; v++) total += w[v];
    const double target = u * total;
    double run = 0.0;
    for (int64_t v = 0; v < V; v++) {
        run += w[v];
        if (run > target) return v;
    }
    for (int64_t v = V - 1; v > 0; v--)
        if (w[v] > 0.f) return v;
    return 0;
}

/* p = softmax(x * inv_temp) over V entries into p (exp_nonpos after the max, each term
 * divided by the sum in double, then rounded to float) */
static void softmax_row(const float *x, int64_t V, float inv_temp, float *p) {
    float m = -INFINITY;
    int64_t v0 = 0;
#ifdef SPECOPS_AVX2
    /* the maximum in 8 lanes (the scalar loop's compare chain does not vectorize): max_ps(a, m)
     * is a > m ? a : m, the scalar rule, lane by lane; so a NaN term is skipped alike */
    if (V >= 8) {
        const __m256 it = _mm256_set1_ps(inv_temp);
        __m256 mv = _mm256_set1_ps(-INFINITY);
        for (; v0 + 8 <= V; v0 += 8) mv = _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + v0), it), mv);
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    }
#endif
    for (int64_t v = v0; v < V; v++) m = x[v] * inv_temp > m ? x[v] * inv_temp : m;
    /* each term once, into p (a loop of nothing else vectorizes; the sum's loop below and the
     * division's each called exp_nonpos again: ~85 us a 4k row on a Zen 1 host) */
    for (int64_t v = 0; v < V; v++) p[v] = exp_nonpos(x[v] * inv_temp - m);
    double sum = 0.0;
    for (int64_t v = 0; v < V; v++) sum += p[v];
    for (int64_t v = 0; v < V; v++) p[v] = (float)(p[v] / sum);
}

/* Lossless rejection sampling of one drafted block in one call (Leviathan et al. 2023,
 * Algorithm 1), the target's p = softmax(logits * inv_temp) computed here from its logits
 * [G + 1, V]: drafted token i (of `draft`, drawn from q row i [G, V], or q NULL: a
 * deterministic drafter, a point mass) is accepted while u[i] * q_i(x) < p_i(x); at the
 * first rejection n the next token is drawn from max(p_n - q_n, 0) (p_n itself when that is
 * all zero), after a fully accepted block from p_G, by `draw_cdf` with u_draw. The same
 * uniforms in the same roles as `verify.verify_sampling`. `row` is V floats of scratch. */
void specops_verify_sampled(const float *logits, const float *q, const int64_t *draft, int64_t G, int64_t V,
                            float inv_temp, const float *u, double u_draw, float *row, int64_t *accepted,
                            int64_t *next) {
    int64_t n = 0;
    for (; n < G; n++) {
        softmax_row(logits + n * V, V, inv_temp, row);
        const int64_t x = draft[n];
        const float q_x = q == NULL ? 1.0f : q[n * V + x];
        if (!(u[n] * q_x < row[x])) break;
    }
    *accepted = n;
    if (n == G) {
        softmax_row(logits + n * V, V, inv_temp, row);
        *next = draw_cdf(row, V, u_draw);
        return;
    }
    /* row holds p_n: the residual max(p_n - q_n, 0) goes to its own buffer so p_n stays for the
     * all-zero case */
    float *residual = row + V;
    double mass = 0.0;
    for (int64_t v = 0; v < V; v++) {
        const float r = row[v] - (q != NULL ? q[n * V + v] : (v == draft[n] ? 1.0f : 0.0f));
        residual[v] = r > 0.f ? r : 0.f;
        mass += residual[v];
    }
    *next = draw_cdf(mass > 0.0 ? residual : row, V, u_draw);
}

/* q = softmax(logits * inv_temp) into q, and its `draw_cdf` index with the uniform u: the
 * draft's proposal distribution in sampled drafting (the verifier accepts against exactly
 * this q, so the output stays the target's distribution). */
static int64_t draw_softmax(const float *logits, int64_t V, float inv_temp, double u, float *q) {
    softmax_row(logits, V, inv_temp, q);
    return draw_cdf(q, V, u);
}

/* Drafting in one call: the T tokens `tokens` (embedding rows of `embed` [vocab, E]),
 * then G - 1 more steps, each feeding the argmax of the last row's logits back as the next
 * token; out[g] is the g-th argmax (G tokens in all; the last one is not fed, so the cache
 * grows by T + G - 1 positions from `start`). Every forward is the `specops_llama_layers`
 * call the runner makes for that step (cos_tab / sin_tab are the [positions, D] tables, row
 * p for position p), the LM head runs on the last row only (a row's logits do not depend on
 * the other rows) and the argmax is `specops_argmax_rows`, so the tokens are those of a
 * Python loop of forwards and argmaxes, bit for bit.
 * Sampling instead (uniforms != NULL): each step's token is drawn from q = softmax(logits *
 * inv_temp), stored in q[g * V ..] (`draw_softmax`, uniforms[g] in [0, 1)), and fed back.
 * head_ids (greedy only): the head's V rows are these tokens' (a draft vocabulary, the LM
 * head's rows of the tokens drafting may propose), so the argmax row r is token head_ids[r].
 *   x        at least T * E floats (the residual stream), hidden at least T * E, logits V
 *   scratch  as `specops_llama_layers` for T rows
 * Returns 0, or the first failing call's code. */
int specops_llama_draft(const LayerWeights *layers, int64_t n_layers, const float *embed, const int64_t *tokens,
                         int64_t T, int64_t G, float *x, int64_t E, int64_t Hq, int64_t Hkv, int64_t D, int64_t I,
                         float eps, float scale, const float *cos_tab, const float *sin_tab, int64_t kv_b,
                         int64_t kv_h, int64_t start, float *scratch, int threads, const float *norm,
                         const float *head_w, const float *head_b, int64_t V, float *hidden, float *logits,
                         int head_flags, int64_t *out, const double *uniforms, float inv_temp, float *q,
                         const int64_t *head_ids) {
    if (T < 1 || G < 1 || (head_ids != NULL && uniforms != NULL)) return 3;
    int64_t t = T, at = start;
    for (int64_t g = 0; g < G; g++) {
        const int64_t *ids = g == 0 ? tokens : out + g - 1;
        for (int64_t r = 0; r < t; r++) memcpy(x + r * E, embed + ids[r] * E, sizeof(float) * (size_t)E);
        int rc = specops_llama_layers(layers, n_layers, x, t, E, Hq, Hkv, D, I, eps, scale, cos_tab + at * D,
                                      sin_tab + at * D, kv_b, kv_h, at, NULL, scratch, threads, norm, head_w, head_b,
                                      V, hidden, logits, head_flags, 1, NULL);
        if (rc != 0) return rc;
        if (uniforms == NULL) {
            specops_argmax_rows(logits, 1, V, out + g);
            if (head_ids != NULL) out[g] = head_ids[out[g]];
        } else {
            out[g] = draw_softmax(logits, V, inv_temp, uniforms[g], q + g * V);
        }
        at += t;
        t = 1;
    }
    return 0;
}

/* -- the same layer stack over a ragged batch on a block-paged store -----------------------
 * N flat tokens of S sequences (`PagedMeta`: first [S+1], start [S], tables [S, tstride]
 * int32, words [N] and masked [S] for trees), token n at rotary position pos[n] (cos_tab /
 * sin_tab [positions, D], sin as above) and cache position start[s] + (n - first[s]), where
 * its key and value go before attention. Each layer's k_cache / v_cache in `layers` is its
 * [slots, Hkv, D] half of the store. Every call is the one the single-sequence stack makes
 * (linear rows, rope_row, attend), so a sequence's tokens come out bit for bit as
 * `specops_llama_layers` computes them. After the last layer, hidden [R, E] = rmsnorm of the
 * rows `rows` [R] and logits [R, V] = hidden head_w^T (+ head_b) (logits NULL: none).
 *   L        most keys any token sees (max over s of start[s] + its new tokens)
 *   scratch  at least N * (Hq + 2 Hkv) * D + N * Hq * D + N * 2 * I floats
 * Returns 0, or the first failing call's code (2: no memory, 3: bad shapes). */
int specops_paged_layers(const LayerWeights *layers, int64_t n_layers, float *x, int64_t N, int64_t E, int64_t Hq,
                         int64_t Hkv, int64_t D, int64_t I, float eps, float scale, const float *cos_tab,
                         const float *sin_tab, const int32_t *pos, int64_t S, const int64_t *first, const int64_t *start,
                         const int32_t *tables, int64_t tstride, int64_t bs, const uint64_t *words, const int8_t *masked,
                         int64_t L, float *scratch, int threads, const float *norm, const float *head_w,
                         const float *head_b, int64_t V, const int64_t *rows, int64_t R, float *hidden, float *logits,
                         int head_flags) {
    const int64_t H = Hq + 2 * Hkv;
    if (D > ROPE_MAX_D || D % 2 || S < 1 || first[0] != 0 || first[S] != N || bs < 1) return 3;
    for (int64_t s = 0; s < S; s++)
        if (first[s + 1] < first[s] || (masked[s] && first[s + 1] - first[s] > 64) ||
            start[s] + first[s + 1] - first[s] > L || start[s] + first[s + 1] - first[s] > tstride * bs)
            return 3;
    int32_t *tok_seq = (int32_t *)malloc(sizeof(int32_t) * (size_t)(N > 0 ? N : 1));
    if (tok_seq == NULL) return 2;
    for (int64_t s = 0; s < S; s++)
        for (int64_t n = first[s]; n < first[s + 1]; n++) tok_seq[n] = (int32_t)s;
    const PagedMeta meta = {first, start, tables, tstride, bs, words, masked, tok_seq};
    float *qkv = scratch, *att = qkv + N * H * D, *gu = att + N * Hq * D;
    int rc = 0;
    for (int64_t i = 0; i < n_layers && rc == 0; i++) {
        const LayerWeights *l = layers + i;
        const int f = (int)l->flags;
        rc = specops_linear(x, l->qkv_w, l->qkv_b, NULL, qkv, N, E, H * D, threads, 1 | f, l->ln1, eps);
        if (rc != 0) break;
        for (int64_t n = 0; n < N; n++) { /* rotary, then the new key / value into its slot */
            float *row = qkv + n * H * D;
            rope_row(row, cos_tab + (int64_t)pos[n] * D, sin_tab + (int64_t)pos[n] * D, Hq + Hkv, D);
            const int64_t s = tok_seq[n], p = start[s] + n - first[s];
            const int64_t slot = (int64_t)tables[s * tstride + p / bs] * bs + p % bs;
            memcpy(l->k_cache + slot * Hkv * D, row + Hq * D, sizeof(float) * (size_t)(Hkv * D));
            memcpy(l->v_cache + slot * Hkv * D, row + (Hq + Hkv) * D, sizeof(float) * (size_t)(Hkv * D));
        }
        AttnJob a = {qkv, l->k_cache, l->v_cache, NULL, att, 0, H * D, 0, 0, 1, N, Hq, Hkv, D, L, scale, 0, &meta};
        rc = attention(a, threads);
        if (rc == 0) rc = layer_tail(l, att, x, gu, N, E, Hq * D, I, eps, threads);
    }
    free(tok_seq);
    if (rc != 0) return rc;
    for (int64_t r = 0; r < R; r++) rms_norm_rows(x + rows[r] * E, norm, eps, 1, E, hidden + r * E);
    if (logits != NULL)
        return specops_linear(hidden, head_w, head_b, NULL, logits, R, E, V, threads, head_flags, NULL, 0.f);
    return 0;
}

static double clock_s(int clock_id) {
    struct timespec ts;
    clock_gettime((clockid_t)clock_id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Greedy drafting for a ragged batch in one call: `specops_paged_layers` rounds with the
 * argmax fed back in between. Round 0 feeds each sequence s its tokens first0[s] ..
 * first0[s+1]-1 of `tokens` (what its draft cache lacks: 1 or more) after start0[s] cached
 * ones, and takes the argmax of its last row; round r >= 1 feeds the sequences with
 * gammas[s] > r their previous token, one each, in sequence order (a sequence leaves once it
 * has its gammas[s] tokens; its last one is never fed). out[s * G + r] is sequence s's r-th
 * token (G >= every gammas[s] >= 1). Every round is the `specops_paged_layers` call the
 * engine's per-round loop makes for the same sequences and tokens, and the argmax is
 * `specops_argmax_rows`, so the tokens and the cache are those of that loop, bit for bit.
 * round_s[r] (when not NULL): the seconds round r took on clock `clock_id` (clock_gettime),
 * its set-up and argmax included.
 * Sampling (inv_temps != NULL): a sequence s with inv_temps[s] > 0 draws its round-r token
 * from q = softmax(logits * inv_temps[s]) with the uniform uniforms[s * G + r] (`draw_softmax`,
 * as `specops_llama_draft` does) and stores q in q[(s * G + r) * V ..]; the others take the
 * argmax. The verifier accepts against exactly that q (lossless).
 * head_ids (greedy only, NULL otherwise): the head's V rows are these tokens' (a draft
 * vocabulary), so the argmax row r drafts, and the next round feeds, token head_ids[r].
 *   x        at least max(N0, S) * E floats; hidden S * E; logits S * V
 *   scratch  as `specops_paged_layers` for max(N0, S) tokens
 * Returns 0, or the first failing call's code (2: no memory, 3: bad shapes). */
int specops_paged_draft(const LayerWeights *layers, int64_t n_layers, const float *embed, const int64_t *tokens,
                        int64_t S, const int64_t *first0, const int64_t *start0, const int64_t *gammas,
                        const int32_t *tables, int64_t tstride, int64_t bs, int64_t E, int64_t Hq, int64_t Hkv,
                        int64_t D, int64_t I, float eps, float scale, const float *cos_tab, const float *sin_tab,
                        float *x, float *scratch, int threads, const float *norm, const float *head_w,
                        const float *head_b, int64_t V, float *hidden, float *logits, int head_flags, int64_t *out,
                        int64_t G, int clock_id, double *round_s, const double *uniforms,
                        const float *inv_temps, float *q, const int64_t *head_ids) {
    if (S < 1 || G < 1 || first0[0] != 0) return 3;
    if (inv_temps != NULL && (uniforms == NULL || q == NULL)) return 3;
    if (head_ids != NULL && inv_temps != NULL) return 3; /* a draft vocabulary drafts greedily only */
    const int64_t N0 = first0[S];
    for (int64_t s = 0; s < S; s++)
        if (first0[s + 1] <= first0[s] || gammas[s] < 1 || gammas[s] > G) return 3;
    const int64_t M = N0 > S ? N0 : S;
    int32_t *pos = (int32_t *)malloc(sizeof(int32_t) * (size_t)M);
    int32_t *tab = (int32_t *)malloc(sizeof(int32_t) * (size_t)(S * tstride));
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(S + 1));
    int64_t *start = (int64_t *)malloc(sizeof(int64_t) * (size_t)S);
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)S);
    int64_t *who = (int64_t *)malloc(sizeof(int64_t) * (size_t)S);
    int64_t *picked = (int64_t *)malloc(sizeof(int64_t) * (size_t)S);
    uint64_t *words = (uint64_t *)calloc((size_t)M, sizeof(uint64_t)); /* causal: no tree words */
    int8_t *masked = (int8_t *)calloc((size_t)S, sizeof(int8_t));
    int rc = 0;
    if (!pos || !tab || !first || !start || !rows || !who || !picked || !words || !masked) rc = 2;
    for (int64_t r = 0; r < G && rc == 0; r++) {
        const double t0 = round_s != NULL ? clock_s(clock_id) : 0.0;
        int64_t n = 0, m = 0, keys = 0;
        first[0] = 0;
        for (int64_t s = 0; s < S; s++) {
            if (gammas[s] <= r) continue;
            const int64_t fed0 = first0[s + 1] - first0[s];
            const int64_t at = r == 0 ? start0[s] : start0[s] + fed0 + r - 1;
            const int64_t t = r == 0 ? fed0 : 1;
            for (int64_t j = 0; j < t; j++) {
                const int64_t id = r == 0 ? tokens[first0[s] + j] : out[s * G + r - 1];
                memcpy(x + (n + j) * E, embed + id * E, sizeof(float) * (size_t)E);
                pos[n + j] = (int32_t)(at + j);
            }
            memcpy(tab + m * tstride, tables + s * tstride, sizeof(int32_t) * (size_t)tstride);
            start[m] = at;
            n += t;
            first[m + 1] = n;
            rows[m] = n - 1;
            who[m] = s;
            if (at + t > keys) keys = at + t;
            m++;
        }
        if (m == 0) break; /* G above every gamma */
        rc = specops_paged_layers(layers, n_layers, x, n, E, Hq, Hkv, D, I, eps, scale, cos_tab, sin_tab, pos, m,
                                  first, start, tab, tstride, bs, words, masked, keys, scratch, threads, norm, head_w,
                                  head_b, V, rows, m, hidden, logits, head_flags);
        if (rc != 0) break;
        specops_argmax_rows(logits, m, V, picked);
        for (int64_t j = 0; j < m; j++) {
            const int64_t s = who[j];
            if (inv_temps != NULL && inv_temps[s] > 0.f)
                out[s * G + r] = draw_softmax(logits + j * V, V, inv_temps[s], uniforms[s * G + r],
                                              q + (s * G + r) * V);
            else
                out[s * G + r] = head_ids != NULL ? head_ids[picked[j]] : picked[j];
        }
        if (round_s != NULL) round_s[r] = clock_s(clock_id) - t0;
    }
    free(pos); free(tab); free(first); free(start); free(rows); free(who); free(picked); free(words); free(masked);
    return rc;
}

/* out[r] = the index of the largest of x[r, 0..cols-1], the first one on ties, a NaN before
 * any number (torch.argmax's rules). One thread: a greedy verification's few rows, without
 * waking torch's OpenMP team (whose spinning workers then take the second core from the
 * next forward's pool). */
/* torch.argmax's answer for one row: the first index of the maximum, or of the first NaN. */
static int64_t argmax_scalar(const float *row, int64_t cols) {
    int64_t best = 0;
    float m = row[0];
    if (m == m) {
        for (int64_t c = 1; c < cols; c++) {
            const float v = row[c];
            if (v != v) return c;
            if (v > m) { m = v; best = c; }
        }
    }
    return best;
}

#ifdef SPECOPS_AVX512
/* The same in two vector passes (the scalar loop's compare-and-branch per element cost ~60 us
 * per 4k-vocabulary row): the row's maximum, then the first index holding a value equal to it
 * (-0.0 == +0.0, as the scalar loop's strict > keeps the first of them). A row with a NaN
 * goes to the scalar loop. */
static int64_t argmax_row(const float *row, int64_t cols) {
    if (cols < 16) return argmax_scalar(row, cols);
    __m512 m = _mm512_loadu_ps(row);
    __mmask16 nan = _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q);
    int64_t c = 16;
    for (; c + 16 <= cols; c += 16) {
        const __m512 v = _mm512_loadu_ps(row + c);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);
    }
    if (c < cols) { /* the tail, padded with the first element (never above the maximum) */
        const __mmask16 t = (__mmask16)((1u << (cols - c)) - 1u);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(row[0]), t, row + c);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);
    }
    if (nan) return argmax_scalar(row, cols);
    const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    for (c = 0; c + 16 <= cols; c += 16) {
        const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + c), best, _CMP_EQ_OQ);
        if (eq) return c + __builtin_ctz((unsigned)eq);
    }
    for (; c < cols; c++) /* no NaN here: the first element equal to the maximum */
        if (row[c] == _mm512_cvtss_f32(best)) return c;
    return 0; /* not reached: the maximum is in the row */
}
#elif defined(SPECOPS_AVX2)
/* The same two passes in 8 lanes (AVX2 hosts ran the scalar loop: 129 us for the 16 rows of
 * a batch-16 step of the bundled 4k vocabulary, on a Zen 1 host). */
static int64_t argmax_row(const float *row, int64_t cols) {
    if (cols < 8) return argmax_scalar(row, cols);
    __m256 m = _mm256_loadu_ps(row);
    __m256 nan = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
    int64_t c = 8;
    for (; c + 8 <= cols; c += 8) {
        const __m256 v = _mm256_loadu_ps(row + c);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, v);
    }
    if (_mm256_movemask_ps(nan)) return argmax_scalar(row, cols);
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float top = lanes[0];
    for (int l = 1; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    for (int64_t t = c; t < cols; t++) { /* the tail */
        if (row[t] != row[t]) return argmax_scalar(row, cols);
        top = row[t] > top ? row[t] : top;
    }
    const __m256 best = _mm256_set1_ps(top);
    for (c = 0; c + 8 <= cols; c += 8) {
        const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + c), best, _CMP_EQ_OQ));
        if (eq) return c + __builtin_ctz((unsigned)eq);
    }
    for (; c < cols; c++) /* no NaN here: the first element equal to the maximum */
        if (row[c] == top) return c;
    return 0; /* not reached: the maximum is in the row */
}
#else
#define argmax_row argmax_scalar
#endif

void specops_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * cols, cols);
}

/* -- Medusa proposals --------------------------------------------------------------------
 * `MedusaHeads.candidates` in one call: R rows of the target's hidden state, x = hidden (+
 * root_w e(root), the root token's embedding row, for heads that read it); for each of K
 * heads, z = x, then z += silu(W z + b) for each of its L blocks, then logits over F rows of
 * the shared LM head (the shortlist's, or the whole vocabulary: ids NULL) and the top_k of
 * them, best first (a tie keeps the lower row first): out[(k R + r) top_k + j] = ids[row]
 * (or the row). The linears are `specops_linear` (the same kernel calls as the per-call
 * path); the proposal only chooses which tokens the target verifies, so its bits never reach
 * the output. Between two target forwards the per-call path ran ~20 small tensor ops, each
 * cache-cold after the forward evicted the interpreter's working set: 0.45-0.5 ms of a
 * 3 ms Medusa round on the bundled models against the kernels' ~0.1 ms.
 *   block_w / block_b  [K * L] weights (panel-packed, [E, E]) and biases [E], head-major
 * Returns 0, 2 when a buffer could not be allocated, 3 for a root id outside [0, n_embed). */
int specops_medusa_candidates(const float *hidden, int64_t R, int64_t E, const int64_t *roots, const float *embed,
                              int64_t n_embed, const void *root_w, int root_flags, const void *const *block_w,
                              const float *const *block_b, int block_flags, int64_t K, int64_t L, const void *lm_w,
                              const float *lm_b, int lm_flags, int64_t F, const int64_t *ids, int64_t top_k,
                              int64_t *out, int threads) {
    if (top_k < 1 || top_k > F) return 3;
    if (root_w != NULL)
        for (int64_t r = 0; r < R; r++)
            if (roots[r] < 0 || roots[r] >= n_embed) return 3;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(R * E * (3 + K) + K * R * F) + sizeof(float) * 2 * top_k);
    if (buf == NULL) return 2;
    float *x = buf, *y = x + R * E, *emb = y + R * E, *z = emb + R * E, *logits = z + K * R * E;
    float *best = logits + K * R * F;
    int64_t *at = (int64_t *)malloc(sizeof(int64_t) * (size_t)top_k);
    if (at == NULL) {
        free(buf);
        return 2;
    }
    int rc = 0;
    if (root_w != NULL) { /* x = root_w e(root) + hidden */
        for (int64_t r = 0; r < R; r++) memcpy(emb + r * E, embed + roots[r] * E, sizeof(float) * (size_t)E);
        rc = specops_linear(emb, (const float *)root_w, NULL, hidden, x, R, E, E, threads, root_flags, NULL, 0.f);
    } else {
        memcpy(x, hidden, sizeof(float) * (size_t)(R * E));
    }
    for (int64_t k = 0; k < K && rc == 0; k++) {
        float *zk = z + k * R * E;
        memcpy(zk, x, sizeof(float) * (size_t)(R * E));
        for (int64_t l = 0; l < L && rc == 0; l++) {
            rc = specops_linear(zk, (const float *)block_w[k * L + l], block_b[k * L + l], NULL, y, R, E, E, threads,
                                block_flags, NULL, 0.f);
            for (int64_t i = 0; i < R * E; i++) { /* silu(v) = v / (1 + e^-v), e^-|v| never overflows */
                const float v = y[i], e = exp_nonpos(v < 0.f ? v : -v);
                zk[i] += (v < 0.f ? v * e : v) / (1.0f + e);
            }
        }
    }
    if (rc == 0) rc = specops_linear(z, (const float *)lm_w, lm_b, NULL, logits, K * R, E, F, threads, lm_flags, NULL, 0.f);
    for (int64_t row = 0; row < K * R && rc == 0; row++) {
        const float *lg = logits + row * F;
        int64_t n = 0;
        for (int64_t f = 0; f < F; f++) {
            const float v = lg[f];
            if (n == top_k && !(v > best[top_k - 1])) continue;
            int64_t p = n < top_k ? n++ : top_k - 1;
            while (p > 0 && v > best[p - 1]) {
                best[p] = best[p - 1], at[p] = at[p - 1];
                p--;
            }
            best[p] = v, at[p] = f;
        }
        for (int64_t j = 0; j < top_k; j++) out[row * top_k + j] = ids != NULL ? ids[at[j]] : at[j];
    }
    free(at);
    free(buf);
    return rc;
}

/* -- one greedy Medusa step of the batch-1 fast runner in one call -------------------------
 * What `generate_medusa`'s greedy loop does per step, with the same kernel calls in the same
 * order, so tokens, cache and candidates are those of that loop bit for bit:
 *   1. the tree's tokens: the root, then node j's token cands[src[j]] (src indexes the K x TK
 *      candidates the previous step's heads ranked, head-major);
 *   2. `specops_llama_layers` over the N nodes at cache slots start..start+N-1, rotary
 *      positions start + depth[j], visibility words[j] (the tree's ancestor mask), logits and
 *      argmax of every node;
 *   3. the greedy walk from the root: the first child c (parent[c] == node, c ascending) whose
 *      token is the node's argmax, until none is; the argmax of the last accepted node is the
 *      next token;
 *   4. the accepted path's cache entries moved to start, start + 1, ... in every layer;
 *   5. `specops_medusa_candidates` on the last accepted node's hidden state with the next
 *      token as root: the next step's candidates, written over cands.
 * tree [4, N] int64: src (src[0] unused), depth, parent (-1 for the root), words. result
 * [N + 2]: the path's length P, the next token, then the P - 1 accepted tokens. heads_s: the
 * seconds step 5 took (CLOCK_MONOTONIC). Returns 0, 2 (no memory), 3 (a token id or N out of
 * range; nothing written to the cache).
 * branch [M] (M >= 0; NULL when M == 0): a drafted continuation of the root (a prompt-lookup
 * match) merged into the tree before step 2 as into a trie: from the root, follow the child
 * whose token is the branch's next token while there is one, then append the rest as a chain
 * (nodes N, N + 1, ... after the tree's, depth and ancestor words extended), as far as
 * max_nodes allows. Siblings keep distinct tokens, so the walk's path is the longest accepted
 * one. *nodes: the nodes the step fed (N plus the appended ones; the hidden and logit rows). */
typedef struct { /* a batch-1 fast runner's target (and Medusa heads) for the one-call steps below */
    const LayerWeights *layers;
    int64_t n_layers;
    const float *embed; /* [n_embed, E] fp32: the target's embedding (also the heads' root input) */
    int64_t n_embed, E, Hq, Hkv, D, I;
    double eps, scale;
    const float *cos_tab, *sin_tab; /* [positions, D] */
    int64_t kv_b, kv_h;
    const float *norm, *head_w, *head_b;
    int64_t V, head_flags;
    const void *root_w; /* the heads: as `specops_medusa_candidates` */
    int64_t root_flags;
    const void *const *block_w;
    const float *const *block_b;
    int64_t block_flags, K, L;
    const void *lm_w;
    const float *lm_b;
    int64_t lm_flags, F;
    const int64_t *ids;
    int64_t TK, threads, max_nodes;
    float *buf; /* max_nodes * (2 E + V + 2 D + (Hq + 2 Hkv) D + Hq D + 2 I) floats */
    int64_t *work; /* 6 * max_nodes: tokens, argmax, path, then the step's depth, parent, words */
} StepLoop;

int specops_medusa_step(const StepLoop *m, int64_t start, int64_t N, const int64_t *tree, int64_t root,
                        int64_t *cands, int64_t *result, double *heads_s, const int64_t *branch, int64_t M,
                        int64_t *nodes) {
    if (N < 1 || N > m->max_nodes || N > 64 || root < 0 || root >= m->n_embed || M < 0) return 3;
    const int64_t E = m->E, D = m->D, V = m->V, cap = m->max_nodes < 64 ? m->max_nodes : 64;
    const int64_t *src = tree;
    int64_t *tokens = m->work, *choice = m->work + m->max_nodes, *path = m->work + 2 * m->max_nodes;
    int64_t *depth = m->work + 3 * m->max_nodes, *parent = m->work + 4 * m->max_nodes;
    uint64_t *words = (uint64_t *)(m->work + 5 * m->max_nodes);
    memcpy(depth, tree + N, sizeof(int64_t) * (size_t)N);
    memcpy(parent, tree + 2 * N, sizeof(int64_t) * (size_t)N);
    memcpy(words, tree + 3 * N, sizeof(uint64_t) * (size_t)N);
    tokens[0] = root;
    for (int64_t j = 1; j < N; j++) {
        if (src[j] < 0 || src[j] >= m->K * m->TK) return 3;
        tokens[j] = cands[src[j]];
        if (tokens[j] < 0 || tokens[j] >= m->n_embed) return 3;
    }
    for (int64_t i = 0; i < M; i++)
        if (branch[i] < 0 || branch[i] >= m->n_embed) return 3;
    for (int64_t i = 0, at = 0; i < M; i++) { /* the branch into the tree, as into a trie */
        int64_t child = -1;
        for (int64_t c = at + 1; c < N; c++)
            if (parent[c] == at && tokens[c] == branch[i]) {
                child = c;
                break;
            }
        if (child < 0) {
            if (N == cap) break;
            child = N++;
            tokens[child] = branch[i], depth[child] = depth[at] + 1, parent[child] = at;
            words[child] = words[at] | ((uint64_t)1 << child);
        }
        at = child;
    }
    *nodes = N;
    float *x = m->buf, *hidden = x + N * E, *logits = hidden + N * E, *cs = logits + N * V, *sn = cs + N * D;
    float *scratch = sn + N * D;
    for (int64_t j = 0; j < N; j++) {
        memcpy(x + j * E, m->embed + tokens[j] * E, sizeof(float) * (size_t)E);
        memcpy(cs + j * D, m->cos_tab + (start + depth[j]) * D, sizeof(float) * (size_t)D);
        memcpy(sn + j * D, m->sin_tab + (start + depth[j]) * D, sizeof(float) * (size_t)D);
    }
    int rc = specops_llama_layers(m->layers, m->n_layers, x, N, E, m->Hq, m->Hkv, D, m->I, (float)m->eps,
                                  (float)m->scale, cs, sn, m->kv_b, m->kv_h, start, words, scratch, (int)m->threads,
                                  m->norm, m->head_w, m->head_b, V, hidden, logits, (int)m->head_flags, N, choice);
    if (rc != 0) return rc;
    int64_t P = 1, node = 0;
    path[0] = 0;
    for (;;) {
        int64_t next = -1;
        for (int64_t c = node + 1; c < N; c++)
            if (parent[c] == node && tokens[c] == choice[node]) {
                next = c;
                break;
            }
        if (next < 0) break;
        path[P++] = next;
        node = next;
    }
    for (int64_t i = 1; i < P; i++) {
        if (path[i] == i) continue;
        for (int64_t l = 0; l < m->n_layers; l++)
            for (int64_t h = 0; h < m->Hkv; h++) {
                float *k = m->layers[l].k_cache + h * m->kv_h, *v = m->layers[l].v_cache + h * m->kv_h;
                memcpy(k + (start + i) * D, k + (start + path[i]) * D, sizeof(float) * (size_t)D);
                memcpy(v + (start + i) * D, v + (start + path[i]) * D, sizeof(float) * (size_t)D);
            }
    }
    const int64_t last = path[P - 1];
    result[0] = P;
    result[1] = choice[last];
    for (int64_t i = 1; i < P; i++) result[1 + i] = tokens[path[i]];
    const double t0 = clock_s(CLOCK_MONOTONIC);
    if (m->K > 0)
        rc = specops_medusa_candidates(hidden + last * E, 1, E, result + 1, m->embed, m->n_embed, m->root_w,
                                       (int)m->root_flags, m->block_w, m->block_b, (int)m->block_flags, m->K, m->L,
                                       m->lm_w, m->lm_b, (int)m->lm_flags, m->F, m->ids, m->TK, cands,
                                       (int)m->threads);
    if (heads_s != NULL) *heads_s = clock_s(CLOCK_MONOTONIC) - t0;
    return rc;
}

/* -- one greedy verification of a linear block in one call ---------------------------------
 * The target forward over tokens[0..T-1] (the pending token, then T - 1 drafted ones) at
 * cache slots and rotary positions start..start+T-1 (causal), exactly the `specops_llama_layers`
 * call of the fast runner's forward, every row's argmax, and the greedy acceptance: n = the
 * drafted tokens that equal the argmax before them, in order until the first that does not.
 * result[0] = n, result[1] = the argmax after the last accepted one (the next token). The
 * cache holds all T new entries afterwards (the caller cuts it back). Returns 0, 2 (no
 * memory) or 3 (a token id or T out of range; nothing written to the cache). */
int specops_chain_verify(const StepLoop *m, int64_t start, int64_t T, const int64_t *tokens, int64_t *result) {
    if (T < 1 || T > m->max_nodes) return 3;
    for (int64_t j = 0; j < T; j++)
        if (tokens[j] < 0 || tokens[j] >= m->n_embed) return 3;
    const int64_t E = m->E, D = m->D;
    int64_t *choice = m->work + m->max_nodes;
    float *x = m->buf, *hidden = x + T * E, *logits = hidden + T * E;
    float *scratch = logits + T * m->V + 2 * T * D;
    for (int64_t j = 0; j < T; j++) memcpy(x + j * E, m->embed + tokens[j] * E, sizeof(float) * (size_t)E);
    int rc = specops_llama_layers(m->layers, m->n_layers, x, T, E, m->Hq, m->Hkv, D, m->I, (float)m->eps,
                                  (float)m->scale, m->cos_tab + start * D, m->sin_tab + start * D, m->kv_b, m->kv_h,
                                  start, NULL, scratch, (int)m->threads, m->norm, m->head_w, m->head_b, m->V, hidden,
                                  logits, (int)m->head_flags, T, choice);
    if (rc != 0) return rc;
    int64_t n = 0;
    while (n < T - 1 && tokens[n + 1] == choice[n]) n++;
    result[0] = n;
    result[1] = choice[n];
    return 0;
}

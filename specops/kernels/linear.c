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
        _mm_prefetch((const char *)(w + k + 1024), _MM_HINT_T0); /* see PREFETCH_FLOATS */
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

#if defined(__AVX512F__) && defined(SPECOPS_AVX2)
#define SPECOPS_AVX512 1
/* dots of tb rows of x (tb <= 8, a compile-time constant after inlining) with nw (1 or 2)
 * weight rows: one 16-lane accumulator per (row, weight row), k in blocks of 16 (the last
 * one masked), then _mm512_reduce_add_ps. The pairing of weight rows and the number of
 * rows of x do not change any output's arithmetic. Defined twice: fp32 weights, and
 * bfloat16 weights widened to fp32 in registers (half the bytes streamed; for drafters,
 * whose logits only propose). The weights stream from L3 / memory: without a prefetch
 * this far ahead the loads of the next lines wait behind the FMAs of several rows
 * (measured, bundled target's 33 matrices, 2 threads, medians of 4 interleaved runs:
 * 8 rows 2221 -> 1126 us, 1 row 786 -> 582 us). */
#define PREFETCH_BYTES 4096
#define LOAD_F32(p, k) _mm512_loadu_ps((p) + (k))
#define LOAD_F32_MASKED(m, p, k) _mm512_maskz_loadu_ps((m), (p) + (k))
#define WIDEN_BF16(h) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
#define LOAD_BF16(p, k) WIDEN_BF16(_mm256_loadu_si256((const __m256i *)((p) + (k))))
#define LOAD_BF16_MASKED(m, p, k) WIDEN_BF16(_mm256_maskz_loadu_epi16((m), (p) + (k)))
/* The 16 sums of v[0..15] at once, each by the tree of _mm512_reduce_add_ps (lanes j + j+8,
 * then j + j+4, then j + j+2, then j + j+1), so a sum's bits do not depend on whether it was
 * reduced alone or with others; lanes of different vectors never meet, so zero vectors
 * pad a short group. Sum i lands in lane REDUCE16_LANE(i). 45 shuffles and adds for 16
 * sums where one reduce_add_ps each takes 7: the reductions of a block of 8 rows x 2
 * weight rows had cost about half as much as its FMAs over K = 256. */
#define REDUCE16_MIN 8
#define REDUCE16_LANE(i) (4 * ((i) % 4) + (i) / 4)
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 *v) {
    __m512 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: j + j+8 of v[2i]; lanes 8-15: of v[2i+1] */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit lane q: j + j+4 of v[4i + q] */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++) /* in 128-bit lane q: j + j+2 of v[8i + q] (2 lanes), then of v[8i + 4 + q] */
        e[i] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane 4q + m: the sum of v[4m + q] */
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#define DEFINE_DOTS(NAME, WT, LOADW, LOADW_MASKED)                                                          \
    static inline __attribute__((always_inline)) void NAME(const float *const *xs, const WT *w0, const WT *w1, \
                                                           int64_t K, const int tb, const int nw, float *out0, \
                                                           float *out1) {                                    \
        __m512 a0[8], a1[8];                                                                                 \
        for (int t = 0; t < tb; t++) a0[t] = a1[t] = _mm512_setzero_ps();                                   \
        int64_t k = 0;                                                                                       \
        for (; k + 16 <= K; k += 16) {                                                                       \
            _mm_prefetch((const char *)(w0 + k) + PREFETCH_BYTES, _MM_HINT_T0);                              \
            if (nw > 1) _mm_prefetch((const char *)(w1 + k) + PREFETCH_BYTES, _MM_HINT_T0);                  \
            const __m512 v0 = LOADW(w0, k);                                                                  \
            const __m512 v1 = nw > 1 ? LOADW(w1, k) : v0;                                                    \
            for (int t = 0; t < tb; t++) {                                                                   \
                const __m512 xv = _mm512_loadu_ps(xs[t] + k);                                                \
                a0[t] = _mm512_fmadd_ps(xv, v0, a0[t]);                                                      \
                if (nw > 1) a1[t] = _mm512_fmadd_ps(xv, v1, a1[t]);                                          \
            }                                                                                                \
        }                                                                                                    \
        if (k < K) {                                                                                         \
            const __mmask16 mk = (__mmask16)((1u << (K - k)) - 1u);                                         \
            const __m512 v0 = LOADW_MASKED(mk, w0, k);                                                       \
            const __m512 v1 = nw > 1 ? LOADW_MASKED(mk, w1, k) : v0;                                         \
            for (int t = 0; t < tb; t++) {                                                                   \
                const __m512 xv = _mm512_maskz_loadu_ps(mk, xs[t] + k);                                      \
                a0[t] = _mm512_fmadd_ps(xv, v0, a0[t]);                                                      \
                if (nw > 1) a1[t] = _mm512_fmadd_ps(xv, v1, a1[t]);                                          \
            }                                                                                                \
        }                                                                                                    \
        if (tb * nw >= REDUCE16_MIN) { /* all accumulators at once, each summed as reduce_add_ps would */    \
            __m512 v[16];                                                                                    \
            for (int i = 0; i < 16; i++) v[i] = _mm512_setzero_ps();                                         \
            for (int t = 0; t < tb; t++) {                                                                   \
                v[nw * t] = a0[t];                                                                           \
                if (nw > 1) v[nw * t + 1] = a1[t];                                                           \
            }                                                                                                \
            float r[16];                                                                                     \
            _mm512_storeu_ps(r, reduce16(v));                                                                \
            for (int t = 0; t < tb; t++) {                                                                   \
                out0[t] = r[REDUCE16_LANE(nw * t)];                                                          \
                if (nw > 1) out1[t] = r[REDUCE16_LANE(nw * t + 1)];                                          \
            }                                                                                                \
            return;                                                                                          \
        }                                                                                                    \
        for (int t = 0; t < tb; t++) {                                                                       \
            out0[t] = _mm512_reduce_add_ps(a0[t]);                                                           \
            if (nw > 1) out1[t] = _mm512_reduce_add_ps(a1[t]);                                               \
        }                                                                                                    \
    }
DEFINE_DOTS(dots16, float, LOAD_F32, LOAD_F32_MASKED)
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPECOPS_BF16_WEIGHTS 1
DEFINE_DOTS(dots16h, uint16_t, LOAD_BF16, LOAD_BF16_MASKED)
#endif

#define DOTS_CASE(FN, TB)                                                     \
    case TB:                                                                  \
        if (nw == 2) FN(xs, w0, w1, K, TB, 2, r0, r1);                        \
        else FN(xs, w0, w0, K, TB, 1, r0, r1);                                \
        break;

/* each pair of weight rows streamed once, for every row of x */
#define DEFINE_RUN_ROWS(NAME, WT, FN)                                                                       \
    static void NAME(const Job *j, int64_t n0, int64_t n1) {                                               \
        const int64_t T = j->T, K = j->K;                                                                   \
        for (int64_t n = n0; n < n1; n += 2) {                                                              \
            const int nw = n + 1 < n1 ? 2 : 1;                                                              \
            const WT *w0 = (const WT *)j->w + n * K, *w1 = w0 + K;                                          \
            for (int64_t t0 = 0; t0 < T; t0 += 8) {                                                         \
                const int tb = (int)(T - t0 < 8 ? T - t0 : 8);                                              \
                const float *xs[8];                                                                         \
                float r0[8], r1[8];                                                                         \
                for (int t = 0; t < tb; t++) xs[t] = j->x + (t0 + t) * K;                                   \
                switch (tb) { /* constant block sizes, so the accumulators stay in registers */             \
                    DOTS_CASE(FN, 8) DOTS_CASE(FN, 7) DOTS_CASE(FN, 6) DOTS_CASE(FN, 5)                     \
                    DOTS_CASE(FN, 4) DOTS_CASE(FN, 3) DOTS_CASE(FN, 2) DOTS_CASE(FN, 1)                     \
                }                                                                                           \
                store_rows(j, n, nw, t0, tb, r0, r1);                                                       \
            }                                                                                               \
        }                                                                                                   \
    }

static inline void store_rows(const Job *j, int64_t n, int nw, int64_t t0, int tb, const float *r0,
                              const float *r1) {
    for (int w = 0; w < nw; w++) {
        const float *r = w ? r1 : r0;
        const float bias = j->bias ? j->bias[n + w] : 0.f;
        for (int t = 0; t < tb; t++) {
            float v = r[t];
            if (j->bias) v += bias;
            const int64_t at = (t0 + t) * j->N + n + w;
            if (j->add) v += j->add[at];
            j->y[at] = v;
        }
    }
}

DEFINE_RUN_ROWS(run_rows_f32, float, dots16)
#ifdef SPECOPS_BF16_WEIGHTS
DEFINE_RUN_ROWS(run_rows_bf16, uint16_t, dots16h)
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
#else
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

/* scores[c] = scale * q . k[keys[c]] for c < n (keys: position of each visible key) */
static void attn_scores(const float *qh, const float *kh, const int32_t *keys, int64_t n, int64_t D, int64_t stride,
                        float scale, float *scores) {
#ifdef SPECOPS_AVX2
    if (D % 8 == 0) {
        const __m256 vs = _mm256_set1_ps(scale);
        for (int64_t c0 = 0; c0 < n; c0 += 8) {
            const float *kr[8];
            for (int i = 0; i < 8; i++) kr[i] = kh + (int64_t)keys[c0 + i < n ? c0 + i : c0] * stride; /* pad: a real key, result dropped */
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[i] + d), acc[i]);
            }
            float tmp[8];
            _mm256_storeu_ps(tmp, _mm256_mul_ps(hsum8(acc), vs));
            const int64_t m = n - c0 < 8 ? n - c0 : 8;
            for (int64_t i = 0; i < m; i++) scores[c0 + i] = tmp[i];
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

/* One (query, head) row over its n keys (key c at kh / vh + keys[c] * stride). One compiled
 * copy serves the dense and the paged batches, so both round alike. */
static __attribute__((noinline)) void attend(const float *qh, const float *kh, const float *vh, const int32_t *keys,
                                             int64_t n, int64_t D, int64_t stride, float scale, float *scores,
                                             float *oh) {
    attn_scores(qh, kh, keys, n, D, stride, scale, scores);
#ifdef SPECOPS_AVX2
    if (D % 8 == 0 && D <= 128) {
        /* max, exp and the denominator in 8 lanes by rank (a zero-padded last block), then the
         * output in two interleaved sums (even / odd ranks) added at the end: two chains of
         * FMAs, not one, per output vector */
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
        const float total = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
        __m256 e[16], o[16];
        const int64_t nv = D / 8;
        for (int64_t i = 0; i < nv; i++) e[i] = o[i] = _mm256_setzero_ps();
        int64_t cc = 0;
        for (; cc + 2 <= n; cc += 2) {
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

/* Row `row` = (token, head) of a job; the key list is built once per token (*have names the
 * token keys[0..*n) belong to) and shared by its heads. */
static void attn_row(const AttnJob *a, int64_t row, float *scores, int32_t *keys, int64_t *have, int64_t *n) {
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
    attend(a->q + b * a->q_b + t * a->q_row + h * D, a->k + b * a->kv_b + g * a->kv_h,
           a->v + b * a->kv_b + g * a->kv_h, keys, *n, D, D, a->scale, scores, a->out + (b * T + t) * Hq * D + h * D);
}

static void attn_rows(AttnJob *a, int64_t r0, int64_t r1) {
    float stack_scores[ATTN_STACK_KEYS];
    int32_t stack_keys[ATTN_STACK_KEYS];
    float *scores = stack_scores;
    int32_t *keys = stack_keys;
    if (a->L > ATTN_STACK_KEYS) {
        scores = (float *)malloc(sizeof(float) * (size_t)a->L);
        keys = (int32_t *)malloc(sizeof(int32_t) * (size_t)a->L);
        if (scores == NULL || keys == NULL) {
            free(scores);
            free(keys);
            a->failed = 1;
            return;
        }
    }
    int64_t have = -1, n = 0;
    for (int64_t r = r0; r < r1; r++) attn_row(a, r, scores, keys, &have, &n);
    if (scores != stack_scores) {
        free(scores);
        free(keys);
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
static int job_kind; /* JOB_LINEAR or JOB_ATTENTION */
static int64_t job_chunk; /* attention rows per chunk */
static Job job;
static AttnJob attn_job;
enum { JOB_LINEAR, JOB_ATTENTION };

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
    while ((c = claim(gen)) >= 0) { /* the job is stable while a chunk of it is claimed and not done */
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
 * workers; the caller holds pool_lock. */
static void pool_run(int64_t chunks, int threads) {
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
 * and logits [T, V] = hidden head_w^T (+ head_b).
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
                         int64_t V, float *hidden, float *logits, int head_flags) {
    const int64_t H = Hq + 2 * Hkv;
    float *qkv = scratch, *att = qkv + T * H * D, *gu = att + T * Hq * D;
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
    if (logits != NULL)
        return specops_linear(hidden, head_w, head_b, NULL, logits, T, E, V, threads, head_flags, NULL, 0.f);
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
    for (int64_t v = 0; v < V; v++) m = x[v] * inv_temp > m ? x[v] * inv_temp : m;
    double sum = 0.0;
    for (int64_t v = 0; v < V; v++) sum += exp_nonpos(x[v] * inv_temp - m);
    for (int64_t v = 0; v < V; v++) p[v] = (float)(exp_nonpos(x[v] * inv_temp - m) / sum);
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
 *   x        at least T * E floats (the residual stream), hidden at least T * E, logits V
 *   scratch  as `specops_llama_layers` for T rows
 * Returns 0, or the first failing call's code. */
int specops_llama_draft(const LayerWeights *layers, int64_t n_layers, const float *embed, const int64_t *tokens,
                         int64_t T, int64_t G, float *x, int64_t E, int64_t Hq, int64_t Hkv, int64_t D, int64_t I,
                         float eps, float scale, const float *cos_tab, const float *sin_tab, int64_t kv_b,
                         int64_t kv_h, int64_t start, float *scratch, int threads, const float *norm,
                         const float *head_w, const float *head_b, int64_t V, float *hidden, float *logits,
                         int head_flags, int64_t *out, const double *uniforms, float inv_temp, float *q) {
    if (T < 1 || G < 1) return 3;
    int64_t t = T, at = start;
    for (int64_t g = 0; g < G; g++) {
        const int64_t *ids = g == 0 ? tokens : out + g - 1;
        for (int64_t r = 0; r < t; r++) memcpy(x + r * E, embed + ids[r] * E, sizeof(float) * (size_t)E);
        int rc = specops_llama_layers(layers, n_layers, x, t, E, Hq, Hkv, D, I, eps, scale, cos_tab + at * D,
                                      sin_tab + at * D, kv_b, kv_h, at, NULL, scratch, threads, norm, head_w, head_b,
                                      V, hidden, NULL, head_flags);
        if (rc == 0)
            rc = specops_linear(hidden + (t - 1) * E, head_w, head_b, NULL, logits, 1, E, V, threads, head_flags,
                                NULL, 0.f);
        if (rc != 0) return rc;
        if (uniforms == NULL) specops_argmax_rows(logits, 1, V, out + g);
        else out[g] = draw_softmax(logits, V, inv_temp, uniforms[g], q + g * V);
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
                        const float *inv_temps, float *q) {
    if (S < 1 || G < 1 || first0[0] != 0) return 3;
    if (inv_temps != NULL && (uniforms == NULL || q == NULL)) return 3;
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
                out[s * G + r] = picked[j];
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
void specops_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        int64_t best = 0;
        float m = row[0];
        if (m == m) {
            for (int64_t c = 1; c < cols; c++) {
                const float v = row[c];
                if (v != v) { best = c; break; }
                if (v > m) { m = v; best = c; }
            }
        }
        out[r] = best;
    }
}

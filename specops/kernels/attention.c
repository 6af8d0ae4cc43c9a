/* Attention over a dense (contiguous per head) KV cache --------------------------------
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
#include "attention.h"
#include "pool.h"

#define ATTN_STACK_KEYS 4096
#ifdef SPECOPS_AVX512
#define PAIR_ROWS 1 /* attn_rows pairs the heads of a kv head (attend_pair) */
#else
#define PAIR_ROWS 0
#endif

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

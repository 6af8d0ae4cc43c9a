#include "sample.h"

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

/* q = softmax(logits * inv_temp) into q, and its `draw_cdf` index with the uniform u: the
 * draft's proposal distribution in sampled drafting (the verifier accepts against exactly
 * this q, so the output stays the target's distribution). */
static int64_t draw_softmax(const float *logits, int64_t V, float inv_temp, double u, float *q) {
    softmax_row(logits, V, inv_temp, q);
    return draw_cdf(q, V, u);
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

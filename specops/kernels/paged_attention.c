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
 * so sums are vectorized).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 256

int specops_paged_attention(const float *q, const float *k, const float *v, const int64_t *q_index,
                            const int64_t *visible, const int64_t *kv_slots, float *out, int64_t G,
                            int64_t Tq, int64_t Lk, int64_t Hq, int64_t Hkv, int64_t D, int64_t q_stride, float scale) {
    if (Hkv <= 0 || Hq % Hkv != 0 || Hq > MAX_HEADS) return 1;
    const int64_t group = Hq / Hkv;
    const int64_t row_elems = Hkv * D; /* one slot's keys (or values) for every kv head, contiguous */
    float *scores = (float *)malloc(sizeof(float) * (size_t)(Hq * (Lk > 0 ? Lk : 1))); /* [Hq, n] */
    float *acc = (float *)malloc(sizeof(float) * (size_t)(Hq * D));
    if (scores == NULL || acc == NULL) {
        free(scores);
        free(acc);
        return 2;
    }
    for (int64_t g = 0; g < G; g++) {
        const int64_t *slots = kv_slots + g * Lk;
        for (int64_t t = 0; t < Tq; t++) {
            const int64_t n = visible[g * Tq + t];
            if (n <= 0) continue;
            const float *qr = q + q_index[g * Tq + t] * q_stride; /* [Hq, D] */
            float mx[MAX_HEADS];
            for (int64_t h = 0; h < Hq; h++) mx[h] = -INFINITY;
            /* scores: each slot's key row (all kv heads) is read once, for every query head */
            for (int64_t s = 0; s < n; s++) {
                const float *kr = k + slots[s] * row_elems;
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
                const float *vr = v + slots[s] * row_elems;
                for (int64_t h = 0; h < Hq; h++) {
                    const float *vp = vr + (h / group) * D;
                    const float p = scores[h * n + s];
                    float *ah = acc + h * D;
                    for (int64_t d = 0; d < D; d++) ah[d] += p * vp[d];
                }
            }
            float *o = out + q_index[g * Tq + t] * Hq * D;
            for (int64_t h = 0; h < Hq; h++)
                for (int64_t d = 0; d < D; d++) o[h * D + d] = acc[h * D + d] * inv[h];
        }
    }
    free(scores);
    free(acc);
    return 0;
}

/* A whole forward of a Llama-family layer stack ---------------------------------------------
 * One sequence (B = 1), T new tokens after `start` cached ones, every layer:
 *   x += o(attention(rope(qkv(rmsnorm(x, ln1)))))      (the new keys / values into the cache)
 *   x += down(silu(gate) * up),  gate | up = gate_up(rmsnorm(x, ln2))
 * with the calls of gemv.c and attention.c, so each step computes exactly what the per-call
 * path computes.
 * Saves the Python side a dozen calls per layer. x [T, E] is updated in place (the
 * residual stream after the last layer); then, when given, hidden [T, E] = rmsnorm(x, norm)
 * and logits [R, V] = hidden head_w^T (+ head_b) for the last R = logit_rows rows of hidden
 * (R = T: every row; a prompt pass reads only its last row, or none, and the LM head over
 * the rest is wasted work: 2 of a 24 ms 190-token pass of the bundled target), and when
 * argmax is given, argmax [R] = each logit row's `specops_argmax_rows` (a greedy caller's
 * choice, read while the rows are still in cache rather than by another call from Python).
 *   scratch  at least T * (Hq + 2 Hkv) * D + T * Hq * D + T * 2 * I floats
 * Returns 0, or the first failing call's code. */
#include "layers.h"
#include "gemv.h"
#include "attention.h"
#include "sample.h"


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
 * sin_tab [positions, D], sin as specops_rope_cache_attention takes it) and cache position
 * start[s] + (n - first[s]), where its key and value go before attention. Each layer's
 * k_cache / v_cache in `layers` is its [slots, Hkv, D] half of the store. Every call is the one the single-sequence stack makes
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

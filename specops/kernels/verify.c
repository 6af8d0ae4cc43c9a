/* Verifying a drafted block in one call: lossless rejection sampling over the target's
 * logits, and the greedy verification of a linear block on the fast runner. */
#include "steps.h"
#include "layers.h"
#include "sample.h"

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

/* One greedy verification of a linear block in one call ---------------------------------
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

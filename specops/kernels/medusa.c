/* Medusa proposals ------------------------------------------------------------------------
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
#include "steps.h"
#include "gemv.h"
#include "layers.h"

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

/* One greedy Medusa step of the batch-1 fast runner in one call -------------------------
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

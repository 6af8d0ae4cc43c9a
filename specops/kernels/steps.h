/* A batch-1 fast runner's target and Medusa heads, for the one-call steps of medusa.c
 * (specops_medusa_step) and verify.c (specops_chain_verify). */
#ifndef SPECOPS_STEPS_H
#define SPECOPS_STEPS_H
#include "kernel.h"
#include "layers.h"

typedef struct { /* a batch-1 fast runner's target (and Medusa heads) for the two calls below */
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
                        int64_t *nodes);
int specops_chain_verify(const StepLoop *m, int64_t start, int64_t T, const int64_t *tokens, int64_t *result);
#endif

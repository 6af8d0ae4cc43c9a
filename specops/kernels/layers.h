/* Whole forwards of a Llama-family layer stack (layers.c). */
#ifndef SPECOPS_LAYERS_H
#define SPECOPS_LAYERS_H
#include "kernel.h"

typedef struct {
    const float *ln1, *qkv_w, *qkv_b, *o_w, *o_b, *ln2, *gu_w, *gu_b, *down_w, *down_b;
    float *k_cache, *v_cache; /* [B, Hkv, S, D] views of this layer's cache */
    int64_t flags;            /* WEIGHTS_BF16 when the four matrices are bfloat16 */
} LayerWeights;

int specops_llama_layers(const LayerWeights *layers, int64_t n_layers, float *x, int64_t T, int64_t E, int64_t Hq,
                         int64_t Hkv, int64_t D, int64_t I, float eps, float scale, const float *cos,
                         const float *sin, int64_t kv_b, int64_t kv_h, int64_t start, const uint64_t *mask,
                         float *scratch, int threads, const float *norm, const float *head_w, const float *head_b,
                         int64_t V, float *hidden, float *logits, int head_flags, int64_t logit_rows,
                         int64_t *argmax);
int specops_paged_layers(const LayerWeights *layers, int64_t n_layers, float *x, int64_t N, int64_t E, int64_t Hq,
                         int64_t Hkv, int64_t D, int64_t I, float eps, float scale, const float *cos_tab,
                         const float *sin_tab, const int32_t *pos, int64_t S, const int64_t *first, const int64_t *start,
                         const int32_t *tables, int64_t tstride, int64_t bs, const uint64_t *words, const int8_t *masked,
                         int64_t L, float *scratch, int threads, const float *norm, const float *head_w,
                         const float *head_b, int64_t V, const int64_t *rows, int64_t R, float *hidden, float *logits,
                         int head_flags);
#endif

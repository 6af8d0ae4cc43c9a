/* Attention (attention.c): T new queries per sequence over a dense KV cache, or flat tokens
 * of a ragged batch over a block-paged store; rotary embeddings. */
#ifndef SPECOPS_ATTENTION_H
#define SPECOPS_ATTENTION_H
#include "kernel.h"

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

#define ROPE_MAX_D 1024 /* the largest head size rope_row takes */

/* query rows [r0, r1) (row = token * Hq + head) of the job; sets a->failed when out of memory */
static void attn_rows(AttnJob *a, int64_t r0, int64_t r1);
/* the job's rows on the caller and up to threads - 1 pool workers: 0, or 2 (out of memory) */
static int attention(AttnJob a, int threads);
/* rotary embeddings on `heads` heads of one token's row, in place */
static void rope_row(float *row, const float *c, const float *s, int64_t heads, int64_t D);

int specops_attention(const float *q, int64_t q_b, int64_t q_row, const float *k, const float *v, int64_t kv_b,
                      int64_t kv_h, float *out, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t L,
                      float scale, const uint64_t *mask, int threads);
int specops_rope_cache_attention(float *qkv, const float *cos, const float *sin, float *k_cache, float *v_cache,
                                 int64_t kv_b, int64_t kv_h, int64_t start, float *out, int64_t B, int64_t T,
                                 int64_t Hq, int64_t Hkv, int64_t D, float scale, const uint64_t *mask,
                                 int threads);
#endif

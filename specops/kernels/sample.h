/* Choosing tokens from logits (sample.c): argmax rows, softmax, inverse-CDF draws. */
#ifndef SPECOPS_SAMPLE_H
#define SPECOPS_SAMPLE_H
#include "kernel.h"

/* the index drawn from the non-negative weights w[0..V-1] by inverse CDF with the uniform u */
static int64_t draw_cdf(const float *w, int64_t V, double u);
/* p = softmax(x * inv_temp) over V entries */
static void softmax_row(const float *x, int64_t V, float inv_temp, float *p);
/* q = softmax(logits * inv_temp), and its draw_cdf index with the uniform u */
static int64_t draw_softmax(const float *logits, int64_t V, float inv_temp, double u, float *q);

void specops_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out);
#endif

/* The linear layer (gemv.c): y = f(x) W^T (+ b) (+ residual) over panel-packed weights. */
#ifndef SPECOPS_GEMV_H
#define SPECOPS_GEMV_H
#include "kernel.h"

typedef struct {
    const float *x, *w, *bias, *add;
    float *y;
    int64_t T, K, N;
    int bf16; /* w holds bfloat16 weights (uint16 bit patterns; AVX-512 builds only) */
} Job;

#define PANEL 32 /* output rows per weight panel (see gemv.c) */
#define WEIGHTS_BF16 8 /* a mode flag of specops_linear: w holds bfloat16 weights */

/* output rows [n0, n1) of the job (n0 a multiple of PANEL), every row of x */
static void run_rows(const Job *j, int64_t n0, int64_t n1);
/* out [T, K] = RMSNorm(x [T, K]) with gain g [K] */
static void rms_norm_rows(const float *x, const float *g, float eps, int64_t T, int64_t K, float *out);

int specops_bf16_weights(void);
int specops_linear(const float *x, const float *w, const float *bias, const float *add, float *y, int64_t T,
                   int64_t K, int64_t N, int threads, int mode, const float *g, float eps);
#endif

/* What every file of the CPU kernels' library (linear.c) shares: the system headers, the
 * instruction sets the build targets, and a clock. */
#ifndef SPECOPS_KERNEL_H
#define SPECOPS_KERNEL_H
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "vexp.h" /* exp_nonpos */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECOPS_AVX2 1
#endif

#if defined(__AVX512F__) && defined(SPECOPS_AVX2)
#define SPECOPS_AVX512 1
#endif

static double clock_s(int clock_id) {
    struct timespec ts;
    clock_gettime((clockid_t)clock_id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif

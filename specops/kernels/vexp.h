/* A vectorizable exp for softmax terms, shared by the CPU kernels (included, not linked). */
#ifndef SPECOPS_VEXP_H
#define SPECOPS_VEXP_H
#include <math.h>
#include <stdint.h>

/* exp(x) for x <= 0 (x - max of a softmax row), vectorizable: 2^n * p(r), x = n ln2 + r,
 * |r| <= ln2 / 2, Cody-Waite reduction and Cephes' degree-5 minimax polynomial (~1 ulp).
 * Inputs below -87 give exp(-87) (~1.6e-38) instead of a smaller value: a row's largest
 * term is 1, so the difference does not show in the normalized result. */
static inline float exp_nonpos(float x) {
    uint32_t u; /* x = max(x, -87) on the bits (unsigned: +0 stays, more negative is larger), which
                 * vectorizes where a float max with its NaN rules does not */
    __builtin_memcpy(&u, &x, sizeof u);
    u = u < 0xC2AE0000u ? u : 0xC2AE0000u;
    __builtin_memcpy(&x, &u, sizeof u);
    const int32_t n = (int32_t)(x * 1.44269504088896341f - 0.5f); /* x <= 0: truncation rounds to nearest */
    const float fn = (float)n;
    float r = fmaf(fn, -0.693359375f, x); /* fma: never reassociated, so the two-part ln 2 stays exact */
    r = fmaf(fn, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    const int32_t bits = (n + 127) << 23; /* n >= -126: a normal power of two */
    float two_n;
    __builtin_memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#endif

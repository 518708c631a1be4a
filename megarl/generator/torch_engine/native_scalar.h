/* Scalar helpers shared by the engine's C kernels (decode_attention.c, decoder_ops.c). */
#ifndef MEGARL_NATIVE_SCALAR_H
#define MEGARL_NATIVE_SCALAR_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) as a loop body the compiler vectorises: Cephes' expf (2^n by the exponent bits, a
 * degree-6 polynomial on the rest), within 2 ulp of expf; x is clamped to [-87, 88], where
 * 2^n stays a normal float (exp(88) = 1.65e38: a softmax after its max is subtracted and
 * silu need no more). libm's scalar expf cost ~20 ns a call here, 75% of the attention
 * kernel; its vector form needs -ffast-math, which would also switch the whole process to
 * flush-to-zero. */
static inline float exp_clamped(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#endif

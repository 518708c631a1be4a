/* The decoder layer's elementwise steps for the torch engine on CPU, each one pass:
 *   megarl_add_rms_norm  x += delta (the residual add), then h = weight * RMSNorm(x)
 *   megarl_rope          q and k heads of the fused qkv output rotated in place
 *   megarl_silu_mul      silu(gate) * up from the fused gate_up output
 *
 * Why: at decode shapes (32-64 rows of 576-1536 values) each torch op costs its dispatch,
 * not its arithmetic. In bf16 the layer's RMSNorm was 7 ops, RoPE 5, SwiGLU 2, the two
 * residual adds 2: ~20 ms of a ~90 ms decode step of SmolLM2 at batch 64 on 2 cores.
 *
 * Math: what the engine's torch ops compute, with the same roundings to the model dtype
 * (bf16: each torch op rounds its result, so these round at the same points):
 *   add:      x = round(x + delta)
 *   RMSNorm:  h = round(w * round(x * rsqrt(mean(x^2) + eps)))   mean and rsqrt in fp32
 *             (transformers' LlamaRMSNorm; the sum runs in another order than torch's)
 *   RoPE:     x = round(round(x * cos) + round(swap_halves(x) * signed_sin))   (bit-exact)
 *   SwiGLU:   out = round(round(g / (1 + exp(-g))) * up)   exp within 2 ulp of expf
 * In fp32 "round" is the identity. Compiled with -std=c11, so GCC contracts no a*b+c into an
 * FMA (ISO C mode turns -ffp-contract off): the products round as torch's do.
 *
 * Built together with decode_attention.c by native.py; see there for the build and threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_scalar.h"

/* A value of either dtype as float, and a float rounded to the dtype and back. Every kernel
 * below is written once with these and instantiated twice (bf16 = 1 / 0, a constant after
 * inlining), so each loop compiles to straight vector code for its dtype. */
#define INLINE static inline __attribute__((always_inline))

INLINE float get(const void *base, const int bf16, int64_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

INLINE float rounded(float f, const int bf16) { /* float_to_bf16's bits, kept as a float */
    if (!bf16) return f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t r = ((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
    const uint32_t out = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u : r;
    memcpy(&f, &out, sizeof f);
    return f;
}

INLINE void put(void *base, const int bf16, int64_t i, float f) {
    if (bf16)
        ((uint16_t *)base)[i] = float_to_bf16(f);
    else
        ((float *)base)[i] = f;
}

/* One row of add_rms_norm (below). */
INLINE void add_rms_norm_row(void *x, const void *delta, const void *weight, void *out, int64_t hidden, float eps,
                             const int bf16) {
    float sum = 0.f;
    if (delta) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; i++) {
            const float v = rounded(get(x, bf16, i) + get(delta, bf16, i), bf16);
            put(x, bf16, i, v);
            sum += v * v;
        }
    } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; i++) {
            const float v = get(x, bf16, i);
            sum += v * v;
        }
    }
    const float inv = 1.f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++) put(out, bf16, i, get(weight, bf16, i) * rounded(get(x, bf16, i) * inv, bf16));
}

/* x [rows, hidden] (row stride x_stride), delta (or NULL) and out [rows, hidden] contiguous,
 * weight [hidden]. With delta: x = round(x + delta) first, in place. */
void megarl_add_rms_norm(void *x, int64_t x_stride, const void *delta, const void *weight, void *out,
                         int64_t rows, int64_t hidden, float eps, int bf16, int threads) {
    const int64_t elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * hidden >= 65536)
    for (int64_t t = 0; t < rows; t++) {
        void *xt = (char *)x + t * x_stride * elem, *ot = (char *)out + t * hidden * elem;
        const void *dt = delta ? (const char *)delta + t * hidden * elem : NULL;
        if (bf16)
            add_rms_norm_row(xt, dt, weight, ot, hidden, eps, 1);
        else
            add_rms_norm_row(xt, dt, weight, ot, hidden, eps, 0);
    }
}

/* One head of one row of rope (below). */
INLINE void rope_head(void *head, const float *c, const float *s, int64_t d, const int bf16) {
    float x[1024];
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) x[i] = get(head, bf16, i);
#pragma omp simd
    for (int64_t i = 0; i < half; i++)
        put(head, bf16, i, rounded(x[i] * c[i], bf16) + rounded(x[i + half] * s[i], bf16));
#pragma omp simd
    for (int64_t i = half; i < d; i++)
        put(head, bf16, i, rounded(x[i] * c[i], bf16) + rounded(x[i - half] * s[i], bf16));
}

/* The first `heads` heads of each row of qkv ([rows, >= heads * d], row stride qkv_stride),
 * rotated in place: x * cos + swap_halves(x) * signed_sin, with cos and signed_sin [rows, d]
 * contiguous in the same dtype (signed_sin's first half negated: rotate_half's sign). */
int megarl_rope(void *qkv, int64_t qkv_stride, const void *cos, const void *signed_sin, int64_t rows,
                int64_t heads, int64_t d, int bf16, int threads) {
    if (d % 2 != 0 || d > 1024) return -1;
    const int64_t elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * heads * d >= 65536)
    for (int64_t t = 0; t < rows; t++) {
        float c[1024], s[1024];
        for (int64_t i = 0; i < d; i++) {
            c[i] = get(cos, bf16, t * d + i);
            s[i] = get(signed_sin, bf16, t * d + i);
        }
        for (int64_t h = 0; h < heads; h++) {
            void *head = (char *)qkv + (t * qkv_stride + h * d) * elem;
            if (bf16)
                rope_head(head, c, s, d, 1);
            else
                rope_head(head, c, s, d, 0);
        }
    }
    return 0;
}

/* One row of silu_mul (below). */
INLINE void silu_mul_row(const void *gate, const void *up, void *out, int64_t inter, const int bf16) {
#pragma omp simd
    for (int64_t i = 0; i < inter; i++) {
        const float g = get(gate, bf16, i);
        const float silu = rounded(g / (1.f + exp_clamped(-g)), bf16);
        put(out, bf16, i, silu * get(up, bf16, i));
    }
}

/* gate_up [rows, 2 * inter] (gate then up, row stride gu_stride), out [rows, inter] contiguous. */
void megarl_silu_mul(const void *gate_up, int64_t gu_stride, void *out, int64_t rows, int64_t inter, int bf16,
                     int threads) {
    const int64_t elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter >= 65536)
    for (int64_t t = 0; t < rows; t++) {
        const char *gate = (const char *)gate_up + t * gu_stride * elem;
        void *o = (char *)out + t * inter * elem;
        if (bf16)
            silu_mul_row(gate, gate + inter * elem, o, inter, 1);
        else
            silu_mul_row(gate, gate + inter * elem, o, inter, 0);
    }
}

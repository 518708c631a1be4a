/* Decode attention for the torch engine on CPU: one new query token per sequence, grouped
 * query heads, each sequence reading its own KV-cache slot up to its own length.
 *
 * Why a kernel of our own: torch's SDPA at these shapes (per sequence and KV head, a
 * [group x head_dim] query block against a few hundred keys) runs one tiny GEMM pair per
 * (sequence, head) and reached 16-20 GFLOP/s on a 2-core AVX-512 EPYC -- ~30% of a decode
 * step at batch 64. The work is a stream over the cached keys and values; this loop reads
 * each cached row once, converts it to fp32 and serves every query head of its group.
 *
 * Math: scores in fp32 (q pre-scaled by 1/sqrt(head_dim)), an exact softmax (max-subtracted,
 * the sum in fp32), the weighted sum of values in fp32, rounded once to the cache dtype --
 * what SDPA's CPU kernels compute, summed in another order.
 *
 * Built by native.py with the machine's C compiler (-O3 -march=native -fopenmp) and called
 * through ctypes with raw pointers: no Python or torch headers, so it builds in about a second.
 * OpenMP comes from the libgomp torch has already loaded (same soname), so the threads are
 * torch's own pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_scalar.h"

/* 16 floats: GCC's vector extension, lowered to whatever the CPU has (one AVX-512 register,
 * two AVX2 ones, ...). head_dim must be a multiple of 16 (the entry point checks). */
typedef float vf16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
typedef uint32_t vu16 __attribute__((vector_size(64)));

static inline vf16 load16(const void *base, int bf16, int64_t at) {
    vf16 f;
    if (bf16) {
        vh16 h;
        memcpy(&h, (const uint16_t *)base + at, sizeof h);
        vu16 u = __builtin_convertvector(h, vu16) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, (const float *)base + at, sizeof f);
    }
    return f;
}

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

static inline float sum16(vf16 v) { /* halves added as vectors: 4 dependent adds, not 16 */
    vf8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    const vf8 s8 = lo + hi;
    vf4 a, b;
    memcpy(&a, &s8, sizeof a);
    memcpy(&b, (const char *)&s8 + sizeof a, sizeof b);
    const vf4 s4 = a + b;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* One (sequence, KV head): n keys from cache row first_row, the group's queries qv
 * [group][chunks] (scaled), probabilities into scores [group][n], the output into acc
 * [group][chunks]. CHUNKS is head_dim / 16; a constant where the caller knows it, so the
 * query and accumulator vectors stay in registers. */
#define ATTEND_BODY(CHUNKS)                                                                            \
    for (int64_t g = 0; g < group; g++) {                                                              \
        const vf16 *qg = qv + g * (CHUNKS);                                                            \
        float *sg = scores + g * n;                                                                    \
        for (int64_t j = 0; j < n; j++) {                                                              \
            vf16 dot = {0};                                                                            \
            for (int64_t c = 0; c < (CHUNKS); c++) dot += qg[c] * load16(k_cache, bf16, (first_row + j) * d + 16 * c); \
            sg[j] = sum16(dot);                                                                        \
        }                                                                                              \
        float top = sg[0], sum = 0.f;                                                                  \
        for (int64_t j = 1; j < n; j++) top = sg[j] > top ? sg[j] : top;                               \
        _Pragma("omp simd reduction(+ : sum)")                                                         \
        for (int64_t j = 0; j < n; j++) {                                                              \
            sg[j] = exp_clamped(sg[j] - top);                                                      \
            sum += sg[j];                                                                              \
        }                                                                                              \
        const float inv = 1.f / sum;                                                                   \
        vf16 out[(CHUNKS)];                                                                            \
        for (int64_t c = 0; c < (CHUNKS); c++) out[c] = (vf16){0};                                     \
        for (int64_t j = 0; j < n; j++) {                                                              \
            const float p = sg[j] * inv;                                                               \
            for (int64_t c = 0; c < (CHUNKS); c++) out[c] += p * load16(v_cache, bf16, (first_row + j) * d + 16 * c); \
        }                                                                                              \
        for (int64_t c = 0; c < (CHUNKS); c++) acc[g * (CHUNKS) + c] = out[c];                          \
    }

static void attend_4(const vf16 *qv, const void *k_cache, const void *v_cache, int bf16, int64_t first_row,
                     int64_t n, int64_t group, int64_t d, float *scores, vf16 *acc) {
    ATTEND_BODY(4)
}

static void attend_8(const vf16 *qv, const void *k_cache, const void *v_cache, int bf16, int64_t first_row,
                     int64_t n, int64_t group, int64_t d, float *scores, vf16 *acc) {
    ATTEND_BODY(8)
}

static void attend_any(const vf16 *qv, const void *k_cache, const void *v_cache, int bf16, int64_t first_row,
                       int64_t n, int64_t group, int64_t d, float *scores, vf16 *acc) {
    const int64_t chunks = d / 16;
    ATTEND_BODY(chunks)
}

static inline void store_row(void *cache, int bf16, int64_t row, const void *src, int64_t d) {
    const size_t bytes = (size_t)d * (bf16 ? 2 : 4);
    memcpy((char *)cache + (size_t)row * bytes, src, bytes);
}

/* Sequence b, KV head h, query head h * group + g (GQA: a KV head serves `group` adjacent
 * query heads): q[b * q_stride + (h * group + g) * d + i], out the same contiguously
 * ([batch, kv_heads * group, d]); k_cache, v_cache: [slots, kv_heads, max_len, d], contiguous,
 * all of one dtype (bf16 != 0: bfloat16, else float32). Sequence b reads slot slots[b], keys
 * [0, lengths[b]). new_k / new_v (or NULL): the new token's key and value, rows
 * new_k[b * k_stride + h * d + i], written to position lengths[b] - 1 of the slot first --
 * each (b, h) writes only the row it then reads, so the write is part of the same pass.
 * Returns 0; -1 when a length is outside [1, max_len]; -2 when d is not a multiple of 16; -3 when a
 * slot is outside [0, num_slots). Nothing is read or written before these checks. */
int megarl_decode_attention(const void *q, int64_t q_stride, const void *new_k, int64_t k_stride, const void *new_v,
                            int64_t v_stride, void *k_cache, void *v_cache, const int64_t *slots,
                            const int64_t *lengths, void *out, int64_t batch, int64_t kv_heads, int64_t group,
                            int64_t d, int64_t num_slots, int64_t max_len, float scale, int bf16, int threads) {
    if (d % 16 != 0) return -2;
    for (int64_t b = 0; b < batch; b++) {
        if (lengths[b] < 1 || lengths[b] > max_len) return -1;
        if (slots[b] < 0 || slots[b] >= num_slots) return -3;
    }
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++) longest = lengths[b] > longest ? lengths[b] : longest;
    const int64_t elem = bf16 ? 2 : 4;

#pragma omp parallel num_threads(threads)
    {
        vf16 *qv = aligned_alloc(64, sizeof(vf16) * (size_t)(group * d / 16));
        vf16 *acc = aligned_alloc(64, sizeof(vf16) * (size_t)(group * d / 16));
        float *scores = malloc(sizeof(float) * (size_t)(group * longest));
#pragma omp for schedule(dynamic, 2)
        for (int64_t bh = 0; bh < batch * kv_heads; bh++) {
            const int64_t b = bh / kv_heads, h = bh % kv_heads, n = lengths[b];
            const int64_t first_row = (slots[b] * kv_heads + h) * max_len; /* cache row of key 0 */
            if (new_k)
                store_row(k_cache, bf16, first_row + n - 1, (const char *)new_k + (b * k_stride + h * d) * elem, d);
            if (new_v)
                store_row(v_cache, bf16, first_row + n - 1, (const char *)new_v + (b * v_stride + h * d) * elem, d);
            const int64_t q_first = b * q_stride + h * group * d;
            for (int64_t i = 0; i < group * d / 16; i++) qv[i] = scale * load16(q, bf16, q_first + 16 * i);
            if (d == 64)
                attend_4(qv, k_cache, v_cache, bf16, first_row, n, group, d, scores, acc);
            else if (d == 128)
                attend_8(qv, k_cache, v_cache, bf16, first_row, n, group, d, scores, acc);
            else
                attend_any(qv, k_cache, v_cache, bf16, first_row, n, group, d, scores, acc);
            const float *a = (const float *)acc;
            if (bf16) {
                uint16_t *o = (uint16_t *)out + bh * group * d;
                for (int64_t i = 0; i < group * d; i++) o[i] = float_to_bf16(a[i]);
            } else {
                memcpy((float *)out + bh * group * d, a, sizeof(float) * (size_t)(group * d));
            }
        }
        free(qv);
        free(acc);
        free(scores);
    }
    return 0;
}

/* A decoder layer's small per-token operations for CPUs: RMSNorm, rotary embedding (RoPE), the
 * KV-cache write and SwiGLU's activation (silu_and_mul). Built and loaded by kernels/cpu_kernels.py
 * like cpu_attention.c, but without -ffast-math: in plain ISO C (-std=c11, so no contraction into
 * fused multiply-adds) each result is rounded as PyTorch's own float32 ops round it, so RoPE and the
 * KV write are bit-identical to kernels/reference.py; RMSNorm differs only in the order of its sum
 * of squares, and silu_and_mul's e^x is a polynomial (relative error ~1e-7): float rounding.
 *
 * Why C: on a small model each of these is a few microseconds of arithmetic behind 5-60 us of
 * PyTorch per-op overhead (RoPE alone is eight tensor ops per Q or K), paid once per layer per step.
 * silu_and_mul reads the gate/up projection once and writes its result once, where PyTorch's silu
 * and multiply write and re-read a [num_tokens, intermediate_size] temporary: on a prefill chunk
 * those are megabytes, past the L2 cache.
 *
 * Layouts (float32 unless said): rows of tokens with a given stride in elements (a row may be a
 * slice of a wider tensor, e.g. a fused QKV projection's output); within a row, heads x head_dim
 * contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vector.h"

/* out[t] = weight * (x[t] / sqrt(mean(x[t]^2) + eps)) for num_tokens rows of `size` elements
 * (Zhang & Sennrich 2019; HF's LlamaRMSNorm in float32). out may be x. */
void rms_norm(const float *restrict x, int64_t x_stride, const float *restrict weight, float eps, int64_t num_tokens,
              int size, float *restrict out, int64_t out_stride) {
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *restrict xt = x + t * x_stride;
        float *restrict ot = out + t * out_stride;
        float partial[8] = {0};  /* eight running sums, as a vectorized reduction keeps them */
        int i = 0;
        for (; i + 8 <= size; i += 8)
            for (int j = 0; j < 8; j++) partial[j] += xt[i + j] * xt[i + j];
        float sum = 0.0f;
        for (int j = 0; j < 8; j++) sum += partial[j];
        for (; i < size; i++) sum += xt[i] * xt[i];
        const float r = 1.0f / sqrtf(sum / (float)size + eps);
        for (i = 0; i < size; i++) ot[i] = weight[i] * (xt[i] * r);
    }
}

/* Rotates, in place, each head of q ([num_tokens, num_heads, head_dim], rows q_stride apart) and k
 * ([num_tokens, num_kv_heads, head_dim], rows k_stride apart) by token t's angles: cos and sin are
 * [num_tokens, head_dim / 2]. HF's rotate_half pairing: element i with element i + head_dim / 2
 * (Su et al. 2021, RoFormer, section 3.4.2). */
static inline __attribute__((always_inline)) void rotate(float *restrict row, int heads, const int head_dim,
                                                        const float *restrict c, const float *restrict s) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; h++) {
        float *restrict x1 = row + h * head_dim, *restrict x2 = x1 + half;
        for (int i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i] + a * s[i];
        }
    }
}

/* head_dim known at compile time for the common sizes: the inner loop becomes straight vector code */
#define ROTATE_ALL(D)                                                                                  \
    for (int64_t t = 0; t < num_tokens; t++) {                                                        \
        rotate(q + t * q_stride, num_heads, D, cos + t * (D / 2), sin + t * (D / 2));                  \
        rotate(k + t * k_stride, num_kv_heads, D, cos + t * (D / 2), sin + t * (D / 2));               \
    }

void rotary_embedding(float *q, int64_t q_stride, int num_heads, float *k, int64_t k_stride, int num_kv_heads,
                      int head_dim, const float *cos, const float *sin, int64_t num_tokens) {
    switch (head_dim) {
        case 8: ROTATE_ALL(8) break;
        case 64: ROTATE_ALL(64) break;
        case 128: ROTATE_ALL(128) break;
        default: ROTATE_ALL(head_dim)
    }
}
#undef ROTATE_ALL

/* float32 to bfloat16 as PyTorch rounds it: to nearest, ties to even; NaN stays a (quiet) NaN. */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (isnan(x)) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Stores token t's K and V rows (row_size = num_kv_heads x head_dim elements, float32, rows
 * key_stride / value_stride apart) into slot slot_mapping[t] of k_cache and v_cache ([num_slots,
 * row_size] of float32, or of bfloat16 when bf16 is 1); slot -1 skips the token (padding).
 * Returns 0, or -2 (and writes nothing) when a slot is outside [-1, num_slots). */
int write_kv_cache(const float *key, int64_t key_stride, const float *value, int64_t value_stride, void *k_cache,
                   void *v_cache, int bf16, const int64_t *slot_mapping, int64_t num_tokens, int row_size,
                   int64_t num_slots) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] < -1 || slot_mapping[t] >= num_slots) return -2;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const float *kt = key + t * key_stride, *vt = value + t * value_stride;
        if (bf16) {
            uint16_t *kd = (uint16_t *)k_cache + slot * row_size, *vd = (uint16_t *)v_cache + slot * row_size;
            for (int i = 0; i < row_size; i++) kd[i] = to_bf16(kt[i]), vd[i] = to_bf16(vt[i]);
        } else {
            memcpy((float *)k_cache + slot * row_size, kt, sizeof(float) * (size_t)row_size);
            memcpy((float *)v_cache + slot * row_size, vt, sizeof(float) * (size_t)row_size);
        }
    }
    return 0;
}

/* Lane-wise mask ? a : b (C has no vector ?:) */
static inline f32x8 select8(i32x8 mask, f32x8 a, f32x8 b) {
    return (f32x8)(((i32x8)a & mask) | ((i32x8)b & ~mask));
}

/* silu(g) = g / (1 + e^-g), from e = e^-|g| <= 1 so that nothing overflows: 1 / (1 + e) for g > 0,
 * e / (1 + e) otherwise. */
static inline f32x8 silu8(f32x8 g) {
    const i32x8 positive = g > 0.0f;
    const f32x8 e = exp8(-max8(g, -g));
    const f32x8 r = 1.0f / (1.0f + e);
    return g * select8(positive, r, e * r);
}

/* SwiGLU's activation (Shazeer 2020): out[t][i] = silu(x[t][i]) * x[t][size + i], for rows t of x
 * ([num_tokens][2 * size], rows x_stride apart: the fused gate/up projection's output, gate first)
 * into out ([num_tokens][size], rows out_stride apart). */
void silu_and_mul(const float *restrict x, int64_t x_stride, int64_t num_tokens, int size, float *restrict out,
                  int64_t out_stride) {
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *restrict gate = x + t * x_stride, *restrict up = gate + size;
        float *restrict o = out + t * out_stride;
        int i = 0;
        for (; i + 8 <= size; i += 8)
            *(f32x8 *)(o + i) = silu8(*(const f32x8 *)(gate + i)) * *(const f32x8 *)(up + i);
        if (i < size) {  /* the row's last size % 8 elements, through a zero-padded vector */
            f32x8 g = {0}, u = {0};
            memcpy(&g, gate + i, sizeof(float) * (size_t)(size - i));
            memcpy(&u, up + i, sizeof(float) * (size_t)(size - i));
            const f32x8 r = silu8(g) * u;
            memcpy(o + i, &r, sizeof(float) * (size_t)(size - i));
        }
    }
}

/* A decoder layer's small per-token operations for CPUs: RMSNorm, rotary embedding (RoPE), the
 * KV-cache write and SwiGLU's activation (silu_and_mul). Built and loaded by kernels/cpu_kernels.py
 * like cpu_attention.c, but without its fast-math flags and with -ffp-contract=off (no contraction
 * into fused multiply-adds): each result is rounded as PyTorch's own float32 ops round it, so RoPE and the
 * KV write are bit-identical to kernels/reference.py; RMSNorm differs only in the order of its sum
 * of squares, and silu_and_mul's e^x is a polynomial (relative error ~1e-7): float rounding.
 *
 * Why C: on a small model each of these is a few microseconds of arithmetic behind 5-60 us of
 * PyTorch per-op overhead (RoPE alone is eight tensor ops per Q or K), paid once per layer per step.
 * silu_and_mul reads the gate/up projection once and writes its result once, where PyTorch's silu
 * and multiply write and re-read a [num_tokens, intermediate_size] temporary: on a prefill chunk
 * those are megabytes, past the L2 cache.
 *
 * Element types: float32 or bfloat16 (`kind`, the model's dtype; a bfloat16 KV pool for either),
 * except silu_and_mul, float32 only.
 * bfloat16 is computed in float32 and rounded to bfloat16 wherever the reference's PyTorch ops
 * round (to nearest, ties to even): RMSNorm after its normalisation and after the weight, RoPE and
 * the KV write once, at the cast. NaN becomes 0x7fc0 where PyTorch may keep other NaN bits.
 * Layouts: rows of tokens with a given stride in elements (a row may be a slice of a wider tensor,
 * e.g. a fused QKV projection's output); within a row, heads x head_dim contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vector.h"

enum { F32 = 0, BF16 = 1 };  /* element kinds: cpu_kernels.py's _F32, _BF16 */

/* float32 to bfloat16 as PyTorch rounds it: to nearest, ties to even; NaN stays a (quiet) NaN. */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (isnan(x)) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Element i of a `kind` array as float32, and x stored there (rounded for bfloat16). Called with a
 * constant kind from always-inline bodies, so each kind compiles to its own straight loop. */
static inline __attribute__((always_inline)) float load1(int kind, const void *p, int64_t i) {
    return kind == BF16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void store1(int kind, void *p, int64_t i, float x) {
    if (kind == BF16)
        ((uint16_t *)p)[i] = to_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* x as a `kind` tensor holds it: what PyTorch keeps between two ops on a bfloat16 tensor. */
static inline __attribute__((always_inline)) float round1(int kind, float x) {
    return kind == BF16 ? from_bf16(to_bf16(x)) : x;
}

/* Bytes per element of a kind. */
static inline int64_t elem_bytes(int kind) { return kind == BF16 ? 2 : 4; }

/* out[t] = weight * (x[t] / sqrt(mean(x[t]^2) + eps)) for num_tokens rows of `size` elements
 * (Zhang & Sennrich 2019; HF's LlamaRMSNorm: the norm in float32, x / rms rounded to x's type before
 * the weight multiplies it). x, weight and out are all of `kind`. */
static inline __attribute__((always_inline)) void rms_norm_rows(
        const int kind, const void *restrict x, int64_t x_stride, const void *restrict weight, float eps,
        int64_t num_tokens, int size, void *restrict out, int64_t out_stride) {
    for (int64_t t = 0; t < num_tokens; t++) {
        const char *xt = (const char *)x + t * x_stride * elem_bytes(kind);
        char *ot = (char *)out + t * out_stride * elem_bytes(kind);
        float partial[8] = {0};  /* eight running sums, as a vectorized reduction keeps them */
        int i = 0;
        for (; i + 8 <= size; i += 8)
            for (int j = 0; j < 8; j++) {
                const float v = load1(kind, xt, i + j);
                partial[j] += v * v;
            }
        float sum = 0.0f;
        for (int j = 0; j < 8; j++) sum += partial[j];
        for (; i < size; i++) sum += load1(kind, xt, i) * load1(kind, xt, i);
        const float r = 1.0f / sqrtf(sum / (float)size + eps);
        for (i = 0; i < size; i++)
            store1(kind, ot, i, load1(kind, weight, i) * round1(kind, load1(kind, xt, i) * r));
    }
}

void rms_norm(int kind, const void *x, int64_t x_stride, const void *weight, float eps, int64_t num_tokens,
              int size, void *out, int64_t out_stride) {
    if (kind == BF16)
        rms_norm_rows(BF16, x, x_stride, weight, eps, num_tokens, size, out, out_stride);
    else
        rms_norm_rows(F32, x, x_stride, weight, eps, num_tokens, size, out, out_stride);
}

/* Rotates, in place, each head of q ([num_tokens, num_heads, head_dim], rows q_stride apart) and k
 * ([num_tokens, num_kv_heads, head_dim], rows k_stride apart), both of `kind`, by token t's angles:
 * cos and sin are float32 [num_tokens, head_dim / 2]. HF's rotate_half pairing: element i with
 * element i + head_dim / 2 (Su et al. 2021, RoFormer, section 3.4.2). Computed in float32 and
 * rounded once, as the reference's float32 arithmetic then cast. */
static inline __attribute__((always_inline)) void rotate(const int kind, void *restrict row, int heads,
                                                        const int head_dim, const float *restrict c,
                                                        const float *restrict s) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; h++) {
        char *x1 = (char *)row + (int64_t)h * head_dim * elem_bytes(kind), *x2 = x1 + half * elem_bytes(kind);
        for (int i = 0; i < half; i++) {
            const float a = load1(kind, x1, i), b = load1(kind, x2, i);
            store1(kind, x1, i, a * c[i] - b * s[i]);
            store1(kind, x2, i, b * c[i] + a * s[i]);
        }
    }
}

/* head_dim known at compile time for the common sizes: the inner loop becomes straight vector code */
#define ROTATE_ALL(K, D)                                                                                       \
    for (int64_t t = 0; t < num_tokens; t++) {                                                                 \
        rotate(K, (char *)q + t * q_stride * elem_bytes(K), num_heads, D, cos + t * (D / 2), sin + t * (D / 2)); \
        rotate(K, (char *)k + t * k_stride * elem_bytes(K), num_kv_heads, D, cos + t * (D / 2),               \
               sin + t * (D / 2));                                                                             \
    }
#define ROTATE_DIMS(K)                           \
    switch (head_dim) {                          \
        case 8: ROTATE_ALL(K, 8) break;          \
        case 64: ROTATE_ALL(K, 64) break;        \
        case 128: ROTATE_ALL(K, 128) break;      \
        default: ROTATE_ALL(K, head_dim)         \
    }

void rotary_embedding(int kind, void *q, int64_t q_stride, int num_heads, void *k, int64_t k_stride,
                      int num_kv_heads, int head_dim, const float *cos, const float *sin, int64_t num_tokens) {
    if (kind == BF16)
        ROTATE_DIMS(BF16)
    else
        ROTATE_DIMS(F32)
}
#undef ROTATE_DIMS
#undef ROTATE_ALL

/* Stores token t's K and V rows (row_size = num_kv_heads x head_dim elements of src_kind, rows
 * key_stride / value_stride apart) into slot slot_mapping[t] of k_cache and v_cache ([num_slots,
 * row_size] of dst_kind); slot -1 skips the token (padding). Returns 0, or -2 (and writes nothing)
 * when a slot is outside [-1, num_slots). */
int write_kv_cache(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                   void *v_cache, int src_kind, int dst_kind, const int64_t *slot_mapping, int64_t num_tokens,
                   int row_size, int64_t num_slots) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] < -1 || slot_mapping[t] >= num_slots) return -2;
    const int64_t src = elem_bytes(src_kind), dst = elem_bytes(dst_kind);
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const char *kt = (const char *)key + t * key_stride * src, *vt = (const char *)value + t * value_stride * src;
        char *kd = (char *)k_cache + slot * row_size * dst, *vd = (char *)v_cache + slot * row_size * dst;
        if (src_kind == dst_kind) {
            memcpy(kd, kt, (size_t)(row_size * dst));
            memcpy(vd, vt, (size_t)(row_size * dst));
        } else {  /* a conversion (float32 K/V into a bfloat16 pool): off the serving path, one loop */
            for (int i = 0; i < row_size; i++) {
                store1(dst_kind, kd, i, load1(src_kind, kt, i));
                store1(dst_kind, vd, i, load1(src_kind, vt, i));
            }
        }
    }
    return 0;
}

/* silu(g) = g / (1 + e^-g), from e = e^-|g| <= 1 so that nothing overflows: 1 / (1 + e) for g > 0,
 * e / (1 + e) otherwise. */
static inline f32xw siluw(f32xw g) {
    const f32xw e = expw(-maxw(g, -g));
    const f32xw r = 1.0f / (1.0f + e);
    return g * selectw(g > 0.0f, r, e * r);
}

/* SwiGLU's activation (Shazeer 2020): out[t][i] = silu(x[t][i]) * x[t][size + i], for rows t of x
 * ([num_tokens][2 * size], rows x_stride apart: the fused gate/up projection's output, gate first)
 * into out ([num_tokens][size], rows out_stride apart), in the target's widest vectors: with AVX-512's
 * 16 lanes 0.25 ms against 8 lanes' 0.31 at 2,052 x 172 (a stories260K prefill step, one thread), the
 * same results bit for bit. float32 only: a bfloat16 version of the 8-lane loop, with its conversions,
 * took twice as long as PyTorch's own silu and multiply (16 lanes with AVX-512) on a 2,040 x 2,816
 * prefill step, so bfloat16 stays on PyTorch (cpu_kernels.py). */
void silu_and_mul(const float *restrict x, int64_t x_stride, int64_t num_tokens, int size, float *restrict out,
                  int64_t out_stride) {
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *restrict gate = x + t * x_stride, *restrict up = gate + size;
        float *restrict o = out + t * out_stride;
        int i = 0;
        for (; i + WIDE <= size; i += WIDE)
            *(f32xw *)(o + i) = siluw(*(const f32xw *)(gate + i)) * *(const f32xw *)(up + i);
        if (i < size) {  /* the row's last size % WIDE elements, through a zero-padded vector */
            f32xw g = {0}, u = {0};
            memcpy(&g, gate + i, sizeof(float) * (size_t)(size - i));
            memcpy(&u, up + i, sizeof(float) * (size_t)(size - i));
            const f32xw r = siluw(g) * u;
            memcpy(o + i, &r, sizeof(float) * (size_t)(size - i));
        }
    }
}

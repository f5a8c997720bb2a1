/* Eight-lane vector helpers shared by cpu_attention.c and cpu_ops.c (GCC and Clang vector
 * extensions: one AVX register, two SSE or NEON ones; no target-specific builtins). Part of each
 * file's build key in kernels/cpu_kernels.py, so editing it rebuilds both. */
#ifndef PAGEDKV_CPU_VECTOR_H
#define PAGEDKV_CPU_VECTOR_H

#include <stdint.h>

/* Eight floats (or int32) as one value, loadable from any float address. */
typedef float f32x8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t i32x8 __attribute__((vector_size(32), aligned(4), may_alias));

/* The lane-wise maximum, written lane by lane: the compiler makes it one vmaxps (or NEON fmax). */
static inline __attribute__((always_inline)) f32x8 max8(f32x8 a, f32x8 b) {
    for (int i = 0; i < 8; i++) a[i] = a[i] > b[i] ? a[i] : b[i];
    return a;
}

/* e^x for x <= 0 on eight lanes: 2^n e^f with n the integer nearest x log2(e) (truncating t - 0.5
 * rounds a t <= 0 to nearest) and f = x - n ln2, |f| <= 0.35; e^f by its degree-7 Taylor polynomial
 * (error < 1e-8), evaluated by Estrin's scheme (products of f^2 and f^4 side by side: half the
 * dependent steps of Horner's); 2^n made in float ((n + 127) * 2^23 converted to int is the
 * exponent's bits), so that every step is one 256-bit float or conversion instruction, also on AVX
 * machines without AVX2's 256-bit integer ops. x is clamped at -87 (e^-87 ~ 1.6e-38, about the
 * smallest normal float). Relative error against double exp: 7e-8 on [-5, 0], 3e-7 down to -80. */
static inline __attribute__((always_inline)) f32x8 exp8(f32x8 x) {
    const f32x8 lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    x = max8(x, lo);
    const f32x8 n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f - 0.5f, i32x8), f32x8);
    const f32x8 f = x - n * 0.693147181f;
    const f32x8 f2 = f * f, f4 = f2 * f2;
    const f32x8 p = ((1.0f + f) + f2 * (0.5f + f * (1.0f / 6))) + f4 * (((1.0f / 24) + f * (1.0f / 120))
                  + f2 * ((1.0f / 720) + f * (1.0f / 5040)));
    const i32x8 bits = __builtin_convertvector((n + 127.0f) * 8388608.0f, i32x8);
    return p * (f32x8)bits;
}

#endif

/* Vector helpers shared by cpu_attention.c and cpu_ops.c (GCC and Clang vector extensions, no
 * target-specific builtins): eight lanes (one AVX register, two SSE or NEON ones), and the target's
 * widest vector. Part of each file's build key in kernels/cpu_kernels.py, so editing it rebuilds both. */
#ifndef PAGEDKV_CPU_VECTOR_H
#define PAGEDKV_CPU_VECTOR_H

#include <stdint.h>

/* Eight floats (or int32) as one value, loadable from any float address. */
typedef float f32x8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t i32x8 __attribute__((vector_size(32), aligned(4), may_alias));

/* The widest vector of this build's target: sixteen floats (one 512-bit register) with AVX-512,
 * else eight (as f32x8), for loops whose lanes are all independent (a row of elements). */
#ifdef __AVX512F__
#define WIDE 16
#else
#define WIDE 8
#endif
typedef float f32xw __attribute__((vector_size(4 * WIDE), aligned(4), may_alias));
typedef int32_t i32xw __attribute__((vector_size(4 * WIDE), aligned(4), may_alias));

/* Lane-wise mask ? a : b, for a mask from a vector comparison (C has no vector ?:). */
static inline __attribute__((always_inline)) f32xw selectw(i32xw mask, f32xw a, f32xw b) {
    return (f32xw)(((i32xw)a & mask) | ((i32xw)b & ~mask));
}

/* The lane-wise maximum. max8 written lane by lane: the compiler makes it one vmaxps (or NEON
 * fmax). maxw is max8 at eight lanes; at sixteen a compare and a select, which a 512-bit register
 * takes as is (written lane by lane, GCC split it into two 256-bit halves through memory). */
static inline __attribute__((always_inline)) f32x8 max8(f32x8 a, f32x8 b) {
    for (int i = 0; i < 8; i++) a[i] = a[i] > b[i] ? a[i] : b[i];
    return a;
}

static inline __attribute__((always_inline)) f32xw maxw(f32xw a, f32xw b) {
#if WIDE == 8
    return max8(a, b);  /* one vmaxps, where the compare and select take four AVX instructions */
#else
    return selectw(a > b, a, b);
#endif
}

/* e^x for x <= 0, lane-wise: 2^n e^f with n the integer nearest x log2(e) (truncating t - 0.5
 * rounds a t <= 0 to nearest) and f = x - n ln2, |f| <= 0.35; e^f by its degree-7 Taylor polynomial
 * (error < 1e-8), evaluated by Estrin's scheme (products of f^2 and f^4 side by side: half the
 * dependent steps of Horner's); 2^n made in float ((n + 127) * 2^23 converted to int is the
 * exponent's bits), so that every step is one float or conversion instruction, also on AVX
 * machines without AVX2's 256-bit integer ops. x is clamped at -87 (e^-87 ~ 1.6e-38, about the
 * smallest normal float). Relative error against double exp: 7e-8 on [-5, 0], 3e-7 down to -80.
 * exp8 and expw are one function, lane for lane. */
#define DEFINE_EXP(NAME, F, I, MAX)                                                                     \
    static inline __attribute__((always_inline)) F NAME(F x) {                                          \
        x = MAX(x, (F){0} - 87.0f);                                                                     \
        const F n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f - 0.5f, I), F);     \
        const F f = x - n * 0.693147181f;                                                               \
        const F f2 = f * f, f4 = f2 * f2;                                                               \
        const F p = ((1.0f + f) + f2 * (0.5f + f * (1.0f / 6))) + f4 * (((1.0f / 24) + f * (1.0f / 120)) \
                  + f2 * ((1.0f / 720) + f * (1.0f / 5040)));                                           \
        const I bits = __builtin_convertvector((n + 127.0f) * 8388608.0f, I);                           \
        return p * (F)bits;                                                                             \
    }
DEFINE_EXP(exp8, f32x8, i32x8, max8)
DEFINE_EXP(expw, f32xw, i32xw, maxw)
#undef DEFINE_EXP

#endif

/* Fused paged attention for CPUs: new tokens read their sequence's K/V in place through the
 * block table (PagedAttention, Kwon et al., SOSP 2023, section 4.1). Built and loaded by
 * kernels/cpu_kernels.py (plain C, no torch headers, so it compiles in about a second).
 *
 * Why not tensor ops: a decode step is bound by reading the KV cache. Gathering K/V into a
 * contiguous tensor, then transposing it for a batched GEMM, moves every byte three times and
 * pays per-(sequence, head) GEMM overheads; here K/V are read in place. Four paths:
 * - attend: one new token (decode), all heads, one pass over its context: scores, softmax, V.
 * - attend_heads8: the same at head_dim 8, eight heads to a vector (one lane each).
 * - attend_tile: up to TILE_Q consecutive new tokens of a sequence (prefill, extend) together,
 *   with an online softmax (FlashAttention) over chunks of CHUNK keys: each K/V row is loaded
 *   once per tile instead of once per token, K is transposed per chunk so that scores are
 *   vector multiply-adds over keys (no horizontal sums at head_dim 8), and each token stops at
 *   its own position (no padding, no mask beyond its last chunk).
 * - attend_tile8: the same at head_dim 8, eight heads to a vector (attend_heads8's layout).
 * Prefill chunks up to max_query_len tokens run here; longer ones take cpu_kernels.py's GEMMs.
 *
 * Layout: q and out [num_tokens, num_heads, head_dim] float32; k_cache and v_cache
 * [num_blocks, block_size, num_kv_heads, head_dim] of the pool's element type; block_tables
 * [num_seqs, table_stride] int32; seq_lens [num_seqs] int32 (context including the new token);
 * query_start_loc [num_seqs + 1] int32. Only sequences with 1 to max_query_len new tokens are
 * computed; the others' rows of out are left untouched. Head h reads KV head h / (num_heads / num_kv_heads).
 */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vector.h"

enum { KV_F32 = 0, KV_BF16 = 1, KV_LUT8 = 2 };

/* The running maximum's start and a masked key's score: below every float32 score (-1e30 was not:
 * a query whose scores were all below it got V's plain average). e^(NO_SCORE - max) is clamped to
 * e^-87 like any other weight that small, also where the difference overflows to -inf. */
#define NO_SCORE (-FLT_MAX)

/* Every element type becomes float32 here; 8-bit caches (fp8 E4M3 / E5M2) decode through a
 * 256-entry table built by the caller from torch, so this file knows no fp8 format. */
static inline void load_row(int kind, const void *base, int64_t index, int n, const float *lut, float *dst) {
    if (kind == KV_F32) {
        memcpy(dst, (const float *)base + index, (size_t)n * sizeof(float));
    } else if (kind == KV_BF16) {
        const uint16_t *src = (const uint16_t *)base + index;
        for (int i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)src[i] << 16;
            memcpy(dst + i, &bits, sizeof(float));
        }
    } else {
        const uint8_t *src = (const uint8_t *)base + index;
        for (int i = 0; i < n; i++) dst[i] = lut[src[i]];
    }
}

/* Warm the cache with one slot's row (row_bytes from p). The decode paths fetch the next block's
 * row j while they read row j of the current one (blocks sit at random places in the pool, so the
 * hardware prefetcher cannot guess the next one), so a block's misses spread over its keys. Issued
 * all at once at the block's start they queue behind each other: past L3, 256 x 112 decode at
 * 8/4/8 took 1.25x as long that way (native driver, one thread, 6 alternated pairs). After a pass's
 * last block, usually partial, the next block (the other pass's first, or the next sequence's) gets
 * only as many rows as that block has keys: fetching all of it there, ceil(block_size / n) rows per
 * key, was 0.93-0.98x at 256 x 100 (8/4/8, 16/2/8) and 64 x 1000 (32/8/64), 1.07x at 256 x 40. */
static inline __attribute__((always_inline)) void prefetch_row(const char *p, int64_t row_bytes) {
    for (const char *line = (const char *)((uintptr_t)p & ~(uintptr_t)63); line < p + row_bytes; line += 64)
        __builtin_prefetch(line);
}

/* The keys [first, first + n) of a sequence that lie in its block first / block_size: returns n,
 * their first slot goes to *slot0, and the sequence's next block in the same pool (for
 * prefetch_row; NULL at its last block, so n is block_size whenever there is one) to *next. */
static inline __attribute__((always_inline)) int block_keys(const int32_t *table, int64_t first, int64_t len,
                                                           int block_size, const void *cache, int64_t block_bytes,
                                                           int64_t *slot0, const char **next) {
    *slot0 = (int64_t)table[first / block_size] * block_size;
    *next = first + block_size < len ? (const char *)cache + (int64_t)table[first / block_size + 1] * block_bytes : NULL;
    return len - first < block_size ? (int)(len - first) : block_size;
}

/* A slot's K or V row (n elements from element `index` of the pool) as float32: in place for a
 * float32 pool, else converted into `row`. */
static inline __attribute__((always_inline)) const float *kv_row(int kind, const void *cache, int64_t index, int n,
                                                                const float *lut, float *row) {
    if (kind == KV_F32) return (const float *)cache + index;
    load_row(kind, cache, index, n, lut, row);
    return row;
}

/* One new token of a sequence, all heads: each slot's K (then V) row is read once, in address order
 * within a block, for every head at once. q, out: [num_heads, head_dim]; scores: [num_heads, len]. */
static inline __attribute__((always_inline)) void attend(
        const float *restrict q, const void *k_cache, const void *v_cache, int kind, const float *lut,
        int64_t elem_bytes, const int32_t *table, int64_t len, int num_kv_heads, int group,
        const int head_dim, int block_size, float qk_scale, float v_scale,
        float *restrict scores, float *restrict row, float *restrict out, const char *then) {
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;  /* elements between slots */
    const int64_t row_bytes = token_stride * elem_bytes, block_bytes = block_size * row_bytes;
    const int num_heads = num_kv_heads * group;
    /* scores[h][t] = qk_scale * <q_h, k_t>, block by block: the block table is read once per block */
    for (int64_t first = 0, slot0; first < len; first += block_size) {
        const char *next;
        const int n = block_keys(table, first, len, block_size, k_cache, block_bytes, &slot0, &next);
        if (!next) next = (const char *)v_cache + (int64_t)table[0] * block_bytes;  /* the V pass's first block */
        for (int j = 0; j < n; j++) {
            prefetch_row(next + j * row_bytes, row_bytes);
            const float *k = kv_row(kind, k_cache, (slot0 + j) * token_stride, (int)token_stride, lut, row);
            for (int kvh = 0, h = 0; kvh < num_kv_heads; kvh++) {
                const float *restrict kh = k + (int64_t)kvh * head_dim;
                for (int g = 0; g < group; g++, h++) {
                    const float *restrict qh = q + (int64_t)h * head_dim;
                    float dot = 0.0f;
                    for (int d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
                    scores[(int64_t)h * len + first + j] = dot * qk_scale;
                }
            }
        }
    }
    /* softmax over t for each head; V's scale folds into the normalisation */
    for (int h = 0; h < num_heads; h++) {
        float *restrict sh = scores + (int64_t)h * len;
        float m = sh[0], sum = 0.0f;
        for (int64_t t = 1; t < len; t++) m = sh[t] > m ? sh[t] : m;
        for (int64_t t = 0; t < len; t++) sh[t] = expf(sh[t] - m);
        for (int64_t t = 0; t < len; t++) sum += sh[t];
        const float inv = v_scale / sum;
        for (int64_t t = 0; t < len; t++) sh[t] *= inv;
    }
    /* out_h = sum_t p[h][t] * v_t, accumulated in place */
    memset(out, 0, sizeof(float) * (size_t)num_heads * (size_t)head_dim);
    for (int64_t first = 0, slot0; first < len; first += block_size) {
        const char *next;
        const int n = block_keys(table, first, len, block_size, v_cache, block_bytes, &slot0, &next);
        if (!next) next = then;  /* the next sequence's first K block */
        for (int j = 0; j < n; j++) {
            if (next) prefetch_row(next + j * row_bytes, row_bytes);
            const float *v = kv_row(kind, v_cache, (slot0 + j) * token_stride, (int)token_stride, lut, row);
            for (int kvh = 0, h = 0; kvh < num_kv_heads; kvh++) {
                const float *restrict vh = v + (int64_t)kvh * head_dim;
                for (int g = 0; g < group; g++, h++) {
                    const float p = scores[(int64_t)h * len + first + j];
                    float *restrict o = out + (int64_t)h * head_dim;
                    for (int d = 0; d < head_dim; d++) o[d] += p * vh[d];
                }
            }
        }
    }
}

enum { TILE_Q = 16, CHUNK = 32 };  /* queries per tile; keys per online-softmax step (4 AVX2 vectors) */

/* e^x for x <= 0 in plain arithmetic, so that loops over it vectorize inline (no libm call):
 * e^x = 2^n e^f with n the integer nearest x log2(e) (truncating t - 0.5 rounds a t <= 0 to
 * nearest) and f = x - n ln2 (one fused multiply-add), |f| <= 0.35; e^f by its degree-7 Taylor
 * polynomial (error < 1e-8); 2^n written into the exponent bits. Relative error against double
 * exp: 7e-8 on [-5, 0], 3e-7 down to -80 (float ln2 times n). x is clamped at -87 (e^-87 ~
 * 1.6e-38, about the smallest normal float), so n + 127 >= 1. */
static inline float exp_nonpositive(float x) {
    x = x > -87.0f ? x : -87.0f;
    const int32_t n = (int32_t)(x * 1.44269504f - 0.5f);
    const float f = x - (float)n * 0.693147181f;
    const float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120
                  + f * (1.0f / 720 + f * (1.0f / 5040)))))));
    const int32_t bits = (n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Per-thread scratch of the tile path, for one KV head at a time (rows = TILE_Q x group);
 * attend_tile8 lays its own arrays over the same fields (sized for both in run). */
typedef struct {
    float *q;    /* [rows][head_dim]: the tile's queries of the KV head's group, times qk_scale */
    float *acc;  /* [rows][head_dim]: sum of p * v so far */
    float *m;    /* [rows]: running max of the scores */
    float *l;    /* [rows]: running sum of e^(score - m) */
    float *kt;   /* [head_dim][CHUNK]: the chunk's K, transposed so a row's scores are vector FMAs */
    float *v;    /* [CHUNK][head_dim]: the chunk's V as float32 */
    float *row;  /* [num_kv_heads * head_dim]: one slot's K or V row converted from the pool's element type */
    float *s;    /* [rows][CHUNK]: the chunk's scores, then weights */
} Scratch;


/* s[r][c] = <q[r], kt[:, c]> for rows r of q ([rows][head_dim]) and the CHUNK keys of a chunk
 * (kt: [head_dim][CHUNK], s: [rows][CHUNK]). Written with vectors so that the accumulators stay
 * in registers for every head_dim (as plain loops they do only when the d loop unrolls fully);
 * two rows at a time share each load of kt. */
static inline __attribute__((always_inline)) void chunk_scores(
        const float *restrict q, int rows, const float *restrict kt, const int head_dim, float *restrict s) {
    _Static_assert(CHUNK == 32, "four vectors of eight keys");
    int r = 0;
    for (; r + 2 <= rows; r += 2) {
        const float *restrict q0 = q + r * head_dim, *restrict q1 = q0 + head_dim;
        f32x8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, t0 = {0}, t1 = {0}, t2 = {0}, t3 = {0};
        for (int d = 0; d < head_dim; d++) {
            const f32x8 *k = (const f32x8 *)(kt + d * CHUNK);
            const f32x8 k0 = k[0], k1 = k[1], k2 = k[2], k3 = k[3];
            s0 += q0[d] * k0, s1 += q0[d] * k1, s2 += q0[d] * k2, s3 += q0[d] * k3;
            t0 += q1[d] * k0, t1 += q1[d] * k1, t2 += q1[d] * k2, t3 += q1[d] * k3;
        }
        f32x8 *out = (f32x8 *)(s + r * CHUNK);
        out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3, out[4] = t0, out[5] = t1, out[6] = t2, out[7] = t3;
    }
    if (r < rows) {
        const float *restrict q0 = q + r * head_dim;
        f32x8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        for (int d = 0; d < head_dim; d++) {
            const f32x8 *k = (const f32x8 *)(kt + d * CHUNK);
            s0 += q0[d] * k[0], s1 += q0[d] * k[1], s2 += q0[d] * k[2], s3 += q0[d] * k[3];
        }
        f32x8 *out = (f32x8 *)(s + r * CHUNK);
        out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
    }
}

/* a += sum over c < n of p[c] v[c], v: [n][head_dim]. Enough independent vector accumulators
 * that consecutive multiply-adds do not wait on each other: eight along d for head_dim a multiple
 * of 64; else, for a multiple of 8, four along the keys (c mod 4) per eight of a's elements; other
 * sizes take the plain loop. */
static inline __attribute__((always_inline)) void add_weighted_rows(
        float *restrict a, const float *restrict p, const float *restrict v, int n, const int head_dim) {
    if (head_dim % 8 != 0) {
        for (int c = 0; c < n; c++)
            for (int d = 0; d < head_dim; d++) a[d] += p[c] * v[c * head_dim + d];
        return;
    }
    if (head_dim % 64 == 0) {  /* eight accumulators along d share one broadcast of p[c] */
        for (int j = 0; j < head_dim; j += 64) {
            f32x8 *aj = (f32x8 *)(a + j);
            f32x8 a0 = aj[0], a1 = aj[1], a2 = aj[2], a3 = aj[3], a4 = aj[4], a5 = aj[5], a6 = aj[6], a7 = aj[7];
            for (int c = 0; c < n; c++) {
                const f32x8 *vc = (const f32x8 *)(v + c * head_dim + j);
                const float pc = p[c];
                a0 += pc * vc[0], a1 += pc * vc[1], a2 += pc * vc[2], a3 += pc * vc[3];
                a4 += pc * vc[4], a5 += pc * vc[5], a6 += pc * vc[6], a7 += pc * vc[7];
            }
            aj[0] = a0, aj[1] = a1, aj[2] = a2, aj[3] = a3, aj[4] = a4, aj[5] = a5, aj[6] = a6, aj[7] = a7;
        }
        return;
    }
    for (int j = 0; j < head_dim; j += 8) {
        f32x8 a0 = *(const f32x8 *)(a + j), a1 = {0}, a2 = {0}, a3 = {0};
        const float *restrict vj = v + j;
        int c = 0;
        for (; c + 4 <= n; c += 4) {
            a0 += p[c] * *(const f32x8 *)(vj + c * head_dim);
            a1 += p[c + 1] * *(const f32x8 *)(vj + (c + 1) * head_dim);
            a2 += p[c + 2] * *(const f32x8 *)(vj + (c + 2) * head_dim);
            a3 += p[c + 3] * *(const f32x8 *)(vj + (c + 3) * head_dim);
        }
        for (; c < n; c++) a0 += p[c] * *(const f32x8 *)(vj + c * head_dim);
        *(f32x8 *)(a + j) = (a0 + a1) + (a2 + a3);
    }
}

/* Several consecutive new tokens of one sequence, all heads (FlashAttention's online softmax, Dao
 * et al. 2022, section 3.1, over the paged K/V of section 4.1 of the PagedAttention paper). Each
 * K/V row the tile sees is loaded and converted once per KV head for all the tile's queries, not
 * once per query; each query stops at its own position (causal: query i sees first_len + i keys).
 * q, out: [num_queries, num_heads, head_dim] at the tile's first query. */
static inline __attribute__((always_inline)) void attend_tile(
        const float *restrict q, int num_queries, int64_t first_len, const void *k_cache, const void *v_cache,
        int kind, const float *lut, const int32_t *table, int num_kv_heads, int group, const int head_dim,
        int block_size, float qk_scale, float v_scale, const Scratch *sc, float *restrict out) {
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int num_heads = num_kv_heads * group, rows = num_queries * group;
    const int64_t kv_len = first_len + num_queries - 1;  /* keys the tile's last query sees */
    float *restrict qs = sc->q, *restrict acc = sc->acc, *restrict m = sc->m, *restrict l = sc->l;
    float *restrict kt = sc->kt, *restrict vs = sc->v, *restrict row = sc->row, *restrict scores = sc->s;
    for (int kvh = 0; kvh < num_kv_heads; kvh++) {
        for (int i = 0; i < num_queries; i++)
            for (int g = 0; g < group; g++) {
                const float *restrict src = q + ((int64_t)i * num_heads + kvh * group + g) * head_dim;
                float *restrict dst = qs + (i * group + g) * head_dim;
                for (int d = 0; d < head_dim; d++) dst[d] = src[d] * qk_scale;
            }
        for (int r = 0; r < rows; r++) m[r] = NO_SCORE, l[r] = 0.0f;
        memset(acc, 0, sizeof(float) * (size_t)rows * (size_t)head_dim);
        for (int64_t c0 = 0; c0 < kv_len; c0 += CHUNK) {
            const int n = kv_len - c0 < CHUNK ? (int)(kv_len - c0) : CHUNK;
            /* load the chunk's K (transposed) and V for this KV head, walking the block table */
            for (int c = 0; c < n; c++) {
                const int64_t key = c0 + c;
                const int64_t index = ((int64_t)table[key / block_size] * block_size + key % block_size) * token_stride
                                      + (int64_t)kvh * head_dim;
                const float *k = (const float *)k_cache + index;
                if (kind != KV_F32) {
                    load_row(kind, k_cache, index, head_dim, lut, row);
                    k = row;
                }
                for (int d = 0; d < head_dim; d++) kt[d * CHUNK + c] = k[d];
                load_row(kind, v_cache, index, head_dim, lut, vs + (int64_t)c * head_dim);
            }
            int first = 0;  /* the tile's first query that sees a key of this chunk */
            while (first_len + first - c0 <= 0) first++;
            chunk_scores(qs + first * group * head_dim, rows - first * group, kt, head_dim, scores + first * group * CHUNK);
            for (int i = first; i < num_queries; i++) {
                const int64_t visible = first_len + i - c0;  /* keys of this chunk query i sees */
                const int nv = visible < n ? (int)visible : n;
                for (int g = 0; g < group; g++) {
                    const int r = i * group + g;
                    float *restrict s = scores + r * CHUNK;
                    float mx = m[r];
                    for (int c = 0; c < CHUNK; c++) {
                        s[c] = c < nv ? s[c] : NO_SCORE;  /* keys past the query, or past the chunk */
                        mx = s[c] > mx ? s[c] : mx;
                    }
                    const float alpha = exp_nonpositive(m[r] - mx);  /* rescales what the old max weighed */
                    float sum = 0.0f;
                    for (int c = 0; c < CHUNK; c++) {  /* a masked key weighs e^-87: nothing next to sum >= 1 */
                        s[c] = exp_nonpositive(s[c] - mx);
                        sum += s[c];
                    }
                    m[r] = mx;
                    l[r] = l[r] * alpha + sum;
                    float *restrict a = acc + r * head_dim;
                    for (int d = 0; d < head_dim; d++) a[d] *= alpha;
                    add_weighted_rows(a, s, vs, nv, head_dim);
                }
            }
        }
        for (int i = 0; i < num_queries; i++)
            for (int g = 0; g < group; g++) {
                const int r = i * group + g;
                const float inv = v_scale / l[r];
                float *restrict dst = out + ((int64_t)i * num_heads + kvh * group + g) * head_dim;
                for (int d = 0; d < head_dim; d++) dst[d] = acc[r * head_dim + d] * inv;
            }
    }
}

/* Eight vectors' horizontal sums as one vector, lane i = sum of x[i]'s lanes: three rounds of
 * interleave-and-add (14 shuffles, 7 adds) instead of eight separate reductions. */
static inline __attribute__((always_inline)) f32x8 sum_each(const f32x8 x[8]) {
#define PICK(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
    f32x8 p[4], r[2];
    for (int i = 0; i < 4; i++)  /* p[i] = pairwise sums of x[2i], x[2i+1], interleaved */
        p[i] = PICK(x[2 * i], x[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) + PICK(x[2 * i], x[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)  /* r[i]: quarter sums of x[4i .. 4i+3] */
        r[i] = PICK(p[2 * i], p[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) + PICK(p[2 * i], p[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return PICK(r[0], r[1], 0, 1, 2, 3, 8, 9, 10, 11) + PICK(r[0], r[1], 4, 5, 6, 7, 12, 13, 14, 15);
#undef PICK
}

/* y[d][i] = x[i][d]: an 8 x 8 transpose in three rounds of two-source shuffles (unpack, shuffle,
 * 128-bit permute on AVX: 24 instructions). */
static inline __attribute__((always_inline)) void transpose8(const f32x8 x[8], f32x8 y[8]) {
#define PICK(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
    f32x8 t[8], u[8];
    for (int i = 0; i < 4; i++) {  /* t[2i], t[2i+1]: x[2i] and x[2i+1] interleaved, within 128-bit halves */
        t[2 * i] = PICK(x[2 * i], x[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[2 * i + 1] = PICK(x[2 * i], x[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 2; i++)  /* u[4i + j]: column j (and j + 4) of rows 4i .. 4i + 3 */
        for (int j = 0; j < 2; j++) {
            u[4 * i + 2 * j] = PICK(t[4 * i + j], t[4 * i + j + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            u[4 * i + 2 * j + 1] = PICK(t[4 * i + j], t[4 * i + j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    for (int j = 0; j < 4; j++) {  /* the halves of rows 0-3 and 4-7 joined */
        y[j] = PICK(u[j], u[4 + j], 0, 1, 2, 3, 8, 9, 10, 11);
        y[4 + j] = PICK(u[j], u[4 + j], 4, 5, 6, 7, 12, 13, 14, 15);
    }
#undef PICK
}

#if WIDE == 16
/* The eight heads' scores <q_i, k> of one K row at head_dim 8 for a group of 2, 4 or 8 query heads
 * per KV head, without sum_each's fourteen shuffles: vector j holds dimension j of each lane's KV
 * head in lanes 0-7 and dimension j + 4 in lanes 8-15 (one two-source permute of the row each), so
 * four multiplies by the queries laid out alike (qd: the scaled queries transposed, dimensions j and
 * j + 4 side by side) and four adds give the scores. The sums keep sum_each's order, ((d0 + d1) +
 * (d2 + d3)) + ((d4 + d5) + (d6 + d7)), so the scores are the same bits; the empty asm statements
 * keep the compiler from contracting a product and a sum into a multiply-add or reordering the sums
 * (-ffp-contract=fast, -fassociative-math). k: the row from the pass's first KV head on. */
static inline __attribute__((always_inline)) f32x8 scores_by_dim(const f32xw qd[4], const float *k, const int group) {
#define AT(i) ((i) / G * 8)
#define DIM(d) __builtin_shufflevector(lo, hi, AT(0) + d, AT(1) + d, AT(2) + d, AT(3) + d, AT(4) + d, AT(5) + d, \
                                       AT(6) + d, AT(7) + d, AT(0) + d + 4, AT(1) + d + 4, AT(2) + d + 4,        \
                                       AT(3) + d + 4, AT(4) + d + 4, AT(5) + d + 4, AT(6) + d + 4, AT(7) + d + 4)
#define DIMS z[0] = DIM(0), z[1] = DIM(1), z[2] = DIM(2), z[3] = DIM(3)
    f32xw lo, hi, z[4];
    if (group == 2) {  /* four KV heads: the row's 32 floats */
        enum { G = 2 };
        lo = *(const f32xw *)k, hi = *(const f32xw *)(k + 16);
        DIMS;
    } else if (group == 4) {  /* two KV heads: 16 floats */
        enum { G = 4 };
        lo = hi = *(const f32xw *)k;
        DIMS;
    } else {  /* one: 8 floats (no more read: the row may end there) */
        enum { G = 8 };
        const f32x8 row = *(const f32x8 *)k;
        lo = hi = __builtin_shufflevector(row, row, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
        DIMS;
    }
#undef DIMS
#undef DIM
#undef AT
    for (int j = 0; j < 4; j++) {
        z[j] *= qd[j];
        __asm__("" : "+v"(z[j]));
    }
    f32xw a = z[0] + z[1], b = z[2] + z[3];
    __asm__("" : "+v"(a), "+v"(b));
    const f32xw y = a + b;
    return __builtin_shufflevector(y, y, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(y, y, 8, 9, 10, 11, 12, 13, 14, 15);
}
#endif

/* One new token at head_dim 8, eight heads per pass with one head per vector lane (num_heads a
 * multiple of 8). At this size a head's K row is one vector: per-head loops pay a horizontal sum
 * per (head, key), and the tile path a transposition of K per KV head, several times the
 * arithmetic. Here each slot's K row gives the eight heads' scores with eight multiplies and one
 * sum_each (with AVX-512 and a group of 2, 4 or 8: scores_by_dim, the same bits); the softmax runs
 * across the eight heads at once; each V row is read once for all heads. q, out: [num_heads][8];
 * scores: [len][8].
 * attend_tokens calls it with kind and group known at compile time for float32 pools and groups
 * dividing 8: then lane i's K/V offset is (i / group) * 8 past the pass's first KV head, an
 * immediate, and lanes of one KV head share one load (with group and kind runtime values, the
 * eight offsets lived on the stack: sixteen more loads a key, and two branches on kind per row). */
static inline __attribute__((always_inline)) void attend_heads8(
        const float *restrict q, const void *k_cache, const void *v_cache, const int kind, const float *lut,
        int64_t elem_bytes, const int32_t *table, int64_t len, int num_kv_heads, const int group, int block_size,
        float qk_scale, float v_scale, float *restrict scores, float *restrict row, float *restrict out,
        const char *then) {
    const int64_t token_stride = (int64_t)num_kv_heads * 8;
    const int64_t row_bytes = token_stride * elem_bytes, block_bytes = block_size * row_bytes;
    const int num_heads = num_kv_heads * group;
    for (int h0 = 0; h0 < num_heads; h0 += 8) {
        f32x8 qv[8], acc[8] = {{0}};
        /* lane i's K/V offset within a slot's row (its KV head's) is base + at[i] */
        const int64_t base = 8 % group ? 0 : h0 / group * 8;
        int at[8];
        for (int i = 0; i < 8; i++) {
            qv[i] = *(const f32x8 *)(q + (h0 + i) * 8) * qk_scale;
            at[i] = 8 % group ? (h0 + i) / group * 8 : i / group * 8;
        }
#if WIDE == 16
        const int by_dim = group == 2 || group == 4 || group == 8;  /* scores_by_dim's cases */
        f32xw qd[4];
        if (by_dim) {
            f32x8 y[8];
            transpose8(qv, y);
            for (int j = 0; j < 4; j++) qd[j] = __builtin_shufflevector(y[j], y[j + 4], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                        11, 12, 13, 14, 15);
        }
#endif
        f32x8 m = (f32x8){0} + NO_SCORE;
        for (int64_t first = 0, slot0; first < len; first += block_size) {  /* scores[t][i] = <q_i, k_t> */
            const char *next;
            const int n = block_keys(table, first, len, block_size, k_cache, block_bytes, &slot0, &next);
            if (!next) next = (const char *)v_cache + (int64_t)table[0] * block_bytes;  /* the V pass's first block */
            for (int j = 0; j < n; j++) {
                prefetch_row(next + j * row_bytes, row_bytes);
                const float *k = kv_row(kind, k_cache, (slot0 + j) * token_stride, (int)token_stride, lut, row) + base;
                f32x8 s;
#if WIDE == 16
                if (by_dim) {
                    s = scores_by_dim(qd, k, group);
                } else
#endif
                {
                    f32x8 x[8];
                    for (int i = 0; i < 8; i++) x[i] = qv[i] * *(const f32x8 *)(k + at[i]);
                    s = sum_each(x);
                }
                *(f32x8 *)(scores + (first + j) * 8) = s;
                for (int i = 0; i < 8; i++) m[i] = s[i] > m[i] ? s[i] : m[i];
            }
        }
        float sum[8] = {0};
        for (int64_t t = 0; t < len; t++)
            for (int i = 0; i < 8; i++) {
                const float e = exp_nonpositive(scores[t * 8 + i] - m[i]);
                scores[t * 8 + i] = e;
                sum[i] += e;
            }
        for (int64_t first = 0, slot0; first < len; first += block_size) {  /* acc_i += p[t][i] v_t */
            const char *next;
            const int n = block_keys(table, first, len, block_size, v_cache, block_bytes, &slot0, &next);
            if (!next)  /* after the last V block: this sequence's K again for the next eight heads, or the next sequence's */
                next = h0 + 8 < num_heads ? (const char *)k_cache + (int64_t)table[0] * block_bytes : then;
            for (int j = 0; j < n; j++) {
                if (next) prefetch_row(next + j * row_bytes, row_bytes);
                const float *v = kv_row(kind, v_cache, (slot0 + j) * token_stride, (int)token_stride, lut, row) + base;
                const float *p = scores + (first + j) * 8;
                for (int i = 0; i < 8; i++) acc[i] += p[i] * *(const f32x8 *)(v + at[i]);
            }
        }
        for (int i = 0; i < 8; i++) *(f32x8 *)(out + (h0 + i) * 8) = acc[i] * (v_scale / sum[i]);
    }
}

/* Keys per vector in attend_tile8: two in a 512-bit vector (lane 8j + h: key j of the two, head h),
 * else one. fold8 adds a vector's keys' lanes (per head), fold8_max takes their maximum, spread8
 * repeats eight lanes for each key, keep_keys sets the lanes of the keys past the first `keep` to
 * `value`. With one key a vector each is the identity. */
enum { KPV = WIDE / 8 };
#if WIDE == 16
#define LOW8(x) __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
#define HIGH8(x) __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15)
static inline __attribute__((always_inline)) f32x8 fold8(f32xw x) { return LOW8(x) + HIGH8(x); }
static inline __attribute__((always_inline)) f32x8 fold8_max(f32xw x) { return max8(LOW8(x), HIGH8(x)); }
#undef LOW8
#undef HIGH8
static inline __attribute__((always_inline)) f32xw spread8(f32x8 x) {
    return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
}
static inline __attribute__((always_inline)) f32xw keep_keys(f32xw x, int keep, float value) {
    if (keep < 2) x = __builtin_shufflevector(x, (f32xw){0} + value, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    return x;
}
#else
static inline __attribute__((always_inline)) f32x8 fold8(f32xw x) { return x; }
static inline __attribute__((always_inline)) f32x8 fold8_max(f32xw x) { return x; }
static inline __attribute__((always_inline)) f32xw spread8(f32x8 x) { return x; }
static inline __attribute__((always_inline)) f32xw keep_keys(f32xw x, int keep, float value) {
    (void)keep, (void)value;
    return x;
}
#endif

/* Several consecutive new tokens of one sequence at head_dim 8 (prefill, extend), eight heads per
 * pass with one head per vector lane (num_heads a multiple of 8): attend_heads8's layout in
 * attend_tile's loop (online softmax over chunks of CHUNK keys, each K/V row loaded once per tile).
 * At this size attend_tile spends most of its time around its few multiply-adds: a broadcast per
 * (row, key) for V, 32 exps per (row, chunk) whatever the keys the row sees, the masking of the
 * rest, scalar transposes of K. Here queries, a chunk's K and V and the accumulators are held
 * transposed, vector d = dimension d of the eight heads (of KPV keys side by side: two in a 512-bit
 * vector), so KPV (query, key) pairs cost 8 multiply-adds for the eight heads' scores, one exp for
 * their weights and 8 multiply-adds into their outputs: no horizontal sum, no broadcast, no mask
 * (each query stops at its own last key; a lone last key of a pair has its partner's weight zeroed).
 * With two keys a vector the accumulators hold each half's sum, added at the tile's end; the chunk's
 * maximum is taken over both halves. K and V are transposed once per key per tile (24 shuffles a
 * row), queries and outputs once per query.
 * Measured against attend_tile (one thread, this 2-core AVX VM, shared): 2.0x at 19 prompts x 108
 * tokens (stories260K's 8/4/8 heads/KV heads/head_dim: 1.0 against 2.0 ms a layer), 1.7x at
 * 1 x 2,048 and at 19 x 108 with 16/2/8. Two keys a 512-bit vector against one (the same source built
 * with -mno-avx512f), on the five layers' inputs of a stories260K prefill step captured from the model
 * (`ops/bench_cpu_attention.py --model`: 25 conv-trace prompts, 2,283 tokens), CPU ms: 7.4-7.6 against
 * 9.0-9.9 on random tokens, 7.5-7.7 against 9.0-9.9 on story text (3 alternations).
 * Scratch: q and acc [TILE_Q][8] f32xw (vector d of a query, repeated for each key of a vector; acc:
 * sum of weights times V), m and l [TILE_Q] f32x8 (running max of the scores, sum of the weights),
 * kt and v [CHUNK / KPV][8] f32xw (a key pair's vectors d), s [CHUNK / KPV] f32xw (one query's
 * scores in the chunk, then weights).
 * q, out: [num_queries, num_heads, 8] at the tile's first query; query i sees first_len + i keys. */
static void attend_tile8(
        const float *restrict q, int num_queries, int64_t first_len, const void *k_cache, const void *v_cache,
        int kind, const float *lut, const int32_t *table, int num_kv_heads, int group, int block_size,
        float qk_scale, float v_scale, const Scratch *sc, float *restrict out) {
    const int64_t token_stride = (int64_t)num_kv_heads * 8;
    const int num_heads = num_kv_heads * group;
    const int64_t kv_len = first_len + num_queries - 1;  /* keys the tile's last query sees */
    f32xw (*restrict qt)[8] = (f32xw (*)[8])sc->q, (*restrict acc)[8] = (f32xw (*)[8])sc->acc;
    f32xw (*restrict kt)[8] = (f32xw (*)[8])sc->kt, (*restrict vt)[8] = (f32xw (*)[8])sc->v;
    f32x8 *restrict m = (f32x8 *)sc->m, *restrict l = (f32x8 *)sc->l;
    f32xw *restrict s = (f32xw *)sc->s;
    for (int h0 = 0; h0 < num_heads; h0 += 8) {
        int at[8];  /* lane i's K/V offset within a slot's row: its KV head's */
        for (int i = 0; i < 8; i++) at[i] = (h0 + i) / group * 8;
        for (int i = 0; i < num_queries; i++) {
            f32x8 x[8], y[8];
            for (int h = 0; h < 8; h++) x[h] = *(const f32x8 *)(q + ((int64_t)i * num_heads + h0 + h) * 8) * qk_scale;
            transpose8(x, y);
            for (int d = 0; d < 8; d++) qt[i][d] = spread8(y[d]), acc[i][d] = (f32xw){0};
            m[i] = (f32x8){0} + NO_SCORE;
            l[i] = (f32x8){0};
        }
        for (int64_t c0 = 0; c0 < kv_len; c0 += CHUNK) {
            const int n = kv_len - c0 < CHUNK ? (int)(kv_len - c0) : CHUNK;
            int64_t block = c0 / block_size;  /* walk the block table key by key, without a division each */
            int offset = (int)(c0 % block_size);
            for (int c = 0; c < n; c++, offset++) {
                if (offset == block_size) block++, offset = 0;
                const int64_t index = ((int64_t)table[block] * block_size + offset) * token_stride;
                f32x8 x[8], y[8];
                float *kc = (float *)kt[c / KPV] + c % KPV * 8, *vc = (float *)vt[c / KPV] + c % KPV * 8;
                const float *k = kv_row(kind, k_cache, index, (int)token_stride, lut, sc->row);
                for (int h = 0; h < 8; h++) x[h] = *(const f32x8 *)(k + at[h]);
                transpose8(x, y);
                for (int d = 0; d < 8; d++) *(f32x8 *)(kc + d * WIDE) = y[d];
                const float *v = kv_row(kind, v_cache, index, (int)token_stride, lut, sc->row);
                for (int h = 0; h < 8; h++) x[h] = *(const f32x8 *)(v + at[h]);
                transpose8(x, y);
                for (int d = 0; d < 8; d++) *(f32x8 *)(vc + d * WIDE) = y[d];
            }
            if (n % KPV)  /* the lanes past the chunk's last key held another chunk's (or sequence's) K/V: zero, never NaN */
                for (int d = 0; d < 8; d++)
                    *(f32x8 *)((float *)kt[n / KPV] + d * WIDE + 8) = *(f32x8 *)((float *)vt[n / KPV] + d * WIDE + 8) = (f32x8){0};
            for (int i = c0 < first_len ? 0 : (int)(c0 - first_len + 1); i < num_queries; i++) {
                const int nv = first_len + i - c0 < n ? (int)(first_len + i - c0) : n;  /* keys of the chunk i sees */
                const int ng = (nv + KPV - 1) / KPV, last = nv - (ng - 1) * KPV;  /* vectors; keys in the last */
                const f32xw *restrict qi = qt[i];
                const f32xw q0 = qi[0], q1 = qi[1], q2 = qi[2], q3 = qi[3];
                const f32xw q4 = qi[4], q5 = qi[5], q6 = qi[6], q7 = qi[7];
                f32xw mx = spread8(m[i]);
                for (int g = 0; g < ng; g++) {  /* a tree of sums: four products in flight, not a chain of eight */
                    const f32xw *k = kt[g];
                    const f32xw sg = ((q0 * k[0] + q1 * k[1]) + (q2 * k[2] + q3 * k[3]))
                                   + ((q4 * k[4] + q5 * k[5]) + (q6 * k[6] + q7 * k[7]));
                    s[g] = g + 1 < ng ? sg : keep_keys(sg, last, NO_SCORE);  /* a key past nv weighs nothing */
                    mx = maxw(mx, s[g]);
                }
                const f32x8 mx8 = fold8_max(mx), alpha = exp8(m[i] - mx8);  /* alpha rescales what the old max weighed */
                const f32xw mxw = spread8(mx8), alphaw = spread8(alpha);
                f32xw *restrict a = acc[i], sum = {0};
                f32xw a0 = a[0] * alphaw, a1 = a[1] * alphaw, a2 = a[2] * alphaw, a3 = a[3] * alphaw;
                f32xw a4 = a[4] * alphaw, a5 = a[5] * alphaw, a6 = a[6] * alphaw, a7 = a[7] * alphaw;
                for (int g = 0; g < ng; g++) {  /* the weights first: the exp's constants stay in registers */
                    const f32xw p = expw(s[g] - mxw);
                    s[g] = g + 1 < ng ? p : keep_keys(p, last, 0.0f);
                    sum += s[g];
                }
                for (int g = 0; g < ng; g++) {
                    const f32xw p = s[g], *v = vt[g];
                    a0 += p * v[0], a1 += p * v[1], a2 += p * v[2], a3 += p * v[3];
                    a4 += p * v[4], a5 += p * v[5], a6 += p * v[6], a7 += p * v[7];
                }
                a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3, a[4] = a4, a[5] = a5, a[6] = a6, a[7] = a7;
                m[i] = mx8;
                l[i] = l[i] * alpha + fold8(sum);
            }
        }
        for (int i = 0; i < num_queries; i++) {
            f32x8 x[8], y[8];
            for (int d = 0; d < 8; d++) x[d] = fold8(acc[i][d]);
            transpose8(x, y);
            const f32x8 inv = v_scale / l[i];
            for (int h = 0; h < 8; h++) *(f32x8 *)(out + ((int64_t)i * num_heads + h0 + h) * 8) = y[h] * inv[h];
        }
    }
}

/* The arguments of one call; a thread computes the tiles from (first_seq, first_tile) up to, not
 * including, (last_seq, last_tile). */
typedef struct {
    const float *q; const void *k_cache; const void *v_cache; int kv_kind; const float *lut;
    const int32_t *block_tables; int64_t table_stride; const int32_t *seq_lens; const int32_t *query_start_loc;
    int num_heads, num_kv_heads, head_dim, block_size, max_query_len; int64_t num_blocks, max_seq_len;
    float scale, k_scale, v_scale;
    float *out; int64_t first_seq, last_seq; int first_tile, last_tile; int status;
} Work;

/* A sequence's new tokens split into tiles of at most TILE_Q, of sizes differing by at most one
 * (17 tokens are 9 + 8, not 16 + 1): tile k holds new tokens [k q_len / tiles, (k + 1) q_len / tiles). */
static inline int num_tiles(int64_t q_len) { return (int)((q_len + TILE_Q - 1) / TILE_Q); }
static inline int64_t tile_start(int64_t q_len, int k) { return k * q_len / num_tiles(q_len); }

/* (query, key) pairs of new tokens [j0, j1) of a sequence: new token j sees seq_len - q_len + j + 1 keys */
static inline int64_t pairs(int64_t seq_len, int64_t q_len, int64_t j0, int64_t j1) {
    const int64_t first = seq_len - q_len + j0 + 1, n = j1 - j0;
    return n * first + n * (n - 1) / 2;
}

/* New tokens [j0, j1) of sequence s, all heads; first_len: the keys new token j0 sees. A lone new
 * token (decode) at head_dim 8 takes attend_heads8 when the heads fill vectors of eight (at 256 x
 * 112 tokens, 8/4/8 heads/KV heads/head_dim: 5.9x the tile path; 8/8/8: 2.5x the per-token path;
 * ops/bench_cpu_attention.py's batches), and several new tokens take attend_tile8 (2.0x the tile
 * path at 19 prompts x 108 tokens, 8/4/8). Otherwise a lone new token gains nothing from a tile's
 * reuse of K/V and pays the per-chunk transposition of K for only `group` rows, so it takes the
 * per-token path unless head_dim is at most 4 x group (there the tile path was 1.2-1.3x faster at
 * 8/4/8 and 4.4x at 8/1/8, but 0.7x at 8/8/8 and 0.5x at 8/2/32; at 64 x 1024, 0.3x at 32/8/64). */
static inline __attribute__((always_inline)) void attend_tokens(
        const Work *w, const Scratch *sc, float *scores, int64_t s, int64_t j0, int64_t j1, int64_t first_len,
        const int head_dim) {
    const int group = w->num_heads / w->num_kv_heads;
    const int32_t *table = w->block_tables + s * w->table_stride;
    const int64_t at = (w->query_start_loc[s] + j0) * w->num_heads * head_dim;
    const float qk_scale = w->scale * w->k_scale;
    const int64_t elem_bytes = w->kv_kind == KV_F32 ? 4 : w->kv_kind == KV_BF16 ? 2 : 1;
    /* a decode token prefetches the next sequence's first K block while it finishes (its V pass) */
    const int32_t after = j1 - j0 == 1 && s < w->last_seq ? table[w->table_stride] : -1;
    const char *then = after >= 0 && after < w->num_blocks
        ? (const char *)w->k_cache + (int64_t)after * w->block_size * w->num_kv_heads * head_dim * elem_bytes : NULL;
    if (j1 - j0 == 1 && head_dim == 8 && w->num_heads % 8 == 0) {
#define HEADS8(KIND, GROUP) attend_heads8(w->q + at, w->k_cache, w->v_cache, KIND, w->lut, elem_bytes, table, \
                                          first_len, w->num_kv_heads, GROUP, w->block_size, qk_scale, w->v_scale, \
                                          scores, sc->row, w->out + at, then)
        switch (w->kv_kind == KV_F32 ? group : 0) {  /* copies with kind and group fixed, see attend_heads8 */
            case 1: HEADS8(KV_F32, 1); break;
            case 2: HEADS8(KV_F32, 2); break;
            case 4: HEADS8(KV_F32, 4); break;
            case 8: HEADS8(KV_F32, 8); break;
            default: HEADS8(w->kv_kind, group);
        }
#undef HEADS8
    } else if (head_dim == 8 && w->num_heads % 8 == 0) {
        attend_tile8(w->q + at, (int)(j1 - j0), first_len, w->k_cache, w->v_cache, w->kv_kind, w->lut, table,
                     w->num_kv_heads, group, w->block_size, qk_scale, w->v_scale, sc, w->out + at);
    } else if (j1 - j0 == 1 && head_dim > 4 * group) {
        attend(w->q + at, w->k_cache, w->v_cache, w->kv_kind, w->lut, elem_bytes, table, first_len, w->num_kv_heads,
               group, head_dim, w->block_size, qk_scale, w->v_scale, scores, sc->row, w->out + at, then);
    } else {
        attend_tile(w->q + at, (int)(j1 - j0), first_len, w->k_cache, w->v_cache, w->kv_kind, w->lut, table,
                    w->num_kv_heads, group, head_dim, w->block_size, qk_scale, w->v_scale, sc, w->out + at);
    }
}

/* Common head sizes get a copy with head_dim known at compile time (unrolled, vectorized), each a
 * function of its own: inlined together into run, they slowed decode by about 5%. */
#define ATTEND_TOKENS(NAME, D)                                                                                   \
    static __attribute__((noinline)) void NAME(const Work *w, const Scratch *sc, float *scores, int64_t s,       \
                                               int64_t j0, int64_t j1, int64_t first_len) {                     \
        attend_tokens(w, sc, scores, s, j0, j1, first_len, D);                                                   \
    }
ATTEND_TOKENS(attend_tokens_8, 8)
ATTEND_TOKENS(attend_tokens_64, 64)
ATTEND_TOKENS(attend_tokens_128, 128)
ATTEND_TOKENS(attend_tokens_any, w->head_dim)
#undef ATTEND_TOKENS

/* Subnormal floats flushed to zero, in and out (x86's MXCSR FTZ and DAZ bits), for the calling
 * thread until restore_subnormals: a trained model's scores in a row can lie more than 87 apart, so
 * weights e^(s - max) and their products fall below float32's normal range (1.2e-38), and on x86
 * each such result takes a slow microcode assist. What they would have added is below 1e-38 of the
 * row's largest weight. On stories260K prefill inputs captured from the model, the kernel took 2-4%
 * less time with it on random-token and story-text prompts, 15% on bench_worker_breakdown's
 * synthetic ones (ids 7j + i). A no-op on other architectures. Returns the state to restore. */
static inline unsigned flush_subnormals(void) {
#if defined(__SSE__)
    const unsigned csr = __builtin_ia32_stmxcsr();
    __builtin_ia32_ldmxcsr(csr | 0x8040);  /* FTZ (bit 15), DAZ (bit 6) */
    return csr;
#else
    return 0;
#endif
}

static inline void restore_subnormals(unsigned csr) {
#if defined(__SSE__)
    __builtin_ia32_ldmxcsr(csr);
#else
    (void)csr;
#endif
}

static void *run(void *arg) {
    Work *w = arg;
    const unsigned csr = flush_subnormals();
    const int head_dim = w->head_dim;
    const size_t rows = (size_t)TILE_Q * (w->num_heads / w->num_kv_heads);
    float *scores = malloc(sizeof(float) * (size_t)w->num_heads * (size_t)(w->max_seq_len > 0 ? w->max_seq_len : 1));
    float *row = malloc(sizeof(float) * (size_t)w->num_kv_heads * (size_t)head_dim);
    /* the tile paths' arrays (floats), carved from one zeroed allocation; attend_tile8 keeps eight
     * floats (one per head of a pass) per query where attend_tile keeps one per row, and a chunk's
     * K/V for eight heads. Every size is a multiple of 16 floats: each array starts on a cache line. */
    const size_t lanes = head_dim == 8 ? WIDE : 1, per_query = rows > TILE_Q * lanes ? rows : TILE_Q * lanes;
    const size_t nq = per_query * head_dim, nm = per_query, nkv = (size_t)CHUNK * head_dim * lanes;
    const size_t bytes = sizeof(float) * (2 * nq + 2 * nm + 2 * nkv + rows * CHUNK);
    float *tile = aligned_alloc(64, (bytes + 63) / 64 * 64);
    Scratch sc = {0};
    if (tile) {
        float *p = tile;
        memset(tile, 0, bytes);
        sc.q = p, p += nq;
        sc.acc = p, p += nq;
        sc.m = p, p += nm;
        sc.l = p, p += nm;
        sc.kt = p, p += nkv;
        sc.v = p, p += nkv;
        sc.s = p;
    }
    sc.row = row;
    w->status = scores && row && tile ? 0 : -1;
    for (int64_t s = w->first_seq; s <= w->last_seq && w->status == 0; s++) {
        const int32_t q_len = w->query_start_loc[s + 1] - w->query_start_loc[s];
        if (q_len < 1 || q_len > w->max_query_len) continue;  /* idle, or left to the batched path */
        const int first_tile = s == w->first_seq ? w->first_tile : 0;
        const int last_tile = s == w->last_seq && w->last_tile < num_tiles(q_len) ? w->last_tile : num_tiles(q_len);
        if (first_tile >= last_tile) continue;
        const int64_t seq_len = w->seq_lens[s] < w->max_seq_len ? w->seq_lens[s] : w->max_seq_len;
        const int32_t *table = w->block_tables + s * w->table_stride;
        for (int64_t b = 0; b < (seq_len + w->block_size - 1) / w->block_size; b++)
            if (table[b] < 0 || table[b] >= w->num_blocks) w->status = -2;  /* never read outside the pool */
        if (w->status != 0) break;
        for (int k = first_tile; k < last_tile; k++) {
            int64_t j0 = tile_start(q_len, k);
            const int64_t j1 = tile_start(q_len, k + 1);
            if (j0 < q_len - seq_len) j0 = q_len - seq_len;  /* causal: a new token sees the context up to itself */
            if (j0 >= j1) continue;
            const int64_t first_len = seq_len - q_len + j0 + 1;
            switch (head_dim) {
                case 8: attend_tokens_8(w, &sc, scores, s, j0, j1, first_len); break;
                case 64: attend_tokens_64(w, &sc, scores, s, j0, j1, first_len); break;
                case 128: attend_tokens_128(w, &sc, scores, s, j0, j1, first_len); break;
                default: attend_tokens_any(w, &sc, scores, s, j0, j1, first_len);
            }
        }
    }
    free(scores); free(row); free(tile);
    restore_subnormals(csr);
    return NULL;
}

enum { MAX_THREADS = 256 };

/* Attention for every sequence with 1 to max_query_len new tokens, on num_threads threads. The
 * work is cut into tiles (one decode token, or up to TILE_Q consecutive new tokens of a sequence)
 * and each thread takes a contiguous range of tiles holding about the same number of (query, key)
 * pairs, so one long prompt spreads over threads too. Returns 0; -1 when scratch memory could not
 * be had; -2 when a block table names a block outside [0, num_blocks) within its sequence's length
 * (out is then incomplete). */
int paged_attention_fused(const float *q, const void *k_cache, const void *v_cache, int kv_kind,
                           const float *lut, const int32_t *block_tables, int64_t table_stride,
                           const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,
                           int num_heads, int num_kv_heads, int head_dim, int block_size, int max_query_len,
                           int64_t num_blocks, int64_t max_seq_len, float scale, float k_scale, float v_scale,
                           float *out, int num_threads) {
    const Work all = {q, k_cache, v_cache, kv_kind, lut, block_tables, table_stride, seq_lens, query_start_loc,
                      num_heads, num_kv_heads, head_dim, block_size, max_query_len, num_blocks, max_seq_len,
                      scale, k_scale, v_scale, out, 0, num_seqs - 1, 0, INT_MAX, 0};
    int64_t total = 0;  /* (query, key) pairs: the work */
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len >= 1 && q_len <= max_query_len) total += pairs(seq_lens[s], q_len, 0, q_len);
    }
    /* a thread costs ~50 us to start: give each at least ~4K (query, key) pairs (tens of us of work) */
    int threads = num_threads < MAX_THREADS ? num_threads : MAX_THREADS;
    if (threads > 1 + total / 4096) threads = (int)(1 + total / 4096);
    if (threads <= 1) {
        Work w = all;
        run(&w);
        return w.status;
    }
    Work work[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t done = 0;
    int used = 0;  /* threads given a range so far, the last one still open */
    work[0] = all;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len < 1 || q_len > max_query_len) continue;
        for (int k = 0; k < num_tiles(q_len); k++) {
            if (used + 1 < threads && done >= total * (used + 1) / threads) {  /* close range `used` here */
                work[used].last_seq = s, work[used].last_tile = k;
                work[++used] = all;
                work[used].first_seq = s, work[used].first_tile = k;
            }
            done += pairs(seq_lens[s], q_len, tile_start(q_len, k), tile_start(q_len, k + 1));
        }
    }
    threads = used + 1;
    int status = 0;
    for (int i = 1; i < threads; i++) started[i] = pthread_create(&ids[i], NULL, run, &work[i]) == 0;
    for (int i = 1; i < threads; i++)
        if (!started[i]) run(&work[i]);  /* no thread to be had: do its share here */
    run(&work[0]);
    for (int i = 0; i < threads; i++) {
        if (i > 0 && started[i]) pthread_join(ids[i], NULL);
        if (work[i].status != 0) status = work[i].status;
    }
    return status;
}

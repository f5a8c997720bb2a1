/* Fused paged attention for CPUs: each new token reads its sequence's K/V in place through the
 * block table (PagedAttention, Kwon et al., SOSP 2023, section 4.1), one pass per token. Built and
 * loaded by kernels/cpu_kernels.py (plain C, no torch headers, so it compiles in about a second).
 *
 * Why not tensor ops: a decode step is bound by reading the KV cache. Gathering K/V into a
 * contiguous tensor, then transposing it for a batched GEMM, moves every byte three times and
 * pays per-(sequence, head) GEMM overheads; here each K and V element is read once per new token.
 * Prefill chunks up to max_query_len tokens run here too (no padding, no mask: each token stops
 * at its own position); longer ones are better served by GEMMs, which reuse K/V across queries.
 *
 * Layout: q and out [num_tokens, num_heads, head_dim] float32; k_cache and v_cache
 * [num_blocks, block_size, num_kv_heads, head_dim] of the pool's element type; block_tables
 * [num_seqs, table_stride] int32; seq_lens [num_seqs] int32 (context including the new token);
 * query_start_loc [num_seqs + 1] int32. Only sequences with 1 to max_query_len new tokens are
 * computed; the others' rows of out are left untouched. Head h reads KV head h / (num_heads / num_kv_heads).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_LUT8 = 2 };

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

/* Warm the cache with one block's K or V (block_bytes from p) while the current block is computed:
 * blocks sit at random places in the pool, so the hardware prefetcher cannot guess the next one. */
static inline void prefetch_block(const char *p, int64_t block_bytes) {
    for (int64_t off = 0; off < block_bytes; off += 64) __builtin_prefetch(p + off);
}

/* One new token of a sequence, all heads: each slot's K (then V) row is read once, in address order
 * within a block, for every head at once. q, out: [num_heads, head_dim]; scores: [num_heads, len]. */
static inline __attribute__((always_inline)) void attend(
        const float *restrict q, const void *k_cache, const void *v_cache, int kind, const float *lut,
        int64_t elem_bytes, const int32_t *table, int64_t len, int num_kv_heads, int group,
        const int head_dim, int block_size, float qk_scale, float v_scale,
        float *restrict scores, float *restrict row, float *restrict out) {
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;  /* elements between slots */
    const int64_t block_bytes = block_size * token_stride * elem_bytes;
    const int num_heads = num_kv_heads * group;
    /* scores[h][t] = qk_scale * <q_h, k_t>, block by block: the block table is read once per block */
    for (int64_t first = 0; first < len; first += block_size) {
        const int64_t slot0 = (int64_t)table[first / block_size] * block_size;
        if (first + block_size < len)
            prefetch_block((const char *)k_cache + (int64_t)table[first / block_size + 1] * block_bytes, block_bytes);
        const int n = len - first < block_size ? (int)(len - first) : block_size;
        for (int j = 0; j < n; j++) {
            const int64_t index = (slot0 + j) * token_stride;
            const float *k = (const float *)k_cache + index;
            if (kind != KV_F32) {
                load_row(kind, k_cache, index, (int)token_stride, lut, row);
                k = row;
            }
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
    for (int64_t first = 0; first < len; first += block_size) {
        const int64_t slot0 = (int64_t)table[first / block_size] * block_size;
        if (first + block_size < len)
            prefetch_block((const char *)v_cache + (int64_t)table[first / block_size + 1] * block_bytes, block_bytes);
        const int n = len - first < block_size ? (int)(len - first) : block_size;
        for (int j = 0; j < n; j++) {
            const int64_t index = (slot0 + j) * token_stride;
            const float *v = (const float *)v_cache + index;
            if (kind != KV_F32) {
                load_row(kind, v_cache, index, (int)token_stride, lut, row);
                v = row;
            }
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

/* The arguments of one call; a thread computes sequences [first, last). */
typedef struct {
    const float *q; const void *k_cache; const void *v_cache; int kv_kind; const float *lut;
    const int32_t *block_tables; int64_t table_stride; const int32_t *seq_lens; const int32_t *query_start_loc;
    int num_heads, num_kv_heads, head_dim, block_size, max_query_len; int64_t num_blocks, max_seq_len;
    float scale, k_scale, v_scale;
    float *out; int64_t first, last; int status;
} Work;

static void *run(void *arg) {
    Work *w = arg;
    const int group = w->num_heads / w->num_kv_heads;
    const int64_t elem_bytes = w->kv_kind == KV_F32 ? 4 : w->kv_kind == KV_BF16 ? 2 : 1;
    float *scores = malloc(sizeof(float) * (size_t)w->num_heads * (size_t)(w->max_seq_len > 0 ? w->max_seq_len : 1));
    float *row = malloc(sizeof(float) * (size_t)w->num_kv_heads * (size_t)w->head_dim);
    w->status = scores && row ? 0 : -1;
    for (int64_t s = w->first; s < w->last && w->status == 0; s++) {
        const int32_t t_q = w->query_start_loc[s], q_len = w->query_start_loc[s + 1] - t_q;
        if (q_len < 1 || q_len > w->max_query_len) continue;  /* idle, or left to the batched path */
        const int64_t seq_len = w->seq_lens[s] < w->max_seq_len ? w->seq_lens[s] : w->max_seq_len;
        const int32_t *table = w->block_tables + s * w->table_stride;
        for (int64_t b = 0; b < (seq_len + w->block_size - 1) / w->block_size; b++)
            if (table[b] < 0 || table[b] >= w->num_blocks) w->status = -2;  /* never read outside the pool */
        if (w->status != 0) break;
        for (int32_t j = 0; j < q_len; j++) {  /* causal: new token j sees the context up to itself */
            const int64_t len = seq_len - q_len + j + 1;
            const int64_t at = (int64_t)(t_q + j) * w->num_heads * w->head_dim;
            if (len < 1) continue;
            /* common head sizes get a copy with head_dim known at compile time (unrolled, vectorized) */
#define ATTEND(D) attend(w->q + at, w->k_cache, w->v_cache, w->kv_kind, w->lut, elem_bytes, table, len,      \
                         w->num_kv_heads, group, D, w->block_size, w->scale * w->k_scale, w->v_scale, scores, \
                         row, w->out + at)
            switch (w->head_dim) {
                case 8: ATTEND(8); break;
                case 64: ATTEND(64); break;
                case 128: ATTEND(128); break;
                default: ATTEND(w->head_dim);
            }
#undef ATTEND
        }
    }
    free(scores); free(row);
    return NULL;
}

enum { MAX_THREADS = 256 };

/* Attention for every sequence with 1 to max_query_len new tokens, on num_threads threads (each
 * takes a contiguous range of sequences holding about the same number of (query, key) pairs).
 * Returns 0; -1 when scratch memory could not be had; -2 when a block table names a block outside
 * [0, num_blocks) within its sequence's length (out is then incomplete). */
int paged_attention_fused(const float *q, const void *k_cache, const void *v_cache, int kv_kind,
                           const float *lut, const int32_t *block_tables, int64_t table_stride,
                           const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,
                           int num_heads, int num_kv_heads, int head_dim, int block_size, int max_query_len,
                           int64_t num_blocks, int64_t max_seq_len, float scale, float k_scale, float v_scale,
                           float *out, int num_threads) {
    const Work all = {q, k_cache, v_cache, kv_kind, lut, block_tables, table_stride, seq_lens, query_start_loc,
                      num_heads, num_kv_heads, head_dim, block_size, max_query_len, num_blocks, max_seq_len,
                      scale, k_scale, v_scale, out, 0, num_seqs, 0};
    int64_t total = 0;  /* (query, key) pairs: the work */
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len >= 1 && q_len <= max_query_len) total += q_len * seq_lens[s];
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
    int64_t s = 0, done = 0;
    for (int i = 0; i < threads; i++) {
        work[i] = all;
        work[i].first = s;
        const int64_t target = total * (i + 1) / threads;
        while (s < num_seqs && (done < target || i == threads - 1)) {
            const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
            done += q_len >= 1 && q_len <= max_query_len ? q_len * seq_lens[s] : 0;
            s++;
        }
        work[i].last = s;
    }
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

/* A lone decode in one call: one token of one sequence through every layer of a
 * Llama-style decoder (gateway/models/kernels/cpu/lone_decode.py decides where it applies).
 *
 * The layers' projections hold no bias and are quantized weights (quant.h), or dense
 * float32 or bfloat16 ones held transposed for single rows. Per layer: RMSNorm, fused
 * q/k/v, rope (the half-split layout), this token's K and V into the paged cache,
 * attention over its context, o, the residual, RMSNorm, fused gate/up, SiLU(gate) * up,
 * down, the residual; then the final RMSNorm. The same operations in the same order as the
 * model's torch forward, computed in float32; what differs is the order of a few sums
 * (norms, softmax), and for a bfloat16 model that the torch forward rounds to bfloat16
 * after each op where this call keeps float32 between them (its weights and KV cache stay
 * bfloat16: a value written to the cache is rounded as torch rounds it). One call a step
 * instead of some four thousand op dispatches.
 *
 * The same call runs a verify step of speculative decoding: R tokens of the one sequence at
 * consecutive positions (its last known token and its drafts), each through the same
 * operations as a lone token at its position, so each row's logits equal bit for bit those
 * a lone decode of that token computes; the weights are streamed from memory once for
 * all R rows (each block of a weight is reused from the cache by the rows after the first).
 */
#include <sched.h>

#include "kquant.h"
#include "lone_dense.h"

/* A projection W [rows, cols]: quantized (quant.h; bits 4 or 8), in its file's blocks
 * (bits 1: codes is then a gw_kq_parts, kquant.h), or dense float32 (bits 32) or bfloat16
 * (bits 16): codes is then W transposed, [cols, rows] contiguous, or where
 * `blocked` W transposed in blocks of DENSE_BLOCK of its rows, [rows / DENSE_BLOCK, cols,
 * DENSE_BLOCK] contiguous; scales and minimums are unused. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scales, *minimums;
    int64_t rows, cols, bits, blocked;
} gw_qmatrix;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    gw_qmatrix qkv, o, gate_up, down;
    void *kv_cache; /* [2, kv_heads, num_slots, head_dim], float32 or bfloat16 (cache_bf16) */
} gw_lone_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, num_slots, block_size;
    double eps;
    int64_t cache_bf16;
    /* 1: a bfloat16 model, whose verify rows take the AVX512-BF16 products where the CPU
     * has them (the torch forward rounds its activations to bfloat16 there too). */
    int64_t rows_bf16;
} gw_lone_dims;

/* Floats of scratch gw_lone_decode needs for `rows` tokens (its threads' own buffers
 * aside). */
int64_t gw_lone_scratch_floats(const gw_lone_dims *d, int64_t rows) {
    return rows * ((d->heads + 2 * d->kv_heads) * d->head_dim /* qkv */
                   + d->heads * d->head_dim + 2 * d->hidden + 3 * d->intermediate)
        + d->head_dim;
}

KERNEL static void rms_norm(const float *x, const float *weight, int64_t n, float eps,
                            float *out) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float squares = hsum(acc);
    for (; i < n; i++) squares += x[i] * x[i];
    const float r = 1.0f / sqrtf(squares / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = x[i] * r * weight[i];
}

/* v [head_dim] rotated: v * cos + [v2, v1] * sin, `sin` signed (its first half negated). */
KERNEL static void rotate(float *v, const float *cos, const float *sin, int64_t dim,
                          float *tmp) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < dim; i++) tmp[i] = v[i];
    for (int64_t i = 0; i < dim; i++) v[i] = tmp[i] * cos[i] + tmp[(i + half) % dim] * sin[i];
}

/* The share [*n0, *n1) of `count` items that thread t of T takes, in runs of `align`. */
static inline void share(int64_t count, int t, int T, int64_t align, int64_t *n0,
                         int64_t *n1) {
    const int64_t span = ((count + T - 1) / T + align - 1) / align * align;
    *n0 = t * span < count ? t * span : count;
    *n1 = *n0 + span < count ? *n0 + span : count;
}

/* Thread t of T's share of y [R, rows] = x [R, cols] W^T; `mine` holds
 * (R + 3) * cols / 32 + R * (cols / 2 + 1) floats of the thread's own (the sums of x per
 * group, a row's scales and minimums; or x in bfloat16 pairs). Each row of x is multiplied
 * exactly as a lone row is (the same operations in the same order), one weight row or
 * block at a time for all R, so the rows after the first read it from the cache (up to 8
 * rows share a quantized group's unpacking, 4 a K-quant's); except where `pairs` (several rows of a
 * bfloat16 model on an AVX512-BF16 CPU) and W is bfloat16: `dense_blocks_pairs`, x rounded
 * to bfloat16 as the torch forward rounds it. A quantized W's rows stay exact even then:
 * their multiply-adds, not the unpacking, are most of the cost, and bfloat16 products of
 * them (tried) saved a tenth of a verify step while giving up its equality with lone
 * decodes. */
KERNEL static void product_share(const float *x, int64_t R, const gw_qmatrix *w, int pairs,
                                 int t, int T, float *mine, float *y) {
    const int64_t N = w->rows, K = w->cols;
    int64_t n0, n1;
    if (w->blocked) {
        share(N / DENSE_BLOCK, t, T, 1, &n0, &n1);
        if (pairs && w->bits == 16) {
            uint32_t *x16 = (uint32_t *)mine;
            bf16_pairs(x, R, K, x16);
            dense_blocks_pairs(x16, R, (const uint16_t *)w->codes, K, n0, n1, y, N);
            return;
        }
        for (int64_t b = n0; b < n1; b++)
            for (int64_t r = 0; r < R; r++) {
                if (w->bits == 32) dense_blocks(x + r * K, w->codes, 0, K, b, b + 1, y + r * N);
                else dense_blocks(x + r * K, w->codes, 1, K, b, b + 1, y + r * N);
            }
        return;
    }
    if (w->bits == 32 || w->bits == 16) {
        const int bf16 = w->bits == 16;
        share(N, t, T, bf16 ? 32 : 16, &n0, &n1); /* whole cache lines of each weight row */
        for (int64_t r = 0; r < R; r++) {
            if (bf16) dense_columns(x + r * K, w->codes, 1, K, N, n0, n1, y + r * N);
            else dense_columns(x + r * K, w->codes, 0, K, N, n0, n1, y + r * N);
        }
        return;
    }
    share(N, t, T, 1, &n0, &n1);
    const int64_t groups = K / GROUP, group_bytes = w->bits == 4 ? 16 : 32;
    float *xsum = mine, *scale = xsum + R * groups, *minimum = scale + groups;
    for (int64_t r = 0; r < R; r++) group_sums(x + r * K, groups, xsum + r * groups);
    if (w->bits == 1) {
        const gw_kq_parts *parts = (const gw_kq_parts *)w->codes;
        float *scale16 = scale, *minimum32 = scale16 + K / 16;
        for (int64_t n = n0; n < n1; n++) {
            int type;
            const uint8_t *row = kq_row(parts, K, n, &type);
            row_params(type, row, K, scale16, minimum32);
            prefetch_ahead(row, kq_row_bytes(type, K));
            for (int64_t r = 0; r < R; r += ROW_BLOCK) /* sharing the row's unpacking */
                kq_dot(x + r * K, xsum + r * groups, K,
                       (int)(R - r < ROW_BLOCK ? R - r : ROW_BLOCK), row, type, scale16,
                       minimum32, y + r * N + n, N);
        }
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        halves_to_floats(w->scales + n * groups, groups, scale);
        halves_to_floats(w->minimums + n * groups, groups, minimum);
        const uint8_t *row = w->codes + n * groups * group_bytes;
        prefetch_ahead(row, groups * group_bytes);
        /* Up to 8 rows share a group's unpacking, each summed as dot_rows sums a lone row. */
        for (int64_t r = 0; r < R; r += 8) {
            const float *xr = x + r * K, *sr = xsum + r * groups;
            float *yr = y + r * N + n;
            const int bits = (int)w->bits;
            switch (R - r < 8 ? R - r : 8) {
            case 8: dot_rows(xr, sr, K, 8, row, scale, minimum, bits, yr, N); break;
            case 7: dot_rows(xr, sr, K, 7, row, scale, minimum, bits, yr, N); break;
            case 6: dot_rows(xr, sr, K, 6, row, scale, minimum, bits, yr, N); break;
            case 5: dot_rows(xr, sr, K, 5, row, scale, minimum, bits, yr, N); break;
            case 4: dot_rows(xr, sr, K, 4, row, scale, minimum, bits, yr, N); break;
            case 3: dot_rows(xr, sr, K, 3, row, scale, minimum, bits, yr, N); break;
            case 2: dot_rows(xr, sr, K, 2, row, scale, minimum, bits, yr, N); break;
            default: dot_rows(xr, sr, K, 1, row, scale, minimum, bits, yr, N); break;
            }
        }
    }
}

/* A barrier for the threads of one lone decode. They spin, briefly: a step has some 270
 * of these, microseconds apart, and OpenMP's own barrier under OMP_WAIT_POLICY=PASSIVE
 * (the engine core's) puts a thread to sleep and wakes it at each, which costs more than
 * a second thread saves. After SPINS_BEFORE_YIELD spins a waiting thread yields its core
 * at each look, so that the front end and the client, which share the cores, run meanwhile
 * and the thread it waits for is not kept off a core (the spin counts tried are in
 * docs/cpu-performance.md). */
typedef struct {
    int arrived, generation, parties;
} gw_spin_barrier;

#define SPINS_BEFORE_YIELD 100

KERNEL static void spin_wait(gw_spin_barrier *b) {
    const int generation = __atomic_load_n(&b->generation, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->arrived, 1, __ATOMIC_ACQ_REL) == b->parties) {
        __atomic_store_n(&b->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->generation, generation + 1, __ATOMIC_RELEASE);
        return;
    }
    for (int spins = 0; __atomic_load_n(&b->generation, __ATOMIC_ACQUIRE) == generation;) {
        if (spins < SPINS_BEFORE_YIELD) {
            _mm_pause();
            spins++;
        } else {
            sched_yield();
        }
    }
}

/* The cache row of `slot` in plane `plane` (a K or V head): float32 or bfloat16 values. */
static inline const void *cache_row(const gw_lone_dims *d, const void *cache, int64_t plane,
                                    int64_t slot) {
    const int64_t at = (plane * d->num_slots + slot) * d->head_dim;
    return d->cache_bf16 ? (const void *)((const uint16_t *)cache + at)
                         : (const void *)((const float *)cache + at);
}

/* q [count] . a cache row of bfloat16 values, each widened as it is loaded. */
KERNEL static inline float dot_bf16(const float *q, const uint16_t *row, int64_t count) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_bf16x8(row + i), acc);
    float total = hsum(acc);
    for (; i < count; i++) total += q[i] * from_bf16(row[i]);
    return total;
}

/* o [dim] += p * a cache row (float32, or bfloat16 where bf16). */
KERNEL static inline void add_scaled_row(float *o, float p, const void *row, int64_t dim,
                                         int bf16) {
    const __m256 pv = _mm256_set1_ps(p);
    int64_t i = 0;
    if (bf16) {
        const uint16_t *v = row;
        for (; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, load_bf16x8(v + i),
                                                    _mm256_loadu_ps(o + i)));
        for (; i < dim; i++) o[i] += p * from_bf16(v[i]);
    } else {
        const float *v = row;
        for (; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i),
                                                    _mm256_loadu_ps(o + i)));
        for (; i < dim; i++) o[i] += p * v[i];
    }
}

/* out [heads * head_dim], heads h0..h1 of it: each such query head's attention over the
 * context's `length` tokens, whose slots are given block by block (block_ids); scores has
 * `length` floats. A bfloat16 cache is widened as it is read. */
KERNEL static void attend(const gw_lone_dims *d, const float *q, const void *cache,
                          const int64_t *block_ids, int64_t length, int64_t h0, int64_t h1,
                          float *scores, float *out) {
    const int64_t dim = d->head_dim, group = d->heads / d->kv_heads, bs = d->block_size;
    const int bf16 = (int)d->cache_bf16;
    const float scale = 1.0f / sqrtf((float)dim);
    for (int64_t h = h0; h < h1; h++) {
        const int64_t kv = h / group;
        const float *qh = q + h * dim;
        float top = -INFINITY;
        for (int64_t t = 0; t < length; t++) {
            const int64_t slot = block_ids[t / bs] * bs + t % bs;
            const void *k = cache_row(d, cache, kv, slot);
            scores[t] = (bf16 ? dot_bf16(qh, k, dim) : dot(qh, k, dim)) * scale;
            if (scores[t] > top) top = scores[t];
        }
        float total = 0.0f;
        for (int64_t t = 0; t < length; t++) {
            scores[t] = expf(scores[t] - top);
            total += scores[t];
        }
        float *o = out + h * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = 0.0f;
        for (int64_t t = 0; t < length; t++) {
            const int64_t slot = block_ids[t / bs] * bs + t % bs;
            add_scaled_row(o, scores[t], cache_row(d, cache, d->kv_heads + kv, slot), dim, bf16);
        }
        const float inverse = 1.0f / total;
        for (int64_t i = 0; i < dim; i++) o[i] *= inverse;
    }
}

/* x [R, hidden]: the tokens' embeddings in, their residual streams after the last layer
 * out; out [R, hidden]: the final norm of them; logits [R, head->rows]: out times the
 * output layer `head` (NULL: not computed). cos, sin [R, head_dim]: the tokens' rope rows.
 * The R tokens (1 for a lone decode) are positions length - R .. length - 1 of their
 * sequence, whose cache blocks block_ids lists, and row r attends over the first
 * length - R + r + 1. The step runs on up to `threads` threads, which split each product's
 * output rows and the attention's (row, head) pairs; the small ops between run on the
 * first. Returns 0, or -1 where memory for the threads' own buffers ran out (nothing is
 * then written). */
KERNEL int gw_lone_decode(const gw_lone_dims *d, const gw_lone_layer *layers,
                          int64_t num_layers, const float *final_norm, const gw_qmatrix *head,
                          float *x, const float *cos, const float *sin,
                          const int64_t *block_ids, int64_t length, int64_t R, float *scratch,
                          float *out, float *logits, int64_t threads) {
    const int64_t E = d->hidden, H = d->heads, KV = d->kv_heads, D = d->head_dim;
    const int64_t I = d->intermediate, bs = d->block_size, QKV = (H + 2 * KV) * D;
    const float eps = (float)d->eps;
    float *qkv = scratch, *attn = qkv + R * QKV, *normed = attn + R * H * D;
    float *delta = normed + R * E, *gate_up = delta + R * E, *act = gate_up + R * 2 * I;
    float *tmp = act + R * I;
    const int64_t first = length - R; /* the first row's position */
    const int T = threads > 1 ? (int)threads : 1;
    /* Each thread's own floats: its scores over the context, then product_share's. */
    int64_t widest = E > H * D ? E : H * D;
    widest = widest > I ? widest : I;
    /* product_share's: the sums of x per group and a row's parameters, or x in bfloat16
     * pairs. */
    const int64_t own = length + (R + 3) * (widest / GROUP) + R * (widest / 2 + 1) + 16;
    const int pairs = R > 1 && d->rows_bf16 && gw_runs_avx512_bf16();
    float *owned = malloc(sizeof(float) * (size_t)(T * own));
    if (owned == NULL) return -1;
    gw_spin_barrier barrier = {0, 0, 1};
    #pragma omp parallel num_threads(T)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        #pragma omp single
        barrier.parties = team; /* the team may be smaller than asked */
        float *scores = owned + t * own, *mine = scores + length;
        int64_t i0, i1;
        for (int64_t l = 0; l < num_layers; l++) {
            const gw_lone_layer *layer = layers + l;
            if (t == 0)
                for (int64_t r = 0; r < R; r++)
                    rms_norm(x + r * E, layer->input_norm, E, eps, normed + r * E);
            spin_wait(&barrier);
            product_share(normed, R, &layer->qkv, pairs, t, team, mine, qkv);
            spin_wait(&barrier);
            if (t == 0) {
                for (int64_t r = 0; r < R; r++) {
                    float *row = qkv + r * QKV;
                    const int64_t pos = first + r, slot = block_ids[pos / bs] * bs + pos % bs;
                    for (int64_t h = 0; h < H + KV; h++)
                        rotate(row + h * D, cos + r * D, sin + r * D, D, tmp);
                    for (int64_t h = 0; h < 2 * KV; h++) { /* K heads, then V heads */
                        const int64_t at = (h * d->num_slots + slot) * D;
                        const float *src = row + (H + h) * D;
                        if (d->cache_bf16) {
                            uint16_t *dst = (uint16_t *)layer->kv_cache + at;
                            for (int64_t i = 0; i < D; i++) dst[i] = to_bf16(src[i]);
                        } else {
                            float *dst = (float *)layer->kv_cache + at;
                            for (int64_t i = 0; i < D; i++) dst[i] = src[i];
                        }
                    }
                }
            }
            spin_wait(&barrier);
            share(R * H, t, team, 1, &i0, &i1); /* (row, head) pairs */
            for (int64_t i = i0; i < i1; i++) {
                const int64_t r = i / H, h = i % H;
                attend(d, qkv + r * QKV, layer->kv_cache, block_ids, first + r + 1, h, h + 1,
                       scores, attn + r * H * D);
            }
            spin_wait(&barrier);
            product_share(attn, R, &layer->o, pairs, t, team, mine, delta);
            spin_wait(&barrier);
            if (t == 0) {
                for (int64_t i = 0; i < R * E; i++) x[i] += delta[i];
                for (int64_t r = 0; r < R; r++)
                    rms_norm(x + r * E, layer->post_norm, E, eps, normed + r * E);
            }
            spin_wait(&barrier);
            product_share(normed, R, &layer->gate_up, pairs, t, team, mine, gate_up);
            spin_wait(&barrier);
            for (int64_t r = 0; r < R; r++) {
                const float *gu = gate_up + r * 2 * I;
                float *a = act + r * I;
                share(I, t, team, 16, &i0, &i1);
                for (int64_t i = i0; i < i1; i++) {
                    const float g = gu[i];
                    a[i] = g / (1.0f + expf(-g)) * gu[I + i];
                }
            }
            spin_wait(&barrier);
            product_share(act, R, &layer->down, pairs, t, team, mine, delta);
            spin_wait(&barrier);
            if (t == 0)
                for (int64_t i = 0; i < R * E; i++) x[i] += delta[i];
        }
        if (t == 0)
            for (int64_t r = 0; r < R; r++) rms_norm(x + r * E, final_norm, E, eps, out + r * E);
        if (head != NULL) {
            spin_wait(&barrier);
            product_share(out, R, head, pairs, t, team, mine, logits);
        }
    }
    free(owned);
    return 0;
}

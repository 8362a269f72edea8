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
 */
#include <sched.h>

#include "kquant.h"

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
} gw_lone_dims;

/* Floats of scratch gw_lone_decode needs (its threads' own buffers aside). */
int64_t gw_lone_scratch_floats(const gw_lone_dims *d) {
    return (d->heads + 2 * d->kv_heads) * d->head_dim /* qkv */ + d->heads * d->head_dim
        + 2 * d->hidden + 3 * d->intermediate + d->head_dim;
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

/* y[n0:n1] of x [K] W^T for a dense W held transposed, wt [K, N] of float32 or (bf16, a
 * constant once inlined) bfloat16, each weight then widened as it streams in: the weight
 * rows are streamed four at a time into sums that stay in the L1 cache (at most N floats:
 * 12 KiB for the widest projection of the default model). */
KERNEL static inline __attribute__((always_inline)) void dense_columns(
        const float *x, const void *wt, int bf16, int64_t K, int64_t N, int64_t n0, int64_t n1,
        float *y) {
    const int64_t esize = bf16 ? 2 : 4;
    for (int64_t n = n0; n < n1; n++) y[n] = 0.0f;
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        const char *w0 = (const char *)wt + k * N * esize, *w1 = w0 + N * esize;
        const char *w2 = w1 + N * esize, *w3 = w2 + N * esize;
        const __m256 a = _mm256_set1_ps(x[k]), b = _mm256_set1_ps(x[k + 1]);
        const __m256 c = _mm256_set1_ps(x[k + 2]), e = _mm256_set1_ps(x[k + 3]);
        int64_t n = n0;
        for (; n + 8 <= n1; n += 8) {
            __m256 acc = _mm256_loadu_ps(y + n);
            acc = _mm256_fmadd_ps(a, weights8(w0, n, bf16), acc);
            acc = _mm256_fmadd_ps(b, weights8(w1, n, bf16), acc);
            acc = _mm256_fmadd_ps(c, weights8(w2, n, bf16), acc);
            acc = _mm256_fmadd_ps(e, weights8(w3, n, bf16), acc);
            _mm256_storeu_ps(y + n, acc);
        }
        for (; n < n1; n++)
            y[n] += x[k] * weight1(w0, n, bf16) + x[k + 1] * weight1(w1, n, bf16)
                + x[k + 2] * weight1(w2, n, bf16) + x[k + 3] * weight1(w3, n, bf16);
    }
    for (; k < K; k++)
        for (int64_t n = n0; n < n1; n++) y[n] += x[k] * weight1(wt, k * N + n, bf16);
}

#define DENSE_BLOCK 32 /* outputs a block of a blocked dense weight holds (gw_qmatrix) */

/* y[b0 * 32 : b1 * 32] of x [K] W^T for a dense W held in blocks of 32 outputs, wb [N / 32,
 * K, 32], float32 or bfloat16 (widened): a block's sums stay in registers while its K rows
 * of 32 weights stream in, one contiguous run of memory a block, so each thread reads its
 * share of the weight in order. The transposed layout (dense_columns) has each thread read
 * a slice of every row instead, short runs with gaps between, and keeps its sums in L1,
 * which streams memory well below its bandwidth (docs/cpu-performance.md). */
KERNEL static inline __attribute__((always_inline)) void dense_blocks(
        const float *x, const void *wb, int bf16, int64_t K, int64_t b0, int64_t b1, float *y) {
    const int64_t esize = bf16 ? 2 : 4, row = DENSE_BLOCK * esize;
    for (int64_t b = b0; b < b1; b++) {
        const char *w = (const char *)wb + b * K * row;
        __m256 s[8];
        for (int i = 0; i < 8; i++) s[i] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 2 <= K; k += 2) { /* two rows a pass: two chains of sums in flight */
            const __m256 a = _mm256_set1_ps(x[k]), c = _mm256_set1_ps(x[k + 1]);
            const char *r = w + k * row, *r1 = r + row;
            for (int i = 0; i < 4; i++) {
                s[i] = _mm256_fmadd_ps(a, weights8(r, 8 * i, bf16), s[i]);
                s[4 + i] = _mm256_fmadd_ps(c, weights8(r1, 8 * i, bf16), s[4 + i]);
            }
        }
        if (k < K) {
            const __m256 a = _mm256_set1_ps(x[k]);
            for (int i = 0; i < 4; i++)
                s[i] = _mm256_fmadd_ps(a, weights8(w + k * row, 8 * i, bf16), s[i]);
        }
        for (int i = 0; i < 4; i++)
            _mm256_storeu_ps(y + b * DENSE_BLOCK + 8 * i, _mm256_add_ps(s[i], s[4 + i]));
    }
}

/* Thread t of T's share of y [rows] = x [cols] W^T; `mine` holds 4 * cols / 32 floats of
 * the thread's own (the sums of x per group, a row's scales and minimums). */
KERNEL static void product_share(const float *x, const gw_qmatrix *w, int t, int T,
                                 float *mine, float *y) {
    const int64_t N = w->rows, K = w->cols;
    int64_t n0, n1;
    if (w->blocked) {
        share(N / DENSE_BLOCK, t, T, 1, &n0, &n1);
        if (w->bits == 32) dense_blocks(x, w->codes, 0, K, n0, n1, y);
        else dense_blocks(x, w->codes, 1, K, n0, n1, y);
        return;
    }
    if (w->bits == 32) {
        share(N, t, T, 16, &n0, &n1); /* whole cache lines of each weight row */
        dense_columns(x, w->codes, 0, K, N, n0, n1, y);
        return;
    }
    if (w->bits == 16) {
        share(N, t, T, 32, &n0, &n1);
        dense_columns(x, w->codes, 1, K, N, n0, n1, y);
        return;
    }
    share(N, t, T, 1, &n0, &n1);
    const int64_t groups = K / GROUP, group_bytes = w->bits == 4 ? 16 : 32;
    float *xsum = mine, *scale = xsum + groups, *minimum = scale + groups;
    group_sums(x, groups, xsum);
    if (w->bits == 1) {
        const gw_kq_parts *parts = (const gw_kq_parts *)w->codes;
        float *scale16 = scale, *minimum32 = scale16 + K / 16;
        for (int64_t n = n0; n < n1; n++) {
            int type;
            const uint8_t *row = kq_row(parts, K, n, &type);
            row_params(type, row, K, scale16, minimum32);
            prefetch_ahead(row, kq_row_bytes(type, K));
            kq_dot(x, xsum, K, 1, row, type, scale16, minimum32, y + n, N);
        }
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        halves_to_floats(w->scales + n * groups, groups, scale);
        halves_to_floats(w->minimums + n * groups, groups, minimum);
        const uint8_t *row = w->codes + n * groups * group_bytes;
        prefetch_ahead(row, groups * group_bytes);
        dot_rows(x, xsum, K, 1, row, scale, minimum, (int)w->bits, y + n, N);
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

/* x [hidden]: the token's embedding in, its residual stream after the last layer out;
 * out [hidden]: the final norm of it; logits [head->rows]: out times the output layer
 * `head` (NULL: not computed). cos, sin [head_dim]: the token's rope rows; the token is at
 * position length - 1 of its sequence, whose cache blocks block_ids lists. The step runs
 * on up to `threads` threads, which split each product's output rows and the attention's
 * heads; the small ops between run on the first. Returns 0, or -1 where memory for the
 * threads' own buffers ran out (nothing is then written). */
KERNEL int gw_lone_decode(const gw_lone_dims *d, const gw_lone_layer *layers,
                          int64_t num_layers, const float *final_norm, const gw_qmatrix *head,
                          float *x, const float *cos, const float *sin,
                          const int64_t *block_ids, int64_t length, float *scratch,
                          float *out, float *logits, int64_t threads) {
    const int64_t E = d->hidden, H = d->heads, KV = d->kv_heads, D = d->head_dim;
    const int64_t I = d->intermediate, bs = d->block_size;
    const float eps = (float)d->eps;
    float *qkv = scratch, *attn = qkv + (H + 2 * KV) * D, *normed = attn + H * D;
    float *delta = normed + E, *gate_up = delta + E, *act = gate_up + 2 * I;
    float *tmp = act + I;
    const int64_t pos = length - 1, slot = block_ids[pos / bs] * bs + pos % bs;
    const int T = threads > 1 ? (int)threads : 1;
    /* Each thread's own floats: its scores over the context, then product_share's. */
    int64_t widest = E > H * D ? E : H * D;
    widest = widest > I ? widest : I;
    const int64_t own = length + 4 * (widest / GROUP) + 16;
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
            if (t == 0) rms_norm(x, layer->input_norm, E, eps, normed);
            spin_wait(&barrier);
            product_share(normed, &layer->qkv, t, team, mine, qkv);
            spin_wait(&barrier);
            if (t == 0) {
                for (int64_t h = 0; h < H + KV; h++) rotate(qkv + h * D, cos, sin, D, tmp);
                for (int64_t h = 0; h < 2 * KV; h++) { /* K heads, then V heads */
                    const int64_t at = (h * d->num_slots + slot) * D;
                    const float *src = qkv + (H + h) * D;
                    if (d->cache_bf16) {
                        uint16_t *dst = (uint16_t *)layer->kv_cache + at;
                        for (int64_t i = 0; i < D; i++) dst[i] = to_bf16(src[i]);
                    } else {
                        float *dst = (float *)layer->kv_cache + at;
                        for (int64_t i = 0; i < D; i++) dst[i] = src[i];
                    }
                }
            }
            spin_wait(&barrier);
            share(H, t, team, 1, &i0, &i1);
            attend(d, qkv, layer->kv_cache, block_ids, length, i0, i1, scores, attn);
            spin_wait(&barrier);
            product_share(attn, &layer->o, t, team, mine, delta);
            spin_wait(&barrier);
            if (t == 0) {
                for (int64_t i = 0; i < E; i++) x[i] += delta[i];
                rms_norm(x, layer->post_norm, E, eps, normed);
            }
            spin_wait(&barrier);
            product_share(normed, &layer->gate_up, t, team, mine, gate_up);
            spin_wait(&barrier);
            share(I, t, team, 16, &i0, &i1);
            for (int64_t i = i0; i < i1; i++) {
                const float g = gate_up[i];
                act[i] = g / (1.0f + expf(-g)) * gate_up[I + i];
            }
            spin_wait(&barrier);
            product_share(act, &layer->down, t, team, mine, delta);
            spin_wait(&barrier);
            if (t == 0)
                for (int64_t i = 0; i < E; i++) x[i] += delta[i];
        }
        if (t == 0) rms_norm(x, final_norm, E, eps, out);
        if (head != NULL) {
            spin_wait(&barrier);
            product_share(out, head, t, team, mine, logits);
        }
    }
    free(owned);
    return 0;
}

/* The decode attention of many sequences, read in place from the paged KV cache.
 *
 * q [B, H, D] (one query per sequence), cache [2, KV, num_slots, D] (K plane, then V;
 * slot = block * block_size + offset), block_table [B, max_blocks] int32, lens [B]: each
 * sequence's context length (its tokens, this one's included) -> out [B, H, D]. q, cache
 * and out are all float32 or all bfloat16; everything is computed in float32. Each task is
 * one (sequence, kv head) pair: its G = H / KV query heads read every key and value once,
 * a block at a time, with the softmax kept running (its maximum and sum rescaled as later
 * blocks raise the maximum), so no score buffer grows with the context and nothing is
 * gathered. Threads take tasks as they come: contexts differ in length.
 */
#include "kernels.h"

#define VECTOR_BITS 256
#include "vector.h"
#undef VECTOR_BITS
#define VECTOR_BITS 512
#include "vector.h"
#undef VECTOR_BITS

#define ATTN_CHUNK 32  /* tokens a pass: the scores of G heads for them stay in L1 */
#define ATTN_MAX_GROUP 16
#define ATTN_MAX_DIM 256

/* count bfloat16 values at src as floats at dst, any count. */
KERNEL static inline void bf16_to_floats(const uint16_t *src, int64_t count, float *dst) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
    for (; i < count; i++) dst[i] = from_bf16(src[i]);
}

/* n rows of `dim` values at src (float32, or bfloat16 when bf16) as float32 rows at dst;
 * float32 rows are returned in place. */
KERNEL static inline const float *rows_f32(const void *src, int bf16, int64_t n, int64_t dim,
                                          float *dst) {
    if (!bf16) return (const float *)src;
    bf16_to_floats((const uint16_t *)src, n * dim, dst);
    return dst;
}

/* The 8 horizontal sums of a[0..7], in order, as one vector. */
KERNEL static inline __m256 sum8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* One task on AVX2, float32 or bfloat16 (widened a pass at a time): the G query heads at q
 * over the `length` tokens whose cache blocks `blocks` lists, K and V rows at k_offset and
 * v_offset (elements) of the cache -> out, G heads. */
KERNEL static void attend_group(const void *q, const void *cache, const int32_t *blocks,
                                int64_t length, int64_t G, int64_t dim, int64_t block_size,
                                int64_t k_offset, int64_t v_offset, int bf16, void *out) {
    const int64_t esize = bf16 ? 2 : 4;
    const float scale = 1.0f / sqrtf((float)dim);
    float qs[ATTN_MAX_GROUP * ATTN_MAX_DIM], acc[ATTN_MAX_GROUP * ATTN_MAX_DIM];
    float kbuf[ATTN_CHUNK * ATTN_MAX_DIM], vbuf[ATTN_CHUNK * ATTN_MAX_DIM];
    float scores[ATTN_MAX_GROUP][ATTN_CHUNK], top[ATTN_MAX_GROUP], total[ATTN_MAX_GROUP];
    const float *qf = rows_f32(q, bf16, G, dim, qs);
    if (!bf16) {
        for (int64_t i = 0; i < G * dim; i++) qs[i] = qf[i];
    }
    for (int64_t i = 0; i < G * dim; i++) {
        qs[i] *= scale;
        acc[i] = 0.0f;
    }
    for (int64_t h = 0; h < G; h++) {
        top[h] = -INFINITY;
        total[h] = 0.0f;
    }
    int64_t n = 0;
    for (int64_t t0 = 0; t0 < length; t0 += n) {
        /* one pass: tokens t0 .. t0 + n, all in one block (contiguous slots) */
        const int64_t offset = t0 % block_size;
        n = block_size - offset;
        if (n > ATTN_CHUNK) n = ATTN_CHUNK;
        if (n > length - t0) n = length - t0;
        const int64_t slot = (int64_t)blocks[t0 / block_size] * block_size + offset;
        if (t0 + n < length) {  /* the next block's rows on their way while this one runs */
            const int64_t next = (int64_t)blocks[(t0 + n) / block_size] * block_size
                + (t0 + n) % block_size;
            int64_t m = length - t0 - n;
            if (m > ATTN_CHUNK) m = ATTN_CHUNK;
            const char *nk = (const char *)cache + (k_offset + next * dim) * esize;
            const char *nv = (const char *)cache + (v_offset + next * dim) * esize;
            for (int64_t b = 0; b < m * dim * esize; b += 64) {
                _mm_prefetch(nk + b, _MM_HINT_T0);
                _mm_prefetch(nv + b, _MM_HINT_T0);
            }
        }
        const float *keys = rows_f32((const char *)cache + (k_offset + slot * dim) * esize,
                                     bf16, n, dim, kbuf);
        const float *values = rows_f32((const char *)cache + (v_offset + slot * dim) * esize,
                                       bf16, n, dim, vbuf);
        for (int64_t h = 0; h < G; h++) {
            const float *qh = qs + h * dim;
            int64_t j = 0;
            for (; j + 8 <= n; j += 8) {  /* 8 tokens: 8 independent sums, reduced at once */
                const float *k = keys + j * dim;
                __m256 a[8];
                for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
                for (int64_t d = 0; d < dim; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qh + d);
                    for (int i = 0; i < 8; i++)
                        a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i * dim + d), a[i]);
                }
                _mm256_storeu_ps(&scores[h][j], sum8(a));
            }
            for (; j < n; j++) {
                __m256 a = _mm256_setzero_ps();
                for (int64_t d = 0; d < dim; d += 8)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d),
                                        _mm256_loadu_ps(keys + j * dim + d), a);
                scores[h][j] = hsum(a);
            }
            float best = top[h];
            for (j = 0; j < n; j++)
                if (scores[h][j] > best) best = scores[h][j];
            /* rescale what came before to the new maximum, then add this pass */
            const float shrink = top[h] == -INFINITY ? 0.0f : expf(top[h] - best);
            top[h] = best;
            const __m256 m = _mm256_set1_ps(best);
            __m256 sum = _mm256_setzero_ps();
            for (j = 0; j + 8 <= n; j += 8) {
                const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(&scores[h][j]), m));
                _mm256_storeu_ps(&scores[h][j], p);
                sum = _mm256_add_ps(sum, p);
            }
            float s = hsum(sum);
            for (; j < n; j++) {
                scores[h][j] = expf(scores[h][j] - best);
                s += scores[h][j];
            }
            total[h] = total[h] * shrink + s;
            if (shrink != 1.0f) {
                const __m256 k = _mm256_set1_ps(shrink);
                for (int64_t d = 0; d < dim; d += 8)
                    _mm256_storeu_ps(acc + h * dim + d,
                                     _mm256_mul_ps(_mm256_loadu_ps(acc + h * dim + d), k));
            }
        }
        for (int64_t h = 0; h < G; h++) {
            float *ah = acc + h * dim;
            int64_t d = 0;
            for (; d + 64 <= dim; d += 64) {  /* 8 independent sums a pass */
                __m256 a[8];
                for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(ah + d + 8 * i);
                for (int64_t j = 0; j < n; j++) {
                    const __m256 p = _mm256_set1_ps(scores[h][j]);
                    const float *v = values + j * dim + d;
                    for (int i = 0; i < 8; i++)
                        a[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), a[i]);
                }
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(ah + d + 8 * i, a[i]);
            }
            for (; d < dim; d += 8) {
                __m256 a = _mm256_loadu_ps(ah + d);
                for (int64_t j = 0; j < n; j++)
                    a = _mm256_fmadd_ps(_mm256_set1_ps(scores[h][j]),
                                        _mm256_loadu_ps(values + j * dim + d), a);
                _mm256_storeu_ps(ah + d, a);
            }
        }
    }
    for (int64_t h = 0; h < G; h++) {
        const float inv = 1.0f / total[h];
        for (int64_t d = 0; d < dim; d++) {
            const float v = acc[h * dim + d] * inv;
            if (bf16) ((uint16_t *)out)[h * dim + d] = to_bf16(v);
            else ((float *)out)[h * dim + d] = v;
        }
    }
}

/* ---- The decode attention of bfloat16 caches on AVX-512 with AVX512_BF16 ----
 *
 * Not attend_group at a wider vector but another algorithm for its task: the keys read as
 * bfloat16 pairs (VDPBF16PS: two products a lane, exact, summed in float32) and no float32
 * copy of any row. The scores of up to ATTN16_CHUNK tokens are taken first, then one
 * maximum and one exp a head, then the values, each row widened once for all G heads; the
 * running maximum and sum carry from one chunk to the next as in attend_group. */

#define ATTN16_CHUNK 256
#define PREFETCH_AHEAD 32  /* tokens: how far ahead the keys are fetched */

/* The 16 lane sums of v[0..15], in order, as one vector (a transpose by halves). */
KERNEL512 static inline __m512 sum16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  /* lanes 4k..4k+3 of each 128 bits: v[2i] at 0, 2; v[2i+1] at 1, 3 */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* each 128 bits: v[4i], v[4i+1], v[4i+2], v[4i+3] */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)  /* b[2i]'s 128-bit parts 0+2, 1+3, then b[2i+1]'s */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                         _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* acc[h][d0 ..] += sum_j p[h][j] v_j[d0 ..] for NH heads from h0 and NV vectors of 16 values
 * from d0: NH * NV accumulators held in registers while every row passes once. */
KERNEL512 static inline __attribute__((always_inline)) void values16(
        float *acc, const float (*p)[ATTN16_CHUNK + 16], const uint16_t *cache,
        const int64_t *slots, int64_t n, int64_t dim, int64_t h0, int64_t d0,
        const int NH, const int NV) {
    __m512 a[4][4];
    for (int h = 0; h < NH; h++)
        for (int i = 0; i < NV; i++) a[h][i] = _mm512_loadu_ps(acc + (h0 + h) * dim + d0 + 16 * i);
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *row = cache + slots[j] * dim + d0;
        __m512 v[4];
        for (int i = 0; i < NV; i++) v[i] = load16(row, 16 * i);
        for (int h = 0; h < NH; h++) {
            const __m512 w = _mm512_set1_ps(p[h0 + h][j]);
            for (int i = 0; i < NV; i++) a[h][i] = _mm512_fmadd_ps(w, v[i], a[h][i]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int i = 0; i < NV; i++) _mm512_storeu_ps(acc + (h0 + h) * dim + d0 + 16 * i, a[h][i]);
}

KERNEL512 static void attend_group16(const uint16_t *q, const uint16_t *cache,
                                     const int32_t *blocks, int64_t length, int64_t G,
                                     int64_t dim, int64_t block_size, int64_t k_offset,
                                     int64_t v_offset, uint16_t *out) {
    const float scale = 1.0f / sqrtf((float)dim);
    float acc[ATTN_MAX_GROUP * ATTN_MAX_DIM];
    float scores[ATTN_MAX_GROUP][ATTN16_CHUNK + 16], top[ATTN_MAX_GROUP], total[ATTN_MAX_GROUP];
    int64_t slots[ATTN16_CHUNK + 16];
    const int64_t pairs = dim / 32;  /* 32 bfloat16 values a vector */
    for (int64_t i = 0; i < G * dim; i++) acc[i] = 0.0f;
    for (int64_t h = 0; h < G; h++) {
        top[h] = -INFINITY;
        total[h] = 0.0f;
    }
    int64_t block = 0, offset = 0;  /* where token t0 sits */
    for (int64_t t0 = 0; t0 < length; t0 += ATTN16_CHUNK) {
        int64_t n = length - t0;
        if (n > ATTN16_CHUNK) n = ATTN16_CHUNK;
        for (int64_t j = 0; j < n; j++) {
            slots[j] = (int64_t)blocks[block] * block_size + offset;
            if (++offset == block_size) {
                offset = 0;
                block++;
            }
        }
        for (int64_t j = n; j < ((n + 15) & ~15); j++) slots[j] = slots[n - 1];
        for (int64_t i = 0; i < PREFETCH_AHEAD && i < n; i++)
            for (int64_t b = 0; b < dim * 2; b += 64)
                _mm_prefetch((const char *)(cache + k_offset + slots[i] * dim) + b, _MM_HINT_T0);
        for (int64_t j0 = 0; j0 < n; j0 += 16) {  /* 16 keys' scores for every head */
            const uint16_t *k[16];
            for (int i = 0; i < 16; i++) k[i] = cache + k_offset + slots[j0 + i] * dim;
            /* the keys PREFETCH_AHEAD tokens on, and these tokens' values, on their way */
            for (int64_t i = j0 + PREFETCH_AHEAD; i < j0 + PREFETCH_AHEAD + 16 && i < n; i++)
                for (int64_t b = 0; b < dim * 2; b += 64)
                    _mm_prefetch((const char *)(cache + k_offset + slots[i] * dim) + b,
                                 _MM_HINT_T0);
            for (int64_t i = j0; i < j0 + 16 && i < n; i++)
                for (int64_t b = 0; b < dim * 2; b += 64)
                    _mm_prefetch((const char *)(cache + v_offset + slots[i] * dim) + b,
                                 _MM_HINT_T1);
            for (int64_t h = 0; h < G; h++) {
                const uint16_t *qh = q + h * dim;
                __m512 a[16];
                for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
                for (int64_t c = 0; c < pairs; c++) {
                    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qh + 32 * c);
                    for (int i = 0; i < 16; i++)
                        a[i] = _mm512_dpbf16_ps(
                            a[i], qv, (__m512bh)_mm512_loadu_si512(k[i] + 32 * c));
                }
                _mm512_storeu_ps(&scores[h][j0], _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale)));
            }
        }
        const __mmask16 tail = (__mmask16)((1u << (n & 15)) - 1);  /* the last 16's own lanes */
        for (int64_t h = 0; h < G; h++) {
            __m512 best = _mm512_set1_ps(top[h]);
            int64_t j = 0;
            for (; j + 16 <= n; j += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(&scores[h][j]));
            if (j < n) best = _mm512_mask_max_ps(best, tail, best, _mm512_loadu_ps(&scores[h][j]));
            const float m = _mm512_reduce_max_ps(best);
            const float shrink = top[h] == -INFINITY ? 0.0f : expf(top[h] - m);
            top[h] = m;
            const __m512 mv = _mm512_set1_ps(m);
            __m512 sum = _mm512_setzero_ps();
            for (j = 0; j + 16 <= n; j += 16) {
                const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(&scores[h][j]), mv));
                _mm512_storeu_ps(&scores[h][j], p);
                sum = _mm512_add_ps(sum, p);
            }
            if (j < n) {
                const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(&scores[h][j]), mv));
                _mm512_storeu_ps(&scores[h][j], p);
                sum = _mm512_mask_add_ps(sum, tail, sum, p);
            }
            total[h] = total[h] * shrink + _mm512_reduce_add_ps(sum);
            if (shrink != 1.0f)
                for (int64_t d = 0; d < dim; d += 16)
                    _mm512_storeu_ps(acc + h * dim + d, _mm512_mul_ps(
                        _mm512_loadu_ps(acc + h * dim + d), _mm512_set1_ps(shrink)));
        }
        const uint16_t *values = cache + v_offset;
        for (int64_t h0 = 0; h0 < G; h0 += 4) {
            const int64_t nh = G - h0 < 4 ? G - h0 : 4;
            for (int64_t d0 = 0; d0 < dim; d0 += 64) {
                const int64_t nv = (dim - d0) / 16 < 4 ? (dim - d0) / 16 : 4;
                /* constant counts, so each case keeps its accumulators in registers */
                switch (nh * 8 + nv) {
#define VALUES16_CASE(H, V) \
                case H * 8 + V: values16(acc, (const float (*)[ATTN16_CHUNK + 16])scores, values, slots, n, dim, h0, d0, H, V); break;
                VALUES16_CASE(1, 2) VALUES16_CASE(1, 4)
                VALUES16_CASE(2, 2) VALUES16_CASE(2, 4)
                VALUES16_CASE(3, 2) VALUES16_CASE(3, 4)
                VALUES16_CASE(4, 2) VALUES16_CASE(4, 4)
#undef VALUES16_CASE
                default: break;  /* dim % 32 == 0: nv is 2 or 4 */
                }
            }
        }
    }
    for (int64_t h = 0; h < G; h++) {
        const __m512 inv = _mm512_set1_ps(1.0f / total[h]);
        for (int64_t d = 0; d < dim; d += 16)
            store16(out, h * dim + d, _mm512_mul_ps(_mm512_loadu_ps(acc + h * dim + d), inv));
    }
}

/* 0, or -1 for shapes the kernel does not take (head_dim not a multiple of 8 or above
 * ATTN_MAX_DIM, more than ATTN_MAX_GROUP query heads a kv head, a length not positive). */
int gw_decode_attention(const void *q, const void *cache, const int32_t *block_table,
                        const int32_t *lens, int64_t batch, int64_t heads, int64_t kv_heads,
                        int64_t dim, int64_t block_size, int64_t num_slots, int64_t max_blocks,
                        int bf16, void *out) {
    const int64_t G = heads / kv_heads;
    if (dim % 8 || dim > ATTN_MAX_DIM || G > ATTN_MAX_GROUP || G * kv_heads != heads)
        return -1;
    for (int64_t b = 0; b < batch; b++)
        if (lens[b] <= 0 || lens[b] > max_blocks * block_size) return -1;
    const int64_t esize = bf16 ? 2 : 4, tasks = batch * kv_heads;
    const int wide = bf16 && dim % 32 == 0 && gw_runs_avx512_bf16();
    #pragma omp parallel for schedule(dynamic, 1) if (tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t b = task / kv_heads, g = task % kv_heads;
        const int64_t head = (b * heads + g * G) * dim;  /* element offset of its G heads */
        if (wide) {
            attend_group16((const uint16_t *)q + head, (const uint16_t *)cache,
                           block_table + b * max_blocks, lens[b], G, dim, block_size,
                           g * num_slots * dim, (kv_heads + g) * num_slots * dim,
                           (uint16_t *)out + head);
            continue;
        }
        attend_group((const char *)q + head * esize, cache, block_table + b * max_blocks,
                     lens[b], G, dim, block_size, g * num_slots * dim,
                     (kv_heads + g) * num_slots * dim, bf16, (char *)out + head * esize);
    }
    return 0;
}

/* Matrix products with GGUF-style quantized weights on x86-64 CPUs with AVX2, FMA and F16C,
 * computed in float32 (gateway/models/kernels/cpu.py builds and loads this file).
 *
 * A weight [N, K] is held as, per output row n and group g of 32 input columns:
 *   codes[n][g]: 16 bytes (4-bit: byte j holds column j in its low nibble and column
 *                j + 16 in its high one, GGUF's own order) or 32 bytes (8-bit, one a column);
 *   scales[n][g], minimums[n][g]: the group's scale and minimum as IEEE half floats;
 * and reads w = code * scale + minimum. So within a group
 *   sum_k x[k] w[k] = scale * sum_k x[k] code[k] + minimum * sum_k x[k],
 * which needs the codes as floats once per group for all rows of x, and the sums of x per
 * group once per row. Threads (OpenMP: the library torch itself runs on, so torch's thread
 * count applies and no second pool competes) split the output rows.
 *
 * The end of the file holds the lone decode's one call (a whole batch-1 step), the decode
 * attention of many sequences over the paged KV cache, the elementwise rows, products of
 * many bfloat16 rows with the same weights (AVX512-BF16) and the sampler's draw.
 */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <omp.h>
#include <sched.h>

#define GROUP 32
#define ROW_BLOCK 4 /* rows of x sharing one unpacking of a group's codes */
/* Products smaller than this (multiply-adds) run on the calling thread alone: waking a
 * sleeping OpenMP thread costs more than it saves. */
#define PARALLEL_WORK (1 << 20)
#define KERNEL __attribute__((target("avx2,fma,f16c")))
/* Kernels for CPUs with AVX-512 and AVX512_BF16 (chosen at run time, see bf16_rows_512). */
#define KERNEL512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

/* 1 where this CPU runs the kernels below. */
int gw_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c");
}

KERNEL static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 bytes at p widened to 8 int32 lanes (one load-and-widen). */
KERNEL static inline __m256i widen8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* The 32 codes of one group as floats, in column order. Each byte is widened to its own
 * lane first and the nibbles split there: two widenings a 4-bit group instead of four plus
 * the byte shifts between them (widenings are shuffles, the scarce port). */
KERNEL static inline void unpack(const uint8_t *p, int bits, __m256 c[4]) {
    if (bits == 4) {
        const __m256i mask = _mm256_set1_epi32(0x0F);
        const __m256i a = widen8(p), b = widen8(p + 8);
        c[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
        c[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
        c[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
        c[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    } else {
        for (int i = 0; i < 4; i++) c[i] = _mm256_cvtepi32_ps(widen8(p + 8 * i));
    }
}

/* Half floats [count] to floats. */
KERNEL static inline void halves_to_floats(const uint16_t *h, int64_t count, float *out) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < count; i++) out[i] = _cvtsh_ss(h[i]);
}

KERNEL static inline float dot(const float *a, const float *b, int64_t count) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float total = hsum(acc);
    for (; i < count; i++) total += a[i] * b[i];
    return total;
}

static inline uint16_t to_bf16(float f) {  /* round to nearest, ties to even */
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* 8 bfloat16 values at p as 8 floats (exact: a bfloat16 is a float's upper half). */
KERNEL static inline __m256 load_bf16x8(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* count bfloat16 values at src as floats at dst, any count. */
KERNEL static inline void bf16_to_floats(const uint16_t *src, int64_t count, float *dst) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
    for (; i < count; i++) dst[i] = from_bf16(src[i]);
}

/* 8 floats rounded to bfloat16 (to nearest, ties to even; NaN stays NaN), in the upper
 * halves of 8 int32 lanes' lower halves: the 8 bfloat16 values as 8 uint32. */
KERNEL static inline __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}

/* v as bfloat16 would hold it, still as floats (torch's rounding of an intermediate). */
KERNEL static inline __m256 round_bf16x8(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

/* 8 floats stored at element i of p: rounded to bfloat16 when bf16, else as they are. */
KERNEL static inline void store8(void *p, int64_t i, __m256 v, int bf16) {
    if (!bf16) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    const __m256i bits = bf16_bits8(v);  /* each <= 0xffff: the pack does not saturate */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xD8);
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_castsi256_si128(packed));
}

/* The codes of the weight row PREFETCH_ROWS rows after `row` (each row_bytes long) on
 * their way to the L1 cache. A row's codes are a few hundred bytes, read once; without
 * this the few rows of x a step has left the product waiting on them: on a 2-vCPU Xeon
 * (Sapphire Rapids class) the default model's lone decode took 16.6 ms on 2 threads
 * without and 6.2-6.9 ms with it, in process; 4 and 16 rows ahead did no better than 8. */
#define PREFETCH_ROWS 8
KERNEL static inline void prefetch_ahead(const uint8_t *row, int64_t row_bytes) {
    const char *ahead = (const char *)(row + PREFETCH_ROWS * row_bytes);
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
}

/* y[r][n] for rows r < R of x (R <= ROW_BLOCK, a constant once inlined); scale and minimum
 * are the row's [groups] as floats. */
KERNEL static inline __attribute__((always_inline)) void dot_rows(
        const float *x, const float *xsum, int64_t K, int R, const uint8_t *codes,
        const float *scale, const float *minimum, int bits, float *y, int64_t N) {
    const int64_t groups = K / GROUP, group_bytes = bits == 4 ? 16 : 32;
    __m256 acc[ROW_BLOCK];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 c[4];
        unpack(codes + g * group_bytes, bits, c);
        const __m256 s = _mm256_broadcast_ss(scale + g);
        for (int r = 0; r < R; r++) {
            const float *xg = x + r * K + g * GROUP;
            __m256 d = _mm256_mul_ps(c[0], _mm256_loadu_ps(xg));
            d = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(xg + 8), d);
            d = _mm256_fmadd_ps(c[2], _mm256_loadu_ps(xg + 16), d);
            d = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(xg + 24), d);
            acc[r] = _mm256_fmadd_ps(d, s, acc[r]);
        }
    }
    for (int r = 0; r < R; r++)
        y[r * N] = hsum(acc[r]) + dot(minimum, xsum + r * groups, groups);
}

/* Many rows of x: TILE rows of W are dequantized into a buffer (which stays in the L1
 * cache) and multiplied with every row of x there, four rows of x by two of W at a time
 * (eight sums in registers, six loads for eight multiply-adds). Each group is unpacked once
 * per step instead of once for every ROW_BLOCK rows of x, so from some eight rows on this
 * beats dot_rows, and it keeps up with a dense float32 product while reading a quarter of
 * its bytes. */
#define TILE 8
#ifndef TILED_ROWS
#define TILED_ROWS 8 /* rows of x from which tiled_matmul runs */
#endif

/* out [K]: row n of W dequantized as code * scale + minimum, rounded after each operation
 * as a plain float32 computation is; float32, or where bf16 then rounded to bfloat16 (as
 * torch rounds a float32 tensor). */
KERNEL static inline __attribute__((always_inline)) void dequantize_row(
        const uint8_t *codes, const uint16_t *scales, const uint16_t *minimums, int64_t K,
        int bits, int64_t n, void *out, int bf16) {
    const int64_t groups = K / GROUP, group_bytes = bits == 4 ? 16 : 32;
    for (int64_t g = 0; g < groups; g++) {
        __m256 c[4];
        unpack(codes + (n * groups + g) * group_bytes, bits, c);
        const __m256 scale = _mm256_set1_ps(_cvtsh_ss(scales[n * groups + g]));
        const __m256 minimum = _mm256_set1_ps(_cvtsh_ss(minimums[n * groups + g]));
        for (int i = 0; i < 4; i++)
            store8(out, g * GROUP + 8 * i, _mm256_add_ps(_mm256_mul_ps(c[i], scale), minimum),
                   bf16);
    }
}

/* y[m][j] for rows m < R of x (R <= 4) and rows j < J of w (J <= 2), K a multiple of 8. */
KERNEL static inline __attribute__((always_inline)) void tile_dots(
        const float *x, int64_t K, int R, const float *w, int J, float *y, int64_t N) {
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 w0 = _mm256_loadu_ps(w + k);
        const __m256 w1 = J > 1 ? _mm256_loadu_ps(w + K + k) : w0;
        for (int r = 0; r < R; r++) {
            const __m256 xr = _mm256_loadu_ps(x + r * K + k);
            acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
            if (J > 1) acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) y[r * N + j] = hsum(acc[r][j]);
}

KERNEL static int tiled_matmul(const float *x, int64_t M, int64_t K, const uint8_t *codes,
                               const uint16_t *scales, const uint16_t *minimums, int64_t N,
                               int bits, float *y) {
    const int64_t tiles = (N + TILE - 1) / TILE;
    int failed = 0;
    #pragma omp parallel
    {
        float *w = malloc(sizeof(float) * (size_t)(TILE * K));
        if (w == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (w == NULL) continue;
            const int64_t n0 = t * TILE, rows = N - n0 < TILE ? N - n0 : TILE;
            for (int64_t r = 0; r < rows; r++)
                dequantize_row(codes, scales, minimums, K, bits, n0 + r, w + r * K, 0);
            for (int64_t m = 0; m < M; m += 4) {
                const int R = M - m >= 4 ? 4 : (int)(M - m);
                const float *xm = x + m * K;
                for (int64_t j = 0; j < rows; j += 2) {
                    float *ym = y + m * N + n0 + j;
                    const float *wj = w + j * K;
                    if (rows - j >= 2) {
                        switch (R) {
                        case 4: tile_dots(xm, K, 4, wj, 2, ym, N); break;
                        case 3: tile_dots(xm, K, 3, wj, 2, ym, N); break;
                        case 2: tile_dots(xm, K, 2, wj, 2, ym, N); break;
                        default: tile_dots(xm, K, 1, wj, 2, ym, N); break;
                        }
                    } else {
                        tile_dots(xm, K, R, wj, 1, ym, N);
                    }
                }
            }
        }
        free(w);
    }
    return failed ? -1 : 0;
}

/* out[i] = the sum of x[32 i .. 32 i + 31], for `count` groups of x. */
KERNEL static void group_sums(const float *x, int64_t count, float *out) {
    for (int64_t i = 0; i < count; i++) {
        const float *p = x + i * GROUP;
        out[i] = hsum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                    _mm256_add_ps(_mm256_loadu_ps(p + 16),
                                                  _mm256_loadu_ps(p + 24))));
    }
}

/* y [M, N] = x [M, K] W^T, x and y float32 and contiguous, K a multiple of 32; returns 0,
 * or -1 where memory for the sums of x ran out (y is then not written). */
KERNEL int gw_quant_matmul(const float *x, int64_t M, int64_t K, const uint8_t *codes,
                           const uint16_t *scales, const uint16_t *minimums, int64_t N,
                           int bits, float *y) {
    if (M >= TILED_ROWS) return tiled_matmul(x, M, K, codes, scales, minimums, N, bits, y);
    const int64_t groups = K / GROUP, group_bytes = bits == 4 ? 16 : 32;
    float *xsum = malloc(sizeof(float) * (size_t)(M * groups));
    if (xsum == NULL) return -1;
    group_sums(x, M * groups, xsum);
    int failed = 0;
    #pragma omp parallel if (M * N * K >= PARALLEL_WORK)
    {
        float *row_params = malloc(sizeof(float) * (size_t)(2 * groups));
        if (row_params == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (row_params == NULL) continue;
            float *scale = row_params, *minimum = row_params + groups;
            halves_to_floats(scales + n * groups, groups, scale);
            halves_to_floats(minimums + n * groups, groups, minimum);
            const uint8_t *row_codes = codes + n * groups * group_bytes;
            prefetch_ahead(row_codes, groups * group_bytes);
            for (int64_t m = 0; m < M; m += ROW_BLOCK) {
                const float *xm = x + m * K, *xs = xsum + m * groups;
                float *ym = y + m * N + n;
                switch (M - m >= ROW_BLOCK ? ROW_BLOCK : (int)(M - m)) {
                case 4: dot_rows(xm, xs, K, 4, row_codes, scale, minimum, bits, ym, N); break;
                case 3: dot_rows(xm, xs, K, 3, row_codes, scale, minimum, bits, ym, N); break;
                case 2: dot_rows(xm, xs, K, 2, row_codes, scale, minimum, bits, ym, N); break;
                default: dot_rows(xm, xs, K, 1, row_codes, scale, minimum, bits, ym, N); break;
                }
            }
        }
        free(row_params);
    }
    free(xsum);
    return failed ? -1 : 0;
}

/* out [R, K]: rows `rows` [R] of W dequantized as code * scale + minimum, rounded after
 * each operation as a plain float32 computation is (rows NULL: all N rows, R = N); float32,
 * or bfloat16 where out_bf16 (the float32 value rounded once), so a bfloat16 product of
 * many rows needs no float32 copy of the weight first. */
KERNEL void gw_quant_dequantize(const uint8_t *codes, const uint16_t *scales,
                                const uint16_t *minimums, int64_t K, int bits,
                                const int64_t *rows, int64_t R, void *out, int out_bf16) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = rows == NULL ? r : rows[r];
        if (out_bf16)
            dequantize_row(codes, scales, minimums, K, bits, n, (uint16_t *)out + r * K, 1);
        else
            dequantize_row(codes, scales, minimums, K, bits, n, (float *)out + r * K, 0);
    }
}

/* ------------------------------------------------------------------ a lone decode
 * One token of one sequence through every layer of a Llama-style decoder whose four
 * projections are quantized weights of the kind above, with no bias: RMSNorm, fused q/k/v,
 * rope (the half-split layout), this token's K and V into the paged cache, attention over
 * its context, o, the residual, RMSNorm, fused gate/up, SiLU(gate) * up, down, the residual;
 * then the final RMSNorm. The same operations in the same order as the model's torch
 * forward, computed in float32; what differs is the order of a few sums (norms, softmax),
 * and for a bfloat16 model that the torch forward rounds to bfloat16 after each op where
 * this call keeps float32 between them (its weights and KV cache stay bfloat16: a value
 * written to the cache is rounded as torch rounds it). One call a step instead of some four
 * thousand op dispatches. */

/* A projection W [rows, cols]: quantized as above (bits 4 or 8), or dense float32 (bits 32)
 * or bfloat16 (bits 16): codes is then W transposed, [cols, rows] contiguous, or where
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

/* 8 weights at element i of a dense row, float32 or bfloat16 (widened), as floats; and one. */
KERNEL static inline __attribute__((always_inline)) __m256 weights8(const void *w, int64_t i,
                                                                    int bf16) {
    return bf16 ? load_bf16x8((const uint16_t *)w + i) : _mm256_loadu_ps((const float *)w + i);
}

static inline __attribute__((always_inline)) float weight1(const void *w, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)w)[i]) : ((const float *)w)[i];
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
 * a slice of every row instead, short runs with gaps between, and keeps its sums in L1: on
 * a 2-core Zen 4 EPYC the default model's float32 products took 17.3-19.7 ms a step
 * blocked against 21.8-24.5 ms, and bfloat16's 9.8-11.0 against 16.6-18.8 ms. */
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

/* Thread t of T's share of y [rows] = x [cols] W^T; `mine` holds 3 * cols / 32 floats of
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
 * a second thread saves. After a hundred spins a waiting thread yields its core at each
 * look, so that the front end and the client, which share the cores, run meanwhile and
 * the thread it waits for is not kept off a core: through HTTP on 2 cores the default
 * model's gaps between tokens were 11.1 ms with 50 spins, 11.6 with 200, 13.9 with none,
 * 21.7 with 20,000, and 14.8 ms with the call on one thread (one run). */
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
    const int64_t own = length + 3 * (widest / GROUP) + 16;
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

/* ---- Decode attention of many sequences, read in place from the paged KV cache ----
 *
 * q [B, H, D] (one query per sequence), cache [2, KV, num_slots, D] (K plane, then V;
 * slot = block * block_size + offset), block_table [B, max_blocks] int32, lens [B]: each
 * sequence's context length (its tokens, this one's included) -> out [B, H, D]. q, cache
 * and out are all float32 or all bfloat16; everything is computed in float32. Each task is
 * one (sequence, kv head) pair: its G = H / KV query heads read every key and value once,
 * a block at a time, with the softmax kept running (its maximum and sum rescaled as later
 * blocks raise the maximum), so no score buffer grows with the context and nothing is
 * gathered. Threads take tasks as they come: contexts differ in length. */

#define ATTN_CHUNK 32  /* tokens a pass: the scores of G heads for them stay in L1 */
#define ATTN_MAX_GROUP 16
#define ATTN_MAX_DIM 256

/* exp of 8 floats, to about 1 ulp on [-87, 88]: x = n ln2 + r with |r| <= ln2 / 2 (ln2
 * split in two so r stays exact), exp(r) by its Taylor polynomial to r^7, times 2^n. */
KERNEL static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
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

static int bf16_rows_512(void);
KERNEL512 static void attend_group16(const uint16_t *q, const uint16_t *cache,
                                     const int32_t *blocks, int64_t length, int64_t G,
                                     int64_t dim, int64_t block_size, int64_t k_offset,
                                     int64_t v_offset, uint16_t *out);

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
    const int wide = bf16 && dim % 32 == 0 && bf16_rows_512();
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

/* ------------------------------------------------------------------------------------------
 * The elementwise steps between the matrix products of a many-row step, each in one pass
 * over rows of bfloat16 or float32 (torch's ops take two to six passes, and as many
 * dispatches, for each). In bfloat16 each rounds where torch's ops round, so the results
 * are those of the ops they replace up to the order of a row's sum of squares.
 */

/* Rows of this many values or more are split between threads. */
#define ELEMENTWISE_PARALLEL (1 << 15)

/* x [rows, dim] is the residual stream: with delta [rows, dim], x += delta first, in place
 * (rounded as torch's add_). Then out [rows, dim] = x / sqrt(mean(x^2) + eps) * weight: in
 * bfloat16 as HF's Llama computes it (normalised in float32, rounded, then times the
 * weight, rounded), in float32 as F.rms_norm. */
KERNEL static inline __attribute__((always_inline)) void add_rms_norm_row(
        char *row, const char *add, const void *weight, int64_t dim, float eps, int bf16,
        char *dst) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) {
        __m256 v0 = weights8(row, i, bf16), v1 = weights8(row, i + 8, bf16);
        if (add) {
            v0 = _mm256_add_ps(v0, weights8(add, i, bf16));
            v1 = _mm256_add_ps(v1, weights8(add, i + 8, bf16));
            if (bf16) {
                v0 = round_bf16x8(v0);
                v1 = round_bf16x8(v1);
            }
            store8(row, i, v0, bf16);
            store8(row, i + 8, v1, bf16);
        }
        acc0 = _mm256_fmadd_ps(v0, v0, acc0);
        acc1 = _mm256_fmadd_ps(v1, v1, acc1);
    }
    for (; i < dim; i += 8) {
        __m256 v = weights8(row, i, bf16);
        if (add) {
            v = _mm256_add_ps(v, weights8(add, i, bf16));
            if (bf16) v = round_bf16x8(v);
            store8(row, i, v, bf16);
        }
        acc0 = _mm256_fmadd_ps(v, v, acc0);
    }
    const float mean = hsum(_mm256_add_ps(acc0, acc1)) / (float)dim;
    const __m256 scale = _mm256_set1_ps(1.0f / sqrtf(mean + eps));
    for (i = 0; i < dim; i += 8) {
        __m256 v = _mm256_mul_ps(weights8(row, i, bf16), scale);
        if (bf16) v = round_bf16x8(v);
        store8(dst, i, _mm256_mul_ps(v, weights8(weight, i, bf16)), bf16);
    }
}

/* bfloat16 rows on CPUs with AVX-512 and its bfloat16 conversions (AVX512_BF16): 16 values
 * an instruction, and the rounding to bfloat16 in one (to nearest even, as torch rounds;
 * it flushes subnormals, below 1.2e-38, to zero). KERNEL512 is defined at the top. */

static int wide_rows_allowed = 1;
/* The instruction-set level Python's cpu_isa() allows (3: AVX512_BF16; see
 * gateway/platforms/cpu_isa.py): GATEWAY_CPU_ISA can cap it below the CPU's own. */
static int isa_level = 0;

void gw_set_isa_level(int level) { isa_level = level; }

static int bf16_rows_512(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
            && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
    }
    return known && isa_level >= 3 && wide_rows_allowed;
}

/* Allow (1) or forbid (0) the AVX-512 bfloat16 rows (the tests run both); returns whether
 * they run now. */
int gw_wide_bf16_rows(int allow) {
    wide_rows_allowed = allow;
    return bf16_rows_512();
}

KERNEL512 static inline __m512 load16(const void *p, int64_t i) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

KERNEL512 static inline __m256i bits16(__m512 v) {
    return (__m256i)_mm512_cvtneps_pbh(v);
}

KERNEL512 static inline void store16(void *p, int64_t i, __m512 v) {
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), bits16(v));
}

KERNEL512 static inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits16(v)), 16));
}

/* exp8's polynomial on 16 lanes. */
KERNEL512 static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

KERNEL512 static void add_rms_norm_row16(char *row, const char *add, const void *weight,
                                         int64_t dim, float eps, char *dst) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
        __m512 v = load16(row, i);
        if (add) {
            v = round16(_mm512_add_ps(v, load16(add, i)));
            store16(row, i, v);
        }
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float mean = _mm512_reduce_add_ps(acc) / (float)dim;
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(mean + eps));
    for (int64_t i = 0; i < dim; i += 16)
        store16(dst, i, _mm512_mul_ps(round16(_mm512_mul_ps(load16(row, i), scale)),
                                      load16(weight, i)));
}

KERNEL512 static void silu_mul_row16(const char *gate, const char *up, int64_t inter,
                                     char *dst) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < inter; i += 16) {
        const __m512 g = load16(gate, i);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, g))));
        store16(dst, i, _mm512_mul_ps(round16(s), load16(up, i)));
    }
}

KERNEL512 static void rotary_row16(char *x, int64_t heads, int64_t dim, const char *c,
                                   const char *s) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        char *v = x + h * dim * 2;
        for (int64_t i = 0; i < half; i += 16) {
            const __m512 x1 = load16(v, i), x2 = load16(v, half + i);
            const __m512 a = round16(_mm512_mul_ps(x1, load16(c, i)));
            const __m512 b = round16(_mm512_mul_ps(x2, load16(c, half + i)));
            store16(v, i, _mm512_fmadd_ps(x2, load16(s, i), a));
            store16(v, half + i, _mm512_fmadd_ps(x1, load16(s, half + i), b));
        }
    }
}

/* 0, or -1 where dim is not a multiple of 8. */
KERNEL int gw_add_rms_norm(void *x, const void *delta, const void *weight, int64_t rows,
                           int64_t dim, float eps, int bf16, void *out) {
    if (dim % 8 || dim <= 0) return -1;
    const int64_t bytes = dim * (bf16 ? 2 : 4);
    const int wide = bf16 && dim % 16 == 0 && bf16_rows_512();
    #pragma omp parallel for schedule(static) if (rows * dim >= ELEMENTWISE_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        char *row = (char *)x + r * bytes, *dst = (char *)out + r * bytes;
        const char *add = delta ? (const char *)delta + r * bytes : NULL;
        if (wide) add_rms_norm_row16(row, add, weight, dim, eps, dst);
        else if (bf16) add_rms_norm_row(row, add, weight, dim, eps, 1, dst);
        else add_rms_norm_row(row, add, weight, dim, eps, 0, dst);
    }
    return 0;
}

KERNEL static inline __attribute__((always_inline)) void silu_mul_row(
        const char *gate, const char *up, int64_t inter, int bf16, char *dst) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t i = 0; i < inter; i += 8) {
        const __m256 g = weights8(gate, i, bf16);
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
        if (bf16) s = round_bf16x8(s);
        store8(dst, i, _mm256_mul_ps(s, weights8(up, i, bf16)), bf16);
    }
}

/* gate_up [rows, 2 inter] (gate, then up, per row) -> out [rows, inter] = silu(gate) * up,
 * silu rounded to bfloat16 before the product where bf16 (as F.silu then mul_). 0, or -1
 * where inter is not a multiple of 8. */
KERNEL int gw_silu_mul(const void *gate_up, int64_t rows, int64_t inter, int bf16, void *out) {
    if (inter % 8 || inter <= 0) return -1;
    const int64_t esize = bf16 ? 2 : 4;
    const int wide = bf16 && inter % 16 == 0 && bf16_rows_512();
    #pragma omp parallel for schedule(static) if (rows * inter >= ELEMENTWISE_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)gate_up + r * 2 * inter * esize;
        char *dst = (char *)out + r * inter * esize;
        if (wide) silu_mul_row16(gate, gate + inter * esize, inter, dst);
        else if (bf16) silu_mul_row(gate, gate + inter * esize, inter, 1, dst);
        else silu_mul_row(gate, gate + inter * esize, inter, 0, dst);
    }
    return 0;
}

KERNEL static inline __attribute__((always_inline)) void rotary_row(
        char *x, int64_t heads, int64_t dim, const char *c, const char *s, int bf16) {
    const int64_t half = dim / 2, esize = bf16 ? 2 : 4;
    for (int64_t h = 0; h < heads; h++) {
        char *v = x + h * dim * esize;
        for (int64_t i = 0; i < half; i += 8) {
            const __m256 x1 = weights8(v, i, bf16), x2 = weights8(v, half + i, bf16);
            __m256 a = _mm256_mul_ps(x1, weights8(c, i, bf16));
            __m256 b = _mm256_mul_ps(x2, weights8(c, half + i, bf16));
            if (bf16) {
                a = round_bf16x8(a);
                b = round_bf16x8(b);
            }
            store8(v, i, _mm256_fmadd_ps(x2, weights8(s, i, bf16), a), bf16);
            store8(v, half + i, _mm256_fmadd_ps(x1, weights8(s, half + i, bf16), b), bf16);
        }
    }
}

/* In place, the first `heads` heads (dim values each) of each row of x (row r at element
 * r * stride): HF's half-split rotary embedding, x * cos + [x2, x1] * sin, with cos and sin
 * [rows, dim] (sin's first half negated), rounded as torch's mul_ then addcmul_ where bf16.
 * 0, or -1 where dim is not a multiple of 16. */
KERNEL int gw_rotary(void *x, int64_t rows, int64_t stride, int64_t heads, int64_t dim,
                     const void *cos, const void *sin, int bf16) {
    if (dim % 16 || dim <= 0) return -1;
    const int64_t esize = bf16 ? 2 : 4;
    const int wide = bf16 && dim % 32 == 0 && bf16_rows_512();
    #pragma omp parallel for schedule(static) if (rows * heads * dim >= ELEMENTWISE_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        char *row = (char *)x + r * stride * esize;
        const char *c = (const char *)cos + r * dim * esize;
        const char *s = (const char *)sin + r * dim * esize;
        if (wide) rotary_row16(row, heads, dim, c, s);
        else if (bf16) rotary_row(row, heads, dim, c, s, 1);
        else rotary_row(row, heads, dim, c, s, 0);
    }
    return 0;
}

/* ---- The decode attention of bfloat16 caches on AVX-512 with AVX512_BF16 ----
 *
 * attend_group's task with the keys read as bfloat16 pairs (VDPBF16PS: two products a lane,
 * exact, summed in float32) and no float32 copy of any row. The scores of up to
 * ATTN16_CHUNK tokens are taken first, then one maximum and one exp a head, then the values,
 * each row widened once for all G heads; the running maximum and sum carry from one chunk
 * to the next as in attend_group. */

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

/* ---- Quantized products of many bfloat16 rows (AVX512_BF16) ----
 *
 * x [M, K] bfloat16 times a quantized W [N, K] (the layout at the top of the file), for a
 * step of a few to some tens of rows: VDPBF16PS multiplies 32 pairs of bfloat16 values and
 * adds them into 16 float32 lanes an instruction, twice the multiply-adds of two float32
 * FMAs. The codes are integers below 256, exact in bfloat16, and each product of two
 * bfloat16 values is exact in float32; so, per group of 32 columns, sum x[k] code[k] is
 * computed from the codes themselves, then scaled and given minimum * sum(x) in float32,
 * as the float32 kernel does from x widened: only the order of the sums differs (and the
 * instruction flushes subnormal inputs, below 1.2e-38, to zero).
 *
 * Lanes run across rows of W: for a block of 16 rows and a group, 32-bit lane i of vector p
 * holds row i's codes of columns p and p + 16 (the two nibbles of byte p of a 4-bit group,
 * bytes p and p + 16 of an 8-bit one), and x's values of those two columns are broadcast
 * to every lane. The 16 vectors are built once a block and group (a 16 x 16 byte transpose)
 * and read from the L1 cache for every row of x; a group's 16 products with a row are one
 * chain of additions, 16 rows at once. */

/* r[p] byte i := r[i] byte p, for 16 rows of 16 bytes (four rounds of unpacks: after round
 * j, bit j of the row index sits in the position within the register). */
KERNEL512 static inline __attribute__((always_inline)) void transpose16(__m128i r[16]) {
    __m128i a[16], b[16];
    for (int k = 0; k < 8; k++) {  /* a[(i3 i2 i1) p3], positions (p2 p1 p0 i0) */
        a[2 * k] = _mm_unpacklo_epi8(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm_unpackhi_epi8(r[2 * k], r[2 * k + 1]);
    }
    for (int h = 0; h < 4; h++)  /* b[(i3 i2) p3 p2], positions (p1 p0 i1 i0) */
        for (int p3 = 0; p3 < 2; p3++) {
            const __m128i lo = a[(2 * h) * 2 + p3], hi = a[(2 * h + 1) * 2 + p3];
            b[h * 4 + p3 * 2] = _mm_unpacklo_epi16(lo, hi);
            b[h * 4 + p3 * 2 + 1] = _mm_unpackhi_epi16(lo, hi);
        }
    for (int i3 = 0; i3 < 2; i3++)  /* a[i3 p3 p2 p1], positions (p0 i2 i1 i0) */
        for (int q = 0; q < 4; q++) {
            const __m128i lo = b[(2 * i3) * 4 + q], hi = b[(2 * i3 + 1) * 4 + q];
            a[i3 * 8 + q * 2] = _mm_unpacklo_epi32(lo, hi);
            a[i3 * 8 + q * 2 + 1] = _mm_unpackhi_epi32(lo, hi);
        }
    for (int q = 0; q < 8; q++) {  /* r[p3 p2 p1 p0], positions (i3 i2 i1 i0) */
        r[2 * q] = _mm_unpacklo_epi64(a[q], a[8 + q]);
        r[2 * q + 1] = _mm_unpackhi_epi64(a[q], a[8 + q]);
    }
}

/* The 16 vectors of rows n0 .. n0 + 15 and group g (see above). */
KERNEL512 static inline __attribute__((always_inline)) void code_pairs(
        const uint8_t *codes, int64_t groups, int bits, int64_t n0, int64_t g, __m512i w[16]) {
    const int64_t group_bytes = bits == 4 ? 16 : 32, row_bytes = groups * group_bytes;
    const uint8_t *p = codes + n0 * row_bytes + g * group_bytes;
    __m128i lo[16];
    for (int i = 0; i < 16; i++) lo[i] = _mm_loadu_si128((const __m128i *)(p + i * row_bytes));
    transpose16(lo);
    if (bits == 4) {
        /* word j of bfloat16(j) for j < 16: the codes' values looked up by VPERMW */
        const __m512i table = _mm512_set_epi16(
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
            0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
        const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
        for (int q = 0; q < 16; q++) {
            const __m512i d = _mm512_cvtepu8_epi32(lo[q]);  /* byte b in a lane */
            /* (b & 15) in the low word, b >> 4 in the high one */
            const __m512i v = _mm512_and_si512(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)),
                                               nibbles);
            w[q] = _mm512_permutexvar_epi16(v, table);
        }
    } else {
        __m128i hi[16];
        for (int i = 0; i < 16; i++)
            hi[i] = _mm_loadu_si128((const __m128i *)(p + i * row_bytes + 16));
        transpose16(hi);
        const __m512i high_half = _mm512_set1_epi32((int)0xFFFF0000u);
        for (int q = 0; q < 16; q++) {
            /* a float of an integer below 256 is its bfloat16 with 16 zero bits after it */
            const __m512i a =
                _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo[q])));
            const __m512i b =
                _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi[q])));
            w[q] = _mm512_or_si512(_mm512_srli_epi32(a, 16), _mm512_and_si512(b, high_half));
        }
    }
}

/* acc[r] (16 lanes: rows n0 .. n0 + 15 of W) += the group's sums with rows m .. m + R - 1
 * of x, scaled, plus minimum * sum(x); R <= PAIR_ROWS, a constant once inlined. w: the
 * group's 16 vectors (in L1, each loaded once for the R rows); xp: x's pairs of this group
 * from row m on, [R][16] (a group's rows are adjacent, so each pair is one constant offset
 * away); xs: their group sums [R]. The R sums are independent chains of additions: the
 * instruction's latency is several times its issue interval, so one row's chain alone
 * would leave the unit idle most of the time. */
#define PAIR_ROWS 16
KERNEL512 static inline __attribute__((always_inline)) void pair_dots(
        const __m512i *w, const uint32_t *xp, const float *xs, int R, __m512 scale,
        __m512 minimum, float *acc) {
    __m512 d[PAIR_ROWS];
    for (int r = 0; r < R; r++) d[r] = _mm512_setzero_ps();
    for (int q = 0; q < 16; q++) {
        const __m512bh wq = (__m512bh)_mm512_load_si512(w + q);
        for (int r = 0; r < R; r++)
            d[r] = _mm512_dpbf16_ps(d[r], wq,
                                    (__m512bh)_mm512_set1_epi32((int)xp[r * 16 + q]));
    }
    for (int r = 0; r < R; r++) {
        __m512 a = _mm512_loadu_ps(acc + r * 16);
        a = _mm512_fmadd_ps(d[r], scale, a);
        a = _mm512_fmadd_ps(_mm512_set1_ps(xs[r]), minimum, a);
        _mm512_storeu_ps(acc + r * 16, a);
    }
}

/* Scratch for x's pairs and group sums: grown as needed and kept by the calling thread, as
 * a fresh buffer every call (some hundreds of KiB) costs page faults. */
static __thread uint32_t *pair_scratch;
static __thread size_t pair_scratch_bytes;

KERNEL512 static int quant_matmul_bf16(const uint16_t *x, int64_t M, int64_t K,
                                       const uint8_t *codes, const uint16_t *scales,
                                       const uint16_t *minimums, int64_t N, int bits, void *y,
                                       int out_bf16) {
    const int64_t groups = K / GROUP;
    const size_t need = sizeof(uint32_t) * (size_t)(M * K / 2)
        + sizeof(float) * (size_t)(M * groups);
    if (need > pair_scratch_bytes) {
        free(pair_scratch);
        pair_scratch = malloc(need);
        pair_scratch_bytes = pair_scratch ? need : 0;
        if (!pair_scratch) return -1;
    }
    uint32_t *xp = pair_scratch;
    float *xs = (float *)(xp + M * K / 2);
    for (int64_t m = 0; m < M; m++)  /* pairs (column j, column j + 16) and sums, [groups][M] */
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *src = x + m * K + g * GROUP;
            const __m256i a = _mm256_loadu_si256((const __m256i *)src);
            const __m256i b = _mm256_loadu_si256((const __m256i *)(src + 16));
            const __m512i pairs = _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                                                  _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
            _mm512_storeu_si512(xp + (g * M + m) * 16, pairs);
            xs[g * M + m] = _mm512_reduce_add_ps(_mm512_add_ps(load16(src, 0),
                                                                    load16(src, 16)));
        }
    const int64_t blocks = N / 16;
    int failed = 0;
    #pragma omp parallel if (M * N * K >= PARALLEL_WORK)
    {
        /* the block's scales and minimums, [groups][16] each, then its sums [M][16] */
        float *params = malloc(sizeof(float) * (size_t)(32 * groups + 16 * M));
        if (params == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            if (params == NULL) continue;
            const int64_t n0 = blk * 16;
            float *scale = params, *minimum = params + 16 * groups, *acc = params + 32 * groups;
            for (int i = 0; i < 16; i++)
                for (int64_t g = 0; g < groups; g++) {
                    scale[g * 16 + i] = _cvtsh_ss(scales[(n0 + i) * groups + g]);
                    minimum[g * 16 + i] = _cvtsh_ss(minimums[(n0 + i) * groups + g]);
                }
            for (int64_t i = 0; i < M * 16; i++) acc[i] = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                __m512i w[16] __attribute__((aligned(64)));
                code_pairs(codes, groups, bits, n0, g, w);
                const __m512 s = _mm512_loadu_ps(scale + g * 16);
                const __m512 mn = _mm512_loadu_ps(minimum + g * 16);
                for (int64_t m = 0; m < M; m += PAIR_ROWS) {
                    const uint32_t *xpm = xp + (g * M + m) * 16;
                    const float *xsm = xs + g * M + m;
                    float *am = acc + m * 16;
#define PAIR_CASE(R) case R: pair_dots(w, xpm, xsm, R, s, mn, am); break;
                    switch (M - m >= PAIR_ROWS ? PAIR_ROWS : (int)(M - m)) {
                    PAIR_CASE(16) PAIR_CASE(15) PAIR_CASE(14) PAIR_CASE(13) PAIR_CASE(12)
                    PAIR_CASE(11) PAIR_CASE(10) PAIR_CASE(9) PAIR_CASE(8) PAIR_CASE(7)
                    PAIR_CASE(6) PAIR_CASE(5) PAIR_CASE(4) PAIR_CASE(3) PAIR_CASE(2)
                    default: pair_dots(w, xpm, xsm, 1, s, mn, am); break;
                    }
#undef PAIR_CASE
                }
            }
            for (int64_t m = 0; m < M; m++) {
                const __m512 v = _mm512_loadu_ps(acc + m * 16);
                if (out_bf16) store16(y, m * N + n0, v);
                else _mm512_storeu_ps((float *)y + m * N + n0, v);
            }
        }
        free(params);
    }
    return failed ? -1 : 0;
}

/* 1 where gw_quant_matmul_bf16 runs on this CPU (and the AVX-512 rows are allowed). */
int gw_bf16_products(void) { return bf16_rows_512(); }

/* y [M, N] (float32, or bfloat16 where out_bf16) = x [M, K] W^T, x bfloat16 and contiguous,
 * N a multiple of 16, K of 32. 0; -1 where memory ran out; -2 where the CPU lacks
 * AVX512_BF16 or the shape does not fit (y untouched). */
int gw_quant_matmul_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                         const uint16_t *scales, const uint16_t *minimums, int64_t N, int bits,
                         void *y, int out_bf16) {
    if (!bf16_rows_512() || M < 1 || N % 16 || K % GROUP
            || (bits != 4 && bits != 8))
        return -2;
    return quant_matmul_bf16(x, M, K, codes, scales, minimums, N, bits, y, out_bf16);
}

/* ---- The sampler's draw: one token a row by inverting its CDF ----
 *
 * Per row of float32 logits x (temperature already applied), as sampling_ops.draw computes
 * it with torch's ops: the weights w = exp(x - max x), 0 below the row's threshold; the
 * token is the first whose running sum of weights exceeds u times their total. torch takes
 * five passes over the row and three [rows, vocab] temporaries; here the row is read
 * twice, and a third time over one block: the sums of blocks of DRAW_BLOCK weights (in
 * double) locate the block where u * total falls, whose weights are then summed one by one.
 * A token below its row's threshold has weight 0 (a NaN threshold keeps every token, as
 * torch's comparison does). A row holding NaN or +inf, or with no weight left, cannot be
 * sampled (ok 0, token 0). */

#define DRAW_BLOCK 512

/* The weights of x[0 .. n) (n <= DRAW_BLOCK) into w, and their sum. */
KERNEL static double draw_weights(const float *x, int64_t n, float top, float threshold,
                                  float *w) {
    const __m256 mv = _mm256_set1_ps(top), tv = _mm256_set1_ps(threshold);
    const __m256 floor = _mm256_set1_ps(-87.0f);  /* below: exp underflows, weight 0 */
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i), d = _mm256_sub_ps(v, mv);
        const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(v, tv, _CMP_NLT_UQ),
                                          _mm256_cmp_ps(d, floor, _CMP_GE_OQ));
        const __m256 e = _mm256_and_ps(exp8(d), keep);
        _mm256_storeu_ps(w + i, e);
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double lanes[4], total;
    _mm256_storeu_pd(lanes, _mm256_add_pd(s0, s1));
    total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; i < n; i++) {
        const float d = x[i] - top;
        w[i] = (!(x[i] < threshold) && d >= -87.0f) ? expf(d) : 0.0f;
        total += w[i];
    }
    return total;
}

KERNEL static int64_t draw_row(const float *x, int64_t vocab, float threshold, float u,
                               double *block_sums, int *ok) {
    float w[DRAW_BLOCK];
    __m256 best = _mm256_set1_ps(-INFINITY);
    __m256 nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= vocab; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        best = _mm256_max_ps(best, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], top;
    _mm256_storeu_ps(lanes, best);
    top = lanes[0];
    for (int k = 1; k < 8; k++) top = lanes[k] > top ? lanes[k] : top;
    int has_nan = !_mm256_testz_ps(nan, nan);
    for (; i < vocab; i++) {
        if (x[i] != x[i]) has_nan = 1;
        else if (x[i] > top) top = x[i];
    }
    *ok = 0;
    if (has_nan || !isfinite(top)) return 0;
    const int64_t blocks = (vocab + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * DRAW_BLOCK;
        const int64_t n = vocab - start < DRAW_BLOCK ? vocab - start : DRAW_BLOCK;
        block_sums[b] = draw_weights(x + start, n, top, threshold, w);
        total += block_sums[b];
    }
    if (!(total > 0.0) || !isfinite(total)) return 0;
    *ok = 1;
    const double target = (double)u * total;  /* u < 1: below the total */
    /* The block sums add up in the order `total` did, so the walk stops at a block b whose
     * sum is positive: it holds a token with weight, and `last` is set once it is read. */
    double running = 0.0;
    int64_t b = 0, last = 0;
    while (running + block_sums[b] <= target) running += block_sums[b++];
    for (; b < blocks; b++) {  /* one by one from the block where the target falls */
        const int64_t start = b * DRAW_BLOCK;
        const int64_t n = vocab - start < DRAW_BLOCK ? vocab - start : DRAW_BLOCK;
        draw_weights(x + start, n, top, threshold, w);
        for (int64_t j = 0; j < n; j++) {
            if (w[j] <= 0.0f) continue;
            running += w[j];
            last = start + j;
            if (running > target) return last;
        }
    }
    return last;  /* summed one by one the weights fell short of the target: the last */
}

/* logits [rows, vocab] float32; thresholds [rows] or NULL (none); uniforms [rows] in
 * [0, 1). Writes tokens [rows] and ok [rows] (1: sampled). 0, or -1 where the block sums
 * could not be allocated. */
KERNEL int gw_draw(const float *logits, int64_t rows, int64_t vocab, const float *thresholds,
                   const float *uniforms, int64_t *tokens, uint8_t *ok) {
    const int64_t blocks = (vocab + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double *sums = malloc(sizeof(double) * (size_t)(blocks * rows > 0 ? blocks * rows : 1));
    if (!sums) return -1;
    #pragma omp parallel for schedule(static) if (rows > 1 && rows * vocab >= ELEMENTWISE_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        int row_ok;
        tokens[r] = draw_row(logits + r * vocab, vocab, thresholds ? thresholds[r] : -INFINITY,
                             uniforms[r], sums + r * blocks, &row_ok);
        ok[r] = (uint8_t)row_ok;
    }
    free(sums);
    return 0;
}

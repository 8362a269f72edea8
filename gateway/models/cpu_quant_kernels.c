/* Matrix products with GGUF-style quantized weights on x86-64 CPUs with AVX2, FMA and F16C,
 * computed in float32 (gateway/models/cpu_quant_kernels.py builds and loads this file).
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
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define GROUP 32
#define ROW_BLOCK 4 /* rows of x sharing one unpacking of a group's codes */
/* Products smaller than this (multiply-adds) run on the calling thread alone: waking a
 * sleeping OpenMP thread costs more than it saves. */
#define PARALLEL_WORK (1 << 20)
#define KERNEL __attribute__((target("avx2,fma,f16c")))

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

KERNEL static inline __m256 bytes_to_floats(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); /* the low 8 bytes */
}

/* The 32 codes of one group as floats, in column order. */
KERNEL static inline void unpack(const uint8_t *p, int bits, __m256 c[4]) {
    if (bits == 4) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        __m128i mask = _mm_set1_epi8(0x0F);
        __m128i lo = _mm_and_si128(v, mask);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        c[0] = bytes_to_floats(lo);
        c[1] = bytes_to_floats(_mm_srli_si128(lo, 8));
        c[2] = bytes_to_floats(hi);
        c[3] = bytes_to_floats(_mm_srli_si128(hi, 8));
    } else {
        __m128i a = _mm_loadu_si128((const __m128i *)p);
        __m128i b = _mm_loadu_si128((const __m128i *)(p + 16));
        c[0] = bytes_to_floats(a);
        c[1] = bytes_to_floats(_mm_srli_si128(a, 8));
        c[2] = bytes_to_floats(b);
        c[3] = bytes_to_floats(_mm_srli_si128(b, 8));
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

/* y [M, N] = x [M, K] W^T, x and y float32 and contiguous, K a multiple of 32; returns 0,
 * or -1 where memory for the sums of x ran out (y is then not written). */
KERNEL int gw_quant_matmul(const float *x, int64_t M, int64_t K, const uint8_t *codes,
                           const uint16_t *scales, const uint16_t *minimums, int64_t N,
                           int bits, float *y) {
    const int64_t groups = K / GROUP, group_bytes = bits == 4 ? 16 : 32;
    float *xsum = malloc(sizeof(float) * (size_t)(M * groups));
    if (xsum == NULL) return -1;
    for (int64_t i = 0; i < M * groups; i++) {
        const float *p = x + i * GROUP;
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
        xsum[i] = hsum(s);
    }
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

/* out [R, K] float32: rows `rows` [R] of W dequantized as code * scale + minimum, rounded
 * after each operation as a plain float32 computation is (rows NULL: all N rows, R = N). */
KERNEL void gw_quant_dequantize(const uint8_t *codes, const uint16_t *scales,
                                const uint16_t *minimums, int64_t K, int bits,
                                const int64_t *rows, int64_t R, float *out) {
    const int64_t groups = K / GROUP, group_bytes = bits == 4 ? 16 : 32;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = rows == NULL ? r : rows[r];
        for (int64_t g = 0; g < groups; g++) {
            __m256 c[4];
            unpack(codes + (n * groups + g) * group_bytes, bits, c);
            const __m256 scale = _mm256_set1_ps(_cvtsh_ss(scales[n * groups + g]));
            const __m256 minimum = _mm256_set1_ps(_cvtsh_ss(minimums[n * groups + g]));
            float *o = out + r * K + g * GROUP;
            for (int i = 0; i < 4; i++)
                _mm256_storeu_ps(o + 8 * i, _mm256_add_ps(_mm256_mul_ps(c[i], scale), minimum));
        }
    }
}

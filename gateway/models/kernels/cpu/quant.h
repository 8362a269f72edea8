/* The layout of a GGUF-style quantized weight (Q4_0, Q4_1, Q8_0) as the kernels hold it,
 * and the helpers that read it: the products (quant_matmul.c, lone_decode.c) and the
 * dequantization (dequantize.c).
 *
 * A weight [N, K] is held as, per output row n and group g of 32 input columns:
 *   codes[n][g]: 16 bytes (4-bit: byte j holds column j in its low nibble and column
 *                j + 16 in its high one, GGUF's own order) or 32 bytes (8-bit, one a column);
 *   scales[n][g], minimums[n][g]: the group's scale and minimum as IEEE half floats;
 * and reads w = code * scale + minimum. So within a group
 *   sum_k x[k] w[k] = scale * sum_k x[k] code[k] + minimum * sum_k x[k],
 * which needs the codes as floats once per group for all rows of x, and the sums of x per
 * group once per row.
 */
#ifndef GW_QUANT_H
#define GW_QUANT_H

#include "kernels.h"

#define GROUP 32
#define ROW_BLOCK 4 /* rows of x sharing one unpacking of a group's codes */

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

/* The codes of the weight row PREFETCH_ROWS rows after `row` (each row_bytes long) on
 * their way to the L1 cache. A row's codes are a few hundred bytes, read once; without
 * this the few rows of x a step has leave the product waiting on them (the distance is
 * measured: docs/cpu-performance.md). */
#define PREFETCH_ROWS 8
KERNEL static inline void prefetch_ahead(const uint8_t *row, int64_t row_bytes) {
    const char *ahead = (const char *)(row + PREFETCH_ROWS * row_bytes);
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
}

/* y[r][n] for rows r < R of x (R <= 8, a constant once inlined); scale and minimum are the
 * row's [groups] as floats. Each row's sums are the same operations in the same order
 * whatever R is. */
KERNEL static inline __attribute__((always_inline)) void dot_rows(
        const float *x, const float *xsum, int64_t K, int R, const uint8_t *codes,
        const float *scale, const float *minimum, int bits, float *y, int64_t N) {
    const int64_t groups = K / GROUP, group_bytes = bits == 4 ? 16 : 32;
    __m256 acc[8];
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

/* out[i] = the sum of x[32 i .. 32 i + 31], for `count` groups of x. */
KERNEL static inline void group_sums(const float *x, int64_t count, float *out) {
    for (int64_t i = 0; i < count; i++) {
        const float *p = x + i * GROUP;
        out[i] = hsum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                    _mm256_add_ps(_mm256_loadu_ps(p + 16),
                                                  _mm256_loadu_ps(p + 24))));
    }
}

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

#endif

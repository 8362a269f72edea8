/* The lone decode's products of dense weights (lone_decode.c): a float32 or bfloat16 W held
 * transposed, or in blocks of 32 outputs, times one row of x; and, for a verify step's
 * rows of a bfloat16 model on an AVX512-BF16 CPU, the blocked W times several rows by
 * bfloat16 dot products of pairs.
 */
#ifndef GW_LONE_DENSE_H
#define GW_LONE_DENSE_H

#include "kernels.h"

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

/* Rows of x one pass of `dense_blocks_pairs` holds (two vectors of sums a row). */
#define PAIR_ROWS 6

/* x [R, K] rounded to bfloat16, each row as K / 2 words of two values (x[2p] low, x[2p + 1]
 * high; an odd K's last word padded with a zero): x16 [R, (K + 1) / 2]. */
KERNEL512 static void bf16_pairs(const float *x, int64_t R, int64_t K, uint32_t *x16) {
    const int64_t words = (K + 1) / 2;
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * K;
        uint16_t *out = (uint16_t *)(x16 + r * words);
        int64_t i = 0;
        for (; i + 32 <= K; i += 32)
            _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_loadu_ps(row + i + 16), _mm512_loadu_ps(row + i)));
        for (; i < K; i++) out[i] = to_bf16(row[i]);
        if (K % 2) out[K] = 0;
    }
}

/* y[r][32 b .. 32 b + 31] for rows r < R of x and blocks b0 <= b < b1 of a bfloat16 W held
 * in blocks of 32 outputs (dense_blocks' layout), by AVX-512 bfloat16 dot products of pairs:
 * two weight rows k, k + 1 of a block (a cache line each) are interleaved so that each
 * output's two weights sit in one word, and each row of x (x16, bf16_pairs) multiplies
 * them by its pair x[k], x[k + 1]. One interleaving serves every row, and one instruction
 * does 32 products: the rows after the first cost little more than reading the block again
 * from the cache, where `dense_blocks` widens each weight once a row. The interleaving
 * leaves the sums in the order of outputs 0-3, 8-11, 16-19, 24-27 (lo) and 4-7, 12-15, ...
 * (hi), which the two permutations at the end undo. x is rounded to bfloat16 here, as the
 * torch forward of a bfloat16 model rounds it. */
KERNEL512 static inline __attribute__((always_inline)) void pair_pass(
        const uint32_t *x16, int64_t words, int n, const uint16_t *w, int64_t K, float *y,
        int64_t N) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21,
                                            22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15,
                                             28, 29, 30, 31);
    __m512 lo[PAIR_ROWS], hi[PAIR_ROWS];
    for (int r = 0; r < n; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < words; p++) {
        const __m512i a = _mm512_loadu_si512(w + 2 * p * DENSE_BLOCK);
        const __m512i c = 2 * p + 1 < K ? _mm512_loadu_si512(w + (2 * p + 1) * DENSE_BLOCK)
                                        : _mm512_setzero_si512();
        const __m512bh wl = (__m512bh)_mm512_unpacklo_epi16(a, c);
        const __m512bh wh = (__m512bh)_mm512_unpackhi_epi16(a, c);
        for (int r = 0; r < n; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x16[r * words + p]);
            lo[r] = _mm512_dpbf16_ps(lo[r], xv, wl);
            hi[r] = _mm512_dpbf16_ps(hi[r], xv, wh);
        }
    }
    for (int r = 0; r < n; r++) {
        _mm512_storeu_ps(y + r * N, _mm512_permutex2var_ps(lo[r], first, hi[r]));
        _mm512_storeu_ps(y + r * N + 16, _mm512_permutex2var_ps(lo[r], second, hi[r]));
    }
}

KERNEL512 static void dense_blocks_pairs(const uint32_t *x16, int64_t R, const uint16_t *wb,
                                         int64_t K, int64_t b0, int64_t b1, float *y,
                                         int64_t N) {
    const int64_t words = (K + 1) / 2;
    for (int64_t b = b0; b < b1; b++) {
        const uint16_t *w = wb + b * K * DENSE_BLOCK;
        for (int64_t r0 = 0; r0 < R; r0 += PAIR_ROWS) {
            const uint32_t *xr = x16 + r0 * words;
            float *yr = y + r0 * N + b * DENSE_BLOCK;
            switch (R - r0 < PAIR_ROWS ? R - r0 : PAIR_ROWS) { /* the sums in registers */
            case 6: pair_pass(xr, words, 6, w, K, yr, N); break;
            case 5: pair_pass(xr, words, 5, w, K, yr, N); break;
            case 4: pair_pass(xr, words, 4, w, K, yr, N); break;
            case 3: pair_pass(xr, words, 3, w, K, yr, N); break;
            case 2: pair_pass(xr, words, 2, w, K, yr, N); break;
            default: pair_pass(xr, words, 1, w, K, yr, N); break;
            }
        }
    }
}

#endif

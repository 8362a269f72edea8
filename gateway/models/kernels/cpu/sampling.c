/* The sampler's draw: one token a row by inverting its CDF (sampling_ops.draw in the
 * worker computes the same with torch's ops).
 *
 * Per row of float32 logits x (temperature already applied): the weights
 * w = exp(x - max x), 0 below the row's threshold; the token is the first whose running sum
 * of weights exceeds u times their total. torch takes five passes over the row and three
 * [rows, vocab] temporaries; here the row is read twice, and a third time over one block:
 * the sums of blocks of DRAW_BLOCK weights (in double) locate the block where u * total
 * falls, whose weights are then summed one by one. A token below its row's threshold has
 * weight 0 (a NaN threshold keeps every token, as torch's comparison does). A row holding
 * NaN or +inf, or with no weight left, cannot be sampled (ok 0, token 0).
 */
#include "kernels.h"

#define VECTOR_BITS 256
#include "vector.h"
#undef VECTOR_BITS

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

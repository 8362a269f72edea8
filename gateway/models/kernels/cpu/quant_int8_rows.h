/* The few-row product of quant_int8.c for one path: included once per path with INT8_PATH
 * (avx2 or vnni) and INT8_TARGET (its target attribute) defined, it defines
 *   rows_<path>(...)   one row of W against every row of q.
 * The paths differ only in a group's integer sums (group_sums_<path>): 8 int32 lanes whose
 * total is sum_k q[k] code[k] (AVX2's 8-bit codes: sum_k q[k] (code[k] - 128)).
 * No include guard: each inclusion defines the other path's functions.
 */
#define INT8_CAT(a, b) a##_##b
#define INT8_NAME(a, b) INT8_CAT(a, b)

/* A group's 32 codes as 32 bytes in column order: 4-bit ones below 16; AVX2's 8-bit ones
 * as signed code - 128. */
INT8_TARGET static inline __attribute__((always_inline)) __m256i INT8_NAME(codes, INT8_PATH)(
        const uint8_t *p, int bits) {
    if (bits == 4) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(0x0F);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low),
                                _mm_and_si128(raw, low));
    }
    const __m256i c = _mm256_loadu_si256((const __m256i *)p);
    return INT8_NAME(shift_codes8, INT8_PATH)(c);
}

/* y[r][n] for rows r < R of q (R <= INT8_ROWS, a constant once inlined). */
INT8_TARGET static inline __attribute__((always_inline)) void INT8_NAME(dot_rows, INT8_PATH)(
        const int8_t *q, const float *d, int64_t K, int R, const uint8_t *codes,
        const float *scale, int bits, float *acc_out) {
    const int64_t groups = K / GROUP, group_bytes = bits == 4 ? 16 : 32;
    __m256 acc[INT8_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m256i c = INT8_NAME(codes, INT8_PATH)(codes + g * group_bytes, bits);
        const __m256 s = _mm256_broadcast_ss(scale + g);
        for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(q + r * K + g * GROUP));
            const __m256i sums = INT8_NAME(group_sums, INT8_PATH)(c, x, bits);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                     _mm256_mul_ps(s, _mm256_broadcast_ss(d + r * groups + g)),
                                     acc[r]);
        }
    }
    for (int r = 0; r < R; r++) acc_out[r] = hsum(acc[r]);
}

INT8_TARGET static void INT8_NAME(rows, INT8_PATH)(
        const int8_t *q, const float *d, const float *dsum, int64_t M, int64_t K,
        const uint8_t *codes, const float *scale, const float *minimum, int bits, float *y,
        int64_t N) {
    const int64_t groups = K / GROUP;
    for (int64_t m = 0; m < M; m += INT8_ROWS) {
        const int8_t *qm = q + m * K;
        const float *dm = d + m * groups;
        float sums[INT8_ROWS];
        const int R = M - m >= INT8_ROWS ? INT8_ROWS : (int)(M - m);
        switch (R) {
        case 4: INT8_NAME(dot_rows, INT8_PATH)(qm, dm, K, 4, codes, scale, bits, sums); break;
        case 3: INT8_NAME(dot_rows, INT8_PATH)(qm, dm, K, 3, codes, scale, bits, sums); break;
        case 2: INT8_NAME(dot_rows, INT8_PATH)(qm, dm, K, 2, codes, scale, bits, sums); break;
        default: INT8_NAME(dot_rows, INT8_PATH)(qm, dm, K, 1, codes, scale, bits, sums); break;
        }
        for (int r = 0; r < R; r++)
            y[(m + r) * N] = sums[r] + dot(minimum, dsum + (m + r) * groups, groups);
    }
}

#undef INT8_CAT
#undef INT8_NAME

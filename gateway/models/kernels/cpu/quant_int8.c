/* Products of x [M, K] float32 with a quantized weight W [N, K] (quant.h's layout, read as
 * it is: no second copy of the codes) through 8-bit activations. Each group of 32 columns
 * of a row of x is quantized to int8 with its own scale, d = max|x| / 127 and q = x / d
 * rounded to nearest (ties to even), and a group's product is an integer sum scaled once:
 *   sum_k x[k] w[k] ~ d (scale * sum_k q[k] code[k] + minimum * sum_k q[k]).
 * So y is exactly (up to the order of float32 sums) x's int8 approximation times W.
 *
 * Three paths compute the same integer sums, chosen by the caller (Python, which knows the
 * instruction-set level GATEWAY_CPU_ISA allows):
 *   VNNI   AVX-512 VNNI's vpdpbusd at 256 bits: unsigned codes times signed q, four
 *          products added into each int32 lane, one instruction a group and row of x;
 *   AVX2   vpmaddubsw (pairs into int16) then vpmaddwd (into int32). The 4-bit codes
 *          (below 16) times q cannot saturate an int16 pair; 8-bit codes (below 256) can,
 *          so they are made signed (code - 128, minimum + 128 scale) and multiplied as
 *          |code - 128| times q with the code's sign, at most 128 * 127 * 2 a pair;
 *   scalar plain C, the same sums (for the tests, and any path the CPU lacks).
 * Threads split W's rows as quant_matmul.c's few-row product does.
 */
#include "quant.h"

enum { INT8_SCALAR = 1, INT8_AVX2 = 2, INT8_VNNI = 3 };

#define KERNEL_VNNI \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* Products smaller than this (multiply-adds) run on the calling thread alone. */
#define INT8_PARALLEL_WORK (1 << 20)

/* The paths this CPU runs, as a bit mask (1 << path). */
int gw_int8_paths(void) {
    __builtin_cpu_init();
    int paths = 1 << INT8_SCALAR;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
            && __builtin_cpu_supports("f16c"))
        paths |= 1 << INT8_AVX2;
    if ((paths & (1 << INT8_AVX2)) && __builtin_cpu_supports("avx512f")
            && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
            && __builtin_cpu_supports("avx512vnni"))
        paths |= 1 << INT8_VNNI;
    return paths;
}

/* ---- x quantized: q [count * 32] int8, d [count] the groups' scales, dsum [count]
 * d * sum q (the minimum's factor) ---- */

static void quantize_scalar(const float *x, int64_t count, int8_t *q, float *d, float *dsum) {
    for (int64_t i = 0; i < count; i++) {
        const float *p = x + i * GROUP;
        float amax = 0.0f;
        for (int k = 0; k < GROUP; k++) amax = fmaxf(amax, fabsf(p[k]));
        const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        int sum = 0;
        for (int k = 0; k < GROUP; k++) {
            const int v = (int)nearbyintf(p[k] * inverse);
            q[i * GROUP + k] = (int8_t)v;
            sum += v;
        }
        d[i] = scale;
        dsum[i] = scale * (float)sum;
    }
}

KERNEL static inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* As quantize_scalar: the same float32 operations, rounded by the default MXCSR mode
 * (nearest, ties to even, as nearbyintf). */
KERNEL static void quantize_avx2(const float *x, int64_t count, int8_t *q, float *d,
                                 float *dsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < count; i++) {
        const float *p = x + i * GROUP;
        __m256 v[4];
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(p + 8 * j);
        __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]),
                                               _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]),
                                               _mm256_andnot_ps(sign, v[3])));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float amax = _mm_cvtss_f32(m);
        const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        const __m256 mul = _mm256_set1_ps(inverse);
        __m256i n[4];
        for (int j = 0; j < 4; j++) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], mul));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]),
                                               _mm256_add_epi32(n[2], n[3]));
        /* packs interleave the 128-bit lanes; the permute puts the columns back in order */
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]),
                                                  _mm256_packs_epi32(n[2], n[3]));
        _mm256_storeu_si256((__m256i *)(q + i * GROUP),
                            _mm256_permutevar8x32_epi32(packed, order));
        d[i] = scale;
        dsum[i] = scale * (float)hsum_epi32(total);
    }
}

/* ---- The products ---- */

/* y[r][n] of rows r < R of q (R <= INT8_ROWS) and one row of W, plain C. */
static void dot_rows_scalar(const int8_t *q, const float *d, const float *dsum, int64_t K,
                            int R, const uint8_t *codes, const float *scale,
                            const float *minimum, int bits, float *y, int64_t N) {
    const int64_t groups = K / GROUP, group_bytes = bits == 4 ? 16 : 32;
    for (int r = 0; r < R; r++) {
        float total = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *c = codes + g * group_bytes;
            const int8_t *qg = q + r * K + g * GROUP;
            int sum = 0;
            for (int k = 0; k < GROUP; k++) {
                const int code = bits == 4 ? (k < 16 ? c[k] & 15 : c[k - 16] >> 4) : c[k];
                sum += code * qg[k];
            }
            total += (float)sum * (scale[g] * d[r * groups + g]);
        }
        for (int64_t g = 0; g < groups; g++) total += minimum[g] * dsum[r * groups + g];
        y[r * N] = total;
    }
}

#define INT8_ROWS 4 /* rows of x sharing one unpacking of a group's codes */

/* A group's 8-bit codes as each path multiplies them: AVX2's signed (code - 128). */
KERNEL static inline __m256i shift_codes8_avx2(__m256i c) {
    return _mm256_xor_si256(c, _mm256_set1_epi8((char)0x80));
}
KERNEL_VNNI static inline __m256i shift_codes8_vnni(__m256i c) { return c; }

/* 8 int32 lanes adding up to a group's sum of codes c times q x. */
KERNEL static inline __attribute__((always_inline)) __m256i group_sums_avx2(__m256i c,
                                                                            __m256i x,
                                                                            int bits) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (bits == 4) return _mm256_madd_epi16(_mm256_maddubs_epi16(c, x), ones);
    /* |code - 128| (at most 128, unsigned) times q (at most 127 in magnitude) with the
     * code's sign: pairs within an int16, and no int8 negation can overflow */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c),
                                                  _mm256_sign_epi8(x, c)), ones);
}
KERNEL_VNNI static inline __attribute__((always_inline)) __m256i group_sums_vnni(__m256i c,
                                                                                 __m256i x,
                                                                                 int bits) {
    (void)bits;
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, x);
}

/* The AVX2 and VNNI few-row products: the same loop around each path's group sums. */
#define INT8_PATH avx2
#define INT8_TARGET KERNEL
#include "quant_int8_rows.h"
#undef INT8_PATH
#undef INT8_TARGET
#define INT8_PATH vnni
#define INT8_TARGET KERNEL_VNNI
#include "quant_int8_rows.h"
#undef INT8_PATH
#undef INT8_TARGET

/* One weight row n against every row of q, by path. */
static void product_row(int path, const int8_t *q, const float *d, const float *dsum,
                        int64_t M, int64_t K, const uint8_t *row_codes, const float *scale,
                        const float *minimum, int bits, float *y, int64_t N) {
    switch (path) {
    case INT8_VNNI: rows_vnni(q, d, dsum, M, K, row_codes, scale, minimum, bits, y, N); break;
    case INT8_AVX2: rows_avx2(q, d, dsum, M, K, row_codes, scale, minimum, bits, y, N); break;
    default:
        for (int64_t m = 0; m < M; m += INT8_ROWS) {
            const int R = M - m >= INT8_ROWS ? INT8_ROWS : (int)(M - m);
            dot_rows_scalar(q + m * K, d + m * (K / GROUP), dsum + m * (K / GROUP), K, R,
                            row_codes, scale, minimum, bits, y + m * N, N);
        }
    }
}

/* y [M, N] = x [M, K] W^T through 8-bit activations on `path` (INT8_*), x and y float32
 * and contiguous, K a multiple of 32. 0; -1 where memory ran out; -2 where this CPU lacks
 * the path or the arguments do not fit (y untouched). */
KERNEL int gw_quant_matmul_int8(const float *x, int64_t M, int64_t K, const uint8_t *codes,
                                const uint16_t *scales, const uint16_t *minimums,
                                int64_t N, int bits, float *y, int path) {
    if (path < INT8_SCALAR || path > INT8_VNNI || !(gw_int8_paths() & (1 << path)) || M < 1
            || K % GROUP || (bits != 4 && bits != 8))
        return -2;
    const int64_t groups = K / GROUP, group_bytes = bits == 4 ? 16 : 32;
    int8_t *q = malloc((size_t)(M * K) + sizeof(float) * (size_t)(2 * M * groups));
    if (q == NULL) return -1;
    float *d = (float *)(void *)(q + M * K), *dsum = d + M * groups; /* K % 32 == 0: aligned */
    if (path == INT8_SCALAR) quantize_scalar(x, M * groups, q, d, dsum);
    else quantize_avx2(x, M * groups, q, d, dsum);
    /* the AVX2 path reads 8-bit codes as code - 128: their minimum grows by 128 scale */
    const int shifted = path == INT8_AVX2 && bits == 8;
    int failed = 0;
    #pragma omp parallel if (M * N * K >= INT8_PARALLEL_WORK)
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
            for (int64_t g = 0; g < groups; g++) {
                scale[g] = _cvtsh_ss(scales[n * groups + g]);
                minimum[g] = _cvtsh_ss(minimums[n * groups + g]);
                if (shifted) minimum[g] += 128.0f * scale[g];
            }
            const uint8_t *row_codes = codes + n * groups * group_bytes;
            prefetch_ahead(row_codes, groups * group_bytes);
            product_row(path, q, d, dsum, M, K, row_codes, scale, minimum, bits, y + n, N);
        }
        free(row_params);
    }
    free(q);
    return failed ? -1 : 0;
}

/* x [M, K] quantized as the products quantize it, on `path`: q [M, K] int8, d and dsum
 * [M, K / 32] (for the tests). 0, or -2 where this CPU lacks the path. */
KERNEL int gw_quantize_int8(const float *x, int64_t M, int64_t K, int8_t *q, float *d,
                            float *dsum, int path) {
    if (path < INT8_SCALAR || path > INT8_VNNI || !(gw_int8_paths() & (1 << path))
            || K % GROUP)
        return -2;
    if (path == INT8_SCALAR) quantize_scalar(x, M * (K / GROUP), q, d, dsum);
    else quantize_avx2(x, M * (K / GROUP), q, d, dsum);
    return 0;
}

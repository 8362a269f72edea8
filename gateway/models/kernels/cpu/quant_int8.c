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
 *   scalar plain C, the same sums: the reference the tests hold the others to (the
 *          library itself needs AVX2, so Python picks AVX2 at least).
 * Threads split W's rows (or blocks of them, below) as quant_matmul.c's products do.
 * A NaN or infinity in a group of x is not carried to y as the float32 kernels carry it:
 * the group's scale is then infinite and its codes meaningless.
 */
#include "quant_int8.h"

/* Products smaller than this (multiply-adds) run on the calling thread alone. */
#define INT8_PARALLEL_WORK (1 << 20)

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

/* ---- Many rows of x: lanes across rows of W ----
 *
 * From INT8_BLOCK_ROWS rows of x on, the codes of a block of W's rows (16 for VNNI at 512
 * bits, 8 for AVX2) are laid out once for all of x: per group, 8 vectors, vector j's
 * 32-bit lane i holding row i's codes of columns 4j .. 4j + 3 (a transpose of 32-bit
 * words, then the nibbles split). A row of x then meets the block's rows in 8 dot products
 * of 4 byte pairs a lane, x's 4 values broadcast to every lane, and the scale, minimum and
 * output run 16 (or 8) rows of W a vector: no horizontal sums. The block stays in the L1
 * cache (K bytes a row of W). 4-bit AVX2 sums the 8 products of a lane in int16 (each at
 * most 2 * 15 * 127, 8 of them below 32768) before one vpmaddwd; 8-bit codes on AVX2 take
 * the row-by-row product above. */
#ifndef INT8_BLOCK_ROWS
#define INT8_BLOCK_ROWS 4 /* rows of x from which the blocked product runs */
#endif
#define INT8_PASS_ROWS 8 /* rows of x a pass over the block's groups keeps in registers */

typedef int32_t __attribute__((may_alias, aligned(1))) int8x4;

/* The 4 x 4 transpose of 32-bit words within each 128-bit lane: word k of row j (z[j])
 * becomes word j of d[k]. */
#define TRANSPOSE4(W, z, d)                                                                 \
    do {                                                                                    \
        const W t0 = UNPACKLO32(z[0], z[1]), t1 = UNPACKHI32(z[0], z[1]);                   \
        const W t2 = UNPACKLO32(z[2], z[3]), t3 = UNPACKHI32(z[2], z[3]);                   \
        d[0] = UNPACKLO64(t0, t2), d[1] = UNPACKHI64(t0, t2);                               \
        d[2] = UNPACKLO64(t1, t3), d[3] = UNPACKHI64(t1, t3);                               \
    } while (0)

/* Rows n0 .. n0 + 15 of W as block vectors, w [groups][8]; their scales and minimums
 * [groups][16] as floats. */
KERNEL_VNNI static void block_codes_vnni(const uint8_t *codes, const uint16_t *scales,
                                         const uint16_t *minimums, int64_t groups, int bits,
                                         int64_t n0, __m512i *w, float *scale,
                                         float *minimum) {
#define UNPACKLO32 _mm512_unpacklo_epi32
#define UNPACKHI32 _mm512_unpackhi_epi32
#define UNPACKLO64 _mm512_unpacklo_epi64
#define UNPACKHI64 _mm512_unpackhi_epi64
    const int64_t group_bytes = bits == 4 ? 16 : 32, row_bytes = groups * group_bytes;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t half = 0; half < group_bytes / 16; half++) {
            __m512i z[4], d[4];
            for (int j = 0; j < 4; j++) {  /* lane L: row j + 4 L */
                const uint8_t *p = codes + (n0 + j) * row_bytes + g * group_bytes + half * 16;
                __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
                for (int L = 1; L < 4; L++)
                    v = _mm512_inserti32x4(
                        v, _mm_loadu_si128((const __m128i *)(p + 4 * L * row_bytes)), L);
                z[j] = v;
            }
            TRANSPOSE4(__m512i, z, d);  /* d[k] lane 4 L + j: row j + 4 L's word k */
            for (int k = 0; k < 4; k++) {
                if (bits == 4) {
                    w[g * 8 + k] = _mm512_and_si512(d[k], low);
                    w[g * 8 + 4 + k] = _mm512_and_si512(_mm512_srli_epi16(d[k], 4), low);
                } else {
                    w[g * 8 + half * 4 + k] = d[k];
                }
            }
        }
        for (int i = 0; i < 16; i++) {
            scale[g * 16 + i] = _cvtsh_ss(scales[(n0 + i) * groups + g]);
            minimum[g * 16 + i] = _cvtsh_ss(minimums[(n0 + i) * groups + g]);
        }
    }
#undef UNPACKLO32
#undef UNPACKHI32
#undef UNPACKLO64
#undef UNPACKHI64
}

/* y[r][n0 .. n0 + 15] for rows r < R of q (R <= INT8_PASS_ROWS, a constant once inlined). */
KERNEL_VNNI static inline __attribute__((always_inline)) void block_dots_vnni(
        const __m512i *w, const float *scale, const float *minimum, const int8_t *q,
        const float *d, const float *dsum, int64_t K, int R, float *y, int64_t N) {
    const int64_t groups = K / GROUP;
    __m512 acc[INT8_PASS_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m512 s = _mm512_loadu_ps(scale + g * 16), mn = _mm512_loadu_ps(minimum + g * 16);
        for (int r = 0; r < R; r++) {
            const int8x4 *x = (const int8x4 *)(q + r * K + g * GROUP);
            __m512i sum = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++)
                sum = _mm512_dpbusd_epi32(sum, w[g * 8 + j], _mm512_set1_epi32(x[j]));
            const __m512 f = _mm512_mul_ps(s, _mm512_set1_ps(d[r * groups + g]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), f, acc[r]);
            acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(dsum[r * groups + g]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * N, acc[r]);
}

/* Rows n0 .. n0 + 7 of W as AVX2 block vectors (4-bit codes), as block_codes_vnni. */
KERNEL static void block_codes_avx2(const uint8_t *codes, const uint16_t *scales,
                                    const uint16_t *minimums, int64_t groups, int64_t n0,
                                    __m256i *w, float *scale, float *minimum) {
#define UNPACKLO32 _mm256_unpacklo_epi32
#define UNPACKHI32 _mm256_unpackhi_epi32
#define UNPACKLO64 _mm256_unpacklo_epi64
#define UNPACKHI64 _mm256_unpackhi_epi64
    const int64_t row_bytes = groups * 16;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        __m256i z[4], d[4];
        for (int j = 0; j < 4; j++) {  /* lane L: row j + 4 L */
            const uint8_t *p = codes + (n0 + j) * row_bytes + g * 16;
            z[j] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p + 4 * row_bytes)),
                                    _mm_loadu_si128((const __m128i *)p));
        }
        TRANSPOSE4(__m256i, z, d);
        for (int k = 0; k < 4; k++) {
            w[g * 8 + k] = _mm256_and_si256(d[k], low);
            w[g * 8 + 4 + k] = _mm256_and_si256(_mm256_srli_epi16(d[k], 4), low);
        }
        for (int i = 0; i < 8; i++) {
            scale[g * 8 + i] = _cvtsh_ss(scales[(n0 + i) * groups + g]);
            minimum[g * 8 + i] = _cvtsh_ss(minimums[(n0 + i) * groups + g]);
        }
    }
#undef UNPACKLO32
#undef UNPACKHI32
#undef UNPACKLO64
#undef UNPACKHI64
}

/* y[r][n0 .. n0 + 7] for rows r < R of q, 4-bit codes (R <= INT8_PASS_ROWS). */
KERNEL static inline __attribute__((always_inline)) void block_dots_avx2(
        const __m256i *w, const float *scale, const float *minimum, const int8_t *q,
        const float *d, const float *dsum, int64_t K, int R, float *y, int64_t N) {
    const int64_t groups = K / GROUP;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[INT8_PASS_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m256 s = _mm256_loadu_ps(scale + g * 8), mn = _mm256_loadu_ps(minimum + g * 8);
        for (int r = 0; r < R; r++) {
            const int8x4 *x = (const int8x4 *)(q + r * K + g * GROUP);
            __m256i sum = _mm256_maddubs_epi16(w[g * 8], _mm256_set1_epi32(x[0]));
            for (int j = 1; j < 8; j++)
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[g * 8 + j],
                                                                 _mm256_set1_epi32(x[j])));
            const __m256 f = _mm256_mul_ps(s, _mm256_broadcast_ss(d + r * groups + g));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones)), f,
                                     acc[r]);
            acc[r] = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(dsum + r * groups + g), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * N, acc[r]);
}

#define PASS_CASES(CALL)                                                                   \
    switch (R) {                                                                           \
    case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break;               \
    case 5: CALL(5); break; case 4: CALL(4); break; case 3: CALL(3); break;               \
    case 2: CALL(2); break; default: CALL(1); break;                                       \
    }

KERNEL_VNNI static void block_product_vnni(const uint8_t *codes, const uint16_t *scales,
                                           const uint16_t *minimums, int bits, int64_t n0,
                                           const int8_t *q, const float *d, const float *dsum,
                                           int64_t M, int64_t K, void *buffer, float *y,
                                           int64_t N) {
    const int64_t groups = K / GROUP;
    __m512i *w = buffer;
    float *scale = (float *)(w + groups * 8), *minimum = scale + groups * 16;
    block_codes_vnni(codes, scales, minimums, groups, bits, n0, w, scale, minimum);
    for (int64_t m = 0; m < M; m += INT8_PASS_ROWS) {
        const int R = M - m >= INT8_PASS_ROWS ? INT8_PASS_ROWS : (int)(M - m);
#define CALL(R) block_dots_vnni(w, scale, minimum, q + m * K, d + m * groups, \
                                dsum + m * groups, K, R, y + m * N + n0, N)
        PASS_CASES(CALL)
#undef CALL
    }
}

KERNEL static void block_product_avx2(const uint8_t *codes, const uint16_t *scales,
                                      const uint16_t *minimums, int64_t n0, const int8_t *q,
                                      const float *d, const float *dsum, int64_t M, int64_t K,
                                      void *buffer, float *y, int64_t N) {
    const int64_t groups = K / GROUP;
    __m256i *w = buffer;
    float *scale = (float *)(w + groups * 8), *minimum = scale + groups * 8;
    block_codes_avx2(codes, scales, minimums, groups, n0, w, scale, minimum);
    for (int64_t m = 0; m < M; m += INT8_PASS_ROWS) {
        const int R = M - m >= INT8_PASS_ROWS ? INT8_PASS_ROWS : (int)(M - m);
#define CALL(R) block_dots_avx2(w, scale, minimum, q + m * K, d + m * groups, \
                                dsum + m * groups, K, R, y + m * N + n0, N)
        PASS_CASES(CALL)
#undef CALL
    }
}

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
    /* W's rows below `blocked` run in blocks of `block` (lanes across rows), the rest one
     * by one */
    const int64_t block = path == INT8_VNNI ? 16 : 8;
    const int64_t blocked = M >= INT8_BLOCK_ROWS && (path == INT8_VNNI
        || (path == INT8_AVX2 && bits == 4)) ? N / block * block : 0;
    const int64_t tasks = blocked / block + (N - blocked);
    const size_t buffer_bytes = blocked ? (size_t)(groups * (8 * block * 4 + 2 * block * 4))
                                        : sizeof(float) * (size_t)(2 * groups);
    int failed = 0;
    #pragma omp parallel if (M * N * K >= INT8_PARALLEL_WORK)
    {
        void *buffer = aligned_alloc(64, (buffer_bytes + 63) / 64 * 64);
        float *row_params = malloc(sizeof(float) * (size_t)(2 * groups));
        if (buffer == NULL || row_params == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            if (buffer == NULL || row_params == NULL) continue;
            if (t < blocked / block) {
                if (path == INT8_VNNI)
                    block_product_vnni(codes, scales, minimums, bits, t * block, q, d, dsum,
                                       M, K, buffer, y, N);
                else
                    block_product_avx2(codes, scales, minimums, t * block, q, d, dsum, M, K,
                                       buffer, y, N);
                continue;
            }
            const int64_t n = blocked + (t - blocked / block);
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
        free(buffer);
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

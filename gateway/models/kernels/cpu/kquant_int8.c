/* Products of x [M, K] float32 with a weight W [N, K] in its GGUF file's Q4_K, Q5_K or
 * Q6_K blocks (kquant.h, read as the file holds them) through 8-bit activations, as
 * quant_int8.c does for Q4_0, Q4_1 and Q8_0. Each 256 columns of a row of x (one
 * super-block of W) are quantized to int8 with one scale, dx = max|x| / 127 and q = x / dx
 * rounded to nearest (ties to even), and the sums of q per 16 columns are kept. A
 * super-block's sub-block scales are small integers (6 bits for Q4_K and Q5_K, int8 for
 * Q6_K), so all of its products with a row of x are one integer sum, scaled once:
 *   Q4_K, Q5_K  w = d sc[j] code - dmin m[j], sub-blocks j of 32 columns, codes 0..15 or
 *               0..31:  sum_k x w ~ dx (d sum_j sc[j] sum code q - dmin sum_j m[j] sum q)
 *   Q6_K        w = d sc[j] (code - 32), sub-blocks of 16, codes 0..63:
 *               sum_k x w ~ dx d (sum_j sc[j] sum code q - 32 sum_j sc[j] sum q)
 * So y is exactly (up to float32 sums and their order) x's int8 approximation times W.
 *
 * Each row of W is unpacked once for every row of x into a buffer that stays in the L1
 * cache (a tile of rows of W at a time), alike for the three types, so that the product
 * loops have no per-type bit work:
 *   codes [K]         uint8, one a column;
 *   pair_scales [K/2] int16, the integer scale of columns 2i and 2i + 1 (one sub-block);
 *   mins [K/16]       int16, per 16 columns the integer factor of their sum of q
 *                     (Q4_K, Q5_K: m[j], for both halves of a sub-block; Q6_K: -32 sc[j]);
 *   d, dm [K/256]     float, the factors of the code sums and of the mins' sums (Q4_K,
 *                     Q5_K: d and -dmin; Q6_K: d, the mins' sums then added as integers).
 * vpmaddubsw multiplies a column pair's codes with q and adds the two products into an
 * int16; the pair's scale multiplies that as an int16 into int32 lanes. Paths:
 *   VNNI   at 512 bits, vpdpwssd: the scale's multiply and the int32 addition in one
 *          instruction (vpdpbusd would sum four columns a lane before any scale, and a
 *          Q6_K scale covers only 16), 64 columns a vpmaddubsw;
 *   AVX2   vpmaddwd by the scales then vpaddd, 32 columns a vpmaddubsw;
 *   scalar plain C, the same integer sums: the reference the tests hold the others to.
 * Nothing overflows: a pair of products is at most 2 * 63 * 127 = 16002 in an int16 (q is
 * within +-127); a super-block's sum at most 256 * 63 * 127 * 128 + 16 * 4096 * 2032,
 * below 2^29, in an int32. Threads split W's rows, a tile of KQ_INT8_TILE at a time.
 * A NaN or infinity in 256 columns of x is not carried to y as the float32 kernels carry
 * it: the block's scale is then infinite and its codes meaningless.
 */
#include "kquant.h"
#include "quant_int8.h"

#define SUPER 256 /* columns of a K-quant super-block, and of x's int8 blocks */

/* Products smaller than this (multiply-adds) run on the calling thread alone. */
#define KQ_INT8_PARALLEL_WORK (1 << 20)
#define KQ_INT8_ROWS 4 /* rows of x sharing each load of a row's codes and scales */
#define KQ_INT8_TILE 8 /* rows of W unpacked at once, a thread's unit of work */

static int is_kquant(int64_t type) {
    return type == GW_Q4_K || type == GW_Q5_K || type == GW_Q6_K;
}

/* ---- x quantized: q [count * 256] int8, dx [count] the blocks' scales, bsum
 * [count * 16] the sums of q per 16 columns ---- */

static void quantize_scalar(const float *x, int64_t count, int8_t *q, float *dx,
                            int16_t *bsum) {
    for (int64_t i = 0; i < count; i++) {
        const float *p = x + i * SUPER;
        float amax = 0.0f;
        for (int k = 0; k < SUPER; k++) amax = fmaxf(amax, fabsf(p[k]));
        const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        for (int g = 0; g < SUPER / 16; g++) {
            int sum = 0;
            for (int k = 16 * g; k < 16 * g + 16; k++) {
                const int v = (int)nearbyintf(p[k] * inverse);
                q[i * SUPER + k] = (int8_t)v;
                sum += v;
            }
            bsum[i * 16 + g] = (int16_t)sum;
        }
        dx[i] = scale;
    }
}

/* As quantize_scalar: the same float32 operations, rounded by the default MXCSR mode
 * (nearest, ties to even, as nearbyintf). */
KERNEL static void quantize_avx2(const float *x, int64_t count, int8_t *q, float *dx,
                                 int16_t *bsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < count; i++) {
        const float *p = x + i * SUPER;
        __m256 a = _mm256_setzero_ps();
        for (int k = 0; k < SUPER; k += 8)
            a = _mm256_max_ps(a, _mm256_andnot_ps(sign, _mm256_loadu_ps(p + k)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float amax = _mm_cvtss_f32(m);
        const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        const __m256 mul = _mm256_set1_ps(inverse);
        for (int k = 0; k < SUPER; k += 32) {
            __m256i n[4];
            for (int j = 0; j < 4; j++)
                n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + k + 8 * j), mul));
            bsum[i * 16 + k / 16] = (int16_t)hsum_epi32(_mm256_add_epi32(n[0], n[1]));
            bsum[i * 16 + k / 16 + 1] = (int16_t)hsum_epi32(_mm256_add_epi32(n[2], n[3]));
            /* packs interleave the 128-bit lanes; the permute puts the columns back */
            const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]),
                                                      _mm256_packs_epi32(n[2], n[3]));
            _mm256_storeu_si256((__m256i *)(q + i * SUPER + k),
                                _mm256_permutevar8x32_epi32(packed, order));
        }
        dx[i] = scale;
    }
}

/* ---- A row of W unpacked (see the top) ---- */

typedef struct {
    uint8_t *codes;
    int16_t *pair_scales, *mins;
    float *d, *dm;
} unpacked_row;

/* The buffer's bytes for K columns (64-byte aligned parts: K is a multiple of 256). */
static size_t row_buffer_bytes(int64_t K) {
    return (size_t)(K + K + K / 8 + 2 * (K / SUPER) * 4);
}

static unpacked_row row_in(void *buffer, int64_t K) {
    unpacked_row u;
    u.codes = buffer;
    u.pair_scales = (int16_t *)(void *)(u.codes + K);
    u.mins = u.pair_scales + K / 2;
    u.d = (float *)(void *)(u.mins + K / 16);
    u.dm = u.d + K / SUPER;
    return u;
}

/* Super-block b's factors, scales and mins (both ways of unpacking share them). */
KERNEL static void unpack_params(int type, const uint8_t *blk, int64_t b, unpacked_row u) {
    int16_t *ps = u.pair_scales + b * (SUPER / 2), *mn = u.mins + b * 16;
    /* word j of v copied to every word: a byte shuffle picking bytes 2j and 2j + 1 */
#define WORD(j) _mm_set1_epi16((short)(((2 * (j) + 1) << 8) | (2 * (j))))
    if (type == GW_Q6_K) {
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        u.d[b] = u.dm[b] = half_at(blk + 208);
        const __m128i lo = _mm_cvtepi8_epi16(sc), hi = _mm_cvtepi8_epi16(_mm_srli_si128(sc, 8));
        for (int j = 0; j < 8; j++) {
            _mm_storeu_si128((__m128i *)(ps + 8 * j), _mm_shuffle_epi8(lo, WORD(j)));
            _mm_storeu_si128((__m128i *)(ps + 64 + 8 * j), _mm_shuffle_epi8(hi, WORD(j)));
        }
        /* -32 sc, as 16 int16 (|sc| <= 128) */
        _mm256_storeu_si256((__m256i *)mn, _mm256_sub_epi16(
            _mm256_setzero_si256(), _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), 5)));
    } else {
        uint8_t sc[8], m[8];
        kq_scales_mins(blk + 4, sc, m);
        u.d[b] = half_at(blk);
        u.dm[b] = -half_at(blk + 2);
        const __m256i s = _mm256_broadcastsi128_si256(
            _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
        for (int j = 0; j < 8; j++)
            _mm256_storeu_si256((__m256i *)(ps + 16 * j),
                                _mm256_shuffle_epi8(s, _mm256_broadcastsi128_si256(WORD(j))));
        /* each minimum for both halves of its sub-block of 32 */
        const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)m));
        _mm_storeu_si128((__m128i *)mn, _mm_unpacklo_epi16(v, v));
        _mm_storeu_si128((__m128i *)(mn + 8), _mm_unpackhi_epi16(v, v));
    }
#undef WORD
}

/* The codes of a row, plain C (the tests' reference for unpack_avx2's bit work). */
KERNEL static void unpack_scalar(int type, const uint8_t *row, int64_t K, unpacked_row u) {
    const int64_t bytes = kq_block_bytes(type);
    for (int64_t b = 0; b < K / SUPER; b++) {
        const uint8_t *blk = row + b * bytes;
        uint8_t *c = u.codes + b * SUPER;
        unpack_params(type, blk, b, u);
        if (type == GW_Q6_K) {
            for (int half = 0; half < 2; half++) {
                const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
                uint8_t *ch = c + 128 * half;
                for (int l = 0; l < 32; l++) {
                    ch[l] = (uint8_t)((ql[l] & 15) | ((qh[l] & 3) << 4));
                    ch[l + 32] = (uint8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                    ch[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    ch[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
        } else {  /* 64 columns j: sub-blocks 2j (low nibbles) and 2j + 1 (high ones) */
            const uint8_t *qs = blk + (type == GW_Q4_K ? 16 : 48), *qh = blk + 16;
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) {
                    int lo = qs[32 * j + l] & 15, hi = qs[32 * j + l] >> 4;
                    if (type == GW_Q5_K) {
                        lo |= ((qh[l] >> (2 * j)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                    }
                    c[64 * j + l] = (uint8_t)lo;
                    c[64 * j + 32 + l] = (uint8_t)hi;
                }
        }
    }
}

/* As unpack_scalar, 32 columns a vector. Byte shifts are 16-bit ones masked after: the
 * masks drop what crosses from the neighbouring byte. */
KERNEL static void unpack_avx2(int type, const uint8_t *row, int64_t K, unpacked_row u) {
    const int64_t bytes = kq_block_bytes(type);
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3),
                  one = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < K / SUPER; b++) {
        const uint8_t *blk = row + b * bytes;
        __m256i *c = (__m256i *)(void *)(u.codes + b * SUPER);
        unpack_params(type, blk, b, u);
        if (type == GW_Q6_K) {
            for (int half = 0; half < 2; half++) {
                const __m256i a0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * half));
                const __m256i a1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * half + 32));
                const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
#define HIGH2(s) _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, s), low2), 4)
                c[4 * half] = _mm256_or_si256(_mm256_and_si256(a0, low4), HIGH2(0));
                c[4 * half + 1] = _mm256_or_si256(_mm256_and_si256(a1, low4), HIGH2(2));
                c[4 * half + 2] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(a0, 4), low4), HIGH2(4));
                c[4 * half + 3] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(a1, 4), low4), HIGH2(6));
#undef HIGH2
            }
        } else {
            const uint8_t *qs = blk + (type == GW_Q4_K ? 16 : 48);
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
            for (int j = 0; j < 4; j++) {
                const __m256i a = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                __m256i lo = _mm256_and_si256(a, low4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(a, 4), low4);
                if (type == GW_Q5_K) {
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(
                        _mm256_and_si256(_mm256_srli_epi16(h, 2 * j), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                        _mm256_and_si256(_mm256_srli_epi16(h, 2 * j + 1), one), 4));
                }
                c[2 * j] = lo;
                c[2 * j + 1] = hi;
            }
        }
    }
}

/* ---- The products of one unpacked row of W with rows of x ---- */

/* y[r * N] for the `rows` rows of q from the first, plain C. Q6_K (combine) adds the
 * mins' sums to the code sums as integers: both are scaled by d. */
static void dots_scalar(unpacked_row u, int combine, const int8_t *q, const float *dx,
                        const int16_t *bsum, int64_t rows, int64_t K, float *y, int64_t N) {
    const int64_t blocks = K / SUPER;
    for (int64_t r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *c = u.codes + b * SUPER;
            const int8_t *qb = q + r * K + b * SUPER;
            const int16_t *ps = u.pair_scales + b * (SUPER / 2);
            int sum = 0, msum = 0;
            for (int i = 0; i < SUPER / 2; i++)
                sum += ps[i] * (c[2 * i] * qb[2 * i] + c[2 * i + 1] * qb[2 * i + 1]);
            for (int g = 0; g < 16; g++)
                msum += u.mins[b * 16 + g] * bsum[(r * blocks + b) * 16 + g];
            const float t = combine ? (float)(sum + msum) * u.d[b]
                                    : (float)sum * u.d[b] + (float)msum * u.dm[b];
            total += t * dx[r * blocks + b];
        }
        y[r * N] = total;
    }
}

/* acc (8 float lanes) += super-block b's scaled sums, from its code sums in 8 int32 lanes;
 * the mins' sums (16 int16 mins times 16 int16 sums of q) go in here. The factors are
 * broadcast from memory (loads, no shuffles) and x's scale dx applied last, once. */
KERNEL static inline __attribute__((always_inline)) __m256 block_total(
        unpacked_row u, int combine, int64_t b, __m256i sum, const int16_t *bsum,
        const float *dx, __m256 acc) {
    const __m256i m = _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(u.mins + b * 16)),
                                        _mm256_loadu_si256((const __m256i *)bsum));
    __m256 t;
    if (combine) {
        t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(sum, m)),
                          _mm256_broadcast_ss(u.d + b));
    } else {
        t = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(u.d + b));
        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_broadcast_ss(u.dm + b), t);
    }
    return _mm256_fmadd_ps(t, _mm256_broadcast_ss(dx), acc);
}

/* y[r * N] for rows r < R of q (R <= KQ_INT8_ROWS, a constant once inlined), AVX2. */
KERNEL static inline __attribute__((always_inline)) void dots_avx2(
        unpacked_row u, int combine, const int8_t *q, const float *dx, const int16_t *bsum,
        int R, int64_t K, float *y, int64_t N) {
    const int64_t blocks = K / SUPER;
    __m256 acc[KQ_INT8_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i sum[KQ_INT8_ROWS];
        for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256();
        for (int j = 0; j < SUPER / 32; j++) {
            const __m256i c = _mm256_load_si256((const __m256i *)(u.codes + b * SUPER) + j);
            const __m256i s = _mm256_load_si256(
                (const __m256i *)(u.pair_scales + b * (SUPER / 2)) + j);
            for (int r = 0; r < R; r++) {
                const __m256i x = _mm256_loadu_si256(
                    (const __m256i *)(q + r * K + b * SUPER) + j);
                sum[r] = _mm256_add_epi32(
                    sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(c, x), s));
            }
        }
        for (int r = 0; r < R; r++)
            acc[r] = block_total(u, combine, b, sum[r], bsum + (r * blocks + b) * 16,
                                 dx + r * blocks + b, acc[r]);
    }
    for (int r = 0; r < R; r++) y[r * N] = hsum(acc[r]);
}

/* As dots_avx2, 64 columns a step with VNNI's vpdpwssd. */
KERNEL_VNNI static inline __attribute__((always_inline)) void dots_vnni(
        unpacked_row u, int combine, const int8_t *q, const float *dx, const int16_t *bsum,
        int R, int64_t K, float *y, int64_t N) {
    const int64_t blocks = K / SUPER;
    __m256 acc[KQ_INT8_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sum[KQ_INT8_ROWS];
        for (int r = 0; r < R; r++) sum[r] = _mm512_setzero_si512();
        for (int j = 0; j < SUPER / 64; j++) {
            const __m512i c = _mm512_load_si512((const __m512i *)(u.codes + b * SUPER) + j);
            const __m512i s = _mm512_load_si512(
                (const __m512i *)(u.pair_scales + b * (SUPER / 2)) + j);
            for (int r = 0; r < R; r++) {
                const __m512i x = _mm512_loadu_si512(
                    (const __m512i *)(q + r * K + b * SUPER) + j);
                sum[r] = _mm512_dpwssd_epi32(sum[r], _mm512_maddubs_epi16(c, x), s);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(sum[r]),
                                                  _mm512_extracti64x4_epi64(sum[r], 1));
            acc[r] = block_total(u, combine, b, half, bsum + (r * blocks + b) * 16,
                                 dx + r * blocks + b, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r * N] = hsum(acc[r]);
}

/* Every row of q times the `rows` unpacked rows of a tile of W (y at the tile's first
 * column): KQ_INT8_ROWS rows of q at a time, each against every row of the tile while
 * they are in the L1 cache (from the L2 cache for each row of W instead, x's int8 rows of
 * a long step would bound the product). */
#define TILE_DOTS(PATH)                                                                     \
    KERNEL_##PATH static void tile_##PATH(const unpacked_row *u, const int *combine,       \
                                          int64_t rows, const int8_t *q, const float *dx,   \
                                          const int16_t *bsum, int64_t M, int64_t K,        \
                                          float *y, int64_t N) {                            \
        const int64_t blocks = K / SUPER;                                                   \
        for (int64_t m = 0; m < M; m += KQ_INT8_ROWS) {                                     \
            const int8_t *qm = q + m * K;                                                   \
            const float *dxm = dx + m * blocks;                                             \
            const int16_t *bm = bsum + m * blocks * 16;                                     \
            const int R = M - m >= KQ_INT8_ROWS ? KQ_INT8_ROWS : (int)(M - m);              \
            for (int64_t i = 0; i < rows; i++) {                                            \
                float *ym = y + m * N + i;                                                  \
                switch (R) {                                                                \
                case 4: dots_##PATH(u[i], combine[i], qm, dxm, bm, 4, K, ym, N); break;     \
                case 3: dots_##PATH(u[i], combine[i], qm, dxm, bm, 3, K, ym, N); break;     \
                case 2: dots_##PATH(u[i], combine[i], qm, dxm, bm, 2, K, ym, N); break;     \
                default: dots_##PATH(u[i], combine[i], qm, dxm, bm, 1, K, ym, N); break;    \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }
#define KERNEL_avx2 KERNEL
#define KERNEL_vnni KERNEL_VNNI
TILE_DOTS(avx2)
TILE_DOTS(vnni)
#undef KERNEL_avx2
#undef KERNEL_vnni
#undef TILE_DOTS

/* y [M, N] = x [M, K] W^T through 8-bit activations on `path` (INT8_*), W in its file's
 * blocks (every part Q4_K, Q5_K or Q6_K), x and y float32 and contiguous. 0; -1 where
 * memory ran out; -2 where this CPU lacks the path or the arguments do not fit (y
 * untouched). */
KERNEL int gw_kquant_matmul_int8(const float *x, int64_t M, int64_t K, const gw_kq_parts *wq,
                                 int64_t N, float *y, int path) {
    if (path < INT8_SCALAR || path > INT8_VNNI || !(gw_int8_paths() & (1 << path)) || M < 1
            || K % SUPER || wq->num_parts < 1 || wq->num_parts > KQ_MAX_PARTS)
        return -2;
    for (int64_t p = 0; p < wq->num_parts; p++)
        if (!is_kquant(wq->parts[p].type)) return -2;
    const int64_t blocks = K / SUPER;
    int8_t *q = malloc((size_t)(M * K) + sizeof(float) * (size_t)(M * blocks)
                       + sizeof(int16_t) * (size_t)(M * blocks * 16));
    if (q == NULL) return -1;
    float *dx = (float *)(void *)(q + M * K);  /* K % 256 == 0: aligned */
    int16_t *bsum = (int16_t *)(void *)(dx + M * blocks);
    if (path == INT8_SCALAR) quantize_scalar(x, M * blocks, q, dx, bsum);
    else quantize_avx2(x, M * blocks, q, dx, bsum);
    const int64_t tiles = (N + KQ_INT8_TILE - 1) / KQ_INT8_TILE;
    const size_t row_bytes = (row_buffer_bytes(K) + 63) / 64 * 64;
    int failed = 0;
    #pragma omp parallel if (M * N * K >= KQ_INT8_PARALLEL_WORK)
    {
        uint8_t *buffer = aligned_alloc(64, KQ_INT8_TILE * row_bytes);
        if (buffer == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (buffer == NULL) continue;
            const int64_t n0 = t * KQ_INT8_TILE;
            const int64_t rows = N - n0 < KQ_INT8_TILE ? N - n0 : KQ_INT8_TILE;
            unpacked_row u[KQ_INT8_TILE];
            int combine[KQ_INT8_TILE];
            for (int64_t i = 0; i < rows; i++) {
                int type;
                const uint8_t *row = kq_row(wq, K, n0 + i, &type);
                prefetch_ahead(row, kq_row_bytes(type, K));
                u[i] = row_in(buffer + i * row_bytes, K);
                combine[i] = type == GW_Q6_K;
                if (path == INT8_SCALAR) unpack_scalar(type, row, K, u[i]);
                else unpack_avx2(type, row, K, u[i]);
            }
            if (path == INT8_VNNI) {
                tile_vnni(u, combine, rows, q, dx, bsum, M, K, y + n0, N);
            } else if (path == INT8_AVX2) {
                tile_avx2(u, combine, rows, q, dx, bsum, M, K, y + n0, N);
            } else {
                for (int64_t i = 0; i < rows; i++)
                    dots_scalar(u[i], combine[i], q, dx, bsum, M, K, y + n0 + i, N);
            }
        }
        free(buffer);
    }
    free(q);
    return failed ? -1 : 0;
}

/* Products of x [M, K] with a quantized weight W [N, K] (the layout in quant.h), for steps
 * of up to some tens of rows: x float32, computed in float32; or, on CPUs with AVX-512 and
 * AVX512_BF16, x bfloat16 multiplied with the codes themselves and summed in float32.
 * Threads split the output rows.
 */
#include "kquant.h"

#define VECTOR_BITS 512
#include "vector.h"
#undef VECTOR_BITS

/* Products smaller than this (multiply-adds) run on the calling thread alone: waking a
 * sleeping OpenMP thread costs more than it saves. */
#define PARALLEL_WORK (1 << 20)

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

/* y[m][j] for every row m < M of x and the `rows` (<= TILE) dequantized rows w [rows, K]
 * of a tile (y at the tile's first column). */
KERNEL static void tile_products(const float *x, int64_t M, int64_t K, const float *w,
                                 int64_t rows, float *y, int64_t N) {
    for (int64_t m = 0; m < M; m += 4) {
        const int R = M - m >= 4 ? 4 : (int)(M - m);
        const float *xm = x + m * K;
        for (int64_t j = 0; j < rows; j += 2) {
            float *ym = y + m * N + j;
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
            tile_products(x, M, K, w, rows, y + n0, N);
        }
        free(w);
    }
    return failed ? -1 : 0;
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

/* ---- Products with weights kept in their file's blocks (kquant.h) ----
 *
 * As above: a few rows of x multiply each row of W from its codes unpacked in registers
 * (kq_dot_rows), TILED_ROWS rows and more multiply tiles of W dequantized into the L1
 * cache (tile_products). */

KERNEL static int kq_tiled_matmul(const float *x, int64_t M, int64_t K, const gw_kq_parts *wq,
                                  int64_t N, float *y) {
    const int64_t tiles = (N + TILE - 1) / TILE;
    int failed = 0;
    #pragma omp parallel
    {
        /* the tile [TILE, K], then a row's scales [K / 16] and minimums [K / 32] */
        float *w = malloc(sizeof(float) * (size_t)(TILE * K + K / 16 + K / 32));
        if (w == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (w == NULL) continue;
            float *scale16 = w + TILE * K, *minimum32 = scale16 + K / 16;
            const int64_t n0 = t * TILE, rows = N - n0 < TILE ? N - n0 : TILE;
            for (int64_t r = 0; r < rows; r++) {
                int type;
                const uint8_t *row = kq_row(wq, K, n0 + r, &type);
                kq_dequantize_row(type, row, K, scale16, minimum32, w + r * K, 0);
            }
            tile_products(x, M, K, w, rows, y + n0, N);
        }
        free(w);
    }
    return failed ? -1 : 0;
}

/* y [M, N] = x [M, K] W^T for W in its file's blocks (kquant.h), x and y float32 and
 * contiguous, K a multiple of every part's block; 0, or -1 where memory ran out. */
KERNEL int gw_kquant_matmul(const float *x, int64_t M, int64_t K, const gw_kq_parts *wq,
                            int64_t N, float *y) {
    if (M >= TILED_ROWS) return kq_tiled_matmul(x, M, K, wq, N, y);
    const int64_t groups = K / GROUP;
    float *xsum = malloc(sizeof(float) * (size_t)(M * groups));
    if (xsum == NULL) return -1;
    group_sums(x, M * groups, xsum);
    int failed = 0;
    #pragma omp parallel if (M * N * K >= PARALLEL_WORK)
    {
        float *row_params_buffer = malloc(sizeof(float) * (size_t)(K / 16 + groups));
        if (row_params_buffer == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (row_params_buffer == NULL) continue;
            float *scale16 = row_params_buffer, *minimum32 = scale16 + K / 16;
            int type;
            const uint8_t *row = kq_row(wq, K, n, &type);
            row_params(type, row, K, scale16, minimum32);
            prefetch_ahead(row, kq_row_bytes(type, K));
            for (int64_t m = 0; m < M; m += ROW_BLOCK) {
                const int R = M - m >= ROW_BLOCK ? ROW_BLOCK : (int)(M - m);
                kq_dot(x + m * K, xsum + m * groups, K, R, row, type, scale16, minimum32,
                       y + m * N + n, N);
            }
        }
        free(row_params_buffer);
    }
    free(xsum);
    return failed ? -1 : 0;
}

/* ---- Quantized products of many bfloat16 rows (AVX512_BF16) ----
 *
 * Not the float32 kernel at a wider vector but another algorithm: x [M, K] bfloat16 times a
 * quantized W [N, K], for a step of a few to some tens of rows. VDPBF16PS multiplies 32
 * pairs of bfloat16 values and adds them into 16 float32 lanes an instruction, twice the
 * multiply-adds of two float32 FMAs. The codes are integers below 256, exact in bfloat16,
 * and each product of two bfloat16 values is exact in float32; so, per group of 32
 * columns, sum x[k] code[k] is computed from the codes themselves, then scaled and given
 * minimum * sum(x) in float32, as the float32 kernel does from x widened: only the order of
 * the sums differs (and the instruction flushes subnormal inputs, below 1.2e-38, to zero).
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
int gw_bf16_products(void) { return gw_runs_avx512_bf16(); }

/* y [M, N] (float32, or bfloat16 where out_bf16) = x [M, K] W^T, x bfloat16 and contiguous,
 * N a multiple of 16, K of 32. 0; -1 where memory ran out; -2 where the CPU lacks
 * AVX512_BF16 or the shape does not fit (y untouched). */
int gw_quant_matmul_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes,
                         const uint16_t *scales, const uint16_t *minimums, int64_t N, int bits,
                         void *y, int out_bf16) {
    if (!gw_runs_avx512_bf16() || M < 1 || N % 16 || K % GROUP
            || (bits != 4 && bits != 8))
        return -2;
    return quant_matmul_bf16(x, M, K, codes, scales, minimums, N, bits, y, out_bf16);
}

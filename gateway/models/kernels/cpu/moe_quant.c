/* Grouped products of a mixture of experts with its experts' weights kept quantized
 * (gateway/models/kernels/cpu/moe_quant.py): the rows routed to the experts, sorted by
 * expert, each times its own expert's weight, every expert in one call.
 *
 * A projection's weights are one stack [E, N, K], expert e's rows e N .. e N + N - 1 of a
 * weight [E N, K]: Q4_0 and Q4_1 in quant.h's layout (codes, half-float scales and
 * minimums), the other types in their file's blocks (kquant.h). Experts chosen by fewer
 * than MANY_ROWS rows (every expert of a decode step) are work items of (expert, CHUNK
 * output rows) shared between threads in one parallel region: each weight row is read once
 * and multiplied with the expert's few rows from registers, so a step reads only the
 * chosen experts' bytes. Experts of more rows (a prefill) run one after another through
 * quant_matmul.c's tiled products, which dequantize tiles of the weight into the L1 cache
 * (in a bfloat16 model on a CPU with AVX512_BF16: tiles of bfloat16, below).
 */
#include "kquant.h"

#define GW_Q4_0 2
#define GW_Q4_1 3

/* Output rows of one expert a work item: small enough for a decode step's few experts to
 * keep every thread busy, large enough that an item outlasts its scheduling. */
#define CHUNK 32
/* Rows of one expert from which it runs through the tiled products (quant_matmul.c's
 * TILED_ROWS). */
#define MANY_ROWS 8
/* Products smaller than this (multiply-adds) run on the calling thread alone. */
#define PARALLEL_WORK (1 << 20)

typedef struct {
    int64_t type;              /* ggml's number of the type */
    const uint8_t *data;       /* blocks [E N, row bytes]; Q4_0, Q4_1: codes [E N, K / 32, 16] */
    const uint16_t *scales;    /* Q4_0, Q4_1: [E N, K / 32] half floats; else unused */
    const uint16_t *minimums;  /* likewise */
} gw_moe_weight;

/* quant_matmul.c's products of one weight */
extern int gw_quant_matmul(const float *x, int64_t M, int64_t K, const uint8_t *codes,
                           const uint16_t *scales, const uint16_t *minimums, int64_t N,
                           int bits, float *y);
extern int gw_kquant_matmul(const float *x, int64_t M, int64_t K, const gw_kq_parts *wq,
                            int64_t N, float *y);

static inline int is_q4(int64_t type) { return type == GW_Q4_0 || type == GW_Q4_1; }

/* y [R, rows] (row stride ldy) = x [R, K] times weight rows n .. n + rows - 1 (of the
 * whole stack), R < MANY_ROWS; xsum: x's group sums [R, K / 32]; params: scratch of
 * K / 16 + K / 32 floats. */
KERNEL static void few_rows(const float *x, const float *xsum, int64_t R, int64_t K,
                            const gw_moe_weight *w, int64_t n, int64_t rows, float *y,
                            int64_t ldy, float *params) {
    const int64_t groups = K / GROUP;
    for (int64_t j = 0; j < rows; j++) {
        if (is_q4(w->type)) {
            float *scale = params, *minimum = params + groups;
            halves_to_floats(w->scales + (n + j) * groups, groups, scale);
            halves_to_floats(w->minimums + (n + j) * groups, groups, minimum);
            const uint8_t *codes = w->data + (n + j) * groups * 16;
            if (j + PREFETCH_ROWS < rows) prefetch_ahead(codes, groups * 16);
            for (int64_t m = 0; m < R; m += ROW_BLOCK) {
                const float *xm = x + m * K, *xs = xsum + m * groups;
                float *ym = y + m * ldy + j;
                switch (R - m >= ROW_BLOCK ? ROW_BLOCK : (int)(R - m)) {
                case 4: dot_rows(xm, xs, K, 4, codes, scale, minimum, 4, ym, ldy); break;
                case 3: dot_rows(xm, xs, K, 3, codes, scale, minimum, 4, ym, ldy); break;
                case 2: dot_rows(xm, xs, K, 2, codes, scale, minimum, 4, ym, ldy); break;
                default: dot_rows(xm, xs, K, 1, codes, scale, minimum, 4, ym, ldy); break;
                }
            }
        } else {
            const int type = (int)w->type;
            const int64_t row_bytes = kq_row_bytes(type, K);
            const uint8_t *row = w->data + (n + j) * row_bytes;
            float *scale16 = params, *minimum32 = params + K / 16;
            row_params(type, row, K, scale16, minimum32);
            if (j + PREFETCH_ROWS < rows) prefetch_ahead(row, row_bytes);
            for (int64_t m = 0; m < R; m += ROW_BLOCK) {
                const int r = R - m >= ROW_BLOCK ? ROW_BLOCK : (int)(R - m);
                kq_dot(x + m * K, xsum + m * groups, K, r, row, type, scale16, minimum32,
                       y + m * ldy + j, ldy);
            }
        }
    }
}

/* y [R, N] (row stride ldy) = x [R, K] times expert e's whole weight, through the tiled
 * products into `scratch` [R, N]; 0, or -1 where memory ran out. */
KERNEL static int many_rows(const float *x, int64_t R, int64_t K, const gw_moe_weight *w,
                            int64_t e, int64_t N, float *y, int64_t ldy, float *scratch) {
    const int64_t groups = K / GROUP;
    int status;
    if (is_q4(w->type)) {
        status = gw_quant_matmul(x, R, K, w->data + e * N * groups * 16,
                                 w->scales + e * N * groups, w->minimums + e * N * groups, N,
                                 4, scratch);
    } else {
        gw_kq_parts parts = {.num_parts = 1};
        parts.parts[0].blocks = w->data + e * N * kq_row_bytes(w->type, K);
        parts.parts[0].type = w->type;
        parts.parts[0].rows = N;
        status = gw_kquant_matmul(x, R, K, &parts, N, scratch);
    }
    for (int64_t m = 0; m < R && status == 0; m++)
        __builtin_memcpy(y + m * ldy, scratch + m * N, sizeof(float) * (size_t)N);
    return status;
}

/* ---- Experts of many bfloat16 rows (AVX512_BF16) ----
 *
 * Where the rows were bfloat16 (a model run in bfloat16), an expert of many rows takes
 * tiles of BF16_TILE weight rows dequantized to bfloat16 (the values a dequantized
 * bfloat16 model holds) and VDPBF16PS: 32 products a instruction, summed in float32, as
 * oneDNN's bfloat16 products of the dequantized weights sum them. */
#define BF16_TILE 8

/* y[r][j] for rows r < R of x16 (R <= 4) and rows j < 4 of w16, both bfloat16 [., K]: 16
 * sums in registers, eight loads for sixteen instructions. */
KERNEL512 static inline __attribute__((always_inline)) void bf16_dots(
        const uint16_t *x16, int64_t K, int R, const uint16_t *w16, float *y, int64_t ldy) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wj[4];
        for (int j = 0; j < 4; j++) wj[j] = (__m512bh)_mm512_loadu_si512(w16 + j * K + k);
        for (int r = 0; r < R; r++) {
            const __m512bh xr = (__m512bh)_mm512_loadu_si512(x16 + r * K + k);
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xr, wj[j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) y[r * ldy + j] = _mm512_reduce_add_ps(acc[r][j]);
}

/* y [R, N] (row stride ldy) = x16 [R, K] bfloat16 times expert e's weight, N a multiple
 * of 4 and K of 32; 0, or -1 where memory ran out. */
KERNEL512 static int many_bf16_rows(const uint16_t *x16, int64_t R, int64_t K,
                                    const gw_moe_weight *w, int64_t e, int64_t N, float *y,
                                    int64_t ldy) {
    const int64_t tiles = (N + BF16_TILE - 1) / BF16_TILE;
    int failed = 0;
    #pragma omp parallel
    {
        /* the tile [BF16_TILE, K] bfloat16, then a row's scales and minimums */
        uint16_t *tile = malloc(sizeof(uint16_t) * (size_t)(BF16_TILE * K)
                                + sizeof(float) * (size_t)(K / 16 + K / 32));
        if (tile == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (tile == NULL) continue;
            float *scale16 = (float *)(tile + BF16_TILE * K), *minimum32 = scale16 + K / 16;
            const int64_t n0 = t * BF16_TILE, rows = N - n0 < BF16_TILE ? N - n0 : BF16_TILE;
            for (int64_t j = 0; j < rows; j++) {
                const int64_t n = e * N + n0 + j;
                if (is_q4(w->type))
                    dequantize_row(w->data, w->scales, w->minimums, K, 4, n, tile + j * K, 1);
                else
                    kq_dequantize_row((int)w->type, w->data + n * kq_row_bytes(w->type, K),
                                      K, scale16, minimum32, tile + j * K, 1);
            }
            for (int64_t m = 0; m < R; m += 4)
                for (int64_t j = 0; j < rows; j += 4) {
                    const uint16_t *xm = x16 + m * K, *wj = tile + j * K;
                    float *ym = y + m * ldy + n0 + j;
                    switch (R - m >= 4 ? 4 : (int)(R - m)) {
                    case 4: bf16_dots(xm, K, 4, wj, ym, ldy); break;
                    case 3: bf16_dots(xm, K, 3, wj, ym, ldy); break;
                    case 2: bf16_dots(xm, K, 2, wj, ym, ldy); break;
                    default: bf16_dots(xm, K, 1, wj, ym, ldy); break;
                    }
                }
        }
        free(tile);
    }
    return failed ? -1 : 0;
}

/* `count` floats rounded to bfloat16 (as torch rounds), into x16. */
static void rows_to_bf16(const float *x, int64_t count, uint16_t *x16) {
    for (int64_t i = 0; i < count; i++) x16[i] = to_bf16(x[i]);
}

/* y [M, N] (row stride ldy >= N) = each row of x [M, K] (float32, contiguous, sorted by
 * expert) times its expert's weight [N, K] transposed; offsets [E]: the end of each
 * expert's rows. K a multiple of the type's block. bf16_rows: the model runs in bfloat16,
 * so experts of many rows may multiply x rounded to bfloat16 (where the CPU has
 * AVX512_BF16). 0, or -1 where memory ran out. */
KERNEL int gw_moe_quant_matmul(const float *x, int64_t M, int64_t K, const int32_t *offsets,
                               int64_t E, const gw_moe_weight *w, int64_t N, float *y,
                               int64_t ldy, int bf16_rows) {
    const int64_t groups = K / GROUP, chunks = (N + CHUNK - 1) / CHUNK;
    int64_t *few = malloc(sizeof(int64_t) * (size_t)(E > 0 ? E : 1));
    float *xsum = malloc(sizeof(float) * (size_t)(M * groups > 0 ? M * groups : 1));
    if (few == NULL || xsum == NULL) {
        free(few);
        free(xsum);
        return -1;
    }
    int64_t num_few = 0, few_work = 0, largest = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t count = offsets[e] - (e ? offsets[e - 1] : 0);
        if (count >= MANY_ROWS) {
            largest = count > largest ? count : largest;
        } else if (count > 0) {
            few[num_few++] = e;
            few_work += count * N * K;
        }
    }
    int failed = 0;
    if (largest > 0) {  /* 1. experts of many rows, one after another */
        const int wide = bf16_rows && N % 4 == 0 && K % 32 == 0 && gw_runs_avx512_bf16();
        /* the tiled products' output [largest, N], or the rows as bfloat16 [largest, K] */
        void *scratch = malloc(wide ? sizeof(uint16_t) * (size_t)(largest * K)
                                    : sizeof(float) * (size_t)(largest * N));
        failed = scratch == NULL;
        for (int64_t e = 0; e < E && !failed; e++) {
            const int64_t start = e ? offsets[e - 1] : 0, count = offsets[e] - start;
            if (count < MANY_ROWS) continue;
            if (wide) {
                rows_to_bf16(x + start * K, count * K, scratch);
                failed = many_bf16_rows(scratch, count, K, w, e, N, y + start * ldy, ldy) != 0;
            } else {
                failed = many_rows(x + start * K, count, K, w, e, N, y + start * ldy, ldy,
                                   scratch) != 0;
            }
        }
        free(scratch);
    }
    group_sums(x, M * groups, xsum);
    /* 2. experts of few rows: (expert, chunk) items between the threads */
    #pragma omp parallel if (few_work >= PARALLEL_WORK)
    {
        float *params = malloc(sizeof(float) * (size_t)(K / 16 + K / 32));
        if (params == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_few * chunks; item++) {
            if (params == NULL) continue;
            const int64_t e = few[item / chunks], n0 = (item % chunks) * CHUNK;
            const int64_t start = e ? offsets[e - 1] : 0, count = offsets[e] - start;
            const int64_t rows = N - n0 < CHUNK ? N - n0 : CHUNK;
            few_rows(x + start * K, xsum + start * groups, count, K, w, e * N + n0, rows,
                     y + start * ldy + n0, ldy, params);
        }
        free(params);
    }
    free(few);
    free(xsum);
    return failed ? -1 : 0;
}

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
 * quant_matmul.c's tiled products, which dequantize tiles of the weight into the L1 cache.
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
int gw_quant_matmul(const float *x, int64_t M, int64_t K, const uint8_t *codes,
                    const uint16_t *scales, const uint16_t *minimums, int64_t N, int bits,
                    float *y);
int gw_kquant_matmul(const float *x, int64_t M, int64_t K, const gw_kq_parts *wq, int64_t N,
                     float *y);

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

/* y [M, N] (row stride ldy >= N) = each row of x [M, K] (float32, contiguous, sorted by
 * expert) times its expert's weight [N, K] transposed; offsets [E]: the end of each
 * expert's rows. K a multiple of the type's block. 0, or -1 where memory ran out. */
KERNEL int gw_moe_quant_matmul(const float *x, int64_t M, int64_t K, const int32_t *offsets,
                               int64_t E, const gw_moe_weight *w, int64_t N, float *y,
                               int64_t ldy) {
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
        float *scratch = malloc(sizeof(float) * (size_t)(largest * N));
        failed = scratch == NULL;
        for (int64_t e = 0; e < E && !failed; e++) {
            const int64_t start = e ? offsets[e - 1] : 0, count = offsets[e] - start;
            if (count >= MANY_ROWS)
                failed = many_rows(x + start * K, count, K, w, e, N, y + start * ldy, ldy,
                                   scratch) != 0;
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

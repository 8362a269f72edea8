/* A quantized weight (the layout in quant.h) dequantized, whole or some of its rows: for
 * the products of long steps (prefill), which multiply the dequantized weight densely, and
 * for the rows of an embedding.
 */
#include "kquant.h"

/* out [R, K]: rows `rows` [R] of W dequantized as code * scale + minimum, rounded after
 * each operation as a plain float32 computation is (rows NULL: all N rows, R = N); float32,
 * or bfloat16 where out_bf16 (the float32 value rounded once), so a bfloat16 product of
 * many rows needs no float32 copy of the weight first. */
KERNEL void gw_quant_dequantize(const uint8_t *codes, const uint16_t *scales,
                                const uint16_t *minimums, int64_t K, int bits,
                                const int64_t *rows, int64_t R, void *out, int out_bf16) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = rows == NULL ? r : rows[r];
        if (out_bf16)
            dequantize_row(codes, scales, minimums, K, bits, n, (uint16_t *)out + r * K, 1);
        else
            dequantize_row(codes, scales, minimums, K, bits, n, (float *)out + r * K, 0);
    }
}

/* out [R, K]: rows `rows` [R] (NULL: all N, R = N) of a weight in its file's blocks
 * (kquant.h) dequantized, float32 or (out_bf16) bfloat16, as gw_quant_dequantize does;
 * 0, or -1 where memory ran out (out is then not all written). */
KERNEL int gw_kquant_dequantize(const gw_kq_parts *wq, int64_t K, const int64_t *rows,
                                int64_t R, void *out, int out_bf16) {
    int failed = 0;
    #pragma omp parallel
    {
        float *params = malloc(sizeof(float) * (size_t)(K / 16 + K / 32));
        if (params == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            if (params == NULL) continue;
            int type;
            const uint8_t *row = kq_row(wq, K, rows == NULL ? r : rows[r], &type);
            void *dst = out_bf16 ? (void *)((uint16_t *)out + r * K) : (void *)((float *)out + r * K);
            kq_dequantize_row(type, row, K, params, params + K / 16, dst, out_bf16);
        }
        free(params);
    }
    return failed ? -1 : 0;
}

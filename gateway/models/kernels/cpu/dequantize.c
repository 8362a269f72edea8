/* A quantized weight (the layout in quant.h) dequantized, whole or some of its rows: for
 * the products of long steps (prefill), which multiply the dequantized weight densely, and
 * for the rows of an embedding.
 */
#include "quant.h"

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

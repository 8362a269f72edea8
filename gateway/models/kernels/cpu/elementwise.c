/* The elementwise steps between the matrix products of a many-row step, each in one pass
 * over rows of bfloat16 or float32 (torch's ops take two to six passes, and as many
 * dispatches, for each): the residual add with the RMS norm after it, silu(gate) * up, and
 * the rotary embedding. In bfloat16 each rounds where torch's ops round, so the results
 * are those of the ops they replace up to the order of a row's sum of squares.
 *
 * Each row kernel is written once (elementwise_rows.h) and compiled for AVX2 (8 floats a
 * vector, float32 and bfloat16 rows) and for AVX-512 (16 floats, bfloat16 rows where the
 * CPU has AVX512_BF16, whose rounding is one instruction).
 */
#include "kernels.h"

#define VECTOR_BITS 256
#include "vector.h"
#include "elementwise_rows.h"
#undef VECTOR_BITS
#define VECTOR_BITS 512
#include "vector.h"
#include "elementwise_rows.h"
#undef VECTOR_BITS

/* The AVX-512 rows, bfloat16 only, as functions of their own: an AVX2 caller cannot
 * inline them. */
KERNEL512 static void add_rms_norm_wide(char *row, const char *add, const void *weight,
                                        int64_t dim, float eps, char *dst) {
    add_rms_norm_row16(row, add, weight, dim, eps, 1, dst);
}

KERNEL512 static void silu_mul_wide(const char *gate, const char *up, int64_t inter,
                                    char *dst) {
    silu_mul_row16(gate, up, inter, 1, dst);
}

KERNEL512 static void rotary_wide(char *x, int64_t heads, int64_t dim, const char *c,
                                  const char *s) {
    rotary_row16(x, heads, dim, c, s, 1);
}

/* x [rows, dim] is the residual stream: with delta [rows, dim], x += delta first, in place.
 * Then out [rows, dim] = the RMS norm of x times weight (add_rms_norm_row). 0, or -1 where
 * dim is not a multiple of 8. */
KERNEL int gw_add_rms_norm(void *x, const void *delta, const void *weight, int64_t rows,
                           int64_t dim, float eps, int bf16, void *out) {
    if (dim % 8 || dim <= 0) return -1;
    const int64_t bytes = dim * (bf16 ? 2 : 4);
    const int wide = bf16 && dim % 16 == 0 && gw_runs_avx512_bf16();
    #pragma omp parallel for schedule(static) if (rows * dim >= ELEMENTWISE_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        char *row = (char *)x + r * bytes, *dst = (char *)out + r * bytes;
        const char *add = delta ? (const char *)delta + r * bytes : NULL;
        if (wide) add_rms_norm_wide(row, add, weight, dim, eps, dst);
        else if (bf16) add_rms_norm_row8(row, add, weight, dim, eps, 1, dst);
        else add_rms_norm_row8(row, add, weight, dim, eps, 0, dst);
    }
    return 0;
}

/* gate_up [rows, 2 inter] (gate, then up, per row) -> out [rows, inter] = silu(gate) * up.
 * 0, or -1 where inter is not a multiple of 8. */
KERNEL int gw_silu_mul(const void *gate_up, int64_t rows, int64_t inter, int bf16, void *out) {
    if (inter % 8 || inter <= 0) return -1;
    const int64_t esize = bf16 ? 2 : 4;
    const int wide = bf16 && inter % 16 == 0 && gw_runs_avx512_bf16();
    #pragma omp parallel for schedule(static) if (rows * inter >= ELEMENTWISE_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)gate_up + r * 2 * inter * esize;
        char *dst = (char *)out + r * inter * esize;
        if (wide) silu_mul_wide(gate, gate + inter * esize, inter, dst);
        else if (bf16) silu_mul_row8(gate, gate + inter * esize, inter, 1, dst);
        else silu_mul_row8(gate, gate + inter * esize, inter, 0, dst);
    }
    return 0;
}

/* In place, the first `heads` heads (dim values each) of each row of x (row r at element
 * r * stride): HF's half-split rotary embedding, with cos and sin [rows, dim]
 * (rotary_row). 0, or -1 where dim is not a multiple of 16. */
KERNEL int gw_rotary(void *x, int64_t rows, int64_t stride, int64_t heads, int64_t dim,
                     const void *cos, const void *sin, int bf16) {
    if (dim % 16 || dim <= 0) return -1;
    const int64_t esize = bf16 ? 2 : 4;
    const int wide = bf16 && dim % 32 == 0 && gw_runs_avx512_bf16();
    #pragma omp parallel for schedule(static) if (rows * heads * dim >= ELEMENTWISE_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        char *row = (char *)x + r * stride * esize;
        const char *c = (const char *)cos + r * dim * esize;
        const char *s = (const char *)sin + r * dim * esize;
        if (wide) rotary_wide(row, heads, dim, c, s);
        else if (bf16) rotary_row8(row, heads, dim, c, s, 1);
        else rotary_row8(row, heads, dim, c, s, 0);
    }
    return 0;
}

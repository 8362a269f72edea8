/* GGUF weights kept in their file's blocks (the K-quants Q4_K, Q5_K, Q6_K, the 5-bit Q5_0
 * and Q5_1, and Q8_0 in a file that has those) and the helpers that read them: the
 * products (quant_matmul.c, lone_decode.c) and the dequantization (dequantize.c).
 *
 * A weight [N, K] is one or more parts of whole rows (a fused q/k/v may hold a Q6_K v
 * beside a Q4_K q and k), each row its blocks exactly as the file holds them. Every type
 * reads w = code * scale + minimum, with one scale per 32 columns (per 16 for Q6_K) and
 * one minimum per 32 (`row_params` computes them as floats for a row; Q6_K, Q5_0 and Q8_0
 * have signed codes and no minimum). The codes are unpacked a unit at a time (64 columns
 * of the K-quants, 32 of the others) straight into floats in registers and multiplied there.
 */
#ifndef GW_KQUANT_H
#define GW_KQUANT_H

#include "quant.h"

/* ggml's numbers for the types (GGMLQuantizationType). */
#define GW_Q5_0 6
#define GW_Q5_1 7
#define GW_Q8_0 8
#define GW_Q4_K 12
#define GW_Q5_K 13
#define GW_Q6_K 14

#define KQ_MAX_PARTS 4

typedef struct {
    const uint8_t *blocks; /* [rows, row bytes] as the file holds them */
    int64_t type, rows;
} gw_kq_part;

typedef struct {
    int64_t num_parts;
    gw_kq_part parts[KQ_MAX_PARTS];
} gw_kq_parts;

/* Columns a block holds and its bytes; 0 for a type not read here. */
static inline int64_t kq_block_values(int64_t type) {
    return type == GW_Q5_0 || type == GW_Q5_1 || type == GW_Q8_0 ? 32 : 256;
}

static inline int64_t kq_block_bytes(int64_t type) {
    switch (type) {
    case GW_Q5_0: return 22;
    case GW_Q5_1: return 24;
    case GW_Q8_0: return 34;
    case GW_Q4_K: return 144;
    case GW_Q5_K: return 176;
    case GW_Q6_K: return 210;
    default: return 0;
    }
}

static inline int64_t kq_row_bytes(int64_t type, int64_t K) {
    return K / kq_block_values(type) * kq_block_bytes(type);
}

/* Row n of W: its bytes, and its type in *type. */
KERNEL static inline const uint8_t *kq_row(const gw_kq_parts *w, int64_t K, int64_t n, int *type) {
    int64_t p = 0;
    while (p + 1 < w->num_parts && n >= w->parts[p].rows) n -= w->parts[p++].rows;
    *type = (int)w->parts[p].type;
    return w->parts[p].blocks + n * kq_row_bytes(w->parts[p].type, K);
}

KERNEL static inline float half_at(const uint8_t *p) {
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The 8 six-bit scales and the 8 minimums of a Q4_K / Q5_K super-block's 12 bytes, 8 bytes
 * each in column order. Bytes 0-3 hold scales 0-3 in their low 6 bits and the top 2 bits of
 * scales 4-7 above them; bytes 4-7 the same of the minimums; bytes 8-11 the low 4 bits of
 * scales 4-7 (low nibbles) and of minimums 4-7 (high nibbles). Read as 32-bit words. */
static inline void kq_scales_mins(const uint8_t *q, uint8_t scales[8], uint8_t mins[8]) {
    uint32_t a, b, c, w[4];
    __builtin_memcpy(&a, q, 4);
    __builtin_memcpy(&b, q + 4, 4);
    __builtin_memcpy(&c, q + 8, 4);
    w[0] = a & 0x3f3f3f3fu;
    w[1] = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
    w[2] = b & 0x3f3f3f3fu;
    w[3] = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
    __builtin_memcpy(scales, w, 8);
    __builtin_memcpy(mins, w + 2, 8);
}

/* A row's scales and minimums [K / 32] as floats, each the product a float32
 * dequantization computes (gguf-py's and llama.cpp's); Q6_K's scales are per 16 columns,
 * [K / 16]. The minimums of the types with signed codes (kq_signed) are 0 and not written. */
KERNEL static inline void row_params(int type, const uint8_t *row, int64_t K, float *scales,
                                     float *minimum32) {
    const int64_t blocks = K / kq_block_values(type), bytes = kq_block_bytes(type);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = row + b * bytes;
        if (type == GW_Q5_0 || type == GW_Q5_1 || type == GW_Q8_0) {
            scales[b] = half_at(blk);
            if (type == GW_Q5_1) minimum32[b] = half_at(blk + 2);
        } else if (type == GW_Q6_K) {
            const __m256 d = _mm256_set1_ps(half_at(blk + 208));
            for (int i = 0; i < 2; i++) {
                const __m256i sc = _mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * i)));
                _mm256_storeu_ps(scales + 16 * b + 8 * i,
                                 _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
            }
        } else {  /* Q4_K, Q5_K: d, dmin, 12 bytes of scales and minimums */
            uint8_t sc[8], mn[8];
            kq_scales_mins(blk + 4, sc, mn);
            const __m256 d = _mm256_set1_ps(half_at(blk));
            const __m256 dmin = _mm256_set1_ps(half_at(blk + 2));
            _mm256_storeu_ps(scales + 8 * b, _mm256_mul_ps(d, _mm256_cvtepi32_ps(widen8(sc))));
            /* -(dmin * m): the dequantization subtracts dmin * m */
            const __m256 m = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(widen8(mn)));
            _mm256_storeu_ps(minimum32 + 8 * b, _mm256_xor_ps(m, _mm256_set1_ps(-0.0f)));
        }
    }
}

/* Columns a unit of `type` unpacks at once. */
static inline int kq_unit(int type) { return kq_block_values(type) == 32 ? 32 : 64; }

/* Whether every minimum of `type` is 0 (its codes signed). */
static inline int kq_signed(int type) {
    return type == GW_Q6_K || type == GW_Q5_0 || type == GW_Q8_0;
}

/* Bit `shift` of each lane of v, moved to bit 4. */
KERNEL static inline __m256i bit4(__m256i v, int shift) {
    return _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(v, shift),
                                              _mm256_set1_epi32(1)), 4);
}

/* The codes of unit u of a row as floats c[kq_unit / 8], in column order. */
KERNEL static inline __attribute__((always_inline)) void kq_unpack(int type, const uint8_t *row,
                                                                   int64_t u, __m256 c[8]) {
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    if (type == GW_Q4_K || type == GW_Q5_K) {
        /* unit j of 4 a super-block: sub-blocks 2j (low nibbles) and 2j + 1 (high ones) */
        const uint8_t *blk = row + (u / 4) * kq_block_bytes(type);
        const int j = (int)(u % 4);
        const uint8_t *qs = blk + (type == GW_Q4_K ? 16 : 48) + 32 * j;
        for (int i = 0; i < 4; i++) {
            const __m256i a = widen8(qs + 8 * i);
            __m256i lo = _mm256_and_si256(a, low4), hi = _mm256_srli_epi32(a, 4);
            if (type == GW_Q5_K) {
                const __m256i h = widen8(blk + 16 + 8 * i);
                lo = _mm256_or_si256(lo, bit4(h, 2 * j));
                hi = _mm256_or_si256(hi, bit4(h, 2 * j + 1));
            }
            c[i] = _mm256_cvtepi32_ps(lo);
            c[4 + i] = _mm256_cvtepi32_ps(hi);
        }
    } else if (type == GW_Q6_K) {
        /* unit u of 4: half u / 2 of 128 columns; its low (columns 0..63) or high nibbles */
        const uint8_t *blk = row + (u / 4) * 210;
        const int half = (int)(u % 4) / 2, which = (int)(u % 2);
        const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
        const __m256i offset = _mm256_set1_epi32(32), bits45 = _mm256_set1_epi32(0x30);
        for (int i = 0; i < 4; i++) {
            const __m256i h = widen8(qh + 8 * i);
            for (int s = 0; s < 2; s++) {  /* columns 32 s + 8 i .. of the unit */
                const __m256i a = widen8(ql + 32 * s + 8 * i);
                /* the code's low 4 bits, and its 2 high ones (bits 4 w + 2 s of h) at 4-5 */
                const __m256i l = which ? _mm256_srli_epi32(a, 4) : _mm256_and_si256(a, low4);
                const __m256i hs = which ? _mm256_srli_epi32(h, 2 * s)
                                         : _mm256_slli_epi32(h, 4 - 2 * s);
                const __m256i q = _mm256_or_si256(l, _mm256_and_si256(hs, bits45));
                c[4 * s + i] = _mm256_cvtepi32_ps(_mm256_sub_epi32(q, offset));
            }
        }
    } else if (type == GW_Q8_0) {  /* a half float, then 32 signed bytes */
        const int8_t *qs = (const int8_t *)(row + u * 34 + 2);
        for (int i = 0; i < 4; i++)
            c[i] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * i))));
    } else {  /* Q5_0 (signed codes, q - 16), Q5_1: a 32-bit word of high bits, 16 bytes */
        const int64_t bytes = kq_block_bytes(type);
        const uint8_t *blk = row + u * bytes;
        uint32_t qh;
        __builtin_memcpy(&qh, blk + bytes - 20, 4);
        const uint8_t *qs = blk + bytes - 16;
        /* bit 8 i + k of qh (column 8 i + k) moved to bit 4 of lane k: qh << 4 shifted
         * right by k for i = 0, qh by 8 i + k - 4 after */
        const __m256i high = _mm256_set1_epi32((int)qh);
        const __m256i high4 = _mm256_set1_epi32((int)(qh << 4)), sixteen = _mm256_set1_epi32(16);
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (int i = 0; i < 4; i++) {  /* columns 8 i .. 8 i + 7 */
            const __m256i a = widen8(qs + 8 * (i % 2));
            const __m256i l = i < 2 ? _mm256_and_si256(a, low4) : _mm256_srli_epi32(a, 4);
            const __m256i shift = _mm256_add_epi32(lanes, _mm256_set1_epi32(i ? 8 * i - 4 : 0));
            const __m256i hb = _mm256_and_si256(_mm256_srlv_epi32(i ? high : high4, shift),
                                                sixteen);
            __m256i q = _mm256_or_si256(l, hb);
            if (type == GW_Q5_0) q = _mm256_sub_epi32(q, sixteen);
            c[i] = _mm256_cvtepi32_ps(q);
        }
    }
}

/* y[r][n] for rows r < R of x (R <= ROW_BLOCK, a constant once inlined) and one row of W
 * of `type` (a constant once inlined); scales, minimum32: the row's (row_params). Each 32
 * columns' products are summed first and scaled once (twice for Q6_K, whose scales are
 * per 16); each row keeps two sums, alternating, so that no one chain of additions holds
 * a lone row back (and a row's sums are the same operations whatever R is). */
KERNEL static inline __attribute__((always_inline)) void kq_dot_rows(
        const float *x, const float *xsum, int64_t K, int R, const uint8_t *row, int type,
        const float *scales, const float *minimum32, float *y, int64_t N) {
    const int unit = kq_unit(type), halves = unit / 32;
    __m256 acc[ROW_BLOCK][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t u = 0; u < K / unit; u++) {
        __m256 c[8];
        kq_unpack(type, row, u, c);
        const float *s = scales + u * unit / (type == GW_Q6_K ? 16 : 32);
        for (int r = 0; r < R; r++) {
            const float *xu = x + r * K + u * unit;
            for (int h = 0; h < halves; h++) {
                const __m256 *ch = c + 4 * h;
                const float *xh = xu + 32 * h;
                const int a = h & 1;
                __m256 d = _mm256_mul_ps(ch[0], _mm256_loadu_ps(xh));
                d = _mm256_fmadd_ps(ch[1], _mm256_loadu_ps(xh + 8), d);
                if (type == GW_Q6_K) {
                    __m256 e = _mm256_mul_ps(ch[2], _mm256_loadu_ps(xh + 16));
                    e = _mm256_fmadd_ps(ch[3], _mm256_loadu_ps(xh + 24), e);
                    d = _mm256_mul_ps(d, _mm256_broadcast_ss(s + 2 * h));
                    d = _mm256_fmadd_ps(e, _mm256_broadcast_ss(s + 2 * h + 1), d);
                    acc[r][a] = _mm256_add_ps(acc[r][a], d);
                } else {
                    d = _mm256_fmadd_ps(ch[2], _mm256_loadu_ps(xh + 16), d);
                    d = _mm256_fmadd_ps(ch[3], _mm256_loadu_ps(xh + 24), d);
                    acc[r][a] = _mm256_fmadd_ps(d, _mm256_broadcast_ss(s + h), acc[r][a]);
                }
            }
        }
    }
    const int64_t groups = K / GROUP;
    for (int r = 0; r < R; r++)
        y[r * N] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]))
            + (kq_signed(type) ? 0.0f : dot(minimum32, xsum + r * groups, groups));
}

/* One row of W of `type` times rows m .. of x, ROW_BLOCK at a time (y at row m's column n);
 * dispatches to the instantiation of each type and row count. */
#define KQ_ROWS_CASE(T)                                                                    \
    case T:                                                                                \
        switch (R) {                                                                       \
        case 4: kq_dot_rows(x, xsum, K, 4, row, T, scales, minimum32, y, N); break;     \
        case 3: kq_dot_rows(x, xsum, K, 3, row, T, scales, minimum32, y, N); break;     \
        case 2: kq_dot_rows(x, xsum, K, 2, row, T, scales, minimum32, y, N); break;     \
        default: kq_dot_rows(x, xsum, K, 1, row, T, scales, minimum32, y, N); break;    \
        }                                                                                  \
        break;

KERNEL static inline void kq_dot(const float *x, const float *xsum, int64_t K, int R,
                                 const uint8_t *row, int type, const float *scales,
                                 const float *minimum32, float *y, int64_t N) {
    switch (type) {
    KQ_ROWS_CASE(GW_Q4_K)
    KQ_ROWS_CASE(GW_Q5_K)
    KQ_ROWS_CASE(GW_Q6_K)
    KQ_ROWS_CASE(GW_Q5_0)
    KQ_ROWS_CASE(GW_Q5_1)
    KQ_ROWS_CASE(GW_Q8_0)
    default: break;
    }
}

/* out [K]: a row of `type` dequantized as code * scale + minimum (float32, rounded after
 * each operation as gguf-py's dequantizer rounds), float32 or (bf16) rounded to bfloat16;
 * scales and minimum32 filled for it (row_params). */
KERNEL static inline __attribute__((always_inline)) void kq_dequantize_row_of(
        int type, const uint8_t *row, int64_t K, float *scales, float *minimum32, void *out,
        int bf16) {
    row_params(type, row, K, scales, minimum32);
    const int unit = kq_unit(type), vectors = unit / 8;
    for (int64_t u = 0; u < K / unit; u++) {
        __m256 c[8];
        kq_unpack(type, row, u, c);
        for (int v = 0; v < vectors; v++) {
            const int64_t at = u * unit + 8 * v;
            const __m256 w = _mm256_mul_ps(
                c[v], _mm256_set1_ps(scales[type == GW_Q6_K ? at / 16 : at / 32]));
            store8(out, at,
                   kq_signed(type) ? w : _mm256_add_ps(w, _mm256_set1_ps(minimum32[at / 32])),
                   bf16);
        }
    }
}

KERNEL static inline void kq_dequantize_row(int type, const uint8_t *row, int64_t K,
                                            float *scales, float *minimum32, void *out,
                                            int bf16) {
    switch (type) {
#define KQ_DEQ_CASE(T) \
    case T: kq_dequantize_row_of(T, row, K, scales, minimum32, out, bf16); break;
    KQ_DEQ_CASE(GW_Q4_K)
    KQ_DEQ_CASE(GW_Q5_K)
    KQ_DEQ_CASE(GW_Q6_K)
    KQ_DEQ_CASE(GW_Q5_0)
    KQ_DEQ_CASE(GW_Q5_1)
    KQ_DEQ_CASE(GW_Q8_0)
#undef KQ_DEQ_CASE
    default: break;
    }
}

#endif

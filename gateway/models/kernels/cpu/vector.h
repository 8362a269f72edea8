/* The float vector of one width, so that code written once compiles for both: included
 * with VECTOR_BITS defined as 256 (AVX2: 8 floats, KERNEL) or 512 (AVX-512 with
 * AVX512_BF16: 16 floats, KERNEL512), it defines for that width
 *   vec, VEC_WIDTH, VEC_TARGET   the vector type, its floats, its target attribute;
 *   vec_*                        the operations on it, as the intrinsics of that width;
 *   VEC(name)                    a name for that width: name8 or name16;
 *   VEC(exp)                     exp of each lane (exp8, exp16).
 * A file may include it once per width (no include guard: each inclusion redefines the
 * macros). The two widths round to bfloat16 each in their own way: AVX2 by integer
 * arithmetic (kernels.h), AVX-512 in one instruction, which also flushes subnormals (below
 * 1.2e-38) to zero.
 */
#include "kernels.h"

#undef vec
#undef veci
#undef VEC_WIDTH
#undef VEC_TARGET
#undef VEC
#undef vec_set1
#undef vec_zero
#undef vec_add
#undef vec_sub
#undef vec_mul
#undef vec_div
#undef vec_min
#undef vec_max
#undef vec_fmadd
#undef vec_fnmadd
#undef vec_round_to_int
#undef vec_to_int
#undef vec_from_bits
#undef veci_set1
#undef veci_add
#undef veci_shift_left
#undef vec_load_row
#undef vec_store_row
#undef vec_round_bf16
#undef vec_sum_of_16

#define VEC_CONCAT(name, width) name##width
#define VEC_NAME(name, width) VEC_CONCAT(name, width)
#define VEC(name) VEC_NAME(name, VEC_WIDTH)

#if VECTOR_BITS == 256
#define vec __m256
#define veci __m256i
#define VEC_WIDTH 8
#define VEC_TARGET KERNEL
#define vec_set1 _mm256_set1_ps
#define vec_zero _mm256_setzero_ps
#define vec_add _mm256_add_ps
#define vec_sub _mm256_sub_ps
#define vec_mul _mm256_mul_ps
#define vec_div _mm256_div_ps
#define vec_min _mm256_min_ps
#define vec_max _mm256_max_ps
#define vec_fmadd _mm256_fmadd_ps
#define vec_fnmadd _mm256_fnmadd_ps
#define vec_round_to_int(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vec_to_int _mm256_cvtps_epi32
#define vec_from_bits _mm256_castsi256_ps
#define veci_set1 _mm256_set1_epi32
#define veci_add _mm256_add_epi32
#define veci_shift_left _mm256_slli_epi32
/* VEC_WIDTH values at element i of a float32 or (bf16) bfloat16 row; stored likewise. */
#define vec_load_row(p, i, bf16) weights8(p, i, bf16)
#define vec_store_row(p, i, v, bf16) store8(p, i, v, bf16)
#define vec_round_bf16 round_bf16x8
/* The sum of 16 lanes held in 16 / VEC_WIDTH vectors acc[]. */
#define vec_sum_of_16(acc) hsum(_mm256_add_ps((acc)[0], (acc)[1]))

#elif VECTOR_BITS == 512
#define vec __m512
#define veci __m512i
#define VEC_WIDTH 16
#define VEC_TARGET KERNEL512
#define vec_set1 _mm512_set1_ps
#define vec_zero _mm512_setzero_ps
#define vec_add _mm512_add_ps
#define vec_sub _mm512_sub_ps
#define vec_mul _mm512_mul_ps
#define vec_div _mm512_div_ps
#define vec_min _mm512_min_ps
#define vec_max _mm512_max_ps
#define vec_fmadd _mm512_fmadd_ps
#define vec_fnmadd _mm512_fnmadd_ps
#define vec_round_to_int(v) \
    _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vec_to_int _mm512_cvtps_epi32
#define vec_from_bits _mm512_castsi512_ps
#define veci_set1 _mm512_set1_epi32
#define veci_add _mm512_add_epi32
#define veci_shift_left _mm512_slli_epi32
#define vec_load_row(p, i, bf16) ((bf16) ? load16(p, i) : _mm512_loadu_ps((const float *)(p) + (i)))
#define vec_store_row(p, i, v, bf16) \
    ((bf16) ? store16(p, i, v) : _mm512_storeu_ps((float *)(p) + (i), v))
#define vec_round_bf16 round16
#define vec_sum_of_16(acc) _mm512_reduce_add_ps((acc)[0])

/* 16 bfloat16 values at element i of p as 16 floats. */
KERNEL512 static inline __m512 load16(const void *p, int64_t i) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

KERNEL512 static inline __m256i bits16(__m512 v) {
    return (__m256i)_mm512_cvtneps_pbh(v);
}

/* 16 floats stored at element i of p as bfloat16. */
KERNEL512 static inline void store16(void *p, int64_t i, __m512 v) {
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), bits16(v));
}

KERNEL512 static inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits16(v)), 16));
}

#else
#error "VECTOR_BITS must be 256 or 512"
#endif

/* exp of each lane, to about 1 ulp on [-87, 88]: x = n ln2 + r with |r| <= ln2 / 2 (ln2
 * split in two so r stays exact), exp(r) by its Taylor polynomial to r^7, times 2^n. */
VEC_TARGET static inline vec VEC(exp)(vec x) {
    x = vec_max(vec_min(x, vec_set1(88.0f)), vec_set1(-87.0f));
    const vec n = vec_round_to_int(vec_mul(x, vec_set1(1.44269504088896341f)));
    vec r = vec_fnmadd(n, vec_set1(0.693359375f), x);
    r = vec_fnmadd(n, vec_set1(-2.12194440e-4f), r);
    vec p = vec_set1(1.0f / 5040);
    p = vec_fmadd(p, r, vec_set1(1.0f / 720));
    p = vec_fmadd(p, r, vec_set1(1.0f / 120));
    p = vec_fmadd(p, r, vec_set1(1.0f / 24));
    p = vec_fmadd(p, r, vec_set1(1.0f / 6));
    p = vec_fmadd(p, r, vec_set1(0.5f));
    p = vec_fmadd(p, r, vec_set1(1.0f));
    p = vec_fmadd(p, r, vec_set1(1.0f));
    const veci e = veci_shift_left(veci_add(vec_to_int(n), veci_set1(127)), 23);
    return vec_mul(p, vec_from_bits(e));
}

/* What every CPU kernel file shares: the target attributes, the instruction-set level the
 * AVX-512 paths follow, and the small inline helpers of float32 and bfloat16 values.
 *
 * The files beside this one are compiled together into one library, which
 * gateway/models/kernels/cpu/library.py builds at first use and the worker loads. Every
 * kernel runs on x86-64 CPUs with AVX2, FMA and F16C (KERNEL); the functions marked
 * KERNEL512 run only where the CPU has AVX-512 with AVX512_BF16, chosen at run time by
 * gw_runs_avx512_bf16(). Threads are OpenMP's: the library torch itself runs on, so
 * torch's thread count applies and no second pool competes.
 */
#ifndef GW_KERNELS_H
#define GW_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define KERNEL __attribute__((target("avx2,fma,f16c")))
#define KERNEL512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
/* Symbols the kernel files share that the library does not export. */
#define INTERNAL __attribute__((visibility("hidden")))

/* Rows of this many values or more are split between threads (elementwise rows, draws). */
#define ELEMENTWISE_PARALLEL (1 << 15)

/* 1 where the AVX-512 bfloat16 kernels run now: the CPU has AVX-512 with AVX512_BF16, the
 * level Python allows (gw_set_isa_level) reaches it, and the tests have not forbidden them
 * (gw_wide_bf16_rows). Defined in isa.c. */
INTERNAL int gw_runs_avx512_bf16(void);

KERNEL static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

KERNEL static inline float dot(const float *a, const float *b, int64_t count) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float total = hsum(acc);
    for (; i < count; i++) total += a[i] * b[i];
    return total;
}

static inline uint16_t to_bf16(float f) {  /* round to nearest, ties to even */
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* 8 bfloat16 values at p as 8 floats (exact: a bfloat16 is a float's upper half). */
KERNEL static inline __m256 load_bf16x8(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* 8 floats rounded to bfloat16 (to nearest, ties to even; NaN stays NaN), in the upper
 * halves of 8 int32 lanes' lower halves: the 8 bfloat16 values as 8 uint32. */
KERNEL static inline __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}

/* v as bfloat16 would hold it, still as floats (torch's rounding of an intermediate). */
KERNEL static inline __m256 round_bf16x8(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

/* 8 floats stored at element i of p: rounded to bfloat16 when bf16, else as they are. */
KERNEL static inline void store8(void *p, int64_t i, __m256 v, int bf16) {
    if (!bf16) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    const __m256i bits = bf16_bits8(v);  /* each <= 0xffff: the pack does not saturate */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xD8);
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_castsi256_si128(packed));
}

/* 8 values at element i of a row, float32 or bfloat16 (widened), as floats; and one. */
KERNEL static inline __attribute__((always_inline)) __m256 weights8(const void *w, int64_t i,
                                                                    int bf16) {
    return bf16 ? load_bf16x8((const uint16_t *)w + i) : _mm256_loadu_ps((const float *)w + i);
}

static inline __attribute__((always_inline)) float weight1(const void *w, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

#endif

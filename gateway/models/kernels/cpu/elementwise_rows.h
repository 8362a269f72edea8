/* One row of each elementwise step, written once for both vector widths: elementwise.c
 * includes this after vector.h, once for each width (names end in 8 or 16: see vector.h).
 * Each is inlined where bf16 is a constant. In bfloat16 each rounds where torch's ops
 * round. A row holds a multiple of VEC_WIDTH values (its caller checks).
 */

/* x [dim] is a row of the residual stream: with add [dim], x += add first, in place
 * (rounded as torch's add_). Then dst [dim] = x / sqrt(mean(x^2) + eps) * weight: in
 * bfloat16 as HF's Llama computes it (normalised in float32, rounded, then times the
 * weight, rounded), in float32 as F.rms_norm. */
VEC_TARGET static inline __attribute__((always_inline)) void VEC(add_rms_norm_row)(
        char *row, const char *add, const void *weight, int64_t dim, float eps, int bf16,
        char *dst) {
    /* The squares are summed 16 values a step at either width, so both widths sum a row
     * of 16 n values in the same order (at width 8, a row of 16 n + 8 has a tail). */
    enum { PER_16 = 16 / VEC_WIDTH };
    vec acc[PER_16];
    for (int k = 0; k < PER_16; k++) acc[k] = vec_zero();
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) {
        vec v[PER_16];
        for (int k = 0; k < PER_16; k++) v[k] = vec_load_row(row, i + k * VEC_WIDTH, bf16);
        if (add) {
            for (int k = 0; k < PER_16; k++) {
                v[k] = vec_add(v[k], vec_load_row(add, i + k * VEC_WIDTH, bf16));
                if (bf16) v[k] = vec_round_bf16(v[k]);
            }
            for (int k = 0; k < PER_16; k++) vec_store_row(row, i + k * VEC_WIDTH, v[k], bf16);
        }
        for (int k = 0; k < PER_16; k++) acc[k] = vec_fmadd(v[k], v[k], acc[k]);
    }
    for (; VEC_WIDTH == 8 && i < dim; i += VEC_WIDTH) {  /* a tail of 8 */
        vec v = vec_load_row(row, i, bf16);
        if (add) {
            v = vec_add(v, vec_load_row(add, i, bf16));
            if (bf16) v = vec_round_bf16(v);
            vec_store_row(row, i, v, bf16);
        }
        acc[0] = vec_fmadd(v, v, acc[0]);
    }
    const float mean = vec_sum_of_16(acc) / (float)dim;
    const vec scale = vec_set1(1.0f / sqrtf(mean + eps));
    for (i = 0; i < dim; i += VEC_WIDTH) {
        vec v = vec_mul(vec_load_row(row, i, bf16), scale);
        if (bf16) v = vec_round_bf16(v);
        vec_store_row(dst, i, vec_mul(v, vec_load_row(weight, i, bf16)), bf16);
    }
}

/* dst [inter] = silu(gate) * up, silu rounded to bfloat16 before the product where bf16
 * (as F.silu then mul_). */
VEC_TARGET static inline __attribute__((always_inline)) void VEC(silu_mul_row)(
        const char *gate, const char *up, int64_t inter, int bf16, char *dst) {
    const vec one = vec_set1(1.0f), zero = vec_zero();
    for (int64_t i = 0; i < inter; i += VEC_WIDTH) {
        const vec g = vec_load_row(gate, i, bf16);
        vec s = vec_div(g, vec_add(one, VEC(exp)(vec_sub(zero, g))));
        if (bf16) s = vec_round_bf16(s);
        vec_store_row(dst, i, vec_mul(s, vec_load_row(up, i, bf16)), bf16);
    }
}

/* In place, `heads` heads of dim values at x: x * cos + [x2, x1] * sin, with cos and sin
 * [dim] (sin's first half negated), rounded as torch's mul_ then addcmul_ where bf16. */
VEC_TARGET static inline __attribute__((always_inline)) void VEC(rotary_row)(
        char *x, int64_t heads, int64_t dim, const char *c, const char *s, int bf16) {
    const int64_t half = dim / 2, esize = bf16 ? 2 : 4;
    for (int64_t h = 0; h < heads; h++) {
        char *v = x + h * dim * esize;
        for (int64_t i = 0; i < half; i += VEC_WIDTH) {
            const vec x1 = vec_load_row(v, i, bf16), x2 = vec_load_row(v, half + i, bf16);
            vec a = vec_mul(x1, vec_load_row(c, i, bf16));
            vec b = vec_mul(x2, vec_load_row(c, half + i, bf16));
            if (bf16) {
                a = vec_round_bf16(a);
                b = vec_round_bf16(b);
            }
            vec_store_row(v, i, vec_fmadd(x2, vec_load_row(s, i, bf16), a), bf16);
            vec_store_row(v, half + i, vec_fmadd(x1, vec_load_row(s, half + i, bf16), b), bf16);
        }
    }
}

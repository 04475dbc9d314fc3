/* Fused kernels of the built-in CPU platform: RMSNorm (with the residual add), SiLU-and-mul and
 * rotary embedding, each one pass over its rows instead of torch's chain of elementwise ops; and,
 * at the end, the decode matmul by an 8-bit group-wise quantized weight.
 *
 * Semantics are those of the reference ops (loom_plugin_api.ops): arithmetic in fp32, results
 * rounded to the tensor's dtype at the same points the reference rounds, so bf16 outputs agree
 * with it to within float rounding of the fp32 intermediates. Built by loom.platforms.cpu_kernels
 * with the machine's compiler (-O3 -march=native) and cached, like the paged-decode kernel. The
 * rotary loops, and RMSNorm's on CPUs without AVX-512, are plain C that the compiler vectorizes
 * (`omp simd`); SiLU-and-mul is written with explicit vectors, because GCC if-converts the scalar
 * exp's clamp into several masked divisions per lane, some of them computing denormals (ten times
 * slower than torch). With AVX-512, SiLU-and-mul and bf16 RMSNorm use intrinsics, so that their
 * bf16 roundings take `vcvtneps2bf16` where the CPU has it.
 * Rows are split across OpenMP threads (one row, as in decoding one stream, runs on the calling
 * thread: waking the pool costs more than the row), on torch's own pool (libgomp resolves to the copy torch
 * loaded).
 *
 * Every row argument is (rows, row stride) with unit stride inside a row.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef uint16_t bf16_t;

static inline float f32_from_f32(float x) { return x; }
static inline float f32_from_bf16(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f; memcpy(&f, &u, sizeof f); return f;
}
static inline float to_f32(float x) { return x; }
static inline bf16_t to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u; memcpy(&u, &f, sizeof u);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? ((u >> 16) | 0x40u) : r);
}
/* the value a tensor of this dtype holds after rounding f into it */
static inline float round_f32(float f) { return f; }
static inline float round_bf16(float f) { return f32_from_bf16(to_bf16(f)); }

/* Sixteen-float vectors (GCC vector extensions): one AVX-512 register or two AVX2 ones with
 * -march=native, so the elementwise kernels do not depend on the auto-vectorizer. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

/* Lane-wise a > b as all-ones masks. GCC compares these 64-byte vectors one lane at a time
 * (scalar `vucomiss` and `cmova`, sixteen of each) where the CPU has no AVX-512; compared as
 * vectors of the CPU's own width, they take one instruction each (`vcmpps` on AVX2). That made
 * fp32 SiLU-and-mul 1.8x slower than torch's on an AVX2-only EPYC, and greedy sampling's argmax
 * about ten times slower than its memory traffic (2026-12-07). */
#if defined(__AVX512F__)
#define CMP_LANES 16
#elif defined(__AVX__)
#define CMP_LANES 8
#else
#define CMP_LANES 4
#endif
typedef float cmp_vf __attribute__((vector_size(4 * CMP_LANES)));
typedef int32_t cmp_vi __attribute__((vector_size(4 * CMP_LANES)));
#define DEFINE_GT16(NAME, V, PART)                                                                 \
    static inline v16i NAME(V a, V b) {                                                            \
        PART pa[16 / CMP_LANES], pb[16 / CMP_LANES];                                               \
        cmp_vi m[16 / CMP_LANES];                                                                  \
        memcpy(pa, &a, sizeof a);                                                                  \
        memcpy(pb, &b, sizeof b);                                                                  \
        for (int i = 0; i < 16 / CMP_LANES; i++) m[i] = pa[i] > pb[i];                             \
        v16i r; memcpy(&r, m, sizeof r); return r;                                                 \
    }
DEFINE_GT16(gt16, v16f, cmp_vf)  /* floats */
DEFINE_GT16(gt16i, v16i, cmp_vi) /* signed ints */
/* CMP_LANES values widened to fp32: loops that carry vectors from one iteration to the next keep
 * them in registers at this width (GCC spills 64-byte ones to the stack on AVX2 every iteration) */
typedef uint16_t cmp_vh __attribute__((vector_size(2 * CMP_LANES)));
typedef uint32_t cmp_vu __attribute__((vector_size(4 * CMP_LANES)));
static inline cmp_vf loadn_f32(const float *p) { cmp_vf x; memcpy(&x, p, sizeof x); return x; }
static inline cmp_vf loadn_bf16(const bf16_t *p) {
    cmp_vh h; memcpy(&h, p, sizeof h);
    return (cmp_vf)(__builtin_convertvector(h, cmp_vu) << 16);
}

static inline v16f load16_f32(const float *p) { v16f x; memcpy(&x, p, sizeof x); return x; }
static inline v16f load16_bf16(const bf16_t *p) {
    v16h h; memcpy(&h, p, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
}
static inline void store16_f32(float *p, v16f x) { memcpy(p, &x, sizeof x); }
static inline v16u bf16_bits16(v16f x) { /* to_bf16 on sixteen lanes, in the low 16 bits */
    const v16u u = (v16u)x;
    const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v16u nan = (v16u)gt16i((v16i)(u & 0x7fffffffu), (v16i){} + 0x7f800000); /* both below 2^31 */
    return (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
}
static inline void store16_bf16(bf16_t *p, v16f x) {
    const v16h h = __builtin_convertvector(bf16_bits16(x), v16h); memcpy(p, &h, sizeof h);
}
static inline v16f round16_f32(v16f x) { return x; }
static inline v16f round16_bf16(v16f x) { return (v16f)(bf16_bits16(x) << 16); }

/* e^x for any float x (Cephes' expf polynomial, x = n ln2 + r, e^x = 2^n e^r), x clamped to
 * [-87, 88.7] where 2^n stays a normal float: beyond it only the last digits of SiLU's tiny or
 * saturated values differ from the unclamped exp, and no lane ever computes a denormal. exp16 on
 * sixteen lanes, expn on CMP_LANES (GT: a > b as a lane mask at that width). */
static inline cmp_vi gtn(cmp_vf a, cmp_vf b) { return a > b; }
#define DEFINE_EXP(NAME, VF, VI, GT)                                                               \
    static inline VF NAME(VF x) {                                                                  \
        const VF lo = (VF){} - 87.0f, hi = (VF){} + 88.7f;                                         \
        VI m = GT(lo, x);                                                                          \
        x = (VF)(((VI)lo & m) | ((VI)x & ~m));                                                     \
        m = GT(x, hi);                                                                             \
        x = (VF)(((VI)hi & m) | ((VI)x & ~m));                                                     \
        const VF t = x * 1.44269504088896341f + 0.5f;                                              \
        VI n = __builtin_convertvector(t, VI);                /* truncates toward zero ...  */     \
        n -= GT(__builtin_convertvector(n, VF), t) & 1;       /* ... floor: one less when t < 0 */ \
        const VF nf = __builtin_convertvector(n, VF);                                              \
        const VF r = x - nf * 0.693359375f + nf * 2.12194440e-4f;                                  \
        VF p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                            \
        p = p * r + 8.3334519073e-3f;                                                              \
        p = p * r + 4.1665795894e-2f;                                                              \
        p = p * r + 1.6666665459e-1f;                                                              \
        p = p * r + 5.0000001201e-1f;                                                              \
        p = p * r * r + r + 1.0f;                                                                  \
        return (VF)((VI)p + (n << 23));                       /* times 2^n */                      \
    }
DEFINE_EXP(exp16, v16f, v16i, gt16)
DEFINE_EXP(expn, cmp_vf, cmp_vi, gtn)

/* SiLU-and-mul's whole vectors with AVX-512 intrinsics, for bf16: the same arithmetic as the
 * portable loop below (Cephes' exp, a true division, the reference's two roundings, subnormals
 * kept), with one instruction where that loop takes several: the clamps min/max, the floor
 * `vrndscaleps`, the power of two `vscalefps`, the rounding `vcvtneps2bf16` where the CPU has it
 * (vectors with a subnormal lane round in integers, see bf16_bits512). 2.4 -> 0.8 ms for the
 * default model's prefill rows (2,048 x 1,536). Returns how many elements
 * it did (0 elsewhere: the portable loop does them all). */
#if defined(__AVX512F__)
static inline __m512 widen_bf16_512(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.0f));
    const __m512 nf = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                           _mm512_set1_ps(0.5f)),
                                           _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(nf, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.9875691500e-4f), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, nf);
}
/* to_bf16 on sixteen lanes (round to nearest even, NaN quiet), the bits in each lane's low half:
 * `vcvtneps2bf16` where the CPU has it and no lane is subnormal (it would flush those to zero,
 * torch keeps them), else integer arithmetic as bf16_bits16 (about twice the time of the whole
 * loop's vcvtneps2bf16 version) */
static inline __m512i bf16_bits512(__m512 x) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    if (!_mm512_fpclass_ps_mask(x, 0x20)) /* 0x20: the denormal class */
        return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
#endif
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan);
}
static inline __m512 load_bf16_512(const bf16_t *p) { return widen_bf16_512(_mm256_loadu_si256((const void *)p)); }
/* x rounded to bf16 and widened back (round_bf16 on sixteen lanes) */
static inline __m512 round_bf16_512(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits512(x), 16)); }
static inline void store16_bf16_512(bf16_t *p, __m512 x) {
    _mm256_storeu_si256((void *)p, _mm512_cvtepi32_epi16(bf16_bits512(x)));
}
/* silu(a) rounded to bf16, times u, on sixteen lanes (the caller rounds the product): also the
 * epilogue of cpu_gemm.c's one-pass gate/up GEMM, which gives these bits so */
static inline __m512 silu_mul_bf16_512(__m512 a, __m512 u) {
    const __m512 s = _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), a))));
    return _mm512_mul_ps(round_bf16_512(s), u);
}
static inline int64_t silu_and_mul_wide_bf16(const bf16_t *g, const bf16_t *u, bf16_t *o, int64_t d) {
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) store16_bf16_512(o + i, silu_mul_bf16_512(load_bf16_512(g + i), load_bf16_512(u + i)));
    return i;
}
#else
static inline int64_t silu_and_mul_wide_bf16(const bf16_t *g, const bf16_t *u, bf16_t *o, int64_t d) {
    (void)g, (void)u, (void)o, (void)d;
    return 0;
}
#endif
/* fp32 SiLU-and-mul's whole vectors of the CPU's width: the portable loop's arithmetic, which
 * GCC compiles through the stack where sixteen lanes are two registers (1.3-1.7 -> 1.1-1.2 ms for
 * 1,670 x 1,536 on an AVX2 EPYC, about the time its 40 MB of memory traffic takes) */
static inline int64_t silu_and_mul_wide_f32(const float *g, const float *u, float *o, int64_t d) {
    int64_t i = 0;
    for (; i + CMP_LANES <= d; i += CMP_LANES) {
        const cmp_vf a = loadn_f32(g + i);
        const cmp_vf y = a / (1.0f + expn(-a)) * loadn_f32(u + i);
        memcpy(o + i, &y, sizeof y);
    }
    return i;
}

/* One bf16 row of RMSNorm with AVX-512 intrinsics, n a multiple of 16: the portable loop's
 * arithmetic (the sum of squares in sixteen fp32 lanes, here with fused multiply-adds) and its
 * roundings, through bf16_bits512: `vcvtneps2bf16` where the CPU has it instead of the integer
 * rounding the compiler makes of to_bf16, up to three per element. 1.4-1.8x faster on the default
 * model's rows (64 or 1,670 x 576 with the residual, 2026-12-06). s: the row's fp32 sums. Returns
 * 0 where it cannot take the row (the portable loop does it). */
#if defined(__AVX512F__)
static inline int rms_norm_row_bf16(const bf16_t *x, const bf16_t *r, bf16_t *ro, const bf16_t *w, bf16_t *o,
                                    int64_t n, float eps, float *s) {
    if (n % 16) return 0;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __m512 v = load_bf16_512(x + i);
        if (r) {
            v = _mm512_add_ps(v, load_bf16_512(r + i));
            store16_bf16_512(ro + i, v);
        }
        _mm512_storeu_ps(s + i, v);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 y = round_bf16_512(_mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
        store16_bf16_512(o + i, _mm512_mul_ps(y, load_bf16_512(w + i)));
    }
    return 1;
}
#else
static inline int rms_norm_row_bf16(const bf16_t *x, const bf16_t *r, bf16_t *ro, const bf16_t *w, bf16_t *o,
                                    int64_t n, float eps, float *s) {
    (void)x, (void)r, (void)ro, (void)w, (void)o, (void)n, (void)eps, (void)s;
    return 0;
}
#endif
static inline int rms_norm_row_f32(const float *x, const float *r, float *ro, const float *w, float *o,
                                   int64_t n, float eps, float *s) {
    (void)x, (void)r, (void)ro, (void)w, (void)o, (void)n, (void)eps, (void)s;
    return 0;
}

#define DEFINE_KERNELS(NAME, T)                                                                  \
/* out = (s * rsqrt(mean(s^2) + eps)) rounded, times weight, rounded; s = x (+ residual) in fp32, \
 * and res_out = s rounded when residual is given. n <= 16384 (a row of fp32 on the stack). */                                \
int rms_norm_##NAME(const T *x, int64_t xs, const T *res, int64_t rs, const T *w, T *out,          \
                    int64_t os, T *res_out, int64_t ros, int64_t rows, int64_t n, float eps,       \
                    int nthreads) {                                                                \
    if (n > 16384) return 2;                                                                          \
    _Pragma("omp parallel for if(rows > 1) num_threads(nthreads) schedule(static)")                             \
    for (int64_t t = 0; t < rows; t++) {                                                           \
        float s[n];                                                                                \
        const T *xr = x + t * xs;                                                                  \
        if (rms_norm_row_##NAME(xr, res ? res + t * rs : NULL, res ? res_out + t * ros : NULL, w,   \
                                out + t * os, n, eps, s))                                          \
            continue;                                                                              \
        float sq = 0.f;                                                                            \
        if (res) {                                                                                 \
            const T *rr = res + t * rs;                                                            \
            T *ro = res_out + t * ros;                                                             \
            _Pragma("omp simd reduction(+:sq)")                                                    \
            for (int64_t i = 0; i < n; i++) {                                                      \
                s[i] = f32_from_##NAME(xr[i]) + f32_from_##NAME(rr[i]);                           \
                ro[i] = to_##NAME(s[i]);                                                           \
                sq += s[i] * s[i];                                                                 \
            }                                                                                      \
        } else {                                                                                   \
            _Pragma("omp simd reduction(+:sq)")                                                    \
            for (int64_t i = 0; i < n; i++) {                                                      \
                s[i] = f32_from_##NAME(xr[i]);                                                     \
                sq += s[i] * s[i];                                                                 \
            }                                                                                      \
        }                                                                                          \
        const float inv = 1.0f / sqrtf(sq / (float)n + eps);                                       \
        T *o = out + t * os;                                                                       \
        _Pragma("omp simd")                                                                        \
        for (int64_t i = 0; i < n; i++)                                                            \
            o[i] = to_##NAME(round_##NAME(s[i] * inv) * f32_from_##NAME(w[i]));                   \
    }                                                                                              \
    return 0;                                                                                      \
}                                                                                                  \
                                                                                                   \
/* out[t, i] = silu(x[t, i]) rounded, times x[t, d + i], rounded */                                \
int silu_and_mul_##NAME(const T *x, int64_t xs, T *out, int64_t os, int64_t rows, int64_t d,      \
                        int nthreads) {                                                            \
    _Pragma("omp parallel for if(rows > 1) num_threads(nthreads) schedule(static)")                             \
    for (int64_t t = 0; t < rows; t++) {                                                           \
        const T *g = x + t * xs, *u = g + d;                                                       \
        T *o = out + t * os;                                                                       \
        int64_t i = silu_and_mul_wide_##NAME(g, u, o, d);                                          \
        for (; i + 16 <= d; i += 16) {                                                               \
            const v16f a = load16_##NAME(g + i);                                                     \
            store16_##NAME(o + i, round16_##NAME(round16_##NAME(a / (1.0f + exp16(-a))) * load16_##NAME(u + i))); \
        }                                                                                          \
        if (i < d) { /* the tail, through a zero-padded vector */                                 \
            T gt[16] = {0}, ut[16] = {0}, ot[16];                                                     \
            memcpy(gt, g + i, (d - i) * sizeof(T));                                                \
            memcpy(ut, u + i, (d - i) * sizeof(T));                                                \
            const v16f a = load16_##NAME(gt);                                                        \
            store16_##NAME(ot, round16_##NAME(round16_##NAME(a / (1.0f + exp16(-a))) * load16_##NAME(ut))); \
            memcpy(o + i, ot, (d - i) * sizeof(T));                                                \
        }                                                                                          \
    }                                                                                              \
    return 0;                                                                                      \
}                                                                                                  \
                                                                                                   \
/* Rotate the first rot channels of every head of q (hq heads) and k (hk heads) in place, by    \
 * the fp32 [cos | sin] row of each token's position; NeoX halves or GPT-J pairs. */               \
int rotary_##NAME(const int64_t *pos, T *q, int64_t qs, int64_t hq, T *k, int64_t ks, int64_t hk,  \
                  const float *cos_sin, int64_t css, int64_t max_pos, int64_t rows, int64_t D,     \
                  int64_t rot, int neox, int nthreads) {                                           \
    int bad = 0;                                                                                   \
    const int64_t half = rot / 2;                                                                  \
    _Pragma("omp parallel for if(rows > 1) num_threads(nthreads) schedule(static)")                             \
    for (int64_t t = 0; t < rows; t++) {                                                           \
        const int64_t p = pos[t];                                                                  \
        if (p < 0 || p >= max_pos) { _Pragma("omp atomic write") bad = 1; continue; }              \
        const float *c = cos_sin + p * css, *sn = c + half;                                        \
        for (int64_t h = 0; h < hq + hk; h++) {                                                    \
            T *x = h < hq ? q + t * qs + h * D : k + t * ks + (h - hq) * D;                        \
            if (neox) {                                                                            \
                _Pragma("omp simd")                                                                \
                for (int64_t i = 0; i < half; i++) {                                               \
                    const float x1 = f32_from_##NAME(x[i]), x2 = f32_from_##NAME(x[i + half]);     \
                    x[i] = to_##NAME(x1 * c[i] - x2 * sn[i]);                                      \
                    x[i + half] = to_##NAME(x2 * c[i] + x1 * sn[i]);                               \
                }                                                                                  \
            } else {                                                                               \
                for (int64_t i = 0; i < half; i++) {                                               \
                    const float x1 = f32_from_##NAME(x[2 * i]), x2 = f32_from_##NAME(x[2 * i + 1]); \
                    x[2 * i] = to_##NAME(x1 * c[i] - x2 * sn[i]);                                  \
                    x[2 * i + 1] = to_##NAME(x2 * c[i] + x1 * sn[i]);                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    return bad ? 3 : 0;                                                                            \
}

DEFINE_KERNELS(f32, float)
DEFINE_KERNELS(bf16, bf16_t)

/* ---- The running argmax of greedy sampling ----
 * For each of `rows` rows of n values: the index of the first largest value and that value in
 * fp32, as torch.max(dim=-1) gives them (torch's kernel takes about 0.45 ns per bf16 value, more
 * than the LM head's chunk matmul that made them for a small model). Sixteen lanes (in vectors of
 * the CPU's width) keep their own largest value and where it was first seen; the lanes' results
 * merge by value, then by the smaller index. A NaN never wins (a row of nothing but NaN gives
 * -inf at index 0). */
#define ARGMAX_PARTS (16 / CMP_LANES)
#define DEFINE_ARGMAX(NAME, T)                                                                     \
int row_argmax_##NAME(const T *x, int64_t xs, int64_t rows, int64_t n, float *val, int64_t *idx,   \
                      int nthreads) {                                                              \
    _Pragma("omp parallel for if(rows > 1) num_threads(nthreads) schedule(static)")                \
    for (int64_t t = 0; t < rows; t++) {                                                           \
        const T *r = x + t * xs;                                                                   \
        cmp_vf best[ARGMAX_PARTS];                                                                 \
        cmp_vi at[ARGMAX_PARTS], cur[ARGMAX_PARTS];                                                \
        for (int p = 0; p < ARGMAX_PARTS; p++)                                                     \
            for (int l = 0; l < CMP_LANES; l++) {                                                  \
                best[p][l] = -INFINITY; at[p][l] = 0; cur[p][l] = p * CMP_LANES + l;               \
            }                                                                                      \
        int64_t i = 0;                                                                             \
        for (; i + 16 <= n && i + 16 <= INT32_MAX; i += 16)                                        \
            for (int p = 0; p < ARGMAX_PARTS; p++) {                                               \
                const cmp_vf v = loadn_##NAME(r + i + p * CMP_LANES);                              \
                const cmp_vi gt = v > best[p];                                                     \
                best[p] = (cmp_vf)(((cmp_vi)v & gt) | ((cmp_vi)best[p] & ~gt));                    \
                at[p] = (cur[p] & gt) | (at[p] & ~gt);                                             \
                cur[p] += 16;                                                                      \
            }                                                                                      \
        float m = -INFINITY;                                                                       \
        int64_t a = 0;                                                                             \
        for (int p = 0; p < ARGMAX_PARTS; p++)                                                     \
            for (int l = 0; l < CMP_LANES; l++)                                                    \
                if (best[p][l] > m || (best[p][l] == m && at[p][l] < a)) { m = best[p][l]; a = at[p][l]; } \
        for (; i < n; i++) {                                                                       \
            const float f = f32_from_##NAME(r[i]);                                                 \
            if (f > m) { m = f; a = i; }                                                           \
        }                                                                                          \
        val[t] = m;                                                                                \
        idx[t] = a;                                                                                \
    }                                                                                              \
    return 0;                                                                                      \
}

DEFINE_ARGMAX(f32, float)
DEFINE_ARGMAX(bf16, bf16_t)

/* ---- Embedding rows gathered from the LM head's oneDNN-packed chunks ----
 * A tied embedding looks its rows up in the weight the LM head keeps packed for oneDNN
 * (loom/layers/onednn.py), instead of in a second, dense copy. Row `id` lies in chunk
 * id / chunk_rows; its elements come in runs of `group` adjacent ones (1 in oneDNN's fp32
 * layouts, 2 in its bf16 ones), run k starting row_offset[id] + k * col_stride elements into that
 * chunk's buffer (a layout onednn.py read back by packing probe weights). A copy, bit for bit. An
 * id outside [0, rows) leaves its output row alone and makes the call return 1: the caller
 * raises, as F.embedding would. */
#define DEFINE_GATHER(NAME, T)                                                                     \
int gather_rows_##NAME(const T *const *chunks, int64_t chunk_rows, const int64_t *row_offset,      \
                       int64_t col_stride, int64_t group, int64_t cols, int64_t rows,              \
                       const int64_t *ids, int64_t n, T *out, int nthreads) {                      \
    int bad = 0;                                                                                   \
    _Pragma("omp parallel for if(n >= 256) num_threads(nthreads) schedule(static) reduction(|:bad)") \
    for (int64_t t = 0; t < n; t++) {                                                              \
        const int64_t id = ids[t];                                                                 \
        if (id < 0 || id >= rows) { bad = 1; continue; }                                           \
        const T *src = chunks[id / chunk_rows] + row_offset[id];                                   \
        T *dst = out + t * cols;                                                                   \
        if (group == 1) {                                                                          \
            for (int64_t i = 0; i < cols; i++) dst[i] = src[i * col_stride];                       \
        } else {                                                                                   \
            for (int64_t i = 0; i < cols; i += group, src += col_stride)                           \
                for (int64_t j = 0; j < group && i + j < cols; j++) dst[i + j] = src[j];           \
        }                                                                                          \
    }                                                                                              \
    return bad;                                                                                    \
}

DEFINE_GATHER(f32, float)
DEFINE_GATHER(bf16, bf16_t)

/* ---- Weight-only 8-bit group-wise quantized matmul for a few rows (decode) ----
 *
 * out[r, o] = sum_i x[r, i] * ((q[o, i] - 128) * scale[o, i / G] + zero[o, i / G]), fp32 sums.
 * q is uint8 (N, K) row-major, scale and zero float32 (N, K / G); G a multiple of 16 dividing K.
 * Decode reads the whole weight for a handful of rows, so each weight byte is read once per call
 * for all rows (up to 8): a tile holds OB outputs x R rows of vector accumulators and dequantizes
 * each vector of codes once for all R rows, w = q * s + (z - 128 s) (one FMA, exact in its
 * product), then one FMA per row. Folding the zero into w costs the same one instruction per
 * vector as the scale alone, so the zero * sum(x over the group) term needs no group sums. x is
 * converted to fp32 once per call into a small buffer (R * K floats) that stays in L1/L2.
 * Outputs are split across threads in contiguous slices, each thread streaming its own part of
 * the weight. On a 2-core Zen 4 one row runs at ~20 GB/s (the widening and converting of the
 * codes plus the FMAs take about as long as the memory); several rows are bound by the FMAs. */

/* The tile's vectors are the machine's own width: sixteen floats with AVX-512, eight otherwise
 * (GCC keeps arrays of 64-byte vectors in memory when it has to split each into two registers).
 * The codes are widened with x86's vpmovzxbd: GCC (12) scalarizes __builtin_convertvector from
 * bytes to ints (byte by byte through general registers, ten times the work); other targets get
 * a loop the vectorizer handles. */
#if defined(__AVX512F__)
#define Q8_VL 16
typedef v16f q8v;
static inline q8v q8_load_codes(const uint8_t *p) { /* as floats 0..255 */
    return (q8v)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#else
#define Q8_VL 8
typedef float q8v __attribute__((vector_size(32)));
static inline q8v q8_load_codes(const uint8_t *p) {
#if defined(__AVX2__)
    return (q8v)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    q8v r;
    for (int l = 0; l < Q8_VL; l++) r[l] = p[l];
    return r;
#endif
}
#endif
static inline q8v q8_load_f32(const float *p) { q8v x; memcpy(&x, p, sizeof x); return x; }
static inline float q8_hsum(q8v v) {
    float s = 0.f;
    for (int l = 0; l < Q8_VL; l++) s += v[l];
    return s;
}

/* Bytes ahead of the codes being read to prefetch: with the hardware prefetchers alone an LM head
 * of 576-byte rows streamed at ~13 GB/s on the machine above; 1-4 KiB ahead gives ~20. */
#define Q8_PREFETCH 2048

/* OB outputs (weight rows q, q + K, ...) times R rows of xf (row stride K) into res[oo * R + r].
 * R and OB are literals, so the accumulators are registers: OB * R + R + 1 vectors, at most 25
 * of AVX-512's 32 (AVX2's 16 spill a few from 4 rows up); GC is the group size as a literal too
 * (0: the argument), which lets the compiler unroll the group's loop (~10% for groups of 32). */
typedef void (*q8_tile_fn)(const float *, int64_t, int64_t, const uint8_t *, const float *,
                           const float *, float *);
#define Q8_TILE(NAME, R, OB, GC)                                                                   \
static void NAME(const float *xf, int64_t K, int64_t group, const uint8_t *q, const float *scale, \
                 const float *zero, float *res) {                                                  \
    const int64_t G = GC ? GC : group;                                                             \
    q8v acc[OB][R];                                                                                \
    for (int oo = 0; oo < OB; oo++)                                                                \
        for (int r = 0; r < R; r++) acc[oo][r] = (q8v){};                                          \
    const int64_t ng = K / G;                                                                      \
    for (int64_t g = 0; g < ng; g++) {                                                             \
        float s[OB], z[OB];                                                                        \
        for (int oo = 0; oo < OB; oo++) {                                                          \
            for (int64_t b = 0; b < G; b += 64)                                                    \
                __builtin_prefetch(q + oo * K + g * G + b + Q8_PREFETCH);                          \
            s[oo] = scale[oo * ng + g];                                                            \
            z[oo] = zero[oo * ng + g] - 128.0f * s[oo];                                            \
        }                                                                                          \
        for (int64_t i = g * G; i < (g + 1) * G; i += Q8_VL) {                                     \
            q8v xv[R];                                                                             \
            for (int r = 0; r < R; r++) xv[r] = q8_load_f32(xf + r * K + i);                       \
            for (int oo = 0; oo < OB; oo++) {                                                      \
                const q8v w = q8_load_codes(q + oo * K + i) * s[oo] + z[oo];                       \
                for (int r = 0; r < R; r++) acc[oo][r] += w * xv[r];                               \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int oo = 0; oo < OB; oo++)                                                                \
        for (int r = 0; r < R; r++) res[oo * R + r] = q8_hsum(acc[oo][r]);                         \
}

/* Outputs [o0, o1) for R rows: OB at a time, then one at a time for what is left (the tile of
 * one output does the same arithmetic per output as the tile of OB). */
#define Q8_RANGE(R, OB)                                                                            \
Q8_TILE(q8_tile_##R, R, OB, 0) Q8_TILE(q8_tile32_##R, R, OB, 32)                                   \
Q8_TILE(q8_tile128_##R, R, OB, 128) Q8_TILE(q8_tail_##R, R, 1, 0)                                  \
Q8_TILE(q8_tail32_##R, R, 1, 32) Q8_TILE(q8_tail128_##R, R, 1, 128)                                \
static void q8_range_##R(const float *xf, int64_t K, int64_t G, const uint8_t *q,                  \
                         const float *scale, const float *zero, void *out, int64_t os, int bf16,   \
                         int64_t o0, int64_t o1) {                                                 \
    const int64_t ng = K / G;                                                                      \
    const q8_tile_fn tile = G == 32 ? q8_tile32_##R : G == 128 ? q8_tile128_##R : q8_tile_##R;     \
    const q8_tile_fn tail = G == 32 ? q8_tail32_##R : G == 128 ? q8_tail128_##R : q8_tail_##R;     \
    float res[OB * R];                                                                             \
    for (int64_t o = o0; o < o1;) {                                                                \
        const int ob = o + OB <= o1 ? OB : 1;                                                      \
        (ob == OB ? tile : tail)(xf, K, G, q + o * K, scale + o * ng, zero + o * ng, res);         \
        for (int oo = 0; oo < ob; oo++)                                                            \
            for (int r = 0; r < R; r++) {                                                          \
                if (bf16) ((bf16_t *)out)[r * os + o + oo] = to_bf16(res[oo * R + r]);             \
                else ((float *)out)[r * os + o + oo] = res[oo * R + r];                            \
            }                                                                                      \
        o += ob;                                                                                   \
    }                                                                                              \
}

/* Four outputs a tile for one row; two from two rows up, where the FMAs, not memory, bound the
 * time and smaller tiles measured as fast or faster. OB divides 8 (see q8_run). */
Q8_RANGE(1, 4) Q8_RANGE(2, 2) Q8_RANGE(3, 2) Q8_RANGE(4, 2)
Q8_RANGE(5, 2) Q8_RANGE(6, 2) Q8_RANGE(7, 2) Q8_RANGE(8, 2)

typedef void (*q8_range_fn)(const float *, int64_t, int64_t, const uint8_t *, const float *,
                            const float *, void *, int64_t, int, int64_t, int64_t);
static const q8_range_fn q8_ranges[8] = {q8_range_1, q8_range_2, q8_range_3, q8_range_4,
                                         q8_range_5, q8_range_6, q8_range_7, q8_range_8};

static void q8_run(const float *xf, int64_t rows, const uint8_t *q, const float *scale,
                   const float *zero, void *out, int64_t os, int bf16, int64_t N, int64_t K,
                   int64_t G, int nthreads) {
    const q8_range_fn range = q8_ranges[rows - 1];
    _Pragma("omp parallel num_threads(nthreads)")
    {
        /* contiguous slices in whole 8s (a multiple of every OB): only the last output's few
         * leftovers take the one-output tile, whatever the number of threads */
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t per = ((N + nt - 1) / nt + 7) / 8 * 8;
        const int64_t o0 = t * per < N ? t * per : N, o1 = o0 + per < N ? o0 + per : N;
        if (o0 < o1) range(xf, K, G, q, scale, zero, out, os, bf16, o0, o1);
    }
}

#define DEFINE_Q8(NAME, T)                                                                         \
/* out (rows, N), row stride os, = x (rows, K), row stride xs, times the dequantized weight^T.   \
 * 0, or 2: rows outside 0..8, 3: G not a multiple of 16 dividing K, 4: out of memory. */          \
int q8_linear_##NAME(const T *x, int64_t xs, const uint8_t *q, const float *scale,                 \
                     const float *zero, T *out, int64_t os, int64_t rows, int64_t N, int64_t K,    \
                     int64_t G, int nthreads) {                                                    \
    if (rows < 0 || rows > 8) return 2;                                                            \
    if (G <= 0 || G % 16 || K % G) return 3;                                                       \
    if (rows == 0 || N == 0) return 0;                                                             \
    float *xf = malloc((size_t)(rows * K) * sizeof(float));                                        \
    if (!xf) return 4;                                                                             \
    for (int64_t r = 0; r < rows; r++)                                                             \
        for (int64_t i = 0; i < K; i++) xf[r * K + i] = f32_from_##NAME(x[r * xs + i]);           \
    q8_run(xf, rows, q, scale, zero, out, os, sizeof(T) == 2, N, K, G, nthreads);                  \
    free(xf);                                                                                      \
    return 0;                                                                                      \
}

DEFINE_Q8(f32, float)
DEFINE_Q8(bf16, bf16_t)

/* ---- Weight-only 4-bit group-wise quantized matmul for a few rows (decode) ----
 *
 * out[r, o] = sum_i x[r, i] * ((q[o, i] - 8) * scale[o, i / G] + zero[o, i / G]), fp32 sums.
 * q in 0..15, packed two to a byte (CpuKernels.pack_q4): a row of K codes is K / 2 bytes in
 * chunks of 64 codes, 32 bytes each, byte m = c[m] | c[32 + m] << 4 (GGUF's Q4 blocks, twice as
 * long); when K % 64 == 32 the row ends in a chunk of 32 codes, 16 bytes, byte m = c[m] |
 * c[16 + m] << 4. scale and zero float32 (N, K / G); G a multiple of 32 dividing K.
 *
 * Sums are taken per group with the scale outside: out = sum_g s_g * sum_{i in g} x_i (q_i - 8)
 * + sum_g z_g * X_g, X_g = sum_{i in g} x_i (summed once per call for all outputs), so a vector
 * of codes costs one FMA per row and the group one more; the zero term is a dot of the output's
 * zeros with the X_g, sixteen groups a vector, added once per output.
 *
 * With AVX-512 BF16 a bf16 x is multiplied as it is: a chunk's 32 bytes are widened to 16-bit
 * lanes (vpmovzxbw), the low nibbles looked up (vpermw, which reads an index's low 5 bits, in a
 * table of bf16 (q - 8) held twice) and the high ones after a shift, giving 64 codes in order as
 * two vectors of 32 bf16, each one vdpbf16ps per row: products of bf16 and small integers are
 * exact, summed in fp32. An f32 x (or bf16 without AVX512_BF16) takes 16 codes a vector widened
 * to ints (vpmovzxbd, and/shift), converted and FMAed; targets without AVX-512 plain C loops. */

/* the code at i of a packed row of K codes (the layout above) */
static inline int q4_code(const uint8_t *row, int64_t K, int64_t i) {
    const int64_t c0 = i / 64 * 64, h = c0 + 64 <= K ? 32 : 16, p = i - c0;
    const uint8_t b = row[c0 / 2 + p % h];
    return p < h ? b & 15 : b >> 4;
}

/* Bytes ahead of the codes being read to prefetch (each of a tile's weight rows), and ahead of
 * the scales and zeros (a quarter of the codes' rate with groups of 32). */
#define Q4_PREFETCH 4096
#define Q4_PREFETCH_SZ 1024

/* the tiles take scale and zero as float (N, K / G) each (f32 x), or (bf16 x) scale as the pairs
 * sz (N, K / G) of uint32: bf16 scale in the low half, bf16 zero in the high (zero unused) */
typedef void (*q4_tile_fn)(const void *, int64_t, const float *, int64_t, int64_t, const uint8_t *,
                           const void *, const void *, float *);

/* a bf16 pair's scale and zero as floats: bf16 is fp32's high half */
static inline float q4_pair_scale(uint32_t u) {
    union { uint32_t u; float f; } v = {u << 16};
    return v.f;
}
static inline float q4_pair_zero(uint32_t u) {
    union { uint32_t u; float f; } v = {u & 0xffff0000u};
    return v.f;
}

/* Portable tile: one output, R rows of f32 x; sums x * q per group, then as above (the zero
 * term with (z - 8 s), the codes being 0..15). */
#define Q4_TILE_C(NAME, R)                                                                         \
static void NAME(const void *xv, int64_t xs, const float *X, int64_t K, int64_t G,                 \
                 const uint8_t *q, const void *scalev, const void *zerov, float *res) {            \
    const float *x = xv, *scale = scalev, *zero = zerov;                                           \
    const int64_t ng = K / G;                                                                      \
    float acc[R];                                                                                  \
    for (int r = 0; r < R; r++) acc[r] = 0.f;                                                      \
    for (int64_t g = 0; g < ng; g++) {                                                             \
        float d[R];                                                                                \
        for (int r = 0; r < R; r++) d[r] = 0.f;                                                    \
        for (int64_t i = g * G; i < (g + 1) * G; i += 32) {                                        \
            float c[32];                                                                           \
            for (int m = 0; m < 32; m++) c[m] = (float)q4_code(q, K, i + m);                       \
            for (int r = 0; r < R; r++)                                                            \
                for (int m = 0; m < 32; m++) d[r] += x[r * xs + i + m] * c[m];                     \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            acc[r] += scale[g] * d[r] + (zero[g] - 8.0f * scale[g]) * X[r * ng + g];               \
    }                                                                                              \
    for (int r = 0; r < R; r++) res[r] = acc[r];                                                   \
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* the zero term of OB outputs into their accumulators: acc[oo][r] += sum_g zz[oo, g] X[r, g],
 * zz = z (MINUS8 0) or z - 8 s (MINUS8 1), sixteen groups a vector */
#define Q4_ZERO_TERM(OB, R, MINUS8)                                                                \
    for (int64_t g = 0; g < ng; g += 16) {                                                         \
        const __mmask16 mk = ng - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (ng - g)) - 1);  \
        __m512 xg[R];                                                                              \
        for (int r = 0; r < R; r++) xg[r] = _mm512_maskz_loadu_ps(mk, X + r * ng + g);             \
        for (int oo = 0; oo < OB; oo++) {                                                          \
            __m512 zz = MINUS8 ? _mm512_maskz_loadu_ps(mk, zero + oo * ng + g)                     \
                               : _mm512_castsi512_ps(_mm512_and_si512(                             \
                                     _mm512_maskz_loadu_epi32(mk, sz + oo * ng + g),               \
                                     _mm512_set1_epi32((int)0xffff0000u)));                        \
            if (MINUS8)                                                                            \
                zz = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, scale + oo * ng + g),               \
                                     _mm512_set1_ps(-8.0f), zz);                                   \
            for (int r = 0; r < R; r++) acc[oo][r] = _mm512_fmadd_ps(zz, xg[r], acc[oo][r]);       \
        }                                                                                          \
    }

#define Q4_PREFETCH_TILE(OB, TWO)                                                                  \
    for (int64_t b = 0; b < OB * ng * 4; b += 64) {                                                \
        __builtin_prefetch((const char *)scalev + b + Q4_PREFETCH_SZ);                             \
        if (TWO) __builtin_prefetch((const char *)zerov + b + Q4_PREFETCH_SZ);                     \
    }

/* after the piece of 32 codes ending at e: whether a group ends there */
#define Q4_GROUP_ENDS(GC, e) ((GC) == 32 ? 1 : ((e) % G) == 0)
#define Q4_FLUSH(OB, R, S)                                                                         \
    for (int oo = 0; oo < OB; oo++) {                                                              \
        const __m512 s = _mm512_set1_ps(S);                                                        \
        for (int r = 0; r < R; r++) {                                                              \
            acc[oo][r] = _mm512_fmadd_ps(t[oo][r], s, acc[oo][r]);                                 \
            t[oo][r] = _mm512_setzero_ps();                                                        \
        }                                                                                          \
    }                                                                                              \
    g++;

/* OB outputs (packed rows q, q + K / 2, ...) times R rows of f32 x (row stride xs) into
 * res[oo * R + r]; GC the group size as a literal (0: the argument) */
#define Q4_TILE_F(NAME, R, OB, GC)                                                                 \
static void NAME(const void *xv, int64_t xs, const float *X, int64_t K, int64_t group,             \
                 const uint8_t *q, const void *scalev, const void *zerov, float *res) {            \
    const float *x = xv, *scale = scalev, *zero = zerov;                                           \
    const uint32_t *sz = NULL;                                                                     \
    (void)sz;                                                                                      \
    const int64_t G = GC ? GC : group, ng = K / G, kb = K / 2;                                     \
    const __m512i m15 = _mm512_set1_epi32(15);                                                     \
    __m512 acc[OB][R], t[OB][R];                                                                   \
    for (int oo = 0; oo < OB; oo++)                                                                \
        for (int r = 0; r < R; r++) acc[oo][r] = t[oo][r] = _mm512_setzero_ps();                   \
    Q4_PREFETCH_TILE(OB, 1)                                                                        \
    int64_t g = 0;                                                                                 \
    for (int64_t c = 0; c < K; c += 64) {                                                          \
        if (c + 64 <= K) {                                                                         \
            __m512 lo[OB][2], hi[OB][2];                                                           \
            for (int oo = 0; oo < OB; oo++) {                                                      \
                const uint8_t *p = q + oo * kb + c / 2;                                            \
                if (!(c & 127)) __builtin_prefetch(p + Q4_PREFETCH);                               \
                for (int h = 0; h < 2; h++) {                                                      \
                    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * h))); \
                    lo[oo][h] = _mm512_cvtepi32_ps(_mm512_and_si512(b, m15));                      \
                    hi[oo][h] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));                       \
                }                                                                                  \
            }                                                                                      \
            for (int r = 0; r < R; r++) {                                                          \
                const __m512 x0 = _mm512_loadu_ps(x + r * xs + c), x1 = _mm512_loadu_ps(x + r * xs + c + 16); \
                for (int oo = 0; oo < OB; oo++)                                                    \
                    t[oo][r] = _mm512_fmadd_ps(lo[oo][1], x1, _mm512_fmadd_ps(lo[oo][0], x0, t[oo][r])); \
            }                                                                                      \
            if (Q4_GROUP_ENDS(GC, c + 32)) { Q4_FLUSH(OB, R, scale[oo * ng + g]) }                                     \
            for (int r = 0; r < R; r++) {                                                          \
                const __m512 x2 = _mm512_loadu_ps(x + r * xs + c + 32), x3 = _mm512_loadu_ps(x + r * xs + c + 48); \
                for (int oo = 0; oo < OB; oo++)                                                    \
                    t[oo][r] = _mm512_fmadd_ps(hi[oo][1], x3, _mm512_fmadd_ps(hi[oo][0], x2, t[oo][r])); \
            }                                                                                      \
            if (Q4_GROUP_ENDS(GC, c + 64)) { Q4_FLUSH(OB, R, scale[oo * ng + g]) }               \
        } else { /* the last 32 codes */                                                           \
            for (int oo = 0; oo < OB; oo++) {                                                      \
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + oo * kb + c / 2))); \
                const __m512 c0 = _mm512_cvtepi32_ps(_mm512_and_si512(b, m15));                    \
                const __m512 c1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));                     \
                for (int r = 0; r < R; r++)                                                        \
                    t[oo][r] = _mm512_fmadd_ps(c1, _mm512_loadu_ps(x + r * xs + c + 16),           \
                                               _mm512_fmadd_ps(c0, _mm512_loadu_ps(x + r * xs + c), t[oo][r])); \
            }                                                                                      \
            Q4_FLUSH(OB, R, scale[oo * ng + g])                                                    \
        }                                                                                          \
    }                                                                                              \
    Q4_ZERO_TERM(OB, R, 1)                                                                         \
    for (int oo = 0; oo < OB; oo++)                                                                \
        for (int r = 0; r < R; r++) res[oo * R + r] = _mm512_reduce_add_ps(acc[oo][r]);            \
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define Q4_BF16_DP 1
/* bf16 (q - 8) for q = 0..15, twice: vpermw's table for an index's low 5 bits */
static inline __m512i q4_lut(void) {
    const __m512 f = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    return (__m512i)_mm512_cvtne2ps_pbh(f, f);
}
#define Q4_DP(acc, codes, xp) _mm512_dpbf16_ps(acc, (__m512bh)(codes), (__m512bh)_mm512_loadu_si512(xp))

/* as Q4_TILE_F for R rows of bf16 x, multiplied by vdpbf16ps. Groups of 32 (GC 32): each half
 * chunk is its own group, scaled as it is summed; otherwise sums run over the group's pieces. */
#define Q4_TILE_B(NAME, R, OB, GC)                                                                 \
static void NAME(const void *xv, int64_t xs, const float *X, int64_t K, int64_t group,             \
                 const uint8_t *q, const void *scalev, const void *zerov, float *res) {            \
    const bf16_t *x = xv;                                                                          \
    const uint32_t *sz = scalev;                                                                   \
    const float *zero = NULL, *scale = NULL;                                                       \
    (void)zerov; (void)zero; (void)scale;                                                          \
    const int64_t G = GC ? GC : group, ng = K / G, kb = K / 2;                                     \
    const __m512i lut = q4_lut();                                                                  \
    __m512 acc[OB][R], t[OB][R];                                                                   \
    const uint8_t *qp[OB];                                                                         \
    const uint32_t *sp[OB];                                                                        \
    for (int oo = 0; oo < OB; oo++) {                                                              \
        qp[oo] = q + oo * kb;                                                                      \
        sp[oo] = sz + oo * ng;                                                                     \
        for (int r = 0; r < R; r++) acc[oo][r] = t[oo][r] = _mm512_setzero_ps();                   \
    }                                                                                              \
    Q4_PREFETCH_TILE(OB, 0)                                                                        \
    int64_t g = 0, c = 0;                                                                          \
    for (; c + 64 <= K; c += 64) {                                                                 \
        __m512i lo[OB], hi[OB];                                                                    \
        for (int oo = 0; oo < OB; oo++) {                                                          \
            const uint8_t *p = qp[oo] + c / 2;                                                     \
            __builtin_prefetch(p + Q4_PREFETCH);                                                   \
            const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));        \
            lo[oo] = _mm512_permutexvar_epi16(b, lut);                                             \
            hi[oo] = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut);                       \
        }                                                                                          \
        if (GC == 32) {                                                                            \
            for (int r = 0; r < R; r++) {                                                          \
                const __m512i x0 = _mm512_loadu_si512(x + r * xs + c);                             \
                const __m512i x1 = _mm512_loadu_si512(x + r * xs + c + 32);                        \
                for (int oo = 0; oo < OB; oo++) {                                                  \
                    const __m512 d0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo[oo], (__m512bh)x0); \
                    const __m512 d1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)hi[oo], (__m512bh)x1); \
                    acc[oo][r] = _mm512_fmadd_ps(d0, _mm512_set1_ps(q4_pair_scale(sp[oo][c / 32])), acc[oo][r]);  \
                    acc[oo][r] = _mm512_fmadd_ps(d1, _mm512_set1_ps(q4_pair_scale(sp[oo][c / 32 + 1])), acc[oo][r]); \
                }                                                                                  \
            }                                                                                      \
        } else {                                                                                   \
            for (int r = 0; r < R; r++)                                                            \
                for (int oo = 0; oo < OB; oo++) t[oo][r] = Q4_DP(t[oo][r], lo[oo], x + r * xs + c); \
            if ((GC == 0 || GC % 64) && (c + 32) % G == 0) { Q4_FLUSH(OB, R, q4_pair_scale(sz[oo * ng + g])) }                             \
            for (int r = 0; r < R; r++)                                                            \
                for (int oo = 0; oo < OB; oo++) t[oo][r] = Q4_DP(t[oo][r], hi[oo], x + r * xs + c + 32); \
            if ((c + 64) % G == 0) { Q4_FLUSH(OB, R, q4_pair_scale(sz[oo * ng + g])) }                                             \
        }                                                                                          \
    }                                                                                              \
    if (c < K) { /* the last 32 codes: bytes to words, their high nibbles after them */            \
        if (GC == 32) g = c / 32;                                                                  \
        for (int oo = 0; oo < OB; oo++) {                                                          \
            const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qp[oo] + c / 2))); \
            const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(w), _mm256_srli_epi16(w, 4), 1); \
            const __m512i codes = _mm512_permutexvar_epi16(b, lut);                                \
            for (int r = 0; r < R; r++) t[oo][r] = Q4_DP(t[oo][r], codes, x + r * xs + c);         \
        }                                                                                          \
        Q4_FLUSH(OB, R, q4_pair_scale(sz[oo * ng + g]))                                            \
    }                                                                                              \
    (void)g;                                                                                       \
    Q4_ZERO_TERM(OB, R, 0)                                                                         \
    for (int oo = 0; oo < OB; oo++)                                                                \
        for (int r = 0; r < R; r++) res[oo * R + r] = _mm512_reduce_add_ps(acc[oo][r]);            \
}
#endif

/* Outputs [o0, o1) for R rows: OB at a time, then one at a time for what is left. */
#define Q4_RANGE(KIND, TILE, R, OB)                                                                \
TILE(q4_tile_##KIND##_##R, R, OB, 0) TILE(q4_tile32_##KIND##_##R, R, OB, 32)                       \
TILE(q4_tile128_##KIND##_##R, R, OB, 128) TILE(q4_tail_##KIND##_##R, R, 1, 0)                      \
TILE(q4_tail32_##KIND##_##R, R, 1, 32) TILE(q4_tail128_##KIND##_##R, R, 1, 128)                    \
static void q4_range_##KIND##_##R(const void *x, int64_t xs, int xsize, const float *X, int64_t K, \
                                  int64_t G, const uint8_t *q, const void *scale,                  \
                                  const void *zero, void *out, int64_t os, int bf16, int64_t o0,  \
                                  int64_t o1) {                                                    \
    const int64_t ng = K / G;                                                                      \
    const q4_tile_fn tile = G == 32 ? q4_tile32_##KIND##_##R : G == 128 ? q4_tile128_##KIND##_##R  \
                                                                        : q4_tile_##KIND##_##R;    \
    const q4_tile_fn tail = G == 32 ? q4_tail32_##KIND##_##R : G == 128 ? q4_tail128_##KIND##_##R  \
                                                                        : q4_tail_##KIND##_##R;    \
    (void)xsize;                                                                                   \
    float res[OB * R];                                                                             \
    for (int64_t o = o0; o < o1;) {                                                                \
        const int ob = o + OB <= o1 ? OB : 1;                                                      \
        (ob == OB ? tile : tail)(x, xs, X, K, G, q + o * (K / 2),                  \
                                  (const float *)scale + o * ng, (const float *)zero + o * ng, res); \
        for (int oo = 0; oo < ob; oo++)                                                            \
            for (int r = 0; r < R; r++) {                                                          \
                if (bf16) ((bf16_t *)out)[r * os + o + oo] = to_bf16(res[oo * R + r]);             \
                else ((float *)out)[r * os + o + oo] = res[oo * R + r];                            \
            }                                                                                      \
        o += ob;                                                                                   \
    }                                                                                              \
}
/* the portable tile ignores GC and takes one output at a time */
#define Q4_TILE_C_ANY(NAME, R, OB, GC) Q4_TILE_C(NAME, R)

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
static inline float q4_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* the sums of group g (tl and th) scaled into the accumulators */
#define Q4_FLUSH8(OB, R, g)                                                                        \
    for (int oo = 0; oo < OB; oo++) {                                                              \
        const __m256 sc = _mm256_set1_ps(scale[oo * ng + (g)]);                                    \
        for (int r = 0; r < R; r++) {                                                              \
            acc[oo][r] = _mm256_fmadd_ps(_mm256_add_ps(tl[oo][r], th[oo][r]), sc, acc[oo][r]);     \
            tl[oo][r] = th[oo][r] = _mm256_setzero_ps();                                           \
        }                                                                                          \
    }
/* As Q4_TILE_F on AVX2 (eight lanes): a block of 2h codes (h = 32, or 16 for the last 32) is h
 * bytes, code c + j in byte j's low nibble and c + h + j in its high one. Eight bytes at a time
 * widened to ints (vpmovzxbd) give eight low and eight high codes, summed into their own
 * accumulators (two independent FMA chains: tl, and thb for this block's high half); a group
 * ends after a block's low half or after the block (G a multiple of 32): its sums (tl, and th for
 * the high halves) are scaled then; the zero term after the loop. */
#define Q4_TILE_F8(NAME, R, OB, GC)                                                                \
static void NAME(const void *xv, int64_t xs, const float *X, int64_t K, int64_t group,             \
                 const uint8_t *q, const void *scalev, const void *zerov, float *res) {            \
    const float *x = xv, *scale = scalev, *zero = zerov;                                           \
    const int64_t G = GC ? GC : group, ng = K / G, kb = K / 2;                                     \
    const __m256i m15 = _mm256_set1_epi32(15);                                                     \
    __m256 acc[OB][R], tl[OB][R], th[OB][R], thb[OB][R];                                           \
    for (int oo = 0; oo < OB; oo++)                                                                \
        for (int r = 0; r < R; r++) acc[oo][r] = tl[oo][r] = th[oo][r] = thb[oo][r] = _mm256_setzero_ps(); \
    for (int64_t c = 0; c < K; c += 64) {                                                          \
        const int64_t h = c + 64 <= K ? 32 : 16;                                                   \
        for (int oo = 0; oo < OB; oo++) __builtin_prefetch(q + oo * kb + c / 2 + Q4_PREFETCH);     \
        for (int64_t j = 0; j < h; j += 8) {                                                       \
            for (int oo = 0; oo < OB; oo++) {                                                      \
                const __m256i b = _mm256_cvtepu8_epi32(                                            \
                    _mm_loadl_epi64((const __m128i *)(q + oo * kb + c / 2 + j)));                  \
                const __m256 wl = _mm256_cvtepi32_ps(_mm256_and_si256(b, m15));                    \
                const __m256 wh = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));                     \
                for (int r = 0; r < R; r++) {                                                      \
                    tl[oo][r] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x + r * xs + c + j), tl[oo][r]); \
                    thb[oo][r] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x + r * xs + c + h + j), thb[oo][r]); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        if ((c + h) % G == 0) Q4_FLUSH8(OB, R, c / G) /* the low half ends its group */           \
        for (int oo = 0; oo < OB; oo++)     /* the high half joins the group it lies in */          \
            for (int r = 0; r < R; r++) {                                                          \
                th[oo][r] = _mm256_add_ps(th[oo][r], thb[oo][r]);                                  \
                thb[oo][r] = _mm256_setzero_ps();                                                  \
            }                                                                                      \
        if ((c + 2 * h) % G == 0) Q4_FLUSH8(OB, R, (c + 2 * h) / G - 1) /* the block ends one */  \
    }                                                                                              \
    for (int oo = 0; oo < OB; oo++) {                                                              \
        const float *so = scale + oo * ng, *zo = zero + oo * ng;                                   \
        for (int r = 0; r < R; r++) {                                                              \
            const float *Xr = X + r * ng;                                                          \
            __m256 zt = _mm256_setzero_ps();                                                       \
            int64_t gg = 0;                                                                        \
            for (; gg + 8 <= ng; gg += 8)                                                          \
                zt = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_loadu_ps(so + gg), _mm256_set1_ps(-8.0f), \
                                                     _mm256_loadu_ps(zo + gg)),                    \
                                     _mm256_loadu_ps(Xr + gg), zt);                                \
            float z = q4_hsum8(_mm256_add_ps(acc[oo][r], zt));                                     \
            for (; gg < ng; gg++) z += (zo[gg] - 8.0f * so[gg]) * Xr[gg];                          \
            res[oo * R + r] = z;                                                                   \
        }                                                                                          \
    }                                                                                              \
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define Q4_TILE_FX Q4_TILE_F
#define Q4_OB1 4
#define Q4_OBN 2
#elif defined(__AVX2__) && defined(__FMA__)
/* Sixteen ymm registers: a tile keeps four accumulators an (output, row), so more than four
 * (output, row) pairs spill. The default model's 120 decode linears (2 cores of an AVX2 EPYC,
 * 2026-12-07, ms for the 120 calls): one row 5.0 with two outputs a tile against 6.1 with four;
 * four rows 10.4 with one against 16.0 with two; two rows the same either way. */
#define Q4_TILE_FX Q4_TILE_F8
#define Q4_OB1 2
#define Q4_OBN 1
#else
#define Q4_TILE_FX Q4_TILE_C_ANY
#define Q4_OB1 1
#define Q4_OBN 1
#endif
/* f32 x: OB outputs a tile for one row, fewer from two rows up (the FMAs bound the time) */
Q4_RANGE(f, Q4_TILE_FX, 1, Q4_OB1) Q4_RANGE(f, Q4_TILE_FX, 2, Q4_OBN)
Q4_RANGE(f, Q4_TILE_FX, 3, Q4_OBN) Q4_RANGE(f, Q4_TILE_FX, 4, Q4_OBN)
Q4_RANGE(f, Q4_TILE_FX, 5, 1) Q4_RANGE(f, Q4_TILE_FX, 6, 1)
Q4_RANGE(f, Q4_TILE_FX, 7, 1) Q4_RANGE(f, Q4_TILE_FX, 8, 1)

typedef void (*q4_range_fn)(const void *, int64_t, int, const float *, int64_t, int64_t,
                            const uint8_t *, const void *, const void *, void *, int64_t, int,
                            int64_t, int64_t);
static const q4_range_fn q4_ranges_f[8] = {q4_range_f_1, q4_range_f_2, q4_range_f_3, q4_range_f_4,
                                           q4_range_f_5, q4_range_f_6, q4_range_f_7, q4_range_f_8};
#ifdef Q4_BF16_DP
Q4_RANGE(b, Q4_TILE_B, 1, 2) Q4_RANGE(b, Q4_TILE_B, 2, 2) Q4_RANGE(b, Q4_TILE_B, 3, 2)
Q4_RANGE(b, Q4_TILE_B, 4, 2) Q4_RANGE(b, Q4_TILE_B, 5, 1) Q4_RANGE(b, Q4_TILE_B, 6, 1)
Q4_RANGE(b, Q4_TILE_B, 7, 1) Q4_RANGE(b, Q4_TILE_B, 8, 1)
static const q4_range_fn q4_ranges_b[8] = {q4_range_b_1, q4_range_b_2, q4_range_b_3, q4_range_b_4,
                                           q4_range_b_5, q4_range_b_6, q4_range_b_7, q4_range_b_8};
#endif

/* Below this many weights one thread does it all: waking the pool costs more than it saves. */
#define Q4_SERIAL_WEIGHTS 32768

static void q4_run(q4_range_fn range, const void *x, int64_t xs, const float *X, int64_t rows,
                   const uint8_t *q, const void *scale, const void *zero, void *out, int64_t os,
                   int bf16, int64_t N, int64_t K, int64_t G, int nthreads) {
    (void)rows;
    if (N * K < Q4_SERIAL_WEIGHTS) nthreads = 1;
    _Pragma("omp parallel num_threads(nthreads)")
    {
        /* contiguous slices in whole 8s (a multiple of every OB), as q8_run */
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t per = ((N + nt - 1) / nt + 7) / 8 * 8;
        const int64_t o0 = t * per < N ? t * per : N, o1 = o0 + per < N ? o0 + per : N;
        if (o0 < o1) range(x, xs, 0, X, K, G, q, scale, zero, out, os, bf16, o0, o1);
    }
}

/* X[r, g]: the group sums of x's rows, in fp32 */
#define Q4_GROUP_SUMS(NAME, T)                                                                     \
static void q4_group_sums_##NAME(const T *x, int64_t xs, int64_t rows, int64_t K, int64_t G,        \
                                 float *X) {                                                       \
    for (int64_t r = 0; r < rows; r++)                                                             \
        for (int64_t g = 0; g < K / G; g++) {                                                      \
            float s = 0.f;                                                                         \
            for (int64_t i = g * G; i < (g + 1) * G; i++) s += f32_from_##NAME(x[r * xs + i]);     \
            X[r * (K / G) + g] = s;                                                                \
        }                                                                                          \
}
Q4_GROUP_SUMS(f32, float)
Q4_GROUP_SUMS(bf16, bf16_t)

/* out (rows, N), row stride os, = x (rows, K), row stride xs, times the dequantized weight^T;
 * q the packed codes (N, K / 2). 0, or 2: rows outside 0..8, 3: G not a multiple of 32 dividing
 * K, 4: out of memory. */
int q4_linear_f32(const float *x, int64_t xs, const uint8_t *q, const float *scale,
                  const float *zero, float *out, int64_t os, int64_t rows, int64_t N, int64_t K,
                  int64_t G, int nthreads) {
    if (rows < 0 || rows > 8) return 2;
    if (G <= 0 || G % 32 || K % G) return 3;
    if (rows == 0 || N == 0) return 0;
    float *X = malloc((size_t)(rows * (K / G)) * sizeof(float));
    if (!X) return 4;
    q4_group_sums_f32(x, xs, rows, K, G, X);
    q4_run(q4_ranges_f[rows - 1], x, xs, X, rows, q, scale, zero, out, os, 0, N, K, G, nthreads);
    free(X);
    return 0;
}

/* bf16 x: the weight's scale and zero as bf16 pairs sz (N, K / G) of uint32 (CpuKernels.pack_q4),
 * the scale in the low half, the zero in the high; a quarter less to read than two fp32. */
int q4_linear_bf16(const bf16_t *x, int64_t xs, const uint8_t *q, const uint32_t *sz, bf16_t *out,
                   int64_t os, int64_t rows, int64_t N, int64_t K, int64_t G, int nthreads) {
    if (rows < 0 || rows > 8) return 2;
    if (G <= 0 || G % 32 || K % G) return 3;
    if (rows == 0 || N == 0) return 0;
#ifdef Q4_BF16_DP
    float *X = malloc((size_t)(rows * (K / G)) * sizeof(float));
    if (!X) return 4;
    q4_group_sums_bf16(x, xs, rows, K, G, X);
    q4_run(q4_ranges_b[rows - 1], x, xs, X, rows, q, sz, sz, out, os, 1, N, K, G, nthreads);
#else /* x, scales and zeros to f32 (after the group sums) for the f32 tiles */
    const int64_t ng = K / G;
    float *X = malloc((size_t)(rows * ng + rows * K + 2 * N * ng) * sizeof(float));
    if (!X) return 4;
    float *xf = X + rows * ng, *scale = xf + rows * K, *zero = scale + N * ng;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < K; i++) xf[r * K + i] = f32_from_bf16(x[r * xs + i]);
    for (int64_t i = 0; i < N * ng; i++) {
        scale[i] = q4_pair_scale(sz[i]);
        zero[i] = q4_pair_zero(sz[i]);
    }
    q4_group_sums_bf16(x, xs, rows, K, G, X);
    q4_run(q4_ranges_f[rows - 1], xf, K, X, rows, q, scale, zero, out, os, 1, N, K, G, nthreads);
#endif
    free(X);
    return 0;
}

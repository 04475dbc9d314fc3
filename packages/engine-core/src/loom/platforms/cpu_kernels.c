/* Fused kernels of the built-in CPU platform: RMSNorm (with the residual add), SiLU-and-mul and
 * rotary embedding, each one pass over its rows instead of torch's chain of elementwise ops.
 *
 * Semantics are those of the reference ops (loom_plugin_api.ops): arithmetic in fp32, results
 * rounded to the tensor's dtype at the same points the reference rounds, so bf16 outputs agree
 * with it to within float rounding of the fp32 intermediates. Built by loom.platforms.cpu_kernels
 * with the machine's compiler (-O3 -march=native) and cached, like the paged-decode kernel. The
 * RMSNorm and rotary loops are plain C that the compiler vectorizes (`omp simd`); SiLU-and-mul
 * is written with explicit vectors, because GCC if-converts the scalar exp's clamp into several
 * masked divisions per lane, some of them computing denormals (ten times slower than torch).
 * Rows are split across OpenMP threads, on torch's own pool (libgomp resolves to the copy torch
 * loaded).
 *
 * Every row argument is (rows, row stride) with unit stride inside a row.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

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

static inline v16f load16_f32(const float *p) { v16f x; memcpy(&x, p, sizeof x); return x; }
static inline v16f load16_bf16(const bf16_t *p) {
    v16h h; memcpy(&h, p, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
}
static inline void store16_f32(float *p, v16f x) { memcpy(p, &x, sizeof x); }
static inline v16u bf16_bits16(v16f x) { /* to_bf16 on sixteen lanes, in the low 16 bits */
    const v16u u = (v16u)x;
    const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v16u nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u);
    return (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
}
static inline void store16_bf16(bf16_t *p, v16f x) {
    const v16h h = __builtin_convertvector(bf16_bits16(x), v16h); memcpy(p, &h, sizeof h);
}
static inline v16f round16_f32(v16f x) { return x; }
static inline v16f round16_bf16(v16f x) { return (v16f)(bf16_bits16(x) << 16); }

static inline v16f select16(v16i mask, v16f a, v16f b) { return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask)); }

/* e^x for any float x (Cephes' expf polynomial, x = n ln2 + r, e^x = 2^n e^r), x clamped to
 * [-87, 88.7] where 2^n stays a normal float: beyond it only the last digits of SiLU's tiny or
 * saturated values differ from the unclamped exp, and no lane ever computes a denormal. */
static inline v16f exp16(v16f x) {
    x = select16(x < -87.0f, (v16f){} - 87.0f, x);
    x = select16(x > 88.7f, (v16f){} + 88.7f, x);
    const v16f t = x * 1.44269504088896341f + 0.5f;
    v16i n = __builtin_convertvector(t, v16i);                  /* truncates toward zero ...  */
    n -= (v16i)(__builtin_convertvector(n, v16f) > t) & 1;      /* ... floor: one less when t < 0 */
    const v16f nf = __builtin_convertvector(n, v16f);
    const v16f r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v16f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return (v16f)((v16i)p + (n << 23));                          /* times 2^n */
}

#define DEFINE_KERNELS(NAME, T)                                                                  \
/* out = (s * rsqrt(mean(s^2) + eps)) rounded, times weight, rounded; s = x (+ residual) in fp32, \
 * and res_out = s rounded when residual is given. n <= 16384 (a row of fp32 on the stack). */                                \
int rms_norm_##NAME(const T *x, int64_t xs, const T *res, int64_t rs, const T *w, T *out,          \
                    int64_t os, T *res_out, int64_t ros, int64_t rows, int64_t n, float eps,       \
                    int nthreads) {                                                                \
    if (n > 16384) return 2;                                                                          \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                             \
    for (int64_t t = 0; t < rows; t++) {                                                           \
        float s[n];                                                                                \
        const T *xr = x + t * xs;                                                                  \
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
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                             \
    for (int64_t t = 0; t < rows; t++) {                                                           \
        const T *g = x + t * xs, *u = g + d;                                                       \
        T *o = out + t * os;                                                                       \
        int64_t i = 0;                                                                             \
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
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                             \
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

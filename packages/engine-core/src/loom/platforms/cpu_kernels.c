/* Fused kernels of the built-in CPU platform: RMSNorm (with the residual add), SiLU-and-mul and
 * rotary embedding, each one pass over its rows instead of torch's chain of elementwise ops; and,
 * at the end, the decode matmul by an 8-bit group-wise quantized weight.
 *
 * Semantics are those of the reference ops (loom_plugin_api.ops): arithmetic in fp32, results
 * rounded to the tensor's dtype at the same points the reference rounds, so bf16 outputs agree
 * with it to within float rounding of the fp32 intermediates. Built by loom.platforms.cpu_kernels
 * with the machine's compiler (-O3 -march=native) and cached, like the paged-decode kernel. The
 * RMSNorm and rotary loops are plain C that the compiler vectorizes (`omp simd`); SiLU-and-mul
 * is written with explicit vectors, because GCC if-converts the scalar exp's clamp into several
 * masked divisions per lane, some of them computing denormals (ten times slower than torch).
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
#if defined(__AVX2__)
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
    _Pragma("omp parallel for if(rows > 1) num_threads(nthreads) schedule(static)")                             \
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
    _Pragma("omp parallel for if(rows > 1) num_threads(nthreads) schedule(static)")                             \
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

/* Decode matmuls with int8 activations (llama.cpp's scheme), for CPUs with AVX512-VNNI.
 *
 * Compiled after cpu_kernels.c, as one translation unit (loom.platforms.cpu_kernels joins the
 * two sources): it uses that file's bf16 helpers and headers.
 *
 * out[r, o] = sum_g s[o, g] * dx[r, g] * sum_{i in g} c[o, i] * xq[r, i] + zz[o, g] * X[r, g]
 *
 * for weights w[o, i] = c[o, i] * s[o, g] + zz[o, g] in groups g of 32 (4-bit: c in 0..15,
 * zz = zero - 8 * scale; 8-bit: c in 0..255, zz = zero - 128 * scale). Each row's group of x is
 * quantized to int8 with its own scale, xq = round_half_even(x / dx), dx = max|x| / 127; X[r, g]
 * is the group's exact sum of x in fp32, so the zero term carries no quantization error. The
 * integer dot products of unsigned codes and signed xq are vpdpbusd's (four products a lane), the
 * rest fp32. Against the exact weight-only product, the error is that of rounding x to 8 bits
 * per 32 values (about 2^-9 of a group's largest |x| per element); the tests compare with a torch
 * emulation of these same steps, tightly, and with the exact product, loosely.
 *
 * Layout (CpuKernels.pack_q4 / pack_q8 with layout 1). A row of K codes (K a multiple of 32) is
 * in superblocks of 16 groups (512 codes), the last one of S = (K / 32) % 16 groups when that is
 * not 0. In a superblock of S groups, lane j (4 bytes of a vector) belongs to group j, and vector
 * v (0..7) holds codes 4v..4v+3 of every group: one vpdpbusd per vector sums four codes of each
 * group into its own int32 lane, so eight of them give each group's whole sum, one lane per group,
 * and the scales are applied sixteen groups a vector, once per superblock.
 *   8-bit: byte (v, j, b) at v * 4S + 4j + b is code 4v + b of group j (32S bytes).
 *   4-bit: byte (p, j, b) at p * 4S + 4j + b holds code 8p + b of group j in its low nibble and
 *          code 8p + 4 + b in its high one: vectors 2p and 2p + 1 of the 8-bit order (16S bytes).
 * x is quantized into the same order once per call: per row and superblock eight vectors of
 * 64 bytes (lanes past S zero), and dx and X as sixteen floats each. */

#include <float.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

/* 1 when these kernels are compiled in (the CPU has AVX512-VNNI), else 0 (see the stubs below) */
int qa_available(void) { return 1; }

#define QA_SB 16                  /* groups a superblock */
#define QA_XQ_BYTES (8 * 64)      /* a row's quantized x per superblock */
#define QA_PREFETCH 4096          /* bytes ahead of the codes being read */
#define QA_PREFETCH_SZ 1024       /* and of the scales */

/* A superblock of S groups (1..16): P lanes a group's sub-vector (S rounded up to a power of
 * two), F = min(8, 16 / P) sub-vectors a 64-byte register, NR = 8 / F registers. */
static inline int qa_lanes(int64_t S) { int P = 1; while (P < S) P *= 2; return P; }
static inline int qa_fold(int P) { return 16 / P < 8 ? 16 / P : 8; }

/* x (rows, K), row stride xs, into xq (rows, nsb, 8, 64) int8 (register i, lane l, byte b: code
 * 4v + b of group l % P, v = i * F + l / P), and per row and superblock the sixteen floats dx
 * (lane l: group l % P's scale) and X (lane l < P: group l's sum, else 0); what no group fills is
 * zero (the caller's calloc) */
#define QA_QUANTIZE(NAME, T, LOAD)                                                                 \
static void qa_quantize_##NAME(const T *x, int64_t xs, int64_t rows, int64_t K, int8_t *xq,       \
                               float *dx, float *X) {                                              \
    const int64_t ng = K / 32, nsb = (ng + QA_SB - 1) / QA_SB;                                     \
    for (int64_t r = 0; r < rows; r++)                                                             \
        for (int64_t g = 0; g < ng; g++) {                                                         \
            const __m512 v0 = LOAD(x + r * xs + g * 32), v1 = LOAD(x + r * xs + g * 32 + 16);     \
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))); \
            /* a subnormal step (max|x| below ~1.5e-36) would make 1 / d infinite: such a group is 0 */ \
            const float d = amax / 127.0f, id = d >= FLT_MIN ? 1.0f / d : 0.0f;                    \
            /* round half to even (the default MXCSR mode), then saturate to int8 (never needed) */ \
            const __m128i q0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)))); \
            const __m128i q1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)))); \
            int32_t quads[8];                                                                      \
            memcpy(quads, &q0, 16);                                                                \
            memcpy(quads + 4, &q1, 16);                                                            \
            const int64_t sb = g / QA_SB, j = g % QA_SB, at = r * nsb + sb;                        \
            const int64_t S = ng - sb * QA_SB < QA_SB ? ng - sb * QA_SB : QA_SB;                   \
            const int P = qa_lanes(S), F = qa_fold(P);                                             \
            int8_t *dst = xq + at * QA_XQ_BYTES;                                                   \
            for (int v = 0; v < 8; v++) memcpy(dst + (v / F) * 64 + 4 * ((v % F) * P + j), quads + v, 4); \
            for (int l = (int)j; l < QA_SB; l += P) dx[at * QA_SB + l] = d;                        \
            X[at * QA_SB + j] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));                       \
        }                                                                                          \
}
static inline __m512 qa_load_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 qa_load_bf16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
QA_QUANTIZE(f32, float, qa_load_f32)
QA_QUANTIZE(bf16, bf16_t, qa_load_bf16)

/* One call's operands: the quantized x, and the weight (codes, and its scales: sz the bf16
 * (scale, zero) pairs of a 4-bit weight, or scale and zero (zero may be NULL: all zero) float) */
typedef struct {
    const int8_t *xq;
    const float *dx, *X;
    int64_t rows, K, ng, nsb, kb; /* kb: bytes a weight row */
    const uint8_t *q;
    const uint32_t *sz;
    const float *scale, *zero;
    void *out;
    int64_t os;
    int bf16;
    int S_last, P_last, NR_last; /* the last superblock's groups, lanes and registers (the others 16, 16, 8) */
} qa_args;

/* the scales of OB outputs' superblock sb as (s, zz) vectors, lanes past S zero */
static inline void qa_scales(const qa_args *a, int bits, int64_t o, int64_t sb, __mmask16 ks, __m512 *s,
                             __m512 *zz) {
    const int64_t at = o * a->ng + sb * QA_SB;
    if (a->sz) { /* bf16 pairs: the scale in the low half, the zero in the high */
        const __m512i p = _mm512_maskz_loadu_epi32(ks, a->sz + at);
        *s = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
        const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(p, _mm512_set1_epi32((int)0xffff0000u)));
        *zz = _mm512_fmadd_ps(*s, _mm512_set1_ps(bits == 4 ? -8.0f : -128.0f), z);
    } else {
        *s = _mm512_maskz_loadu_ps(ks, a->scale + at);
        const __m512 z = a->zero ? _mm512_maskz_loadu_ps(ks, a->zero + at) : _mm512_setzero_ps();
        *zz = _mm512_fmadd_ps(*s, _mm512_set1_ps(bits == 4 ? -8.0f : -128.0f), z);
    }
}

/* OB outputs from o (weight rows q + o * kb, ...) times R rows into res[oo * R + r] (sixteen
 * partial sums an output, added by the caller); BITS 4 or 8.
 * A superblock's bytes: 64 a register (8-bit), 64 a pair of registers (4-bit, register 2p in
 * the low nibbles, 2p + 1 in the high); a lone register (P <= 2) of 4-bit codes is 32 bytes,
 * its bytes 0..31 in the low nibbles and 32..63 in the high. */
#define QA_TILE(NAME, BITS, R, OB)                                                                 \
static void NAME(const qa_args *a, int64_t o, __m512 *res) {                                       \
    __m512 acc[OB][R];                                                                             \
    for (int oo = 0; oo < OB; oo++)                                                                \
        for (int r = 0; r < R; r++) acc[oo][r] = _mm512_setzero_ps();                              \
    const __m512i m15 = _mm512_set1_epi8(15);                                                      \
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);   \
    const uint8_t *qo = a->q + o * a->kb;                                                          \
    for (int64_t sb = 0; sb < a->nsb; sb++) {                                                      \
        const int last = sb == a->nsb - 1;                                                         \
        const int S = last ? a->S_last : QA_SB, P = last ? a->P_last : QA_SB, NR = last ? a->NR_last : 8; \
        const __mmask16 ks = (__mmask16)((1u << S) - 1);                                           \
        const uint8_t *qs = qo + sb * QA_SB * 32 * BITS / 8;                                       \
        const int8_t *xs = a->xq + sb * QA_XQ_BYTES;                                               \
        __m512i I[OB][R];                                                                          \
        for (int oo = 0; oo < OB; oo++)                                                            \
            for (int r = 0; r < R; r++) I[oo][r] = _mm512_setzero_si512();                         \
        if (NR == 1) { /* one register: 4-bit as 32 bytes, 8-bit as 64 */                          \
            __m512i xa[R];                                                                         \
            for (int r = 0; r < R; r++) xa[r] = _mm512_loadu_si512(xs + r * a->nsb * QA_XQ_BYTES); \
            for (int oo = 0; oo < OB; oo++) {                                                      \
                __m512i c;                                                                         \
                __builtin_prefetch(qs + oo * a->kb + QA_PREFETCH);                                 \
                if (BITS == 4) {                                                                   \
                    const __m256i y = _mm256_loadu_si256((const __m256i *)(qs + oo * a->kb));       \
                    c = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1), m15); \
                } else {                                                                           \
                    c = _mm512_loadu_si512(qs + oo * a->kb);                                       \
                }                                                                                  \
                for (int r = 0; r < R; r++) I[oo][r] = _mm512_dpbusd_epi32(I[oo][r], c, xa[r]);    \
            }                                                                                      \
        }                                                                                          \
        for (int p = 0; NR > 1 && p < NR / 2; p++) {                                               \
            __m512i xa[R], xb[R];                                                                  \
            for (int r = 0; r < R; r++) {                                                          \
                xa[r] = _mm512_loadu_si512(xs + r * a->nsb * QA_XQ_BYTES + 2 * p * 64);           \
                xb[r] = _mm512_loadu_si512(xs + r * a->nsb * QA_XQ_BYTES + (2 * p + 1) * 64);     \
            }                                                                                      \
            for (int oo = 0; oo < OB; oo++) {                                                      \
                __m512i ca, cb;                                                                    \
                if (BITS == 4) {                                                                   \
                    const uint8_t *pp = qs + oo * a->kb + p * 64;                                  \
                    __builtin_prefetch(pp + QA_PREFETCH);                                          \
                    const __m512i b = _mm512_loadu_si512(pp);                                      \
                    ca = _mm512_and_si512(b, m15);                                                 \
                    cb = _mm512_and_si512(_mm512_srli_epi16(b, 4), m15);                           \
                } else {                                                                           \
                    const uint8_t *pp = qs + oo * a->kb + 2 * p * 64;                              \
                    __builtin_prefetch(pp + QA_PREFETCH);                                          \
                    __builtin_prefetch(pp + 64 + QA_PREFETCH);                                     \
                    ca = _mm512_loadu_si512(pp);                                                   \
                    cb = _mm512_loadu_si512(pp + 64);                                              \
                }                                                                                  \
                for (int r = 0; r < R; r++)                                                        \
                    I[oo][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(I[oo][r], ca, xa[r]), cb, xb[r]); \
            }                                                                                      \
        }                                                                                          \
        for (int oo = 0; oo < OB; oo++)                                                            \
            __builtin_prefetch((const char *)(a->sz ? (const void *)a->sz : (const void *)a->scale) \
                               + ((o + oo) * a->ng + sb * QA_SB) * 4 + QA_PREFETCH_SZ);             \
        const __m512i lane_group = _mm512_and_si512(iota, _mm512_set1_epi32(P - 1));               \
        for (int oo = 0; oo < OB; oo++) {                                                          \
            __m512 s, zz;                                                                          \
            qa_scales(a, BITS, o + oo, sb, ks, &s, &zz);                                           \
            if (P < QA_SB) s = _mm512_permutexvar_ps(lane_group, s); /* zz stays: X is 0 past P */ \
            for (int r = 0; r < R; r++) {                                                          \
                const int64_t at = (r * a->nsb + sb) * QA_SB;                                      \
                const __m512 d = _mm512_mul_ps(_mm512_cvtepi32_ps(I[oo][r]), _mm512_loadu_ps(a->dx + at)); \
                acc[oo][r] = _mm512_fmadd_ps(zz, _mm512_loadu_ps(a->X + at), _mm512_fmadd_ps(d, s, acc[oo][r])); \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int oo = 0; oo < OB; oo++)                                                                \
        for (int r = 0; r < R; r++) res[oo * R + r] = acc[oo][r];                                  \
}

/* the sums of sixteen vectors v[0], v[stride], ..., v[15 * stride], in that order, each added as
 * _mm512_reduce_add_ps adds one vector (halves, quarters, then pairs two and one apart: the same
 * result to the bit), with about a third of its instructions: a transpose and add in four levels */
static inline __m512 qa_sum16(const __m512 *v, int stride) {
    __m512 c[8], g[4], p[2];
    for (int i = 0; i < 8; i++) { /* element j + 8: outputs 2i (lanes 0, 1) and 2i + 1 (2, 3) */
        const __m512 a = v[2 * i * stride], b = v[(2 * i + 1) * stride];
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int k = 0; k < 4; k++) /* element j + 4: lane l of 128 bits is output 4k + l */
        g[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int m = 0; m < 2; m++) /* element j + 2: lane l is [8m + l, 8m + 4 + l, the same] */
        p[m] = _mm512_add_ps(_mm512_unpacklo_ps(g[2 * m], g[2 * m + 1]), _mm512_unpackhi_ps(g[2 * m], g[2 * m + 1]));
    /* element j + 1: lane l is outputs l, 4 + l, 8 + l, 12 + l; put in order */
    const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), y);
}

/* outputs [o0, o1) in blocks of sixteen: OB at a time, then one at a time, their partial sums
 * added sixteen outputs a vector and stored as one. One row takes one output at a time: the
 * codes stream from memory in order (four outputs' rows at once measured up to twice as slow,
 * cold, on the machine of the README); more rows share each load of the codes between them. */
#define QA_RANGE(BITS, R, OB)                                                                      \
QA_TILE(qa_tile##BITS##_##R, BITS, R, OB) QA_TILE(qa_tail##BITS##_##R, BITS, R, 1)                 \
static void qa_range##BITS##_##R(const qa_args *a, int64_t o0, int64_t o1) {                       \
    __m512 v[16 * R]; /* output ob + i, row r: v[i * R + r] */                                     \
    for (int64_t ob = o0; ob < o1; ob += 16) {                                                     \
        const int64_t n = o1 - ob < 16 ? o1 - ob : 16;                                             \
        for (int64_t o = ob; o < ob + n;) {                                                        \
            const int k = o + OB <= ob + n ? OB : 1;                                               \
            (k == OB ? qa_tile##BITS##_##R : qa_tail##BITS##_##R)(a, o, v + (o - ob) * R);         \
            o += k;                                                                                \
        }                                                                                          \
        for (int r = 0; r < R; r++) {                                                              \
            if (n == 16) {                                                                         \
                const __m512 y = qa_sum16(v + r, R);                                               \
                if (a->bf16) store16_bf16((bf16_t *)a->out + r * a->os + ob, (v16f)y);             \
                else _mm512_storeu_ps((float *)a->out + r * a->os + ob, y);                        \
                continue;                                                                          \
            }                                                                                      \
            for (int64_t i = 0; i < n; i++) {                                                      \
                const float y = _mm512_reduce_add_ps(v[i * R + r]);                                \
                if (a->bf16) ((bf16_t *)a->out)[r * a->os + ob + i] = to_bf16(y);                  \
                else ((float *)a->out)[r * a->os + ob + i] = y;                                    \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}
#define QA_RANGES(BITS)                                                                            \
QA_RANGE(BITS, 1, 1) QA_RANGE(BITS, 2, 2) QA_RANGE(BITS, 3, 2) QA_RANGE(BITS, 4, 2)                \
QA_RANGE(BITS, 5, 1) QA_RANGE(BITS, 6, 1) QA_RANGE(BITS, 7, 1) QA_RANGE(BITS, 8, 1)               \
static void (*const qa_ranges##BITS[8])(const qa_args *, int64_t, int64_t) = {                     \
    qa_range##BITS##_1, qa_range##BITS##_2, qa_range##BITS##_3, qa_range##BITS##_4,                \
    qa_range##BITS##_5, qa_range##BITS##_6, qa_range##BITS##_7, qa_range##BITS##_8};
QA_RANGES(4)
QA_RANGES(8)

/* x quantized once (by the calling thread), then the outputs split across threads in
 * contiguous slices of whole 16s (qa_range's blocks); a small weight on the calling thread alone */
/* bytes a weight row of K codes takes in layout 1 */
static int64_t qa_row_bytes(int bits, int64_t K) {
    const int64_t ng = K / 32, S = ng % QA_SB;
    int64_t n = ng / QA_SB * QA_SB * 32 * bits / 8;
    if (S) {
        const int NR = 8 / qa_fold(qa_lanes(S));
        n += bits == 8 ? NR * 64 : NR == 1 ? 32 : NR * 32;
    }
    return n;
}

static int qa_run(int bits, const void *x, int xbf16, int64_t xs, qa_args *a, int64_t N, int nthreads) {
    const int64_t ng = a->K / 32, nsb = (ng + QA_SB - 1) / QA_SB;
    char *buf = calloc(1, (size_t)(a->rows * nsb * (QA_XQ_BYTES + 2 * QA_SB * sizeof(float))));
    if (!buf) return 4;
    int8_t *xq = (int8_t *)buf;
    float *dx = (float *)(buf + a->rows * nsb * QA_XQ_BYTES), *X = dx + a->rows * nsb * QA_SB;
    if (xbf16) qa_quantize_bf16(x, xs, a->rows, a->K, xq, dx, X);
    else qa_quantize_f32(x, xs, a->rows, a->K, xq, dx, X);
    a->xq = xq, a->dx = dx, a->X = X, a->ng = ng, a->nsb = nsb, a->kb = qa_row_bytes(bits, a->K);
    a->S_last = (int)(ng - (nsb - 1) * QA_SB), a->P_last = qa_lanes(a->S_last);
    a->NR_last = 8 / qa_fold(a->P_last);
    void (*range)(const qa_args *, int64_t, int64_t) = (bits == 4 ? qa_ranges4 : qa_ranges8)[a->rows - 1];
    if (N * a->K < Q4_SERIAL_WEIGHTS) nthreads = 1;
    _Pragma("omp parallel num_threads(nthreads)")
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t blocks = (N + 15) / 16; /* whole sixteens, shared out evenly */
        const int64_t o0 = t * blocks / nt * 16, o1 = (t + 1) * blocks / nt * 16 < N ? (t + 1) * blocks / nt * 16 : N;
        if (o0 < o1) range(a, o0, o1);
    }
    free(buf);
    return 0;
}

/* out (rows, N), row stride os, = x (rows, K), row stride xs, times the weight^T of BITS (4 or 8)
 * in layout 1 (codes q) with, per group of 32, either bf16 (scale, zero) pairs sz (N, K / 32) or
 * scale and zero float (N, K / 32) (sz NULL; zero NULL: all zero). 0, or 2: rows outside 0..8,
 * 3: K not a multiple of 32 or bits not 4 or 8, 4: out of memory, 5: not compiled in. */
#define QA_DEFINE(NAME, T)                                                                         \
int qa_linear_##NAME(int bits, const T *x, int64_t xs, const uint8_t *q, const uint32_t *sz,       \
                     const float *scale, const float *zero, T *out, int64_t os, int64_t rows,      \
                     int64_t N, int64_t K, int nthreads) {                                         \
    if (rows < 0 || rows > 8) return 2;                                                            \
    if (K % 32 || (bits != 4 && bits != 8)) return 3;                                             \
    if (rows == 0 || N == 0) return 0;                                                             \
    qa_args a = {.rows = rows, .K = K, .q = q, .sz = sz, .scale = scale, .zero = zero, .out = out, \
                 .os = os, .bf16 = sizeof(T) == 2};                                                \
    return qa_run(bits, x, sizeof(T) == 2, xs, &a, N, nthreads);                                   \
}

#else /* no AVX512-VNNI: the entry points exist (the loader binds them) and refuse */

int qa_available(void) { return 0; }
#define QA_DEFINE(NAME, T)                                                                         \
int qa_linear_##NAME(int bits, const T *x, int64_t xs, const uint8_t *q, const uint32_t *sz,       \
                     const float *scale, const float *zero, T *out, int64_t os, int64_t rows,      \
                     int64_t N, int64_t K, int nthreads) {                                         \
    (void)bits, (void)x, (void)xs, (void)q, (void)sz, (void)scale, (void)zero, (void)out, (void)os; \
    (void)rows, (void)N, (void)K, (void)nthreads;                                                  \
    return 5;                                                                                      \
}
#endif

QA_DEFINE(f32, float)
QA_DEFINE(bf16, bf16_t)

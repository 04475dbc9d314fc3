/* A prototype decode GEMM on AMX tiles that reads torch's plain (out, in) bf16 weight, for
 * bench/amx_linear.py (not used by loom; see that script for why it exists and what it shows).
 *
 * out (m x n, bf16) = x (m x k, bf16) . w^T (+ bias), fp32 sums, for m <= 64, k % 32 == 0,
 * n % 16 == 0; x's rows at an even stride (elements) of at least k, w contiguous. An AMX multiply (`tdpbf16ps`) takes its first operand as rows of 32 bf16 and its
 * second in pairs along k (VNNI). A weight row is such a first-operand row, so the kernel computes
 * out^T = w . x^T: a tile of 16 weight rows x 32 k is loaded straight from the weight (no packed
 * copy), x^T is laid out in pairs once per call (at most 64 rows, from cache), and each 16 x 16
 * fp32 result tile is transposed in registers on its way out. Each thread streams its own range
 * of the weight's rows and prefetches the next 16 rows while it multiplies the current ones.
 * Built by the script with the machine's compiler: cc -O3 -march=native -fopenmp -shared -fPIC. */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef uint16_t bf16_t;

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg;

/* Linux lets a process use the AMX tile registers once it asks: 1 when it may */
int amx_ready(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

static void tiles_16x64(void) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

/* r[0..15] (16 rows of 16 floats) transposed in place */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {
        const __m512d a = (__m512d)t[4 * g], b = (__m512d)t[4 * g + 1];
        const __m512d c = (__m512d)t[4 * g + 2], d = (__m512d)t[4 * g + 3];
        r[4 * g] = (__m512)_mm512_unpacklo_pd(a, c);
        r[4 * g + 1] = (__m512)_mm512_unpackhi_pd(a, c);
        r[4 * g + 2] = (__m512)_mm512_unpacklo_pd(b, d);
        r[4 * g + 3] = (__m512)_mm512_unpackhi_pd(b, d);
    }
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0x88);
        t[j + 4] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0xdd);
        t[j + 8] = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0x88);
        t[j + 12] = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0xdd);
    }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
}

static __thread uint32_t *xt_buf; /* x^T in pairs, kept between calls (never freed: a benchmark's) */
static __thread size_t xt_cap;

/* 16 weight rows (wn) against MB blocks of 16 rows of x: result tiles 0..MB-1, weight tile 4,
 * x^T tiles 5-7; the next 16 weight rows are asked for a k-step at a time */
#define TDP(J, B) { _tile_loadd(B, xk + (J) * 256, 64); _tile_dpbf16ps(J, 4, B); }
#define KLOOP(MB)                                                                                  \
    for (int64_t s = 0; s < ks; s++) {                                                             \
        if (b + 1 < b1) /* this thread's next 16 rows */                                           \
            for (int r = 0; r < 16; r++) _mm_prefetch((const char *)(wn + (16 + r) * k + 32 * s), _MM_HINT_T0); \
        _tile_loadd(4, wn + 32 * s, 2 * k);                                                        \
        const uint32_t *xk = xt + s * mb * 256;                                                    \
        TDP(0, 5) if (MB > 1) TDP(1, 6) if (MB > 2) TDP(2, 7) if (MB > 3) TDP(3, 5)                \
    }

/* 0, or 2 where the shapes are not the kernel's, 1 where scratch memory ran out */
int amx_linear_bf16(const bf16_t *x, int64_t x_stride, int64_t m, const bf16_t *w, int64_t n, int64_t k,
                    const bf16_t *bias, bf16_t *out, int64_t out_stride, int nthreads) {
    /* x's rows are gathered in 32-bit pairs with int32 offsets of up to 15 rows */
    if (k % 32 || n % 16 || m > 64 || m < 1 || x_stride % 2 || x_stride < k || x_stride / 2 > INT32_MAX / 16) return 2;
    const int64_t ks = k / 32, mb = (m + 15) / 16, nblk = n / 16;
    const size_t need = (size_t)(ks * mb * 1024);
    if (need > xt_cap) {
        free(xt_buf);
        xt_buf = aligned_alloc(64, need);
        xt_cap = xt_buf ? need : 0;
        if (!xt_buf) return 1;
    }
    uint32_t *xt = xt_buf;
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)(x_stride / 2)));
    _Pragma("omp parallel num_threads(nthreads)")
    {
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        /* xt[(s * mb + j) * 256 + 16 r + c] = the pair r of k-step s of x's row 16 j + c (zero past m) */
        for (int64_t sj = tid; sj < ks * mb; sj += nt) {
            const int64_t s = sj / mb, j = sj % mb;
            const int valid = m - 16 * j >= 16 ? 16 : (int)(m - 16 * j);
            const __mmask16 vm = (__mmask16)((1u << valid) - 1);
            const int *base = (const int *)(x + 16 * j * x_stride + 32 * s);
            for (int r = 0; r < 16; r++)
                _mm512_store_si512((void *)(xt + sj * 256 + 16 * r),
                                   _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), vm, rows, base + r, 4));
        }
        _Pragma("omp barrier")
        tiles_16x64();
        float acc[4][256] __attribute__((aligned(64)));
        const int64_t b0 = nblk * tid / nt, b1 = nblk * (tid + 1) / nt;
        for (int64_t b = b0; b < b1; b++) {
            const bf16_t *wn = w + 16 * b * k;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            switch (mb) {
            case 1: KLOOP(1) break;
            case 2: KLOOP(2) break;
            case 3: KLOOP(3) break;
            default: KLOOP(4) break;
            }
            _tile_stored(0, acc[0], 64);
            if (mb > 1) _tile_stored(1, acc[1], 64);
            if (mb > 2) _tile_stored(2, acc[2], 64);
            if (mb > 3) _tile_stored(3, acc[3], 64);
            __m512 bv = _mm512_setzero_ps();
            if (bias)
                bv = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(bias + 16 * b))), 16));
            for (int64_t j = 0; j < mb; j++) { /* acc[j]: 16 weight rows x 16 rows of x */
                __m512 r[16];
                for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(acc[j] + 16 * i);
                transpose16(r);
                const int valid = m - 16 * j >= 16 ? 16 : (int)(m - 16 * j);
                for (int i = 0; i < valid; i++)
                    _mm256_storeu_si256((void *)(out + (16 * j + i) * out_stride + 16 * b),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(r[i], bv)));
            }
        }
        _tile_release();
    }
    return 0;
}

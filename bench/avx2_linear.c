/* A prototype fp32 linear layer for decode batches on AVX2 + FMA, to size one against oneDNN
 * (bench/avx2_linear.py; not used by loom).
 *
 * y (m x n, row stride ys) = x (m x k, row stride xs) . W^T (+ bias), W (n x k) packed once by
 * avx2_pack into panels of NR = 16 output columns: wp[p][kk][16], the columns past n zero. Each
 * thread takes a contiguous, equal share of the panels (so 576 columns, 36 panels, split 18 and
 * 18), and for each panel walks K in blocks of KC, so the panel's block (16 x KC floats, 16 KB)
 * stays in L1 while every 6-row sliver of x multiplies it: a 6 x 16 tile of twelve accumulators,
 * two loads of W and six broadcasts of x a step of k. */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define NR 16
#define MR 6
#define KC 256

int64_t avx2_packed_floats(int64_t n, int64_t k) { return (n + NR - 1) / NR * NR * k; }

void avx2_pack(const float *w, int64_t n, int64_t k, float *wp) {
    const int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t row = p * NR + j;
                wp[(p * k + kk) * NR + j] = row < n ? w[row * k + kk] : 0.f;
            }
}

/* c (rows x cols of a 6 x 16 tile, row stride ldc) = or += x rows (stride xs) . b block (kc x 16) */
static inline void tile(const float *x, int64_t xs, const float *b, int64_t kc, float *c, int64_t ldc,
                        int rows, int cols, int accumulate, const float *bias) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    /* rows past the sliver's end read row 0 again (their results are not stored) */
    const float *x0 = x, *x1 = rows > 1 ? x + xs : x, *x2 = rows > 2 ? x + 2 * xs : x;
    const float *x3 = rows > 3 ? x + 3 * xs : x, *x4 = rows > 4 ? x + 4 * xs : x, *x5 = rows > 5 ? x + 5 * xs : x;
    for (int64_t kk = 0; kk < kc; kk++) {
        const __m256 b0 = _mm256_load_ps(b + kk * NR), b1 = _mm256_load_ps(b + kk * NR + 8);
        __m256 a = _mm256_broadcast_ss(x0 + kk);
        c00 = _mm256_fmadd_ps(a, b0, c00); c01 = _mm256_fmadd_ps(a, b1, c01);
        a = _mm256_broadcast_ss(x1 + kk);
        c10 = _mm256_fmadd_ps(a, b0, c10); c11 = _mm256_fmadd_ps(a, b1, c11);
        a = _mm256_broadcast_ss(x2 + kk);
        c20 = _mm256_fmadd_ps(a, b0, c20); c21 = _mm256_fmadd_ps(a, b1, c21);
        a = _mm256_broadcast_ss(x3 + kk);
        c30 = _mm256_fmadd_ps(a, b0, c30); c31 = _mm256_fmadd_ps(a, b1, c31);
        a = _mm256_broadcast_ss(x4 + kk);
        c40 = _mm256_fmadd_ps(a, b0, c40); c41 = _mm256_fmadd_ps(a, b1, c41);
        a = _mm256_broadcast_ss(x5 + kk);
        c50 = _mm256_fmadd_ps(a, b0, c50); c51 = _mm256_fmadd_ps(a, b1, c51);
    }
    __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    float t[NR];
    for (int i = 0; i < rows; i++) {
        float *ci = c + i * ldc;
        if (cols == NR) {
            __m256 v0 = acc[i][0], v1 = acc[i][1];
            if (accumulate) v0 = _mm256_add_ps(v0, _mm256_loadu_ps(ci)), v1 = _mm256_add_ps(v1, _mm256_loadu_ps(ci + 8));
            else if (bias) v0 = _mm256_add_ps(v0, _mm256_loadu_ps(bias)), v1 = _mm256_add_ps(v1, _mm256_loadu_ps(bias + 8));
            _mm256_storeu_ps(ci, v0); _mm256_storeu_ps(ci + 8, v1);
        } else {
            _mm256_storeu_ps(t, acc[i][0]); _mm256_storeu_ps(t + 8, acc[i][1]);
            for (int j = 0; j < cols; j++) ci[j] = t[j] + (accumulate ? ci[j] : bias ? bias[j] : 0.f);
        }
    }
}

/* 0, or 1: arguments it cannot take */
int avx2_linear(const float *x, int64_t xs, int64_t m, const float *wp, int64_t n, int64_t k, const float *bias,
                float *y, int64_t ys, int nthreads) {
    if (m < 1 || n < 1 || k < 1 || ((uintptr_t)wp & 31)) return 1;
    const int64_t panels = (n + NR - 1) / NR;
    #pragma omp parallel num_threads(nthreads)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = panels * t / nt, hi = panels * (t + 1) / nt;
        for (int64_t p = lo; p < hi; p++) {
            const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
            for (int64_t kb = 0; kb < k; kb += KC) {
                const int64_t kc = k - kb < KC ? k - kb : KC;
                const float *b = wp + (p * k + kb) * NR;
                for (int64_t r = 0; r < m; r += MR) {
                    const int rows = (int)(m - r < MR ? m - r : MR);
                    tile(x + r * xs + kb, xs, b, kc, y + r * ys + p * NR, ys, rows, cols, kb > 0,
                         bias ? bias + p * NR : NULL);
                }
            }
        }
    }
    return 0;
}

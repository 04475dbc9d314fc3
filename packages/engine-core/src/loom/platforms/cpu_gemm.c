
/* ---- cpu_gemm.c: the fp32 linear layer on AVX2 + FMA ----------------------------------------
 *
 * y (m x n, row stride ys) = x (m x k, row stride xs) . W^T (+ bias), for a weight W (n x k, n a
 * multiple of 16) that loom.layers.onednn keeps in panels of PANEL_NR = 16 output columns:
 * wp[p][kk][j] = W[16 p + j][kk], the (n / 16, k, 16) tensor of W.view(n / 16, 16, k).transpose(1, 2).
 *
 * The work is row blocks of up to PANEL_MC rows (they stay in L2) times panels. Where a layer has
 * at least 8 panels a thread, each thread takes a contiguous, equal share of the panels for every
 * row block (576 columns: 36 panels, 18 and 18; oneDNN's AVX2 kernels split them in blocks of 64,
 * nine for two threads, and lose a fifth of the second core there); a narrower layer on many
 * cores shares the (row block, panel) units instead. For each unit K goes in blocks of
 * PANEL_KC, so the panel's block (16 x 256 floats, 16 KB) stays in L1 while each 6-row sliver
 * of the row block multiplies it: a 6 x 16 tile of twelve
 * accumulators, two loads of W and six broadcasts of x a step of k. Slivers of fewer rows (the
 * last one; one to five streams decoding) get their own compiled tile, without the rows they lack.
 *
 * Measured on 2 cores of an AVX2 AMD EPYC (bench/avx2_linear.py, the default model's 120 layer
 * GEMMs, 2026-12-07): 171 GFLOP/s at 64 rows against oneDNN's 134 (165 before each block asked
 * for the next ahead, panel_unit), 180 at 512 against 161-164, 177-183 at 1,024-2,048, as MKL's
 * F.linear. Each output is the sum over k in order, in fp32 with fused multiply-adds, a block of
 * 256 at a time: rounding differs from oneDNN's and MKL's order as theirs differ from each
 * other's. */

#if defined(__AVX2__) && defined(__FMA__)

#define PANEL_NR 16
#define PANEL_MR 6
#define PANEL_KC 256
#define PANEL_MC 192

int panel_available(void) { return 1; }

/* c rows (row stride ldc) of a ROWS x 16 tile = (or += when accumulate) x rows (stride xs) .
 * b block (kc x 16); bias added where not accumulating and given. ROWS is a constant at each
 * call (always inlined), so the loops over rows unroll and the unused accumulators vanish. First
 * it asks for next_lines lines of 64 bytes from next into L2 (see panel_unit). */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t xs, const float *b,
                                                              int64_t kc, float *c, int64_t ldc, const int rows,
                                                              int accumulate, const float *bias,
                                                              const float *next, int64_t next_lines) {
    __m256 acc[PANEL_MR][2];
    const float *xr[PANEL_MR];
    for (int i = 0; i < rows; i++) {
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        xr[i] = x + i * xs;
    }
    for (int64_t l = 0; l < next_lines; l++) __builtin_prefetch(next + l * PANEL_NR, 0, 2);
    for (int64_t kk = 0; kk < kc; kk++) {
        const __m256 b0 = _mm256_load_ps(b + kk * PANEL_NR), b1 = _mm256_load_ps(b + kk * PANEL_NR + 8);
        for (int i = 0; i < rows; i++) {
            const __m256 a = _mm256_broadcast_ss(xr[i] + kk);
            acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < rows; i++) {
        float *ci = c + i * ldc;
        __m256 v0 = acc[i][0], v1 = acc[i][1];
        if (accumulate) {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(ci));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(ci + 8));
        } else if (bias) {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(bias));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(bias + 8));
        }
        _mm256_storeu_ps(ci, v0);
        _mm256_storeu_ps(ci + 8, v1);
    }
}

static void panel_sliver(const float *x, int64_t xs, const float *b, int64_t kc, float *c, int64_t ldc, int rows,
                         int accumulate, const float *bias, const float *next, int64_t next_lines) {
    switch (rows) {
    case 6: panel_tile(x, xs, b, kc, c, ldc, 6, accumulate, bias, next, next_lines); break;
    case 5: panel_tile(x, xs, b, kc, c, ldc, 5, accumulate, bias, next, next_lines); break;
    case 4: panel_tile(x, xs, b, kc, c, ldc, 4, accumulate, bias, next, next_lines); break;
    case 3: panel_tile(x, xs, b, kc, c, ldc, 3, accumulate, bias, next, next_lines); break;
    case 2: panel_tile(x, xs, b, kc, c, ldc, 2, accumulate, bias, next, next_lines); break;
    default: panel_tile(x, xs, b, kc, c, ldc, 1, accumulate, bias, next, next_lines); break;
    }
}

/* One unit of work: rows [r0, r1) times panel p, all of K, into y (bias where given). */
static void panel_unit(const float *x, int64_t xs, const float *wp, const float *bias, float *y, int64_t ys,
                       int64_t r0, int64_t r1, int64_t p, int64_t k, int64_t panels) {
    for (int64_t kb = 0; kb < k; kb += PANEL_KC) {
        const int64_t kc = k - kb < PANEL_KC ? k - kb : PANEL_KC;
        const float *b = wp + (p * k + kb) * PANEL_NR;
        /* The block after this one (the panel's next K, else the next panel's first: they are
         * contiguous) asked for into L2, each sliver a share of its lines before it starts: a
         * step's weights come from memory, and the hardware prefetchers stop at every 4 KB page
         * (bench/avx2_linear.py, 2026-12-07: 64 rows 155-162 -> 171 GFLOP/s, 256 rows 172-175 ->
         * 180). Not for fewer than 8 slivers (under 43 rows), where it gained nothing and larger
         * shares asked for at once cost up to 10% (24 rows). */
        const int64_t slivers = (r1 - r0 + PANEL_MR - 1) / PANEL_MR;
        const int64_t share = slivers >= 8 ? (PANEL_KC + slivers - 1) / slivers : 0;
        const int64_t ahead = panels * k - (p * k + kb + kc); /* lines (steps of k) left in the weight */
        for (int64_t r = r0; r < r1; r += PANEL_MR) {
            const int rows = (int)(r1 - r < PANEL_MR ? r1 - r : PANEL_MR);
            const int64_t from = (r - r0) / PANEL_MR * share;
            const int64_t lines = from >= ahead ? 0 : ahead - from < share ? ahead - from : share;
            panel_sliver(x + r * xs + kb, xs, b, kc, y + r * ys + p * PANEL_NR, ys, rows, kb > 0,
                         bias ? bias + p * PANEL_NR : NULL, lines ? b + (kc + from) * PANEL_NR : b, lines);
        }
    }
}

/* 0, or 1: arguments it cannot take (n not a multiple of 16, a misaligned weight, no rows) */
int panel_linear_f32(const float *x, int64_t xs, const float *wp, const float *bias, float *y, int64_t ys,
                     int64_t m, int64_t n, int64_t k, int nthreads) {
    if (m < 1 || n < PANEL_NR || n % PANEL_NR || k < 1 || nthreads < 1 || ((uintptr_t)wp & 31)) return 1;
    const int64_t panels = n / PANEL_NR, blocks = (m + PANEL_MC - 1) / PANEL_MC;
    /* row blocks of (nearly) equal size, whole slivers: units of equal work */
    const int64_t mc = ((m + blocks - 1) / blocks + PANEL_MR - 1) / PANEL_MR * PANEL_MR;
    /* Enough panels for every thread (a layer of a real model on a few cores): each thread takes an
     * equal share of the panels for every row block, exactly balanced. Else (a narrow layer, many
     * cores) the threads share the (row block, panel) units in that order. Either way each output
     * is one unit's sum: the split never changes a result's bits. */
    const int by_panels = panels >= 8 * (int64_t)nthreads;
    const int64_t units = by_panels ? panels : blocks * panels;
    if (nthreads > units) nthreads = (int)units;
    #pragma omp parallel num_threads(nthreads) if(nthreads > 1)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = units * t / nt, hi = units * (t + 1) / nt;
        if (by_panels) {
            for (int64_t r0 = 0; r0 < m; r0 += mc)
                for (int64_t p = lo; p < hi; p++)
                    panel_unit(x, xs, wp, bias, y, ys, r0, r0 + mc < m ? r0 + mc : m, p, k, panels);
        } else {
            for (int64_t u = lo; u < hi; u++) {
                const int64_t r0 = u / panels * mc;
                panel_unit(x, xs, wp, bias, y, ys, r0, r0 + mc < m ? r0 + mc : m, u % panels, k, panels);
            }
        }
    }
    return 0;
}

#else /* no AVX2 and FMA: the entry points exist (the loader binds them) and refuse */

int panel_available(void) { return 0; }

int panel_linear_f32(const float *x, int64_t xs, const float *wp, const float *bias, float *y, int64_t ys,
                     int64_t m, int64_t n, int64_t k, int nthreads) {
    (void)x, (void)xs, (void)wp, (void)bias, (void)y, (void)ys, (void)m, (void)n, (void)k, (void)nthreads;
    return 1;
}

#endif

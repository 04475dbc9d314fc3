
/* ---- cpu_gemm.c: the fp32 linear layer on AVX2 + FMA, the bf16 one on AVX512-BF16 -----------
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


/* ---- the bf16 linear layer on AVX512-BF16 ------------------------------------------------------
 *
 * y (m x n bf16, row stride ys) = x (m x k bf16, row stride xs) . W^T (+ a bf16 bias), k even, for
 * a weight W (n x k, n a multiple of 16) in panels of 16 output columns and pairs of k, the pairs
 * vdpbf16ps multiplies: wp[p][q][j][h] = W[16 p + j][2 q + h], the (n / 16, k / 2, 32) tensor of
 * W.view(n / 16, 16, k / 2, 2).transpose(1, 2). A tile is up to PBF_MR rows times two panels
 * (32 columns): sixteen fp32 accumulators, two loads of W and one 32-bit broadcast of x a row, a
 * pair of k a step, over the whole of K (a panel pair's 64 k bytes stay in L2 for the row block's
 * other slivers, and the 16 fp32 sums per row never round to bf16 before the end). The first
 * sliver of a row block asks for the pair's lines PBF_AHEAD pairs of k ahead: it reads the pair
 * from memory, the others from L2 (every line against every other one: 1.08x at 64 rows, 1.03x
 * at 256; 16 or 48 ahead: the same; on into the next pair as well: 0.96-0.98x at 256 and 2,048
 * rows). Work splits between threads as in the fp32 kernel above, by panel pairs.
 * panel_linear_silu_bf16 is the same GEMM for a gated MLP's merged gate/up weight whose tile pairs
 * gate panel j with up panel j and writes silu(gate) * up (1.09x the two ops at 64 and 2,048 rows).
 *
 * Measured on 2 cores of an AMD EPYC with AVX512-BF16 (`bench/avx2_linear.py --dtype
 * bfloat16`, the default model's 120 layer GEMMs from memory, 2026-12-07): 64 rows 1.16x
 * oneDNN's speed on its prepacked weight (326 GFLOP/s), 1 and 8 rows 1.47x and 1.26x, 256 and
 * 2,048 rows as fast (383, 393). Each output is the sum over k in order, pairs
 * summed by vdpbf16ps in fp32, rounded to bf16 once (round to nearest even). */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)

#define PBF_NR 16
#define PBF_MR 8
#define PBF_MC 192
#define PBF_AHEAD 32

int panel_bf16_available(void) { return 1; }

/* ROWS x (16 NP) of c = x rows . the panels at b0 and b1 (NP = 1: b0 only), plus their bias
 * (bias0, bias1) where given; ROWS, NP and GATED are constants at each call (always inlined).
 * GATED (NP = 2: b0 a gate panel, b1 its up panel) writes the 16 columns silu(gate) * up instead,
 * with the roundings of the two ops it replaces: gate and up rounded to bf16 as this kernel
 * stores them, then cpu_kernels.c's SiLU-and-mul arithmetic on them (silu_mul_bf16_512: silu
 * rounded, the product rounded), so the result is bit for bit theirs. */
static inline __attribute__((always_inline)) void pbf_tile(const uint16_t *x, int64_t xs, const uint16_t *b0,
                                                            const uint16_t *b1, int64_t kp, uint16_t *c,
                                                            int64_t ldc, const int rows, const int np,
                                                            const int gated, const uint16_t *bias0,
                                                            const uint16_t *bias1, int ahead) {
    __m512 acc[PBF_MR][2];
    const uint16_t *xr[PBF_MR];
    for (int i = 0; i < rows; i++) {
        acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        xr[i] = x + i * xs;
    }
    for (int64_t q = 0; q < kp; q++) {
        if (ahead && q + PBF_AHEAD < kp) { /* a 64-byte line a pair of k and panel */
            __builtin_prefetch(b0 + (q + PBF_AHEAD) * 32, 0, 3);
            if (np == 2) __builtin_prefetch(b1 + (q + PBF_AHEAD) * 32, 0, 3);
        }
        const __m512bh w0 = (__m512bh)_mm512_load_si512(b0 + q * 32);
        __m512bh w1 = w0;
        if (np == 2) w1 = (__m512bh)_mm512_load_si512(b1 + q * 32);
        for (int i = 0; i < rows; i++) {
            int32_t pair;
            memcpy(&pair, xr[i] + 2 * q, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);
            if (np == 2) acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
        }
    }
    for (int i = 0; i < rows; i++) {
        if (gated) {
            __m512 g = acc[i][0], u = acc[i][1];
            if (bias0) {
                g = _mm512_add_ps(g, load_bf16_512(bias0));
                u = _mm512_add_ps(u, load_bf16_512(bias1));
            }
            g = widen_bf16_512((__m256i)_mm512_cvtneps_pbh(g)); /* as stored, then as loaded */
            u = widen_bf16_512((__m256i)_mm512_cvtneps_pbh(u));
            store16_bf16_512(c + i * ldc, silu_mul_bf16_512(g, u)); /* cpu_kernels.c's SiLU-and-mul */
            continue;
        }
        for (int h = 0; h < np; h++) {
            __m512 v = acc[i][h];
            if (bias0) v = _mm512_add_ps(v, load_bf16_512(h ? bias1 : bias0)); /* cpu_kernels.c's */
            _mm256_storeu_si256((__m256i *)(c + i * ldc + 16 * h), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

#define PBF_ROWS(R)                                                                                  \
    case R:                                                                                          \
        if (gated) pbf_tile(x, xs, b0, b1, kp, c, ldc, R, 2, 1, bias0, bias1, ahead);                \
        else if (np == 2) pbf_tile(x, xs, b0, b1, kp, c, ldc, R, 2, 0, bias0, bias1, ahead);         \
        else pbf_tile(x, xs, b0, b1, kp, c, ldc, R, 1, 0, bias0, bias1, ahead);                      \
        break;

static void pbf_sliver(const uint16_t *x, int64_t xs, const uint16_t *b0, const uint16_t *b1, int64_t kp,
                       uint16_t *c, int64_t ldc, int rows, int np, int gated, const uint16_t *bias0,
                       const uint16_t *bias1, int ahead) {
    switch (rows) {
    PBF_ROWS(8) PBF_ROWS(7) PBF_ROWS(6) PBF_ROWS(5) PBF_ROWS(4) PBF_ROWS(3) PBF_ROWS(2) PBF_ROWS(1)
    default: break;
    }
}

/* Rows [r0, r1) times the panel pair u, all of K: panels 2u and 2u + 1 (the last pair may be a
 * single panel), or where gated the gate panel u and its up panel u + panels / 2, into output
 * columns 16 u on. The first sliver asks for the pair's lines ahead; the others find them in L2. */
static void pbf_unit(const uint16_t *x, int64_t xs, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                     int64_t ys, int64_t r0, int64_t r1, int64_t u, int64_t kp, int64_t panels, int gated) {
    const int64_t p0 = gated ? u : 2 * u, p1 = gated ? u + panels / 2 : 2 * u + 1;
    const int np = p1 < panels ? 2 : 1;
    const int64_t col = (gated ? u : 2 * u) * PBF_NR;
    for (int64_t r = r0; r < r1; r += PBF_MR)
        pbf_sliver(x + r * xs, xs, wp + p0 * kp * 32, wp + p1 * kp * 32, kp, y + r * ys + col, ys,
                   (int)(r1 - r < PBF_MR ? r1 - r : PBF_MR), np, gated, bias ? bias + p0 * PBF_NR : NULL,
                   bias ? bias + p1 * PBF_NR : NULL, r == r0);
}

/* Both entry points: row blocks of (nearly) equal size, whole slivers, and the threads' equal
 * shares of the panel pairs (as by_panels above) or of the (row block, pair) units */
static void pbf_run(const uint16_t *x, int64_t xs, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                    int64_t ys, int64_t m, int64_t n, int64_t k, int nthreads, int gated) {
    const int64_t panels = n / PBF_NR, pairs = gated ? panels / 2 : (panels + 1) / 2, kp = k / 2;
    const int64_t blocks = (m + PBF_MC - 1) / PBF_MC;
    const int64_t mc = ((m + blocks - 1) / blocks + PBF_MR - 1) / PBF_MR * PBF_MR;
    const int by_pairs = pairs >= 4 * (int64_t)nthreads;
    const int64_t units = by_pairs ? pairs : blocks * pairs;
    if (nthreads > units) nthreads = (int)units;
    #pragma omp parallel num_threads(nthreads) if(nthreads > 1)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = units * t / nt, hi = units * (t + 1) / nt;
        if (by_pairs) {
            for (int64_t r0 = 0; r0 < m; r0 += mc)
                for (int64_t u = lo; u < hi; u++)
                    pbf_unit(x, xs, wp, bias, y, ys, r0, r0 + mc < m ? r0 + mc : m, u, kp, panels, gated);
        } else {
            for (int64_t v = lo; v < hi; v++) {
                const int64_t r0 = v / pairs * mc;
                pbf_unit(x, xs, wp, bias, y, ys, r0, r0 + mc < m ? r0 + mc : m, v % pairs, kp, panels, gated);
            }
        }
    }
}

/* 0, or 1: arguments it cannot take (n not a multiple of 16, k odd, a misaligned weight, no rows) */
int panel_linear_bf16(const uint16_t *x, int64_t xs, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                      int64_t ys, int64_t m, int64_t n, int64_t k, int nthreads) {
    if (m < 1 || n < PBF_NR || n % PBF_NR || k < 2 || k % 2 || nthreads < 1 || ((uintptr_t)wp & 63)) return 1;
    pbf_run(x, xs, wp, bias, y, ys, m, n, k, nthreads, 0);
    return 0;
}

/* y (m x n / 2) = silu(g) * u of [g | u] = x . W^T (+ bias), W's first n / 2 rows the gate's and
 * the rest the up projection's (a gated MLP's merged weight), without [g | u] ever in memory:
 * each tile takes gate panel j and up panel j. 0, or 1: arguments it cannot take (n not a
 * multiple of 32, k odd, a misaligned weight, no rows). */
int panel_linear_silu_bf16(const uint16_t *x, int64_t xs, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                           int64_t ys, int64_t m, int64_t n, int64_t k, int nthreads) {
    if (m < 1 || n < 2 * PBF_NR || n % (2 * PBF_NR) || k < 2 || k % 2 || nthreads < 1 || ((uintptr_t)wp & 63))
        return 1;
    pbf_run(x, xs, wp, bias, y, ys, m, n, k, nthreads, 1);
    return 0;
}

#else /* no AVX512-BF16: the entry points exist and refuse */

int panel_bf16_available(void) { return 0; }

int panel_linear_bf16(const uint16_t *x, int64_t xs, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                      int64_t ys, int64_t m, int64_t n, int64_t k, int nthreads) {
    (void)x, (void)xs, (void)wp, (void)bias, (void)y, (void)ys, (void)m, (void)n, (void)k, (void)nthreads;
    return 1;
}

int panel_linear_silu_bf16(const uint16_t *x, int64_t xs, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                           int64_t ys, int64_t m, int64_t n, int64_t k, int nthreads) {
    return panel_linear_bf16(x, xs, wp, bias, y, ys, m, n, k, nthreads);
}

#endif

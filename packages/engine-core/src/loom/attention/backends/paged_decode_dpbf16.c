/* Decode attention in bf16 with AVX512-BF16, appended to paged_decode.c when it is built (same
 * layouts, arguments and work items as the portable kernel there; see its comment).
 *
 * The portable kernel widens every K element to fp32 and ends each score with a horizontal sum
 * of one vector: at a decode batch of 64 it computes about 47 GFLOP/s on two cores, so it is
 * bound by instructions, not by the K/V it reads. Here:
 *   - the decode item's cache slots (row, KV heads, tokens as in the portable kernel) are found
 *     once, a division by the block size for the item instead of one per token and use.
 *   - Q.K: `vdpbf16ps` multiplies K's bf16 pairs by the query's without widening (the products
 *     are exact in fp32; pairs are summed in fp32), 32 elements an instruction, and the 16
 *     scores of a tile of 16 tokens are reduced together (a tree of 45 shuffles and adds for
 *     16 vectors instead of a reduction per score); the scale is applied to the sums. The loop
 *     is compiled for each D / 32, so a head's K row stays in registers.
 *   - softmax in 16 lanes (exp16_nonpositive, the portable kernel's exp), left unnormalized: P.V divides
 *     its D sums by the softmax's sum instead of dividing every probability.
 *   - P.V: the probabilities stay fp32 (decode rows; prefill rows round them, see below); V is
 *     widened without a shuffle (see pv_part) and accumulated with FMAs for up to four query
 *     heads of the group and 64 elements of D in registers.
 * Measured 2026-12-06 on this machine's 2 cores (Xeon with AVX512-BF16 and AMX), ms a layer, the
 * decode path before this version -> after, the two built alike and alternated in one run:
 *   cache-warm (one layer's K/V called again and again), 1 / 2 threads:
 *     64 rows x 160 tokens, 9/3 heads of 64:   1.15 -> 0.79 / 0.65 -> 0.44
 *     64 x 128: 0.91 -> 0.62 / 0.51 -> 0.36;   64 x 192: 1.40 -> 0.95 / 0.59 -> 0.41
 *     16 x 300: 0.55 -> 0.41 / 0.31 -> 0.23;   8 x 500: 0.47 -> 0.35 / 0.26 -> 0.18
 *     1 x 200: 0.036 -> 0.028 / 0.031 -> 0.026; 1 x 1500 (split): 0.16 -> 0.11 / 0.096 -> 0.067
 *     64 x 160, 12/12 heads of 64 (OPT-125m): 3.52 -> 2.35 / 1.74 -> 1.24
 *     16 x 300, 32/8 heads of 128: 3.02 -> 2.43 / 1.64 -> 1.26
 *   30 layers' K/V called in turn (as in a model's step, mostly from memory), 1 / 2 threads:
 *     64 x 160: 1.73 -> 1.39 / 0.92 -> 0.77;   16 x 300: 0.84 -> 0.66 / 0.46 -> 0.37
 *     1 x 1000: 0.26 -> 0.22 / 0.19 -> 0.16;   64 x 160 OPT-125m: 6.18 -> 5.10 / 3.01 -> 2.54
 *   From memory the kernel still computes and waits in turn (11.5 GB/s of K/V on two cores where
 *     a plain sum reads 22 GB/s): the next item's K/V is asked for while one computes (see the
 *     prefetcher in paged_decode.c), and taking the asking away is faster cache-warm (0.40 vs
 *     0.43 ms) but slower from memory (0.80 vs 0.69).
 * Used for D % 32 == 0 (every head size of common models but 80 and 8); `paged_decode_bf16`
 * (the exported entry, at the end) sends other sizes and CPUs without the extension to the
 * portable kernel. The results equal the portable kernel's up to the fp32 rounding of the
 * score sums' order, except at subnormals: `vdpbf16ps` reads subnormal K and query elements as
 * zero and `vcvtneps2bf16` (the output's rounding) flushes subnormal results to zero, where the
 * portable kernel keeps them (values below 1.2e-38, which attention does not meet in practice).
 */

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define LOOM_DPBF16 1
#define MAX_DV32 8 /* D / 32 up to 256 */

static inline __m512bh load_bh(const bf16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }
static inline __m512 widen16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
}

static const bf16_t zero_row[32 * MAX_DV32]; /* the keys of a tile past the context */

typedef uint32_t u32_alias __attribute__((may_alias)); /* a bf16 pair, read from bf16 storage */

/* ---- Decode: one query row, a range of its KV heads, a range of its context ----
 * The item's cache slots are found once (one division by the block size for the whole item;
 * a division per token cost more than the arithmetic it addressed). */

/* slots[u] = the cache slot of token tb + u, 0 <= u < n */
static inline void item_slots(const int64_t *table, int64_t block_size, int64_t tb, int64_t n, int64_t *slots) {
    int64_t blk = tb / block_size, off = tb % block_size;
    for (int64_t u = 0; u < n; u++) {
        slots[u] = table[blk] * block_size + off;
        if (++off == block_size) off = 0, blk++;
    }
}

/* scores[r * stride + u] = scale * q_r . k_u for the g query heads of one KV head, 0 <= u < n, keys
 * at k + slots[u] * row (written up to n rounded up to 16; the keys past n are zero); D = 32 * DV */
static inline __attribute__((always_inline)) void qk_part(const bf16_t *q, const bf16_t *k, const int64_t *slots,
                                                          int64_t row, int64_t n, int64_t g, float scale,
                                                          float *scores, int64_t stride, prefetcher *pf,
                                                          const int DV) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t u0 = 0; u0 < n; u0 += 16) {
        const bf16_t *kp[16];
        for (int j = 0; j < 16; j++) kp[j] = u0 + j < n ? k + slots[u0 + j] * row : zero_row;
        for (int64_t f = u0 + 16; f < u0 + 32 && f < n; f++) { /* the next tile: blocks are scattered */
            const char *p = (const char *)(k + slots[f] * row);
            for (int l = 0; l < DV; l++) __builtin_prefetch(p + 64 * l);
        }
        for (int64_t r = 0; r < g; r++) {
            prefetch_some(pf);
            __m512bh qv[MAX_DV32];
            for (int c = 0; c < DV; c++) qv[c] = load_bh(q + r * 32 * DV + 32 * c);
            __m512 a[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], load_bh(kp[j]));
                for (int c = 1; c < DV; c++) s = _mm512_dpbf16_ps(s, qv[c], load_bh(kp[j] + 32 * c));
                a[j] = s;
            }
            _mm512_storeu_ps(scores + r * stride + u0, _mm512_mul_ps(reduce16(a), vscale));
        }
    }
}

static void qk_dp(const bf16_t *q, const bf16_t *k, const int64_t *slots, int64_t row, int64_t n, int64_t g,
                  int64_t D, float scale, float *scores, int64_t stride, prefetcher *pf) {
    switch (D / 32) {
#define QK_CASE(DV) case DV: qk_part(q, k, slots, row, n, g, scale, scores, stride, pf, DV); break;
    QK_CASE(1) QK_CASE(2) QK_CASE(3) QK_CASE(4) QK_CASE(5) QK_CASE(6) QK_CASE(7) QK_CASE(8)
#undef QK_CASE
    }
}

/* each of g rows of scores (row stride `stride`, n values): e^(s - max) in place, unnormalized;
 * ml[2r] = row r's max, ml[2r + 1] its sum of exponentials (P.V divides by it at the end) */
static inline void softmax_dp(float *scores, int64_t g, int64_t stride, int64_t n, float *ml) {
    const __mmask16 last = (__mmask16)(0xFFFFu >> ((16 - n % 16) % 16)); /* the valid lanes of the last tile */
    const int64_t full = (n - 1) / 16 * 16;                                 /* where the last tile starts */
    for (int64_t r = 0; r < g; r++) {
        float *s = scores + r * stride;
        __m512 m = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), last, s + full);
        for (int64_t u = 0; u < full; u += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + u));
        const float mx = _mm512_reduce_max_ps(m);
        const __m512 vm = _mm512_set1_ps(mx);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t u = 0; u < full; u += 16) {
            const __m512 e = (__m512)exp16_nonpositive((v16f)_mm512_sub_ps(_mm512_loadu_ps(s + u), vm));
            _mm512_storeu_ps(s + u, e);
            sum = _mm512_add_ps(sum, e);
        }
        const __m512 e = _mm512_maskz_mov_ps(last, (__m512)exp16_nonpositive((v16f)_mm512_sub_ps(_mm512_loadu_ps(s + full), vm)));
        _mm512_storeu_ps(s + full, e);
        ml[2 * r] = mx, ml[2 * r + 1] = _mm512_reduce_add_ps(_mm512_add_ps(sum, e));
    }
}

/* NR heads' P.V over n tokens for 32 * NC elements of D, values at v + slots[u] * row; divided by
 * the heads' sums (ml[2r + 1]) into o (bf16, rows of os) or, where of is not NULL, its fp32 rows.
 * V is widened without a shuffle: a 32-bit lane of 32 bf16 holds elements 2i (low half) and
 * 2i + 1 (high half), `<< 16` and `& 0xFFFF0000` make them floats, and the even and odd
 * elements are accumulated apart and interleaved once at the end. */
static inline __attribute__((always_inline)) void pv_part(const bf16_t *v, const int64_t *slots, int64_t row,
                                                          int64_t n, const float *p, int64_t stride, const float *ml,
                                                          bf16_t *o, float *of, int64_t os, prefetcher *pf,
                                                          const int NR, const int NC) {
    __m512 ev[4][2], od[4][2];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) ev[r][c] = od[r][c] = _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t u = 0; u < n; u++) {
        const bf16_t *x = v + slots[u] * row;
        if ((u & 3) == 0) prefetch_some(pf);
        if (u + 8 < n) __builtin_prefetch(v + slots[u + 8] * row);
        __m512 xe[2], xo[2];
        for (int c = 0; c < NC; c++) {
            const __m512i b = _mm512_loadu_si512((const void *)(x + 32 * c));
            xe[c] = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
            xo[c] = _mm512_castsi512_ps(_mm512_and_si512(b, high));
        }
        for (int r = 0; r < NR; r++) {
            const __m512 w = _mm512_set1_ps(p[r * stride + u]);
            for (int c = 0; c < NC; c++) {
                ev[r][c] = _mm512_fmadd_ps(w, xe[c], ev[r][c]);
                od[r][c] = _mm512_fmadd_ps(w, xo[c], od[r][c]);
            }
        }
    }
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int r = 0; r < NR; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / ml[2 * r + 1]);
        for (int c = 0; c < NC; c++) {
            const __m512 a = _mm512_mul_ps(_mm512_permutex2var_ps(ev[r][c], lo, od[r][c]), inv);
            const __m512 b = _mm512_mul_ps(_mm512_permutex2var_ps(ev[r][c], hi, od[r][c]), inv);
            if (of) {
                _mm512_storeu_ps(of + r * os + 32 * c, a);
                _mm512_storeu_ps(of + r * os + 32 * c + 16, b);
            } else {
                _mm512_storeu_si512((void *)(o + r * os + 32 * c), (__m512i)_mm512_cvtne2ps_pbh(b, a));
            }
        }
    }
}

#define PV_CASE(NR)                                                                                       \
    if (nc == 2) pv_part(v + d0, slots, row, n, p, stride, m, o, of, os, pf, NR, 2);                       \
    else pv_part(v + d0, slots, row, n, p, stride, m, o, of, os, pf, NR, 1);

/* the g heads' P.V of one KV head (values at v + slots[u] * row), probabilities p unnormalized with
 * their sums in ml: into out (bf16 rows of os), or where outf is not NULL into its fp32 rows */
static void pv_dp(const bf16_t *v, const int64_t *slots, int64_t row, int64_t n, int64_t g, int64_t D,
                  const float *scores, int64_t stride, const float *ml, bf16_t *out, float *outf, int64_t os,
                  prefetcher *pf) {
    for (int64_t r0 = 0; r0 < g; r0 += 4) {
        const int64_t nr = g - r0 < 4 ? g - r0 : 4;
        const float *p = scores + r0 * stride, *m = ml + 2 * r0;
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int64_t nc = D - d0 < 64 ? 1 : 2;
            bf16_t *o = outf ? NULL : out + r0 * os + d0;
            float *of = outf ? outf + r0 * os + d0 : NULL;
            if (nr == 4) { PV_CASE(4) } else if (nr == 3) { PV_CASE(3) } else if (nr == 2) { PV_CASE(2) } else { PV_CASE(1) }
        }
    }
}

/* a thread's scratch for decode items of up to `stride` tokens (a multiple of 16): scores (g rows),
 * ml (2g floats, rounded up to 16), slots (stride int64), one 64-byte aligned block */
static float *decode_scratch(int64_t g, int64_t stride) {
    return aligned_alloc(64, sizeof(float) * (size_t)(g * stride + (2 * g + 15) / 16 * 16 + 2 * stride));
}

/* Decode item: query row q (its heads from KV head kh0's first), KV heads kh0 .. kh1-1, tokens
 * tb .. te-1 of table's context: into out (bf16, the heads' D elements in a row), or where outf is
 * not NULL into fp32 rows of pw floats, each with the head's softmax max and sum after its D
 * (for a merge of parts). Scratch: scores (g rows of stride), ml (2g), slots (te - tb). */
static void decode_item(const bf16_t *q, const bf16_t *k_cache, const bf16_t *v_cache, const int64_t *table,
                        int64_t block_size, int64_t row, int64_t kh0, int64_t kh1, int64_t tb, int64_t te, int64_t g,
                        int64_t D, float scale, float *scores, int64_t stride, float *ml, int64_t *slots,
                        bf16_t *out, float *outf, int64_t pw, prefetcher *pf) {
    const int64_t n = te - tb;
    if (n <= 0) { /* no context (no decode row has none): zeros, as the portable kernel gives */
        for (int64_t h = 0; h < (kh1 - kh0) * g; h++) {
            if (outf) {
                memset(outf + h * pw, 0, sizeof(float) * (size_t)D);
                outf[h * pw + D] = -INFINITY, outf[h * pw + D + 1] = 0.f;
            } else {
                memset(out + h * D, 0, sizeof(bf16_t) * (size_t)D);
            }
        }
        return;
    }
    item_slots(table, block_size, tb, n, slots);
    for (int64_t kh = kh0; kh < kh1; kh++) {
        const int64_t h0 = (kh - kh0) * g;
        qk_dp(q + h0 * D, k_cache + kh * D, slots, row, n, g, D, scale, scores, stride, pf);
        softmax_dp(scores, g, stride, n, ml);
        if (outf) {
            pv_dp(v_cache + kh * D, slots, row, n, g, D, scores, stride, ml, NULL, outf + h0 * pw, pw, pf);
            for (int64_t r = 0; r < g; r++) outf[(h0 + r) * pw + D] = ml[2 * r], outf[(h0 + r) * pw + D + 1] = ml[2 * r + 1];
        } else {
            pv_dp(v_cache + kh * D, slots, row, n, g, D, scores, stride, ml, out + h0 * D, NULL, D, pf);
        }
    }
}

/* ---- Prefill: consecutive query rows of one request, QB at a time ----
 * Rows b .. b+n-1 of the same request whose contexts grow by one (the tokens of a prefill chunk,
 * each attending to the positions up to its own) share each K and V tile: K's 16 tokens are
 * transposed once into pairs (lane j of kt[i] = elements 2i, 2i+1 of token j), so a query head's
 * 16 scores are D/2 `vdpbf16ps` with the query's pair broadcast, and no reduction. P is rounded
 * to bf16 before P.V, where torch's flash kernel (the path this replaces) rounds it: with P kept
 * in fp32 the default model's greedy chat answers drifted from torch's as often as bf16 answers
 * drift from fp32 ones, the README's example among them. So P.V is `vdpbf16ps` too: the run's
 * context's V is laid out once as pairs of keys for all its heads (pv_pairs), and each row
 * multiplies its own keys, its sums in registers, two rows at a time (pv_pairs2: one row's four
 * chains of vdpbf16ps waited on the instruction's latency, `perf` found a quarter of the kernel on
 * them; two rows side by side, each V loaded once, 1.02-1.07x for prompts of 128 and 1.16-1.29x
 * for prompts of 1,000-4,096 tokens, the same bits; 2026-12-08). Before (2026-12-07), V was
 * widened to fp32 a tile at a time and P rounded one float at a time: 16 prompts of 128 tokens,
 * the default model's heads, 30 layers' K/V, 2.8-3.2 ms a layer against 1.9-2.1 then, the same
 * bits (2 cores of an AMD EPYC with AVX512-BF16; the bits differ only where vdpbf16ps reads a
 * subnormal P or V as zero). */
#define QB 16

/* o[16 c .. + 16] for c < ND (bf16) = sum over the row's m keys of P . V, with P as bf16 pairs pp[j]
 * and V as pairs of keys, vp[(j * DC + c) * 32 ..], lane i holding V[2j + 1][16 c + i] in its low half
 * and V[2j][16 c + i] in its high half (P's pair alike). vdpbf16ps adds the high half's product
 * first, then the low half's, each rounded (both products are exact in fp32): key 2j, then 2j + 1,
 * the order of one fused multiply-add a key, so the sums are bit for bit those of a key at a time.
 * An odd m's last pair holds a key past the row's own position: its V is masked to zero, so a
 * non-finite V there reaches no row that does not see it (its P is zero, but 0 * inf is NaN). */
#define AI static inline __attribute__((always_inline))
/* x[c] += P . V over pairs [j0, j1) of one row */
AI void pv_acc(__m512 *x, const uint32_t *pp, int64_t j0, int64_t j1, const bf16_t *vp, int64_t DC, const int ND) {
    for (int64_t j = j0; j < j1; j++) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[j]);
        for (int c = 0; c < ND; c++) x[c] = _mm512_dpbf16_ps(x[c], load_bh(vp + (j * DC + c) * 32), w);
    }
}
/* an odd m's last pair (its V masked), then x rounded into o */
AI void pv_end(__m512 *x, const uint32_t *pp, int64_t m, const bf16_t *vp, int64_t DC, bf16_t *o, const int ND) {
    if (m & 1) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[m / 2]);
        for (int c = 0; c < ND; c++)
            x[c] = _mm512_dpbf16_ps(x[c], (__m512bh)_mm512_maskz_mov_epi16(
                                              0xAAAAAAAAu, _mm512_loadu_si512(vp + (m / 2 * DC + c) * 32)), w);
    }
    for (int c = 0; c < ND; c++) _mm256_storeu_si256((void *)(o + 16 * c), (__m256i)_mm512_cvtneps_pbh(x[c]));
}
AI void pv_pairs(const uint32_t *pp, int64_t m, const bf16_t *vp, int64_t DC, bf16_t *o, const int ND) {
    __m512 x[4];
    for (int c = 0; c < ND; c++) x[c] = _mm512_setzero_ps();
    pv_acc(x, pp, 0, m / 2, vp, DC, ND);
    pv_end(x, pp, m, vp, DC, o, ND);
}
/* pv_pairs of two rows: the pairs both have with their sums side by side, each V loaded once (one
 * row's chain of vdpbf16ps a column is bound by the instruction's latency), then each row's own;
 * each row adds its keys in the same order as alone, so the bits are pv_pairs' */
AI void pv_pairs2(const uint32_t *p0, int64_t m0, const uint32_t *p1, int64_t m1, const bf16_t *vp, int64_t DC,
                  bf16_t *o0, bf16_t *o1, const int ND) {
    __m512 x[4], y[4];
    for (int c = 0; c < ND; c++) x[c] = y[c] = _mm512_setzero_ps();
    const int64_t common = (m0 < m1 ? m0 : m1) / 2;
    for (int64_t j = 0; j < common; j++) {
        const __m512bh w0 = (__m512bh)_mm512_set1_epi32((int)p0[j]), w1 = (__m512bh)_mm512_set1_epi32((int)p1[j]);
        for (int c = 0; c < ND; c++) {
            const __m512bh v = load_bh(vp + (j * DC + c) * 32);
            x[c] = _mm512_dpbf16_ps(x[c], v, w0);
            y[c] = _mm512_dpbf16_ps(y[c], v, w1);
        }
    }
    pv_acc(x, p0, common, m0 / 2, vp, DC, ND);
    pv_end(x, p0, m0, vp, DC, o0, ND);
    pv_acc(y, p1, common, m1 / 2, vp, DC, ND);
    pv_end(y, p1, m1, vp, DC, o1, ND);
}
#undef AI

/* vpermt2w's index for a pair of keys: element 2i from b (key 2j + 1), 2i + 1 from a (key 2j) */
static const uint16_t pair_lanes[32] = {32, 0, 33, 1, 34, 2, 35, 3, 36, 4, 37, 5, 38, 6, 39, 7,
                                        40, 8, 41, 9, 42, 10, 43, 11, 44, 12, 45, 13, 46, 14, 47, 15};

/* r[j][c] -> r[c][j]: a 16 x 16 matrix of 32-bit elements transposed in registers (interleaves of
 * 32 and 64 bits within 128-bit lanes, then two exchanges of whole lanes) */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* lane L of t[4i + k]: column 4L + k of rows 4i .. 4i + 3 */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i u0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), u1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xDD);
        const __m512i u2 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
        const __m512i u3 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xDD);
        t[k] = _mm512_shuffle_i32x4(u0, u2, 0x88);      /* column k */
        t[4 + k] = _mm512_shuffle_i32x4(u1, u3, 0x88);  /* column 4 + k */
        t[8 + k] = _mm512_shuffle_i32x4(u0, u2, 0xDD);  /* column 8 + k */
        t[12 + k] = _mm512_shuffle_i32x4(u1, u3, 0xDD); /* column 12 + k */
    }
    for (int c = 0; c < 16; c++) r[c] = t[c];
}

/* the run's n query rows (rq, contexts ctx_of, consecutive) for KV head kh */
static void prefill_run(const bf16_t *query, int64_t q_stride, const int64_t *rq, const int64_t *ctx_of, int64_t n,
                        const bf16_t *k_cache, const bf16_t *v_cache, const int64_t *table, int64_t block_size,
                        int64_t row, int64_t kh, int64_t g, int64_t D, float scale, float *scores, int64_t stride,
                        u32_alias *kt, bf16_t *vp, bf16_t *out, int64_t out_stride) {
    const int64_t ctxmax = ctx_of[n - 1], nh = n * g, dp = D / 2;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < ctxmax; t0 += 16) {
        const bf16_t *src[16];
        for (int j = 0; j < 16; j++) {
            const int64_t t = t0 + j;
            src[j] = t < ctxmax ? k_cache + (table[t / block_size] * block_size + t % block_size) * row + kh * D
                                : NULL;
        }
        for (int64_t i0 = 0; i0 < dp; i0 += 16) { /* pairs i0 .. i0 + 15 of the 16 tokens */
            __m512i r[16];
            for (int j = 0; j < 16; j++)
                r[j] = src[j] ? _mm512_loadu_si512((const void *)(src[j] + 2 * i0)) : _mm512_setzero_si512();
            transpose16_epi32(r);
            for (int c = 0; c < 16; c++) _mm512_store_si512((void *)(kt + (i0 + c) * 16), r[c]);
        }
        int64_t i0 = t0 + 1 - ctx_of[0]; /* the first query whose context reaches this tile */
        if (i0 < 0) i0 = 0;
        for (int64_t h0 = i0 * g; h0 < nh; h0 += 8) {
            const int64_t nq = nh - h0 < 8 ? nh - h0 : 8;
            const u32_alias *qp[8];
            __m512 a[8];
            for (int k = 0; k < 8; k++) {
                const int64_t h = h0 + (k < nq ? k : 0);
                qp[k] = (const u32_alias *)(query + rq[h / g] * q_stride + (kh * g + h % g) * D);
                a[k] = _mm512_setzero_ps();
            }
            for (int64_t i = 0; i < dp; i++) {
                const __m512bh kv = (__m512bh)_mm512_load_si512((const void *)(kt + i * 16));
                for (int k = 0; k < 8; k++) a[k] = _mm512_dpbf16_ps(a[k], kv, (__m512bh)_mm512_set1_epi32((int)qp[k][i]));
            }
            for (int k = 0; k < nq; k++) _mm512_storeu_ps(scores + (h0 + k) * stride + t0, _mm512_mul_ps(a[k], vscale));
        }
    }
    for (int64_t h = 0; h < nh; h++) {
        float *sr = scores + h * stride;
        const int64_t c = ctx_of[h / g];
        softmax_rows(sr, 1, stride, c, NULL, 1);
        /* P rounded to bf16 (`vcvtne2ps2bf16`), where torch's flash kernel rounds it: the row's
         * floats become a bf16 row in place (32 read, then 32 written over the first half of
         * them), each pair of keys swapped within its 32 bits as pv_pairs takes them; past the
         * row's own keys, zero */
        bf16_t *pb = (bf16_t *)sr;
        for (int64_t u = 0; u < c; u += 32) {
            const __mmask16 m0 = c - u >= 16 ? 0xFFFF : (__mmask16)((1u << (c - u)) - 1);
            const __mmask16 m1 = c - u >= 32 ? 0xFFFF : c - u <= 16 ? 0 : (__mmask16)((1u << (c - u - 16)) - 1);
            const __m512 a = _mm512_maskz_loadu_ps(m0, sr + u), b = _mm512_maskz_loadu_ps(m1, sr + u + 16);
            _mm512_storeu_si512((void *)(pb + u), _mm512_rol_epi32((__m512i)_mm512_cvtne2ps_pbh(b, a), 16));
        }
    }
    /* V of the context as pairs of keys, once for all the run's heads: zeros past its end */
    const int64_t DC = D / 16;
    const __m512i lanes = _mm512_loadu_si512(pair_lanes);
    for (int64_t j = 0; 2 * j < ctxmax; j++) {
        const bf16_t *v0 = v_cache + (table[(2 * j) / block_size] * block_size + (2 * j) % block_size) * row + kh * D;
        const int64_t t1 = 2 * j + 1;
        const bf16_t *v1 = t1 < ctxmax ? v_cache + (table[t1 / block_size] * block_size + t1 % block_size) * row + kh * D
                                       : NULL;
        for (int64_t c = 0; c < DC; c++) {
            const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(v0 + 16 * c)));
            const __m512i b = v1 ? _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(v1 + 16 * c)))
                                 : _mm512_setzero_si512();
            _mm512_store_si512((void *)(vp + (j * DC + c) * 32), _mm512_permutex2var_epi16(a, lanes, b));
        }
    }
    for (int64_t h = 0; h < nh; h += 2) { /* two rows at a time (pv_pairs2) */
        const int two = h + 1 < nh;
        const uint32_t *p0 = (const uint32_t *)(scores + h * stride), *p1 = two ? p0 + stride : p0;
        const int64_t m0 = ctx_of[h / g], m1 = two ? ctx_of[(h + 1) / g] : 0;
        bf16_t *o0 = out + rq[h / g] * out_stride + (kh * g + h % g) * D;
        bf16_t *o1 = two ? out + rq[(h + 1) / g] * out_stride + (kh * g + (h + 1) % g) * D : NULL;
        for (int64_t c0 = 0; c0 < DC; c0 += 4) {
#define PV_ROWS(ND)                                                                                   \
    if (o1) pv_pairs2(p0, m0, p1, m1, vp + c0 * 32, DC, o0 + 16 * c0, o1 + 16 * c0, ND);             \
    else pv_pairs(p0, m0, vp + c0 * 32, DC, o0 + 16 * c0, ND);
            switch (DC - c0 < 4 ? DC - c0 : 4) {
            case 4: PV_ROWS(4) break;
            case 3: PV_ROWS(3) break;
            case 2: PV_ROWS(2) break;
            default: PV_ROWS(1) break;
            }
#undef PV_ROWS
        }
    }
}

/* The runs of rows (a row continues the run before it when it has the same request row and a
 * context one longer, up to QB rows); runs[k] = first row, lens[k] = rows. Returns the count. */
static int64_t find_runs(const int64_t *rows_req, const int64_t *ctx_lens, int64_t B, int64_t *runs, int64_t *lens) {
    int64_t k = 0;
    for (int64_t b = 0; b < B; b++) {
        if (k && lens[k - 1] < QB && rows_req[b] == rows_req[b - 1] && ctx_lens[b] == ctx_lens[b - 1] + 1) {
            lens[k - 1]++;
        } else {
            runs[k] = b, lens[k] = 1, k++;
        }
    }
    return k;
}

static int prefill_runs_dp_bf16(const bf16_t *query, int64_t q_stride, const int64_t *rows_q,
                                const int64_t *rows_req, const bf16_t *k_cache, const bf16_t *v_cache,
                                const int64_t *tables, int64_t bt_stride, const int64_t *ctx_lens, bf16_t *out,
                                int64_t out_stride, const int64_t *runs, const int64_t *lens, int64_t nruns,
                                int64_t H, int64_t Hk, int64_t D, int64_t block_size, int nthreads, float scale) {
    int64_t max_ctx = 1;
    for (int64_t k = 0; k < nruns; k++) {
        const int64_t c = ctx_lens[runs[k] + lens[k] - 1];
        max_ctx = c > max_ctx ? c : max_ctx;
    }
    const int64_t stride = (max_ctx + 15) / 16 * 16, g = H / Hk, row = Hk * D, items = nruns * Hk;
    int64_t *cost = malloc(sizeof(int64_t) * (size_t)items); /* a run's rows times their context (see thread_share) */
    if (!cost) return 1;
    for (int64_t it = 0; it < items; it++) {
        const int64_t k = it / Hk;
        cost[it] = lens[k] * (ctx_lens[runs[k] + lens[k] - 1] + ITEM_TOKENS);
    }
    int failed = 0;
    _Pragma("omp parallel num_threads(nthreads)")
    {
        float *scores = aligned_alloc(64, sizeof(float) * (size_t)(QB * g * stride));
        u32_alias *kt = aligned_alloc(64, sizeof(uint32_t) * (size_t)(8 * D)); /* D/2 pairs x 16 tokens */
        bf16_t *vp = aligned_alloc(64, sizeof(bf16_t) * (size_t)(stride * D)); /* the context's V, in pairs */
        if (!scores || !kt || !vp) {
            _Pragma("omp atomic write") failed = 1;
        } else {
            const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
            int64_t lo, hi;
            thread_share(cost, items, nt, tid, &lo, &hi);
            for (int64_t it = lo; it < hi; it++) {
                const int64_t k = it / Hk, kh = it % Hk, b0 = runs[k];
                prefill_run(query, q_stride, rows_q + b0, ctx_lens + b0, lens[k], k_cache, v_cache,
                            tables + rows_req[b0] * bt_stride, block_size, row, kh, g, D, scale, scores, stride,
                            kt, vp, out, out_stride);
            }
        }
        free(scores); free(kt); free(vp);
    }
    free(cost);
    return failed;
}

/* ---- Decode rows split along their context (flash-decoding) ----
 * With fewer (row, KV head) items than threads can share evenly, one chat stream's attention
 * ran on the threads unevenly (SmolLM2's 3 KV heads on 2 threads: 2:1) and each thread read
 * its head's 128 bytes of every 384-byte cache row. Here each row's context is cut into
 * `chunks` parts of whole 16-token tiles; an item is one part of one row with all its KV heads,
 * and while it computes, the thread asks for its next item's whole cache rows (K, then V) a few
 * lines at a time, as the other decode items do for their heads' share of the rows; each part
 * leaves its heads' P.V in fp32 with the softmax's max and sum, and the parts are merged after:
 * out = sum_c w_c o_c / sum_c w_c, w_c = sum_c * e^(max_c - max). */
static int decode_split_dp_bf16(const bf16_t *query, int64_t q_stride, const int64_t *rows_q, const int64_t *rows_req,
                                const bf16_t *k_cache, const bf16_t *v_cache, const int64_t *tables,
                                int64_t bt_stride, const int64_t *ctx_lens, bf16_t *out, int64_t out_stride,
                                const int64_t *singles, int64_t B, int64_t H, int64_t Hk, int64_t D,
                                int64_t block_size, int nthreads, float scale, int64_t chunks, int64_t max_ctx) {
    const int64_t g = H / Hk, row = Hk * D, pw = D + 2, items = B * chunks;
    const int64_t len_max = ((max_ctx + chunks - 1) / chunks + 15) / 16 * 16;
    float *part = malloc(sizeof(float) * (size_t)(items * H * pw)); /* item, query head: o (D), max, sum */
    int64_t *cost = decode_costs(ctx_lens, singles, items, chunks, chunks, Hk, Hk);
    if (!part || !cost) { free(part); free(cost); return 1; }
    int failed = 0;
    _Pragma("omp parallel num_threads(nthreads)")
    {
        float *scores = decode_scratch(g, len_max);
        if (!scores) {
            _Pragma("omp atomic write") failed = 1;
        } else {
            float *ml = scores + g * len_max;
            int64_t *slots = (int64_t *)(ml + (2 * g + 15) / 16 * 16);
            const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
            int64_t lo, hi;
            thread_share(cost, items, nt, tid, &lo, &hi);
            for (int64_t it = lo; it < hi; it++) {
                const int64_t b = singles[it / chunks];
                int64_t tb, te;
                part_range(ctx_lens[b], chunks, it % chunks, &tb, &te);
                const int64_t n = te > tb ? te - tb : 0;
                /* spread over this item's calls of prefetch_some: QK per tile and head, PV per 4 tokens */
                prefetcher pf = part_prefetcher(it + 1 < hi ? it + 1 : items, items, chunks, singles, rows_req, tables, bt_stride,
                                                ctx_lens, block_size, k_cache, v_cache, row * (int64_t)sizeof(bf16_t),
                                                Hk * (((n + 15) / 16) * g + ((n + 3) / 4) * ((g + 3) / 4) * ((D + 63) / 64)));
                float *pb = part + it * H * pw;
                if (tb >= te) { /* a short row's empty part: no weight in the merge */
                    for (int64_t h = 0; h < H; h++) pb[h * pw + D] = -INFINITY, pb[h * pw + D + 1] = 0.f;
                    continue;
                }
                decode_item(query + rows_q[b] * q_stride, k_cache, v_cache, tables + rows_req[b] * bt_stride,
                            block_size, row, 0, Hk, tb, te, g, D, scale, scores, len_max, ml, slots, NULL, pb, pw,
                            &pf);
            }
        }
        free(scores);
    }
    if (!failed)
        for (int64_t i = 0; i < B; i++)
            for (int64_t h = 0; h < H; h++) {
                float o[32 * MAX_DV32];
                merge_parts(part + i * chunks * H * pw + h * pw, chunks, H * pw, D, o);
                bf16_t *dst = out + rows_q[singles[i]] * out_stride + h * D;
                for (int64_t k = 0; k < D / 16; k++)
                    _mm256_storeu_si256((void *)(dst + 16 * k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(o + 16 * k)));
            }
    free(part);
    free(cost);
    return failed;
}

static int paged_decode_dp_bf16(const bf16_t *query, int64_t q_stride, const int64_t *rows_q,
                                const int64_t *rows_req, const bf16_t *k_cache, const bf16_t *v_cache,
                                const int64_t *tables, int64_t bt_stride, const int64_t *ctx_lens, bf16_t *out,
                                int64_t out_stride, int64_t B, int64_t H, int64_t Hk, int64_t D,
                                int64_t block_size, int nthreads, float scale) {
    /* prefill chunks (runs of rows) first, then the single rows (decodes) as below */
    int64_t *runs = malloc(sizeof(int64_t) * (size_t)(4 * B + 1));
    if (!runs) return 1;
    int64_t *lens = runs + B, *multi = lens + B, *mlens = multi + B, *singles = runs; /* singles reuse runs */
    const int64_t nruns = find_runs(rows_req, ctx_lens, B, runs, lens);
    int64_t nmulti = 0, nsingle = 0;
    for (int64_t k = 0; k < nruns; k++)
        if (lens[k] > 1) multi[nmulti] = runs[k], mlens[nmulti++] = lens[k];
    if (nmulti) {
        const int rc = prefill_runs_dp_bf16(query, q_stride, rows_q, rows_req, k_cache, v_cache, tables, bt_stride,
                                            ctx_lens, out, out_stride, multi, mlens, nmulti, H, Hk, D, block_size,
                                            nthreads, scale);
        if (rc) { free(runs); return rc; }
    }
    for (int64_t k = 0; k < nruns; k++) /* in place: singles[i] = runs[k] with i <= k */
        if (lens[k] == 1) singles[nsingle++] = runs[k];
    B = nsingle;
    if (!B) { free(runs); return 0; }
    int64_t max_ctx = 1;
    for (int64_t i = 0; i < B; i++) max_ctx = ctx_lens[singles[i]] > max_ctx ? ctx_lens[singles[i]] : max_ctx;
    const int64_t chunks = decode_chunks(B, Hk, max_ctx, nthreads);
    if (chunks) {
        const int rc = decode_split_dp_bf16(query, q_stride, rows_q, rows_req, k_cache, v_cache, tables, bt_stride,
                                            ctx_lens, out, out_stride, singles, B, H, Hk, D, block_size, nthreads,
                                            scale, chunks, max_ctx);
        free(runs);
        return rc;
    }
    const int64_t stride = (max_ctx + 15) / 16 * 16, g = H / Hk, row = Hk * D;
    /* work items as in the portable kernel: a request and a range of its KV heads, here fewer
     * heads where a row's K/V is large (decode_parts) */
    const int64_t parts = decode_parts(B, Hk, D, sizeof(bf16_t), ctx_lens, singles, nthreads, ITEM_KV_BYTES);
    const int64_t hpi = (Hk + parts - 1) / parts, per_req = (Hk + hpi - 1) / hpi, items = B * per_req;
    int64_t *cost = decode_costs(ctx_lens, singles, items, per_req, 0, hpi, Hk);
    if (!cost) { free(runs); return 1; }
    int failed = 0;
    _Pragma("omp parallel num_threads(nthreads)")
    {
        float *scores = decode_scratch(g, stride);
        if (!scores) {
            _Pragma("omp atomic write") failed = 1;
        } else {
            float *ml = scores + g * stride;
            int64_t *slots = (int64_t *)(ml + (2 * g + 15) / 16 * 16);
            const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
            int64_t lo, hi;
            thread_share(cost, items, nt, tid, &lo, &hi);
            for (int64_t it = lo; it < hi; it++) {
                const int64_t b = singles[it / per_req], kh0 = (it % per_req) * hpi;
                const int64_t kh1 = kh0 + hpi < Hk ? kh0 + hpi : Hk, ctx = ctx_lens[b];
                /* the next item's K/V, spread over this item's calls: QK per tile and head, PV per 4 tokens */
                prefetcher pf = next_item(it + 1 < hi ? singles[(it + 1) / per_req] : -1, (it + 1) % per_req,
                                          hpi, Hk, D, sizeof(bf16_t), rows_req, tables, bt_stride, ctx_lens,
                                          block_size, k_cache, v_cache,
                                          (kh1 - kh0) * (((ctx + 15) / 16) * g
                                                         + ((g + 3) / 4) * ((D + 63) / 64) * ((ctx + 3) / 4)));
                decode_item(query + rows_q[b] * q_stride + kh0 * g * D, k_cache, v_cache,
                            tables + rows_req[b] * bt_stride, block_size, row, kh0, kh1, 0, ctx, g, D, scale, scores,
                            stride, ml, slots, out + rows_q[b] * out_stride + kh0 * g * D, NULL, 0, &pf);
            }
        }
        free(scores);
    }
    free(cost);
    free(runs);
    return failed;
}
#endif

/* 1 where paged_decode_bf16 takes the AVX512-BF16 kernel for this shape, else 0 */
int paged_decode_dp_bf16_used(int64_t H, int64_t Hk, int64_t D) {
#ifdef LOOM_DPBF16
    return Hk > 0 && D % 32 == 0 && D <= 32 * MAX_DV32 && H % Hk == 0;
#else
    (void)H, (void)Hk, (void)D;
    return 0;
#endif
}

/* the parts paged_decode_bf16 cuts each decode row's context into for B decode rows of up to
 * max_ctx tokens (0: none, the rows go by KV heads); for the tests */
int64_t paged_decode_bf16_chunks(int64_t B, int64_t H, int64_t Hk, int64_t D, int64_t max_ctx, int nthreads) {
#ifdef LOOM_DPBF16
    if (paged_decode_dp_bf16_used(H, Hk, D)) return decode_chunks(B, Hk, max_ctx, nthreads);
#else
    (void)B, (void)H, (void)Hk, (void)D, (void)max_ctx, (void)nthreads;
#endif
    return 0;
}

/* the KV heads a decode work item of the AVX512-BF16 kernel takes, for B decode rows of these
 * contexts (where no row's context is cut into parts, see paged_decode_bf16_chunks); for the tests */
int64_t paged_decode_bf16_heads_per_item(int64_t B, int64_t Hk, int64_t D, const int64_t *ctx_lens, int nthreads) {
    const int64_t parts = decode_parts(B, Hk, D, 2, ctx_lens, NULL, nthreads, ITEM_KV_BYTES);
    return (Hk + parts - 1) / parts;
}

/* bf16: the AVX512-BF16 kernel where the CPU has it and D is a multiple of 32, else the portable
 * one of paged_decode.c (exported too, so the tests check both on a machine that has both) */
int paged_decode_bf16(const bf16_t *query, int64_t q_stride, const int64_t *rows_q, const int64_t *rows_req,
                      const bf16_t *k_cache, const bf16_t *v_cache, const int64_t *tables, int64_t bt_stride,
                      const int64_t *ctx_lens, bf16_t *out, int64_t out_stride, int64_t B, int64_t H, int64_t Hk,
                      int64_t D, int64_t block_size, int nthreads, float scale) {
#ifdef LOOM_DPBF16
    if (paged_decode_dp_bf16_used(H, Hk, D))
        return paged_decode_dp_bf16(query, q_stride, rows_q, rows_req, k_cache, v_cache, tables, bt_stride,
                                    ctx_lens, out, out_stride, B, H, Hk, D, block_size, nthreads, scale);
#endif
    return paged_decode_portable_bf16(query, q_stride, rows_q, rows_req, k_cache, v_cache, tables, bt_stride,
                                      ctx_lens, out, out_stride, B, H, Hk, D, block_size, nthreads, scale);
}

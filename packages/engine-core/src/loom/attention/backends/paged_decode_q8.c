/* Decode attention over an 8-bit KV cache (`--kv-cache-dtype int8`), and the write that fills it;
 * appended to paged_decode.c and paged_decode_dpbf16.c when they are built (it uses
 * paged_decode.c's types, exp16_nonpositive and prefetcher, nothing of paged_decode_dpbf16.c).
 *
 * Layout (bytes; kv_int8.py holds it in torch and is the reference for both functions here):
 *   a cache row   one slot's K (or V) of one layer: Hk * D int8 codes, KV head after KV head,
 *                 then the Hk fp32 scales; row = Hk * (D + 4) bytes. A head's vector is
 *                 scale * codes (symmetric, one scale per token and KV head, scale = amax / 127).
 *   k_rows        (num_slots, row) contiguous uint8; slot = block * block_size + offset
 *   v_rows        the same, for V
 *   query, out    bf16 rows of a (T, q_stride) / (T, out_stride) matrix; head h of row r at
 *                 query + r * q_stride + h * D
 *   tables        (num_requests, bt_stride) int64 block numbers
 * Decode row b reads query row rows_q[b], request row rows_req[b] of the tables and ctx_lens[b]
 * tokens of context, as paged_decode_bf16 does (the same arguments, but for the caches).
 *
 * Numerics:
 *   - Q.K: each query head is quantized to int16 (its largest magnitude -> 32767, rounded to
 *     nearest; relative error <= 2^-16 of the head's largest element), K's codes are widened to
 *     int16 and multiplied with `vpdpwssd` (AVX512-VNNI) into exact int32 sums (|sum| <= D *
 *     32767 * 127 < 2^31 for D <= 256); score = sum * k_scale[t] * (q_amax / 32767 * scale) in fp32.
 *     The 16 scores of a tile of 16 tokens are reduced together (reduce16, paged_decode.c).
 *   - softmax in fp32, 16 lanes (paged_decode.c's exp16_nonpositive), left unnormalized; each
 *     probability is then multiplied by its token's V scale.
 *   - P.V: V's codes widened to fp32 and accumulated with FMAs, for up to four query heads of a
 *     GQA group and 64 elements of D in registers; divided by the softmax's sum at the end and
 *     rounded to bf16 (nearest, ties to even).
 * So the result is the attention of the bf16 query over the dequantized cache up to fp32
 * rounding and the query's int16 rounding.
 *
 * Work items as in paged_decode_bf16's decode path: a decode row and a range of its KV heads
 * (whole rows where there are enough to keep the threads busy), shared by OpenMP threads in
 * turn; while an item computes, the thread asks for its next item's K and V rows (into L2) a
 * few lines at a time (paged_decode.c's prefetcher). Not done here: splitting a few long
 * contexts across threads (flash-decoding, as paged_decode_dpbf16.c does for bf16) and prefill
 * rows (each token of a prefill chunk is a row of its own here, correct but without sharing K/V
 * tiles among the chunk's rows).
 *
 * Measured 2026-12-06 on 2 cores of a Xeon with AVX512-VNNI/BF16 and AMX (a CI job beside it),
 * per layer, 64 decode rows x 160 tokens of 9/3 heads of 64, 30 layers' caches called in turn (as
 * in a model's step, mostly from memory), the two alternated in one run, medians of 25 sweeps:
 * paged_decode_bf16 0.553 ms, paged_decode_q8 0.371 ms (1.49x; a token's K, and its V, is a
 * row of 204 bytes where bf16 has 384); one thread 1.037 vs 0.672 ms (1.54x). With the CI job
 * busy on a core the two-thread medians become ~7 ms for both (OpenMP threads waiting on a
 * preempted one). The prototype measured 1.46x at 64 x 512 alike. Writing
 * 64 tokens' K and V a layer: kv_write_bf16 (memcpy) 6.3 us, kv_write_q8 10.9 us (ctypes call
 * included, Python wrapper not).
 *
 * Compiled where the CPU has AVX512-F/BW/VL and AVX512-VNNI (Cascade Lake, Ice Lake, Sapphire
 * Rapids, Zen 4 and later); elsewhere every function here returns Q8_NOT_COMPILED and the
 * caller keeps the torch reference path. Return codes: 0 done, 1 scratch memory could not be
 * allocated (decode) or a slot out of range (write; nothing written), 2 a shape the kernel does
 * not take, 3 (Q8_NOT_COMPILED) not compiled for this CPU.
 */

#define Q8_NOT_COMPILED 3

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <float.h>
#include <immintrin.h>
#define LOOM_Q8 1
#define Q8_MAX_DV 8 /* D / 32 up to 256 */

/* the first n (<= 16) bf16 of p as fp32 (lanes past n: 0) */
static inline __m512 q8_widen(const bf16_t *p, int n) {
    const __m256i h = _mm256_maskz_loadu_epi16((__mmask16)(0xFFFFu >> (16 - n)), (const void *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 floats to bf16, rounded to nearest (ties to even), NaN kept quiet: f32_to_bf16 of
 * paged_decode.c in 16 lanes (vcvtneps2bf16 is AVX512-BF16, which this file does not need) */
static inline __m256i q8_to_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

static const int8_t q8_zero_codes[32 * Q8_MAX_DV]; /* the keys of a tile past the context */

/* scores[r * stride + u] = q_r . k_u for the g query heads of one KV head, 0 <= u < n (written up
 * to n rounded up to 16): q16 (g rows of D int16) and qmul[r] (its scale times the attention
 * scale), K's codes at kc + coff[u], their scales ksc[u] (0 past n); D = 32 * DV */
static inline __attribute__((always_inline)) void qk_q8_part(const int16_t *q16, const float *qmul, const char *kc,
                                                             const int64_t *coff, const float *ksc, int64_t n,
                                                             int64_t g, float *scores, int64_t stride,
                                                             prefetcher *pf, const int DV) {
    for (int64_t u0 = 0; u0 < n; u0 += 16) {
        const int8_t *kp[16];
        for (int j = 0; j < 16; j++) kp[j] = u0 + j < n ? (const int8_t *)(kc + coff[u0 + j]) : q8_zero_codes;
        for (int64_t f = u0 + 16; f < u0 + 32 && f < n; f++) { /* the next tile: blocks are scattered */
            const char *p = kc + coff[f];
            for (int l = 0; l < DV; l += 2) __builtin_prefetch(p + 64 * (l / 2));
        }
        const __m512 ks = _mm512_loadu_ps(ksc + u0);
        for (int64_t r = 0; r < g; r++) {
            prefetch_some(pf);
            __m512i qv[Q8_MAX_DV];
            for (int c = 0; c < DV; c++) qv[c] = _mm512_loadu_si512((const void *)(q16 + r * 32 * DV + 32 * c));
            __m512 a[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                __m512i s = _mm512_setzero_si512();
                for (int c = 0; c < DV; c++)
                    s = _mm512_dpwssd_epi32(s, qv[c], _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void *)(kp[j] + 32 * c))));
                a[j] = _mm512_cvtepi32_ps(s);
            }
            _mm512_storeu_ps(scores + r * stride + u0,
                             _mm512_mul_ps(_mm512_mul_ps(reduce16(a), ks), _mm512_set1_ps(qmul[r])));
        }
    }
}

static void qk_q8(const int16_t *q16, const float *qmul, const char *kc, const int64_t *coff, const float *ksc,
                  int64_t n, int64_t g, int64_t D, float *scores, int64_t stride, prefetcher *pf) {
    switch (D / 32) {
#define QK_Q8_CASE(DV) case DV: qk_q8_part(q16, qmul, kc, coff, ksc, n, g, scores, stride, pf, DV); break;
    QK_Q8_CASE(1) QK_Q8_CASE(2) QK_Q8_CASE(3) QK_Q8_CASE(4) QK_Q8_CASE(5) QK_Q8_CASE(6) QK_Q8_CASE(7) QK_Q8_CASE(8)
#undef QK_Q8_CASE
    }
}

/* each of g rows of scores (n values): e^(s - max) in place, unnormalized, 0 past n up to the
 * next multiple of 16; sums[r] = row r's sum of exponentials (P.V divides by it at the end) */
static inline void softmax_q8(float *scores, int64_t g, int64_t stride, int64_t n, float *sums) {
    const __mmask16 last = (__mmask16)(0xFFFFu >> ((16 - n % 16) % 16)); /* the valid lanes of the last tile */
    const int64_t full = (n - 1) / 16 * 16;                                 /* where the last tile starts */
    for (int64_t r = 0; r < g; r++) {
        float *s = scores + r * stride;
        __m512 m = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), last, s + full);
        __mmask16 nan = _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q);
        for (int64_t u = 0; u < full; u += 16) {
            const __m512 x = _mm512_loadu_ps(s + u);
            nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            m = _mm512_max_ps(m, x);
        }
        if (nan) { /* a NaN score (a NaN key or query): the row's outputs are NaN, as softmax's are */
            sums[r] = NAN;
            continue;
        }
        const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t u = 0; u < full; u += 16) {
            const __m512 e = (__m512)exp16_nonpositive((v16f)_mm512_sub_ps(_mm512_loadu_ps(s + u), vm));
            _mm512_storeu_ps(s + u, e);
            sum = _mm512_add_ps(sum, e);
        }
        const __m512 e = _mm512_maskz_mov_ps(last, (__m512)exp16_nonpositive((v16f)_mm512_sub_ps(_mm512_loadu_ps(s + full), vm)));
        _mm512_storeu_ps(s + full, e);
        sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(sum, e));
    }
}

/* NR query heads' P.V over n tokens for 16 * NC elements of D: V's codes at vc + coff[u], p
 * (rows of stride) already times the V scales, divided by sums[r] into o (bf16 rows of os) */
static inline __attribute__((always_inline)) void pv_q8_part(const char *vc, const int64_t *coff, int64_t n,
                                                             const float *p, int64_t stride, const float *sums,
                                                             bf16_t *o, int64_t os, prefetcher *pf, const int NR,
                                                             const int NC) {
    __m512 acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t u = 0; u < n; u++) {
        const int8_t *x = (const int8_t *)(vc + coff[u]);
        if ((u & 3) == 0) prefetch_some(pf);
        if (u + 8 < n) __builtin_prefetch(vc + coff[u + 8]);
        __m512 xv[4];
        for (int c = 0; c < NC; c++)
            xv[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(x + 16 * c))));
        for (int r = 0; r < NR; r++) {
            const __m512 w = _mm512_set1_ps(p[r * stride + u]);
            for (int c = 0; c < NC; c++) acc[r][c] = _mm512_fmadd_ps(w, xv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < NR; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / sums[r]);
        for (int c = 0; c < NC; c++)
            _mm256_storeu_si256((void *)(o + r * os + 16 * c), q8_to_bf16(_mm512_mul_ps(acc[r][c], inv)));
    }
}

#define PV_Q8_CASE(NR)                                                                            \
    if (nc == 4) pv_q8_part(vc + d0, coff, n, p, stride, s, o, D, pf, NR, 4);                     \
    else pv_q8_part(vc + d0, coff, n, p, stride, s, o, D, pf, NR, 2);

/* the g query heads' P.V of one KV head, into out (g bf16 rows of D, consecutive) */
static void pv_q8(const char *vc, const int64_t *coff, int64_t n, int64_t g, int64_t D, const float *scores,
                  int64_t stride, const float *sums, bf16_t *out, prefetcher *pf) {
    for (int64_t r0 = 0; r0 < g; r0 += 4) {
        const int64_t nr = g - r0 < 4 ? g - r0 : 4;
        const float *p = scores + r0 * stride, *s = sums + r0;
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int64_t nc = D - d0 < 64 ? 2 : 4; /* D % 32 == 0: 64 elements, or the last 32 */
            bf16_t *o = out + r0 * D + d0;
            if (nr == 4) { PV_Q8_CASE(4) } else if (nr == 3) { PV_Q8_CASE(3) } else if (nr == 2) { PV_Q8_CASE(2) } else { PV_Q8_CASE(1) }
        }
    }
}
#undef PV_Q8_CASE

/* A thread's scratch for decode items of up to `stride` tokens (a multiple of 16) and g query
 * heads a KV head: where each part starts in one allocation (float offsets; 64-byte aligned). */
typedef struct {
    float *scores;  /* g x stride: scores, then probabilities times V scales */
    float *sums;    /* g: the softmax's sums */
    float *qmul;    /* g: a query head's int16 scale times the attention scale */
    float *ksc;     /* stride: K scales of the item's tokens for one KV head (0 past the context) */
    float *vsc;     /* stride: V scales, the same */
    int64_t *coff;  /* stride: byte offset of each token's cache row (slot * row) */
    int16_t *q16;   /* g x D: the query heads of one KV head in int16 */
} q8_scratch;

static inline size_t q8_round16(size_t n) { return (n + 15) / 16 * 16; }

static float *q8_scratch_alloc(int64_t g, int64_t stride, int64_t D, q8_scratch *s) {
    const size_t fl = (size_t)(g * stride) + 2 * q8_round16((size_t)g) + 2 * (size_t)stride;
    const size_t bytes = sizeof(float) * fl + sizeof(int64_t) * (size_t)stride + q8_round16(sizeof(int16_t) * (size_t)(g * D));
    float *base = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!base) return NULL;
    s->scores = base;
    s->sums = s->scores + g * stride;
    s->qmul = s->sums + q8_round16((size_t)g);
    s->ksc = s->qmul + q8_round16((size_t)g);
    s->vsc = s->ksc + stride;
    s->coff = (int64_t *)(s->vsc + stride);
    s->q16 = (int16_t *)(s->coff + stride);
    return base;
}

/* the largest magnitude of a head's D values (a NaN or an infinity gives NaN; max_ps alone would
 * drop a NaN lane) */
static inline float q8_head_amax(const bf16_t *x, int64_t D) {
    __m512 mx = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t d = 0; d < D; d += 16) {
        const __m512 v = q8_widen(x + d, D - d < 16 ? (int)(D - d) : 16);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
    }
    const float amax = _mm512_reduce_max_ps(mx);
    return nan || !(amax <= FLT_MAX) ? NAN : amax;
}

/* query head x (D bf16) in int16: q16 = round(x * 32767 / amax); returns amax / 32767. A head with
 * a NaN or an infinity returns NaN (its outputs come out NaN, as the reference's do); one of zeros
 * and subnormals returns 0, codes 0. */
static inline float quantize_query_head(const bf16_t *x, int64_t D, int16_t *q16) {
    const float amax = q8_head_amax(x, D);
    if (!(amax >= FLT_MIN)) {
        memset(q16, 0, sizeof(int16_t) * (size_t)D);
        return amax != amax ? NAN : 0.f;
    }
    const __m512 inv = _mm512_set1_ps(32767.f / amax);
    for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256((void *)(q16 + d), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(q8_widen(x + d, 16), inv))));
    return amax / 32767.f;
}

/* one decode item: query heads of KV heads kh0 .. kh1 - 1 of row q over tokens 0 .. n - 1 of the
 * request whose block table is `table`; out: the item's (kh1 - kh0) * g heads of the output row */
static void decode_item_q8(const bf16_t *q, const char *k_rows, const char *v_rows, const int64_t *table,
                           int64_t block_size, int64_t Hk, int64_t kh0, int64_t kh1, int64_t n, int64_t g, int64_t D,
                           float scale, const q8_scratch *s, int64_t stride, bf16_t *out, prefetcher *pf) {
    if (n <= 0) { /* no context: zeros, as paged_decode_bf16 gives */
        memset(out, 0, sizeof(bf16_t) * (size_t)((kh1 - kh0) * g * D));
        return;
    }
    const int64_t row = Hk * (D + 4), npad = (n + 15) / 16 * 16;
    for (int64_t blk = 0, off = 0, u = 0; u < n; u++) { /* the rows, one division for the item */
        s->coff[u] = (table[blk] * block_size + off) * row;
        if (++off == block_size) off = 0, blk++;
    }
    for (int64_t kh = kh0; kh < kh1; kh++) {
        const int64_t h0 = (kh - kh0) * g, sc = Hk * D + 4 * kh; /* this head's scale in a row */
        for (int64_t u = 0; u < n; u++) {
            memcpy(s->ksc + u, k_rows + s->coff[u] + sc, sizeof(float));
            memcpy(s->vsc + u, v_rows + s->coff[u] + sc, sizeof(float));
        }
        for (int64_t u = n; u < npad; u++) s->ksc[u] = s->vsc[u] = 0.f;
        for (int64_t r = 0; r < g; r++) s->qmul[r] = quantize_query_head(q + (h0 + r) * D, D, s->q16 + r * D) * scale;
        qk_q8(s->q16, s->qmul, k_rows + kh * D, s->coff, s->ksc, n, g, D, s->scores, stride, pf);
        softmax_q8(s->scores, g, stride, n, s->sums);
        for (int64_t r = 0; r < g; r++)
            for (int64_t u = 0; u < npad; u += 16) {
                float *p = s->scores + r * stride + u;
                _mm512_storeu_ps(p, _mm512_mul_ps(_mm512_loadu_ps(p), _mm512_loadu_ps(s->vsc + u)));
            }
        pv_q8(v_rows + kh * D, s->coff, n, g, D, s->scores, stride, s->sums, out + h0 * D, pf);
    }
}

int paged_decode_q8(const bf16_t *query, int64_t q_stride, const int64_t *rows_q, const int64_t *rows_req,
                    const char *k_rows, const char *v_rows, const int64_t *tables, int64_t bt_stride,
                    const int64_t *ctx_lens, bf16_t *out, int64_t out_stride, int64_t B, int64_t H, int64_t Hk,
                    int64_t D, int64_t block_size, int nthreads, float scale) {
    if (Hk < 1 || H % Hk || D < 32 || D % 32 || D > 32 * Q8_MAX_DV) return 2;
    /* read here, not passed, so a replayed step (same arguments, new lengths) sizes its scratch */
    int64_t max_ctx = 1;
    for (int64_t b = 0; b < B; b++) max_ctx = ctx_lens[b] > max_ctx ? ctx_lens[b] : max_ctx;
    const int64_t stride = (max_ctx + 15) / 16 * 16, g = H / Hk, row = Hk * (D + 4);
    /* work items: a request and a range of its KV heads; the heads are split only where there
     * are too few requests to keep every thread busy */
    int64_t parts = (2 * (int64_t)nthreads + B - 1) / (B > 0 ? B : 1);
    if (parts > Hk) parts = Hk;
    if (parts < 1) parts = 1;
    const int64_t hpi = (Hk + parts - 1) / parts, per_req = (Hk + hpi - 1) / hpi, items = B * per_req;
    int64_t *cost = decode_costs(ctx_lens, NULL, items, per_req, 0, hpi, Hk);
    if (!cost) return 1;
    int failed = 0;
    _Pragma("omp parallel num_threads(nthreads)")
    {
        q8_scratch s;
        float *base = q8_scratch_alloc(g, stride, D, &s);
        if (!base) {
            _Pragma("omp atomic write") failed = 1;
        } else {
            const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
            int64_t lo, hi;
            thread_share(cost, items, nt, tid, &lo, &hi);
            for (int64_t it = lo; it < hi; it++) {
                const int64_t b = it / per_req, kh0 = (it % per_req) * hpi;
                const int64_t kh1 = kh0 + hpi < Hk ? kh0 + hpi : Hk, ctx = ctx_lens[b];
                /* the next item's K and V rows (from its first code to the row's end, scales
                 * included), spread over this item's calls: Q.K per tile and head, P.V per 4 tokens */
                prefetcher pf = {.which = 2};
                if (it + 1 < hi) {
                    const int64_t b2 = (it + 1) / per_req, off = ((it + 1) % per_req) * hpi * D;
                    const int64_t lines = 2 * ctx_lens[b2] * ((row - off + 63) / 64);
                    const int64_t calls = (kh1 - kh0) * (((ctx + 15) / 16) * g
                                                         + ((g + 3) / 4) * ((D + 63) / 64) * ((ctx + 3) / 4));
                    pf = (prefetcher){.k_cache = k_rows, .v_cache = v_rows, .table = tables + rows_req[b2] * bt_stride,
                                      .ctx = ctx_lens[b2], .block_size = block_size, .row_bytes = row, .off = off,
                                      .span = row - off, .t = 0, .per_step = lines / (calls > 0 ? calls : 1) + 1,
                                      .which = 0, .t0 = 0};
                }
                decode_item_q8(query + rows_q[b] * q_stride + kh0 * g * D, k_rows, v_rows,
                               tables + rows_req[b] * bt_stride, block_size, Hk, kh0, kh1, ctx, g, D, scale, &s,
                               stride, out + rows_q[b] * out_stride + kh0 * g * D, &pf);
            }
        }
        free(base);
    }
    free(cost);
    return failed;
}

/* one head x (D bf16) into codes and *scale, as kv_int8.quantize_rows computes them, bit for bit:
 * amax in fp32; inv = (1 / amax) * 127, two fp32 roundings, 0 where amax is 0 (torch computes
 * `127.0 / amax` as `amax.reciprocal() * 127`; one division, 127 / amax, differs in the last bit
 * now and then, and a product at a code's .5 boundary then rounds the other way); code = x * inv
 * rounded to nearest, ties to even (vcvtps2dq under the default rounding mode, as torch.round),
 * clamped to [-127, 127]; scale = amax / 127 (a division, as torch's tensor / scalar). A head
 * with a NaN or an infinity gets scale NaN (it reads back as NaN), one of zeros and subnormals
 * scale 0; both codes 0. */
static inline void quantize_kv_head(const bf16_t *x, int64_t D, int8_t *codes, float *scale) {
    const float amax = q8_head_amax(x, D);
    if (!(amax >= FLT_MIN)) {
        memset(codes, 0, (size_t)D);
        *scale = amax != amax ? NAN : 0.f;
        return;
    }
    float recip = 1.f / amax;
    __asm__("" : "+v"(recip)); /* kept apart: -fassociative-math would fold (1 / amax) * 127 into 127 / amax */
    const __m512 inv = _mm512_set1_ps(recip * 127.f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (int64_t d = 0; d < D; d += 16) {
        const int n = D - d < 16 ? (int)(D - d) : 16;
        __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(q8_widen(x + d, n), inv));
        c = _mm512_min_epi32(_mm512_max_epi32(c, lo), hi);
        _mm_mask_storeu_epi8((void *)(codes + d), (__mmask16)(0xFFFFu >> (16 - n)), _mm512_cvtepi32_epi8(c));
    }
    *scale = amax / 127.f;
}

/* The step's new keys and values into the cache, quantized: row i of key (row stride ks) and of
 * value (vs), Hk * D bf16 each, into row slots[i] of k_rows and v_rows ((num_slots, Hk * (D + 4))
 * bytes, contiguous). 0, or 1: a slot outside 0 .. num_slots - 1 (then nothing is written, as
 * kv_write_bf16 and index_copy_). Any D >= 1. */
int kv_write_q8(const bf16_t *key, int64_t ks, const bf16_t *value, int64_t vs, const int64_t *slots, int64_t n,
                int64_t Hk, int64_t D, char *k_rows, char *v_rows, int64_t num_slots) {
    if (Hk < 1 || D < 1) return 2;
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return 1;
    const int64_t row = Hk * (D + 4);
    for (int64_t i = 0; i < n; i++) {
        char *kr = k_rows + slots[i] * row, *vr = v_rows + slots[i] * row;
        for (int64_t h = 0; h < Hk; h++) {
            float kscale, vscale; /* through memcpy: a row's scales are not 4-byte aligned in general */
            quantize_kv_head(key + i * ks + h * D, D, (int8_t *)(kr + h * D), &kscale);
            quantize_kv_head(value + i * vs + h * D, D, (int8_t *)(vr + h * D), &vscale);
            memcpy(kr + Hk * D + 4 * h, &kscale, sizeof kscale);
            memcpy(vr + Hk * D + 4 * h, &vscale, sizeof vscale);
        }
    }
    return 0;
}

#else /* no AVX512-VNNI here: the caller keeps kv_int8.py's torch path */

int paged_decode_q8(const bf16_t *query, int64_t q_stride, const int64_t *rows_q, const int64_t *rows_req,
                    const char *k_rows, const char *v_rows, const int64_t *tables, int64_t bt_stride,
                    const int64_t *ctx_lens, bf16_t *out, int64_t out_stride, int64_t B, int64_t H, int64_t Hk,
                    int64_t D, int64_t block_size, int nthreads, float scale) {
    (void)query, (void)q_stride, (void)rows_q, (void)rows_req, (void)k_rows, (void)v_rows, (void)tables;
    (void)bt_stride, (void)ctx_lens, (void)out, (void)out_stride, (void)B, (void)H, (void)Hk, (void)D;
    (void)block_size, (void)nthreads, (void)scale;
    return Q8_NOT_COMPILED;
}

int kv_write_q8(const bf16_t *key, int64_t ks, const bf16_t *value, int64_t vs, const int64_t *slots, int64_t n,
                int64_t Hk, int64_t D, char *k_rows, char *v_rows, int64_t num_slots) {
    (void)key, (void)ks, (void)value, (void)vs, (void)slots, (void)n, (void)Hk, (void)D, (void)k_rows;
    (void)v_rows, (void)num_slots;
    return Q8_NOT_COMPILED;
}
#endif

/* 1 where the functions above are compiled for this CPU, else 0 (they return Q8_NOT_COMPILED) */
int kv_q8_compiled(void) {
#ifdef LOOM_Q8
    return 1;
#else
    return 0;
#endif
}

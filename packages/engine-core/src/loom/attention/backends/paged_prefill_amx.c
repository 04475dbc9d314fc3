/* Prefill attention in bf16 on AMX tiles, appended to paged_decode.c when it is built.
 *
 * The step's prefill chunks (a chunk: `tokens` consecutive query rows of one request, the last
 * `tokens` positions of its `context`, a cached prefix before them or not) attend causally to
 * their request's K/V, read from the paged cache through the block table (the chunk's own K/V
 * is written there before the call), all chunks of a step in one call:
 *   chunks (n x 4, int64): first query row in `query`/`out`, tokens, context, block-table row.
 * Layouts as in paged_decode.c: query/out (rows, H * D) with row strides qs/os, caches (slots,
 * Hk, D) contiguous, tables (rows, ts).
 *
 * Work items are (chunk, KV head, a part of its query rows), shared among the threads by cost
 * (thread_share). A call cuts its chunks into parts of one size, at least PF_PART_MIN rows, chosen
 * so that the step gives each thread about PF_ITEMS_PER_THREAD items (each item lays its keys out
 * anew, so finer parts would cost more than they balance). An item lays out the K/V of the keys its rows see once, for all its
 * rows and the g query heads of the KV head:
 *   - K as AMX's second operand of S = Q . K^T (pairs along D, VNNI): per 16 keys and 32 elements
 *     of D a 16 x 16 transpose of 32-bit pairs (1 KB);
 *   - V as the second operand of O = P . V: per 32 keys and 16 elements of D, the pairs of two
 *     consecutive keys interleaved (1 KB); keys past the item's last one are zeros.
 * Then per 16 query rows and query head, the keys the last row sees in passes of up to PF_PASS:
 * the rows' scores against the pass's key blocks (`tdpbf16ps`, two key blocks at a time), stored
 * as fp32 rows; per row its max and 2^((s - max) scale log2 e) over its own positions (a degree-4
 * polynomial and `vscalefps`: the decode kernels' exp took a quarter more time here for precision
 * that the bf16 probabilities drop), rounded to bf16 (the keys past a row's position zero); P . V
 * on tiles, 64 elements of D at a time, added to the row's sums from earlier passes rescaled to
 * the new max (online softmax, as flash attention does); at the end the sums divided by the
 * softmax's. A block of 16 rows computes the scores of every key its last row sees (16 keys a
 * tile) and P . V over them rounded up to 32, so its first row spends up to 46 keys past its own
 * position (masked to zero probability; torch's flash kernel computes whole key blocks too).
 *
 * Measured 2026-12-06 on 2 cores of a Xeon with AMX, the default model's heads (9 / 3 of 64),
 * ms a layer, this kernel alone (ctypes, no K/V write) against torch 2.13's flash kernel (on AMX
 * too) as the backend called it; bench/prefill_attention.py times both through the backend: 16
 * prompts of 128 tokens 0.43 vs 1.33; 8 prompts of 36-510 (2,461 tokens, one flash call per
 * length) 1.29 vs 4.70; one of 1,000 1.21-1.25 vs 2.56; 512 after 1,536 cached 1.97-2.02 vs 4.30
 * (flash on K/V gathered and masked); one of 4,096 17.9-18.2 vs 26; one of 8,192 73-74 vs 98;
 * 2,048 after 6,144 cached 36 vs 72; one of 12,288 203 vs 220, one of 16,384 406 vs 385 (the
 * crossover lies between those two; the backend keeps torch's kernel past 8,192 tokens of context,
 * the longest measured more than twice). Before the passes (one softmax over
 * all of a row's keys, items of at most 128 rows): 0.40 for 16 x 128, 17.4-18.0 for 4,096 and
 * 96-101 for 8,192, where a row's scores and the laid-out K/V of many small items outgrew L2.
 *
 * Built where the compiler targets AMX-TILE, AMX-BF16 and AVX512-BF16 (-march=native on such a
 * CPU); elsewhere paged_prefill_amx_ready() is 0 and the backend keeps its other prefill paths,
 * as it does for head sizes other than multiples of 32 up to 128 (the call answers 2 for those).
 * Linux hands the tile registers to a process that asks (arch_prctl), asked once at the first
 * paged_prefill_amx_ready() call.
 */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(LOOM_DPBF16)
#include <sys/syscall.h>
#include <unistd.h>
#define LOOM_AMX 1
#define PF_PART_MIN 128 /* query rows an item at least, unless its chunk is shorter */
#define PF_ITEMS_PER_THREAD 8

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_tilecfg;

static void amx_tiles_16x64(void) { /* all eight tiles 16 rows of 64 bytes */
    amx_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

/* r[0..15] (16 rows of 16 32-bit lanes) transposed in place */
static inline void transpose16x16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int q = 0; q < 4; q++) {
        const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * q + 2]), d = _mm512_castps_pd(t[4 * q + 3]);
        r[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
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

/* key u's row of KV head kh in `cache` */
#define PF_ROW(cache, u) ((cache) + ((table[(u) / block_size] * block_size + (u) % block_size) * Hk + kh) * D)

/* K of keys [0, nkeys) laid out in kp, kpad / 16 blocks (zeros past nkeys) */
static void pf_pack_k(uint32_t *kp, const bf16_t *k_cache, const int64_t *table, int64_t block_size, int64_t Hk,
                      int64_t kh, int64_t D, int64_t nkeys, int64_t kpad) {
    const int64_t dc = D / 32;
    for (int64_t kb = 0; kb < kpad / 16; kb++) {
        const bf16_t *rows[16];
        for (int n = 0; n < 16; n++) rows[n] = kb * 16 + n < nkeys ? PF_ROW(k_cache, kb * 16 + n) : NULL;
        for (int64_t c = 0; c < dc; c++) {
            __m512 r[16];
            for (int n = 0; n < 16; n++)
                r[n] = rows[n] ? _mm512_loadu_ps((const float *)(rows[n] + 32 * c)) : _mm512_setzero_ps();
            transpose16x16(r);
            float *dst = (float *)(kp + (kb * dc + c) * 256);
            for (int kk = 0; kk < 16; kk++) _mm512_store_ps(dst + 16 * kk, r[kk]);
        }
    }
}

/* V of keys [0, nkeys) laid out in vp, kpad / 32 blocks of D / 16 tiles (zeros past nkeys) */
static void pf_pack_v(uint32_t *vp, const bf16_t *v_cache, const int64_t *table, int64_t block_size, int64_t Hk,
                      int64_t kh, int64_t D, int64_t nkeys, int64_t kpad) {
    const int64_t dt = D / 16;
    __m512i lo_idx, hi_idx;
    {
        int16_t lo[32], hi[32];
        for (int w = 0; w < 32; w++) lo[w] = (int16_t)((w & 1) * 32 + (w >> 1)), hi[w] = (int16_t)(lo[w] + 16);
        lo_idx = _mm512_loadu_si512(lo), hi_idx = _mm512_loadu_si512(hi);
    }
    for (int64_t kc = 0; kc < kpad / 32; kc++)
        for (int k = 0; k < 16; k++) {
            const int64_t a = kc * 32 + 2 * k, b = a + 1;
            const bf16_t *ra = a < nkeys ? PF_ROW(v_cache, a) : NULL, *rb = b < nkeys ? PF_ROW(v_cache, b) : NULL;
            for (int64_t c = 0; c < D / 32; c++) {
                const __m512i va = ra ? _mm512_loadu_si512(ra + 32 * c) : _mm512_setzero_si512();
                const __m512i vb = rb ? _mm512_loadu_si512(rb + 32 * c) : _mm512_setzero_si512();
                uint32_t *dst = vp + (kc * dt + 2 * c) * 256 + 16 * k;
                _mm512_store_si512(dst, _mm512_permutex2var_epi16(va, lo_idx, vb));
                _mm512_store_si512(dst + 256, _mm512_permutex2var_epi16(va, hi_idx, vb));
            }
        }
}

/* S (16 rows, row stride kpad floats) = Q . K^T for key blocks [0, nkb); Q's D / 32 tiles in 2.. */
static inline void pf_scores(const uint32_t *kp, int64_t dc, int64_t nkb, float *s, int64_t kpad) {
    int64_t kb = 0;
    for (; kb + 1 < nkb; kb += 2) {
        const uint32_t *k0 = kp + kb * dc * 256, *k1 = k0 + dc * 256;
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(6, k0, 64); _tile_dpbf16ps(0, 2, 6);
        _tile_loadd(7, k1, 64); _tile_dpbf16ps(1, 2, 7);
        if (dc > 1) { _tile_loadd(6, k0 + 256, 64); _tile_dpbf16ps(0, 3, 6);
                      _tile_loadd(7, k1 + 256, 64); _tile_dpbf16ps(1, 3, 7); }
        if (dc > 2) { _tile_loadd(6, k0 + 512, 64); _tile_dpbf16ps(0, 4, 6);
                      _tile_loadd(7, k1 + 512, 64); _tile_dpbf16ps(1, 4, 7); }
        if (dc > 3) { _tile_loadd(6, k0 + 768, 64); _tile_dpbf16ps(0, 5, 6);
                      _tile_loadd(7, k1 + 768, 64); _tile_dpbf16ps(1, 5, 7); }
        _tile_stored(0, s + kb * 16, kpad * 4);
        _tile_stored(1, s + kb * 16 + 16, kpad * 4);
    }
    if (kb < nkb) {
        const uint32_t *k0 = kp + kb * dc * 256;
        _tile_zero(0);
        _tile_loadd(6, k0, 64); _tile_dpbf16ps(0, 2, 6);
        if (dc > 1) { _tile_loadd(6, k0 + 256, 64); _tile_dpbf16ps(0, 3, 6); }
        if (dc > 2) { _tile_loadd(6, k0 + 512, 64); _tile_dpbf16ps(0, 4, 6); }
        if (dc > 3) { _tile_loadd(6, k0 + 768, 64); _tile_dpbf16ps(0, 5, 6); }
        _tile_stored(0, s + kb * 16, kpad * 4);
    }
}

/* 2^t in 16 lanes for t <= 0: 2^round(t) applied by vscalefps (far below zero: 0) to a degree-4
 * polynomial of the rest, relative error under 1e-5 (P is rounded to bf16, 2^-9, right after) */
static inline __m512 pf_exp2(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.009254957f), f, _mm512_set1_ps(0.05585605f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24031252f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69313061f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999779f));
    return _mm512_scalef_ps(p, n);
}

/* One pass of a row's softmax over the scores s of `valid` keys (up to `width`, P zero past
 * valid): the running max *mr (in units of s c, c = scale log2 e) and sum *lr updated, P =
 * 2^(s c - max) in bf16; returns the factor the row's earlier P . V sums take (0 on a first pass,
 * 1 where this pass has no key of the row) */
static inline float pf_softmax_part(const float *s, bf16_t *p, int64_t valid, int64_t width, float c, float *mr,
                                    float *lr) {
    int64_t j = 0;
    if (valid <= 0) {
        for (; j < width; j += 16) _mm256_storeu_si256((__m256i *)(p + j), _mm256_setzero_si256());
        return 1.0f;
    }
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (j = 0; j < valid; j += 16) {
        const __mmask16 m = valid - j >= 16 ? 0xFFFF : (__mmask16)((1u << (valid - j)) - 1);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, s + j));
    }
    const float row_top = _mm512_reduce_max_ps(mx) * c, top = row_top > *mr ? row_top : *mr;
    const float alpha = *mr == -INFINITY ? 0.0f : top == *mr ? 1.0f : exp2f(*mr - top);
    const __m512 vc = _mm512_set1_ps(c), vtop = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j < valid; j += 16) {
        const __mmask16 m = valid - j >= 16 ? 0xFFFF : (__mmask16)((1u << (valid - j)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(m, pf_exp2(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), vc, vtop)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(p + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    for (; j < width; j += 16) _mm256_storeu_si256((__m256i *)(p + j), _mm256_setzero_si256());
    *lr = *lr * alpha + _mm512_reduce_add_ps(sum);
    *mr = top;
    return alpha;
}

#define PF_PASS 1024 /* keys a softmax pass at most: 16 rows' scores (64 KB) and P (32 KB) stay in L2 */

/* one item: rows [r0, r1) of the chunk, KV head kh; scratch as sized by paged_prefill_amx_bf16:
 * s and p rows `sw` apart, o 16 x 64 floats, acc 16 x D floats */
static void pf_item(const bf16_t *query, int64_t qs, const int64_t *chunk, const bf16_t *k_cache,
                    const bf16_t *v_cache, const int64_t *table, bf16_t *out, int64_t os, int64_t kh, int64_t r0,
                    int64_t r1, int64_t g, int64_t Hk, int64_t D, int64_t block_size, float scale, uint32_t *kp,
                    uint32_t *vp, float *s, bf16_t *p, int64_t sw, bf16_t *qpad, float *o, float *acc) {
    const int64_t first = chunk[0], prefix = chunk[2] - chunk[1];
    const int64_t nkeys = prefix + r1, kpad = (nkeys + 31) / 32 * 32, dc = D / 32, dt = D / 16;
    const float c = scale * 1.44269504088896341f;
    pf_pack_k(kp, k_cache, table, block_size, Hk, kh, D, nkeys, kpad);
    pf_pack_v(vp, v_cache, table, block_size, Hk, kh, D, nkeys, kpad);
    float mr[16], lr[16], alpha[16];
    for (int64_t rb = r0; rb < r1; rb += 16) {
        const int64_t m = r1 - rb < 16 ? r1 - rb : 16, seen = prefix + rb + m; /* keys the last row sees */
        for (int64_t h = kh * g; h < (kh + 1) * g; h++) {
            const bf16_t *q = query + (first + rb) * qs + h * D;
            int64_t qstride = qs * 2;
            if (m < 16) { /* a partial block: its rows from a zero-padded copy */
                memset(qpad, 0, 16 * D * sizeof(bf16_t));
                for (int64_t i = 0; i < m; i++) memcpy(qpad + i * D, q + i * qs, D * sizeof(bf16_t));
                q = qpad, qstride = D * 2;
            }
            for (int i = 0; i < 16; i++) mr[i] = -INFINITY, lr[i] = 0.0f;
            for (int64_t k0 = 0; k0 < seen; k0 += PF_PASS) { /* the keys in passes, softmax online */
                const int64_t k1 = seen - k0 < PF_PASS ? seen : k0 + PF_PASS;
                const int64_t nkb = (k1 - k0 + 15) / 16, width = (k1 - k0 + 31) / 32 * 32;
                _tile_loadd(2, q, qstride); /* (P . V below takes tiles 2 and 3) */
                if (dc > 1) _tile_loadd(3, q + 32, qstride);
                if (dc > 2) _tile_loadd(4, q + 64, qstride);
                if (dc > 3) _tile_loadd(5, q + 96, qstride);
                pf_scores(kp + k0 / 16 * dc * 256, dc, nkb, s, sw);
                for (int64_t i = 0; i < 16; i++) {
                    const int64_t end = prefix + rb + i + 1 < k1 ? prefix + rb + i + 1 : k1;
                    alpha[i] = pf_softmax_part(s + i * sw, p + i * sw, i < m ? end - k0 : 0, width, c, &mr[i], &lr[i]);
                }
                for (int64_t j0 = 0; j0 < dt; j0 += 4) {
                    const int64_t nj = dt - j0 < 4 ? dt - j0 : 4;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t kc = 0; kc < width / 32; kc++) {
                        const uint32_t *v = vp + ((k0 / 32 + kc) * dt + j0) * 256;
                        _tile_loadd(4, p + kc * 32, sw * 2);
                        _tile_loadd(5, v, 64); _tile_dpbf16ps(0, 4, 5);
                        if (nj > 1) { _tile_loadd(6, v + 256, 64); _tile_dpbf16ps(1, 4, 6); }
                        if (nj > 2) { _tile_loadd(7, v + 512, 64); _tile_dpbf16ps(2, 4, 7); }
                        if (nj > 3) { _tile_loadd(5, v + 768, 64); _tile_dpbf16ps(3, 4, 5); }
                    }
                    _tile_stored(0, o, 256);
                    if (nj > 1) _tile_stored(1, o + 16, 256);
                    if (nj > 2) _tile_stored(2, o + 32, 256);
                    if (nj > 3) _tile_stored(3, o + 48, 256);
                    if (k1 == seen && k0 == 0) { /* one pass: the rows' results */
                        for (int64_t i = 0; i < m; i++) {
                            const __m512 inv = _mm512_set1_ps(1.0f / lr[i]);
                            bf16_t *dst = out + (first + rb + i) * os + h * D + j0 * 16;
                            for (int64_t j = 0; j < nj; j++)
                                _mm256_storeu_si256((__m256i *)(dst + 16 * j), (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_mul_ps(_mm512_load_ps(o + i * 64 + 16 * j), inv)));
                        }
                        continue;
                    }
                    for (int64_t i = 0; i < m; i++) /* the row's sums: this pass's, plus the earlier ones rescaled */
                        for (int64_t j = 0; j < nj; j++) {
                            float *a = acc + i * D + (j0 + j) * 16;
                            const __m512 part = _mm512_load_ps(o + i * 64 + 16 * j);
                            _mm512_store_ps(a, k0 ? _mm512_fmadd_ps(_mm512_load_ps(a), _mm512_set1_ps(alpha[i]), part)
                                                  : part);
                        }
                }
            }
            if (seen <= PF_PASS) continue; /* written above */
            for (int64_t i = 0; i < m; i++) {
                const __m512 inv = _mm512_set1_ps(1.0f / lr[i]);
                bf16_t *dst = out + (first + rb + i) * os + h * D;
                for (int64_t j = 0; j < dt; j++)
                    _mm256_storeu_si256((__m256i *)(dst + 16 * j),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + i * D + 16 * j), inv)));
            }
        }
    }
}
#undef PF_ROW

static int amx_permitted = -1; /* -1: not asked yet */
#endif

/* 1 where paged_prefill_amx_bf16 runs (built for AMX, and Linux lets this process use the tiles) */
int paged_prefill_amx_ready(void) {
#ifdef LOOM_AMX
    if (amx_permitted < 0) amx_permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return amx_permitted;
#else
    return 0;
#endif
}

/* 0 done, 1 out of memory, 2 a shape it does not take (D not a multiple of 32 up to 128, H not a
 * multiple of Hk), 3 not built for AMX here or the tiles refused (paged_prefill_amx_ready) */
int paged_prefill_amx_bf16(const bf16_t *query, int64_t qs, const int64_t *chunks, int64_t n,
                           const bf16_t *k_cache, const bf16_t *v_cache, const int64_t *tables, int64_t ts,
                           bf16_t *out, int64_t os, int64_t H, int64_t Hk, int64_t D, int64_t block_size,
                           int nthreads, float scale) {
#ifdef LOOM_AMX
    if (!paged_prefill_amx_ready()) return 3;
    if (Hk <= 0 || H % Hk || D % 32 || D > 128 || D <= 0) return 2;
    if (nthreads < 1) nthreads = 1;
    const int64_t g = H / Hk;
    int64_t *item, *cost; /* a row's keys cost about a sixteenth of laying one out: 16 rows share a tile */
    const int64_t items = prefill_items(chunks, n, Hk, g, nthreads, PF_ITEMS_PER_THREAD, PF_PART_MIN, 16, 16,
                                        &item, &cost);
    if (items <= 0) return items < 0;
    int failed = 0;
    _Pragma("omp parallel num_threads(nthreads)")
    {
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        int64_t lo, hi;
        thread_share(cost, items, nt, tid, &lo, &hi);
        const int64_t kmax = prefill_items_keys(chunks, item, lo, hi, 32, 32);
        const int64_t sw = (kmax < PF_PASS ? kmax : PF_PASS) + 16; /* a pass's keys, rows not 4 KB apart */
        /* K and V laid out, scores, probabilities, a padded query block, a block of results, the sums */
        const size_t kv_bytes = (size_t)kmax * D * sizeof(bf16_t);
        const size_t bytes = 2 * kv_bytes + 16 * sw * (sizeof(float) + sizeof(bf16_t)) + 16 * D * sizeof(bf16_t)
                             + 16 * 64 * sizeof(float) + 16 * D * sizeof(float);
        char *mem = lo < hi ? aligned_alloc(64, (bytes + 63) / 64 * 64) : NULL;
        if (lo < hi && !mem) {
            _Pragma("omp atomic write") failed = 1;
        } else if (lo < hi) {
            uint32_t *kp = (uint32_t *)mem, *vp = (uint32_t *)(mem + kv_bytes);
            float *s = (float *)(mem + 2 * kv_bytes);
            bf16_t *p = (bf16_t *)(s + 16 * sw);
            bf16_t *qpad = p + 16 * sw;
            float *o = (float *)(qpad + 16 * D), *acc = o + 16 * 64;
            amx_tiles_16x64();
            for (int64_t i = lo; i < hi; i++) {
                const int64_t *ch = chunks + 4 * item[4 * i];
                pf_item(query, qs, ch, k_cache, v_cache, tables + ch[3] * ts, out, os, item[4 * i + 1],
                        item[4 * i + 2], item[4 * i + 3], g, Hk, D, block_size, scale, kp, vp, s, p, sw, qpad, o,
                        acc);
            }
            _tile_release();
        }
        free(mem);
    }
    free(item);
    free(cost);
    return failed;
#else
    (void)query, (void)qs, (void)chunks, (void)n, (void)k_cache, (void)v_cache, (void)tables, (void)ts, (void)out;
    (void)os, (void)H, (void)Hk, (void)D, (void)block_size, (void)nthreads, (void)scale;
    return 3;
#endif
}

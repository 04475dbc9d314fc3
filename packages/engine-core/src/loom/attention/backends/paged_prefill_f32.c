/* Prefill attention in fp32 with 8-lane FMA tiles, appended to paged_decode.c when it is built.
 *
 * The same call as paged_prefill_amx.c: a step's prefill chunks (a chunk: `tokens` consecutive
 * query rows of one request, the last `tokens` positions of its `context`, a cached prefix
 * before them or not) attend causally to their request's K/V, read from the paged cache through
 * the block table (the chunk's own K/V is written there before the call), all chunks of a step
 * in one call:
 *   chunks (n x 4, int64): first query row in `query`/`out`, tokens, context, block-table row.
 * Layouts as in paged_decode.c: query/out (rows, H * D) with row strides qs/os, caches (slots,
 * Hk, D) contiguous, tables (rows, ts); here D % 16 == 0.
 *
 * Work items are (chunk, KV head, a part of its query rows), shared among the threads by cost
 * (thread_share), cut by prefill_items as the AMX kernel's are. An item lays out the K/V of the keys its last
 * row sees once, for its rows and the g query heads of the KV head: K as panels of 16 keys
 * (D x 16, keys past the last zero), the second operand of S = Q . K^T; V as contiguous rows.
 * Then per query head and block of P32_MR consecutive rows (the tile shape of cpu_gemm.c, written
 * again here because that one lives in the other kernel library: 6 rows x 16 columns in 12
 * accumulators, a K panel's row and a broadcast query element per step):
 *   - the rows' scores against every key panel the block's last row sees (causal: later panels
 *     are skipped, so a block computes at most 15 + 5 keys past a row's own position);
 *   - per row, the softmax's exponentials over its own positions (the decode kernel's
 *     softmax_rows, so both kernels round alike), zeros past them;
 *   - P . V over each row's own keys, 16 elements of D at a time, divided by the row's sum.
 * A row's whole context is in one pass (no online softmax), so the scores of a block are 6 rows
 * of the context; the backend sends chunks up to F32_PREFILL_MAX_CTX here (torch_sdpa.py).
 *
 * The code is portable C (GCC vector extensions, as paged_decode.c); paged_prefill_f32_ready()
 * says where the backend should use it: x86 with AVX2 and FMA and no AVX-512, where it was
 * measured against torch's flash kernel (docs/performance.md). Elsewhere the call still works
 * (the tests run it on every CPU).
 */

#define P32_MR 6           /* query rows a tile */
#define P32_PART_MIN 64    /* query rows an item at least, unless its chunk is shorter */
#define P32_ITEMS_PER_THREAD 8

int paged_prefill_f32_ready(void) {
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* keys [0, nk) of KV head kh: K as (ceil(nk / 16), D, 16) panels (zeros past nk), V as (nk, D) */
static void p32_layout(float *kp, float *vp, const float *k_cache, const float *v_cache, const int64_t *table,
                       int64_t block_size, int64_t Hk, int64_t kh, int64_t D, int64_t nk) {
    const int64_t nkb = (nk + 15) / 16;
    for (int64_t kb = 0; kb < nkb; kb++) {
        float *panel = kp + kb * D * 16;
        for (int64_t n = 0; n < 16; n++) {
            const int64_t u = kb * 16 + n;
            if (u >= nk) {
                for (int64_t d = 0; d < D; d++) panel[d * 16 + n] = 0.f;
                continue;
            }
            const int64_t at = ((table[u / block_size] * block_size + u % block_size) * Hk + kh) * D;
            const float *kr = k_cache + at;
            for (int64_t d = 0; d < D; d++) panel[d * 16 + n] = kr[d];
            memcpy(vp + u * D, v_cache + at, D * sizeof(float));
        }
    }
}

/* s[r * ss + 0 .. 15] = scale * (q[r] . the panel's 16 keys), r < P32_MR */
static inline void p32_scores(const float *const q[P32_MR], const float *panel, int64_t D, float scale, float *s,
                              int64_t ss) {
    v8f a0[P32_MR], a1[P32_MR];
    for (int r = 0; r < P32_MR; r++) a0[r] = a1[r] = (v8f){0};
    for (int64_t d = 0; d < D; d++) {
        const v8f k0 = load_f32(panel + 16 * d), k1 = load_f32(panel + 16 * d + 8);
        for (int r = 0; r < P32_MR; r++) {
            const float x = q[r][d];
            a0[r] += x * k0;
            a1[r] += x * k1;
        }
    }
    for (int r = 0; r < P32_MR; r++) {
        const v8f b0 = a0[r] * scale, b1 = a1[r] * scale;
        memcpy(s + r * ss, &b0, sizeof b0);
        memcpy(s + r * ss + 8, &b1, sizeof b1);
    }
}

/* o[r * D + j .. + 16] = sum over keys u < lo + r of p[r * ss + u] * V[u][j .. + 16], for every j:
 * row r of the block sees the keys before lo (the first row's count) and r more. A key past a
 * row's position is not multiplied in at all (its P is zero, but 0 * inf or NaN in V is NaN):
 * a non-finite V reaches only the rows whose context holds it, as in the decode kernel. */
static inline void p32_pv(const float *p, int64_t ss, const float *vp, int64_t D, int64_t lo, int64_t nk, float *o) {
    for (int64_t j = 0; j < D; j += 16) {
        v8f a0[P32_MR], a1[P32_MR];
        for (int r = 0; r < P32_MR; r++) a0[r] = a1[r] = (v8f){0};
        for (int64_t u = 0; u < lo; u++) {
            const v8f v0 = load_f32(vp + u * D + j), v1 = load_f32(vp + u * D + j + 8);
            for (int r = 0; r < P32_MR; r++) {
                const float x = p[r * ss + u];
                a0[r] += x * v0;
                a1[r] += x * v1;
            }
        }
        for (int64_t u = lo; u < nk; u++) { /* the block's last keys: rows from u - lo + 1 on */
            const v8f v0 = load_f32(vp + u * D + j), v1 = load_f32(vp + u * D + j + 8);
            for (int r = 0; r < P32_MR; r++)
                if (r > u - lo) {
                    const float x = p[r * ss + u];
                    a0[r] += x * v0;
                    a1[r] += x * v1;
                }
        }
        for (int r = 0; r < P32_MR; r++) {
            memcpy(o + r * D + j, &a0[r], sizeof a0[r]);
            memcpy(o + r * D + j + 8, &a1[r], sizeof a1[r]);
        }
    }
}

/* one item: chunk ch's rows [t0, t1) for the g query heads of KV head kh */
static void p32_item(const float *query, int64_t qs, const int64_t *ch, const float *k_cache, const float *v_cache,
                     const int64_t *table, float *out, int64_t os, int64_t kh, int64_t t0, int64_t t1, int64_t g,
                     int64_t Hk, int64_t D, int64_t block_size, float scale, float *kp, float *vp, float *s,
                     int64_t ss, float *o) {
    const int64_t first = ch[0], prefix = ch[2] - ch[1]; /* position of the chunk's token 0 */
    p32_layout(kp, vp, k_cache, v_cache, table, block_size, Hk, kh, D, prefix + t1);
    float ml[2 * P32_MR];
    for (int64_t h = kh * g; h < (kh + 1) * g; h++)
        for (int64_t t = t0; t < t1; t += P32_MR) {
            const int64_t nr = t1 - t < P32_MR ? t1 - t : P32_MR, nk = prefix + t + nr;
            const float *q[P32_MR];
            for (int r = 0; r < P32_MR; r++) q[r] = query + (first + t + (r < nr ? r : nr - 1)) * qs + h * D;
            for (int64_t kb = 0; kb * 16 < nk; kb++) p32_scores(q, kp + kb * D * 16, D, scale, s + kb * 16, ss);
            for (int64_t r = 0; r < P32_MR; r++) {
                float *sr = s + r * ss;
                const int64_t own = r < nr ? prefix + t + r + 1 : 0; /* keys row r sees */
                if (own) softmax_rows(sr, 1, ss, own, ml + 2 * r, 0);
                memset(sr + own, 0, (nk - own) * sizeof(float));
            }
            p32_pv(s, ss, vp, D, prefix + t + 1, nk, o);
            for (int64_t r = 0; r < nr; r++) {
                const float inv = 1.f / ml[2 * r + 1];
                float *dst = out + (first + t + r) * os + h * D;
                for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
            }
        }
}

int paged_prefill_f32(const float *query, int64_t qs, const int64_t *chunks, int64_t n, const float *k_cache,
                      const float *v_cache, const int64_t *tables, int64_t ts, float *out, int64_t os, int64_t H,
                      int64_t Hk, int64_t D, int64_t block_size, int nthreads, float scale) {
    if (Hk <= 0 || H % Hk || D % 16 || D > 256 || D <= 0) return 2;
    if (nthreads < 1) nthreads = 1;
    const int64_t g = H / Hk;
    int64_t *item, *cost;
    const int64_t items = prefill_items(chunks, n, Hk, g, nthreads, P32_ITEMS_PER_THREAD, P32_PART_MIN, P32_MR, 1,
                                        &item, &cost);
    if (items <= 0) return items < 0;
    int failed = 0;
    _Pragma("omp parallel num_threads(nthreads)")
    {
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        int64_t lo, hi;
        thread_share(cost, items, nt, tid, &lo, &hi);
        const int64_t kmax = prefill_items_keys(chunks, item, lo, hi, 16, 16);
        const int64_t ss = kmax + 16; /* score rows not a multiple of 4 KB apart */
        const size_t bytes = (2 * kmax * D + P32_MR * ss + P32_MR * D) * sizeof(float);
        float *mem = lo < hi ? aligned_alloc(64, (bytes + 63) / 64 * 64) : NULL;
        if (lo < hi && !mem) {
            _Pragma("omp atomic write") failed = 1;
        } else if (lo < hi) {
            float *kp = mem, *vp = kp + kmax * D, *s = vp + kmax * D, *o = s + P32_MR * ss;
            for (int64_t i = lo; i < hi; i++) {
                const int64_t *ch = chunks + 4 * item[4 * i];
                p32_item(query, qs, ch, k_cache, v_cache, tables + ch[3] * ts, out, os, item[4 * i + 1],
                         item[4 * i + 2], item[4 * i + 3], g, Hk, D, block_size, scale, kp, vp, s, ss, o);
            }
        }
        free(mem);
    }
    free(item);
    free(cost);
    return failed;
}

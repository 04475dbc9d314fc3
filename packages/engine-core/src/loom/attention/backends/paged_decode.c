/* Paged attention on the CPU for query rows that each attend to the first ctx tokens of their
 * request: decode requests (one query token each) and, in bf16 on CPUs with AVX512-BF16, the
 * tokens of prefill chunks (paged_decode_dpbf16.c, appended to this file).
 *
 * Reads K and V straight from the paged cache through each request's block table, so no
 * gathered copy of the context is made. Built by loom.attention.backends.native with the
 * machine's compiler (-O3 -march=native) the first time a worker needs it, and cached.
 * Vectors are GCC/clang vector extensions of 8 floats: the compiler maps them to the widest
 * SIMD the CPU has (AVX2 and AVX-512 on x86, NEON pairs on Arm), with no intrinsics.
 *
 * Layouts (element strides; every tensor is row-major):
 *   query    rows of a (T, q_stride) matrix; head h of row r at query + r*q_stride + h*D
 *   k_cache  (num_slots, Hk, D), contiguous; slot = block * block_size + offset
 *   v_cache  same as k_cache
 *   tables   (num_requests, bt_stride) int64 block numbers
 *   out      rows like query, with out_stride
 * Decode request b reads query row rows_q[b], request row rows_req[b] of the tables and
 * ctx_lens[b] tokens of context. The query heads of one KV head (GQA group of g = H / Hk)
 * share its loads: each K vector is loaded and widened to fp32 once for up to four of them
 * (QK_ROWS), each V vector once for the whole group; with g = 3 or 4 that is 1.3-1.6x faster
 * than one pass per query head (same arithmetic, same results). D % 8 == 0.
 *
 * Threads: OpenMP. Loaded after torch, so libgomp.so.1 resolves to the one torch loaded and
 * this kernel shares torch's thread pool (one pool, no second set of spinning threads).
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef _Float16 v8f16 __attribute__((vector_size(16)));
typedef uint16_t bf16_t;
typedef _Float16 f16_t;

static inline v8f load_f32(const float *p) { v8f x; memcpy(&x, p, sizeof x); return x; }
static inline v8f load_bf16(const bf16_t *p) {
    v8h h; memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f x; memcpy(&x, &u, sizeof x); return x;
}
static inline v8f load_f16(const f16_t *p) {
    v8f16 h; memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, v8f);
}

static inline bf16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((v.u >> 16) | 0x40); /* quiet NaN */
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest, ties to even */
    return (bf16_t)((v.u + rounding) >> 16);
}
static inline float store_f32(float x) { return x; }
static inline bf16_t store_bf16(float x) { return f32_to_bf16(x); }
static inline f16_t store_f16(float x) { return (f16_t)x; }

static inline float hsum(v8f x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* e^x for x <= 0 (softmax arguments), Cephes' expf polynomial: x = n ln2 + r, |r| <= ln2/2,
 * e^x = 2^n e^r; below -87 the result is 0 (2^n would leave the normal range). One definition
 * for the 8 lanes here and the 16 of paged_decode_dpbf16.c (appended to this file), so both
 * kernels compute the same softmax. */
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define DEFINE_EXP_NONPOSITIVE(NAME, VF, VI)                                                        \
    static inline VF NAME(VF x) {                                                                 \
        const VI keep = x >= -87.0f;                                                              \
        x = (VF)((VI)x & keep);                   /* -87 and below: compute e^0, mask below */    \
        const VI n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, VI); /* round, x <= 0 */ \
        const VF nf = __builtin_convertvector(n, VF);                                             \
        const VF r = x - nf * 0.693359375f + nf * 2.12194440e-4f;                                 \
        VF p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                           \
        p = p * r + 8.3334519073e-3f;                                                             \
        p = p * r + 4.1665795894e-2f;                                                             \
        p = p * r + 1.6666665459e-1f;                                                             \
        p = p * r + 5.0000001201e-1f;                                                             \
        p = p * r * r + r + 1.0f;                                                                 \
        const VI scaled = (VI)p + (n << 23);      /* times 2^n through the exponent bits */       \
        return (VF)(scaled & keep);                                                               \
    }
DEFINE_EXP_NONPOSITIVE(exp_nonpositive, v8f, v8i)
DEFINE_EXP_NONPOSITIVE(exp16_nonpositive, v16f, v16i)

#if defined(__AVX512F__)
#include <immintrin.h>
/* s[j] = the sum of the 16 lanes of a[j], j = 0 .. 15: for the AVX-512 kernels appended after this
 * file (paged_decode_dpbf16.c, paged_decode_q8.c) */
static inline __m512 reduce16(const __m512 a[16]) {
    __m512 c[8], d[4];
    for (int i = 0; i < 8; i++) /* [8 partials of a[2i] | 8 of a[2i+1]] */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit lane k: 4 partials of token 4i + k */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    /* lane k: [2 partials of token k, 2 of token 4 + k] and [.. 8 + k, .. 12 + k] */
    const __m512 e0 = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    const __m512 e1 = _mm512_add_ps(_mm512_shuffle_ps(d[2], d[3], 0x88), _mm512_shuffle_ps(d[2], d[3], 0xDD));
    /* element 4k + m holds the sum of token 4m + k */
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e0, e1, 0x88), _mm512_shuffle_ps(e0, e1, 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, f);
}
#endif

/* The next work item's K and V, asked for (into L2) a few lines at a time while this item
 * computes. A thread that reads a request's scattered blocks only as it reaches them computes
 * and waits in turn (about 14 GB/s of K/V at a decode batch of 64, with the hardware
 * prefetchers); asking for the whole next item at once stalls on the full miss queue instead. */
typedef struct {
    const char *k_cache, *v_cache;
    const int64_t *table;
    int64_t ctx, block_size, row_bytes, off, span; /* bytes: a cache row, the item's heads in it */
    int64_t t, per_step;                           /* next token; lines asked for per call */
    int which;                                     /* 0: K, 1: V, 2: done */
    int64_t t0;                                    /* the first token (of K, then of V) */
} prefetcher;

static inline void prefetch_some(prefetcher *c) {
    for (int64_t lines = c->per_step; lines > 0 && c->which < 2;) {
        if (c->t >= c->ctx) { c->which++; c->t = c->t0; continue; }
        const char *p = (c->which ? c->v_cache : c->k_cache)
                        + (c->table[c->t / c->block_size] * c->block_size + c->t % c->block_size) * c->row_bytes
                        + c->off;
        for (int64_t l = 0; l < c->span; l += 64) __builtin_prefetch(p + l, 0, 2);
        lines -= (c->span + 63) / 64;
        c->t++;
    }
}

/* the prefetcher of work item (request row b, head part part: heads part*hpi ..), its lines
 * spread over `calls` calls of prefetch_some; b < 0: none */
static inline prefetcher next_item(int64_t b, int64_t part, int64_t hpi, int64_t Hk, int64_t D, int64_t esize,
                                   const int64_t *rows_req, const int64_t *tables, int64_t bt_stride,
                                   const int64_t *ctx_lens, int64_t block_size, const void *k_cache,
                                   const void *v_cache, int64_t calls) {
    if (b < 0) return (prefetcher){.which = 2};
    const int64_t kh0 = part * hpi, kh1 = kh0 + hpi < Hk ? kh0 + hpi : Hk, span = (kh1 - kh0) * D * esize;
    const int64_t lines = 2 * ctx_lens[b] * ((span + 63) / 64);
    return (prefetcher){.k_cache = (const char *)k_cache, .v_cache = (const char *)v_cache,
                        .table = tables + rows_req[b] * bt_stride, .ctx = ctx_lens[b], .block_size = block_size,
                        .row_bytes = Hk * D * esize, .off = kh0 * D * esize, .span = span, .t = 0,
                        .per_step = lines / (calls > 0 ? calls : 1) + 1, .which = 0, .t0 = 0};
}

/* ---- Sharing work items among the threads ----
 * By cost, not dealt round-robin: thread tid takes the consecutive items [*lo, *hi) whose costs
 * add up to about 1/nt of the total (an item goes to the thread whose share holds its middle).
 * Dealt round-robin, a thread's work followed the contexts of the rows it was dealt: with long
 * and short rows alternating, one of two threads read most of the K/V while the other waited at
 * the parallel region's end (64 rows of 600 and 32 tokens alternating: 1.8x the time of the same
 * rows shared by cost, bench/decode_attention.py). A thread's next
 * item (whose K/V it asks for while it computes this one) is it + 1 while that is below *hi. */
#define ITEM_TOKENS 16 /* an item's own cost (its query, scratch and output), in tokens of K/V */

static inline void thread_share(const int64_t *cost, int64_t n, int nt, int tid, int64_t *lo, int64_t *hi) {
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) total += cost[i];
    *lo = *hi = n;
    int64_t before = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t owner = total > 0 ? (2 * before + cost[i]) * nt / (2 * total) : i * nt / n;
        owner = owner < nt ? owner : nt - 1;
        if (owner >= tid && *lo == n) *lo = i;
        if (owner > tid) { *hi = i; break; }
        before += cost[i];
    }
}

/* thread_share, for the tests */
void paged_decode_thread_share(const int64_t *cost, int64_t n, int nt, int tid, int64_t *lo, int64_t *hi) {
    thread_share(cost, n, nt, tid, lo, hi);
}

/* How many parts a decode row's KV heads are cut into, a work item each: enough for two items a
 * thread where there are few rows, and, where cap > 0, enough that an item's K and V (its heads'
 * share of a cache row, over the batch's mean context) stay within cap bytes. A thread asks for
 * its next item's K/V (into L2) while it computes one, so the two must fit there together: an
 * OPT-125m row's 12 heads at 160 tokens are 480 KB. The AVX512-BF16 kernel takes ITEM_KV_BYTES:
 * 64 such rows through 12 layers 16.7-20.6 -> 15.4-15.7 ms (items of 2 heads), 64 rows of 600 and
 * 32 tokens alternating 41 -> 26-33; the default model's heads (120 KB a row, items of 2 heads and
 * 1) 25.6 -> 20.3-21.8 ms for those, 64 rows of 160 within the noise (9.9-10.3 -> 10.3-10.8 in
 * two runs each, 9.86 -> 9.94 best alternated in one process). 2026-12-08, bench/decode_attention.py,
 * docs/performance.md. The portable kernel keeps whole rows (cap 0): it walks a token's heads
 * together, and cut so its fp32 default-model batches were as often slower as faster. */
#define ITEM_KV_BYTES (64 * 1024)
static int64_t decode_parts(int64_t B, int64_t Hk, int64_t D, int64_t esize, const int64_t *ctx_lens,
                            const int64_t *singles, int nthreads, int64_t cap) {
    int64_t parts = (2 * (int64_t)nthreads + B - 1) / (B > 0 ? B : 1), sum = 0;
    for (int64_t i = 0; i < B; i++) sum += ctx_lens[singles ? singles[i] : i];
    if (cap > 0 && B > 0) {
        const int64_t by_bytes = (2 * (sum / B) * Hk * D * esize + cap - 1) / cap;
        parts = by_bytes > parts ? by_bytes : parts;
    }
    return parts > Hk ? Hk : parts < 1 ? 1 : parts;
}

/* ---- A step's prefill chunks as work items (paged_prefill_amx.c, paged_prefill_f32.c) ----
 * An item is (chunk, KV head, rows [r0, r1) of the chunk); chunks (n x 4) as those kernels take
 * them. The chunks are cut into parts of one size: at least part_min rows (unless the chunk is
 * shorter), a multiple of part_round, so that the step gives each of the threads about per_thread
 * items (each item lays its keys out anew, so finer parts would cost more than they balance).
 * An item's cost: laying out its keys (2 a key), then per row and query head the keys it sees
 * (its prefix, the part's middle row, ITEM_TOKENS), those divided by row_div (what a row's key
 * costs against laying one out). *item_out (4 int64 an item: chunk, KV head, r0, r1) and
 * *cost_out are malloc'd; returns the number of items (0: none, nothing allocated) or -1 where
 * memory ran out. */
static int64_t prefill_items(const int64_t *chunks, int64_t n, int64_t Hk, int64_t g, int nthreads,
                             int64_t per_thread, int64_t part_min, int64_t part_round, int64_t row_div,
                             int64_t **item_out, int64_t **cost_out) {
    int64_t items = 0, rows = 0;
    for (int64_t c = 0; c < n; c++) rows += chunks[4 * c + 1];
    const int64_t share = per_thread * (int64_t)nthreads;
    int64_t part = (rows * Hk + share - 1) / share;
    part = part < part_min ? part_min : (part + part_round - 1) / part_round * part_round;
    for (int64_t c = 0; c < n; c++) items += Hk * ((chunks[4 * c + 1] + part - 1) / part);
    if (!items) return 0;
    int64_t *item = malloc(items * 4 * sizeof(int64_t)), *cost = malloc(items * sizeof(int64_t));
    if (!item || !cost) { free(item); free(cost); return -1; }
    int64_t it = 0;
    for (int64_t c = 0; c < n; c++) {
        const int64_t tokens = chunks[4 * c + 1], prefix = chunks[4 * c + 2] - tokens;
        for (int64_t kh = 0; kh < Hk; kh++)
            for (int64_t r0 = 0; r0 < tokens; r0 += part, it++) {
                const int64_t r1 = r0 + part < tokens ? r0 + part : tokens;
                item[4 * it] = c, item[4 * it + 1] = kh, item[4 * it + 2] = r0, item[4 * it + 3] = r1;
                cost[it] = 2 * (prefix + r1) + g * (r1 - r0) * (prefix + (r0 + r1) / 2 + ITEM_TOKENS) / row_div;
            }
    }
    *item_out = item, *cost_out = cost;
    return items;
}

/* the most keys one of items [lo, hi) sees (its chunk's prefix and its last row), at least `least`,
 * rounded up to a multiple of `round`: what a thread's scratch for its items is sized by */
static int64_t prefill_items_keys(const int64_t *chunks, const int64_t *item, int64_t lo, int64_t hi,
                                  int64_t least, int64_t round) {
    int64_t kmax = least;
    for (int64_t i = lo; i < hi; i++) {
        const int64_t *ch = chunks + 4 * item[4 * i];
        const int64_t keys = ch[2] - ch[1] + item[4 * i + 3];
        kmax = keys > kmax ? keys : kmax;
    }
    return (kmax + round - 1) / round * round;
}

/* the largest of a row's first ctx scores (sr[0] where ctx < 1), eight lanes at a time (GCC does
 * not vectorize the scalar loop's compare-and-select: 9 ns a token a layer of the fp32 kernel's
 * 80). Every lane starts from sr[0], so a NaN is kept or skipped exactly as the scalar loop does
 * (kept only where sr[0] is one); a max is exact in any order. */
static inline float row_max(const float *sr, int64_t ctx) {
    float m = sr[0];
    int64_t u = 0;
    if (ctx >= 8) {
        v8f vm = (v8f){0} + sr[0];
        for (; u + 8 <= ctx; u += 8) {
            const v8f x = load_f32(sr + u);
            const v8i gt = x > vm;
            vm = (v8f)(((v8i)x & gt) | ((v8i)vm & ~gt));
        }
        m = vm[0];
        for (int i = 1; i < 8; i++) m = vm[i] > m ? vm[i] : m;
    }
    for (; u < ctx; u++) m = sr[u] > m ? sr[u] : m;
    return m;
}

/* each of nr rows (row stride `stride`) of scores: exponentials of the softmax over its first ctx
 * values, in place, divided by their sum where `normalize` is set; where ml is not NULL, ml[2r]
 * and ml[2r + 1] receive row r's max and sum of exponentials (what a later merge of softmaxes
 * over parts of a context needs, or a caller that divides after P.V) */
static inline void softmax_rows(float *scores, int64_t nr, int64_t stride, int64_t ctx, float *ml, int normalize) {
    for (int64_t r = 0; r < nr; r++) {
        float *sr = scores + r * stride;
        const float m = row_max(sr, ctx);
        float sum = 0.f;
        int64_t u = 0;
        v8f vsum = {0};
        for (; u + 8 <= ctx; u += 8) {
            v8f e = exp_nonpositive(load_f32(sr + u) - m);
            memcpy(sr + u, &e, sizeof e);
            vsum += e;
        }
        for (; u < ctx; u++) { sr[u] = expf(sr[u] - m); sum += sr[u]; }
        sum += hsum(vsum);
        if (ml) ml[2 * r] = m, ml[2 * r + 1] = sum;
        if (!normalize) continue;
        const float inv = 1.f / sum;
        for (u = 0; u < ctx; u++) sr[u] *= inv;
    }
}

/* ---- Decode rows split along their context (flash-decoding; see paged_decode_dpbf16.c) ----
 * Where a step has fewer (row, KV head) items than the threads share evenly, each decode row's
 * context is cut into parts, an item is one part of one row with all its KV heads, and the
 * parts' softmaxes are merged after. */
#define QD_CHUNK 512 /* tokens a part at most (parts a multiple of the threads, so each thread's share is whole
                            parts of about equal length, unless QD_CHUNK_MIN caps them) */
#define QD_CHUNK_MIN 64 /* and at least, where many threads would cut a context finer */
#define QD_SPLIT_MIN 256 /* no split below this context: the attention is then a small part of a step */

/* the number of parts of each row's context, 0 where the rows go by (row, KV heads) items */
static int64_t decode_chunks(int64_t B, int64_t Hk, int64_t max_ctx, int nthreads) {
    if (nthreads < 2 || B * Hk >= 4 * (int64_t)nthreads || max_ctx < QD_SPLIT_MIN) return 0;
    const int64_t chunks = nthreads * ((max_ctx + nthreads * QD_CHUNK - 1) / (nthreads * QD_CHUNK));
    const int64_t most = (max_ctx + QD_CHUNK_MIN - 1) / QD_CHUNK_MIN;
    return chunks < most ? chunks : most;
}

/* decode_chunks, for the tests: the parts paged_decode_f32 / _f16 / _portable_bf16 cut each row into */
int64_t paged_decode_portable_chunks(int64_t B, int64_t Hk, int64_t max_ctx, int nthreads) {
    return decode_chunks(B, Hk, max_ctx, nthreads);
}

/* part c of `chunks` of a context of ctx tokens: [*tb, *te), whole 16-token tiles (empty: *tb >= *te) */
static inline void part_range(int64_t ctx, int64_t chunks, int64_t c, int64_t *tb, int64_t *te) {
    const int64_t len = ((ctx + chunks - 1) / chunks + 15) / 16 * 16;
    *tb = c * len;
    *te = *tb + len < ctx ? *tb + len : ctx;
}

/* The costs of a decode step's `items` items, malloc'd (NULL: out of memory). Item it is of row
 * it / per_req (singles[it / per_req] where singles is not NULL) and either part it % chunks of
 * its context with all Hk KV heads (chunks > 0) or its KV heads (it % per_req) * hpi .. (at most
 * hpi of them); its cost is the tokens it reads times its KV heads, ITEM_TOKENS more a head. */
static int64_t *decode_costs(const int64_t *ctx_lens, const int64_t *singles, int64_t items, int64_t per_req,
                             int64_t chunks, int64_t hpi, int64_t Hk) {
    int64_t *cost = malloc(sizeof(int64_t) * (size_t)(items > 0 ? items : 1));
    if (!cost) return NULL;
    for (int64_t it = 0; it < items; it++) {
        const int64_t b = singles ? singles[it / per_req] : it / per_req;
        if (chunks) {
            int64_t tb, te;
            part_range(ctx_lens[b], chunks, it % chunks, &tb, &te);
            cost[it] = Hk * ((te > tb ? te - tb : 0) + ITEM_TOKENS);
        } else {
            const int64_t kh0 = (it % per_req) * hpi, kh1 = kh0 + hpi < Hk ? kh0 + hpi : Hk;
            cost[it] = (kh1 - kh0) * (ctx_lens[b] + ITEM_TOKENS);
        }
    }
    return cost;
}

/* the prefetcher of split item it (row singles[it / chunks], or it / chunks where singles is NULL;
 * part it % chunks; whole cache rows of row_bytes), its lines spread over `calls` calls */
static inline prefetcher part_prefetcher(int64_t it, int64_t items, int64_t chunks, const int64_t *singles,
                                         const int64_t *rows_req, const int64_t *tables, int64_t bt_stride,
                                         const int64_t *ctx_lens, int64_t block_size, const void *k_cache,
                                         const void *v_cache, int64_t row_bytes, int64_t calls) {
    if (it >= items) return (prefetcher){.which = 2};
    const int64_t b = singles ? singles[it / chunks] : it / chunks;
    int64_t tb, te;
    part_range(ctx_lens[b], chunks, it % chunks, &tb, &te);
    if (tb >= te) return (prefetcher){.which = 2};
    const int64_t lines = 2 * (te - tb) * ((row_bytes + 63) / 64);
    return (prefetcher){.k_cache = (const char *)k_cache, .v_cache = (const char *)v_cache,
                        .table = tables + rows_req[b] * bt_stride, .ctx = te, .block_size = block_size,
                        .row_bytes = row_bytes, .off = 0, .span = row_bytes, .t = tb,
                        .per_step = lines / (calls > 0 ? calls : 1) + 1, .which = 0, .t0 = tb};
}

/* one query head's parts merged: o (D floats) = sum_c w_c o_c / sum_c w_c, w_c = sum_c e^(max_c - max),
 * for parts at p0 + c * stride (o_c: D floats, then max_c and sum_c; an empty part has sum 0) */
static inline void merge_parts(const float *p0, int64_t chunks, int64_t stride, int64_t D, float *o) {
    float mx = -INFINITY, wsum = 0.f;
    for (int64_t c = 0; c < chunks; c++) mx = p0[c * stride + D] > mx ? p0[c * stride + D] : mx;
    for (int64_t d = 0; d < D; d++) o[d] = 0.f;
    for (int64_t c = 0; c < chunks; c++) {
        const float *pc = p0 + c * stride;
        if (pc[D + 1] == 0.f) continue;
        const float w = pc[D + 1] * expf(pc[D] - mx);
        wsum += w;
        for (int64_t d = 0; d < D; d++) o[d] += w * pc[d];
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    for (int64_t d = 0; d < D; d++) o[d] *= inv;
}

#define MAX_DV 32  /* D / 8 up to 256 */

#define SLOT(u) (table[(u) / block_size] * block_size + (u) % block_size)

/* Ask for the item's heads of context token u (if it exists) before they are needed: the
 * blocks of one request are scattered, so the hardware prefetcher loses the stream at every
 * block boundary. */
#define PREFETCH_TOKEN(cache, u)                                                               \
    do {                                                                                       \
        if ((u) < ctx) {                                                                       \
            const char *p_ = (const char *)(cache + SLOT(u) * row + kh0 * D);                  \
            for (int64_t l_ = 0; l_ < span; l_ += 64) __builtin_prefetch(p_ + l_);             \
        }                                                                                      \
    } while (0)

/* scores of query rows r0 .. r0+NQ-1 (one KV head's group) against keys k0..k3 */
#define QK_ROWS(NAME, NQ)                                                                      \
    {                                                                                          \
        v8f a[NQ][4];                                                                          \
        for (int q_ = 0; q_ < NQ; q_++) for (int j_ = 0; j_ < 4; j_++) a[q_][j_] = (v8f){0};  \
        for (int64_t d = 0; d < dv; d++) {                                                     \
            const v8f x0 = load_##NAME(k0 + off + 8 * d), x1 = load_##NAME(k1 + off + 8 * d);  \
            const v8f x2 = load_##NAME(k2 + off + 8 * d), x3 = load_##NAME(k3 + off + 8 * d);  \
            for (int q_ = 0; q_ < NQ; q_++) {                                                  \
                const v8f qq = qv[(r0 + q_) * dv + d];                                         \
                a[q_][0] += qq * x0; a[q_][1] += qq * x1; a[q_][2] += qq * x2; a[q_][3] += qq * x3; \
            }                                                                                  \
        }                                                                                      \
        for (int q_ = 0; q_ < NQ; q_++) {                                                      \
            float *s_ = scores + (r0 + q_) * max_ctx + t - tb;                                 \
            s_[0] = hsum(a[q_][0]); s_[1] = hsum(a[q_][1]); s_[2] = hsum(a[q_][2]); s_[3] = hsum(a[q_][3]); \
        }                                                                                      \
    }

#define DEFINE_PAGED_DECODE(FN, NAME, T)                                                        \
int FN(                                                                                         \
    const T *query, int64_t q_stride, const int64_t *rows_q, const int64_t *rows_req,          \
    const T *k_cache, const T *v_cache, const int64_t *tables, int64_t bt_stride,              \
    const int64_t *ctx_lens, T *out, int64_t out_stride, int64_t B, int64_t H, int64_t Hk,     \
    int64_t D, int64_t block_size, int nthreads, float scale) {                                \
    if (D % 8 || D / 8 > MAX_DV || H % Hk) return 2;                                           \
    /* the scores' row length: read here, not passed, so a replayed step (same arguments, new  \
     * lengths) sizes its scratch for the context it has */                                   \
    int64_t max_ctx = 1;                                                                       \
    for (int64_t b = 0; b < B; b++) max_ctx = ctx_lens[b] > max_ctx ? ctx_lens[b] : max_ctx;   \
    const int64_t g = H / Hk, dv = D / 8, row = Hk * D;                                        \
    /* work items: a request and a range of its KV heads. A request's block is contiguous     \
     * (block_size x Hk x D), so walking all its heads token by token streams memory; split    \
     * the heads only when there are too few requests to keep every thread busy. */            \
    int64_t parts = decode_parts(B, Hk, D, sizeof(T), ctx_lens, NULL, nthreads, 0);            \
    /* too few items for the threads, long contexts: parts of each row's context instead, all  \
     * its KV heads an item, merged after (chunks parts a row, see decode_chunks) */           \
    const int64_t chunks = decode_chunks(B, Hk, max_ctx, nthreads), pw = D + 2;                \
    if (chunks) parts = 1;                                                                     \
    const int64_t hpi = (Hk + parts - 1) / parts, per_req = chunks ? chunks : (Hk + hpi - 1) / hpi; \
    const int64_t items = B * per_req, rows_max = hpi * g;                                     \
    float *part = chunks ? malloc(sizeof(float) * (size_t)(items * H * pw)) : NULL;           \
    int64_t *cost = decode_costs(ctx_lens, NULL, items, per_req, chunks, hpi, Hk);             \
    if ((chunks && !part) || !cost) { free(part); free(cost); return 1; }                      \
    int failed = 0;                                                                            \
    _Pragma("omp parallel num_threads(nthreads)")                                              \
    {                                                                                          \
        /* per thread: scores (hpi*g x max_ctx, then 2 floats a row: ml), queries, accumulators */ \
        float *scores = malloc(sizeof(float) * (size_t)(rows_max * (max_ctx + 2)));            \
        v8f *qv = aligned_alloc(sizeof(v8f), sizeof(v8f) * (size_t)(rows_max * dv));           \
        v8f *acc = aligned_alloc(sizeof(v8f), sizeof(v8f) * (size_t)(rows_max * dv));          \
        if (!scores || !qv || !acc) {                                                          \
            _Pragma("omp atomic write") failed = 1;                                            \
        } else {                                                                               \
            const int nt = omp_get_num_threads(), tid = omp_get_thread_num();                  \
            float *ml = scores + rows_max * max_ctx; /* a split item's softmax max and sum a row */ \
            int64_t lo, hi;                                                                    \
            thread_share(cost, items, nt, tid, &lo, &hi);                                      \
            for (int64_t it = lo; it < hi; it++) {                                             \
                const int64_t b = it / per_req, kh0 = chunks ? 0 : (it % per_req) * hpi;       \
                const int64_t kh1 = kh0 + hpi < Hk ? kh0 + hpi : Hk, nr = (kh1 - kh0) * g;     \
                int64_t tb = 0, ctx = ctx_lens[b]; /* the item's tokens: [tb, ctx) */          \
                if (chunks) part_range(ctx_lens[b], chunks, it % chunks, &tb, &ctx);           \
                float *pb = chunks ? part + it * H * pw : NULL;                                \
                if (chunks && tb >= ctx) { /* a short row's empty part: no weight in the merge */ \
                    for (int64_t h = 0; h < H; h++) pb[h * pw + D] = -INFINITY, pb[h * pw + D + 1] = 0.f; \
                    continue;                                                                  \
                }                                                                              \
                const int64_t span = (kh1 - kh0) * D * (int64_t)sizeof(T);                     \
                const int64_t *table = tables + rows_req[b] * bt_stride;                       \
                const T *qrow = query + rows_q[b] * q_stride + kh0 * g * D;                    \
                /* the next item's K/V while this one computes; not for heads under 32 elements, \
                 * whose per-token work is too small to hide the asking (6% slower, 2M OPT) */   \
                prefetcher pf = chunks ? part_prefetcher(D >= 32 && it + 1 < hi ? it + 1 : items, items, chunks, NULL, rows_req, \
                                                         tables, bt_stride, ctx_lens, block_size, k_cache, \
                                                         v_cache, row * (int64_t)sizeof(T), (ctx - tb + 3) / 4 * 2) \
                                       : next_item(D >= 32 && it + 1 < hi ? (it + 1) / per_req : -1, \
                                                   (it + 1) % per_req, hpi, Hk, D, sizeof(T), rows_req, tables, \
                                                   bt_stride, ctx_lens, block_size, k_cache, v_cache, (ctx + 3) / 4 * 2); \
                for (int64_t j = 0; j < nr * dv; j++) qv[j] = load_##NAME(qrow + 8 * j) * scale;\
                int64_t t = tb;                                                                \
                for (; t + 4 <= ctx; t += 4) { /* four keys at once: four independent chains */\
                    const T *k0 = k_cache + SLOT(t) * row, *k1 = k_cache + SLOT(t + 1) * row;  \
                    const T *k2 = k_cache + SLOT(t + 2) * row, *k3 = k_cache + SLOT(t + 3) * row; \
                    for (int64_t f = t + 8; f < t + 12; f++) PREFETCH_TOKEN(k_cache, f);      \
                    prefetch_some(&pf);                                                        \
                    /* per KV head, each K vector is loaded and widened once for up to four  \
                     * of the query heads that share it (GQA), four keys at a time */          \
                    for (int64_t r0 = 0; r0 < nr; r0 += 4) {                                   \
                        const int64_t off = (kh0 + r0 / g) * D;                                \
                        const int64_t r1 = r0 + 4 < nr ? r0 + 4 : nr;                          \
                        const int64_t nq = (r1 < (r0 / g + 1) * g ? r1 : (r0 / g + 1) * g) - r0; \
                        if (nq == 4) QK_ROWS(NAME, 4) else if (nq == 3) QK_ROWS(NAME, 3)       \
                        else if (nq == 2) QK_ROWS(NAME, 2) else QK_ROWS(NAME, 1)               \
                        r0 += nq - 4;                                                          \
                    }                                                                          \
                }                                                                              \
                for (; t < ctx; t++) {                                                         \
                    const T *k0 = k_cache + SLOT(t) * row;                                     \
                    for (int64_t r = 0; r < nr; r++) {                                         \
                        const int64_t off = (kh0 + r / g) * D;                                 \
                        v8f a0 = {0};                                                          \
                        for (int64_t d = 0; d < dv; d++) a0 += qv[r * dv + d] * load_##NAME(k0 + off + 8 * d); \
                        scores[r * max_ctx + t - tb] = hsum(a0);                               \
                    }                                                                          \
                }                                                                              \
                /* P unnormalized: the rows' accumulators are divided by their sums after P.V */ \
                softmax_rows(scores, nr, max_ctx, ctx - tb, ml, 0);                            \
                memset(acc, 0, sizeof(v8f) * (size_t)(nr * dv));                               \
                int64_t u = tb;                                                                \
                for (; u + 2 <= ctx; u += 2) { /* two tokens a pass: each accumulator read and \
                                                * written once for both */                    \
                    PREFETCH_TOKEN(v_cache, u + 8); PREFETCH_TOKEN(v_cache, u + 9);            \
                    if ((u & 3) == 0) prefetch_some(&pf);                                      \
                    const T *va = v_cache + SLOT(u) * row + kh0 * D;                           \
                    const T *vb = v_cache + SLOT(u + 1) * row + kh0 * D;                       \
                    for (int64_t kh = kh0; kh < kh1; kh++) {                                   \
                        const int64_t o = (kh - kh0) * D, rb = (kh - kh0) * g;                 \
                        for (int64_t d = 0; d < dv; d++) {                                     \
                            const v8f xa = load_##NAME(va + o + 8 * d), xb = load_##NAME(vb + o + 8 * d); \
                            for (int64_t r = rb; r < rb + g; r++) {                            \
                                const float *sr = scores + r * max_ctx + u - tb;               \
                                acc[r * dv + d] += sr[0] * xa + sr[1] * xb;                    \
                            }                                                                  \
                        }                                                                      \
                    }                                                                          \
                }                                                                              \
                for (; u < ctx; u++) {                                                         \
                    PREFETCH_TOKEN(v_cache, u + 8);                                            \
                    const T *v0 = v_cache + SLOT(u) * row + kh0 * D;                           \
                    for (int64_t kh = kh0; kh < kh1; kh++) { /* each V vector widened once */ \
                        const T *vr = v0 + (kh - kh0) * D;                                     \
                        const int64_t rb = (kh - kh0) * g;                                     \
                        for (int64_t d = 0; d < dv; d++) {                                     \
                            const v8f x = load_##NAME(vr + 8 * d);                             \
                            for (int64_t r = rb; r < rb + g; r++)                              \
                                acc[r * dv + d] += scores[r * max_ctx + u - tb] * x;           \
                        }                                                                      \
                    }                                                                          \
                }                                                                              \
                for (int64_t r = 0; r < nr; r++) {                                             \
                    const float inv = ctx > tb ? 1.f / ml[2 * r + 1] : 0.f; /* no context: zeros; NaN stays */ \
                    for (int64_t d = 0; d < dv; d++) acc[r * dv + d] *= inv;                   \
                }                                                                              \
                if (chunks) { /* fp32 P.V, max and sum a head, for the merge */                \
                    for (int64_t r = 0; r < nr; r++) {                                         \
                        memcpy(pb + r * pw, acc + r * dv, sizeof(float) * (size_t)D);          \
                        pb[r * pw + D] = ml[2 * r], pb[r * pw + D + 1] = ml[2 * r + 1];        \
                    }                                                                          \
                    continue;                                                                  \
                }                                                                              \
                T *orow = out + rows_q[b] * out_stride + kh0 * g * D;                          \
                for (int64_t j = 0; j < nr * dv; j++)                                          \
                    for (int e = 0; e < 8; e++) orow[8 * j + e] = store_##NAME(acc[j][e]);     \
            }                                                                                  \
        }                                                                                      \
        free(scores); free(qv); free(acc);                                                     \
    }                                                                                          \
    if (chunks && !failed)                                                                     \
        for (int64_t b = 0; b < B; b++)                                                        \
            for (int64_t h = 0; h < H; h++) {                                                  \
                float o[8 * MAX_DV];                                                           \
                merge_parts(part + b * chunks * H * pw + h * pw, chunks, H * pw, D, o);        \
                T *orow = out + rows_q[b] * out_stride + h * D;                                \
                for (int64_t d = 0; d < D; d++) orow[d] = store_##NAME(o[d]);                  \
            }                                                                                  \
    free(part);                                                                                \
    free(cost);                                                                                \
    return failed;                                                                             \
}

DEFINE_PAGED_DECODE(paged_decode_f32, f32, float)
DEFINE_PAGED_DECODE(paged_decode_portable_bf16, bf16, bf16_t)
DEFINE_PAGED_DECODE(paged_decode_f16, f16, f16_t)

/* paged_decode_bf16 (the exported bf16 entry) is defined in paged_decode_dpbf16.c, appended to
 * this file when it is built. */

/* The step's new keys and values into the cache: row i of key (row stride ks) and of value (vs),
 * row elements each (Hk * D), to slot slots[i] of k_cache and v_cache ((num_slots, row),
 * contiguous). One call for both caches, where torch's index_copy_ costs two calls of several
 * microseconds for a decode step's single row. 0, or 1: a slot outside 0 .. num_slots - 1
 * (then nothing is written, as index_copy_). */
#define DEFINE_KV_WRITE(NAME, T)                                                               \
int kv_write_##NAME(const T *key, int64_t ks, const T *value, int64_t vs, const int64_t *slots,\
                    int64_t n, int64_t row, T *k_cache, T *v_cache, int64_t num_slots) {       \
    for (int64_t i = 0; i < n; i++)                                                            \
        if (slots[i] < 0 || slots[i] >= num_slots) return 1;                                   \
    for (int64_t i = 0; i < n; i++) {                                                          \
        const int64_t s = slots[i];                                                            \
        memcpy(k_cache + s * row, key + i * ks, sizeof(T) * (size_t)row);                      \
        memcpy(v_cache + s * row, value + i * vs, sizeof(T) * (size_t)row);                    \
    }                                                                                          \
    return 0;                                                                                  \
}

DEFINE_KV_WRITE(f32, float)
DEFINE_KV_WRITE(bf16, bf16_t)
DEFINE_KV_WRITE(f16, f16_t)

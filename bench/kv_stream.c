/* The K/V a decode step's attention reads, read and nothing computed, for bench/decode_attention.py
 * (not used by loom): the floor of the kernel's time on this machine for this access pattern.
 *
 * Each request's K rows, then its V rows (row_bytes each, a multiple of 32), found through its
 * block table as the kernel finds them (slot = table[t / bs] * bs + t % bs), summed as 32-bit
 * integers (no floating point: any bits, no denormal slowdowns); the threads share the requests
 * one at a time. Built by the script through loom's kernel build (cc -O3 -march=native -fopenmp). */

#include <omp.h>
#include <stdint.h>
#include <string.h>

typedef int32_t v8i __attribute__((vector_size(32)));

int64_t kv_stream(const char *k_cache, const char *v_cache, const int64_t *tables, int64_t bt_stride,
                  const int64_t *ctx_lens, int64_t B, int64_t row_bytes, int64_t block_size, int nthreads) {
    int64_t total = 0;
    #pragma omp parallel num_threads(nthreads) reduction(+:total)
    {
        v8i acc = {0};
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            const int64_t *table = tables + b * bt_stride;
            for (int which = 0; which < 2; which++) {
                const char *cache = which ? v_cache : k_cache;
                for (int64_t t = 0; t < ctx_lens[b]; t++) {
                    const char *r = cache + (table[t / block_size] * block_size + t % block_size) * row_bytes;
                    for (int64_t o = 0; o < row_bytes; o += 32) {
                        v8i x;
                        memcpy(&x, r + o, sizeof x);
                        acc += x;
                    }
                }
            }
        }
        for (int i = 0; i < 8; i++) total += acc[i];
    }
    return total;
}

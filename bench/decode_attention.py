"""A decode step's attention over the paged cache, for batches whose contexts differ.

The default model's heads (9 query heads, 3 KV heads of 64, bf16 or ``--dtype``, blocks of 16
tokens) and 30 layers, or with ``--shape opt-125m`` 12 query and 12 KV heads of 64 and 12 layers,
each layer with its own K/V cache (as a step reads them, mostly from memory), through the CPU
paged-decode kernel (``loom.attention.backends.native``, the AVX512-BF16 kernel where the CPU
has it). Each row: the best of ``--rounds`` passes over the layers, and the nanoseconds a
token of context costs a layer. Contexts of equal and of mixed lengths, among them long and short
rows alternating: where the kernel's threads share the rows unevenly, that batch costs more a
token than a batch of one length.

    python bench/decode_attention.py
    python bench/decode_attention.py --threads 2 --rounds 30
    python bench/decode_attention.py --dtype float32   # the dtype of CPUs without native bf16
    python bench/decode_attention.py --shape opt-125m  # no GQA: 4x the K/V a row of the default model's

Random K/V and queries (the time depends on the lengths, not the values). On a shared machine,
compare figures from the same minutes.

The last columns: the same K/V read alone, in the kernel's order, nothing computed
(``bench/kv_stream.c``): the floor of the kernel's time for that access pattern on this
machine, and the kernel's time as a multiple of it. The threads share the requests, so a single
request is read by one thread (the kernel splits a long one between them): there the read is
no floor.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import time

import torch
from loom.attention.backends import native

HEAD_SIZE, BLOCK = 64, 16
# query heads, KV heads, layers (heads of 64)
SHAPES = {"default": (9, 3, 30), "opt-125m": (12, 12, 12)}
HEADS, KV_HEADS, LAYERS = SHAPES["default"]


def batch(contexts: list[int], g: torch.Generator, dtype: torch.dtype) -> tuple:
    """Query rows, tables, contexts and 30 layers' caches for decode rows of these contexts."""
    blocks = [(c + BLOCK - 1) // BLOCK for c in contexts]
    order = torch.randperm(sum(blocks), generator=g)  # blocks scattered through the cache
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int64)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used:used + n]
        used += n
    caches = [tuple(torch.randn(used * BLOCK, KV_HEADS, HEAD_SIZE, generator=g).to(dtype)
                    for _ in range(2)) for _ in range(LAYERS)]
    query = torch.randn(len(contexts), HEADS * HEAD_SIZE, generator=g).to(dtype)
    rows = torch.arange(len(contexts))
    return query, rows, caches, tables, torch.tensor(contexts)


def kv_stream() -> ctypes._CFuncPtr:
    """``kv_stream`` of ``bench/kv_stream.c``, built as loom builds its kernels."""
    with open(os.path.join(os.path.dirname(__file__), "kv_stream.c"), "rb") as f:
        fn = ctypes.CDLL(native._build(native._compiler(), f.read(), "kv_stream", "the K/V read benchmark")).kv_stream
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn.restype = ctypes.c_int64
    return fn


def read_ms(stream: ctypes._CFuncPtr, data: tuple, rounds: int, threads: int) -> float:
    """The best of ``rounds`` reads of the 30 layers' K/V of the batch, nothing computed."""
    _, _, caches, tables, ctx = data

    def read_all() -> None:
        for k_cache, v_cache in caches:
            stream(k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0), ctx.data_ptr(),
                   ctx.numel(), k_cache[0].numel() * k_cache.element_size(), BLOCK, threads)

    read_all()  # a warm-up pass, not timed
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        read_all()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def best_ms(kernel: native.PagedDecode, data: tuple, rounds: int) -> float:
    query, rows, caches, tables, ctx = data
    out = torch.empty_like(query)
    for k_cache, v_cache in caches:  # a warm-up pass: first-touch page faults, the kernel's first calls
        kernel(query, rows, rows, k_cache, v_cache, tables, ctx, out, num_heads=HEADS, block_size=BLOCK,
               scale=HEAD_SIZE**-0.5)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            kernel(query, rows, rows, k_cache, v_cache, tables, ctx, out, num_heads=HEADS, block_size=BLOCK,
                   scale=HEAD_SIZE**-0.5)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    parser.add_argument("--shape", choices=list(SHAPES), default="default",
                        help="the model whose heads and layers to take (opt-125m: 12 heads of 64, no GQA, 12 layers)")
    args = parser.parse_args()
    global HEADS, KV_HEADS, LAYERS
    HEADS, KV_HEADS, LAYERS = SHAPES[args.shape]
    if args.threads < 1 or args.rounds < 1:
        parser.error("--threads and --rounds must be at least 1")
    torch.set_num_threads(args.threads)
    kernel = native.paged_decode()
    if kernel is None:
        raise SystemExit("the CPU paged-decode kernel did not build here (see the warning above)")
    stream = kv_stream()
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    batches = [
        ("64 rows of 160", [160] * 64),
        ("64 rows of 128..191", list(range(128, 192))),
        ("64 rows of 16..640, random", [rng.randint(16, 640) for _ in range(64)]),
        ("64 rows of 600 and 32, alternating", [600, 32] * 32),
        ("32 rows of 600", [600] * 32),
        ("16 rows of 16..640, random", [rng.randint(16, 640) for _ in range(16)]),
        ("1 row of 2000", [2000]),
    ]
    dtype = getattr(torch, args.dtype)
    print(f"decode attention, {HEADS}/{KV_HEADS} heads of {HEAD_SIZE}, {args.dtype}, {LAYERS} layers, "
          f"{args.threads} threads, best of {args.rounds}")
    print(f"  {'batch':36s} {'kernel':>10s}  {'a token a layer':>15s}  {'K/V read alone':>23s}  kernel / read")
    for name, contexts in batches:
        data = batch(contexts, g, dtype)
        ms = best_ms(kernel, data, args.rounds)
        floor = read_ms(stream, data, args.rounds, args.threads)
        per_token = ms * 1e6 / (sum(contexts) * LAYERS)
        gbs = sum(contexts) * LAYERS * 2 * KV_HEADS * HEAD_SIZE * data[2][0][0].element_size() / floor / 1e6
        print(f"  {name:36s} {ms:7.2f} ms  {per_token:12.1f} ns  {floor:7.2f} ms ({gbs:5.1f} GB/s)  {ms / floor:9.2f}x")


if __name__ == "__main__":
    main()

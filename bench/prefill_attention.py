"""A prefill step's attention, through the CPU torch-SDPA backend, with and without loom's prefill kernel.

The default model's heads (9 query heads, 3 KV heads of 64, blocks of 16 tokens), in bf16 with
the AMX prefill kernel (``paged_prefill_amx.c``) or, on CPUs with AVX512-BF16 and no AMX, the
decode kernel's prefill rows (``paged_decode_dpbf16.c``), or in fp32 (``--dtype float32``) with the
fp32 one (``paged_prefill_f32.c``). Each case is one step's prefill chunks (fresh prompts, or a chunk
after a cached prefix); the backend's ``forward`` (writing the chunks' K/V into the cache, then
attending) runs with the kernel and without it (torch's flash kernel, one call per chunk length,
or per chunk after a prefix over its gathered K/V), alternated; each figure is the median of
``--rounds`` rounds, ms a layer. The kernel is switched on for every case, whatever the
backend's context limit (``AMX_PREFILL_MAX_CTX``, ``F32_PREFILL_MAX_CTX``,
``KERNEL_PREFILL_MAX_CTX``), so the cases past the limit show why it is there.

    python bench/prefill_attention.py
    python bench/prefill_attention.py --dtype float32 --rounds 15 --threads 2

Random K/V and queries (the time depends on the lengths, not the values). Runs where a kernel
does: bf16 on a CPU with AMX-BF16 or AVX512-BF16; fp32 anywhere the kernels build (the backend uses it on x86
with AVX2 and no AVX-512). On a shared machine, compare figures from the same minutes.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch
from loom.attention.backends import native, torch_sdpa
from loom.attention.backends.torch_sdpa import TorchSDPAImpl
from loom_plugin_api import AttentionMetadata

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 9, 3, 64, 16


def step(chunks: list[tuple[int, int]], g: torch.Generator,
         dtype: torch.dtype = torch.bfloat16) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and a cache for one step of (tokens, cached prefix) chunks, blocks scattered."""
    ctx = [t + p for t, p in chunks]
    blocks = [(c + BLOCK - 1) // BLOCK for c in ctx]
    order = torch.randperm(sum(blocks), generator=g)
    tables = torch.zeros(len(chunks), max(blocks), dtype=torch.int64)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used:used + n]
        used += n
    q_lens = [t for t, _ in chunks]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(p, p + t) for t, p in chunks])
    req = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(q_lens))
    md = AttentionMetadata(
        num_reqs=len(chunks), num_tokens=int(starts[-1]), query_start_loc=starts, seq_lens=torch.tensor(ctx),
        query_lens=q_lens, seq_lens_list=ctx, max_query_len=max(q_lens), max_seq_len=max(ctx),
        block_tables=tables, slot_mapping=tables[req, positions // BLOCK] * BLOCK + positions % BLOCK,
        block_size=BLOCK)
    cache = torch.randn(2, used, BLOCK, KV_HEADS, HEAD_SIZE, generator=g).to(dtype)
    return md, cache


def time_case(impl: TorchSDPAImpl, switch: Callable[[bool], None], chunks: list[tuple[int, int]], rounds: int,
              g: torch.Generator, dtype: torch.dtype) -> tuple[float, float]:
    md, cache = step(chunks, g, dtype)
    T = md.num_tokens
    q, k, v = (torch.randn(T, n * HEAD_SIZE, generator=g).to(dtype) for n in (HEADS, KV_HEADS, KV_HEADS))
    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for _ in range(rounds):
            for on in (True, False):
                switch(on)
                md.scratch.clear()
                impl.forward(None, q, k, v, cache, md)  # the step's plan (built once for all layers), warm-up
                start = time.perf_counter()
                for _ in range(5):
                    impl.forward(None, q, k, v, cache, md)
                times[on].append((time.perf_counter() - start) / 5 * 1e3)
    switch(True)
    return statistics.median(times[True]), statistics.median(times[False])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernel = native.paged_decode()
    if kernel is None:
        sys.exit("the CPU attention kernels did not build here (they need a C compiler with OpenMP)")
    shape = (dtype, HEADS, KV_HEADS, HEAD_SIZE)
    if dtype == torch.float32:
        name, switch = "fp32 kernel", functools.partial(setattr, kernel, "f32_prefill")
    elif kernel.takes_amx_prefill(*shape):
        name, switch = "AMX kernel", functools.partial(setattr, kernel, "amx_prefill")
    elif kernel.takes_prefill(*shape):  # the decode kernel's prefill rows (paged_decode_dpbf16.c)
        name, switch = "AVX512-BF16 kernel", functools.partial(kernel._takes_prefill.__setitem__, shape)
    else:
        sys.exit("no bf16 prefill kernel runs here (the AMX one needs AMX-BF16, the other AVX512-BF16 where "
                 "torch's flash kernel has no AMX); try --dtype float32")
    impl = TorchSDPAImpl(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS)
    # every case through the kernel where it is switched on, past the backend's limits too
    torch_sdpa.AMX_PREFILL_MAX_CTX = torch_sdpa.F32_PREFILL_MAX_CTX = torch_sdpa.KERNEL_PREFILL_MAX_CTX = 1 << 20
    rng = random.Random(0)
    mixed = [(rng.randint(16, 512), 0) for _ in range(8)]
    cases = {
        "16 prompts of 128": [(128, 0)] * 16,
        f"8 prompts of 16-512 ({sum(t for t, _ in mixed):,} tokens)": mixed,
        "one prompt of 1,000": [(1000, 0)],
        "512 tokens after 1,536 cached": [(512, 1536)],
        "one prompt of 4,096": [(4096, 0)],
        "2,048 tokens after 6,144 cached": [(2048, 6144)],
        "one prompt of 8,192": [(8192, 0)],
    }
    g = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads, {HEADS}/{KV_HEADS} heads of {HEAD_SIZE}, {args.dtype}, median of "
          f"{args.rounds} rounds\n\n| step's prefill chunks | {name} ms | torch SDPA ms | SDPA / kernel |\n"
          "|---|---|---|---|")
    for case, chunks in cases.items():
        ours, sdpa = time_case(impl, switch, chunks, args.rounds, g, dtype)
        print(f"| {case} | {ours:.2f} | {sdpa:.2f} | {sdpa / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

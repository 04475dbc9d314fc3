"""Helpers shared by the kernel tests: device, tolerances, and a paged-batch builder.

conftest.py has already switched on the interpreter (off-GPU) and made the kernels importable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (atol, rtol) for elementwise kernels: a couple of ulps of the output dtype.
ELEMENTWISE_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# One rounding of the same fp32 value: exact, except that the interpreter truncates to bf16.
ROUNDING_TOL = {
    torch.float32: (0.0, 0.0),
    torch.float16: (0.0, 0.0),
    torch.bfloat16: (0.0, 0.0) if ON_GPU else (0.0, 2.0**-7),
}
# Attention rounds P to the input dtype before P @ V (as flash attention does) on a GPU.
ATTENTION_TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2.5e-2, 2.5e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float]) -> None:
    atol, rtol = tol
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@dataclass(slots=True)
class PagedBatch:
    """One step of a paged batch: cache, new tokens and the metadata loom builds for them."""

    query: torch.Tensor  # (T, H*D)
    key: torch.Tensor  # (T, Hk*D) the new tokens' K
    value: torch.Tensor  # (T, Hk*D)
    kv_cache: torch.Tensor  # (2, num_blocks, block_size, Hk, D), prefix already cached
    query_start_loc: torch.Tensor  # (num_reqs + 1,)
    seq_lens: torch.Tensor  # (num_reqs,)
    block_tables: torch.Tensor  # (num_reqs, max_blocks) padded with 0
    slot_mapping: torch.Tensor  # (T,)
    max_query_len: int
    max_seq_len: int
    scale: float


def build_paged_batch(
    requests: list[tuple[int, int]],  # (context length after the step, new tokens) per request
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedBatch:
    """Random K/V everywhere (so a read outside the context shows), blocks shuffled across requests."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-ctx // block_size) for ctx, _ in requests]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks hold garbage too
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(blocks_per_req)
    block_tables = torch.zeros(len(requests), max_blocks, dtype=torch.int64)
    used = 0
    for i, n in enumerate(blocks_per_req):
        block_tables[i, :n] = perm[used:used + n]
        used += n
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g).to(dtype)
    q_lens = torch.tensor([q for _, q in requests], dtype=torch.int64)
    seq_lens = torch.tensor([ctx for ctx, _ in requests], dtype=torch.int64)
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int64)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    t = int(query_start_loc[-1])
    req_of_token = torch.repeat_interleave(torch.arange(len(requests)), q_lens)
    positions = torch.arange(t) - query_start_loc[req_of_token] + (seq_lens - q_lens)[req_of_token]
    slot_mapping = block_tables[req_of_token, positions // block_size] * block_size + positions % block_size
    query = torch.randn(t, num_heads * head_size, generator=g).to(dtype)
    key = torch.randn(t, num_kv_heads * head_size, generator=g).to(dtype)
    value = torch.randn(t, num_kv_heads * head_size, generator=g).to(dtype)
    # the new tokens' K/V go in as reshape_and_cache would put them (written here by plain indexing)
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    flat[0, slot_mapping] = key.view(t, num_kv_heads, head_size)
    flat[1, slot_mapping] = value.view(t, num_kv_heads, head_size)
    dev = DEVICE
    return PagedBatch(
        query=query.to(dev), key=key.to(dev), value=value.to(dev), kv_cache=kv_cache.to(dev),
        query_start_loc=query_start_loc.to(dev), seq_lens=seq_lens.to(dev),
        block_tables=block_tables.to(dev), slot_mapping=slot_mapping.to(dev),
        max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()), scale=head_size**-0.5,
    )

"""A reference paged attention in plain torch (fp32), and the steps the attention tier runs.

The reference keeps its own fp32 cache in the contract's default layout
``(2, num_blocks, block_size, num_kv_heads, head_size)``; the platform's backend keeps its
own, in whatever layout ``get_kv_cache_shape`` gives. Both get the same metadata each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..attention import AttentionMetadata

__all__ = ["PagedRun", "reference_paged_attention"]


def reference_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
) -> torch.Tensor:
    """Store the step's K/V at ``slot_mapping``, then let each new token attend causally to its
    request's context gathered through the block table. Returns ``(T, H * D)`` in fp32."""
    T, H, Hk, D = query.shape[0], num_heads, num_kv_heads, head_size
    k_cache = kv_cache[0].view(-1, Hk, D)  # (slots, Hk, D)
    v_cache = kv_cache[1].view(-1, Hk, D)
    k_cache[md.slot_mapping] = key.float().view(T, Hk, D)
    v_cache[md.slot_mapping] = value.float().view(T, Hk, D)
    q = query.float().view(T, H, D)
    out = torch.empty(T, H, D)
    starts = md.query_start_loc.tolist()
    for i in range(md.num_reqs):
        q_len, ctx = md.query_lens[i], md.seq_lens_list[i]
        pos = torch.arange(ctx)
        slots = md.block_tables[i][pos // md.block_size] * md.block_size + pos % md.block_size
        k = k_cache[slots].repeat_interleave(H // Hk, dim=1)  # (ctx, H, D)
        v = v_cache[slots].repeat_interleave(H // Hk, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[starts[i] : starts[i] + q_len], k) * scale  # (H, q, ctx)
        q_pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)  # query j sits at ctx - q_len + j
        scores.masked_fill_(pos.unsqueeze(0) > q_pos, -math.inf)
        out[starts[i] : starts[i] + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out.view(T, H * D)


@dataclass
class PagedRun:
    """Requests with random Q/K/V for every position, blocks scattered over a shared pool."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    max_len: int = 96
    num_requests: int = 3
    seed: int = 0
    computed: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        blocks_per_req = -(-self.max_len // self.block_size)
        self.num_blocks = blocks_per_req * self.num_requests + 2  # spare blocks hold garbage
        perm = torch.randperm(self.num_blocks, generator=g)
        self.block_tables = perm[: blocks_per_req * self.num_requests].view(self.num_requests, blocks_per_req)
        H, Hk, D, n = self.num_heads, self.num_kv_heads, self.head_size, self.max_len
        self.q = [torch.randn(n, H * D, generator=g).to(self.dtype) for _ in range(self.num_requests)]
        self.k = [torch.randn(n, Hk * D, generator=g).to(self.dtype) for _ in range(self.num_requests)]
        self.v = [torch.randn(n, Hk * D, generator=g).to(self.dtype) for _ in range(self.num_requests)]
        self.ref_cache = torch.randn(2, self.num_blocks, self.block_size, Hk, D, generator=g)

    def step(
        self, work: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``work``: (request, new tokens). Returns the step's query, key, value and metadata."""
        qs, ks, vs, slots, query_lens, seq_lens, tables = [], [], [], [], [], [], []
        for req, n in work:
            start = self.computed.get(req, 0)
            end = start + n
            if end > self.max_len:
                raise ValueError(f"request {req} would exceed max_len {self.max_len}")
            pos = torch.arange(start, end)
            slots.append(
                self.block_tables[req][pos // self.block_size] * self.block_size + pos % self.block_size
            )
            qs.append(self.q[req][start:end])
            ks.append(self.k[req][start:end])
            vs.append(self.v[req][start:end])
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(self.block_tables[req])
            self.computed[req] = end
        loc = torch.tensor([0, *query_lens]).cumsum(0)
        md = AttentionMetadata(
            num_reqs=len(work),
            num_tokens=int(loc[-1]),
            query_start_loc=loc,
            seq_lens=torch.tensor(seq_lens),
            query_lens=query_lens,
            seq_lens_list=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_tables=torch.stack(tables),
            slot_mapping=torch.cat(slots),
            block_size=self.block_size,
        )
        return torch.cat(qs), torch.cat(ks), torch.cat(vs), md


def metadata_on(md: AttentionMetadata, device: str) -> AttentionMetadata:
    """The same metadata with its tensors on ``device`` and a fresh scratch."""
    return AttentionMetadata(
        num_reqs=md.num_reqs,
        num_tokens=md.num_tokens,
        query_start_loc=md.query_start_loc.to(device),
        seq_lens=md.seq_lens.to(device),
        query_lens=list(md.query_lens),
        seq_lens_list=list(md.seq_lens_list),
        max_query_len=md.max_query_len,
        max_seq_len=md.max_seq_len,
        block_tables=md.block_tables.to(device),
        slot_mapping=md.slot_mapping.to(device),
        block_size=md.block_size,
    )

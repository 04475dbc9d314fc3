"""The dummy platform's attention: a plain, readable paged attention (one request at a time).

It is the reference a vendor reads first: store the step's K/V at ``slot_mapping``,
then for each request gather its context through the block table and attend with a
causal offset. A real device replaces the loop with a kernel.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from loom_plugin_api import AttentionBackend, AttentionImpl, AttentionMetadata


class DummyAttentionImpl(AttentionImpl):
    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        md = attn_metadata
        T = query.shape[0]
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_size
        group = H // Hk
        k_cache = kv_cache[0].view(-1, Hk, D)  # (num_slots, Hk, D)
        v_cache = kv_cache[1].view(-1, Hk, D)
        k_cache[md.slot_mapping] = key.view(T, Hk, D)
        v_cache[md.slot_mapping] = value.view(T, Hk, D)
        q = query.view(T, H, D)
        out = torch.empty_like(q)
        starts = md.query_start_loc.tolist()
        for i in range(md.num_reqs):
            q_len, ctx = md.query_lens[i], md.seq_lens_list[i]
            pos = torch.arange(ctx)
            slots = md.block_tables[i][pos // md.block_size] * md.block_size + pos % md.block_size
            k = k_cache[slots].repeat_interleave(group, dim=1)  # (ctx, H, D)
            v = v_cache[slots].repeat_interleave(group, dim=1)
            qi = q[starts[i] : starts[i] + q_len]  # (q, H, D)
            scores = torch.einsum("qhd,khd->hqk", qi.float(), k.float()) * self.scale
            # query j sits at position ctx - q_len + j and sees keys up to it
            q_pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)
            scores.masked_fill_(pos.unsqueeze(0) > q_pos, -math.inf)
            probs = scores.softmax(dim=-1)
            out[starts[i] : starts[i] + q_len] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
        return out.view(T, H * D)


class DummyAttentionBackend(AttentionBackend):
    name: ClassVar[str] = "DUMMY"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return DummyAttentionImpl

    @staticmethod
    def get_supported_block_sizes() -> list[int]:
        return [16, 32]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


__all__ = ["DummyAttentionBackend", "DummyAttentionImpl"]

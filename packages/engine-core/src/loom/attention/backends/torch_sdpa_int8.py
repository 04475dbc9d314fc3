"""The torch SDPA backend over an 8-bit KV cache (``--kv-cache-dtype int8``, CPU platform).

The cache layout and quantization are ``kv_int8``'s: per slot a row of int8 codes and one fp32
scale per KV head, so decode attention reads about half the bytes of a bf16 cache. Everything
else is ``TorchSDPAImpl``'s: the step's plan, prefill chunks without a cached prefix (they attend
to their own K/V as computed, unquantized), and SDPA over gathered K/V; what differs is how K/V
get into the cache and out of it. Decode rows run through the int8 kernel of ``kv_int8`` where
the CPU has it (AVX512-VNNI, bf16); elsewhere, and for chunks after a cached prefix, K/V are
gathered and dequantized to the query's dtype first.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from loom_plugin_api import AttentionImpl, AttentionMetadata

from . import kv_int8
from .torch_sdpa import TorchSDPABackend, TorchSDPAImpl, _DecodePlan


class TorchSDPAInt8Impl(TorchSDPAImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, **extra: Any) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, **extra)
        self._int8 = kv_int8.int8_kv()
        self._row = kv_int8.row_bytes(num_kv_heads, head_size)

    def decodes_in_kernel(self, dtype: torch.dtype) -> bool:
        return self._int8 is not None and self._int8.supports(dtype, self.head_size)

    def _takes_prefill(self, dtype: torch.dtype) -> bool:
        return False  # the int8 kernel takes decode rows only

    def _chunk_prefill_max_ctx(self, dtype: torch.dtype) -> int:
        return 0  # the chunk kernels read a cache in the model's dtype

    def _write(self, key_rows: torch.Tensor, value_rows: torch.Tensor, kv_cache: torch.Tensor,
               md: AttentionMetadata) -> None:
        rows = kv_cache.view(2, -1, self._row)
        if self._int8 is None or not self._int8.write(key_rows, value_rows, md.slot_mapping, rows[0], rows[1]):
            hk, d = self.num_kv_heads, self.head_size
            rows[0].index_copy_(0, md.slot_mapping, kv_int8.quantize_rows(key_rows, hk, d))
            rows[1].index_copy_(0, md.slot_mapping, kv_int8.quantize_rows(value_rows, hk, d))

    def _gather(self, kv_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        rows = kv_cache.view(2, -1, self._row)
        flat = slots.reshape(-1)
        hk, d = self.num_kv_heads, self.head_size
        k = kv_int8.dequantize_rows(rows[0].index_select(0, flat), hk, d, dtype)
        v = kv_int8.dequantize_rows(rows[1].index_select(0, flat), hk, d, dtype)
        return k.view(*slots.shape, hk, d), v.view(*slots.shape, hk, d)

    def _decode(self, query: torch.Tensor, plan: _DecodePlan, kv_cache: torch.Tensor, out: torch.Tensor,
                md: AttentionMetadata) -> None:
        rows = kv_cache.view(2, -1, self._row)
        if not self._int8.decode(query, plan.token_idx, plan.rows, rows[0], rows[1], md.block_tables, plan.ctx, out,
                                 num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                 head_size=self.head_size, block_size=md.block_size, scale=self.scale):
            raise RuntimeError(f"the int8 decode kernel refused {query.dtype} rows of head size {self.head_size} "
                               "that it reported it takes")


class TorchSDPAInt8Backend(TorchSDPABackend):
    name: ClassVar[str] = "TORCH_SDPA_INT8"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchSDPAInt8Impl

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, kv_int8.row_bytes(num_kv_heads, head_size))

    @classmethod
    def get_kv_cache_dtype(cls, dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
        if kv_cache_dtype != "int8":
            raise ValueError(f"the {cls.name} attention backend keeps an int8 KV cache, not {kv_cache_dtype!r}")
        return torch.uint8

"""The attention-backend interface: what a platform implements to run attention.

A platform names its backend class in ``Platform.get_attn_backend_cls``; the engine's
selector resolves it once per distinct argument set. Every attention layer of the model
then builds ``backend.get_impl_cls()(...)`` and calls it with the paged KV cache of the
layer and the step's ``AttentionMetadata``.

Token layout of one step: the new tokens of every scheduled request, concatenated in
request order (request ``i`` owns ``query_start_loc[i]:query_start_loc[i+1]``). Request
``i`` has ``seq_lens[i]`` tokens of context after this step, of which the last
``query_len`` are new; the cached ones live in the blocks of ``block_tables[i]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

__all__ = ["AttentionBackend", "AttentionImpl", "AttentionMetadata", "AttentionSelectorConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionSelectorConfig:
    """The arguments that pick a backend; hashable so the selector can cache on them."""

    head_size: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    is_causal: bool = True


@dataclass(slots=True, kw_only=True)
class AttentionMetadata:
    """Per-step layout of the batch, shared by every attention layer of the step."""

    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor
    """(num_reqs + 1,) int64 offsets of each request's new tokens."""
    seq_lens: torch.Tensor
    """(num_reqs,) int64 context length of each request after this step."""
    query_lens: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_tables: torch.Tensor
    """(num_reqs, max_blocks_per_req) int64 block ids, padded with 0."""
    slot_mapping: torch.Tensor
    """(num_tokens,) int64 cache slot (block * block_size + offset) of each new token."""
    block_size: int
    scratch: dict[str, Any] = field(default_factory=dict)
    """Per-step memo for a backend (e.g. gather indices computed once for all layers)."""

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionImpl(ABC):
    """Computes attention for one layer. Built once per layer at model construction."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        **extra: Any,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads

    @abstractmethod
    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Store the new ``key``/``value`` in ``kv_cache`` at ``slot_mapping``, then attend.

        Shapes: query ``(T, num_heads * head_size)``, key/value
        ``(T, num_kv_heads * head_size)``; returns ``(T, num_heads * head_size)``.
        Each new token attends causally to its request's context.

        Write the K/V of every token of the step before reading any context: requests of
        one step may share blocks (a prefix-cache hit on a block that another request of
        the same step fills, e.g. the ``n > 1`` copies of one prompt).
        """


class AttentionBackend(ABC):
    """A family of attention kernels and the KV-cache layout they use."""

    name: ClassVar[str] = "abstract"

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's cache; the default keeps K and V in one tensor. Its size must grow
        in proportion to ``num_blocks``: the reference runner counts a block's bytes from the shape
        for one block."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_supported_block_sizes() -> list[int]:
        """Block sizes this backend accepts (``update_block_size_for_backend`` uses it)."""
        return [16]

    @classmethod
    def get_kv_cache_dtype(cls, dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
        """The dtype of one layer's cache tensor (of ``get_kv_cache_shape``) for a model computing
        in ``dtype`` and the user's ``--kv-cache-dtype`` (``"auto"``: the model's dtype). The
        default keeps the model's dtype and refuses any other choice; a backend with a quantized
        cache returns its storage dtype and lays the scales out in its shape."""
        if kv_cache_dtype != "auto":
            raise ValueError(f"the {cls.name} attention backend keeps its KV cache in the model's dtype: "
                             f"--kv-cache-dtype {kv_cache_dtype} is not supported here (use auto)")
        return dtype

"""Attention tier: the platform's backend against the kit's reference paged attention.

Every scenario runs a few steps through both, with the same block tables (scattered over
a pool with garbage in the spare blocks); the backend must write the step's K/V into its
cache and read the cached context back through the block table.
"""

from __future__ import annotations

import pytest
import torch

from ..attention import AttentionBackend, AttentionSelectorConfig
from ..platform import Platform
from ._names import resolve_subclass
from ._paged_attention import PagedRun, metadata_on, reference_paged_attention
from ._platform import PlatformUnderTest
from ._tolerances import ATTENTION, assert_close, torch_dtype

pytestmark = pytest.mark.attention

HEAD_SIZE = 64


def _scenarios(bs: int) -> dict[str, list[list[tuple[int, int]]]]:
    """Steps of (request, new tokens), for a block size ``bs``."""
    return {
        "prefill": [[(0, bs + 3), (1, 5), (2, bs)]],
        "decode": [[(0, bs - 2), (1, 2 * bs - 1)]] + [[(0, 1), (1, 1)]] * 4,
        "chunked_prefill": [[(0, bs)], [(0, 2 * bs - 5), (1, 7)], [(1, bs), (0, 1)], [(0, 1), (1, 1)]],
        "block_boundaries": [
            [(0, bs - 1), (1, bs), (2, bs + 1)],
            [(0, 1), (1, 1), (2, 1)],
            [(0, 1), (1, bs)],
        ],
    }


class _Layer(torch.nn.Module):
    """What a backend gets as ``layer``: the attention layer's sizes."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size, self.scale = (
            num_heads,
            num_kv_heads,
            head_size,
            scale,
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("scenario", ["prefill", "decode", "chunked_prefill", "block_boundaries"])
def test_backend_matches_reference(
    platform_in_this_process: Platform,
    platform_cls: type[Platform],
    loom_platform_under_test: PlatformUnderTest,
    scenario: str,
    heads: tuple[int, int],
    dtype: str,
) -> None:
    if dtype not in platform_cls.supported_dtypes:
        pytest.skip(f"{platform_cls.__qualname__}.supported_dtypes does not declare {dtype}")
    device = loom_platform_under_test.device()
    num_heads, num_kv_heads = heads
    selector = AttentionSelectorConfig(head_size=HEAD_SIZE, dtype=torch_dtype(dtype))
    backend: type[AttentionBackend] = resolve_subclass(
        platform_cls.get_attn_backend_cls(None, selector, num_heads),
        AttentionBackend,
        f"{platform_cls.__qualname__}.get_attn_backend_cls()",
    )
    sizes = backend.get_supported_block_sizes()
    scale = HEAD_SIZE**-0.5
    # The smallest size, and the largest up to 64 (the steps grow with the block size).
    for block_size in sorted({sizes[0], max([b for b in sizes if b <= 64] or sizes[:1])}):
        impl = backend.get_impl_cls()(num_heads, HEAD_SIZE, scale, num_kv_heads)
        layer = _Layer(num_heads, num_kv_heads, HEAD_SIZE, scale)
        run = PagedRun(
            num_heads, num_kv_heads, HEAD_SIZE, block_size, torch_dtype(dtype), max_len=4 * block_size
        )
        shape = backend.get_kv_cache_shape(run.num_blocks, block_size, num_kv_heads, HEAD_SIZE)
        # in the dtype the runner allocates it in (``get_kv_cache_dtype``), filled with noise that a
        # read of an unwritten slot would show
        kv_cache = (
            torch.randn(shape, generator=torch.Generator().manual_seed(1))
            .to(backend.get_kv_cache_dtype(torch_dtype(dtype), "auto")).to(device)
        )
        for i, work in enumerate(_scenarios(block_size)[scenario]):
            q, k, v, md = run.step(work)
            expected = reference_paged_attention(
                q, k, v, run.ref_cache, md, num_heads, num_kv_heads, HEAD_SIZE, scale
            )
            with torch.inference_mode():
                actual = impl.forward(
                    layer, q.to(device), k.to(device), v.to(device), kv_cache, metadata_on(md, device)
                )
            what = (
                f"{backend.__module__}.{backend.__qualname__} {scenario} step {i} (block size {block_size}, "
                f"{num_heads} heads / {num_kv_heads} KV heads, {dtype}, requests {work})"
            )
            if actual.dtype != q.dtype:
                pytest.fail(f"{what}: output dtype {actual.dtype}, expected the query's {q.dtype}")
            assert_close(actual, expected, ATTENTION[dtype], what)

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, DTYPES
from loom_platform_cuda.kernels import reshape_and_cache
from loom_platform_cuda.kernels.reference import reshape_and_cache_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_size", "block_size"), [(2, 64, 16), (1, 128, 32), (3, 80, 16)])
def test_reshape_and_cache_matches_reference(dtype, num_kv_heads, head_size, block_size):
    num_blocks, t = 6, 9
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size).to(dtype).to(DEVICE)
    # distinct shuffled slots, one padding token (-1) that must be skipped
    slots = torch.randperm(num_blocks * block_size)[:t]
    slots[4] = -1
    slots = slots.to(DEVICE)
    key = torch.randn(t, num_kv_heads * head_size).to(dtype).to(DEVICE)
    value = torch.randn(t, num_kv_heads * head_size).to(dtype).to(DEVICE)

    expected = reshape_and_cache_ref(key, value, kv_cache, slots)
    reshape_and_cache(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


def test_reshape_and_cache_reads_strided_views_of_fused_qkv():
    hk, d, bs = 2, 32, 16
    qkv = torch.randn(5, (4 + 2 * hk) * d, device=DEVICE)
    _, key, value = qkv.split([4 * d, hk * d, hk * d], dim=1)  # row stride > width
    kv_cache = torch.zeros(2, 2, bs, hk, d, device=DEVICE)
    slots = torch.tensor([0, 15, 16, 17, 31], device=DEVICE)
    expected = reshape_and_cache_ref(key, value, kv_cache, slots)
    reshape_and_cache(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize(
    ("key_shape", "cache_shape", "message"),
    [
        ((3, 64), (2, 4, 16, 2, 64), "key and value must be"),
        ((3, 128), (4, 16, 2, 64), "kv_cache must be"),
        ((3, 128), (3, 4, 16, 2, 64), "kv_cache must be"),
    ],
)
def test_reshape_and_cache_rejects_bad_shapes(key_shape, cache_shape, message):
    key = torch.zeros(key_shape, device=DEVICE)
    kv_cache = torch.zeros(cache_shape, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(key, key, kv_cache, slots)


def test_reshape_and_cache_rejects_float_slots():
    key = torch.zeros(3, 128, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        reshape_and_cache(key, key, torch.zeros(2, 4, 16, 2, 64, device=DEVICE), torch.zeros(3, device=DEVICE))


def test_reshape_and_cache_rejects_strided_slots():
    key = torch.zeros(3, 128, device=DEVICE)
    slots = torch.arange(6, device=DEVICE)[::2]
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        reshape_and_cache(key, key, torch.zeros(2, 4, 16, 2, 64, device=DEVICE), slots)

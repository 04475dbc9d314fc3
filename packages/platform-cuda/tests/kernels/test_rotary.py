from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, DTYPES, ELEMENTWISE_TOL, ON_GPU, assert_close
from loom_platform_cuda.kernels import rotary_embedding
from loom_platform_cuda.kernels.reference import rotary_embedding_ref

MAX_POS = 256
# (T, num_q_heads, num_kv_heads, head_size, rotary_dim)
SHAPES = [(1, 4, 2, 64, 64), (6, 4, 2, 64, 32), (5, 3, 1, 128, 128), (4, 2, 2, 80, 40)]
if ON_GPU:
    SHAPES += [(300, 32, 8, 128, 128), (300, 32, 32, 128, 64)]


def _cos_sin_cache(rotary_dim: int) -> torch.Tensor:  # (MAX_POS, rotary_dim) = [cos | sin]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(MAX_POS).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize(("t", "hq", "hk", "head_size", "rotary_dim"), SHAPES)
def test_rotary_embedding_matches_reference(dtype, is_neox_style, t, hq, hk, head_size, rotary_dim):
    positions = torch.randint(0, MAX_POS, (t,)).to(DEVICE)
    query = torch.randn(t, hq * head_size).to(dtype).to(DEVICE)
    key = torch.randn(t, hk * head_size).to(dtype).to(DEVICE)
    cache = _cos_sin_cache(rotary_dim)
    expected_q, expected_k = rotary_embedding_ref(positions, query, key, head_size, cache, is_neox_style)
    q_in, k_in = query.clone(), key.clone()

    q_out, k_out = rotary_embedding(positions, q_in, k_in, head_size, cache, is_neox_style)

    assert q_out is q_in and k_out is k_in  # in place
    tol = ELEMENTWISE_TOL[dtype]
    assert_close(q_out, expected_q, tol)
    assert_close(k_out, expected_k, tol)
    # channels past rotary_dim pass through untouched
    pass_q = q_out.view(t, hq, head_size)[..., rotary_dim:]
    assert torch.equal(pass_q, query.view(t, hq, head_size)[..., rotary_dim:])


def test_rotary_embedding_rotates_views_of_fused_qkv_in_place():
    hq, hk, d = 4, 2, 64
    qkv = torch.randn(5, (hq + 2 * hk) * d, device=DEVICE)
    original = qkv.clone()
    query, key, _ = qkv.split([hq * d, hk * d, hk * d], dim=1)
    positions = torch.tensor([0, 3, 7, 100, 255], device=DEVICE)
    cache = _cos_sin_cache(d)
    expected_q, expected_k = rotary_embedding_ref(positions, query, key, d, cache, True)

    rotary_embedding(positions, query, key, d, cache, True)

    assert_close(qkv[:, : hq * d], expected_q, ELEMENTWISE_TOL[torch.float32])
    assert_close(qkv[:, hq * d: (hq + hk) * d], expected_k, ELEMENTWISE_TOL[torch.float32])
    assert torch.equal(qkv[:, (hq + hk) * d:], original[:, (hq + hk) * d:])  # V untouched


def test_rotary_embedding_takes_3d_head_views():
    t, d = 3, 32
    qkv = torch.randn(t, 4 * d, device=DEVICE)
    query = qkv[:, : 2 * d].unflatten(1, (2, d))  # (T, 2, D) with strided rows
    key = qkv[:, 2 * d: 3 * d].unflatten(1, (1, d))
    positions = torch.tensor([1, 5, 9], device=DEVICE)
    cache = _cos_sin_cache(d)
    expected_q, expected_k = rotary_embedding_ref(positions, query.flatten(1), key.flatten(1), d, cache, False)
    rotary_embedding(positions, query, key, d, cache, False)
    assert_close(qkv[:, : 2 * d], expected_q, ELEMENTWISE_TOL[torch.float32])
    assert_close(qkv[:, 2 * d: 3 * d], expected_k, ELEMENTWISE_TOL[torch.float32])


def test_rotary_embedding_position_zero_is_identity():
    query = torch.randn(1, 2 * 32, device=DEVICE)
    key = torch.randn(1, 32, device=DEVICE)
    q, k = rotary_embedding(torch.zeros(1, dtype=torch.int64, device=DEVICE), query.clone(), key.clone(), 32,
                            _cos_sin_cache(32), False)
    assert torch.equal(q, query) and torch.equal(k, key)


def test_rotary_embedding_rejects_rotary_dim_over_head_size():
    query = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="rotary_dim 64 must be even and at most head_size 32"):
        rotary_embedding(torch.zeros(2, dtype=torch.int64, device=DEVICE), query, query, 32,
                         _cos_sin_cache(64), True)

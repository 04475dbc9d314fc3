from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, DTYPES, ELEMENTWISE_TOL, ON_GPU, assert_close
from loom_platform_cuda.kernels import silu_and_mul
from loom_platform_cuda.kernels.reference import silu_and_mul_ref

SHAPES = [(1, 16), (5, 100), (3, 1500)] + ([(257, 11008)] if ON_GPU else [])  # (T, d); 1500 > one block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "d"), SHAPES)
def test_silu_and_mul_matches_reference(dtype, t, d):
    x = (3 * torch.randn(t, 2 * d)).to(dtype).to(DEVICE)
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), ELEMENTWISE_TOL[dtype])


def test_silu_and_mul_writes_into_out_from_a_strided_input():
    x = torch.randn(4, 2 * 64 + 8, device=DEVICE)[:, : 2 * 64]  # row stride > width
    out = torch.empty(4, 64, device=DEVICE)
    assert silu_and_mul(x, out=out) is out
    assert_close(out, silu_and_mul_ref(x), ELEMENTWISE_TOL[torch.float32])


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even last dimension"):
        silu_and_mul(torch.zeros(2, 7, device=DEVICE))


def test_silu_and_mul_keeps_leading_dims():
    x = torch.randn(2, 3, 2 * 40, device=DEVICE)
    out = silu_and_mul(x)
    assert out.shape == (2, 3, 40)
    assert_close(out, silu_and_mul_ref(x), ELEMENTWISE_TOL[torch.float32])

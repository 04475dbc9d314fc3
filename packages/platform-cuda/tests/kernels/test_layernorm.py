from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, DTYPES, ELEMENTWISE_TOL, ON_GPU, ROUNDING_TOL, assert_close
from loom_platform_cuda.kernels import rms_norm
from loom_platform_cuda.kernels.reference import rms_norm_ref

EPS = 1e-6
# (T, hidden, max_block): a small max_block forces the two-pass path for long rows
SHAPES = [(1, 64, 16384), (7, 96, 16384), (4, 1000, 16384), (3, 200, 64)]
if ON_GPU:
    SHAPES += [(513, 4096, 16384), (64, 8192, 1024)]


def _inputs(t: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = (2 * torch.randn(t, hidden)).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype).to(DEVICE)
    residual = torch.randn(t, hidden).to(dtype).to(DEVICE)
    return x, weight, residual


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "hidden", "max_block"), SHAPES)
def test_rms_norm_matches_reference(dtype, t, hidden, max_block):
    x, weight, _ = _inputs(t, hidden, dtype)
    out = rms_norm(x, weight, EPS, max_block=max_block)
    assert out.dtype == dtype
    assert_close(out, rms_norm_ref(x, weight, EPS), ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "hidden", "max_block"), SHAPES)
def test_fused_add_rms_norm_matches_reference(dtype, t, hidden, max_block):
    x, weight, residual = _inputs(t, hidden, dtype)
    out, res_out = rms_norm(x, weight, EPS, residual, max_block=max_block)
    expected_out, expected_res = rms_norm_ref(x, weight, EPS, residual)
    assert_close(out, expected_out, ELEMENTWISE_TOL[dtype])
    assert_close(res_out, expected_res, ROUNDING_TOL[dtype])  # one fp32 add, one rounding


@pytest.mark.parametrize("max_block", [16384, 64])
def test_fused_add_rms_norm_runs_in_place(max_block):
    x, weight, residual = _inputs(3, 200, torch.bfloat16)
    expected_out, expected_res = rms_norm_ref(x, weight, EPS, residual)
    out, res_out = rms_norm(x, weight, EPS, residual, out=x, residual_out=residual, max_block=max_block)
    assert out is x and res_out is residual
    assert_close(x, expected_out, ELEMENTWISE_TOL[torch.bfloat16])
    assert_close(residual, expected_res, ROUNDING_TOL[torch.bfloat16])


def test_rms_norm_rejects_wrong_weight_shape():
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.zeros(2, 8, device=DEVICE), torch.ones(4, device=DEVICE), EPS)


def test_rms_norm_rejects_integer_input():
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        rms_norm(torch.zeros(2, 8, dtype=torch.int64, device=DEVICE), torch.ones(8, device=DEVICE), EPS)


def test_rms_norm_keeps_leading_dims_and_takes_strided_rows():
    x = torch.randn(2, 3, 64, device=DEVICE)
    w = torch.randn(64, device=DEVICE)
    out = rms_norm(x, w, EPS)
    assert out.shape == x.shape
    assert_close(out, rms_norm_ref(x, w, EPS), ELEMENTWISE_TOL[torch.float32])
    fused = torch.randn(5, 3 * 64, device=DEVICE)
    rows = fused[:, 64:128]  # row stride 192
    assert_close(rms_norm(rows, w, EPS), rms_norm_ref(rows, w, EPS), ELEMENTWISE_TOL[torch.float32])

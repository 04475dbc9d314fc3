"""Tolerances per dtype: a few ulps of the output dtype, as a kernel that accumulates in fp32
and rounds once (or an interpreter that truncates instead of rounding) stays within."""

from __future__ import annotations

import pytest
import torch

__all__ = ["ATTENTION", "ELEMENTWISE", "MATMUL", "assert_close", "torch_dtype"]

ELEMENTWISE: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (2e-2, 2e-2),
}
"""(atol, rtol) of an elementwise or row-wise op against ``forward_native``."""

ATTENTION: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-4),
    "float16": (5e-3, 5e-3),
    "bfloat16": (3e-2, 3e-2),
}
"""(atol, rtol) of attention (a softmax and two matmuls) against the fp32 reference."""

MATMUL: dict[str, tuple[float, float]] = ATTENTION
"""(atol, rtol) of a matmul with outputs of order one (a quantized linear layer) against its
fp32 reference: a kernel may hold scales in the activations' dtype."""


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float], what: str,
                 allowance: torch.Tensor | None = None) -> None:
    """Fail with the worst element and what to fix; ``allowance``: an error each element may have
    on top of the tolerances (a documented rounding of the inputs)."""
    atol, rtol = tol
    actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
    if actual.shape != expected.shape:
        pytest.fail(f"{what}: shape {tuple(actual.shape)}, the reference's is {tuple(expected.shape)}")
    diff = (actual - expected).abs()
    bad = diff > atol + rtol * expected.abs() + (0 if allowance is None else allowance.float().cpu())
    if bad.any() or not torch.isfinite(actual).all():
        worst = int(torch.nan_to_num(diff, nan=float("inf")).argmax())
        pytest.fail(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements differ from the reference beyond "
            f"atol={atol}, rtol={rtol}; worst at flat index {worst}: {actual.flatten()[worst].item():.6g} vs "
            f"{expected.flatten()[worst].item():.6g}"
        )

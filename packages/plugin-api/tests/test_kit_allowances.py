"""The conformance kit's allowance for ``quantized_linear`` kernels that round x to 8 bits per
group of 32 (``KERNEL_SIGNATURES``): it admits exactly that rounding and not a wrong kernel."""

from __future__ import annotations

import pytest
import torch
from loom_plugin_api import ops
from loom_plugin_api.testing._tolerances import MATMUL, assert_close
from loom_plugin_api.testing.test_ops import ALLOWANCES, CASES


def _round_x(x: torch.Tensor) -> torch.Tensor:
    """x rounded to 8 bits per group of 32, as the signature allows, back in fp32."""
    g = x.float().view(*x.shape[:-1], -1, 32)
    step = g.abs().amax(-1, keepdim=True) / 127
    q = torch.round(g / torch.where(step > 0, step, torch.ones_like(step)))
    return (q * step).view(x.shape)


def _cases():
    return CASES["quantized_linear"](torch.float32, "cpu", torch.Generator().manual_seed(0))


def test_x_rounded_to_8_bits_passes_and_the_allowance_is_needed():
    needed = 0
    for op, args in _cases():
        x, bias = args[0], (args[1] if len(args) > 1 else None)
        expected = ops.QuantizedLinear.forward_native(op, x, bias)
        rounded = ops.QuantizedLinear.forward_native(op, _round_x(x), bias)
        assert_close(rounded, expected, MATMUL["float32"], "x rounded", ALLOWANCES["quantized_linear"](op, args))
        diff = (rounded - expected).abs()
        needed += int((diff > MATMUL["float32"][0] + MATMUL["float32"][1] * expected.abs()).any())
    assert needed  # without the allowance the tolerances alone would refuse the rounding


def test_a_wrong_kernel_still_fails():
    op, args = next((op, args) for op, args in _cases() if args[0].shape[0] == 33)
    expected = ops.QuantizedLinear.forward_native(op, *args)
    wrong = ops.QuantizedLinear.forward_native(op, args[0] * 1.05, *args[1:])  # 5% off: not a rounding
    with pytest.raises(pytest.fail.Exception, match="differ from the reference"):
        assert_close(wrong, expected, MATMUL["float32"], "wrong", ALLOWANCES["quantized_linear"](op, args))

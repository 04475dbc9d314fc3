from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, DTYPES, ON_GPU, assert_close
from loom_platform_cuda.kernels import prepare_quantized_linear, quantized_linear
from loom_platform_cuda.kernels.reference import quantized_linear_ref
from loom_plugin_api.ops.quantized_linear import QuantizedWeight

# (M, N, K): one row (decode), a few, and more rows than one block; N off the block size.
SHAPES = [(1, 48, 128), (5, 100, 256), (33, 64, 128)] + ([(300, 4096, 4096), (1, 11008, 4096)] if ON_GPU else [])

# Relative to the output's largest magnitude (atol) and per element (rtol). Half inputs multiply the
# weights rounded to their dtype (the interpreter truncates to bf16), and the output is rounded once.
MATMUL_TOL = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
}


def make_weight(n: int, k: int, bits: int, group_size: int) -> QuantizedWeight:
    """Random codes over the full range, small positive scales and zeros around 0, on DEVICE."""
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
    scale = torch.rand(n, k // group_size) * 0.02 + 0.001
    zero = torch.randn(n, k // group_size) * 0.01
    return QuantizedWeight(q, scale, zero, bits, group_size).to(DEVICE)


def check(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Run the kernel on ``x`` and compare it with the reference on the same ``x``."""
    out = quantized_linear(x, prepare_quantized_linear(weight, x.dtype), bias)
    expected = quantized_linear_ref(x, weight, bias)
    assert out.shape == expected.shape and out.dtype == x.dtype
    tol = MATMUL_TOL[x.dtype]
    assert_close(out, expected, (tol * float(expected.float().abs().max()), tol))
    return out


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_quantized_linear_matches_reference(m, n, k, bits, group_size, dtype, with_bias):
    weight = make_weight(n, k, bits, group_size)
    x = torch.randn(m, k).to(dtype).to(DEVICE)
    bias = torch.randn(n).to(dtype).to(DEVICE) if with_bias else None
    check(x, weight, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("k", "group_size"), [(96, 48), (80, 16)])  # groups off the K block; K off it too
def test_quantized_linear_takes_any_group_size_dividing_in(k, group_size, bits, dtype):
    weight = make_weight(40, k, bits, group_size)
    x = torch.randn(7, k).to(dtype).to(DEVICE)
    check(x, weight, torch.randn(40).to(dtype).to(DEVICE))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_linear_keeps_leading_dims(bits):
    weight = make_weight(48, 128, bits, 32)
    x = torch.randn(2, 3, 128, device=DEVICE)
    assert check(x, weight).shape == (2, 3, 48)


def test_quantized_linear_reads_a_strided_input():
    weight = make_weight(48, 64, 4, 32)
    x = torch.randn(5, 64 + 8, device=DEVICE)[:, :64]  # row stride > width
    check(x, weight)


def test_quantized_linear_takes_a_bias_in_another_dtype():
    weight = make_weight(48, 64, 8, 32)
    check(torch.randn(3, 64, device=DEVICE).to(torch.bfloat16), weight, torch.randn(48, device=DEVICE))


def test_four_bit_packing_round_trips():
    weight = make_weight(6, 64, 4, 32)
    packed = prepare_quantized_linear(weight, torch.float16)
    assert packed.codes.shape == (6, 32) and packed.codes.dtype == torch.uint8
    assert packed.codes.device == weight.qweight.device
    q = weight.qweight
    assert torch.equal(packed.codes & 0xF, q[:, 0::2])  # low nibble: even input column
    assert torch.equal(packed.codes >> 4, q[:, 1::2])  # high nibble: odd input column
    assert torch.equal(packed.unpack_codes(), q)
    assert (packed.bits, packed.group_size, packed.out_features, packed.in_features) == (4, 32, 6, 64)
    assert packed.scale.dtype == torch.float32 and torch.equal(packed.scale, weight.scale)


def test_eight_bit_codes_stay_as_they_are():
    weight = make_weight(6, 64, 8, 32)
    packed = prepare_quantized_linear(weight, torch.bfloat16)
    assert packed.codes.shape == (6, 64) and torch.equal(packed.unpack_codes(), weight.qweight)


def test_prepare_is_the_kernels_attribute():
    assert quantized_linear.prepare is prepare_quantized_linear


def test_the_contracts_op_runs_through_the_kernel(monkeypatch):
    from loom_plugin_api.custom_op import kernel_registry
    from loom_plugin_api.ops.quantized_linear import QuantizedLinear

    monkeypatch.setitem(kernel_registry, "quantized_linear", quantized_linear)
    weight = make_weight(48, 64, 4, 32)
    op = QuantizedLinear(weight, torch.float32)
    x = torch.randn(3, 64, device=DEVICE)
    assert_close(op.forward_cuda(x), quantized_linear_ref(x, weight), (1e-5, 1e-5))
    assert type(op.kernel_weight()).__name__ == "PackedQuantizedWeight"


def test_quantized_linear_rejects_a_wrong_input_width():
    packed = prepare_quantized_linear(make_weight(48, 64, 4, 32), torch.float32)
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 64\)"):
        quantized_linear(torch.zeros(2, 32, device=DEVICE), packed)


def test_quantized_linear_rejects_integer_input():
    packed = prepare_quantized_linear(make_weight(48, 64, 8, 32), torch.float32)
    with pytest.raises(ValueError, match="x has dtype torch.int32"):
        quantized_linear(torch.zeros(2, 64, dtype=torch.int32, device=DEVICE), packed)


def test_quantized_linear_rejects_a_wrong_bias_shape():
    packed = prepare_quantized_linear(make_weight(48, 64, 8, 32), torch.float32)
    with pytest.raises(ValueError, match="bias must be"):
        quantized_linear(torch.zeros(2, 64, device=DEVICE), packed, torch.zeros(47, device=DEVICE))


def test_quantized_linear_rejects_an_unprepared_weight():
    with pytest.raises(ValueError, match="PackedQuantizedWeight"):
        quantized_linear(torch.zeros(2, 64, device=DEVICE), make_weight(48, 64, 8, 32))  # type: ignore[arg-type]


def test_prepare_rejects_an_odd_input_width_at_four_bits():
    weight = QuantizedWeight(torch.zeros(4, 63, dtype=torch.uint8), torch.ones(4, 3), torch.zeros(4, 3), 4, 21)
    with pytest.raises(ValueError, match="input width must be even"):
        prepare_quantized_linear(weight, torch.float32)


def test_prepare_rejects_codes_over_the_bit_width():
    weight = QuantizedWeight(torch.full((4, 64), 16, dtype=torch.uint8), torch.ones(4, 2), torch.zeros(4, 2), 4, 32)
    with pytest.raises(ValueError, match="codes up to 16"):
        prepare_quantized_linear(weight, torch.float32)


def test_prepare_rejects_an_unsupported_dtype():
    with pytest.raises(ValueError, match="dtype"):
        prepare_quantized_linear(make_weight(4, 64, 8, 32), torch.int8)

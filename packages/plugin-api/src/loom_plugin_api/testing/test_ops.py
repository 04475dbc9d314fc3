"""Ops tier: every op the platform replaces against the contract's ``forward_native``.

An op is replaced by a class (``CustomOp.register_oot``: the in-tree class builds the
replacement, which runs the platform's forward method) or by a kernel
(``CustomOp.register_kernel``: the in-tree class's ``forward_cuda`` and ``forward_cpu`` call
it). Both are looked at after the general plugins ran and ``register_triton_kernel_overrides()``
was called, as in a worker process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from .. import ops
from ..custom_op import FORWARD_METHOD_BY_PLATFORM, KERNEL_SIGNATURES, kernel_registry, op_registry_oot
from ..platform import Platform
from ._platform import PlatformUnderTest
from ._tolerances import ELEMENTWISE, MATMUL, assert_close, torch_dtype

pytestmark = pytest.mark.ops

DTYPES = ("float32", "bfloat16", "float16")
NUM_TOKENS = (1, 7, 33)


def _rms_norm(dtype: torch.dtype, device: str, g: torch.Generator) -> list[tuple[Any, tuple[Any, ...]]]:
    cases = []
    for hidden in (64, 96, 1024):
        op = ops.RMSNorm(hidden, eps=1e-6, dtype=dtype)
        op.weight.data = torch.randn(hidden, generator=g).to(dtype)
        for t in NUM_TOKENS:
            x = torch.randn(t, hidden, generator=g).to(dtype)
            cases.append((op, (x,)))
            cases.append((op, (x, torch.randn(t, hidden, generator=g).to(dtype))))
    return cases


def _layer_norm(dtype: torch.dtype, device: str, g: torch.Generator) -> list[tuple[Any, tuple[Any, ...]]]:
    cases = []
    for hidden in (64, 96, 1024):
        op = ops.LayerNorm(hidden, eps=1e-5, dtype=dtype)
        op.weight.data = torch.randn(hidden, generator=g).to(dtype)
        op.bias.data = torch.randn(hidden, generator=g).to(dtype)
        cases += [(op, (torch.randn(t, hidden, generator=g).to(dtype),)) for t in NUM_TOKENS]
    return cases


def _rotary(dtype: torch.dtype, device: str, g: torch.Generator) -> list[tuple[Any, tuple[Any, ...]]]:
    cases = []
    for head_size, rotary_dim, neox in ((64, 64, True), (64, 64, False), (128, 64, True), (32, 32, True)):
        op = ops.RotaryEmbedding(head_size, rotary_dim, 512, 10000.0, is_neox_style=neox, dtype=dtype)
        for t in NUM_TOKENS:
            positions = torch.randint(0, 512, (t,), generator=g)
            q = torch.randn(t, 4 * head_size, generator=g).to(dtype)
            k = torch.randn(t, 2 * head_size, generator=g).to(dtype)
            cases.append((op, (positions, q, k)))
    return cases


def _silu_and_mul(dtype: torch.dtype, device: str, g: torch.Generator) -> list[tuple[Any, tuple[Any, ...]]]:
    op = ops.SiluAndMul()
    return [(op, (torch.randn(t, 2 * d, generator=g).to(dtype),)) for d in (64, 96, 1376) for t in NUM_TOKENS]


def _quantized_linear(dtype: torch.dtype, device: str, g: torch.Generator) -> list[tuple[Any, tuple[Any, ...]]]:
    """Codes, scales and zeros of 4- and 8-bit weights in groups of 32 and 128 (outputs of order one)."""
    cases = []
    for bits, group, out_features, in_features in ((4, 32, 96, 128), (4, 128, 48, 256), (8, 32, 64, 128),
                                                   (8, 128, 48, 256)):
        groups = (out_features, in_features // group)
        q = torch.randint(0, 2**bits, (out_features, in_features), generator=g, dtype=torch.uint8)
        scale = (torch.rand(groups, generator=g) + 0.5) * (0.2 if bits == 4 else 0.01)
        zero = torch.randn(groups, generator=g) * 0.05
        weight = ops.QuantizedWeight(q, scale, zero, bits, group).to(device)
        op = ops.QuantizedLinear(weight, dtype)
        for t in NUM_TOKENS:
            x = (torch.randn(t, in_features, generator=g) / in_features**0.5).to(dtype)
            cases.append((op, (x,)))
            cases.append((op, (x, torch.randn(out_features, generator=g).to(dtype))))
    return cases


def _lora(dtype: torch.dtype, device: str, g: torch.Generator) -> list[tuple[Any, tuple[Any, ...]]]:
    """Adapters of ranks 8 and 16 (zero-padded: a slot's unused rank rows are zeros) in 4 slots; rows
    with no adapter, every row on one slot, and a mix of slots in any order."""
    cases = []
    op = ops.BatchedLoRA()
    for slots, rank, in_features, out_features in ((4, 16, 64, 96), (4, 8, 128, 48), (2, 48, 96, 160)):
        a = (torch.randn(slots, rank, in_features, generator=g) / in_features**0.5)
        b = torch.randn(slots, out_features, rank, generator=g) / rank**0.5
        a[1, rank // 2:] = 0  # slot 1 holds a lower-rank adapter
        b[1, :, rank // 2:] = 0
        for t in NUM_TOKENS:
            x = torch.randn(t, in_features, generator=g).to(dtype)
            y = torch.randn(t, out_features, generator=g).to(dtype)
            mixed = torch.randint(-1, slots, (t,), generator=g)
            for token_slots in (mixed, torch.full((t,), slots - 1), torch.full((t,), -1)):
                mapping = ops.LoRAMapping.from_token_slots(token_slots.to(device))
                cases.append((op, (y, x, a.to(dtype), b.to(dtype), mapping)))
    return cases


CASES: dict[str, Callable[[torch.dtype, str, torch.Generator], list[tuple[Any, tuple[Any, ...]]]]] = {
    "rms_norm": _rms_norm,
    "layer_norm": _layer_norm,
    "rotary_embedding": _rotary,
    "silu_and_mul": _silu_and_mul,
    "quantized_linear": _quantized_linear,
    "lora": _lora,
}
TOLERANCES = {"quantized_linear": MATMUL, "lora": MATMUL}
"""Ops checked with other than ``ELEMENTWISE`` tolerances."""


def _int8_activation_allowance(op: Any, args: tuple[Any, ...]) -> torch.Tensor | None:
    """What ``KERNEL_SIGNATURES["quantized_linear"]`` lets a kernel add: x rounded to 8 bits per
    group of 32 inputs moves each input by at most half a step (the group's max|x| / 254), so an
    output by at most those half-steps times the weights' magnitudes (1% slack for fp32 sums)."""
    x = args[0].detach().float().cpu()
    w = op.weight.dequantize().float().cpu()
    if x.shape[-1] % 32:
        return None
    rows = x.reshape(-1, x.shape[-1])
    half = (rows.view(rows.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32)
    return (half.reshape(rows.shape) @ w.abs().t() * 1.01).view(*x.shape[:-1], w.shape[0])


ALLOWANCES: dict[str, Callable[[Any, tuple[Any, ...]], torch.Tensor | None]] = {
    "quantized_linear": _int8_activation_allowance,
}
"""Ops whose kernels may round their inputs as their signature documents."""


def _outputs(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _clone(a: Any) -> Any:
    return a.clone() if isinstance(a, torch.Tensor) else a


def _check(
    op_name: str, dtype_name: str, device: str, run: Callable[[Any, tuple[Any, ...]], Any], what: str
) -> None:
    in_tree = getattr(ops, ops.REPLACEABLE_OPS[op_name])
    g = torch.Generator().manual_seed(0)
    for i, (op, args) in enumerate(CASES[op_name](torch_dtype(dtype_name), device, g)):
        allowance = ALLOWANCES[op_name](op, args) if op_name in ALLOWANCES else None
        op = op.to(device)
        args = tuple(a.to(device) for a in args)
        # Clones: a kernel may work in place (the rotary and lora ones do).
        expected = _outputs(in_tree.forward_native(op, *map(_clone, args)))
        actual = _outputs(run(op, tuple(map(_clone, args))))
        if len(actual) != len(expected):
            pytest.fail(f"{what} returned {len(actual)} tensors, forward_native returns {len(expected)}")
        shapes = ", ".join(str(tuple(a.shape)) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)
        for j, (a, e) in enumerate(zip(actual, expected)):
            if a.dtype != e.dtype:
                pytest.fail(
                    f"{what} output {j} is {a.dtype}; forward_native's is {e.dtype} (keep the input dtype)"
                )
            assert_close(
                a,
                e,
                TOLERANCES.get(op_name, ELEMENTWISE)[dtype_name],
                f"{what} case {i} (inputs {shapes}, {dtype_name}) output {j} vs forward_native",
                allowance if j == 0 else None,
            )


def _dtype_or_skip(platform_cls: type[Platform], dtype: str) -> None:
    if dtype not in platform_cls.supported_dtypes:
        pytest.skip(f"{platform_cls.__qualname__}.supported_dtypes does not declare {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op_name", list(ops.REPLACEABLE_OPS))
def test_replaced_class_matches_forward_native(
    platform_in_this_process: Platform,
    platform_cls: type[Platform],
    loom_platform_under_test: PlatformUnderTest,
    op_name: str,
    dtype: str,
) -> None:
    class_name = ops.REPLACEABLE_OPS[op_name]
    replacement = op_registry_oot.get(class_name)
    if replacement is None:
        pytest.skip(f"the platform registers no replacement class for {class_name}")
    _dtype_or_skip(platform_cls, dtype)
    method = FORWARD_METHOD_BY_PLATFORM.get(platform_cls._enum, "forward_native")
    what = f"{replacement.__module__}.{replacement.__qualname__}.{method}"
    with torch.inference_mode():
        _check(
            op_name,
            dtype,
            loom_platform_under_test.device(),
            lambda op, args: getattr(op, method)(*args),
            what,
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op_name", [name for name in KERNEL_SIGNATURES if name in ops.REPLACEABLE_OPS])
def test_installed_kernel_matches_forward_native(
    platform_in_this_process: Platform,
    platform_cls: type[Platform],
    loom_platform_under_test: PlatformUnderTest,
    op_name: str,
    dtype: str,
) -> None:
    kernel = kernel_registry.get(op_name)
    if kernel is None:
        pytest.skip(f"the platform installs no {op_name} kernel")
    _dtype_or_skip(platform_cls, dtype)
    in_tree = getattr(ops, ops.REPLACEABLE_OPS[op_name])
    what = (
        f"kernel {op_name} ({getattr(kernel, '__module__', '?')}.{getattr(kernel, '__qualname__', kernel)})"
    )
    with torch.inference_mode():
        _check(
            op_name,
            dtype,
            loom_platform_under_test.device(),
            lambda op, args: in_tree.forward_cuda(op, *args),
            what,
        )


def _row_argmax_cases(dtype: torch.dtype, device: str, g: torch.Generator) -> list[torch.Tensor]:
    """Chunks of logits as greedy sampling gives them: rows of a width that is not a multiple of
    any vector, a tie (the first index must win), a row of -inf, one row alone."""
    x = torch.randn(5, 203, generator=g).to(dtype)
    x[1, 7] = x[1, 150] = x[1].max() + 1
    x[3] = float("-inf")
    wide = torch.randn(2, 4096, generator=g).to(dtype)
    return [t.to(device) for t in (x, x[2:3], wide)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_installed_row_argmax_matches_torch_max(
    platform_in_this_process: Platform,
    platform_cls: type[Platform],
    loom_platform_under_test: PlatformUnderTest,
    dtype: str,
) -> None:
    """``row_argmax`` is not an op class: it is checked against ``x.max(dim=-1)`` itself (the
    values exactly, as float32; the index of the first maximum). A kernel may refuse a chunk
    (None): greedy sampling then runs torch's max."""
    kernel = kernel_registry.get("row_argmax")
    if kernel is None:
        pytest.skip("the platform installs no row_argmax kernel")
    _dtype_or_skip(platform_cls, dtype)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for i, x in enumerate(_row_argmax_cases(torch_dtype(dtype), loom_platform_under_test.device(), g)):
            got = kernel(x)
            if got is None:
                continue
            values, indices = x.max(dim=-1)
            if got[0].dtype != torch.float32 or got[1].dtype != torch.int64:
                pytest.fail(f"row_argmax returned {got[0].dtype} values and {got[1].dtype} indices; "
                            "the contract says float32 and int64")
            if not (torch.equal(got[0].cpu(), values.float().cpu()) and torch.equal(got[1].cpu(), indices.cpu())):
                pytest.fail(f"row_argmax case {i} ({tuple(x.shape)}, {dtype}) differs from x.max(dim=-1): "
                            f"{got[1].tolist()} vs {indices.tolist()}")

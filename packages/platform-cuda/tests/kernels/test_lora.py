"""The batched LoRA kernels (shrink + expand) against the contract's ``BatchedLoRA.forward_native``."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, DTYPES, assert_close
from loom_platform_cuda.kernels import lora
from loom_plugin_api.ops import BatchedLoRA, LoRAMapping

# (rank, in, out): the rank under one 16-wide tile, one, and the largest tile; in and out off the
# 64-wide blocks (in=100: two input blocks, split over two programs for a few rows).
SHAPES = [(8, 40, 50), (16, 100, 70), (64, 96, 130)]
NUM_SLOTS = 4

# Relative to the output's largest magnitude (atol) and per element (rtol): the product is rounded
# to the output dtype and added (the interpreter truncates to bf16 where a GPU rounds).
MATMUL_TOL = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
}


def make_adapters(rank: int, k_in: int, n_out: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """NUM_SLOTS adapters ``(S, R, in)`` and ``(S, out, R)``; slot 1 a zero-padded adapter of half the rank."""
    a = torch.randn(NUM_SLOTS, rank, k_in) / k_in**0.5
    b = torch.randn(NUM_SLOTS, n_out, rank) / rank**0.5
    a[1, rank // 2:] = 0
    b[1, :, rank // 2:] = 0
    return a.to(dtype).to(DEVICE), b.to(dtype).to(DEVICE)


def check(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> None:
    """Run the kernel on ``y`` (in place) and compare with forward_native on a copy of it."""
    mapping = LoRAMapping.from_token_slots(token_slots.to(DEVICE))
    before = y.clone()
    expected = BatchedLoRA().forward_native(y.clone(), x, a, b, mapping)
    ptr = y.data_ptr()
    out = lora(y, x, a, b, mapping)
    assert out is y and y.data_ptr() == ptr and y.dtype == before.dtype
    none = mapping.token_slots < 0
    assert torch.equal(y[none], before[none]), "rows without an adapter changed"
    tol = MATMUL_TOL[y.dtype]
    assert_close(y, expected, (tol * float(expected.float().abs().max()), tol))


@pytest.mark.parametrize("pattern", ["mixed", "one_slot"])
@pytest.mark.parametrize("t", [1, 7, 33])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rank", "k_in", "n_out"), SHAPES)
def test_lora_matches_forward_native(rank, k_in, n_out, dtype, t, pattern):
    a, b = make_adapters(rank, k_in, n_out, dtype)
    x = torch.randn(t, k_in).to(dtype).to(DEVICE)
    y = torch.randn(t, n_out).to(dtype).to(DEVICE)
    if pattern == "mixed" and t == 1:
        token_slots = torch.tensor([1])  # the zero-padded slot
    elif pattern == "mixed":  # every slot and -1 (no adapter), in no order
        token_slots = torch.randint(-1, NUM_SLOTS, (t,))
        token_slots[:NUM_SLOTS + 1] = torch.randperm(NUM_SLOTS + 1) - 1
    else:
        token_slots = torch.full((t,), NUM_SLOTS - 1)
    check(y, x, a, b, token_slots)


def test_the_rank_intermediate_keeps_fp32_precision():
    """The expand multiplies the fp32 intermediate as a high and a low fp16 part: rounded once, the
    product is then fp16's rounding of the fp32 result nearly everywhere (0.6 with the high part alone)."""
    a, b = make_adapters(64, 96, 130, torch.float16)
    x = torch.randn(33, 96).to(torch.float16).to(DEVICE)
    y = torch.zeros(33, 130, dtype=torch.float16, device=DEVICE)
    mapping = LoRAMapping.from_token_slots(torch.randint(0, NUM_SLOTS, (33,)).to(DEVICE))
    want = BatchedLoRA().forward_native(y.clone(), x, a, b, mapping)
    lora(y, x, a, b, mapping)
    assert (y == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_tiles_a_rank_over_the_largest_tile(dtype):
    a, b = make_adapters(80, 72, 40, dtype)  # two rank tiles, the second a quarter full
    x = torch.randn(7, 72).to(dtype).to(DEVICE)
    check(torch.randn(7, 40).to(dtype).to(DEVICE), x, a, b, torch.tensor([3, -1, 0, 1, 3, 2, -1]))


def test_a_zero_padded_slot_is_the_lower_rank_adapter():
    a, b = make_adapters(16, 48, 24, torch.float32)
    x, y = torch.randn(5, 48, device=DEVICE), torch.zeros(5, 24, device=DEVICE)
    lora(y, x, a, b, LoRAMapping.from_token_slots(torch.full((5,), 1, device=DEVICE)))
    want = (x @ a[1, :8].T) @ b[1, :, :8].T
    assert_close(y, want, (1e-5, 1e-5))


def test_rows_without_an_adapter_are_left_exactly():
    dtype = torch.bfloat16
    a, b = make_adapters(16, 40, 24, dtype)
    y = torch.randn(33, 24).to(dtype).to(DEVICE)
    before = y.clone()
    lora(y, torch.randn(33, 40).to(dtype).to(DEVICE), a, b,
         LoRAMapping.from_token_slots(torch.full((33,), -1, device=DEVICE)))
    assert torch.equal(y, before)


def test_lora_writes_into_strided_rows():
    a, b = make_adapters(8, 40, 24, torch.float32)
    wide = torch.randn(7, 24 + 16, device=DEVICE)  # y: the first 24 columns, row stride 40
    x = torch.randn(7, 40 + 8, device=DEVICE)[:, :40]
    untouched = wide[:, 24:].clone()
    check(wide[:, :24], x, a, b, torch.tensor([0, 1, -1, 2, 3, 0, 1]))
    assert torch.equal(wide[:, 24:], untouched)


def test_lora_takes_adapters_in_fp32_for_half_activations():
    a, b = make_adapters(16, 40, 24, torch.float32)
    x = torch.randn(7, 40).to(torch.bfloat16).to(DEVICE)
    check(torch.randn(7, 24).to(torch.bfloat16).to(DEVICE), x, a, b, torch.tensor([0, 1, -1, 2, 3, 0, 1]))


def test_lora_with_no_rows_returns_y():
    a, b = make_adapters(8, 40, 24, torch.float32)
    y = torch.zeros(0, 24, device=DEVICE)
    mapping = LoRAMapping.from_token_slots(torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert lora(y, torch.zeros(0, 40, device=DEVICE), a, b, mapping) is y


def test_the_contracts_op_runs_through_the_kernel(monkeypatch):
    from loom_plugin_api.custom_op import kernel_registry

    monkeypatch.setitem(kernel_registry, "lora", lora)
    a, b = make_adapters(16, 40, 24, torch.float32)
    x, y = torch.randn(7, 40, device=DEVICE), torch.randn(7, 24, device=DEVICE)
    mapping = LoRAMapping.from_token_slots(torch.tensor([2, -1, 0, 2, 1, 3, -1], device=DEVICE))
    want = BatchedLoRA().forward_native(y.clone(), x, a, b, mapping)
    assert BatchedLoRA().forward_cuda(y, x, a, b, mapping) is y
    assert_close(y, want, (1e-5, 1e-5))


def _args(t: int = 3, k_in: int = 40, n_out: int = 24) -> dict:
    a, b = make_adapters(8, k_in, n_out, torch.float32)
    return dict(y=torch.zeros(t, n_out, device=DEVICE), x=torch.zeros(t, k_in, device=DEVICE), lora_a=a, lora_b=b,
                mapping=LoRAMapping.from_token_slots(torch.zeros(t, dtype=torch.int64, device=DEVICE)))


@pytest.mark.parametrize(("change", "message"), [
    (dict(x=torch.zeros(3, 40, dtype=torch.bfloat16)), "x must have y's dtype"),
    (dict(x=torch.zeros(3, 32)), r"lora_a must be \(slots, rank, 32\)"),
    (dict(x=torch.zeros(4, 40)), "y and x must be"),
    (dict(lora_b=torch.zeros(4, 24, 16)), r"lora_b must be \(4, 24, 8\)"),
    (dict(y=torch.zeros(3, 24, dtype=torch.int32)), "y has dtype torch.int32"),
    (dict(mapping=LoRAMapping.from_token_slots(torch.zeros(2, dtype=torch.int64))), "one slot per row"),
    (dict(mapping=torch.zeros(3, dtype=torch.int64)), "mapping must be a LoRAMapping"),
])
def test_lora_rejects_bad_arguments(change, message):
    args = _args()
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in change.items()})
    with pytest.raises(ValueError, match=message):
        lora(**args)

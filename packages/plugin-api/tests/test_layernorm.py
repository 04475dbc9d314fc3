"""LayerNorm: ``forward_native`` is the fp32 reference; the CPU and CUDA paths run torch's kernel on
half-precision tensors as they are, which must give the reference's answer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loom_plugin_api.ops import layernorm
from loom_plugin_api.ops.layernorm import LayerNorm


@pytest.fixture
def calls(monkeypatch) -> list[torch.dtype]:
    """The input dtype of every ``F.layer_norm`` call the op makes."""
    seen: list[torch.dtype] = []
    original = F.layer_norm

    def layer_norm(x, *args, **kwargs):
        seen.append(x.dtype)
        return original(x, *args, **kwargs)

    monkeypatch.setattr(layernorm.F, "layer_norm", layer_norm)
    return seen


def _layer_norm(dtype: torch.dtype, affine: bool = True) -> LayerNorm:
    torch.manual_seed(0)
    ln = LayerNorm(768, eps=1e-5, elementwise_affine=affine, dtype=dtype)
    if affine:
        with torch.no_grad():
            ln.weight.copy_(torch.randn(768) * 0.1 + 1)
            ln.bias.copy_(torch.randn(768) * 0.1)
    return ln


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_cpu_path_gives_the_fp32_reference_without_converting(calls, dtype, affine):
    """Up to the order of the fp32 sums: at most one unit in the last place, almost never."""
    ln = _layer_norm(dtype, affine)
    x = (torch.randn(64, 768) * 3 + 1).to(dtype)
    want = ln.forward_native(x)
    got = ln.forward_cpu(x)
    assert calls == [torch.float32, dtype]  # the reference converts; the CPU path does not
    assert got.dtype == dtype
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got != want).float().mean() < 1e-3


def test_parameters_of_another_dtype_take_the_reference(calls):
    """A bias (or weight) a loader left in another dtype than the input's: the fp32 reference."""
    ln = _layer_norm(torch.bfloat16)
    ln.bias.data = ln.bias.data.float()
    x = torch.randn(4, 768).to(torch.bfloat16)
    torch.testing.assert_close(ln.forward_cpu(x), ln.forward_native(x), rtol=0, atol=0)
    assert calls == [torch.float32, torch.float32]

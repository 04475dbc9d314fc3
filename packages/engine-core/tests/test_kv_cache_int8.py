"""The torch SDPA backend over an 8-bit KV cache (``--kv-cache-dtype int8``): what it writes,
what a step computes from it, and how the CPU platform and the contract choose it. The kernels
themselves are tested in ``test_kv_int8.py``."""

from __future__ import annotations

import pytest
import torch
from loom.attention.backends import kv_int8, native
from loom.attention.backends.torch_sdpa import TorchSDPAImpl
from loom.attention.backends.torch_sdpa_int8 import TorchSDPAInt8Backend, TorchSDPAInt8Impl
from loom.config.cache import CacheConfig
from loom.platforms.cpu import CpuPlatform
from loom.platforms.cpu_features import cpu_flags
from loom_plugin_api import AttentionBackend, AttentionSelectorConfig
from test_cpu_paged_decode import _mixed_step

H, HK, D = 6, 2, 64


def _caches(g: torch.Generator, num_blocks: int, block_size: int, dtype: torch.dtype):
    """A cache of the model's dtype holding random cached prefixes, and the int8 cache of the same K/V."""
    dense = torch.randn(2, num_blocks, block_size, HK, D, generator=g).to(dtype)
    rows = kv_int8.quantize_rows(dense.reshape(-1, HK * D), HK, D)
    return dense, rows.view(2, num_blocks, block_size, kv_int8.row_bytes(HK, D))


def _step_inputs(g: torch.Generator, T: int, dtype: torch.dtype):
    return [torch.randn(T, n * D, generator=g).to(dtype) for n in (H, HK, HK)]


def _kernel_here() -> bool:
    return kv_int8.int8_kv() is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_step_over_the_int8_cache_tracks_the_dense_cache(monkeypatch, dtype):
    """Two decodes, a chunk after a cached prefix and a fresh chunk: the same step over the int8
    cache as over the dense one, within what rounding K/V to 8 bits moves (a fresh chunk attends
    to its own unrounded K/V: there the two agree to the dense backend's own precision); the
    step's K/V land in the cache as ``quantize_rows`` makes them. The dense backend's prefills
    take torch's SDPA here, as the int8 backend's do (not the chunk prefill kernels, which read a
    cache in the model's dtype: tests of their own in test_cpu_prefill_amx.py and _f32.py; nor the
    AVX512-BF16 decode kernel's prefill rows, test_cpu_paged_decode.py's)."""
    if native.paged_decode() is not None:
        monkeypatch.setattr(native.paged_decode(), "amx_prefill", False)
        monkeypatch.setattr(native.paged_decode(), "f32_prefill", False)
        monkeypatch.setattr(native.paged_decode(), "takes_prefill", lambda *shape: False)
    g = torch.Generator().manual_seed(11)
    md, num_blocks = _mixed_step(g)
    dense, int8 = _caches(g, num_blocks, md.block_size, dtype)
    q, k, v = _step_inputs(g, md.num_tokens, dtype)
    want = TorchSDPAImpl(H, D, D**-0.5, HK).forward(None, q, k, v, dense, md)
    md.scratch.clear()
    got = TorchSDPAInt8Impl(H, D, D**-0.5, HK).forward(None, q, k, v, int8, md)
    fresh = slice(md.num_tokens - 4, md.num_tokens)  # the last request: 4 tokens, no prefix
    assert torch.equal(got[fresh], want[fresh])  # its own K/V, as computed: the same call, the same result
    err = (got.float() - want.float()).abs().max().item()
    assert 0 < err < 0.04, f"int8 K/V moved the step's output by {err}"  # 0.016-0.023 measured
    rows = int8.view(2, -1, kv_int8.row_bytes(HK, D))
    assert torch.equal(rows[0][md.slot_mapping], kv_int8.quantize_rows(k, HK, D))
    assert torch.equal(rows[1][md.slot_mapping], kv_int8.quantize_rows(v, HK, D))


@pytest.mark.skipif("avx512_vnni" not in cpu_flags(), reason="the int8 kernel needs AVX512-VNNI")
def test_the_int8_kernel_and_the_torch_path_agree():
    """bf16, head size 64: decode rows through the compiled kernel, and the same step with the
    kernel taken away (quantize in torch, gather and dequantize, SDPA): the same cache bytes, the
    same outputs within bf16 and the kernel's 16-bit query."""
    assert _kernel_here(), "the CPU has AVX512-VNNI: the int8 kernel must build and pass its self-check"
    g = torch.Generator().manual_seed(12)
    md, num_blocks = _mixed_step(g)
    _, cache = _caches(g, num_blocks, md.block_size, torch.bfloat16)
    cache2 = cache.clone()
    q, k, v = _step_inputs(g, md.num_tokens, torch.bfloat16)
    fast = TorchSDPAInt8Impl(H, D, D**-0.5, HK)
    assert fast.decodes_in_kernel(torch.bfloat16) and not fast.decodes_in_kernel(torch.float32)
    slow = TorchSDPAInt8Impl(H, D, D**-0.5, HK)
    slow._int8 = None
    assert not slow.decodes_in_kernel(torch.bfloat16)
    out = fast.forward(None, q, k, v, cache, md)
    md.scratch.clear()
    want = slow.forward(None, q, k, v, cache2, md)
    assert torch.equal(cache, cache2)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


def test_the_cpu_platform_picks_the_int8_backend_and_refuses_others():
    def ask(kv_cache_dtype):
        sel = AttentionSelectorConfig(head_size=D, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype, block_size=16)
        return CpuPlatform.get_attn_backend_cls(None, sel, H)

    assert ask("auto").endswith("TorchSDPABackend")
    assert ask("int8") == f"{TorchSDPAInt8Backend.__module__}.{TorchSDPAInt8Backend.__qualname__}"
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 is not available on CPU"):
        ask("fp8")
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, int8"):
        CacheConfig(kv_cache_dtype="fp8")


def test_the_int8_backend_lays_out_rows_of_codes_and_scales():
    assert TorchSDPAInt8Backend.get_kv_cache_shape(10, 16, HK, D) == (2, 10, 16, HK * (D + 4))
    assert TorchSDPAInt8Backend.get_kv_cache_dtype(torch.bfloat16, "int8") == torch.uint8
    with pytest.raises(ValueError, match="int8 KV cache"):
        TorchSDPAInt8Backend.get_kv_cache_dtype(torch.bfloat16, "auto")


def test_a_backend_without_a_quantized_cache_refuses_one_by_default():
    """What every platform's backend inherits from the contract (the dummy and CUDA platforms'
    among them): its own dtype for auto, and a message naming the flag for anything else."""

    class Plain(AttentionBackend):
        name = "PLAIN"

        @staticmethod
        def get_impl_cls():
            raise NotImplementedError

    assert Plain.get_kv_cache_dtype(torch.float16, "auto") == torch.float16
    with pytest.raises(ValueError, match=r"PLAIN attention backend .* --kv-cache-dtype int8 is not supported"):
        Plain.get_kv_cache_dtype(torch.float16, "int8")

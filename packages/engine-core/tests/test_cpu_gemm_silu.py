"""A gated MLP's gate/up GEMM and SiLU-and-mul in one pass of loom's bf16 GEMM
(``PanelGemm.silu_and_mul``, ``panel_linear_silu_bf16`` in ``platforms/cpu_gemm.c``) and where the
Llama MLP takes it: always the bits of the two ops it replaces."""

from __future__ import annotations

import pytest
import torch
from loom import envs, platforms
from loom.layers import onednn
from loom.layers.linear import MergedColumnParallelLinear
from loom.model_loader import get_model
from loom.models.llama import LlamaMLP
from loom.platforms import cpu_features, cpu_gemm
from loom.platforms.cpu_kernels import install, kernels
from loom_plugin_api.custom_op import kernel_registry
from model_utils import install_quantized_kernel, make_config, run_prefill

BF16 = {"avx512f", "avx512bw", "avx512_bf16"} <= cpu_features.cpu_flags()
# where bf16 layers hold panels (test_onednn_prepack.py): the CPU platform, AVX512-BF16 without AMX
PANELS_BF16 = (platforms.current_platform.is_cpu()
               and onednn.panels_for(torch.bfloat16, cpu_features.cpu_flags()))


@pytest.fixture(autouse=True)
def _live_envs():
    envs._disable_envs_cache_for_tests()


@pytest.fixture
def k():
    """The compiled kernels with the bf16 GEMM: on an AVX512-BF16 CPU they must be there (fails, never
    skips); installed behind the ops as a worker has them, the registry restored afterwards."""
    if not BF16:
        pytest.skip("this CPU has no AVX512-BF16: the bf16 kernel is compiled out")
    found = kernels()
    assert found is not None and found.panel_linear is not None
    assert found.panel_linear.gated_dtypes == {torch.bfloat16}
    saved = dict(kernel_registry)
    install()
    install_quantized_kernel()
    yield found
    kernel_registry.clear()
    kernel_registry.update(saved)


def _two_ops(k, x, panels, bias):
    return k.silu_and_mul(k.panel_linear(x, panels, bias))


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64, 193, 400])
@pytest.mark.parametrize("with_bias", [True, False])
def test_one_pass_gives_the_bits_of_the_gemm_then_silu_and_mul(k, rows, with_bias):
    """Every sliver size and row blocks whole and in part; 1 to 96 gate panels (3: an odd count,
    so pairs are gate and up panels, never two gate panels); K of 4 to 576 pairs; rows with a
    stride wider than K."""
    g = torch.Generator().manual_seed(rows)
    for n, kk in [(32, 8), (96, 300), (192, 64), (3072, 576)]:
        x = torch.randn(rows, kk + 6, generator=g).bfloat16()[:, 2:kk + 2]
        w = (torch.randn(n, kk, generator=g) / kk ** 0.5).bfloat16()
        b = torch.randn(n, generator=g).bfloat16() if with_bias else None
        panels = cpu_gemm.to_panels(w)
        got = k.panel_linear.silu_and_mul(x, panels, b)
        assert got is not None and got.shape == (rows, n // 2) and got.dtype == torch.bfloat16
        assert torch.equal(got, _two_ops(k, x, panels, b)), (n, kk)


def test_threads_leading_dims_and_special_values(k):
    """A row's bits do not depend on the thread count or what shares its call; (batch, seq, K)
    comes back in that shape; an infinity or NaN in x reaches only its row."""
    g = torch.Generator().manual_seed(3)
    gemm = k.panel_linear
    panels = cpu_gemm.to_panels((torch.randn(1056, 200, generator=g) / 15).bfloat16())  # 33 gate panels
    x = torch.randn(300, 200, generator=g).bfloat16()
    whole = gemm.silu_and_mul(x, panels)
    assert torch.equal(whole, _two_ops(k, x, panels, None))
    threads = torch.get_num_threads()
    try:
        for t in (1, 3, 16):
            torch.set_num_threads(t)
            assert torch.equal(gemm.silu_and_mul(x, panels), whole), t
    finally:
        torch.set_num_threads(threads)
    for i in (0, 7, 8, 299):
        assert torch.equal(gemm.silu_and_mul(x[i:i + 1], panels)[0], whole[i]), i
    got = gemm.silu_and_mul(x[:18].view(2, 9, 200), panels)
    assert got.shape == (2, 9, 528) and torch.equal(got.view(18, 528), whole[:18])
    y = x[:8].clone()
    y[3, 7], y[5, 0] = float("inf"), float("nan")
    out = gemm.silu_and_mul(y, panels)
    assert out[5].isnan().all() and not out[[0, 1, 2, 4, 6, 7]].isnan().any()
    assert torch.equal(out[[0, 1, 2, 4, 6, 7]], whole[[0, 1, 2, 4, 6, 7]])


def test_what_it_does_not_take_is_left_to_the_two_ops(k):
    """None (the caller runs the GEMM, then the activation) for a half width that is not whole
    panels, fp32 panels, an x of another dtype or a bias the GEMM would hand to F.linear."""
    gemm = k.panel_linear
    w = torch.randn(96, 64).bfloat16()
    x = torch.randn(5, 64).bfloat16()
    assert gemm.silu_and_mul(x, cpu_gemm.to_panels(torch.randn(48, 64).bfloat16())) is None  # 24 + 24
    assert gemm.silu_and_mul(x.float(), cpu_gemm.to_panels(w)) is None
    assert gemm.silu_and_mul(x, cpu_gemm.to_panels(w), torch.randn(96)) is None  # an fp32 bias
    assert gemm.silu_and_mul(x, cpu_gemm.to_panels(w), torch.randn(95).bfloat16()) is None
    if torch.float32 in gemm.dtypes:
        assert gemm.silu_and_mul(x.float(), cpu_gemm.to_panels(w.float())) is None


def test_the_self_check_finds_a_wrong_gated_pass(k):
    """``kernels()`` checks the pass against the two ops at load; a pass off by a bit fails it."""
    gemm = k.panel_linear

    class Wrong:
        dtypes, gated_dtypes = gemm.dtypes, gemm.gated_dtypes

        def __call__(self, x, panels, bias=None):
            return gemm(x, panels, bias)

        def silu_and_mul(self, x, panels, bias=None):
            out = gemm.silu_and_mul(x, panels, bias)
            out.view(torch.int16)[-1, -1] ^= 1  # the last element's lowest bit
            return out

    cpu_gemm.self_check(gemm, k.silu_and_mul)
    with pytest.raises(Exception, match="SiLU-and-mul differs"):
        cpu_gemm.self_check(Wrong(), k.silu_and_mul)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("llama"))
    LlamaForCausalLM(LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)).save_pretrained(path)
    return path


PROMPTS = [list(range(100, 140)), [5, 17, 900, 3, 42, 999, 0, 8, 9, 10]]


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_the_llama_mlp_runs_one_pass_with_the_two_ops_bits(k, llama_dir, quantization, monkeypatch):
    """Where bf16 layers hold panels, a Llama model's MLPs take the one pass (dense weights, and a
    quantized layer's batches, which go through its dense copy), and the logits are the bits of
    the model with ``LOOM_CPU_FUSED_MLP=0``; elsewhere (another platform, AMX CPUs) nothing takes it."""
    calls = []
    gated = cpu_gemm.PanelGemm.silu_and_mul

    def counted(self, *a, **kw):
        out = gated(self, *a, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_gemm.PanelGemm, "silu_and_mul", counted)
    models = {}
    for env in ("1", "0"):
        monkeypatch.setenv("LOOM_CPU_FUSED_MLP", env)
        models[env] = get_model(make_config(llama_dir, dtype="bfloat16", quantization=quantization))
    mlps = [m for m in models["1"].modules() if isinstance(m, LlamaMLP)]
    # only where SiluAndMul runs the CPU platform's kernel (another platform's op runs forward_oot)
    assert len(mlps) == 2 and all(m.fused == platforms.current_platform.is_cpu() for m in mlps)
    assert not any(m.fused for m in models["0"].modules() if isinstance(m, LlamaMLP))
    fused = run_prefill(models["1"], PROMPTS)
    assert calls == ([True, True] if PANELS_BF16 else [])  # a call a layer: one step
    calls.clear()
    for a, b in zip(fused, run_prefill(models["0"], PROMPTS)):
        assert torch.equal(a, b)
    assert not calls


def test_a_layer_with_lora_slots_or_unequal_outputs_declines(k, monkeypatch):
    """Adapters add to gate and up before the activation: a layer with LoRA slots runs the two
    ops; so does a merged layer of other than two equal outputs, or one whose weight is not in
    panels."""
    from loom.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "_TP", parallel_state.TensorParallelGroup(world_size=1, rank=0))
    x = torch.randn(5, 64).bfloat16()
    layer = MergedColumnParallelLinear(64, [48, 48], bias=False, params_dtype=torch.bfloat16)
    assert layer.silu_and_mul(x) is None  # a dense weight
    if PANELS_BF16:
        layer.weight = torch.nn.Parameter(cpu_gemm.to_panels(torch.randn(96, 64).bfloat16()), requires_grad=False)
        assert torch.equal(layer.silu_and_mul(x), k.silu_and_mul(layer(x)))
    layer.lora = torch.nn.Identity()
    assert layer.silu_and_mul(x) is None
    assert MergedColumnParallelLinear(64, [32, 64], bias=False).silu_and_mul(x) is None

"""loom's own GEMM (``platforms/cpu_gemm.c``: fp32 for AVX2 CPUs, bf16 for AVX512-BF16 ones) and where
``layers/onednn.py`` uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loom import envs, platforms
from loom.attention.backends import native
from loom.layers import onednn
from loom.platforms import cpu_features, cpu_gemm
from loom.platforms.cpu_kernels import kernels

AVX2 = {"avx2", "fma"} <= cpu_features.cpu_flags()
BF16 = {"avx512f", "avx512bw", "avx512_bf16"} <= cpu_features.cpu_flags()


@pytest.fixture(autouse=True)
def _live_envs():
    envs._disable_envs_cache_for_tests()


@pytest.fixture
def gemm() -> cpu_gemm.PanelGemm:
    """The compiled kernel: on an AVX2 + FMA CPU it must be there (fails, never skips)."""
    if not AVX2:
        pytest.skip("this CPU has no AVX2 and FMA: the kernel is compiled out")
    k = kernels()
    assert k is not None and k.panel_linear is not None
    return k.panel_linear


@pytest.fixture
def gemm_bf16() -> cpu_gemm.PanelGemm:
    """The compiled kernel with its bf16 half: on an AVX512-BF16 CPU it must be there (fails, never skips)."""
    if not BF16:
        pytest.skip("this CPU has no AVX512-BF16: the bf16 kernel is compiled out")
    k = kernels()
    assert k is not None and k.panel_linear is not None and torch.bfloat16 in k.panel_linear.dtypes
    return k.panel_linear


def test_compiled_where_the_cpu_has_avx2_and_fma():
    k = kernels()
    assert k is not None
    assert (k.panel_linear is not None) == (AVX2 or BF16)
    dtypes = set() if k.panel_linear is None else k.panel_linear.dtypes
    assert (torch.float32 in dtypes) == AVX2 and (torch.bfloat16 in dtypes) == BF16


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 64, 191, 192, 193, 400])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_a_float64_reference(gemm, rows, with_bias):
    """Every sliver size (1-6 rows and their tails), row blocks of 192 whole and in part, K not a
    multiple of 8 and past a block of 256, rows with a stride wider than K; the error within the
    worst case of fp32 sums in any order (``within_rounding``), and never 4x F.linear's plus a
    few units in the last place of the output's scale."""
    g = torch.Generator().manual_seed(rows)
    for n, k in [(16, 8), (48, 300), (96, 576), (512, 40)]:  # (512: 32 panels, split by panel on <= 4 threads)
        x = torch.randn(rows, k + 5, generator=g)[:, 2:k + 2]
        w = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if with_bias else None
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        got = gemm(x, cpu_gemm.to_panels(w), b)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert cpu_gemm.within_rounding(got, x, w, b), (n, k)
        err, torch_err = ((y.double() - ref).abs().max().item() for y in (got, F.linear(x, w, b)))
        assert err <= 4 * torch_err + 8 * 2.0 ** -24 * ref.abs().max().item(), (n, k, err, torch_err)


def test_leading_dims_threads_and_special_values(gemm):
    """(batch, seq, K) inputs come back in that shape; one thread or many, the same sums; an
    infinity or NaN in x reaches exactly the outputs of its row."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(64, 40, generator=g), torch.randn(64, generator=g)
    panels = cpu_gemm.to_panels(w)
    x = torch.randn(2, 9, 40, generator=g)
    got = gemm(x, panels, b)
    assert got.shape == (2, 9, 64)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    threads = torch.get_num_threads()
    rows = torch.randn(700, 40, generator=g)  # 4 row blocks x 4 panels: units split unevenly
    wide = cpu_gemm.to_panels(torch.randn(512, 40, generator=g))  # 32 panels: split by panel on <= 4 threads
    want = gemm(rows, panels, b), gemm(rows, wide)
    try:
        for n in (1, 3, 5, 16):  # more threads than units too (x: 4 units)
            torch.set_num_threads(n)
            assert torch.equal(gemm(x, panels, b), got) and torch.equal(gemm(rows, panels, b), want[0]), n
            assert torch.equal(gemm(rows, wide), want[1]), n
    finally:
        torch.set_num_threads(threads)  # each output is one unit's sum in one order
    x = torch.randn(8, 40, generator=g)
    x[3, 7], x[5, 0] = float("inf"), float("nan")
    y = gemm(x, panels, None)
    assert y[5].isnan().all() and not y[[0, 1, 2, 4, 6, 7]].isnan().any() and not y[3].isfinite().any()
    assert gemm(torch.empty(0, 40), panels).shape == (0, 64)


def test_a_row_gets_the_same_bits_whatever_shares_its_call(gemm):
    """Each output is one sum over K in one order, whatever the other rows (alone, in a sliver of
    6, in a block of 192 or past it, at any place): a request's result does not depend on what
    else its step holds (oneDNN's and MKL's may, with the batch size)."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 300, generator=g), torch.randn(96, generator=g)
    panels = cpu_gemm.to_panels(w)
    x = torch.randn(400, 300, generator=g)
    whole = gemm(x, panels, b)
    for i in (0, 5, 191, 192, 399):
        assert torch.equal(gemm(x[i:i + 1], panels, b)[0], whole[i]), i
        assert torch.equal(gemm(x[max(i - 3, 0):i + 4], panels, b)[min(i, 3)], whole[i]), i


def test_any_torch_default_dtype_and_any_row_layout(gemm):
    """The output is float32 whatever torch's default dtype (the kernel writes fp32); a transposed
    x (its rows not unit-stride), a 1-D x and a broadcast x give F.linear's result."""
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(32, 24, generator=g), torch.randn(32, generator=g)
    panels = cpu_gemm.to_panels(w)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        got = gemm(torch.randn(3, 24, generator=g, dtype=torch.float32), panels, b)
    finally:
        torch.set_default_dtype(default)
    assert got.dtype == torch.float32 and got.shape == (3, 32)
    for x in (torch.randn(24, 7, generator=g).t(), torch.randn(24, generator=g), torch.randn(1, 24).expand(5, 24)):
        torch.testing.assert_close(gemm(x, panels, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_a_weight_not_made_by_to_panels_is_refused(gemm):
    """A view, another dtype or shape: a clear error, never a wrong product."""
    panels = cpu_gemm.to_panels(torch.randn(32, 24))
    x = torch.randn(2, 24)
    for bad in (panels[:, :, :8], panels.double(), panels.transpose(0, 1), panels.reshape(2, 24, 2, 8)):
        with pytest.raises(ValueError, match="to_panels"):
            gemm(x, bad)


def test_what_the_kernel_cannot_take_goes_through_f_linear(gemm):
    """Another dtype, a wrong width or bias: F.linear on the dense weight computes it or says why."""
    w = torch.randn(32, 24)
    panels = cpu_gemm.to_panels(w)
    x64 = torch.randn(3, 24, dtype=torch.float64)
    with pytest.raises(RuntimeError):  # F.linear's own dtype error
        gemm(x64, panels)
    with pytest.raises(RuntimeError):
        gemm(torch.randn(3, 25), panels)
    x, b = torch.randn(3, 24), torch.randn(64)[::2]  # a strided bias: F.linear takes it
    torch.testing.assert_close(gemm(x, panels, b), F.linear(x, w, b))
    with pytest.raises((RuntimeError, NotImplementedError)):  # a bias off the CPU: never read as a host pointer
        gemm(x, panels, torch.empty(32, device="meta"))


def test_panels_round_trip_and_refuse_what_they_cannot_hold():
    w = torch.randn(48, 7)
    panels = cpu_gemm.to_panels(w)
    assert panels.shape == (3, 7, 16) and panels.is_contiguous() and torch.equal(panels[1, 4], w[16:32, 4])
    assert torch.equal(cpu_gemm.from_panels(panels), w)
    for bad in (torch.randn(20, 7), torch.randn(48, 7, dtype=torch.bfloat16), torch.randn(3, 16, 7)):
        with pytest.raises(ValueError, match="multiple of 16"):
            cpu_gemm.to_panels(bad)


def test_a_misaligned_weight_is_refused_not_read(gemm):
    w = torch.randn(16 * 8 + 1)[1:].view(8, 16)  # 4 bytes past a 64-byte boundary
    assert w.data_ptr() % 32
    with pytest.raises(RuntimeError, match="refused"):
        gemm(torch.randn(2, 8), w.view(1, 8, 16))


def test_panels_for_fp32_only_on_avx2_without_avx512_and_bf16_only_on_avx512_bf16_without_amx():
    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
    bf16 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
    f32, b16 = torch.float32, torch.bfloat16
    assert onednn.panels_for(f32, avx2) and not onednn.panels_for(b16, avx2)
    assert not onednn.panels_for(f32, avx2 | {"avx512f"})
    assert not onednn.panels_for(f32, frozenset({"avx", "avx2"}))  # no FMA
    assert not onednn.panels_for(f32, frozenset()) and not onednn.panels_for(b16, frozenset())  # not x86
    assert onednn.panels_for(b16, bf16) and not onednn.panels_for(f32, bf16)
    assert not onednn.panels_for(b16, bf16 | {"amx_bf16", "amx_tile"})  # oneDNN's AMX GEMMs, several times faster
    assert not onednn.panels_for(b16, bf16 - {"avx512_bf16"}) and not onednn.panels_for(torch.float16, bf16)


def test_pack_chooses_panels_for_fp32_multiples_of_16(monkeypatch):
    """Where the panel GEMM runs here (the CPU platform, an AVX2 CPU): fp32 weights of a multiple of 16 rows become panels and
    ``linear`` multiplies by them; other row counts, bf16, or ``LOOM_CPU_PANEL_GEMM=0`` keep
    oneDNN's layout. Every form gives F.linear's result, and ``dense`` the exact weight."""
    here = onednn.panels_for(torch.float32, cpu_features.cpu_flags()) and platforms.current_platform.is_cpu()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 24, generator=g)
    for rows, env, want in [(32, "1", "panels" if here else "onednn"), (20, "1", "onednn"), (32, "0", "onednn")]:
        monkeypatch.setenv("LOOM_CPU_PANEL_GEMM", env)
        w, b = torch.randn(rows, 24, generator=g), torch.randn(rows, generator=g)
        packed = onednn.pack(w)
        assert ("panels" if packed.dim() == 3 else "onednn" if packed.is_mkldnn else "dense") == want, (rows, env)
        torch.testing.assert_close(onednn.linear(x, packed, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
        assert torch.equal(onednn.dense(packed), w)


def test_the_self_check_finds_a_wrong_kernel(gemm):
    """What ``kernels()`` runs at load before a layer may use the kernel (a failure drops it alone)."""
    class Wrong:
        def __call__(self, x, panels, bias=None):
            return gemm(x, panels, bias) + 1

    Wrong.dtypes = gemm.dtypes  # type: ignore[attr-defined]
    with pytest.raises(native.NativeKernelError, match="panel GEMM disagrees"):
        cpu_gemm.self_check(Wrong())  # type: ignore[arg-type]


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 17, 64, 191, 192, 193, 400])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bf16_matches_a_float64_reference(gemm_bf16, rows, with_bias):
    """The bf16 kernel: every sliver size (1-8 rows and their tails), row blocks of 192 whole and in
    part, K of 8 to 576 pairs, an odd number of panels (80: the last pair a single panel), rows
    with a stride wider than K; within fp32 sums' worst case plus the output's bf16 rounding, and
    never more than one bf16 unit from F.linear's bf16 result on the same bf16 inputs."""
    g = torch.Generator().manual_seed(rows)
    for n, k in [(16, 8), (48, 300), (80, 40), (96, 576), (512, 40)]:
        x = torch.randn(rows, k + 6, generator=g).bfloat16()[:, 2:k + 2]
        w = torch.randn(n, k, generator=g).bfloat16()
        b = torch.randn(n, generator=g).bfloat16() if with_bias else None
        got = gemm_bf16(x, cpu_gemm.to_panels(w), b)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        assert cpu_gemm.within_rounding(got, x, w, b), (n, k)
        want = F.linear(x, w, b).double()
        assert ((got.double() - want).abs() <= 2.0 ** -7 * want.abs() + 1e-6).all(), (n, k)


def test_bf16_rows_threads_and_special_values(gemm_bf16):
    """A row's bits do not depend on what shares its call or on the thread count; (batch, seq, K)
    comes back in that shape; an infinity or NaN in x reaches exactly the outputs of its row;
    what the kernel cannot take (fp32 x on bf16 panels) goes through F.linear, which says why."""
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, 300, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    panels = cpu_gemm.to_panels(w)
    x = torch.randn(400, 300, generator=g).bfloat16()
    whole = gemm_bf16(x, panels, b)
    for i in (0, 7, 8, 191, 192, 399):
        assert torch.equal(gemm_bf16(x[i:i + 1], panels, b)[0], whole[i]), i
        assert torch.equal(gemm_bf16(x[max(i - 3, 0):i + 6], panels, b)[min(i, 3)], whole[i]), i
    threads = torch.get_num_threads()
    wide = cpu_gemm.to_panels(torch.randn(528, 300, generator=g).bfloat16())  # 33 panels: 17 units, by pair
    want = gemm_bf16(x, wide)
    try:
        for t in (1, 3, 16):
            torch.set_num_threads(t)
            assert torch.equal(gemm_bf16(x, panels, b), whole) and torch.equal(gemm_bf16(x, wide), want), t
    finally:
        torch.set_num_threads(threads)
    got = gemm_bf16(x[:18].view(2, 9, 300), panels, b)
    assert got.shape == (2, 9, 96) and torch.equal(got.view(18, 96), whole[:18])
    y = x[:8].clone()
    y[3, 7], y[5, 0] = float("inf"), float("nan")
    out = gemm_bf16(y, panels, None)
    assert out[5].isnan().all() and not out[[0, 1, 2, 4, 6, 7]].isnan().any() and not out[3].isfinite().any()
    with pytest.raises(RuntimeError):  # F.linear's own dtype error
        gemm_bf16(x.float(), panels)


def test_bf16_panels_round_trip_and_lay_out_pairs_of_k():
    w = torch.randn(48, 10).bfloat16()
    panels = cpu_gemm.to_panels(w)
    assert panels.shape == (3, 5, 32) and panels.is_contiguous()
    assert torch.equal(panels[1, 2].view(16, 2), w[16:32, 4:6])  # panel 1, pair 2: rows 16-31, k 4 and 5
    assert torch.equal(cpu_gemm.from_panels(panels), w)
    offset, stride, group = cpu_gemm.row_layout(48, 10, torch.bfloat16)
    flat = panels.reshape(-1)
    for r in range(48):
        for i in range(10):
            assert flat[offset[r] + i // group * stride + i % group] == w[r, i]
    with pytest.raises(ValueError, match="k even"):
        cpu_gemm.to_panels(torch.randn(48, 7).bfloat16())


def test_pack_chooses_bf16_panels_where_the_cpu_has_avx512_bf16(monkeypatch):
    """bf16 weights of a multiple of 16 rows and even K become panels where the kernel runs (the CPU
    platform, AVX512-BF16 without AMX); odd K or ``LOOM_CPU_PANEL_GEMM=0`` keep oneDNN's layout.
    Every form gives F.linear's result within a bf16 unit, and ``dense`` the exact weight."""
    here = onednn.panels_for(torch.bfloat16, cpu_features.cpu_flags()) and platforms.current_platform.is_cpu()
    if not onednn.packs(torch.bfloat16) and not here:
        pytest.skip("this CPU has no AVX512-BF16: neither oneDNN nor loom pack bf16 weights")
    g = torch.Generator().manual_seed(6)
    for rows, k, env, want in [(32, 24, "1", "panels" if here else "onednn"), (32, 23, "1", "onednn"),
                               (32, 24, "0", "onednn")]:
        monkeypatch.setenv("LOOM_CPU_PANEL_GEMM", env)
        w, b = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(rows, generator=g).bfloat16()
        x = torch.randn(5, k, generator=g).bfloat16()
        packed = onednn.pack(w)
        assert ("panels" if packed.dim() == 3 else "onednn" if packed.is_mkldnn else "dense") == want, (rows, k, env)
        torch.testing.assert_close(onednn.linear(x, packed, b), F.linear(x, w, b), atol=2e-2, rtol=2 ** -7)
        assert torch.equal(onednn.dense(packed), w)

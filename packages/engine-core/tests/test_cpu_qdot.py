"""The decode matmuls with int8 activations (``platforms/cpu_qdot.c``, AVX512-VNNI) and their
weight layout (``platforms/cpu_qdot.py``): bit-exact packing, the kernels against a float64
emulation of the same steps (tightly) and against the exact weight-only product (within the
rounding of x to 8 bits), and the fallbacks."""

from __future__ import annotations

import pytest
import torch
from loom import envs
from loom.platforms import cpu_kernels, cpu_qdot
from loom.platforms.cpu_features import cpu_flags


@pytest.fixture(autouse=True)
def _live_envs():
    envs._disable_envs_cache_for_tests()


@pytest.fixture(scope="module")
def k():
    kernels = cpu_kernels.kernels()
    assert kernels is not None, "the matrix always has a C compiler: the kernels must build"
    return kernels


DTYPES = [torch.float32, torch.bfloat16]
# every size of a last superblock (1..15 groups), none, and several whole ones
WIDTHS = [32 * g for g in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 18, 31, 48)]


def _codes(n, kdim, bits, seed):
    return torch.randint(0, 2 ** bits, (n, kdim), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kdim", WIDTHS)
def test_layout_round_trips(bits, kdim):
    q = _codes(5, kdim, bits, kdim)
    packed = cpu_qdot.pack_codes(q, bits)
    assert packed.dtype == torch.uint8 and packed.is_contiguous()
    assert torch.equal(cpu_qdot.unpack_codes(packed, kdim, bits), q)


def test_layout_of_a_whole_superblock_is_four_codes_of_each_group_per_lane():
    """8-bit: byte 4j + b of register v is code 4v + b of group j (the C file's order)."""
    q = _codes(1, 512, 8, 0)
    packed = cpu_qdot.pack_codes(q, 8).view(8, 16, 4)
    groups = q.view(16, 8, 4)  # (group, v, b)
    assert torch.equal(packed, groups.permute(1, 0, 2))
    four = cpu_qdot.pack_codes(q & 15, 4).view(4, 16, 4)  # 4-bit: registers 2p, 2p + 1 in one byte
    assert torch.equal(four & 15, (q & 15).view(16, 8, 4).permute(1, 0, 2)[0::2])
    assert torch.equal(four >> 4, (q & 15).view(16, 8, 4).permute(1, 0, 2)[1::2])


def _weights(n, kdim, bits, seed, dtype, k):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (n, kdim), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, kdim // 32, generator=g) * 0.05 + 1e-3
    zero = torch.randn(n, kdim // 32, generator=g) * 0.05
    if bits == 4:
        packed = k.pack_q4(q, scale, zero, dtype)
        assert packed.layout == 1
        q2, scale, zero = cpu_kernels.unpack_q4(packed)  # bf16: the rounded scales the kernel holds
        assert torch.equal(q2, q)
        return packed, q, scale, zero, zero - 8 * scale, lambda x: k.q4_linear(x, packed)
    packed = k.pack_q8(q, scale, zero, 32)
    return packed, q, scale, zero, zero - 128 * scale, lambda x: k.q8a_linear(x, packed)


def _needs_vnni(k):
    if not k.int8_compiled:  # pragma: no cover - the CI machine has AVX512-VNNI
        pytest.skip("this CPU lacks AVX512-VNNI (test_without_vnni_the_exact_kernels_run covers what runs)")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("kdim", [96, 544, 576, 1536])
def test_kernels_match_their_emulation_and_the_exact_product(k, bits, dtype, rows, kdim):
    _needs_vnni(k)
    n = 37  # a tail of outputs for every split
    _, q, scale, zero, zero_term, run = _weights(n, kdim, bits, rows + kdim + bits, dtype, k)
    wide = torch.randn(rows, kdim + 24, generator=torch.Generator().manual_seed(rows)).to(dtype)
    x = wide[:, 8:8 + kdim]  # strided rows
    x[0, :32] = 0  # a group of zeros: dx 0, no division by it
    got = run(x)
    assert got.shape == (rows, n) and got.dtype == dtype
    want = cpu_qdot.emulate(x, q, scale, zero_term)
    tol = 2e-6 if dtype == torch.float32 else 8e-3  # fp32: the sums' order; bf16: the output's rounding
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    # against the weights as they are: x rounded by at most half a step (max|x| / 254) per element
    w = (q.float().view(n, -1, 32) * scale[..., None] + zero_term[..., None]).view(n, kdim)
    step = (x.float().view(rows, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32).reshape(rows, kdim)
    exact = x.float() @ w.t()
    bound = step @ w.abs().t() * 1.001 + 1e-6 + (0 if dtype == torch.float32 else got.float().abs() / 128)
    assert ((got.float() - exact).abs() <= bound).all()
    assert (got.float() != exact).any()  # x really was rounded


def test_x_rounds_half_to_even(k):
    """x / dx exactly halfway between integers rounds to the even one (as torch.round): with
    max|x| = 127 the step is 1, so 0.5, 1.5, 2.5, -0.5 become 0, 2, 2, 0."""
    _needs_vnni(k)
    q = torch.zeros(1, 32, dtype=torch.uint8)
    q[0, 1:5] = 1
    packed = k.pack_q8(q, torch.ones(1, 1), torch.full((1, 1), 128.0), 32)  # w = code: zero - 128 s = 0
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1:5] = 127, torch.tensor([0.5, 1.5, 2.5, -0.5])
    assert k.q8a_linear(x, packed).item() == 4.0  # 0 + 2 + 2 + 0; half away from zero: 1 + 2 + 3 - 1 = 5


def test_threads_do_not_change_the_result(k):
    _needs_vnni(k)
    _, _, _, _, _, run = _weights(1003, 576, 4, 3, torch.float32, k)
    x = torch.randn(3, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(x)
        for threads in (2, 3, 7):  # slices of whole sixteens of outputs, shared out unevenly for 3 and 7
            torch.set_num_threads(threads)
            assert torch.equal(one, run(x)), f"{threads} threads"
    finally:
        torch.set_num_threads(before)


def test_refuses_what_it_cannot_take(k):
    _needs_vnni(k)
    _, _, _, _, _, run = _weights(16, 64, 8, 0, torch.float32, k)
    packed = k.pack_q8(_codes(16, 64, 8, 0), torch.ones(16, 2), torch.zeros(16, 2), 32)
    assert packed.zero is None  # all-zero zeros are not read at all
    assert k.q8a_linear(torch.randn(9, 64), packed) is None  # prefill: a GEMM's job
    assert k.q8a_linear(torch.randn(3, 48), packed) is None  # width mismatch
    assert k.q8a_linear(torch.randn(3, 64).half(), packed) is None  # not a kernel dtype
    assert k.q8a_linear(torch.randn(2, 1, 64), packed).shape == (2, 1, 16)  # leading dims kept
    assert k.q8a_linear(torch.randn(0, 64), packed).shape == (0, 16)
    assert k.pack_q8(_codes(16, 64, 8, 0), torch.ones(16, 1), torch.zeros(16, 1), 64) is None  # groups of 64
    q4 = k.pack_q4(_codes(16, 256, 4, 0), torch.ones(16, 2), torch.zeros(16, 2), torch.float32)
    assert q4.layout == 0  # groups of 128: the exact kernel's layout
    with pytest.raises(ValueError, match="layout 1 for groups of 32"):
        cpu_kernels.pack_q4(_codes(16, 256, 4, 0), torch.ones(16, 2), torch.zeros(16, 2), torch.float32, layout=1)


def test_turned_off_the_weights_pack_for_the_exact_kernels(k, monkeypatch):
    """``LOOM_CPU_INT8_ACTIVATIONS=0``: layout 0 and the raw 8-bit codes, x exact."""
    monkeypatch.setenv("LOOM_CPU_INT8_ACTIVATIONS", "0")
    assert not k.int8_activations
    q4 = k.pack_q4(_codes(16, 64, 4, 0), torch.ones(16, 2), torch.zeros(16, 2), torch.float32)
    assert q4.layout == 0
    assert k.pack_q8(_codes(16, 64, 8, 0), torch.ones(16, 2), torch.zeros(16, 2), 32) is None
    monkeypatch.setenv("LOOM_CPU_INT8_ACTIVATIONS", "1")
    assert k.int8_activations == k.int8_compiled


def test_without_vnni_the_exact_kernels_run(k, monkeypatch):
    """A CPU without AVX512-VNNI (here: the flag cleared) packs layout 0 and no 8-bit layout."""
    monkeypatch.setattr(k, "int8_compiled", False)
    assert k.pack_q4(_codes(16, 64, 4, 0), torch.ones(16, 2), torch.zeros(16, 2), torch.float32).layout == 0
    assert k.pack_q8(_codes(16, 64, 8, 0), torch.ones(16, 2), torch.zeros(16, 2), 32) is None


def test_kernels_built_with_int8_turned_off_keep_everything(monkeypatch):
    """The build's self-check packs its own int8 problem whatever ``LOOM_CPU_INT8_ACTIVATIONS``
    says: kernels first built while it is 0 (a test, an operator) still build, int8 included."""
    monkeypatch.setenv("LOOM_CPU_INT8_ACTIVATIONS", "0")
    cpu_kernels.kernels.cache_clear()
    try:
        built = cpu_kernels.kernels()
        assert built is not None and not built.int8_activations
        assert built.int8_compiled == ("avx512_vnni" in cpu_flags())  # its int8 self-check passed
    finally:
        cpu_kernels.kernels.cache_clear()

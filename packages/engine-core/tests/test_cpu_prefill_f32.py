"""The fp32 CPU prefill-attention kernel (``paged_prefill_f32.c``) against torch, and the backend's
use of it. The kernel is portable C, so every test runs on every CPU; the backend sends fp32
chunks to it only where ``paged_prefill_f32_ready()`` says so (x86 with AVX2 and FMA, no
AVX-512: where it was measured), which ``test_ready_where_measured`` pins down, and the backend
tests turn it on by hand elsewhere."""

from __future__ import annotations

import copy
import logging
import platform

import pytest
import torch
from loom.attention.backends import native, torch_sdpa
from loom.attention.backends.torch_sdpa import TorchSDPAImpl
from loom.platforms.cpu_features import cpu_flags
from test_cpu_paged_decode import _mixed_step
from test_cpu_prefill_amx import _reference


@pytest.fixture(scope="module")
def kernel():
    k = native.paged_decode()
    assert k is not None, "the CPU paged-decode kernel did not build (see the warning logged above)"
    return k


def _case(g, spec, heads, kv_heads, head_size, block_size, first=0):
    """Scattered blocks and random K/V for chunks of (tokens, cached prefix), in a random order of
    requests; the query rows of the chunks start at row ``first``."""
    nblk = max(t + p for t, p in spec) // block_size + 1
    tables = torch.randperm(len(spec) * nblk, generator=g).view(len(spec), nblk)
    k_cache, v_cache = (torch.randn(tables.numel() * block_size, kv_heads, head_size, generator=g) for _ in range(2))
    rows = []
    for r in torch.randperm(len(spec), generator=g).tolist():
        tokens, prefix = spec[r]
        rows.append([first, tokens, tokens + prefix, r])
        first += tokens
    return torch.tensor(rows), tables, k_cache, v_cache, first


def test_ready_where_measured(kernel):
    """The backend takes the kernel exactly on x86 CPUs with AVX2 and FMA and no AVX-512 (and the
    self-check passed), for fp32 and head sizes that are multiples of 16 up to 256."""
    flags = set(cpu_flags())
    where = platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= flags and "avx512f" not in flags
    assert kernel.f32_prefill == where
    assert kernel.takes_f32_prefill(torch.float32, 9, 3, 64) == where
    for dtype, h, hk, d in ((torch.bfloat16, 9, 3, 64), (torch.float32, 6, 6, 72), (torch.float32, 2, 1, 272),
                            (torch.float32, 9, 2, 64)):
        assert not kernel.takes_f32_prefill(dtype, h, hk, d)


@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(9, 3, 64), (12, 12, 64), (8, 2, 128), (4, 1, 32),
                                                             (6, 2, 96), (2, 1, 16), (2, 2, 256), (14, 2, 64),
                                                             (8, 1, 32)])
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("nthreads", [1, 2, 3])
def test_chunks_against_torch(kernel, monkeypatch, heads, kv_heads, head_size, block_size, nthreads):
    """Chunks of 1-300 tokens (parts of a long one on different threads; row blocks of 6 cut
    anywhere), fresh and after cached prefixes of any length, scattered blocks, strided query rows:
    each row attends to its context up to its own position, within fp32 rounding of a float64
    reference; rows of other requests in ``out`` stay untouched."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: nthreads)
    g = torch.Generator().manual_seed(heads * block_size + head_size)
    spec = [(40, 0), (17, 30), (2, 5), (16, 0), (3, 100), (300, 7), (33, 1), (31, 17), (1, 0), (7, 0)]
    chunks, tables, k_cache, v_cache, end = _case(g, spec, heads, kv_heads, head_size, block_size, first=3)
    T = end + 2  # three rows before the first chunk (a decode's, say), two after
    query = torch.randn(T, heads * head_size + 8, generator=g)[:, : heads * head_size]
    out = torch.full((T, heads * head_size), 7.0)
    kernel.prefill(query, chunks, k_cache, v_cache, tables, out, num_heads=heads, block_size=block_size,
                   scale=head_size**-0.5)
    untouched = torch.ones(T, dtype=torch.bool)
    for f, want in _reference(query, chunks, k_cache, v_cache, tables, heads, block_size, head_size**-0.5).items():
        torch.testing.assert_close(out[f:f + want.shape[0]].double(), want, atol=2e-5, rtol=1e-4)
        untouched[f:f + want.shape[0]] = False
    assert (out[untouched] == 7.0).all()


@pytest.mark.parametrize("nthreads", [1, 2])
def test_long_contexts(kernel, monkeypatch, nthreads):
    """Contexts of thousands of keys: a long fresh prompt cut into parts, chunks after long cached prefixes."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: nthreads)
    g = torch.Generator().manual_seed(8)
    heads, kv_heads, head_size, block_size = 6, 2, 64, 16
    chunks, tables, k_cache, v_cache, T = _case(g, [(1100, 0), (3, 1100), (300, 1000), (33, 2100)], heads,
                                                kv_heads, head_size, block_size)
    query = torch.randn(T, heads * head_size, generator=g)
    out = torch.empty(T, heads * head_size)
    kernel.prefill(query, chunks, k_cache, v_cache, tables, out, num_heads=heads, block_size=block_size,
                   scale=head_size**-0.5)
    for f, want in _reference(query, chunks, k_cache, v_cache, tables, heads, block_size, head_size**-0.5).items():
        torch.testing.assert_close(out[f:f + want.shape[0]].double(), want, atol=2e-5, rtol=1e-4)


def test_large_scores_and_uniform_rows(kernel):
    """Scores far from zero (softmax shifted by each row's own max, never overflowing) and rows
    whose keys are all equal (the output is V's mean over the row's context)."""
    h, hk, d, bs = 4, 2, 64, 16
    g = torch.Generator().manual_seed(7)
    tables = torch.arange(8).view(1, 8)
    k_cache = torch.randn(128, hk, d, generator=g) * 30
    v_cache = torch.randn(128, hk, d, generator=g)
    query = torch.randn(40, h * d, generator=g) * 30
    chunks = torch.tensor([[0, 40, 100, 0]])
    out = torch.empty(40, h * d)
    kernel.prefill(query, chunks, k_cache, v_cache, tables, out, num_heads=h, block_size=bs, scale=d**-0.5)
    assert torch.isfinite(out).all()
    want = _reference(query, chunks, k_cache, v_cache, tables, h, bs, d**-0.5)[0]
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    query.zero_()  # every score 0: each row averages V over its context
    kernel.prefill(query, chunks, k_cache, v_cache, tables, out, num_heads=h, block_size=bs, scale=d**-0.5)
    mean = torch.stack([v_cache[:61 + i].double().mean(0).repeat_interleave(2, dim=0).reshape(-1)
                        for i in range(40)])
    torch.testing.assert_close(out.double(), mean, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_reaches_only_the_rows_that_see_it(kernel, bad):
    """A NaN or inf in V at position 7 of a 12-token chunk, or in a query row: the rows whose
    context holds it (positions 7 on, or that row) are not finite, every other row is exactly
    what it is without it, as in the decode kernel."""
    h, hk, d, bs = 6, 2, 64, 16
    g = torch.Generator().manual_seed(9)
    tables = torch.arange(2).view(1, 2)
    k_cache, v_cache = (torch.randn(32, hk, d, generator=g) for _ in range(2))
    query = torch.randn(12, h * d, generator=g)
    chunks = torch.tensor([[0, 12, 12, 0]])
    clean = torch.empty(12, h * d)
    kernel.prefill(query, chunks, k_cache, v_cache, tables, clean, num_heads=h, block_size=bs, scale=d**-0.5)
    v_bad = v_cache.clone()
    v_bad[7, 0, 5] = bad  # KV head 0: query heads 0-2
    out = torch.empty(12, h * d)
    kernel.prefill(query, chunks, k_cache, v_bad, tables, out, num_heads=h, block_size=bs, scale=d**-0.5)
    finite = torch.isfinite(out).view(12, h, d).all(dim=2)
    assert finite[:7].all() and not finite[7:, :3].any() and finite[:, 3:].all()
    assert torch.equal(out.view(12, h, d)[:7], clean.view(12, h, d)[:7])
    q_bad = query.clone()
    q_bad[4, 70] = bad  # query head 1 of token 4
    kernel.prefill(q_bad, chunks, k_cache, v_cache, tables, out, num_heads=h, block_size=bs, scale=d**-0.5)
    others = torch.ones(12, h, dtype=torch.bool)
    others[4, 1] = False
    assert torch.equal(out.view(12, h, d)[others], clean.view(12, h, d)[others])


def test_rejects_what_it_does_not_take(kernel):
    """Shapes and layouts outside the kernel's get a clear error, not a wrong answer."""
    k_cache = torch.zeros(32, 2, 64)
    query, out = torch.zeros(4, 4 * 64), torch.zeros(4, 4 * 64)
    tables, chunks = torch.arange(2).view(1, 2), torch.tensor([[0, 4, 4, 0]])
    with pytest.raises(ValueError, match="dtypes or strides"):
        kernel.prefill(query, chunks, k_cache, k_cache, tables, out.double(), num_heads=4, block_size=16, scale=1.0)
    with pytest.raises(ValueError, match="dtypes or strides"):
        kernel.prefill(query, chunks, k_cache.transpose(0, 1), k_cache, tables, out, num_heads=4, block_size=16, scale=1.0)
    with pytest.raises(ValueError, match="multiple of 2 KV heads"):
        kernel.prefill(query[:, :3 * 64], chunks, k_cache, k_cache, tables, out[:, :3 * 64], num_heads=3,
                       block_size=16, scale=1.0)
    k_odd = torch.zeros(32, 2, 40)
    with pytest.raises(ValueError, match="head size 40 is not a multiple of 16"):
        kernel.prefill(query[:, :160], chunks, k_odd, k_odd, tables, out[:, :160], num_heads=4, block_size=16,
                       scale=1.0)


@pytest.mark.parametrize("fault", ["raises", "wrong"])
def test_self_check_turns_the_kernel_off_where_it_fails(kernel, monkeypatch, caplog, fault):
    """A prefill kernel that fails or answers wrong at load is switched off (fp32 prefills keep torch's SDPA)."""
    broken = copy.copy(kernel)
    broken.f32_prefill = True

    def prefill(query, chunks, k_cache, v_cache, tables, out, **kw):
        if fault == "raises":
            raise MemoryError("the CPU prefill kernel (paged_prefill_f32) could not allocate its scratch memory")
        kernel.prefill(query, chunks, k_cache, v_cache, tables, out, **kw)
        out[-1] += 1e-3  # the last row of the long chunk, off by more than fp32 rounding

    broken.prefill = prefill
    with caplog.at_level(logging.WARNING):
        native._check_prefill(broken, torch.Generator().manual_seed(0), torch.float32)
    assert not broken.f32_prefill and not broken.takes_f32_prefill(torch.float32, 9, 3, 64)
    assert "fp32 prefill kernel failed its self-check" in caplog.text
    monkeypatch.setattr(kernel, "f32_prefill", True)
    native._check_prefill(kernel, torch.Generator().manual_seed(0), torch.float32)  # the real one passes
    assert kernel.f32_prefill


@pytest.mark.parametrize("max_ctx", [4096, 12])
def test_backend_sends_fp32_prefill_chunks_to_the_kernel(kernel, monkeypatch, max_ctx):
    """fp32 with the kernel on: every prefill chunk up to F32_PREFILL_MAX_CTX (fresh, or after a
    cached prefix) goes to it in one call, decodes to the decode kernel, a longer chunk to torch's
    SDPA; the step's output equals the all-torch path's within fp32 rounding."""
    monkeypatch.setattr(torch_sdpa, "F32_PREFILL_MAX_CTX", max_ctx)
    monkeypatch.setattr(kernel, "f32_prefill", True)
    H, Hk, D = 6, 2, 64
    g = torch.Generator().manual_seed(6)
    md, num_blocks = _mixed_step(g)  # q_lens [1, 5, 1, 4], contexts [20, 13, 9, 4]
    cache = torch.randn(2, num_blocks, md.block_size, Hk, D, generator=g)
    q, k, v = (torch.randn(md.num_tokens, n * D, generator=g) for n in (H, Hk, Hk))
    with_kernel = TorchSDPAImpl(H, D, D**-0.5, Hk)
    without = TorchSDPAImpl(H, D, D**-0.5, Hk)
    without._kernel = None
    calls = []
    real = kernel.prefill
    monkeypatch.setattr(kernel, "prefill", lambda *a, **kw: calls.append(a[1].tolist()) or real(*a, **kw))
    cache2 = cache.clone()
    out = with_kernel.forward(None, q, k, v, cache, md)
    plan = md.scratch[f"torch_sdpa_plan_00{max_ctx}"]
    assert plan.decode.token_idx.tolist() == [0, 6]
    if max_ctx == 4096:
        assert calls == [[[1, 5, 13, 1], [7, 4, 4, 3]]] and not plan.prefills and not plan.groups
    else:  # the chunk after an 8-token prefix reaches 13 > 12: torch SDPA
        assert calls == [[[7, 4, 4, 3]]] and len(plan.prefills) == 1 and not plan.groups
    md.scratch.clear()
    want = without.forward(None, q, k, v, cache2, md)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)

"""The CPU prefill-attention kernel on AMX tiles (``paged_prefill_amx.c``) against torch, and the
backend's use of it. They run where the CPU has AMX (the Xeons this project's CI has run on) and
skip elsewhere as an absent capability (``conftest.py``'s ``CAPABILITIES``); on every CPU
``test_ready_where_the_cpu_has_amx`` checks that the kernel is on exactly where the tiles are, so a
build that loses it on an AMX machine fails, and one that turns it on without them fails too."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from loom.attention.backends import native, torch_sdpa
from loom.attention.backends.torch_sdpa import TorchSDPAImpl
from loom.platforms.cpu_features import cpu_flags
from test_cpu_paged_decode import _bf16_mixed_step


def _cpu_has_amx() -> bool:
    return {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw", "avx512vl"} <= set(cpu_flags())


needs_amx = pytest.mark.skipif(not _cpu_has_amx(), reason="this CPU has no AMX-BF16 tiles")


@pytest.fixture(scope="module")
def kernel():
    k = native.paged_decode()
    assert k is not None, "the CPU paged-decode kernel did not build (see the warning logged above)"
    return k


def _reference(query, chunks, k_cache, v_cache, tables, num_heads, block_size, scale):
    """{first row: (tokens, H * D) float64} per chunk: causal over its context, softmax in float64."""
    _, hk, d = k_cache.shape
    outs = {}
    for first, tokens, ctx, row in chunks.tolist():
        slots = torch.tensor([int(tables[row, p // block_size]) * block_size + p % block_size for p in range(ctx)])
        k = k_cache[slots].double().repeat_interleave(num_heads // hk, dim=1).transpose(0, 1)  # (H, ctx, D)
        v = v_cache[slots].double().repeat_interleave(num_heads // hk, dim=1).transpose(0, 1)
        q = query[first:first + tokens].double().view(tokens, num_heads, d).transpose(0, 1)
        s = q @ k.transpose(1, 2) * scale
        later = torch.arange(ctx)[None, :] > torch.arange(ctx - tokens, ctx)[:, None]
        w = torch.softmax(s.masked_fill(later, float("-inf")), dim=-1)
        outs[first] = (w @ v).transpose(0, 1).reshape(tokens, -1)
    return outs


def test_ready_where_the_cpu_has_amx(kernel):
    """The build has the AMX kernel exactly where the CPU reports the tiles (and the self-check
    agreed with the decode kernel)."""
    assert kernel.amx_prefill == _cpu_has_amx()
    assert kernel.takes_amx_prefill(torch.bfloat16, 9, 3, 64) == _cpu_has_amx()
    for dtype, h, hk, d in ((torch.float32, 9, 3, 64), (torch.bfloat16, 6, 6, 80), (torch.bfloat16, 2, 1, 256),
                            (torch.bfloat16, 9, 2, 64)):
        assert not kernel.takes_amx_prefill(dtype, h, hk, d)


@needs_amx
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(9, 3, 64), (12, 12, 64), (8, 2, 128), (4, 1, 32),
                                                             (6, 2, 96)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("nthreads", [1, 2, 3])
def test_chunks_against_torch(kernel, monkeypatch, heads, kv_heads, head_size, block_size, nthreads):
    """Chunks of 2-300 tokens (parts of a long one on different threads), fresh and after cached
    prefixes of any length, in any order of requests and rows, scattered blocks: each row attends to
    its context up to its own position; rows of other requests in ``out`` stay untouched."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: nthreads)
    g = torch.Generator().manual_seed(heads * block_size + head_size)
    spec = [(40, 0), (17, 30), (2, 5), (16, 0), (3, 100), (300, 7), (33, 1), (31, 17)]  # (tokens, cached prefix)
    nblk = 320 // block_size + 1
    R = len(spec)
    tables = torch.randperm(R * nblk, generator=g).view(R, nblk)
    k_cache, v_cache = (torch.randn(R * nblk * block_size, kv_heads, head_size, generator=g).to(torch.bfloat16)
                        for _ in range(2))
    rows, first = [], 3  # three rows before the first chunk: a decode's, say
    for r in torch.randperm(R, generator=g).tolist():
        tokens, prefix = spec[r]
        rows.append([first, tokens, tokens + prefix, r])
        first += tokens
    T = first + 2
    query = torch.randn(T, heads * head_size + 32, generator=g).to(torch.bfloat16)[:, : heads * head_size]
    out = torch.full((T, heads * head_size), 7.0, dtype=torch.bfloat16)
    chunks = torch.tensor(rows)
    kernel.prefill(query, chunks, k_cache, v_cache, tables, out, num_heads=heads, block_size=block_size,
                   scale=head_size**-0.5)
    untouched = torch.ones(T, dtype=torch.bool)
    for f, want in _reference(query, chunks, k_cache, v_cache, tables, heads, block_size, head_size**-0.5).items():
        torch.testing.assert_close(out[f:f + want.shape[0]].double(), want, atol=1.6e-2, rtol=1.6e-2)
        untouched[f:f + want.shape[0]] = False
    assert (out[untouched] == 7.0).all()


@needs_amx
@pytest.mark.parametrize("nthreads", [1, 2])
def test_long_contexts(kernel, monkeypatch, nthreads):
    """Contexts of thousands of keys (the kernel takes a row's keys in passes of 1,024, its softmax
    carried from pass to pass): a long fresh prompt, chunks after long cached prefixes, 16-row
    blocks whose rows end on both sides of a pass's last key."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: nthreads)
    g = torch.Generator().manual_seed(8)
    heads, kv_heads, head_size, block_size = 6, 2, 64, 16
    spec = [(1100, 0), (3, 1100), (300, 1000), (33, 2100), (130, 1010)]  # (tokens, cached prefix)
    nblk = 2200 // block_size
    tables = torch.randperm(len(spec) * nblk, generator=g).view(len(spec), nblk)
    k_cache, v_cache = (torch.randn(tables.numel() * block_size, kv_heads, head_size, generator=g)
                        .to(torch.bfloat16) for _ in range(2))
    rows, first = [], 0
    for r, (tokens, prefix) in enumerate(spec):
        rows.append([first, tokens, tokens + prefix, r])
        first += tokens
    query = torch.randn(first, heads * head_size, generator=g).to(torch.bfloat16)
    out = torch.empty(first, heads * head_size, dtype=torch.bfloat16)
    chunks = torch.tensor(rows)
    kernel.prefill(query, chunks, k_cache, v_cache, tables, out, num_heads=heads, block_size=block_size,
                   scale=head_size**-0.5)
    for f, want in _reference(query, chunks, k_cache, v_cache, tables, heads, block_size, head_size**-0.5).items():
        torch.testing.assert_close(out[f:f + want.shape[0]].double(), want, atol=1.6e-2, rtol=1.6e-2)


@needs_amx
def test_large_scores_and_uniform_rows(kernel):
    """Scores far from zero (softmax shifted by each row's own max, never overflowing) and rows
    whose keys are all equal (the output is V's mean over the row's context)."""
    h, hk, d, bs = 4, 2, 64, 16
    g = torch.Generator().manual_seed(7)
    tables = torch.arange(8).view(1, 8)
    k_cache = torch.randn(128, hk, d, generator=g).to(torch.bfloat16) * 30
    v_cache = torch.randn(128, hk, d, generator=g).to(torch.bfloat16)
    query = torch.randn(40, h * d, generator=g).to(torch.bfloat16) * 30
    chunks = torch.tensor([[0, 40, 100, 0]])
    out = torch.empty(40, h * d, dtype=torch.bfloat16)
    kernel.prefill(query, chunks, k_cache, v_cache, tables, out, num_heads=h, block_size=bs, scale=d**-0.5)
    assert torch.isfinite(out.float()).all()
    want = _reference(query, chunks, k_cache, v_cache, tables, h, bs, d**-0.5)[0]
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)
    query.zero_()  # every score 0: each row averages V over its context
    kernel.prefill(query, chunks, k_cache, v_cache, tables, out, num_heads=h, block_size=bs, scale=d**-0.5)
    mean = torch.stack([v_cache[:61 + i].double().mean(0).repeat_interleave(2, dim=0).reshape(-1)
                        for i in range(40)])
    torch.testing.assert_close(out.double(), mean, atol=1e-2, rtol=1e-2)


@needs_amx
@pytest.mark.parametrize("fault", ["raises", "wrong"])
def test_self_check_turns_the_kernel_off_where_it_fails(kernel, caplog, fault):
    """A kernel that fails or answers wrong in the self-check is turned off, with a warning, and the
    backend keeps its other prefill paths; the decode kernel stays."""
    broken = copy.copy(kernel)

    def prefill(query, chunks, k_cache, v_cache, tables, out, **kw):
        if fault == "raises":
            raise MemoryError("the CPU AMX prefill kernel could not allocate its scratch memory")
        kernel.prefill(query, chunks, k_cache, v_cache, tables, out, **kw)
        out[-1] += 1  # the last row of the long chunk

    broken.prefill = prefill
    with caplog.at_level(logging.WARNING):
        native._check_prefill(broken, torch.Generator().manual_seed(0), torch.bfloat16)
    assert not broken.amx_prefill and not broken.takes_amx_prefill(torch.bfloat16, 9, 3, 64)
    assert "prefill attention keeps torch's SDPA" in caplog.text
    assert kernel.amx_prefill  # the shared kernel as it was
    native._check_prefill(kernel, torch.Generator().manual_seed(0), torch.bfloat16)  # the real one passes its own check
    assert kernel.amx_prefill


def test_rejects_what_it_does_not_take(kernel):
    """Shapes and layouts outside the kernel's get a clear error, not a wrong answer."""
    k_cache = torch.zeros(32, 2, 64, dtype=torch.bfloat16)
    query, out = torch.zeros(4, 4 * 64, dtype=torch.bfloat16), torch.zeros(4, 4 * 64, dtype=torch.bfloat16)
    tables, chunks = torch.arange(2).view(1, 2), torch.tensor([[0, 4, 4, 0]])
    with pytest.raises(ValueError, match="dtypes or strides"):
        kernel.prefill(query.float(), chunks, k_cache, k_cache, tables, out, num_heads=4, block_size=16, scale=1.0)
    with pytest.raises(ValueError, match="dtypes or strides"):
        kernel.prefill(query, chunks.int(), k_cache, k_cache, tables, out, num_heads=4, block_size=16, scale=1.0)
    if kernel.amx_prefill:
        with pytest.raises(ValueError, match="multiple of 2 KV heads"):
            kernel.prefill(query[:, :3 * 64], chunks, k_cache, k_cache, tables, out[:, :3 * 64], num_heads=3,
                           block_size=16, scale=1.0)


@needs_amx
@pytest.mark.parametrize("max_ctx", [8192, 12])
def test_backend_sends_prefill_chunks_to_the_amx_kernel(kernel, monkeypatch, max_ctx):
    """bf16 with the AMX kernel: every prefill chunk up to AMX_PREFILL_MAX_CTX (fresh, or after a
    cached prefix) goes to it in one call, decodes to the decode kernel, a longer chunk to torch's
    SDPA; the step's output equals the all-torch path's."""
    monkeypatch.setattr(torch_sdpa, "AMX_PREFILL_MAX_CTX", max_ctx)
    H, Hk, D = 6, 2, 64
    md, cache, q, k, v = _bf16_mixed_step(6)  # q_lens [1, 5, 1, 4], contexts [20, 13, 9, 4]
    with_kernel = TorchSDPAImpl(H, D, D**-0.5, Hk)
    without = TorchSDPAImpl(H, D, D**-0.5, Hk)
    without._kernel = None
    cache2 = cache.clone()
    out = with_kernel.forward(None, q, k, v, cache, md)
    plan = md.scratch[f"torch_sdpa_plan_00{max_ctx}"]
    assert plan.decode.token_idx.tolist() == [0, 6]
    if max_ctx == 8192:
        assert plan.chunks.tolist() == [[1, 5, 13, 1], [7, 4, 4, 3]] and not plan.prefills and not plan.groups
    else:  # the chunk after an 8-token prefix reaches 13 > 12: torch SDPA
        assert plan.chunks.tolist() == [[7, 4, 4, 3]] and len(plan.prefills) == 1 and not plan.groups
    md.scratch.clear()
    want = without.forward(None, q, k, v, cache2, md)
    torch.testing.assert_close(out, want, atol=1.6e-2, rtol=1.6e-2)

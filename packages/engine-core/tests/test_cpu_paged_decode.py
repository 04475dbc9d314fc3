"""The CPU paged-decode kernel (compiled on this machine) against torch, and the backend's use of it.

The matrix always has a C compiler (the supervisor's build needs one), so the kernel must
build here: a test that found it missing would fail, not skip.
"""

from __future__ import annotations

import copy
import ctypes
import logging
import os

import pytest
import torch
from loom import envs
from loom.attention.backends import native, torch_sdpa
from loom.attention.backends.torch_sdpa import TorchSDPAImpl
from loom.platforms.cpu_features import cpu_flags
from loom_plugin_api import AttentionMetadata


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """``native.paged_decode`` built anew into an empty LOOM_CACHE_DIR (the environment as set)."""
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    envs._disable_envs_cache_for_tests()
    native.paged_decode.cache_clear()
    yield native.paged_decode
    native.paged_decode.cache_clear()


@pytest.fixture(scope="module")
def kernel():
    k = native.paged_decode()
    assert k is not None, "the CPU paged-decode kernel did not build (see the warning logged above)"
    return k


def _reference(query, rows_q, rows_req, k_cache, v_cache, tables, ctx, num_heads, block_size, scale):
    """Each request alone: its context gathered position by position, softmax in float64."""
    _, hk, d = k_cache.shape
    outs = []
    for rq, rr, n in zip(rows_q.tolist(), rows_req.tolist(), ctx.tolist()):
        slots = [int(tables[rr, p // block_size]) * block_size + p % block_size for p in range(n)]
        k = k_cache[slots].double().repeat_interleave(num_heads // hk, dim=1)  # (n, H, D)
        v = v_cache[slots].double().repeat_interleave(num_heads // hk, dim=1)
        q = query[rq].double().view(num_heads, d)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", w, v).reshape(-1))
    return torch.stack(outs)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(4, 4, 64), (9, 3, 64), (8, 2, 128), (6, 6, 80),
                                                          (10, 2, 64), (16, 2, 32)])  # groups of 5 and 8: chunks of 4
@pytest.mark.parametrize("block_size", [8, 16])
def test_kernel_matches_torch(kernel, dtype, heads, kv_heads, head_size, block_size):
    g = torch.Generator().manual_seed(heads * 1000 + head_size + block_size)
    num_blocks = 96
    # contexts: 1 token, shorter than a block, not a multiple of 4, exactly a block, across many blocks
    ctx = torch.tensor([1, 5, 7, block_size, 3 * block_size + 3, 100])
    B = len(ctx)
    tables = torch.randperm(num_blocks, generator=g)[: B * 13].view(B, 13)  # scattered, non-increasing blocks
    slots = num_blocks * block_size
    k_cache, v_cache = (torch.randn(slots, kv_heads, head_size, generator=g).to(dtype) for _ in range(2))
    T = B + 3  # query rows of other (prefill) tokens sit between the decode rows
    width = heads * head_size
    query = torch.randn(T, width + 2 * kv_heads * head_size, generator=g).to(dtype)[:, :width]  # a qkv split
    rows_q = torch.randperm(T, generator=g)[:B].contiguous()
    rows_req = torch.randperm(B, generator=g)
    ctx_of = ctx[rows_req].contiguous()  # the context belongs to the request row
    out = torch.full((T, width), 7.0, dtype=dtype)
    scale = head_size**-0.5
    kernel(query, rows_q, rows_req, k_cache, v_cache, tables, ctx_of, out, num_heads=heads,
           block_size=block_size, scale=scale)
    want = _reference(query, rows_q, rows_req, k_cache, v_cache, tables, ctx_of, heads, block_size, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out[rows_q].double(), want, atol=tol, rtol=tol)
    untouched = torch.ones(T, dtype=torch.bool)
    untouched[rows_q] = False
    assert (out[untouched] == 7.0).all(), "the kernel wrote rows that are not decode rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_request_splits_heads_across_threads(kernel, threads, dtype):
    """One stream (the chat case) on one or two threads: by KV heads, or (two threads) its context
    split in parts; the answer is the same."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(1)
        k_cache, v_cache = (torch.randn(64 * 16, 3, 64, generator=g).to(dtype) for _ in range(2))
        tables = torch.randperm(64, generator=g).view(1, 64)
        query, out = torch.randn(1, 9 * 64, generator=g).to(dtype), torch.empty(1, 9 * 64, dtype=dtype)
        one, ctx = torch.zeros(1, dtype=torch.long), torch.tensor([1000])
        kernel(query, one, one, k_cache, v_cache, tables, ctx, out, num_heads=9, block_size=16, scale=0.125)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.double(), _reference(query, one, one, k_cache, v_cache, tables, ctx, 9, 16,
                                                            0.125), atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(before)


def test_kernel_refuses_what_it_cannot_compute(kernel):
    z = torch.zeros(1, dtype=torch.long)
    cache = torch.zeros(16, 2, 12)
    with pytest.raises(ValueError, match="head size 12"):
        kernel(torch.zeros(1, 24), z, z, cache, cache, z.view(1, 1), torch.ones(1, dtype=torch.long),
               torch.zeros(1, 24), num_heads=2, block_size=16, scale=1.0)
    with pytest.raises(ValueError, match="dtypes or strides"):
        kernel(torch.zeros(1, 128), z, z, torch.zeros(16, 2, 64, dtype=torch.bfloat16), cache, z.view(1, 1),
               torch.ones(1, dtype=torch.long), torch.zeros(1, 128), num_heads=2, block_size=16, scale=1.0)
    assert not kernel.supports(torch.float32, 12) and kernel.supports(torch.bfloat16, 64)
    assert not kernel.supports(torch.float64, 64)


def test_build_is_cached_per_machine(fresh_kernel, tmp_path):
    assert fresh_kernel() is not None
    built = os.listdir(tmp_path / "kernels")
    assert len(built) == 1 and built[0].endswith(".so"), built
    mtime = os.path.getmtime(tmp_path / "kernels" / built[0])
    fresh_kernel.cache_clear()
    assert fresh_kernel() is not None
    assert os.listdir(tmp_path / "kernels") == built
    assert os.path.getmtime(tmp_path / "kernels" / built[0]) == mtime, "a cached kernel was compiled again"


def test_no_compiler_falls_back_with_a_reason(fresh_kernel, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert fresh_kernel() is None
    assert "runs on torch ops" in caplog.text and "/nonexistent/cc" in caplog.text


def test_failed_compile_falls_back_with_the_compiler_output(fresh_kernel, monkeypatch, tmp_path, caplog):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake 1.0 && exit 0\necho 'error: no vectors here' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert fresh_kernel() is None
    assert "error: no vectors here" in caplog.text


def test_switched_off_by_environment(fresh_kernel, monkeypatch):
    monkeypatch.setenv("LOOM_CPU_NATIVE_KERNELS", "0")
    assert fresh_kernel() is None
    assert not (envs.LOOM_CACHE_DIR and os.path.exists(os.path.join(envs.LOOM_CACHE_DIR, "kernels")))


def _mixed_step(g: torch.Generator, block_size: int = 8):
    """A step of two decodes, one prefill over a cached prefix, and one fresh prefill."""
    return _step(g, [1, 5, 1, 4], [20, 13, 9, 4], block_size)


def _bf16_mixed_step(seed: int):
    """``_mixed_step`` (q_lens [1, 5, 1, 4], contexts [20, 13, 9, 4]) with a bf16 cache of 2 KV heads
    of 64 holding random prefixes, and the step's q (6 heads), k and v."""
    g = torch.Generator().manual_seed(seed)
    md, num_blocks = _mixed_step(g)
    cache = torch.randn(2, num_blocks, md.block_size, 2, 64, generator=g).to(torch.bfloat16)
    q, k, v = (torch.randn(md.num_tokens, n * 64, generator=g).to(torch.bfloat16) for n in (6, 2, 2))
    return md, cache, q, k, v


def _step(g: torch.Generator, q_lens: list[int], ctx_lens: list[int], block_size: int = 8):
    """A step of requests with these query and context lengths (at most 32 tokens each)."""
    num_blocks, B = 32, len(q_lens)
    tables = torch.randperm(num_blocks, generator=g)[: B * 4].view(B, 4)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(q_lens, ctx_lens)])
    req = torch.repeat_interleave(torch.arange(B), torch.tensor(q_lens))
    slot_mapping = tables[req, positions // block_size] * block_size + positions % block_size
    md = AttentionMetadata(
        num_reqs=B, num_tokens=int(starts[-1]), query_start_loc=starts, seq_lens=torch.tensor(ctx_lens),
        query_lens=q_lens, seq_lens_list=ctx_lens, max_query_len=max(q_lens), max_seq_len=max(ctx_lens),
        block_tables=tables, slot_mapping=slot_mapping, block_size=block_size)
    return md, num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_same_with_and_without_the_kernel(kernel, dtype):
    """The torch SDPA backend gives the same step output through the kernel as through its gather path."""
    g = torch.Generator().manual_seed(3)
    md, num_blocks = _mixed_step(g)
    H, Hk, D = 6, 2, 64
    T = md.num_tokens
    cache = torch.randn(2, num_blocks, md.block_size, Hk, D, generator=g).to(dtype)  # cached prefixes
    q, k, v = (torch.randn(T, n * D, generator=g).to(dtype) for n in (H, Hk, Hk))
    with_kernel = TorchSDPAImpl(H, D, D**-0.5, Hk)
    assert with_kernel._kernel is not None
    without = TorchSDPAImpl(H, D, D**-0.5, Hk)
    without._kernel = None
    cache2 = cache.clone()
    out = with_kernel.forward(None, q, k, v, cache, md)
    md.scratch.clear()
    want = without.forward(None, q, k, v, cache2, md)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    torch.testing.assert_close(cache, cache2)


@pytest.mark.parametrize(("q_lens", "spans"), [([3, 3, 3], {3: (0, 9)}), ([3, 3, 1, 3], {3: None}),
                                               ([4, 3, 4], {4: None, 3: (4, 7)})])
def test_fresh_prefills_of_one_length_are_one_call(monkeypatch, q_lens, spans):
    """Fresh prefill chunks of one length run as one batched causal SDPA call: on views of the
    step's tensors where they follow one another (``span``), through gathers where a decode or a
    chunk of another length sits between them; either way each chunk attends to itself alone."""
    g = torch.Generator().manual_seed(5)
    ctx_lens = [20 if q == 1 else q for q in q_lens]
    md, num_blocks = _step(g, q_lens, ctx_lens)
    H, Hk, D = 6, 2, 16
    T = md.num_tokens
    cache = torch.randn(2, num_blocks, md.block_size, Hk, D, generator=g)
    # k and v as the model hands them over: column slices of the fused qkv projection's rows
    q, k, v = torch.randn(T, (H + 2 * Hk) * D, generator=g).split([H * D, Hk * D, Hk * D], dim=-1)
    impl = TorchSDPAImpl(H, D, D**-0.5, Hk)
    impl._kernel = None
    with torch.inference_mode():  # as a model runs (the gathers' shared workspace may be an inference tensor)
        out = impl.forward(None, q, k, v, cache, md)
    groups = md.scratch["torch_sdpa_plan_100"].groups
    assert {grp.length: grp.span for grp in groups} == spans
    starts = md.query_start_loc.tolist()
    for i, n in enumerate(q_lens):
        if n == 1:
            continue
        rows = slice(starts[i], starts[i] + n)
        qc, kc, vc = (t[rows].view(n, -1, D).transpose(0, 1) for t in (q, k, v))
        want = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=D**-0.5,
                                                                enable_gqa=True)
        torch.testing.assert_close(out[rows], want.transpose(0, 1).reshape(n, H * D), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(torch_sdpa, "_one_run", lambda firsts, length: False)  # gathers for every group
    md.scratch.clear()
    with torch.inference_mode():
        assert torch.equal(impl.forward(None, q, k, v, cache.clone(), md), out)


def test_gathers_work_in_and_out_of_inference_mode(monkeypatch):
    """The gathers' shared workspace, first made under inference_mode (as a model runs), still
    serves a call outside it (a test, a tool), where writing into it would raise."""
    monkeypatch.setattr(torch_sdpa, "_workspace", {})
    cache = torch.randn(10, 2, 4)
    slots = torch.tensor([[1, 3], [4, 0]])
    with torch.inference_mode():
        torch_sdpa._gather_kv(cache, cache, slots)
    k, v = torch_sdpa._gather_kv(cache, cache, slots)
    assert torch.equal(k, cache[slots]) and torch.equal(v, cache[slots])
    with torch.inference_mode():
        k, _ = torch_sdpa._gather_kv(cache, cache, slots[:1])
    assert torch.equal(k, cache[slots[:1]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_write_equals_index_copy(kernel, dtype):
    """The step's new K/V rows (strided: split out of a fused qkv output) land in their slots,
    and nowhere else, as ``index_copy_`` puts them."""
    g = torch.Generator().manual_seed(3)
    row, slots_total = 2 * 16, 40
    k_rows, v_rows = (torch.randn(slots_total, row, generator=g).to(dtype) for _ in range(2))
    qkv = torch.randn(4, 3 * row + 8, generator=g).to(dtype)
    key, value = qkv[:, row: 2 * row], qkv[:, 2 * row: 3 * row]
    slots = torch.tensor([39, 0, 7, 8])
    k_want, v_want = k_rows.index_copy(0, slots, key), v_rows.index_copy(0, slots, value)
    assert kernel.write_kv(key, value, slots, k_rows, v_rows)
    assert torch.equal(k_rows, k_want) and torch.equal(v_rows, v_want)
    for bad in ([1, 2, 40, 3], [1, -1, 2, 3]):  # past the end, negative: nothing is written
        with pytest.raises(IndexError, match="outside the KV cache"):
            kernel.write_kv(key * 2, value * 2, torch.tensor(bad), k_rows, v_rows)
        assert torch.equal(k_rows, k_want) and torch.equal(v_rows, v_want)
    assert not kernel.write_kv(key.float() if dtype != torch.float32 else key.double(), value, slots, k_rows, v_rows)


def _has_avx512_bf16() -> bool:
    return {"avx512_bf16", "avx512bw", "avx512vl"} <= set(cpu_flags())


def _portable_bf16(kernel) -> native.PagedDecode:
    """The same kernel object with bf16 sent to the portable C kernel (exported beside the
    AVX512-BF16 one that ``paged_decode_bf16`` dispatches to)."""
    fn = kernel.lib.paged_decode_portable_bf16
    fn.argtypes, fn.restype = native._ARGTYPES, ctypes.c_int
    other = copy.copy(kernel)
    other._fns = {**kernel._fns, torch.bfloat16: fn}
    return other


@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [
    (9, 3, 64), (8, 2, 128), (4, 4, 32), (12, 1, 64),
    # Q.K compiled per head size / 32, and P.V's last 32 columns alone (96, 160) or with two heads
    (4, 2, 96), (2, 1, 256), (6, 3, 160), (6, 6, 224),
])
def test_bf16_fast_kernel_against_portable_and_torch(kernel, heads, kv_heads, head_size):
    """On a CPU with AVX512-BF16 the bf16 entry takes its own kernel (head sizes a multiple of 32);
    it and the portable kernel both match torch, over many requests (each thread asks for its next
    item's K/V while computing one) and contexts that are not multiples of its 16-token tiles."""
    assert kernel.takes_prefill(torch.bfloat16, heads, kv_heads, head_size) == (
        _has_avx512_bf16() and not kernel.sdpa_prefills_faster)
    assert not kernel.takes_prefill(torch.float32, heads, kv_heads, head_size)
    assert not kernel.takes_prefill(torch.bfloat16, heads, kv_heads, 80)  # portable: 80 % 32
    g = torch.Generator().manual_seed(head_size + heads)
    block_size, B = 16, 40
    ctx = torch.randint(1, 300, (B,), generator=g)
    ctx[:4] = torch.tensor([1, 15, 16, 17])
    nblk = 19
    tables = torch.randperm(B * nblk, generator=g).view(B, nblk)
    slots = B * nblk * block_size
    k_cache, v_cache = (torch.randn(slots, kv_heads, head_size, generator=g).to(torch.bfloat16) for _ in range(2))
    query = torch.randn(B, heads * head_size, generator=g).to(torch.bfloat16)
    rows = torch.arange(B)
    want = _reference(query, rows, rows, k_cache, v_cache, tables, ctx, heads, block_size, head_size**-0.5)
    for k in (kernel, _portable_bf16(kernel)):
        out = torch.empty(B, heads * head_size, dtype=torch.bfloat16)
        k(query, rows, rows, k_cache, v_cache, tables, ctx, out, num_heads=heads, block_size=block_size,
          scale=head_size**-0.5)
        torch.testing.assert_close(out.double(), want, atol=1.6e-2, rtol=1.6e-2)


def _heads_per_item(kernel, contexts: list[int], kv_heads: int, head_size: int, threads: int = 2) -> int:
    """The KV heads a decode work item of the AVX512-BF16 kernel takes for these decode rows."""
    fn = kernel.lib.paged_decode_bf16_heads_per_item
    fn.argtypes = [ctypes.c_int64] * 3 + [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
    fn.restype = ctypes.c_int64
    return fn(len(contexts), kv_heads, head_size, (ctypes.c_int64 * len(contexts))(*contexts), threads)


@pytest.mark.parametrize(("heads", "kv_heads"), [(12, 12), (9, 3)])
def test_bf16_items_of_rows_with_much_kv_take_some_of_their_heads(kernel, heads, kv_heads):
    """A thread asks for its next item's K/V while it computes one, so an item's K/V is kept to
    about 64 KB: an OPT-125m row's 12 heads of 64 at 160 tokens (480 KB) are cut into items of 2
    heads, the default model's 3 (120 KB) into items of 2 and 1; short contexts keep rows whole,
    a few rows are cut for the threads' sake alone. Each item writes its own heads, with the query
    heads of its KV heads (the default model's groups of 3): against torch, 64 rows of 100-190,
    and bit for bit against the same rows computed whole (beside rows of one token each, the
    batch's mean context is short)."""
    assert _heads_per_item(kernel, [160] * 64, 12, 64) == 2
    assert _heads_per_item(kernel, [160] * 64, 3, 64) == 2
    assert _heads_per_item(kernel, [16] * 64, 12, 64) == 12  # 48 KB: whole rows
    assert _heads_per_item(kernel, [16] * 64, 3, 64) == 3
    assert _heads_per_item(kernel, [16], 12, 64) == 3  # one row: 4 items for 2 threads
    assert _heads_per_item(kernel, [4000] * 8, 2, 128) == 1  # never fewer than one head
    head_size, block_size, B, nblk = 64, 16, 64, 12
    g = torch.Generator().manual_seed(heads)
    ctx = torch.randint(100, 190, (B,), generator=g)
    assert _heads_per_item(kernel, ctx.tolist(), kv_heads, head_size) < kv_heads
    tables = torch.randperm(B * nblk, generator=g).view(B, nblk)
    k_cache, v_cache = (torch.randn(B * nblk * block_size, kv_heads, head_size, generator=g).to(torch.bfloat16)
                        for _ in range(2))
    query = torch.randn(B, heads * head_size, generator=g).to(torch.bfloat16)
    rows = torch.arange(B)
    out = torch.empty(B, heads * head_size, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kernel(query, rows, rows, k_cache, v_cache, tables, ctx, out, num_heads=heads, block_size=block_size,
               scale=head_size**-0.5)
        want = _reference(query, rows, rows, k_cache, v_cache, tables, ctx, heads, block_size, head_size**-0.5)
        torch.testing.assert_close(out.double(), want, atol=1.6e-2, rtol=1.6e-2)
        for b in (0, 31, 63):  # the same row beside rows of one token: whole rows, and the same bits
            alone = torch.ones_like(ctx)
            alone[b] = ctx[b]
            assert _heads_per_item(kernel, alone.tolist(), kv_heads, head_size) == kv_heads
            whole = torch.empty_like(out)
            kernel(query, rows, rows, k_cache, v_cache, tables, alone, whole, num_heads=heads,
                   block_size=block_size, scale=head_size**-0.5)
            assert torch.equal(whole[b], out[b]), f"row {b}: items of some of its heads gave other bits"
    finally:
        torch.set_num_threads(before)


def _chunks(kernel, B, heads, kv_heads, head_size, max_ctx, threads) -> int:
    """The parts the bf16 kernel cuts each decode row's context into (0: it goes by KV heads)."""
    fn = kernel.lib.paged_decode_bf16_chunks
    fn.argtypes, fn.restype = [ctypes.c_int64] * 5 + [ctypes.c_int], ctypes.c_int64
    return fn(B, heads, kv_heads, head_size, max_ctx, threads)


@pytest.mark.parametrize("which", ["bf16", "portable bf16", "float32", "float16"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(9, 3, 64), (12, 1, 64), (8, 2, 128), (6, 2, 80),
                                                         (4, 2, 96), (6, 3, 160)])
def test_few_long_rows_split_their_context_across_threads(kernel, which, heads, kv_heads, head_size):
    """One or two chat streams with long contexts have fewer (row, KV head) items than two threads
    share evenly, so each kernel (the AVX512-BF16 one, and the portable one of every dtype) cuts
    each row's context into parts and merges the parts' softmaxes (flash-decoding). Peaked scores
    (a few tokens carry each head) make a wrong merge weight visible; contexts off the parts' and
    tiles' sizes, and a short row beside a long one (some of its parts empty). The decode rows sit
    among other query rows (a prefill chunk in the same step) and read other request rows of the
    tables, the query is a slice of a qkv row: the merge must write each row where it belongs."""
    portable = kernel.lib.paged_decode_portable_chunks
    portable.argtypes, portable.restype = [ctypes.c_int64] * 3 + [ctypes.c_int], ctypes.c_int64
    fast = which == "bf16" and _has_avx512_bf16() and head_size % 32 == 0
    split = ((lambda *a: _chunks(kernel, *a)) if fast else
             (lambda B, heads, kv_heads, head_size, max_ctx, threads: portable(B, kv_heads, max_ctx, threads)))
    assert split(2, heads, kv_heads, head_size, 2000, 2) > 0
    assert split(1, heads, kv_heads, head_size, 255, 2) == 0  # short: the attention is small
    assert split(64, heads, kv_heads, head_size, 2000, 2) == 0  # many rows: by KV heads
    assert split(1, heads, kv_heads, head_size, 2000, 1) == 0  # one thread
    assert split(1, heads, kv_heads, head_size, 256, 64) == 4  # many threads: parts of 64 tokens at least
    dtype = {"bf16": torch.bfloat16, "portable bf16": torch.bfloat16}.get(which) or getattr(torch, which)
    k = _portable_bf16(kernel) if which == "portable bf16" else kernel
    tol = TOLERANCE[dtype]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(heads + head_size)
        block_size, nblk, scale = 16, 128, 4 * head_size**-0.5
        for contexts in ([256], [1500], [300, 2000], [2000, 17]):
            B, ctx = len(contexts), torch.tensor(contexts)
            R = B + 1  # request rows of the tables: one more than the decode rows
            tables = torch.randperm(R * nblk, generator=g).view(R, nblk)
            k_cache, v_cache = (torch.randn(R * nblk * block_size, kv_heads, head_size, generator=g).to(dtype)
                                for _ in range(2))
            T, width = B + 3, heads * head_size  # query rows of other tokens between the decode rows
            query = torch.randn(T, width + 2 * kv_heads * head_size, generator=g).to(dtype)[:, :width]
            rows_q = torch.randperm(T, generator=g)[:B].contiguous()
            rows_req = torch.randperm(R, generator=g)[:B].contiguous()
            ctx_of = torch.zeros(R, dtype=torch.long)
            ctx_of[rows_req] = ctx
            ctx_of = ctx_of[rows_req].contiguous()  # the context belongs to the request row
            out = torch.full((T, width), 7.0, dtype=dtype)
            k(query, rows_q, rows_req, k_cache, v_cache, tables, ctx_of, out, num_heads=heads,
              block_size=block_size, scale=scale)
            want = _reference(query, rows_q, rows_req, k_cache, v_cache, tables, ctx_of, heads, block_size, scale)
            torch.testing.assert_close(out[rows_q].double(), want, atol=tol, rtol=tol, msg=f"contexts {contexts}")
            untouched = torch.ones(T, dtype=torch.bool)
            untouched[rows_q] = False
            assert (out[untouched] == 7.0).all(), "the kernel wrote rows that are not decode rows"
    finally:
        torch.set_num_threads(before)


def _share(kernel, cost: list[int], nt: int) -> list[tuple[int, int]]:
    """The items [lo, hi) each of nt threads takes (``thread_share`` in paged_decode.c)."""
    fn = kernel.lib.paged_decode_thread_share
    i64p = ctypes.POINTER(ctypes.c_int64)
    fn.argtypes, fn.restype = [i64p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, i64p, i64p], None
    arr = (ctypes.c_int64 * max(len(cost), 1))(*cost)
    shares = []
    for tid in range(nt):
        lo, hi = ctypes.c_int64(), ctypes.c_int64()
        fn(arr, len(cost), nt, tid, ctypes.byref(lo), ctypes.byref(hi))
        shares.append((lo.value, hi.value))
    return shares


@pytest.mark.parametrize("nt", [1, 2, 3, 4, 7])
def test_threads_share_the_items_by_their_cost(kernel, nt):
    """Each thread takes a run of consecutive items whose cost is its share of the total, give or
    take one item: with long and short rows alternating, items dealt round-robin gave one of two
    threads nearly all the K/V to read. Every item is taken once, by one thread, in order."""
    rng = torch.Generator().manual_seed(nt)
    cases = [[616, 48] * 32, [48, 616] * 32, torch.randint(17, 656, (64,), generator=rng).tolist(),
             [5000] + [20] * 40, [20] * 40 + [5000], [1000] * 8 + [1] * 56, [100] * 3, [7], []]
    for cost in cases:
        shares = _share(kernel, cost, nt)
        taken = [i for lo, hi in shares for i in range(lo, hi)]
        assert taken == list(range(len(cost))), f"{cost}: {shares}"
        if not cost:
            continue
        fair, biggest = sum(cost) / nt, max(cost)
        for lo, hi in shares:
            assert abs(sum(cost[lo:hi]) - fair) <= biggest, f"{cost}: {shares}"


@pytest.mark.parametrize("which", ["bf16", "portable bf16", "float32", "float16"])
@pytest.mark.parametrize("threads", [2, 3])
def test_rows_of_alternating_lengths_on_any_number_of_threads(kernel, which, threads):
    """Decode rows whose contexts alternate long and short, with a prefill chunk's rows among them,
    on two and three threads (the items shared by cost, not dealt round-robin): every row is
    computed once and lands where it belongs."""
    dtype = {"bf16": torch.bfloat16, "portable bf16": torch.bfloat16}.get(which) or getattr(torch, which)
    k = _portable_bf16(kernel) if which == "portable bf16" else kernel
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        heads, kv_heads, head_size, block_size, nblk = 9, 3, 64, 16, 40
        ctx = torch.tensor([333, 9, 400, 40, 287, 1, 512, 33, 301])
        B = len(ctx)
        tables = torch.randperm(B * nblk, generator=g).view(B, nblk)
        k_cache, v_cache = (torch.randn(B * nblk * block_size, kv_heads, head_size, generator=g).to(dtype)
                            for _ in range(2))
        # a prefill chunk of the last request (its last 4 tokens) after the decode rows
        rows_req = torch.cat([torch.arange(B), torch.full((4,), B - 1)])
        ctx_of = torch.cat([ctx, torch.arange(298, 302)])
        T = len(rows_req)
        query = torch.randn(T, heads * head_size, generator=g).to(dtype)
        rows_q = torch.randperm(T, generator=g)
        out = torch.full((T, heads * head_size), 7.0, dtype=dtype)
        k(query, rows_q, rows_req, k_cache, v_cache, tables, ctx_of, out, num_heads=heads, block_size=block_size,
          scale=0.125)
        want = _reference(query, rows_q, rows_req, k_cache, v_cache, tables, ctx_of, heads, block_size, 0.125)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out[rows_q].double(), want, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(before)


def test_torch_flash_uses_amx_needs_the_cpu_flag_and_torch(monkeypatch):
    """Prefills leave the kernel for torch's flash kernel only where that one has AMX tiles: the
    CPU reports amx_bf16 and torch says it can use the tiles."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16", "amx_tile"}))
    assert native.torch_flash_uses_amx()
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512_bf16", "avx512bw", "avx512vl"}))
    assert not native.torch_flash_uses_amx()
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16", "amx_tile"}))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not native.torch_flash_uses_amx()
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert not native.torch_flash_uses_amx()


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("max_ctx", [4096, 12])
def test_backend_runs_prefills_through_the_kernel(monkeypatch, max_ctx, amx):
    """bf16 on a CPU with AVX512-BF16 and no AMX for torch's flash kernel: prefill chunks (a fresh
    one and one after a cached prefix) with a context up to KERNEL_PREFILL_MAX_CTX join the
    kernel's query rows, one row per token with its context up to its own position; a longer one,
    and everything but the decodes elsewhere, keeps torch's SDPA. With AMX (``amx``, whatever
    this CPU has, and the AMX prefill kernel held off) every prefill chunk keeps SDPA. The step's
    output equals the all-torch path's."""
    monkeypatch.setattr(torch_sdpa, "KERNEL_PREFILL_MAX_CTX", max_ctx)
    H, Hk, D = 6, 2, 64
    md, cache, q, k, v = _bf16_mixed_step(4)
    with_kernel = TorchSDPAImpl(H, D, D**-0.5, Hk)
    monkeypatch.setattr(with_kernel._kernel, "sdpa_prefills_faster", amx)
    monkeypatch.setattr(with_kernel._kernel, "amx_prefill", False)  # the AMX kernel: test_cpu_prefill_amx.py
    monkeypatch.setattr(with_kernel._kernel, "_takes_prefill", {})
    without = TorchSDPAImpl(H, D, D**-0.5, Hk)
    without._kernel = None
    cache2 = cache.clone()
    out = with_kernel.forward(None, q, k, v, cache, md)
    fast = _has_avx512_bf16() and not amx
    plan = md.scratch[f"torch_sdpa_plan_0{int(fast)}0"]
    by_token = dict(zip(plan.decode.token_idx.tolist(), plan.decode.ctx.tolist()))
    if not fast:
        assert by_token == {0: 20, 6: 9} and len(plan.prefills) == len(plan.groups) == 1
    elif max_ctx == 4096:
        assert by_token == dict(enumerate([20, 9, 10, 11, 12, 13, 9, 1, 2, 3, 4]))  # causal, after the prefix
        assert not plan.prefills and not plan.groups
    else:  # the chunk after a 8-token prefix reaches 13 > 12: torch SDPA
        assert by_token == {0: 20, 6: 9, 7: 1, 8: 2, 9: 3, 10: 4}
        assert [(p.start, p.end) for p in plan.prefills] == [(1, 6)] and not plan.groups
    md.scratch.clear()
    want = without.forward(None, q, k, v, cache2, md)
    torch.testing.assert_close(out, want, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(9, 3, 64), (12, 12, 64), (8, 2, 128), (4, 1, 32)])
def test_bf16_prefill_rows_against_torch(kernel, heads, kv_heads, head_size):
    """Rows of prefill chunks (consecutive tokens of a request, contexts growing by one) share
    K/V tiles in the AVX512-BF16 kernel, 16 rows at a time: chunks of 1-40 tokens with and without
    a cached prefix, beside decode rows, in any order of requests, against the float64 reference."""
    g = torch.Generator().manual_seed(heads + head_size)
    block_size, nblk = 16, 8
    chunks = [(40, 0), (17, 30), (1, 5), (16, 0), (3, 100), (1, 77), (33, 1)]  # (tokens, cached prefix)
    R = len(chunks)
    tables = torch.randperm(R * nblk, generator=g).view(R, nblk)
    k_cache, v_cache = (torch.randn(R * nblk * block_size, kv_heads, head_size, generator=g).to(torch.bfloat16)
                        for _ in range(2))
    order = torch.randperm(R, generator=g).tolist()
    rows_req = torch.cat([torch.full((chunks[r][0],), r) for r in order])
    ctx = torch.cat([torch.arange(chunks[r][1] + 1, chunks[r][1] + chunks[r][0] + 1) for r in order])
    B = len(ctx)
    query = torch.randn(B + 5, heads * head_size, generator=g).to(torch.bfloat16)
    rows_q = torch.randperm(B + 5, generator=g)[:B].contiguous()
    out = torch.full((B + 5, heads * head_size), 7.0, dtype=torch.bfloat16)
    kernel(query, rows_q, rows_req, k_cache, v_cache, tables, ctx, out, num_heads=heads, block_size=block_size,
           scale=head_size**-0.5)
    want = _reference(query, rows_q, rows_req, k_cache, v_cache, tables, ctx, heads, block_size, head_size**-0.5)
    torch.testing.assert_close(out[rows_q].double(), want, atol=1.6e-2, rtol=1.6e-2)
    untouched = torch.ones(B + 5, dtype=torch.bool)
    untouched[rows_q] = False
    assert (out[untouched] == 7.0).all()


@pytest.mark.parametrize(("heads", "kv_heads"), [(1, 1), (4, 4), (6, 2)])
def test_bf16_prefill_rows_give_the_same_bits_in_any_pairing(kernel, heads, kv_heads):
    """The AVX512-BF16 kernel's P.V takes a run's rows two at a time (its query heads in order, then
    its tokens), the keys both see side by side, each row's own after. Every row adds its keys in
    the same order either way: the same query and keys give the same bits whether the row is
    first or second of a pair, paired with a row of one key more or less or of the same context
    (a KV head's query heads), or left alone at the end of an odd run."""
    g = torch.Generator().manual_seed(heads)
    head_size, block_size, nblk = 64, 16, 4
    tables = torch.randperm(nblk, generator=g).view(1, nblk)
    k_cache, v_cache = (torch.randn(nblk * block_size, kv_heads, head_size, generator=g).to(torch.bfloat16)
                        for _ in range(2))
    query = torch.randn(5, heads * head_size, generator=g).to(torch.bfloat16)
    outs = {}
    for first, n in [(40, 3), (41, 2), (39, 5), (42, 2)]:  # runs of rows with contexts first .. first + n - 1
        ctx = torch.arange(first, first + n)
        rows_q = ctx - 39  # query row i holds the token of context 39 + i, whatever run it is in
        out = torch.zeros(5, heads * head_size, dtype=torch.bfloat16)
        kernel(query, rows_q, torch.zeros(n, dtype=torch.long), k_cache, v_cache, tables, ctx, out,
               num_heads=heads, block_size=block_size, scale=head_size**-0.5)
        for c in ctx.tolist():
            outs.setdefault(c, []).append(out[c - 39])
    for c, rows in outs.items():
        assert all(torch.equal(r, rows[0]) for r in rows), f"context {c}: the bits depend on the pairing"
    assert len(outs[42]) == 4 and len(outs[41]) == 3  # (a run of one row is a decode row: P stays fp32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_bf16_prefill_rows_see_a_non_finite_value_only_from_their_own_context(kernel, bad):
    """A chunk's rows (contexts 1 to 7) with a non-finite V at key 0 to 6: exactly the rows whose
    context holds that key get a non-finite output, whether the row's context is even or odd (the
    AVX512-BF16 kernel multiplies keys in pairs, its last pair at an odd context holding a key past
    the row's own); the other rows are the float64 reference's."""
    g = torch.Generator().manual_seed(9)
    tables = torch.tensor([[1, 0]])
    rows, ctx = torch.arange(7), torch.arange(1, 8)
    query = torch.randn(7, 9 * 64, generator=g).to(torch.bfloat16)
    k_cache = torch.randn(32, 3, 64, generator=g).to(torch.bfloat16)
    for key in range(7):
        v_cache = torch.randn(32, 3, 64, generator=g).to(torch.bfloat16)
        v_cache[16 + key, 1, 5] = bad  # key `key` of the request (block 1 first), KV head 1, element 5
        out = torch.zeros(7, 9 * 64, dtype=torch.bfloat16)
        kernel(query, rows, torch.zeros(7, dtype=torch.int64), k_cache, v_cache, tables, ctx, out, num_heads=9,
               block_size=16, scale=0.125)
        finite = out.isfinite().all(dim=1)
        assert finite.tolist() == [c <= key for c in ctx.tolist()], key
        want = _reference(query, rows, torch.zeros(7, dtype=torch.int64), k_cache, v_cache, tables, ctx, 9, 16,
                          0.125)
        torch.testing.assert_close(out[finite].double(), want[finite], atol=1.6e-2, rtol=1.6e-2)


def test_a_row_without_context_gets_zeros(kernel):
    """No decode row comes without context; one that did gets zeros from every kernel (not what
    was in their scratch memory), beside a row that has one."""
    tables = torch.arange(4).view(2, 2)
    k_cache, v_cache = (torch.randn(64, 3, 64).to(torch.bfloat16) for _ in range(2))
    query = torch.randn(2, 9 * 64).to(torch.bfloat16)
    rows, ctx = torch.arange(2), torch.tensor([0, 20])
    want = _reference(query, rows[1:], rows[1:], k_cache, v_cache, tables, ctx[1:], 9, 16, 0.125)
    for k in (kernel, _portable_bf16(kernel)):
        out = torch.full((2, 9 * 64), float("nan"), dtype=torch.bfloat16)
        k(query, rows, rows, k_cache, v_cache, tables, ctx, out, num_heads=9, block_size=16, scale=0.125)
        assert torch.equal(out[0], torch.zeros(9 * 64, dtype=torch.bfloat16))
        torch.testing.assert_close(out[1:].double(), want, atol=1.6e-2, rtol=1.6e-2)

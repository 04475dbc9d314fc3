"""The reference out-of-tree platform: its hooks, its attention and its op."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from loom.attention.backends.torch_sdpa import TorchSDPAImpl
from loom_platform_dummy import dummy_platform_plugin
from loom_platform_dummy.dummy_attention_backend import DummyAttentionBackend, DummyAttentionImpl
from loom_platform_dummy.dummy_platform import DummyPlatform
from loom_plugin_api import AttentionMetadata, PlatformEnum, resolve_obj_by_qualname


def test_detector_names_the_platform_class():
    cls = resolve_obj_by_qualname(dummy_platform_plugin())
    assert cls is DummyPlatform
    p = DummyPlatform()
    assert p._enum is PlatformEnum.OOT and p.is_out_of_tree() and not p.is_cpu()
    assert p.device_name == "DummyDevice" and p.device_type == "cpu"


def test_check_and_update_config_sets_ops_and_worker():
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(custom_ops=["none"]),
        parallel_config=SimpleNamespace(worker_cls="auto"),
        model_config=SimpleNamespace(dtype="float32"),
    )
    DummyPlatform.check_and_update_config(config)
    assert config.compilation_config.custom_ops == ["all"]
    assert config.parallel_config.worker_cls == "loom_platform_dummy.worker.DummyWorker"
    assert resolve_obj_by_qualname(DummyPlatform.get_attn_backend_cls(None, None)) is DummyAttentionBackend


def test_check_and_update_config_keeps_the_ops_the_user_switched_off():
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(custom_ops=["none", "+rms_norm", "-quantized_linear"]),
        parallel_config=SimpleNamespace(worker_cls="auto"),
        model_config=SimpleNamespace(dtype="float32"),
    )
    DummyPlatform.check_and_update_config(config)
    assert config.compilation_config.custom_ops == ["all", "-quantized_linear"]


def test_block_size_only_changes_when_user_did_not_choose():
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=8, user_block_size=False))
    DummyPlatform.update_block_size_for_backend(config)
    assert config.cache_config.block_size == 16
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=8, user_block_size=True))
    DummyPlatform.update_block_size_for_backend(config)
    assert config.cache_config.block_size == 8


def _metadata(q_lens, ctx_lens, block_size, num_blocks):
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, start = [], [], 0
    max_blocks = max(-(-c // block_size) for c in ctx_lens)
    for q, c in zip(q_lens, ctx_lens):
        n = -(-c // block_size)
        blocks = perm[start : start + n]
        start += n
        tables.append(blocks + [0] * (max_blocks - n))
        for pos in range(c - q, c):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    return AttentionMetadata(
        num_reqs=len(q_lens), num_tokens=sum(q_lens), query_start_loc=cu, seq_lens=torch.tensor(ctx_lens),
        query_lens=list(q_lens), seq_lens_list=list(ctx_lens), max_query_len=max(q_lens),
        max_seq_len=max(ctx_lens), block_tables=torch.tensor(tables), slot_mapping=torch.tensor(slots),
        block_size=block_size,
    )


def test_dummy_attention_matches_torch_sdpa():
    torch.manual_seed(0)
    H, Hk, D, bs, nb = 4, 2, 8, 4, 64
    # decode with history, a fresh prompt, a chunk over a cached prefix, a single token
    q_lens, ctx_lens = [1, 7, 5, 1], [9, 7, 13, 1]
    T = sum(q_lens)
    q, k, v = torch.randn(T, H * D), torch.randn(T, Hk * D), torch.randn(T, Hk * D)
    history = torch.randn(2, nb, bs, Hk, D)
    results = []
    for impl_cls in (DummyAttentionImpl, TorchSDPAImpl):
        cache = history.clone()
        impl = impl_cls(H, D, D**-0.5, Hk)
        results.append(impl.forward(None, q, k, v, cache, _metadata(q_lens, ctx_lens, bs, nb)))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)

"""The CUDA platform's hooks, and its kernels wired into loom's layers and model runner.

Without a GPU these run the Triton kernels in the CPU interpreter on CPU tensors: the
layers call ``forward_cuda`` (as on the CUDA platform), attention runs the Triton backend,
and decode steps replay "graphs" that re-run the model from the static buffers. Each is
compared with loom's CPU path on the same weights.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from loom.engine.arg_utils import EngineArgs
from loom.layers.activation import SiluAndMul
from loom.layers.attention import Attention
from loom.model_loader import get_model
from loom.worker.input_batch import prepare_inputs
from loom.worker.services import EngineWorkerServices
from loom_platform_cuda import kernels
from loom_platform_cuda.attention import TritonAttentionBackend, TritonAttentionImpl
from loom_platform_cuda.model_runner import CudaModelRunner, EagerGraph
from loom_platform_cuda.platform import CudaPlatform
from loom_plugin_api import CustomOp, PlatformEnum, SamplingParams
from loom_plugin_api.model_runner import ModelRunner
from loom_plugin_api.ops.layernorm import RMSNorm
from loom_plugin_api.ops.rotary_embedding import get_rope
from loom_plugin_api.step import NewRequestData, ScheduledRequest, SchedulerOutput
from tiny_models import build_tiny_model

BLOCK = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def overrides():
    CustomOp.clear_kernels()
    CudaPlatform.register_triton_kernel_overrides()
    yield
    CustomOp.clear_kernels()


def test_identity_and_config_hooks():
    p = CudaPlatform()
    assert p._enum is PlatformEnum.CUDA and p.is_cuda()
    assert (p.device_type, p.dispatch_key, p.dist_backend) == ("cuda", "CUDA", "nccl")
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(worker_cls="auto"),
        model_config=SimpleNamespace(dtype="bfloat16", get_head_size=lambda: 64),
    )
    CudaPlatform.check_and_update_config(config)
    assert config.parallel_config.worker_cls == "loom_platform_cuda.worker.CudaWorker"
    config.model_config.get_head_size = lambda: 100
    with pytest.raises(ValueError, match="head size 100"):
        CudaPlatform.check_and_update_config(config)
    assert CudaPlatform.get_attn_backend_cls(None, None).endswith("TritonAttentionBackend")
    assert CudaPlatform.get_device_communicator_cls().endswith("NcclCommunicator")
    with pytest.raises(ValueError, match="TRITON_ATTN"):
        CudaPlatform.get_attn_backend_cls("TORCH_SDPA", None)


def test_block_size_follows_the_backend():
    cache = SimpleNamespace(block_size=8, user_block_size=False)
    CudaPlatform.update_block_size_for_backend(SimpleNamespace(cache_config=cache))
    assert cache.block_size in TritonAttentionBackend.get_supported_block_sizes()
    cache = SimpleNamespace(block_size=8, user_block_size=True)
    with pytest.raises(ValueError, match="--block-size 8"):
        CudaPlatform.update_block_size_for_backend(SimpleNamespace(cache_config=cache))


def test_kernel_overrides_run_under_forward_cuda(overrides):
    assert CustomOp.get_kernel("rms_norm") is kernels.rms_norm
    assert CustomOp.get_kernel("lora") is kernels.lora
    dev = DEVICE
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5).to(dev)
    norm.weight.data.uniform_(0.5, 1.5)
    x, res = torch.randn(5, 64, device=dev), torch.randn(5, 64, device=dev)
    torch.testing.assert_close(norm.forward_cuda(x), norm.forward_native(x), atol=1e-5, rtol=1e-5)
    out, new_res = norm.forward_cuda(x.clone(), res.clone())
    want, want_res = norm.forward_native(x, res)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_res, want_res)
    act = SiluAndMul()
    y = torch.randn(5, 2 * 48, device=dev)
    torch.testing.assert_close(act.forward_cuda(y), act.forward_native(y), atol=1e-6, rtol=1e-5)
    rope = get_rope(32, 32, 128, 10000.0, is_neox_style=True).to(dev)
    pos = torch.tensor([0, 3, 7, 100, 127], device=dev)
    q, k = torch.randn(5, 4 * 32, device=dev), torch.randn(5, 2 * 32, device=dev)
    want_q, want_k = rope.forward_native(pos, q, k)
    got_q, got_k = rope.forward_cuda(pos, q.clone(), k.clone())
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


def test_forward_cuda_without_overrides_is_native():
    CustomOp.clear_kernels()
    norm = RMSNorm(16).to(DEVICE)
    x = torch.randn(3, 16, device=DEVICE)
    torch.testing.assert_close(norm.forward_cuda(x), norm.forward_native(x))


# ---- the model runner -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "llama", "llama", tie=False)


ON_GPU = DEVICE == "cuda"


def _runner(tiny_llama, cuda_path: bool) -> ModelRunner:
    config = EngineArgs(model=str(tiny_llama), max_model_len=128, max_num_seqs=8, block_size=BLOCK,
                        dtype="float32", enforce_eager=not cuda_path).create_engine_config()
    model = get_model(config)
    device = next(model.parameters()).device
    if not cuda_path:
        runner = ModelRunner(config, model, device, EngineWorkerServices())
    elif ON_GPU:  # the CUDA platform built the model: Triton attention, forward_cuda ops
        runner = CudaModelRunner(config, model, device, EngineWorkerServices())
    else:
        # What the CUDA platform builds, on CPU tensors: Triton attention, forward_cuda ops.
        for layer in model.modules():
            if isinstance(layer, Attention):
                layer.impl = TritonAttentionImpl(layer.num_heads, layer.head_size, layer.impl.scale,
                                                 layer.num_kv_heads)
            if isinstance(layer, CustomOp):
                layer._forward_method = layer.forward_cuda
        runner = CudaModelRunner(config, model, device, EngineWorkerServices(), graph_factory=EagerGraph)
    runner.initialize_cache(64)
    return runner


def test_triton_attention_and_graph_replay_match_a_reference(tiny_llama, overrides):
    """Off the GPU the reference is loom's CPU path (torch SDPA, native ops) and the graphs
    re-run the model; on a GPU it is the same CUDA model run eagerly, against real graphs."""
    eager = _runner(tiny_llama, cuda_path=ON_GPU)  # records no graphs
    cuda = _runner(tiny_llama, cuda_path=True)
    cuda.capture_decode_graphs([1, 2, 4])
    assert sorted(cuda.graphs) == [1, 2, 4]
    device = cuda.device
    prompts = {"a": list(range(10, 15)), "b": list(range(20, 37)), "c": list(range(40, 72))}  # 5, 17, 32 tokens
    blocks = {rid: list(range(i * 8, i * 8 + 8))[::-1] for i, rid in enumerate(prompts)}  # scattered, reversed
    params = SamplingParams(temperature=0, max_tokens=8)
    step = SchedulerOutput(
        new_requests=[NewRequestData(req_id=r, sampling_params=params, prompt_len=len(p), prompt_token_ids=p)
                      for r, p in prompts.items()],
        scheduled=[ScheduledRequest(req_id=r, token_ids=p, num_computed_tokens=0, block_ids=blocks[r], sample=True)
                   for r, p in prompts.items()],
    )
    context = {r: 0 for r in prompts}  # tokens in the KV cache before the step
    last: dict[str, int] = {}
    replays = 0
    for live in (["a", "b", "c"], ["a", "b", "c"], ["a", "b"], ["a", "c"]):  # graphs of 4, 4, 2, 2
        inputs = prepare_inputs(step, BLOCK, device)
        replays += cuda._graph_for(inputs) is not None
        with torch.inference_mode():
            want = eager.run_model(inputs).clone()
            got = cuda.run_model(prepare_inputs(step, BLOCK, device))
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        out = eager.execute_model(step)
        assert cuda.execute_model(step).sampled_token_ids == out.sampled_token_ids
        for sched in step.scheduled:
            context[sched.req_id] += len(sched.token_ids)
        last.update(zip(out.req_ids, out.sampled_token_ids))
        step = SchedulerOutput(scheduled=[
            ScheduledRequest(req_id=r, token_ids=[last[r]], num_computed_tokens=context[r], block_ids=blocks[r],
                             sample=True, num_output_tokens=1)
            for r in live
        ])
    assert replays == 3  # the prefill ran eagerly, every decode step replayed a graph


def test_profile_run_runs_the_largest_step_and_frees_its_cache(tiny_llama):
    config = EngineArgs(model=str(tiny_llama), max_model_len=128, max_num_batched_tokens=300,
                        block_size=BLOCK).create_engine_config()
    model = get_model(config)
    runner = CudaModelRunner(config, model, next(model.parameters()).device, EngineWorkerServices())
    calls = []
    run_model = runner.run_model
    runner.run_model = lambda inputs: calls.append(inputs.attn_metadata) or run_model(inputs)
    with torch.inference_mode():
        runner.profile_run()
    (md,) = calls
    assert md.num_tokens == 300 and md.query_lens == [128, 128, 44]  # the token budget, as prefills
    assert all(layer.kv_cache.numel() == 0 for layer in runner.attn_layers)

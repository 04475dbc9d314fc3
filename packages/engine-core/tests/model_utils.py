"""Run a loom model outside the engine: bind KV caches, build AttentionMetadata, step.

``ModelRunnerHarness(model)`` gives every request its own run of consecutive blocks and
keeps the caches between steps, so a test can prefill and then decode:

    h = ModelRunnerHarness(model)
    logits = h.step({0: prompt_a, 1: prompt_b})      # prefill both -> logits of every new token
    logits = h.step({0: [next_a], 1: [next_b]})      # decode one token each
"""

from __future__ import annotations

import torch
import torch.nn as nn
from loom.layers.attention import Attention
from loom_plugin_api import AttentionMetadata
from loom_plugin_api.context import set_forward_context
from loom_plugin_api.ops.quantized_linear import QuantizedLinear


class ModelRunnerHarness:
    def __init__(self, model: nn.Module, block_size: int = 16, max_blocks_per_req: int = 16,
                 max_reqs: int = 4) -> None:
        self.model = model
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        self.seq_lens: dict[int, int] = {}
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        if not layers:
            raise ValueError("the model has no loom Attention layers")
        num_blocks = max_reqs * max_blocks_per_req
        param = next(model.parameters())
        for layer in layers:
            layer.kv_cache = torch.zeros(2, num_blocks, block_size, layer.num_kv_heads, layer.head_size,
                                         dtype=param.dtype, device=param.device)

    def _blocks(self, req: int) -> list[int]:
        return list(range(req * self.max_blocks_per_req, (req + 1) * self.max_blocks_per_req))

    def build_metadata(self, new_tokens: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flattened input ids, positions and metadata for one step; advances the lengths."""
        ids, positions, slots, q_lens, s_lens, tables = [], [], [], [], [], []
        for req, tokens in new_tokens.items():
            start = self.seq_lens.get(req, 0)
            end = start + len(tokens)
            if end > self.block_size * self.max_blocks_per_req:
                raise ValueError(f"request {req} needs more than {self.max_blocks_per_req} blocks")
            blocks = self._blocks(req)
            ids += tokens
            positions += list(range(start, end))
            slots += [blocks[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]
            q_lens.append(len(tokens))
            s_lens.append(end)
            tables.append(blocks)
            self.seq_lens[req] = end
        query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
        query_start_loc[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int64), 0)
        md = AttentionMetadata(
            num_reqs=len(q_lens),
            num_tokens=len(ids),
            query_start_loc=query_start_loc,
            seq_lens=torch.tensor(s_lens, dtype=torch.int64),
            query_lens=q_lens,
            seq_lens_list=s_lens,
            max_query_len=max(q_lens),
            max_seq_len=max(s_lens),
            block_tables=torch.tensor(tables, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_size=self.block_size,
        )
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), md

    @torch.inference_mode()
    def step(self, new_tokens: dict[int, list[int]]) -> torch.Tensor:
        """Run one step; returns the logits of every new token, ``(num_tokens, vocab)``."""
        input_ids, positions, md = self.build_metadata(new_tokens)
        with set_forward_context(md):
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden)

    def reset(self) -> None:
        self.seq_lens.clear()


def run_prefill(model: nn.Module, prompts: list[list[int]], block_size: int = 16) -> list[torch.Tensor]:
    """Prefill ``prompts`` in one step; returns each prompt's logits ``(len, vocab)``."""
    blocks = max(len(p) for p in prompts) // block_size + 1
    h = ModelRunnerHarness(model, block_size=block_size, max_blocks_per_req=blocks, max_reqs=len(prompts))
    logits = h.step(dict(enumerate(prompts)))
    return list(logits.split([len(p) for p in prompts]))


def greedy_generate(model: nn.Module, prompt: list[int], max_new_tokens: int, block_size: int = 16) -> list[int]:
    """Greedy decoding: prefill the prompt, then decode one token per step with the KV cache."""
    blocks = (len(prompt) + max_new_tokens) // block_size + 1
    h = ModelRunnerHarness(model, block_size=block_size, max_blocks_per_req=blocks, max_reqs=1)
    out: list[int] = []
    logits = h.step({0: prompt})
    for _ in range(max_new_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        logits = h.step({0: [token]})
    return out


def make_config(model: str, **engine_args):
    """A ``LoomConfig`` for ``model`` through ``EngineArgs`` (fp32 unless told otherwise)."""
    from loom.engine.arg_utils import EngineArgs
    from loom.models import register_builtin_models

    register_builtin_models()  # idempotent; `import loom` does it once the package __init__ does
    engine_args.setdefault("dtype", "float32")
    return EngineArgs(model=model, **engine_args).create_engine_config()


def install_quantized_kernel() -> None:
    """The CPU platform's ``quantized_linear`` kernel, as ``CpuPlatform`` installs it in a worker."""
    from loom.layers.quantized import cpu_quantized_linear
    from loom_plugin_api import CustomOp

    CustomOp.register_kernel("quantized_linear", cpu_quantized_linear)


def tp_prefill_worker(rank: int, world_size: int, init_file: str, model_dirs: list[str],
                      prompts: list[list[int]], out_path: str, engine_args: dict | None = None) -> None:
    """Child of ``torch.multiprocessing.spawn``: one TP rank over gloo; rank 0 saves the logits."""
    import torch.distributed as dist
    from loom.distributed import destroy_model_parallel, initialize_model_parallel
    from loom.model_loader import get_model

    torch.set_num_threads(1)
    install_quantized_kernel()  # as the CPU platform does in a worker
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        initialize_model_parallel(world_size)
        results = {}
        for model_dir in model_dirs:
            model = get_model(make_config(model_dir, tensor_parallel_size=world_size, **(engine_args or {})))
            results[model_dir] = run_prefill(model, prompts)
            results[model_dir + ":quantized layers"] = sum(isinstance(getattr(m, "weight", None), QuantizedLinear)
                                                      for m in model.modules())
        if rank == 0:
            torch.save(results, out_path)
        # Tear gloo down only when both ranks are done: a rank that leaves early while
        # the other still holds the pair can abort in gloo's threads.
        dist.barrier()
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()

"""The CPU platform's worker: the contract's ``CPUWorker`` (``loom_plugin_api.cpu_worker``, which
platforms computing in host memory subclass without importing the engine) with a runner that
replays decode steps (``cpu_step_replay``). The CPU platform names it by this path.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from loom_plugin_api.cpu_worker import CPUWorker as _ContractCPUWorker
from loom_plugin_api.model_runner import ModelRunner
from loom_plugin_api.step import ModelInput

from ..attention.backends import native
from ..attention.backends.torch_sdpa import TorchSDPAImpl
from ..attention.backends.torch_sdpa_int8 import TorchSDPAInt8Impl
from ..logger import init_logger
from ..platforms import cpu_kernels
from .cpu_step_replay import StepGraph, StepReplayError

logger = init_logger(__name__)

__all__ = ["CPUWorker", "CpuModelRunner"]


REPLAY_GRAPHS = 4
"""Captured decode steps kept at once, one per batch size; the least recently replayed goes first."""
REPLAY_MEMORY = 256 << 20
"""Bytes the kept graphs' buffers may hold together (a graph keeps every tensor its step made)."""
CAPTURE_AFTER = 8
"""A batch of several requests is captured at this many decode steps in a row of its size: a
capture and the checked replay after it cost about one eager step more than two eager steps, and
the default model's 64-request step saves 14% replayed, so a graph pays back after about eight
replays. At 4, requests arriving as a Poisson stream (16 a second, 64 of them) were served 5%
slower than with ``--enforce-eager``: sizes captured on the way in and out rarely stayed."""


class CpuModelRunner(ModelRunner):
    """``ModelRunner`` whose decode steps (one token per request, no LoRA) are captured once per
    batch size and then replayed; every other step runs eagerly. A lone request's step is
    captured at once; a batch of several at its ``CAPTURE_AFTER``-th decode step in a row of that
    size, so that sizes passing through (requests joining and finishing) do not each pay for a
    capture. Up to ``REPLAY_GRAPHS`` graphs within ``REPLAY_MEMORY`` are kept; a step whose buffers
    alone pass ``REPLAY_MEMORY`` keeps its batch size and larger ones eager. ``enforce_eager``
    keeps every step eager, and so does a capture refused for what the model does (logged once)
    or a replay that fails or differs from its eager step, whatever the batch size: both mean the
    model's steps cannot be replayed as recorded."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._graphs: OrderedDict[int, StepGraph] = OrderedDict()
        self._too_large: int | None = None  # the smallest batch size whose step outgrew REPLAY_MEMORY
        self._streak = (0, 0)  # (batch size, decode steps in a row of it) up to this step
        kernel, dtype = native.paged_decode(), self.config.model_config.torch_dtype
        # the decode attention must be the compiled kernel: the torch path would replay a gather
        # over the whole capacity (max_model_len) every step
        self._replay = (not self.config.compilation_config.enforce_eager
                        and kernel is not None and cpu_kernels.kernels() is not None
                        and all(isinstance(layer.impl, TorchSDPAImpl) and layer.impl.decodes_in_kernel(dtype)
                                for layer in self.attn_layers))
        slow = next((layer.impl for layer in self.attn_layers if isinstance(layer.impl, TorchSDPAInt8Impl)
                     and not layer.impl.decodes_in_kernel(dtype)), None)
        if slow is not None:
            logger.warning("--kv-cache-dtype int8: no int8 decode kernel here for %s with head size %d (it takes "
                           "bf16 models, head sizes that are multiples of 32 up to 256, on CPUs with AVX512-VNNI): "
                           "decode attention gathers and dequantizes K/V, slower than the model's dtype would run",
                           dtype, slow.head_size)

    def initialize_cache(self, num_blocks: int) -> None:
        super().initialize_cache(num_blocks)
        self._graphs.clear()  # they point into the old cache

    def run_model(self, inputs: ModelInput) -> torch.Tensor:
        md = inputs.attn_metadata
        batch = md.num_reqs
        decode = (self._replay and inputs.lora_mapping is None and md.num_tokens == batch
                  and md.max_query_len == 1)
        streak = self._streak[1] + 1 if decode and self._streak[0] == batch else int(decode)
        self._streak = (batch if decode else 0, streak)
        if not decode or (self._too_large is not None and batch >= self._too_large):
            return super().run_model(inputs)
        graph = self._graphs.get(batch)
        if graph is not None and graph.fits(md):
            self._graphs.move_to_end(batch)
            return self._replayed(graph, inputs)
        max_blocks = math.ceil(self.config.model_config.max_model_len / md.block_size)
        if md.block_tables.shape[1] > max_blocks or (batch > 1 and streak < CAPTURE_AFTER):
            return super().run_model(inputs)
        graph, hidden, why, too_large = StepGraph.capture(self.model, inputs.input_ids, inputs.positions, md,
                                                          max_blocks, REPLAY_MEMORY)
        if too_large:
            self._too_large = batch
            logger.info("Decode steps of %d or more requests run eagerly: %s (REPLAY_MEMORY)", batch, why)
        elif graph is None:
            self._stop_replay()
            logger.info("Decode steps run eagerly: %s", why)
        else:
            self._graphs[batch] = graph
            while len(self._graphs) > REPLAY_GRAPHS or sum(g.nbytes for g in self._graphs.values()) > REPLAY_MEMORY:
                self._graphs.popitem(last=False)
            logger.debug("Captured a decode step of %d request(s): %d operations, %.1f MiB", batch, graph.num_ops,
                         graph.nbytes / (1 << 20))
        return hidden

    def _replayed(self, graph: StepGraph, inputs: ModelInput) -> torch.Tensor:
        """The step through ``graph``: its first replay is checked against an eager run; a
        failure or a difference turns replay off for good (the eager step answers)."""
        md = inputs.attn_metadata
        try:
            if graph.checked:
                return graph.replay(inputs.input_ids, inputs.positions, md)
            hidden, same = graph.check(self.model, inputs.input_ids, inputs.positions, md)
        except StepReplayError as e:  # a kernel's error code: the eager step raises it properly, or runs
            self._stop_replay()
            logger.warning("A replayed decode step failed (%s); decode steps run eagerly from now on", e)
            return super().run_model(inputs)  # rewrites whatever K/V the replay wrote for this token
        if same:
            graph.checked = True
        else:
            self._stop_replay()
            logger.warning("A replayed decode step differed from the eager step; decode steps run eagerly from "
                           "now on (the model passes a per-step Python value to a kernel?)")
        return hidden

    def _stop_replay(self) -> None:
        self._replay = False
        self._graphs.clear()


class CPUWorker(_ContractCPUWorker):
    model_runner: CpuModelRunner
    model_runner_cls = CpuModelRunner

"""The CPU platform's worker: the contract's ``CPUWorker`` (``loom_plugin_api.cpu_worker``, which
platforms computing in host memory subclass without importing the engine) with a runner that
replays one stream's decode steps (``cpu_step_replay``). The CPU platform names it by this path.
"""

from __future__ import annotations

import math

import torch
from loom_plugin_api.cpu_worker import CPUWorker as _ContractCPUWorker
from loom_plugin_api.model_runner import ModelRunner
from loom_plugin_api.step import ModelInput

from ..attention.backends import native
from ..attention.backends.torch_sdpa import TorchSDPAImpl
from ..logger import init_logger
from ..platforms import cpu_kernels
from .cpu_step_replay import StepGraph, StepReplayError

logger = init_logger(__name__)

__all__ = ["CPUWorker", "CpuModelRunner"]


class CpuModelRunner(ModelRunner):
    """``ModelRunner`` whose decode step of a single request (one chat stream, no LoRA) is
    captured once and then replayed; every other step runs eagerly. ``enforce_eager`` (and a
    capture that is refused, logged once) keeps every step eager."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._graph: StepGraph | None = None
        self._checked = False  # the graph's first replay matched an eager run of the same step
        kernel, dtype = native.paged_decode(), self.config.model_config.torch_dtype
        # the decode attention must be the compiled kernel: the torch path would replay a gather
        # over the whole capacity (max_model_len) every step
        self._replay = (not self.config.compilation_config.enforce_eager
                        and kernel is not None and cpu_kernels.kernels() is not None
                        and all(isinstance(layer.impl, TorchSDPAImpl) and kernel.supports(dtype, layer.impl.head_size)
                                for layer in self.attn_layers))

    def initialize_cache(self, num_blocks: int) -> None:
        super().initialize_cache(num_blocks)
        self._graph, self._checked = None, False  # it points into the old cache

    def run_model(self, inputs: ModelInput) -> torch.Tensor:
        md = inputs.attn_metadata
        if not self._replay or inputs.lora_mapping is not None or md.num_reqs != 1 or md.num_tokens != 1:
            return super().run_model(inputs)
        if self._graph is not None and self._graph.fits(md):
            try:
                if self._checked:
                    return self._graph.replay(inputs.input_ids, inputs.positions, md)
                hidden, same = self._graph.check(self.model, inputs.input_ids, inputs.positions, md)
            except StepReplayError as e:  # a kernel's error code: the eager step raises it properly, or runs
                self._graph, self._replay = None, False
                logger.warning("A replayed one-stream decode step failed (%s); decode steps run eagerly from now on", e)
                return super().run_model(inputs)  # rewrites whatever K/V the replay wrote for this token
            if same:
                self._checked = True
            else:
                self._graph, self._replay = None, False
                logger.warning("A replayed one-stream decode step differed from the eager step; decode steps "
                               "run eagerly from now on (the model passes a per-step Python value to a kernel?)")
            return hidden
        max_blocks = math.ceil(self.config.model_config.max_model_len / md.block_size)
        if md.block_tables.shape[1] > max_blocks:
            return super().run_model(inputs)
        graph, hidden, why = StepGraph.capture(self.model, inputs.input_ids, inputs.positions, md, max_blocks)
        if graph is None:
            self._replay = False
            logger.info("One-stream decode steps run eagerly: %s", why)
        else:
            self._graph, self._checked = graph, False
            logger.debug("Captured a one-stream decode step: %d operations", graph.num_ops)
        return hidden


class CPUWorker(_ContractCPUWorker):
    model_runner: CpuModelRunner
    model_runner_cls = CpuModelRunner

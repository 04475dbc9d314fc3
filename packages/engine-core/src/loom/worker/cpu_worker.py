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
from ..logger import init_logger
from ..platforms import cpu_kernels
from .cpu_step_replay import StepGraph, StepReplayError

logger = init_logger(__name__)

__all__ = ["CPUWorker", "CpuModelRunner"]


REPLAY_GRAPHS = 4
"""Captured decode steps kept at once, one per batch size; the least recently replayed goes first."""
REPLAY_MEMORY = 256 << 20
"""Bytes the kept graphs' buffers may hold together (a graph keeps every tensor its step made)."""


class CpuModelRunner(ModelRunner):
    """``ModelRunner`` whose decode steps (one token per request, no LoRA) are captured once per
    batch size and then replayed; every other step runs eagerly. A lone request's step is
    captured at once; a batch of several at its second decode step in a row of that size, so that
    sizes passing through (requests joining and finishing) do not each pay for a capture. Up to
    ``REPLAY_GRAPHS`` graphs within ``REPLAY_MEMORY`` are kept. ``enforce_eager`` keeps every step
    eager; a capture that is refused keeps that batch size eager (logged once)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._graphs: OrderedDict[int, StepGraph] = OrderedDict()
        self._checked: set[int] = set()  # batch sizes whose graph's first replay matched an eager run
        self._refused: set[int] = set()
        self._last_decode = 0  # the batch size of the previous step, if it was a decode step
        kernel, dtype = native.paged_decode(), self.config.model_config.torch_dtype
        # the decode attention must be the compiled kernel: the torch path would replay a gather
        # over the whole capacity (max_model_len) every step
        self._replay = (not self.config.compilation_config.enforce_eager
                        and kernel is not None and cpu_kernels.kernels() is not None
                        and all(isinstance(layer.impl, TorchSDPAImpl) and kernel.supports(dtype, layer.impl.head_size)
                                for layer in self.attn_layers))

    def initialize_cache(self, num_blocks: int) -> None:
        super().initialize_cache(num_blocks)
        self._graphs.clear()  # they point into the old cache
        self._checked.clear()

    def run_model(self, inputs: ModelInput) -> torch.Tensor:
        md = inputs.attn_metadata
        batch = md.num_reqs
        decode = self._replay and inputs.lora_mapping is None and md.num_tokens == batch
        previous, self._last_decode = self._last_decode, batch if decode else 0
        if not decode or batch in self._refused:
            return super().run_model(inputs)
        graph = self._graphs.get(batch)
        if graph is not None and graph.fits(md):
            self._graphs.move_to_end(batch)
            return self._replayed(graph, inputs)
        max_blocks = math.ceil(self.config.model_config.max_model_len / md.block_size)
        if md.block_tables.shape[1] > max_blocks or (batch > 1 and previous != batch):
            return super().run_model(inputs)
        graph, hidden, why = StepGraph.capture(self.model, inputs.input_ids, inputs.positions, md, max_blocks)
        if graph is not None and graph.nbytes > REPLAY_MEMORY:
            graph, why = None, f"its buffers ({graph.nbytes / (1 << 20):.0f} MiB) exceed REPLAY_MEMORY"
        if graph is None:
            self._refused.add(batch)
            log = logger.info if len(self._refused) == 1 else logger.debug
            log("Decode steps of %d request(s) run eagerly: %s", batch, why)
        else:
            self._graphs[batch] = graph
            self._checked.discard(batch)
            while len(self._graphs) > REPLAY_GRAPHS or sum(g.nbytes for g in self._graphs.values()) > REPLAY_MEMORY:
                self._checked.discard(self._graphs.popitem(last=False)[0])
            logger.debug("Captured a decode step of %d request(s): %d operations, %.1f MiB", batch, graph.num_ops,
                         graph.nbytes / (1 << 20))
        return hidden

    def _replayed(self, graph: StepGraph, inputs: ModelInput) -> torch.Tensor:
        """The step through ``graph``: its first replay is checked against an eager run; a
        failure or a difference turns replay off for good (the eager step answers)."""
        md = inputs.attn_metadata
        try:
            if graph.batch in self._checked:
                return graph.replay(inputs.input_ids, inputs.positions, md)
            hidden, same = graph.check(self.model, inputs.input_ids, inputs.positions, md)
        except StepReplayError as e:  # a kernel's error code: the eager step raises it properly, or runs
            self._stop_replay()
            logger.warning("A replayed decode step failed (%s); decode steps run eagerly from now on", e)
            return super().run_model(inputs)  # rewrites whatever K/V the replay wrote for this token
        if same:
            self._checked.add(graph.batch)
        else:
            self._stop_replay()
            logger.warning("A replayed decode step differed from the eager step; decode steps run eagerly from "
                           "now on (the model passes a per-step Python value to a kernel?)")
        return hidden

    def _stop_replay(self) -> None:
        self._replay = False
        self._graphs.clear()
        self._checked.clear()


class CPUWorker(_ContractCPUWorker):
    model_runner: CpuModelRunner
    model_runner_cls = CpuModelRunner

"""``CudaModelRunner``: loom's model runner plus decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is bound by kernel launches (a few hundred per
step), not by the GPU. After the KV cache exists the runner records one decode step per
batch size in ``cudagraph_capture_sizes`` into a graph, reading static input buffers. A
decode-only batch of ``n`` requests then copies its inputs into those buffers, pads to the
smallest recorded size ``>= n`` (padding rows write to no cache slot and read one cached
token) and replays. Prefill, mixed and larger batches run eagerly.

Graph recording is an injectable factory: ``torch.cuda.CUDAGraph`` on a GPU; the tests on
CPU record "graphs" that re-run the model, which checks the static buffers and padding.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from loom_plugin_api import (
    AttentionMetadata,
    ModelInput,
    ModelRunner,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
    WorkerServices,
    set_forward_context,
)

logger = logging.getLogger("loom.platform_cuda.model_runner")

__all__ = ["CudaGraph", "CudaModelRunner", "EagerGraph"]


class CudaGraph:
    """One recorded decode step (``torch.cuda.CUDAGraph``), sharing a memory pool."""

    def __init__(self, pool: Any = None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.output: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> None:
        # thread_local: NCCL's watchdog thread may query events while a TP>1 step records.
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            self.output = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        assert self.output is not None
        return self.output

    def memory_pool(self) -> Any:
        return self.graph.pool()


class EagerGraph:
    """Stands in for a CUDA graph off the GPU: ``replay`` runs the recorded function again."""

    def __init__(self, pool: Any = None) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        fn()

    def replay(self) -> torch.Tensor:
        assert self.fn is not None
        return self.fn()

    def memory_pool(self) -> Any:
        return None


@dataclass(slots=True)
class _StaticInputs:
    """Device buffers a recorded decode step reads; sized for the largest batch."""

    input_ids: torch.Tensor  # (B,)
    positions: torch.Tensor  # (B,)
    slot_mapping: torch.Tensor  # (B,)
    seq_lens: torch.Tensor  # (B,)
    block_tables: torch.Tensor  # (B, max_blocks)
    query_start_loc: torch.Tensor  # (B + 1,) = arange: one token per request

    @classmethod
    def allocate(cls, batch: int, max_blocks: int, device: torch.device) -> _StaticInputs:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(zeros(batch), zeros(batch), zeros(batch), zeros(batch) + 1, zeros(batch, max_blocks),
                   torch.arange(batch + 1, dtype=torch.int64, device=device))

    def metadata(self, batch: int, block_size: int, max_seq_len: int) -> AttentionMetadata:
        # max_seq_len is the model's limit, not the batch's: the kernel's launch shape must
        # not change between replays. Rows shorter than it skip the key blocks they lack.
        return AttentionMetadata(
            num_reqs=batch, num_tokens=batch, query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch], query_lens=[1] * batch, seq_lens_list=[max_seq_len] * batch,
            max_query_len=1, max_seq_len=max_seq_len, block_tables=self.block_tables[:batch],
            slot_mapping=self.slot_mapping[:batch], block_size=block_size,
        )


class CudaModelRunner(ModelRunner):
    def __init__(self, config: Any, model: torch.nn.Module, device: torch.device, services: WorkerServices,
                 graph_factory: Callable[[Any], Any] | None = None) -> None:
        super().__init__(config, model, device, services)
        # One LM-head matmul and an argmax beat the chunked, launch-bound argmax on a GPU
        # (about 375 small kernels per step for a 128k vocabulary).
        self._fused_greedy = None
        self.graph_factory = graph_factory or CudaGraph
        self.graphs: dict[int, tuple[Any, AttentionMetadata]] = {}
        self.static: _StaticInputs | None = None

    # ---- memory profiling ----------------------------------------------------------------
    @torch.inference_mode()
    def profile_run(self) -> int:
        """Run the largest step the scheduler can make (its token budget as prefills, then
        sampling with top-k/top-p/logprobs over ``max_num_seqs`` rows) so that the allocator's
        peak is known. Returns the bytes of the temporary KV cache it used (and freed)."""
        sched = self.config.scheduler_config
        block_size = self.config.cache_config.block_size
        max_len = int(self.config.model_config.max_model_len)
        tokens = sched.max_num_batched_tokens
        lengths = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
        blocks = sum(math.ceil(n / block_size) for n in lengths)
        self.initialize_cache(blocks)
        scheduled, next_block = [], 0
        for i, n in enumerate(lengths):
            nb = math.ceil(n / block_size)
            scheduled.append(ScheduledRequest(req_id=f"profile-{i}", token_ids=[0] * n, num_computed_tokens=0,
                                              block_ids=list(range(next_block, next_block + nb)), sample=True))
            next_block += nb
        inputs = self.services.prepare_inputs(SchedulerOutput(scheduled=scheduled), block_size, self.device)
        hidden = self.run_model(inputs)
        rows = sched.max_num_seqs
        logits = self.model.compute_logits(hidden[-1:].expand(rows, -1)).float()  # the sampler's input at its largest
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=20)
        self.sampler(logits, self.services.sampling_metadata([params] * rows, [None] * rows, [0] * rows, None, None, None))
        del hidden, logits
        for layer in self.attn_layers:
            layer.kv_cache = torch.empty(0, device=self.device)
        return blocks * self.kv_cache_block_bytes()

    # ---- graphs --------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_decode_graphs(self, sizes: list[int]) -> None:
        """Record one decode step per batch size (after ``initialize_cache``)."""
        sizes = sorted({s for s in sizes if s <= self.config.scheduler_config.max_num_seqs})
        if not sizes:
            return
        block_size = self.config.cache_config.block_size
        max_len = int(self.config.model_config.max_model_len)
        self.static = st = _StaticInputs.allocate(sizes[-1], math.ceil(max_len / block_size), self.device)
        pool = None
        for batch in reversed(sizes):  # largest first: the smaller graphs fit in its memory pool
            md = st.metadata(batch, block_size, max_len)
            st.slot_mapping[:batch].fill_(-1)  # recording writes no KV

            def step(batch: int = batch, md: AttentionMetadata = md) -> torch.Tensor:
                md.scratch.clear()
                with set_forward_context(md):
                    return self.model(st.input_ids[:batch], st.positions[:batch])

            step()  # warm up: Triton compiles, the allocator settles
            graph = self.graph_factory(pool)
            graph.capture(step)
            pool = pool if pool is not None else graph.memory_pool()
            self.graphs[batch] = (graph, md)
        logger.info("Recorded decode steps as graphs for batch sizes %s", sizes)

    def _graph_for(self, inputs: ModelInput) -> int | None:
        md = inputs.attn_metadata
        if not self.graphs or not md.is_decode_only or md.num_tokens != md.num_reqs:
            return None
        if inputs.lora_mapping is not None:  # graphs are recorded without adapters: run eagerly
            return None
        return next((size for size in sorted(self.graphs) if size >= md.num_reqs), None)

    def run_model(self, inputs: ModelInput) -> torch.Tensor:
        size = self._graph_for(inputs)
        if size is None:
            return super().run_model(inputs)
        md, st = inputs.attn_metadata, self.static
        assert st is not None
        n = md.num_reqs
        st.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        st.positions[:n].copy_(inputs.positions, non_blocking=True)
        st.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        st.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        st.block_tables[:n, : md.block_tables.shape[1]].copy_(md.block_tables, non_blocking=True)
        if size > n:  # padding rows: no KV written, one cached token read, outputs dropped
            st.input_ids[n:size].zero_()
            st.positions[n:size].zero_()
            st.slot_mapping[n:size].fill_(-1)
            st.seq_lens[n:size].fill_(1)
            st.block_tables[n:size].zero_()
        graph, _ = self.graphs[size]
        return graph.replay()[:n]

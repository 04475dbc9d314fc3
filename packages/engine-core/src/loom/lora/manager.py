"""The worker's adapters: which are loaded, which sit in the layers' slots, and each step's mapping.

:class:`LoRAModelManager` gives every linear layer of the model's decoder layers its
:class:`~loom.lora.layers.LoRASlots` and then, each step (:meth:`prepare`), makes sure the
step's adapters are in slots and returns the :class:`LoRAMapping` that tells every layer which
rows use which slot. Adapters load from their PEFT directory the first time a request names
them (the ``LoRARequest`` in the step's ``NewRequestData``), already sharded for this rank and
scaled; up to ``--max-cpu-loras`` stay loaded, the least recently used evicted. Slots are
reused least recently used first, never one the step needs. The engine core's scheduler puts at
most ``--max-loras`` adapters in a step, so a step always finds its slots.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn
from loom_plugin_api.lora import LoRARequest
from loom_plugin_api.ops.lora import LoRAMapping
from loom_plugin_api.step import SchedulerOutput

from ..config import LoomConfig
from ..layers.linear import LinearBase
from ..logger import init_logger
from .layers import LoRASlots, StepAdapters
from .peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_adapter

logger = init_logger(__name__)

__all__ = ["LoRALoadError", "LoRAModelManager"]

Adapter = dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]
"""Loom module name -> slice index -> this rank's (A, scaled B)."""


class LoRALoadError(RuntimeError):
    """A worker could not load an adapter a step needs; the message starts with ``LoRA adapter``."""


def _stamp(path: str) -> tuple[int, ...]:
    out: list[int] = []
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        st = os.stat(os.path.join(path, name))
        out += [st.st_size, st.st_mtime_ns]
    return tuple(out)


class LoRAModelManager:
    def __init__(self, model: nn.Module, config: LoomConfig, device: torch.device) -> None:
        lora = config.lora_config
        self.model = model
        self.hf_config = config.model_config.hf_config
        self.max_loras = lora.max_loras
        self.max_rank = lora.max_lora_rank
        self.max_cpu_loras = lora.max_cpu_loras or lora.max_loras
        self.dtype = config.model_config.torch_dtype
        self.device = device
        self.stacked = list(getattr(model, "stacked_params_mapping", []))
        self._rename = getattr(model, "_rename", lambda name: name)
        self.layers: dict[str, LoRASlots] = {}
        self.state = StepAdapters()
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and ".layers." in f".{name}":
                module.lora = LoRASlots(module, self.max_loras, self.max_rank, self.dtype, device, self.state)
                self.layers[name] = module.lora
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no linear layers in decoder layers for LoRA adapters")
        self.stamps: dict[int, tuple[int, ...]] = {}
        """Size and modification time of each adapter's files when first loaded, by id."""
        self.known: dict[int, LoRARequest] = {}
        """Every adapter a request brought, by id: where to load it from again after an eviction."""
        self.loaded: OrderedDict[int, Adapter] = OrderedDict()
        self.slot_ids: list[int | None] = [None] * self.max_loras
        self._slot_use: list[int] = [0] * self.max_loras
        self._clock = 0
        logger.info("LoRA: %d layers with %d slots of rank %d; %d adapters kept loaded", len(self.layers),
                    self.max_loras, self.max_rank, self.max_cpu_loras)

    # ---- loading ------------------------------------------------------------------------------
    def _target(self, hf_module: str) -> tuple[str, int]:
        """(loom layer name, slice index) of an HF module name of the adapter."""
        name = self._rename(hf_module)
        for param_name, checkpoint_name, shard_id in self.stacked:
            if name.endswith(checkpoint_name):
                target = name[: -len(checkpoint_name)] + param_name
                slots = self.layers.get(target)
                if slots is not None and shard_id in slots.slices:
                    return target, slots.slices.index(shard_id)
        if name in self.layers:
            return name, 0
        raise ValueError(f"module {hf_module!r} of the adapter is not a linear layer of the model's decoder layers")

    def load(self, request: LoRARequest) -> Adapter:
        """Read, check, shard and scale an adapter's weights (for this rank, in the model's dtype).
        Any failure is a :class:`LoRALoadError` naming the adapter (the engine then refuses its id)."""
        try:
            return self._load(request)
        except Exception as e:
            raise LoRALoadError(f"LoRA adapter {request.lora_name!r} (id {request.lora_int_id}) cannot be loaded: "
                                f"{type(e).__name__}: {e}") from e

    def _load(self, request: LoRARequest) -> Adapter:
        from safetensors.torch import load_file  # lazy: a worker without adapters never reads one

        stamp = _stamp(request.lora_path)
        first = self.stamps.setdefault(request.lora_int_id, stamp)
        if stamp != first:
            raise ValueError(f"its files at {request.lora_path} changed since it was first loaded (a reload would "
                             "run other weights under the same id); load the new version under another name")
        info = check_adapter(request.lora_path, self.hf_config, self.max_rank, name=request.lora_name)
        tensors = load_file(os.path.join(info.path, ADAPTER_WEIGHTS))
        adapter: Adapter = {}
        for hf_module, (key_a, key_b) in info.modules.items():
            target, index = self._target(hf_module)
            a, b = tensors[key_a].float(), tensors[key_b].float() * info.scaling
            a, b = self.layers[target].shard(index, a, b)
            adapter.setdefault(target, {})[index] = (a.to(self.dtype).contiguous(), b.to(self.dtype).contiguous())
        logger.info("Loaded LoRA adapter %r (id %d, rank %d, %d modules) from %s", request.lora_name,
                    request.lora_int_id, info.rank, len(info.modules), info.path)
        return adapter

    def _adapter(self, lora_id: int, keep: set[int]) -> Adapter:
        adapter = self.loaded.get(lora_id)
        if adapter is not None:
            self.loaded.move_to_end(lora_id)
            return adapter
        request = self.known.get(lora_id)
        if request is None:
            raise RuntimeError(f"step names LoRA adapter id {lora_id}, which no request brought to this worker")
        adapter = self.load(request)
        while len(self.loaded) >= self.max_cpu_loras:
            victim = next((i for i in self.loaded if i not in keep), None)
            if victim is None:
                break
            del self.loaded[victim]
        self.loaded[lora_id] = adapter
        return adapter

    def _slot_for(self, lora_id: int, active: set[int]) -> int:
        self._clock += 1
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
            self._slot_use[slot] = self._clock
            return slot
        free = [s for s, i in enumerate(self.slot_ids) if i is None or i not in active]
        if not free:
            raise RuntimeError(f"a step holds more than --max-loras {self.max_loras} adapters: {sorted(active)}")
        slot = min(free, key=lambda s: (self.slot_ids[s] is not None, self._slot_use[s]))
        adapter = self._adapter(lora_id, active)
        for name, slots in self.layers.items():
            slots.set_slot(slot, adapter.get(name, {}))
        self.slot_ids[slot] = lora_id
        self._slot_use[slot] = self._clock
        return slot

    # ---- each step ----------------------------------------------------------------------------
    def prepare(self, step: SchedulerOutput) -> LoRAMapping | None:
        """Put the step's adapters in slots; the step's mapping, None when no request has one."""
        for new in step.new_requests:
            if new.lora_request is not None:
                self.known[new.lora_request.lora_int_id] = new.lora_request
        ids = [r.lora_id for r in step.scheduled]
        self.state.mapping = None
        if not any(ids):
            return None
        active = {i for i in ids if i}
        slot_of = {i: self._slot_for(i, active) for i in sorted(active)}
        per_request = np.fromiter((slot_of.get(i, -1) for i in ids), dtype=np.int64, count=len(ids))
        counts = np.fromiter((len(r.token_ids) for r in step.scheduled), dtype=np.int64, count=len(ids))
        rows = np.repeat(per_request, counts)
        # grouped here, on the host: the device never has to answer which slots a step uses
        used = sorted(set(slot_of.values()))
        if len(used) == 1 and bool((rows == used[0]).all()):
            groups: tuple[tuple[int, torch.Tensor | None], ...] = ((used[0], None),)
        else:
            groups = tuple((s, torch.from_numpy(np.flatnonzero(rows == s)).to(self.device)) for s in used)
        self.state.mapping = LoRAMapping(torch.from_numpy(rows).to(self.device), groups)
        return self.state.mapping

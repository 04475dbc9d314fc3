"""``BatchedLoRA``: many LoRA adapters applied in one step, and ``LoRAMapping``, which row uses which.

A linear layer that serves adapters keeps them stacked in ``slots``: ``lora_a`` is
``(slots, rank, in)`` and ``lora_b`` is ``(slots, out, rank)``, with the adapter's scaling
(``alpha / r``) already folded into ``lora_b``. Rows of one step use different adapters, or
none; :class:`LoRAMapping` gives each row's slot (-1: none) and the rows of each slot in use,
worked out once per step and shared by every layer. The op adds each row's adapter product to
the base layer's output::

    y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T      for every row t whose slot s is not -1

A platform supplies a kernel with ``CustomOp.register_kernel("lora", fn)``, called
``fn(y, x, lora_a, lora_b, mapping)``; it updates ``y`` in place and returns it. Without one,
``forward_native`` gathers the adapted rows once, grouped by slot, runs one pair of matmuls per
slot in use (never a loop over requests) and adds the products back in one scatter.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..custom_op import CustomOp

__all__ = ["BatchedLoRA", "LoRAMapping"]


@dataclass(frozen=True, eq=False)
class LoRAMapping:
    """The adapter slot of each row of a step, and the rows of each slot in use.

    - ``token_slots``: int64 ``(T,)`` on the compute device, the slot of each row, -1 for none;
    - ``groups``: ``(slot, rows)`` for every slot some row uses, ``rows`` an int64 tensor of row
      indices, or None when every row of the step uses that slot.
    """

    token_slots: torch.Tensor
    groups: tuple[tuple[int, torch.Tensor | None], ...]

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor) -> LoRAMapping:
        """Group the rows of ``token_slots`` (int64 ``(T,)``, -1: no adapter) by slot."""
        if token_slots.dtype != torch.int64 or token_slots.dim() != 1:
            raise ValueError(f"token_slots must be a 1-D int64 tensor, got {token_slots.dtype} "
                             f"{tuple(token_slots.shape)}")
        slots = [s for s in torch.unique(token_slots).tolist() if s >= 0]
        if len(slots) == 1 and bool((token_slots == slots[0]).all()):
            return cls(token_slots, ((slots[0], None),))
        groups = tuple((s, (token_slots == s).nonzero().squeeze(1)) for s in slots)
        return cls(token_slots, groups)

    def packed(self) -> tuple[torch.Tensor, tuple[tuple[int, int], ...]]:
        """The rows of every group, concatenated in group order, and each group's ``(start, end)``
        in them; worked out once per mapping (every layer of the step shares it)."""
        packed = self.__dict__.get("_packed")
        if packed is None:
            rows = [torch.arange(self.num_tokens, device=self.token_slots.device) if r is None else r
                    for _, r in self.groups]
            ends = list(itertools.accumulate(r.shape[0] for r in rows))
            packed = (torch.cat(rows), tuple(zip([0, *ends[:-1]], ends)))
            object.__setattr__(self, "_packed", packed)  # a cache, not a field: the mapping stays frozen
        return packed

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    def to(self, device: torch.device | str) -> LoRAMapping:
        """The same mapping with its tensors on ``device``."""
        return LoRAMapping(self.token_slots.to(device),
                           tuple((s, None if rows is None else rows.to(device)) for s, rows in self.groups))


@CustomOp.register("lora")
class BatchedLoRA(CustomOp):
    """``y[rows of s] += x[rows of s] @ lora_a[s].T @ lora_b[s].T`` for each slot ``s`` in use.

    ``forward(y, x, lora_a, lora_b, mapping)``: ``y`` ``(T, out)`` (updated in place and returned),
    ``x`` ``(T, in)`` in ``y``'s dtype, ``lora_a`` ``(slots, rank, in)``, ``lora_b``
    ``(slots, out, rank)``, ``mapping`` a :class:`LoRAMapping` of ``T`` rows. The reference
    computes each slot's product in fp32 and adds it in ``y``'s dtype.
    """

    def forward_native(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       mapping: LoRAMapping) -> torch.Tensor:
        if not mapping.groups:
            return y
        if len(mapping.groups) == 1:
            slot, rows = mapping.groups[0]
            xs = x if rows is None else x.index_select(0, rows)  # (t, in)
            delta = (xs.float() @ lora_a[slot].float().T) @ lora_b[slot].float().T  # (t, out)
            return y.add_(delta.to(y.dtype)) if rows is None else y.index_add_(0, rows, delta.to(y.dtype))
        # Several slots: the adapted rows gathered once, grouped by slot (each group a contiguous
        # range), one pair of matmuls per group into one buffer, scattered back once.
        order, bounds = mapping.packed()
        xs = x.index_select(0, order).float()
        delta = xs.new_empty(xs.shape[0], y.shape[1])
        for (slot, _), (start, end) in zip(mapping.groups, bounds):
            torch.mm(xs[start:end] @ lora_a[slot].float().T, lora_b[slot].float().T, out=delta[start:end])
        return y.index_add_(0, order, delta.to(y.dtype))

    def forward_cuda(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     mapping: LoRAMapping) -> torch.Tensor:
        return self._kernel_or_native(y, x, lora_a, lora_b, mapping)

    def forward_cpu(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    mapping: LoRAMapping) -> torch.Tensor:
        return self._kernel_or_native(y, x, lora_a, lora_b, mapping)

    def _kernel_or_native(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                          mapping: LoRAMapping) -> torch.Tensor:
        kernel = CustomOp.get_kernel("lora")
        if kernel is None:
            return self.forward_native(y, x, lora_a, lora_b, mapping)
        return kernel(y, x, lora_a, lora_b, mapping)

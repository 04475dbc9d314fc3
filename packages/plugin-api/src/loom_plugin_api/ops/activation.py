"""``SiluAndMul``: the fused gate of gated MLPs (Llama's ``act_fn(gate) * up``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..custom_op import CustomOp

__all__ = ["SiluAndMul"]


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dimension ``2 * d`` (gate, up)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]  # (T, d)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_kernel(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_kernel(x)

    def _forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The platform's installed ``silu_and_mul`` kernel, else ``forward_native``."""
        kernel = CustomOp.get_kernel("silu_and_mul")
        return self.forward_native(x) if kernel is None else kernel(x)

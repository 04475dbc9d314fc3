"""Normalization layers: ``RMSNorm`` (Llama) and ``LayerNorm`` (OPT), both replaceable ops."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..custom_op import CustomOp

__all__ = ["LayerNorm", "RMSNorm"]


@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
    """``x / rms(x) * weight``, computed in fp32 and cast back to the input dtype.

    ``forward(x, residual)`` fuses the residual add as vLLM does: it returns
    ``(normed(x + residual), x + residual)`` so a decoder layer passes the new residual on.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        orig_dtype = x.dtype
        x = x.float()  # (T, hidden)
        if residual is not None:
            x = x + residual.float()
            residual = x.to(orig_dtype)
        variance = x.pow(2).mean(dim=-1, keepdim=True)  # (T, 1)
        x = (x * torch.rsqrt(variance + self.variance_epsilon)).to(orig_dtype)
        x = x * self.weight
        return x if residual is None else (x, residual)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._forward_kernel(x, residual)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._forward_kernel(x, residual)

    def _forward_kernel(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The platform's installed ``rms_norm`` kernel, else ``forward_native``."""
        kernel = CustomOp.get_kernel("rms_norm")
        if kernel is None:
            return self.forward_native(x, residual)
        return kernel(x, self.weight, self.variance_epsilon, residual)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"


@CustomOp.register("layer_norm")
class LayerNorm(CustomOp):
    """Standard layer norm with an optional affine weight and bias, computed in fp32."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        out = F.layer_norm(x.float(), (self.hidden_size,), weight, bias, self.eps)  # (T, hidden)
        return out.to(x.dtype)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_as_is(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_as_is(x)

    def _forward_as_is(self, x: torch.Tensor) -> torch.Tensor:
        """torch's layer norm on ``x`` and the parameters in their own dtype: for bf16 and fp16,
        torch's CPU and CUDA kernels compute in fp32 and round once, as ``forward_native`` does
        without its three conversions (half the time on the CPU). ``forward_native`` (the
        reference, and every other device's path) where a parameter's dtype is not ``x``'s."""
        if any(p is not None and p.dtype != x.dtype for p in (self.weight, self.bias)):
            return self.forward_native(x)
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.eps}"

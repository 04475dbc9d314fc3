"""``LogitsProcessor``: hidden states -> full-vocabulary logits."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from loom_plugin_api import CustomOp
from loom_plugin_api.ops import QuantizedLinear

from ..distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
from . import onednn, quantized
from .vocab_parallel_embedding import VocabParallelEmbedding

__all__ = ["LogitsProcessor"]


def _packed_logits(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, x: torch.Tensor) -> torch.Tensor:
    return onednn.linear(x, weight, bias)[..., :rows]  # the chunk's padding rows dropped


def _row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.max(dim=-1)``, through the platform's ``row_argmax`` kernel where one is installed
    and takes the chunk (the CPU platform's C kernel: torch's max with indices cost more than the
    chunk's matmul for a small model's wide vocabulary)."""
    kernel = CustomOp.get_kernel("row_argmax")
    found = None if kernel is None else kernel(logits)
    return logits.max(dim=-1) if found is None else found


class LogitsProcessor(nn.Module):
    """Apply the LM head, gather the vocabulary shards of every TP rank, drop the padding.

    ``forward(lm_head, hidden_states (N, hidden)) -> logits (N, vocab_size)``.
    On the CPU, ``onednn.prepack_model`` gives it ``packed_head``: the LM head's weight
    packed in chunks of ``chunk`` rows, used instead of ``lm_head.weight``. A GGUF file whose
    LM head (or tied embedding) is quantized gives it ``quantized_head``, a ``QuantizedLinear``
    over this rank's (padded) vocabulary rows: steps of up to its kernel's ``max_rows`` rows (decoding a
    few streams, bound by reading the head) multiply through it, larger ones through the dense head.
    """

    chunk = 2048  # vocabulary rows per LM-head matmul of the greedy path (logits stay in cache)

    def __init__(self, vocab_size: int, org_vocab_size: int | None = None, scale: float = 1.0) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.org_vocab_size = org_vocab_size or vocab_size
        self.scale = scale
        self.packed_head: onednn.PackedHead | None = None
        self.quantized_head: QuantizedLinear | None = None

    def _quantized_logits(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """This rank's ``(N, padded_vocab / tp)`` logits through the quantized head, or None for a batch."""
        head = self.quantized_head
        if head is None or hidden_states.shape[0] > getattr(head.kernel_weight(), "max_rows", quantized.QUANT_MAX_ROWS):
            return None
        return self.quantized_head(hidden_states, getattr(lm_head, "bias", None))

    def _chunks(self, lm_head: VocabParallelEmbedding, rows: int, chunk: int) -> Iterator[tuple[int, Callable]]:
        """``(lo, logits of rows lo:lo+chunk)`` over this rank's first ``rows`` vocabulary rows."""
        bias = getattr(lm_head, "bias", None)
        packed = self.packed_head
        if packed is not None:  # its own chunks, whatever ``chunk`` asks: the dense weight may be gone
            for lo, hi, w in packed.chunks:
                if lo >= rows:
                    break
                b = None if bias is None else bias[lo:hi]
                yield lo, functools.partial(_packed_logits, w, b, min(hi, rows) - lo)
            return
        for lo in range(0, rows, chunk):
            hi = min(lo + chunk, rows)
            yield lo, functools.partial(F.linear, weight=lm_head.weight[lo:hi], bias=None if bias is None else bias[lo:hi])

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self._quantized_logits(lm_head, hidden_states)  # (N, padded_vocab / tp) or None
        if logits is None and self.packed_head is not None:
            rows = lm_head.weight.shape[0]
            logits = torch.cat([fn(hidden_states) for _, fn in self._chunks(lm_head, rows, self.chunk)], dim=-1)
        elif logits is None:
            logits = F.linear(hidden_states, lm_head.weight, getattr(lm_head, "bias", None))  # (N, padded_vocab / tp)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)  # (N, padded_vocab)
        logits = logits[..., : self.org_vocab_size]  # (N, vocab)
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    @torch.inference_mode()
    def greedy_token_ids(
        self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor, chunk: int | None = None
    ) -> torch.Tensor:
        """``argmax(forward(lm_head, hidden_states), -1)`` without materializing the logits.

        The LM head runs over vocabulary chunks whose logits stay in cache; each keeps a
        running max. Ties resolve to the lowest token id, as ``argmax`` does. Across TP
        ranks only (max, id) pairs are gathered, not the vocabulary.
        """
        start = lm_head.vocab_start_index
        local = max(0, min(lm_head.weight.shape[0], self.org_vocab_size - start))  # drop padding rows
        best_val = best_idx = None
        whole = self._quantized_logits(lm_head, hidden_states)  # the few-rows path: one call, not chunks
        if whole is None:
            chunks = self._chunks(lm_head, local, chunk or self.chunk)
        else:
            chunks = [(0, lambda _: whole[:, :local])] if local else []
        for lo, logits_of in chunks:
            logits = logits_of(hidden_states)  # (N, c)
            val, idx = _row_max(logits)
            idx += start + lo
            if best_val is None:
                best_val, best_idx = val, idx
            else:
                better = val > best_val
                best_val = torch.where(better, val, best_val)
                best_idx = torch.where(better, idx, best_idx)
        if best_val is None:  # this rank holds only padding
            n = hidden_states.shape[0]
            best_val = torch.full((n,), float("-inf"), dtype=hidden_states.dtype, device=hidden_states.device)
            best_idx = torch.zeros(n, dtype=torch.long, device=hidden_states.device)
        if get_tensor_model_parallel_world_size() > 1:
            vals = tensor_model_parallel_all_gather(best_val.float().unsqueeze(-1), dim=-1)  # (N, tp)
            idxs = tensor_model_parallel_all_gather(best_idx.unsqueeze(-1), dim=-1)
            rank = vals.argmax(dim=-1, keepdim=True)  # first rank wins ties: lowest token id
            best_idx = idxs.gather(-1, rank).squeeze(-1)
        return best_idx

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, scale={self.scale}"

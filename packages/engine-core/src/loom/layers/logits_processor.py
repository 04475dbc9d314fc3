"""``LogitsProcessor``: hidden states -> full-vocabulary logits."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed import tensor_model_parallel_all_gather
from .vocab_parallel_embedding import VocabParallelEmbedding

__all__ = ["LogitsProcessor"]


class LogitsProcessor(nn.Module):
    """Apply the LM head, gather the vocabulary shards of every TP rank, drop the padding.

    ``forward(lm_head, hidden_states (N, hidden)) -> logits (N, vocab_size)``.
    """

    def __init__(self, vocab_size: int, org_vocab_size: int | None = None, scale: float = 1.0) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.org_vocab_size = org_vocab_size or vocab_size
        self.scale = scale

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        bias = getattr(lm_head, "bias", None)
        logits = F.linear(hidden_states, lm_head.weight, bias)  # (N, padded_vocab / tp)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)  # (N, padded_vocab)
        logits = logits[..., : self.org_vocab_size]  # (N, vocab)
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, scale={self.scale}"

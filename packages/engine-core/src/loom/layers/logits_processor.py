"""``LogitsProcessor``: hidden states -> full-vocabulary logits."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
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

    @torch.inference_mode()
    def greedy_token_ids(
        self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor, chunk: int = 2048
    ) -> torch.Tensor:
        """``argmax(forward(lm_head, hidden_states), -1)`` without materializing the logits.

        The LM head runs over vocabulary chunks whose logits stay in cache; each keeps a
        running max. Ties resolve to the lowest token id, as ``argmax`` does. Across TP
        ranks only (max, id) pairs are gathered, not the vocabulary.
        """
        weight = lm_head.weight  # (padded_vocab / tp, hidden)
        bias = getattr(lm_head, "bias", None)
        start = lm_head.vocab_start_index
        local = max(0, min(weight.shape[0], self.org_vocab_size - start))  # drop padding rows
        best_val = best_idx = None
        for lo in range(0, local, chunk):
            hi = min(lo + chunk, local)
            logits = F.linear(hidden_states, weight[lo:hi], None if bias is None else bias[lo:hi])  # (N, c)
            val, idx = logits.max(dim=-1)
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

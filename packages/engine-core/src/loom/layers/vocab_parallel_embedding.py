"""Token embeddings and the LM head, split across TP ranks by vocabulary rows.

The vocabulary is padded to a multiple of ``padding_size`` (64, as vLLM does) and each
rank holds ``padded / tp`` consecutive rows. Padding rows are zero and never looked up;
the logits processor trims them from the output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from .linear import divide

__all__ = ["DEFAULT_VOCAB_PADDING_SIZE", "ParallelLMHead", "VocabParallelEmbedding", "pad_vocab_size"]

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    return (vocab_size + pad_to - 1) // pad_to * pad_to


class VocabParallelEmbedding(nn.Module):
    """``forward(input_ids (T,)) -> (T, embedding_dim)``; each rank embeds the ids it owns,
    zeros the rest, and the all-reduce sums the pieces."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.num_embeddings_per_partition = divide(self.num_embeddings_padded, self.tp_size, "padded vocabulary")
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype or torch.get_default_dtype()),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # on the CPU, once the LM head is packed: the packed head, which serves the rows instead
        # of ``weight`` (then a NaN broadcast to its shape: no data), see ``onednn.prepack_model``
        self.row_source: Any = None

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.row_source is None else self.row_source.lookup(ids)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if loaded_weight.dim() != 2 or loaded_weight.shape[1] != self.embedding_dim or \
                loaded_weight.shape[0] < self.vocab_end_index:
            raise ValueError(
                f"{self.prefix}: checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit a "
                f"vocabulary of {self.num_embeddings} x {self.embedding_dim}; the checkpoint does not match the config"
            )
        rows = max(self.vocab_end_index - self.vocab_start_index, 0)
        with torch.no_grad():
            param.data[:rows].copy_(loaded_weight.narrow(0, self.vocab_start_index, rows))
            param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(input_ids)  # (T, dim)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = torch.where(outside, 0, input_ids - self.vocab_start_index)
        out = self._rows(local_ids)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)  # (T, dim)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"per_partition={self.num_embeddings_per_partition}, tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split like the embedding. ``LogitsProcessor`` applies it;
    ``tie_weights(embed_tokens)`` shares the embedding's weight."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        prefix: str = "",
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, padding_size, prefix)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, dtype=self.weight.dtype),
                                     requires_grad=False)
            self.bias.weight_loader = self._bias_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        rows = max(self.vocab_end_index - self.vocab_start_index, 0)
        with torch.no_grad():
            param.data[:rows].copy_(loaded_weight.narrow(0, self.vocab_start_index, rows))
            param.data[rows:].zero_()

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        if embed_tokens.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie lm_head {tuple(self.weight.shape)} to embeddings {tuple(embed_tokens.weight.shape)}"
            )
        self.weight = embed_tokens.weight
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called directly")

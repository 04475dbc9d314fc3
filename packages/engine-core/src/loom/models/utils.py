"""Helpers shared by the model implementations: prefixes and HF-name weight loading."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from ..model_loader.weight_utils import default_weight_loader

__all__ = ["CausalLMBase", "StackedParam", "load_weights_stacked", "maybe_prefix"]

StackedParam = tuple[str, str, Any]
"""``(param_name, checkpoint_name, shard_id)``: e.g. ``(".qkv_proj", ".q_proj", "q")``."""


def maybe_prefix(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def load_weights_stacked(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: list[StackedParam],
    skip: Callable[[str], bool] = lambda name: False,
    rename: Callable[[str], str] = lambda name: name,
) -> set[str]:
    """Load HF-named tensors into ``model``; return the names of the parameters filled.

    A checkpoint tensor whose name contains a ``checkpoint_name`` of the mapping loads into
    one shard of the stacked parameter; a stacked parameter counts as loaded only once
    all its shards are. ``skip`` drops tensors (rotary buffers, a tied ``lm_head``).
    """
    params = dict(model.named_parameters())
    shards_of: dict[str, set[Any]] = {}
    for param_name, _, shard_id in stacked_params_mapping:
        shards_of.setdefault(param_name, set()).add(shard_id)
    seen_shards: dict[str, set[Any]] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        name = rename(name)
        if skip(name):
            continue
        for param_name, weight_name, shard_id in stacked_params_mapping:
            if weight_name not in name:
                continue
            target = name.replace(weight_name, param_name)
            param = _param(params, target, name, model)
            param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
            got = seen_shards.setdefault(target, set())
            got.add(shard_id)
            if got >= shards_of[param_name]:
                loaded.add(target)
            break
        else:
            param = _param(params, name, name, model)
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
    return loaded


def _param(params: dict[str, nn.Parameter], target: str, name: str, model: nn.Module) -> nn.Parameter:
    param = params.get(target)
    if param is None:
        raise ValueError(
            f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}; "
            "the checkpoint does not belong to this architecture (check 'architectures' in config.json)"
        )
    return param


class CausalLMBase(nn.Module):
    """What the causal LMs share: ``forward`` through ``self.model``, the LM head through
    ``self.logits_processor``, and HF-named weights through ``stacked_params_mapping``."""

    stacked_params_mapping: list[StackedParam] = []
    model: nn.Module
    lm_head: nn.Module
    logits_processor: Any
    tie_word_embeddings: bool

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)  # (N, vocab)

    def compute_greedy_token_ids(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``compute_logits(h).argmax(-1)`` without the (N, vocab) logits; (N,) int64."""
        return self.logits_processor.greedy_token_ids(self.lm_head, hidden_states)

    def _rename(self, name: str) -> str:
        return name

    def _skip_weight(self, name: str) -> bool:
        return self.tie_word_embeddings and name.startswith("lm_head.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_stacked(self, weights, self.stacked_params_mapping, skip=self._skip_weight,
                                    rename=self._rename)

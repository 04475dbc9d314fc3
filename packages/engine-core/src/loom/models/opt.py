"""OPT (facebook/opt-*): learned positions, pre- or post-LayerNorm decoder, ReLU MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from loom_plugin_api.ops.layernorm import LayerNorm

from ..layers.activation import get_act_fn
from ..layers.attention import Attention
from ..layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from ..layers.logits_processor import LogitsProcessor
from ..layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from .utils import CausalLMBase, StackedParam, maybe_prefix

if TYPE_CHECKING:
    from ..config import LoomConfig

__all__ = ["OPTAttention", "OPTDecoder", "OPTDecoderLayer", "OPTForCausalLM", "OPTModel"]


class OPTLearnedPositionalEmbedding(nn.Embedding):
    # OPT's position table starts at index 2 (the first two rows are unused legacy ones).
    offset = 2

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings + self.offset, embedding_dim)
        self.weight.requires_grad_(False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(positions + self.offset)  # (T, hidden)


class OPTAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, bias: bool = True, prefix: str = "") -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.head_dim = embed_dim // num_heads
        self.qkv_proj = QKVParallelLinear(embed_dim, self.head_dim, num_heads, bias=bias, prefix=f"{prefix}.qkv_proj")
        self.out_proj = RowParallelLinear(embed_dim, embed_dim, bias=bias, prefix=f"{prefix}.out_proj")
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.q_size = self.num_heads * self.head_dim
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, prefix=f"{prefix}.attn")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # (T, 3 * H * D), this rank's heads
        q, k, v = qkv.chunk(3, dim=-1)
        out = self.attn(q, k, v)  # (T, H * D)
        return self.out_proj(out)  # (T, hidden)


class OPTDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.embed_dim = hf_config.hidden_size
        bias = bool(getattr(hf_config, "enable_bias", True))
        affine = bool(getattr(hf_config, "layer_norm_elementwise_affine", True))
        self.do_layer_norm_before = hf_config.do_layer_norm_before
        self.self_attn = OPTAttention(self.embed_dim, hf_config.num_attention_heads, bias=bias,
                                      prefix=f"{prefix}.self_attn")
        self.self_attn_layer_norm = LayerNorm(self.embed_dim, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(self.embed_dim, hf_config.ffn_dim, bias=bias, prefix=f"{prefix}.fc1")
        self.activation_fn = get_act_fn(hf_config.activation_function)
        self.fc2 = RowParallelLinear(hf_config.ffn_dim, self.embed_dim, bias=bias, prefix=f"{prefix}.fc2")
        self.final_layer_norm = LayerNorm(self.embed_dim, elementwise_affine=affine)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states  # (T, hidden)
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states)
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(self.activation_fn(self.fc1(hidden_states)))  # (T, ffn / tp) inside
        hidden_states = residual + hidden_states
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class OPTDecoder(nn.Module):
    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        proj_dim = getattr(hf_config, "word_embed_proj_dim", None) or hidden
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, proj_dim,
                                                   prefix=maybe_prefix(prefix, "embed_tokens"))
        self.embed_positions = OPTLearnedPositionalEmbedding(hf_config.max_position_embeddings, hidden)
        # Smaller word embeddings (opt-350m) are projected in and out of the hidden size.
        self.project_in = ReplicatedLinear(proj_dim, hidden, bias=False) if proj_dim != hidden else None
        self.project_out = ReplicatedLinear(hidden, proj_dim, bias=False) if proj_dim != hidden else None
        self.final_layer_norm: LayerNorm | None = None
        if hf_config.do_layer_norm_before and not getattr(hf_config, "_remove_final_layer_norm", False):
            affine = bool(getattr(hf_config, "layer_norm_elementwise_affine", True))
            self.final_layer_norm = LayerNorm(hidden, elementwise_affine=affine)
        self.layers = nn.ModuleList(
            OPTDecoderLayer(hf_config, prefix=maybe_prefix(prefix, f"layers.{i}"))
            for i in range(hf_config.num_hidden_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        inputs_embeds = self.embed_tokens(input_ids)  # (T, proj_dim)
        if self.project_in is not None:
            inputs_embeds = self.project_in(inputs_embeds)  # (T, hidden)
        hidden_states = inputs_embeds + self.embed_positions(positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)  # (T, proj_dim)
        return hidden_states


class OPTModel(nn.Module):
    def __init__(self, *, config: LoomConfig, prefix: str = "") -> None:
        super().__init__()
        self.decoder = OPTDecoder(config.model_config.hf_config, prefix=maybe_prefix(prefix, "decoder"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids, positions)


class OPTForCausalLM(CausalLMBase):
    """``forward(input_ids (T,), positions (T,)) -> (T, proj_dim)``; ``compute_logits`` -> (N, vocab)."""

    supports_tensor_parallel = True
    stacked_params_mapping: list[StackedParam] = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
    ]

    def __init__(self, *, config: LoomConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = config.model_config.hf_config
        self.config = hf_config
        self.model = OPTModel(config=config, prefix=maybe_prefix(prefix, "model"))
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head: VocabParallelEmbedding
        if self.tie_word_embeddings:
            self.lm_head = self.model.decoder.embed_tokens
        else:
            proj_dim = getattr(hf_config, "word_embed_proj_dim", None) or hf_config.hidden_size
            self.lm_head = ParallelLMHead(hf_config.vocab_size, proj_dim, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(hf_config.vocab_size)

    def _rename(self, name: str) -> str:
        # facebook/opt-* checkpoints name the decoder at the top level.
        return "model." + name if name.startswith("decoder.") else name

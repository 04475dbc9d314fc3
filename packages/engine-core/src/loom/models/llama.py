"""Llama (and Llama-shaped models: SmolLM2, TinyLlama, Mistral without sliding window).

GQA through ``num_key_value_heads``, RoPE through ``get_rope``, ``head_dim`` from the
config when it has one, tied or untied embeddings. Weights load from HF names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from loom_plugin_api.ops.layernorm import RMSNorm
from loom_plugin_api.ops.rotary_embedding import get_rope

from .. import envs
from ..distributed import get_tensor_model_parallel_world_size
from ..layers.activation import SiluAndMul
from ..layers.attention import Attention
from ..layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..layers.logits_processor import LogitsProcessor
from ..layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from .utils import CausalLMBase, StackedParam, maybe_prefix

if TYPE_CHECKING:
    from ..config import LoomConfig

__all__ = ["LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP", "LlamaModel"]


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from a transformers 4 (``rope_theta``/``rope_scaling``)
    or 5 (``rope_parameters``) config."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or params or None
    theta = getattr(hf_config, "rope_theta", None) or params.get("rope_theta") or 10000.0
    return float(theta), scaling


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False,
                 prefix: str = "") -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"Llama MLP supports hidden_act 'silu' only, got {hidden_act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()
        # gate, up and the activation in one pass where the layer's GEMM has one (loom's bf16 GEMM
        # on the CPU) and the op runs the CPU platform's kernel, whose result it gives bit for bit
        # (LOOM_CPU_FUSED_MLP=0: two ops)
        self.fused = (envs.LOOM_CPU_FUSED_MLP and type(self.act_fn) is SiluAndMul
                      and self.act_fn.forward_method_name == "forward_cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate_up_proj.silu_and_mul(x) if self.fused else None
        if y is None:
            y = self.act_fn(self.gate_up_proj(x))  # (T, 2 * I / tp) -> (T, I / tp)
        return self.down_proj(y)  # (T, hidden)


class LlamaAttention(nn.Module):
    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.hidden_size = hf_config.hidden_size
        self.total_num_heads = hf_config.num_attention_heads
        self.total_num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.total_num_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or self.hidden_size // self.total_num_heads
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(self.hidden_size, self.head_dim, self.total_num_heads,
                                          self.total_num_kv_heads, bias=bias, prefix=f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, self.hidden_size, bias=bias,
                                        prefix=f"{prefix}.o_proj")
        theta, scaling = rope_settings(hf_config)
        self.rotary_emb = get_rope(self.head_dim, self.head_dim, hf_config.max_position_embeddings, theta,
                                   is_neox_style=True, rope_scaling=scaling)
        self.scaling = self.head_dim**-0.5
        self.attn = Attention(self.num_heads, self.head_dim, self.scaling, num_kv_heads=self.num_kv_heads,
                              prefix=f"{prefix}.attn")
        self.tp_size = tp

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # (T, (Hq + 2 * Hkv) * D), this rank's heads
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v)  # (T, Hq * D)
        return self.o_proj(out)  # (T, hidden)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.self_attn = LlamaAttention(hf_config, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act,
                            bias=bool(getattr(hf_config, "mlp_bias", False)), prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream travels beside the normed states; each RMSNorm adds it in.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual  # (T, hidden) each


class LlamaModel(nn.Module):
    def __init__(self, *, config: LoomConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = config.model_config.hf_config
        self.config = hf_config
        self.vocab_size = hf_config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size,
                                                   prefix=maybe_prefix(prefix, "embed_tokens"))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, prefix=maybe_prefix(prefix, f"layers.{i}"))
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # (T, hidden)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states  # (T, hidden)


class LlamaForCausalLM(CausalLMBase):
    """``forward(input_ids (T,), positions (T,)) -> (T, hidden)``; ``compute_logits`` -> (N, vocab)."""

    supports_tensor_parallel = True
    stacked_params_mapping: list[StackedParam] = [
        # (param_name, checkpoint_name, shard_id)
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, *, config: LoomConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = config.model_config.hf_config
        self.config = hf_config
        self.model = LlamaModel(config=config, prefix=maybe_prefix(prefix, "model"))
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(hf_config.vocab_size)

    def _skip_weight(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
            return True
        return super()._skip_weight(name)

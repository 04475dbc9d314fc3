"""``get_model``: build the registered model class for a config and load its weights.

Formats: ``hf`` (a directory of ``*.safetensors`` + ``config.json``), ``gguf`` (converted
once into the loom cache by :mod:`.gguf_loader`, then read like ``hf``), and
``--load-format dummy`` (small random weights, for benchmarks and tests).

This module holds the ``--load-format`` table and imports no torch, so that the CLI can
list and check the formats; building and loading live in :mod:`.base`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..logger import init_logger

if TYPE_CHECKING:
    import torch.nn as nn

    from ..config import LoomConfig
    from .base import get_model, initialize_dummy_weights, load_weights_into

__all__ = [
    "WEIGHT_LOADERS", "get_model", "initialize_dummy_weights", "load_format_choices", "load_weights_into",
    "register_weight_loader", "resolve_load_format",
]


logger = init_logger(__name__)

WeightLoader = Callable[["nn.Module", "LoomConfig", bool], str]
"""``loader(model, config, show_progress) -> source``: fills every parameter of ``model``."""

_AUTO_FORMAT = {"hf": "safetensors", "gguf": "gguf"}  # model_format -> load format for "auto"
_FORMAT_NEEDS = {"safetensors": "hf", "gguf": "gguf"}


def _load_safetensors(model: nn.Module, config: LoomConfig, show_progress: bool) -> str:
    # lazy: .base and .weight_utils import torch; the CLI reads this table without it
    from .base import load_weights_into
    from .weight_utils import safetensors_files, safetensors_weights_iterator

    source = config.model_config.model_path
    load_weights_into(model, safetensors_weights_iterator(safetensors_files(source), show_progress), source)
    quantization = getattr(config.model_config, "quantization", "none")
    if quantization in ("int4", "int8"):
        from ..layers.quantized import quantize_model  # lazy: it imports torch and the layers

        group_size = config.model_config.quantization_group_size
        done, kept = quantize_model(model, int(quantization[3:]), group_size, config.model_config.torch_dtype)
        logger.info("Quantized %d linear layers to %s (round to nearest, groups of %d)%s", done, quantization,
                    group_size, f"; {kept} kept dense (input width not whole groups, or no kernel runs the op here)" if kept else "")
    return source


def _load_gguf(model: nn.Module, config: LoomConfig, show_progress: bool) -> str:
    # lazy: .base and .weight_utils import torch; the CLI reads this table without it
    from .base import load_weights_into
    from .gguf_loader import gguf_weights_file
    from .weight_utils import safetensors_weights_iterator

    source = config.model_config.model_path
    if getattr(config.model_config, "quantization", "none") == "gguf":
        from .gguf_quantized import load_gguf_quantized  # lazy: it imports torch and the layers

        load_gguf_quantized(model, source, config.model_config.torch_dtype)
        return source
    load_weights_into(model, safetensors_weights_iterator([gguf_weights_file(source)], show_progress), source)
    return source


def _load_dummy(model: nn.Module, config: LoomConfig, show_progress: bool) -> str:
    from .base import initialize_dummy_weights  # lazy: .base imports torch

    initialize_dummy_weights(model, seed=config.model_config.seed or 0)
    return "dummy weights"


WEIGHT_LOADERS: dict[str, WeightLoader] = {
    "safetensors": _load_safetensors,
    "gguf": _load_gguf,
    "dummy": _load_dummy,
}
"""``--load-format`` name -> loader. General plugins may add formats with
:func:`register_weight_loader`; the flag's choices are read after they ran."""


def register_weight_loader(name: str, loader: WeightLoader) -> None:
    """Add a ``--load-format`` choice (call it from a general plugin; idempotent)."""
    if name == "auto" or not name.isidentifier():
        raise ValueError(f"load format name {name!r} must be an identifier other than 'auto'")
    existing = WEIGHT_LOADERS.get(name)
    if existing is not None and existing is not loader:
        raise ValueError(f"load format {name!r} is already registered by {existing.__module__}")
    WEIGHT_LOADERS[name] = loader


def load_format_choices() -> list[str]:
    return ["auto", *WEIGHT_LOADERS]


def resolve_load_format(config: LoomConfig) -> str:
    """The loader name for ``--load-format`` (``auto`` picks by the model's format)."""
    load_format = config.load_config.load_format
    model_format = config.model_config.model_format
    if load_format == "auto":
        return _AUTO_FORMAT[model_format]
    if load_format not in WEIGHT_LOADERS:
        raise ValueError(f"--load-format {load_format!r} is not one of {', '.join(load_format_choices())}")
    wanted = _FORMAT_NEEDS.get(load_format)
    if wanted is not None and wanted != model_format:
        raise ValueError(
            f"--load-format {load_format} does not match model {config.model_config.model_path} "
            f"(a {'GGUF file' if model_format == 'gguf' else 'safetensors directory'}); use --load-format auto"
        )
    return load_format




def __getattr__(name: str) -> Any:
    if name in ("get_model", "initialize_dummy_weights", "load_weights_into"):
        from . import base  # lazy: .base imports torch, which the CLI must not load

        return getattr(base, name)
    raise AttributeError(f"module 'loom.model_loader' has no attribute {name!r}")

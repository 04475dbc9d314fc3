"""``get_model``: build the registered model class for a config and load its weights.

Formats: ``hf`` (a directory of ``*.safetensors`` + ``config.json``), ``gguf`` (converted
once into the loom cache by :mod:`.gguf_loader`, then read like ``hf``), and
``--load-format dummy`` (small random weights, for benchmarks and tests).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from loom_plugin_api import ModelRegistry, set_current_config

from ..distributed import get_tensor_model_parallel_rank
from ..logger import init_logger

if TYPE_CHECKING:
    from ..config import LoomConfig

logger = init_logger(__name__)

__all__ = [
    "WEIGHT_LOADERS", "get_model", "initialize_dummy_weights", "load_format_choices", "load_weights_into",
    "register_weight_loader",
]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


WeightLoader = Callable[[nn.Module, "LoomConfig", bool], str]
"""``loader(model, config, show_progress) -> source``: fills every parameter of ``model``."""

_AUTO_FORMAT = {"hf": "safetensors", "gguf": "gguf"}  # model_format -> load format for "auto"
_FORMAT_NEEDS = {"safetensors": "hf", "gguf": "gguf"}


def _load_safetensors(model: nn.Module, config: LoomConfig, show_progress: bool) -> str:
    from .weight_utils import safetensors_files, safetensors_weights_iterator

    source = config.model_config.model_path
    load_weights_into(model, safetensors_weights_iterator(safetensors_files(source), show_progress), source)
    return source


def _load_gguf(model: nn.Module, config: LoomConfig, show_progress: bool) -> str:
    from .gguf_loader import ensure_gguf_cache, gguf_weights_file
    from .weight_utils import safetensors_weights_iterator

    source = config.model_config.model_path
    cache_dir = ensure_gguf_cache(source)
    load_weights_into(model, safetensors_weights_iterator([gguf_weights_file(cache_dir)], show_progress), source)
    return source


def _load_dummy(model: nn.Module, config: LoomConfig, show_progress: bool) -> str:
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


def _load_format(config: LoomConfig) -> str:
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


def initialize_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3, seed: int = 1234) -> None:
    """Fill every parameter with uniform noise (deterministic for a seed)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                noise = torch.rand(param.shape, generator=generator, dtype=torch.float32) * (high - low) + low
                param.data.copy_(noise.to(param.dtype))


def load_weights_into(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """``model.load_weights(weights)``, then fail naming every parameter left unloaded."""
    loaded = model.load_weights(weights)  # type: ignore[operator]
    expected = {name for name, _ in model.named_parameters()}
    missing = sorted(expected - set(loaded))
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(
            f"weights from {source} leave {len(missing)} parameter(s) of {type(model).__name__} unloaded: "
            f"{shown}; the checkpoint does not match the model config"
        )


def get_model(config: LoomConfig) -> nn.Module:
    """Build ``config.model_config.architecture`` on the platform's device and load it."""
    model_config = config.model_config
    load_format = _load_format(config)
    model_cls, arch = ModelRegistry.resolve_model_cls(model_config.architecture)
    device = torch.device(config.device_config.device_type)
    start = time.perf_counter()
    with set_current_config(config), _default_dtype(model_config.dtype), device:
        model = model_cls(config=config)  # type: ignore[call-arg]
    built = time.perf_counter()
    show_progress = get_tensor_model_parallel_rank() == 0
    source = WEIGHT_LOADERS[load_format](model, config, show_progress)
    model.eval()
    logger.info(
        "Loaded %s (%s, %s) from %s: built in %.2f s, weights in %.2f s",
        arch, model_cls.__qualname__, model_config.dtype, source, built - start, time.perf_counter() - built,
    )
    return model

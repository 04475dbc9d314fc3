"""Build a model on the platform's device and fill its weights (the part that needs torch)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from loom_plugin_api import ModelRegistry, set_current_config
from loom_plugin_api.tracing import span

from ..distributed import get_tensor_model_parallel_rank
from ..layers.onednn import prepack_model
from ..logger import init_logger
from . import WEIGHT_LOADERS, resolve_load_format

if TYPE_CHECKING:
    from ..config import LoomConfig

logger = init_logger("loom.model_loader")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


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


def get_model(config: LoomConfig, device: torch.device | None = None) -> nn.Module:
    """Build ``config.model_config.architecture`` on ``device`` (default: the platform's) and load it."""
    model_config = config.model_config
    load_format = resolve_load_format(config)
    model_cls, arch = ModelRegistry.resolve_model_cls(model_config.architecture)
    device = device if device is not None else torch.device(config.device_config.device_type)
    start = time.perf_counter()
    with span("build model", architecture=arch), set_current_config(config), \
            _default_dtype(model_config.torch_dtype), device:
        model = model_cls(config=config)  # type: ignore[call-arg]
    built = time.perf_counter()
    show_progress = get_tensor_model_parallel_rank() == 0
    # ops built at load (quantized layers) follow its custom_ops too
    with span("load weights", load_format=load_format), set_current_config(config):
        source = WEIGHT_LOADERS[load_format](model, config, show_progress)
    model.eval()
    if device.type == "cpu":
        with span("prepack weights for oneDNN"):
            prepack_model(model)
    logger.info(
        "Loaded %s (%s, %s) from %s: built in %.2f s, weights in %.2f s",
        arch, model_cls.__qualname__, model_config.dtype, source, built - start, time.perf_counter() - built,
    )
    return model

"""Reading checkpoint tensors and copying them into parameters."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..progress import progress_bar

__all__ = ["default_weight_loader", "safetensors_files", "safetensors_weights_iterator"]


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole (replicated) checkpoint tensor into ``param``."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit parameter of shape "
            f"{tuple(param.shape)}; the checkpoint does not match the model config"
        )
    with torch.no_grad():
        param.data.copy_(loaded_weight)


def safetensors_files(model_dir: str) -> list[str]:
    """The ``*.safetensors`` files of an HF model directory, sorted; an error if there are none."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        found = [f for f in os.listdir(model_dir) if f.endswith((".bin", ".pt", ".pth"))]
        hint = (f" (found {', '.join(sorted(found)[:3])}: re-save the model with "
                "save_pretrained(..., safe_serialization=True))") if found else ""
        raise FileNotFoundError(f"no *.safetensors weight files in {model_dir}{hint}")
    return files


def safetensors_weights_iterator(files: list[str], show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from each file, with a progress bar over tensors on stderr.

    A file that is missing, truncated or not safetensors raises ``ValueError`` naming it.
    """
    def open_file(path: str) -> Any:
        try:
            return safe_open(path, framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read weights file {path}: {e}; re-download or re-convert it") from None

    counts = []
    for path in files:
        f = open_file(path)
        counts.append(len(list(f.keys())))
    bar = progress_bar(sum(counts), "Loading weights", "tensor", disable=not show_progress)
    try:
        for path in files:
            f = open_file(path)
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except (SafetensorError, OSError, RuntimeError) as e:
                    raise ValueError(f"cannot read tensor {name!r} from weights file {path}: {e}") from None
                yield name, tensor
                bar.update(1)
    finally:
        bar.close()

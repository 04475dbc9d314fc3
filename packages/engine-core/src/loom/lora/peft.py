"""Adapters in the PEFT format: read and check one without torch.

A PEFT LoRA adapter is a directory with ``adapter_config.json`` (``peft_type: "LORA"``, ``r``,
``lora_alpha``, ``target_modules``, ...) and ``adapter_model.safetensors``, whose tensors are
named ``base_model.model.<module>.lora_A.weight`` (``(r, in)``) and ``...lora_B.weight``
(``(out, r)``) for each adapted linear module of the HF model. :func:`check_adapter` reads the
config and the safetensors header only (no tensor data, no torch), so the front end, the engine
core and the workers all refuse a broken adapter with the same message before it reaches a step.

The shapes are checked against the base model's dimensions for the model families loom serves
adapters on (:data:`TARGET_DIMS`, by ``model_type``); a family not listed gets the format checks
only, and the worker checks shapes when it loads the tensors.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "AdapterInfo", "LoRAAdapterError", "TARGET_DIMS", "check_adapter",
           "target_dims"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_MAX_HEADER = 4 << 20  # a LoRA of a 100-layer model on every projection has a header of ~200 KiB
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")
_LAYER = re.compile(r"\blayers\.(\d+)\.")
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
"""Tensor dtypes an adapter may hold (safetensors names), and their sizes."""


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the problem."""


MODULE_PATHS: dict[str, re.Pattern[str]] = {
    "llama": re.compile(r"model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"),
    "opt": re.compile(r"model\.decoder\.layers\.(\d+)\.(self_attn\.(q|k|v|out)_proj|fc1|fc2)"),
}
"""``model_type`` -> the HF module names an adapter's tensors may name (the layer index in group 1)."""
MODULE_PATHS["mistral"] = MODULE_PATHS["llama"]


def _llama(c: Any) -> dict[str, tuple[int, int]]:
    hidden, heads = c.hidden_size, c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    inter = c.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _opt(c: Any) -> dict[str, tuple[int, int]]:
    hidden, ffn = c.hidden_size, c.ffn_dim
    return {"q_proj": (hidden, hidden), "k_proj": (hidden, hidden), "v_proj": (hidden, hidden),
            "out_proj": (hidden, hidden), "fc1": (hidden, ffn), "fc2": (ffn, hidden)}


TARGET_DIMS: dict[str, Callable[[Any], dict[str, tuple[int, int]]]] = {
    "llama": _llama, "mistral": _llama, "opt": _opt,
}
"""``model_type`` -> ``hf_config`` -> {module name: (in, out)} of the linear modules an adapter may target."""


def target_dims(hf_config: Any) -> dict[str, tuple[int, int]] | None:
    """The adaptable modules of a model and their full ``(in, out)``; None for a family not listed."""
    fn = TARGET_DIMS.get(getattr(hf_config, "model_type", None) or "")
    return None if fn is None else fn(hf_config)


@dataclass(frozen=True)
class AdapterInfo:
    """What :func:`check_adapter` found: enough for a worker to load the tensors."""

    path: str
    rank: int
    scaling: float
    """``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), folded into B at load."""
    modules: dict[str, tuple[str, str]] = field(default_factory=dict)
    """HF module name (``model.layers.0.self_attn.q_proj``) -> (key of A, key of B)."""


def _read_config(path: str, label: str) -> dict[str, Any]:
    config_path = os.path.join(path, ADAPTER_CONFIG)
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAAdapterError(f"{label}: {ADAPTER_CONFIG} is missing from {path}; a PEFT LoRA adapter directory "
                               "holds adapter_config.json and adapter_model.safetensors") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{label}: cannot read {config_path}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{label}: {config_path} must hold a JSON object")
    return config


def _read_header(path: str, label: str) -> dict[str, Any]:
    """The safetensors header, with every tensor's dtype and byte range checked against the file."""
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        extra = " (adapter_model.bin is not read: save the adapter with safe_serialization=True)" \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise LoRAAdapterError(f"{label}: {ADAPTER_WEIGHTS} is missing from {path}{extra}")
    try:
        with open(weights, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if not 2 <= size <= _MAX_HEADER:
                raise ValueError(f"header size {size} is out of range (at most {_MAX_HEADER} bytes)")
            header = json.loads(f.read(size))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        data_size = os.path.getsize(weights) - 8 - size
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        raise LoRAAdapterError(f"{label}: {weights} is not a safetensors file: {e}") from None
    header.pop("__metadata__", None)
    for key, entry in header.items():
        if not isinstance(entry, dict):
            raise LoRAAdapterError(f"{label}: {weights} is not a safetensors file: entry {key!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _DTYPES:
            raise LoRAAdapterError(f"{label}: tensor {key!r} is {dtype}; adapters hold F32, F16 or BF16 weights")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise LoRAAdapterError(f"{label}: {weights} is not a safetensors file: entry {key!r} is malformed")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size or end - begin != math.prod(shape) * _DTYPES[dtype]:
            raise LoRAAdapterError(f"{label}: tensor {key!r}: its bytes [{begin}, {end}) do not hold a {dtype} "
                                   f"{shape} tensor within the file's {data_size} bytes of data (a truncated or "
                                   "damaged file)")
    return header


def _check_config(config: dict[str, Any], label: str, max_rank: int,
                  dims: dict[str, tuple[int, int]] | None) -> tuple[int, float]:
    if config.get("peft_type") != "LORA":
        raise LoRAAdapterError(f"{label}: peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    rank = config.get("r")
    if type(rank) is not int or rank < 1:
        raise LoRAAdapterError(f"{label}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"{label}: rank {rank} is above --max-lora-rank {max_rank}; restart the server "
                               f"with --max-lora-rank {rank} or more")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAAdapterError(f"{label}: lora_alpha must be a number, got {alpha!r}")
    unsupported = [(k, v) for k, v in (("bias", config.get("bias", "none")), ("use_dora", config.get("use_dora")),
                                       ("fan_in_fan_out", config.get("fan_in_fan_out")),
                                       ("modules_to_save", config.get("modules_to_save")),
                                       ("rank_pattern", config.get("rank_pattern")),
                                       ("alpha_pattern", config.get("alpha_pattern")),
                                       ("layers_to_transform", config.get("layers_to_transform")))
                   if v not in (None, False, "none", {}, [])]
    if unsupported:
        k, v = unsupported[0]
        raise LoRAAdapterError(f"{label}: {k}={v!r} is not supported (loom serves plain LoRA: bias 'none', no "
                               "DoRA, no per-module ranks or saved modules)")
    targets = config.get("target_modules")
    if isinstance(targets, list) and dims is not None:
        lacking = [t for t in targets if not isinstance(t, str) or (t != "all-linear" and t.split(".")[-1] not in dims)]
        if lacking:
            raise LoRAAdapterError(f"{label}: target module {lacking[0]!r} is not one the model has; this model's "
                                   f"adaptable modules are {', '.join(dims)}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def check_adapter(path: str, hf_config: Any, max_lora_rank: int, *, name: str | None = None) -> AdapterInfo:
    """Check the PEFT adapter in directory ``path`` against the model of ``hf_config``; raise
    :class:`LoRAAdapterError` naming the first problem."""
    label = f"LoRA adapter {name!r}" if name else "LoRA adapter"
    if not isinstance(path, str) or not os.path.isdir(path):
        raise LoRAAdapterError(f"{label}: {path!r} is not a directory; give the directory of a PEFT adapter")
    dims = target_dims(hf_config)
    paths = MODULE_PATHS.get(getattr(hf_config, "model_type", None) or "")
    rank, scaling = _check_config(_read_config(path, label), label, max_lora_rank, dims)
    num_layers = getattr(hf_config, "num_hidden_layers", None)
    header = _read_header(path, label)
    if dims is not None and num_layers is not None and len(header) > 2 * len(dims) * num_layers:
        raise LoRAAdapterError(f"{label}: {ADAPTER_WEIGHTS} holds {len(header)} tensors; this model has "
                               f"{len(dims) * num_layers} adaptable modules (2 tensors each)")
    found: dict[str, dict[str, str]] = {}
    for key, entry in header.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise LoRAAdapterError(f"{label}: tensor {key!r} is not a LoRA weight (expected "
                                   "base_model.model.<module>.lora_A.weight / lora_B.weight)")
        module, ab = m["module"], m["ab"]
        short = module.split(".")[-1]
        if paths is not None and paths.fullmatch(module) is None and (dims is None or short in dims):
            raise LoRAAdapterError(f"{label}: tensor {key!r} names module {module!r}, which is not where this "
                                   f"model has its {short} (an adapter saved from another model class?)")
        if dims is not None and short not in dims:
            raise LoRAAdapterError(f"{label}: tensor {key!r} targets module {short!r}, which the model lacks; its "
                                   f"adaptable modules are {', '.join(dims)}")
        layer = _LAYER.search(module + ".")
        if layer is not None and num_layers is not None and int(layer[1]) >= num_layers:
            raise LoRAAdapterError(f"{label}: tensor {key!r} is for layer {layer[1]}; the model has {num_layers}")
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(shape, list) and len(shape) == 2 and all(type(s) is int for s in shape)):
            raise LoRAAdapterError(f"{label}: tensor {key!r} is not 2-D (shape {shape!r})")
        if dims is not None:
            d_in, d_out = dims[short]
            want = [rank, d_in] if ab == "A" else [d_out, rank]
            if shape != want:
                raise LoRAAdapterError(f"{label}: tensor {key!r} has shape {shape}; rank {rank} on this model needs "
                                       f"{want} (an adapter of another base model, or r in {ADAPTER_CONFIG} is wrong)")
        elif shape[0 if ab == "A" else 1] != rank:
            raise LoRAAdapterError(f"{label}: tensor {key!r} has shape {shape}, not rank {rank}")
        found.setdefault(module, {})[ab] = key
    if not found:
        raise LoRAAdapterError(f"{label}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    half = next((m for m, ab in found.items() if len(ab) != 2), None)
    if half is not None:
        raise LoRAAdapterError(f"{label}: module {half!r} has lora_{'A' if 'A' in found[half] else 'B'} but not "
                               f"lora_{'B' if 'A' in found[half] else 'A'}")
    return AdapterInfo(path=os.path.abspath(path), rank=rank, scaling=scaling,
                       modules={m: (ab["A"], ab["B"]) for m, ab in found.items()})

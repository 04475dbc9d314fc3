"""``LOOM_*`` environment variables, read in one place.

Values are read from the environment on each access until ``enable_envs_cache()``
runs at the end of a process's start-up; from then on the first value read is kept,
so a late change to the environment cannot change a running serve's behaviour.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from loom_plugin_api import loader as _plugin_loader

_cache_enabled = False
_cache: dict[str, Any] = {}


def _str_or_none(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name)


environment_variables: dict[str, Callable[[], Any]] = {
    # Comma-separated entry-point names of plugins to load; unset = all, "" = none.
    "LOOM_PLUGINS": _str_or_none("LOOM_PLUGINS"),
    # Force a platform by detector name (e.g. "cpu", "dummy_platform_plugin").
    "LOOM_PLATFORM": _str_or_none("LOOM_PLATFORM"),
    # Force an attention backend name; passed to Platform.get_attn_backend_cls.
    "LOOM_ATTENTION_BACKEND": _str_or_none("LOOM_ATTENTION_BACKEND"),
    # GiB of memory the CPU platform gives the KV cache (default: what the model needs, at most 4).
    "LOOM_CPU_KVCACHE_SPACE": _str_or_none("LOOM_CPU_KVCACHE_SPACE"),
    # Whether the CPU computes bf16 natively, for dtype "auto" on host platforms: "1" or "0";
    # unset (or "") = read the avx512_bf16 / amx_bf16 flags from /proc/cpuinfo.
    "LOOM_CPU_BF16": _str_or_none("LOOM_CPU_BF16"),
    # "0" keeps CPU decode attention and the fused ops (RMSNorm, SiLU-and-mul, rotary) on torch ops
    # instead of the kernels compiled on this machine.
    "LOOM_CPU_NATIVE_KERNELS": lambda: os.environ.get("LOOM_CPU_NATIVE_KERNELS", "1") != "0",
    # "0" keeps the CPU decode matmuls of GGUF's 4- and 8-bit weights on bf16/fp32 activations
    # instead of quantizing them to int8 per 32 values (AVX512-VNNI CPUs; see platforms/cpu_qdot.c).
    "LOOM_CPU_INT8_ACTIVATIONS": lambda: os.environ.get("LOOM_CPU_INT8_ACTIVATIONS", "1") != "0",
    # "0" keeps CPU linear layers on F.linear instead of weights prepacked for oneDNN.
    "LOOM_CPU_PREPACK": lambda: os.environ.get("LOOM_CPU_PREPACK", "1") != "0",
    # "0" keeps CPU linear layers on oneDNN where loom's own GEMM would run them (fp32 on AVX2
    # CPUs without AVX-512, bf16 on AVX512-BF16 ones without AMX: layers/onednn.py, platforms/cpu_gemm.c).
    "LOOM_CPU_PANEL_GEMM": lambda: os.environ.get("LOOM_CPU_PANEL_GEMM", "1") != "0",
    # "0" runs a gated MLP's gate/up GEMM and its SiLU-and-mul as two ops where loom's bf16 GEMM
    # would do both in one pass (the same bits either way: models/llama.py, platforms/cpu_gemm.c).
    "LOOM_CPU_FUSED_MLP": lambda: os.environ.get("LOOM_CPU_FUSED_MLP", "1") != "0",
    # Where converted weights (GGUF -> safetensors) and compiled CPU kernels are cached.
    "LOOM_CACHE_DIR": lambda: os.environ.get(
        "LOOM_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "loom")
    ),
    # "1" (or "true") lets clients load and unload LoRA adapters (POST /v1/load_lora_adapter,
    # /v1/unload_lora_adapter) and lets a request naming an unknown model ask the LoRA resolvers.
    "LOOM_ALLOW_RUNTIME_LORA_UPDATING": lambda: os.environ.get(
        "LOOM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true"),
    # Directory the filesystem LoRA resolver (a general plugin of loom-engine) finds adapters in,
    # one subdirectory per adapter name; unset: the resolver does not register.
    "LOOM_LORA_RESOLVER_CACHE_DIR": _str_or_none("LOOM_LORA_RESOLVER_CACHE_DIR"),
    "LOOM_LOGGING_LEVEL": lambda: os.environ.get("LOOM_LOGGING_LEVEL", "INFO").upper(),
}


def __getattr__(name: str) -> Any:
    if name not in environment_variables:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _value(name)


def _value(name: str) -> Any:
    if _cache_enabled:
        if name not in _cache:
            _cache[name] = environment_variables[name]()
        return _cache[name]
    return environment_variables[name]()


# The contract's plugin loader sits below the engine and cannot import it, so the engine
# hands it the reader: LOOM_PLUGINS then goes through this cache like every LOOM_* variable.
# Before this module is imported nothing can have enabled the cache, and the loader's own
# default (os.environ) reads the same value.
_plugin_loader.set_loom_plugins_reader(lambda: _value("LOOM_PLUGINS"))


def enable_envs_cache() -> None:
    """Freeze every ``LOOM_*`` variable at its current value (end of start-up)."""
    global _cache_enabled
    for name, getter in environment_variables.items():
        _cache[name] = getter()
    _cache_enabled = True


def is_envs_cache_enabled() -> bool:
    return _cache_enabled


def _disable_envs_cache_for_tests() -> None:
    global _cache_enabled
    _cache_enabled = False
    _cache.clear()

"""The built-in model architectures, registered lazily so that no model module is
imported until a config names its architecture."""

from __future__ import annotations

from loom_plugin_api import ModelRegistry

__all__ = ["BUILTIN_MODELS", "register_builtin_models"]

BUILTIN_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "loom.models.llama:LlamaForCausalLM",
    "OPTForCausalLM": "loom.models.opt:OPTForCausalLM",
}
"""HF architecture name -> ``"module:Class"`` of loom's implementation."""


def register_builtin_models() -> None:
    """Register every built-in architecture with ``ModelRegistry`` (lazy entries).

    Idempotent; called when ``loom`` is imported, so once per process. An architecture
    that a plugin has already registered (say a replacement ``LlamaForCausalLM``) is
    left alone: the plugin's choice wins over the built-in.
    """
    for arch, target in BUILTIN_MODELS.items():
        if not ModelRegistry.is_registered(arch):
            ModelRegistry.register_model(arch, target)

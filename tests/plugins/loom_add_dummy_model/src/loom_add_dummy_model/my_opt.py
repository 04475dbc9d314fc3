from __future__ import annotations

from loom_plugin_api import ModelRegistry

# The in-tree class, reached through the registry (see my_llama.py).
OPTForCausalLM, _ = ModelRegistry.resolve_model_cls("OPTForCausalLM")


class MyOPTForCausalLM(OPTForCausalLM):  # type: ignore[valid-type, misc]
    """OPT under another architecture name (selected with --hf-overrides)."""

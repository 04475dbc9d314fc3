from __future__ import annotations

from loom_plugin_api import ModelRegistry

# The in-tree class, reached through the registry (the engine registers its models in
# every process before plugins load), so this plugin never imports the engine.
LlamaForCausalLM, _ = ModelRegistry.resolve_model_cls("LlamaForCausalLM")


class MyLlama(LlamaForCausalLM):  # type: ignore[valid-type, misc]
    """Llama under another architecture name, registered lazily."""

"""Test model plugin: one eager and one lazy registration."""

from __future__ import annotations

from loom_plugin_api import ModelRegistry

register_calls = 0


def register() -> None:
    global register_calls
    register_calls += 1
    from .my_opt import MyOPTForCausalLM

    # Eager: the class is imported now and its model info computed at registration.
    ModelRegistry.register_model("MyOPTForCausalLM", MyOPTForCausalLM)
    # Lazy: nothing is imported until the architecture is inspected.
    ModelRegistry.register_model("MyLlama", "loom_add_dummy_model.my_llama:MyLlama")

from __future__ import annotations

from loom.models.llama import LlamaForCausalLM


class MyLlama(LlamaForCausalLM):
    """Llama under another architecture name, registered lazily."""

from __future__ import annotations

from loom.models.opt import OPTForCausalLM


class MyOPTForCausalLM(OPTForCausalLM):
    """OPT under another architecture name (selected with --hf-overrides)."""

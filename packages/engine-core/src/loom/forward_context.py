"""The per-step context lives in the plugin contract (``loom_plugin_api.context``)."""

from __future__ import annotations

from loom_plugin_api.context import ForwardContext, get_forward_context, set_forward_context

__all__ = ["ForwardContext", "get_forward_context", "set_forward_context"]

"""The reference model runner lives in the plugin contract, so platforms can build on it."""

from __future__ import annotations

from loom_plugin_api.model_runner import ModelRunner

__all__ = ["ModelRunner"]

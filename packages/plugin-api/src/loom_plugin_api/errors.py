"""Exceptions of the plugin contract. Each message names what failed and how to fix it."""

from __future__ import annotations


class PluginError(RuntimeError):
    """A plugin could not be loaded or run; the message names the group and entry point."""


class PlatformError(RuntimeError):
    """The platform could not be resolved (none, or more than one out-of-tree answered), or its
    class does not follow the contract (``loom_plugin_api.validation``)."""


class ModelRegistryError(ValueError):
    """A bad registration or an architecture the registry does not know."""


class CustomOpError(RuntimeError):
    """A bad CustomOp registration or ``custom_ops`` setting."""

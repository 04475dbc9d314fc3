"""The reference ops live in the plugin contract (``loom_plugin_api.ops``); the models import them here."""

from __future__ import annotations

from loom_plugin_api.ops.layernorm import *  # noqa: F403
from loom_plugin_api.ops.layernorm import __all__  # noqa: F401

"""The CPU worker lives in the plugin contract (``loom_plugin_api.cpu_worker``), so that
platforms computing in host memory can subclass it without importing the engine. The
CPU platform names it by this path."""

from __future__ import annotations

from loom_plugin_api.cpu_worker import CPUWorker

__all__ = ["CPUWorker"]

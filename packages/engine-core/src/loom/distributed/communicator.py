"""The default communicator lives in the plugin contract; this name stays for the engine."""

from __future__ import annotations

from loom_plugin_api.communicator import DeviceCommunicatorBase, TorchDistributedCommunicator

__all__ = ["DeviceCommunicatorBase", "TorchDistributedCommunicator"]

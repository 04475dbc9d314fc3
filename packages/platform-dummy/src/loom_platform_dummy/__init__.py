"""The reference out-of-tree platform. Vendors: copy this package and change the device.

Two plugins, in two groups (see pyproject.toml):

* ``loom.platform_plugins``: ``dummy_platform_plugin`` — the detector;
* ``loom.general_plugins``: ``dummy_custom_ops`` — registers ``DummyRotaryEmbedding`` and
  ``DummyQuantizedLinear``.
"""

from __future__ import annotations

__all__ = ["dummy_platform_plugin", "register_ops"]


def dummy_platform_plugin() -> str | None:
    """Detector: a real one checks for its device and returns None when it is absent.

    This reference device is always present. A detector runs in every process of a
    serve, early: keep it cheap (no torch import, no device initialization).
    """
    return "loom_platform_dummy.dummy_platform.DummyPlatform"


def register_ops() -> None:
    """General plugin: importing the module registers the replacement op (once per process)."""
    from . import custom_ops  # noqa: F401

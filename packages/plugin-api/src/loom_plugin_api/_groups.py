"""Entry-point group names: the single place they are spelled."""

from __future__ import annotations

PLATFORM_PLUGINS_GROUP = "loom.platform_plugins"
GENERAL_PLUGINS_GROUP = "loom.general_plugins"
STAT_LOGGER_PLUGINS_GROUP = "loom.stat_logger_plugins"
ENDPOINT_PLUGINS_GROUP = "loom.endpoint_plugins"

ALL_GROUPS = (
    PLATFORM_PLUGINS_GROUP,
    GENERAL_PLUGINS_GROUP,
    STAT_LOGGER_PLUGINS_GROUP,
    ENDPOINT_PLUGINS_GROUP,
)

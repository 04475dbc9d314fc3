"""Discovery and loading of plugins through Python entry points.

Every process of a serve loads plugins again (children are fresh interpreters), so
everything here is once-per-process and idempotent:

* the entry-point scan runs once per process and is cached;
* ``load_plugins_by_group`` imports a group's entry points once and caches the result;
  ``load_plugins_strict`` is the same for callers that cannot go on without every plugin;
* ``load_general_plugins`` calls the general plugins once per process.

``LOOM_PLUGINS`` (comma-separated entry-point names, spaces stripped) limits what loads:
unset loads every plugin, an empty string loads none. The engine reads it through its
environment cache (``loom.envs`` installs the reader with :func:`set_loom_plugins_reader`);
without the engine it is read from ``os.environ``.

Before a plugin is imported, its distribution's requirement on ``loom-plugin-api``
(``Requires-Dist``) is checked against the installed contract: a plugin whose range excludes
it is refused like a plugin that fails to import (status ``"failed"``, logged at ERROR, and a
:class:`PluginError` from :func:`load_plugins_strict`); a distribution that declares no range
is loaded with a warning.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from ._groups import ALL_GROUPS, GENERAL_PLUGINS_GROUP
from .errors import PluginError
from .tracing import span
from .validation import contract_mismatch, contract_range

logger = logging.getLogger("loom.plugins")

__all__ = [
    "PluginRecord",
    "allowed_plugin_names",
    "general_plugins_loaded",
    "load_general_plugins",
    "load_plugins_by_group",
    "load_plugins_strict",
    "plugin_records",
    "set_loom_plugins_reader",
]


@dataclass(slots=True, kw_only=True)
class PluginRecord:
    """What happened to one entry point in this process (shown by ``loom plugins``)."""

    group: str
    name: str
    value: str
    distribution: str | None
    version: str | None
    status: str  # "loaded", "filtered", "failed"
    error: str | None = None
    load_seconds: float = 0.0
    calls: list[str] = field(default_factory=list)
    contract_range: str | None = None
    """The distribution's requirement on loom-plugin-api (``""``: any version); None when it
    declares none or the entry point belongs to no distribution."""
    compatible: bool | None = None
    """Whether ``contract_range`` includes the installed contract; None when not declared."""


_records: dict[tuple[str, str], PluginRecord] = {}
_loaded_groups: dict[str, dict[str, Callable[..., Any]]] = {}
_general_plugins_loaded = False
_general_plugins_error: PluginError | None = None
_unknown_names_warned = False


def _read_loom_plugins_from_environ() -> str | None:
    return os.environ.get("LOOM_PLUGINS")


_loom_plugins_reader: Callable[[], str | None] = _read_loom_plugins_from_environ


def set_loom_plugins_reader(reader: Callable[[], str | None]) -> None:
    """Read ``LOOM_PLUGINS`` through ``reader`` from now on (the engine's environment cache)."""
    global _loom_plugins_reader
    _loom_plugins_reader = reader


def allowed_plugin_names() -> set[str] | None:
    """Names allowed by ``LOOM_PLUGINS``; None when the variable is unset (all allowed)."""
    raw = _loom_plugins_reader()
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


@functools.cache
def _scan() -> dict[str, tuple[EntryPoint, ...]]:
    """Scan installed entry points of loom's groups, once per process."""
    start = time.perf_counter()
    with span("scan entry points"):
        found = {group: tuple(entry_points(group=group)) for group in ALL_GROUPS}
    logger.debug("Scanned loom entry points in %.3f s", time.perf_counter() - start)
    return found


def _distribution(ep: EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def _warn_unknown_names(allowed: set[str]) -> None:
    global _unknown_names_warned
    if _unknown_names_warned:
        return
    _unknown_names_warned = True
    existing = sorted({ep.name for eps in _scan().values() for ep in eps})
    for name in sorted(allowed - set(existing)):
        logger.warning(
            "LOOM_PLUGINS names %r, but no installed plugin has that name; installed: %s",
            name,
            ", ".join(existing) or "(none)",
        )


def load_plugins_by_group(group: str) -> dict[str, Callable[..., Any]]:
    """Import the entry points of ``group`` and return ``{name: loaded object}``.

    Called lazily, the first time a group is needed; later calls in the same process
    return the cached dict. A plugin whose import fails is logged at ERROR with the
    group, the entry point and the exception, kept in :func:`plugin_records` with status
    ``"failed"``, and left out of the result; callers that cannot go on without every
    plugin use :func:`load_plugins_strict` instead.
    """
    if group in _loaded_groups:
        return _loaded_groups[group]
    eps = _scan().get(group, ())
    if group not in ALL_GROUPS:
        eps = tuple(entry_points(group=group))
    allowed = allowed_plugin_names()
    if allowed is not None:
        _warn_unknown_names(allowed)
    if not eps:
        logger.debug("No plugins for group %s found.", group)
    plugins: dict[str, Callable[..., Any]] = {}
    group_start = time.perf_counter()
    for ep in eps:
        dist, version = _distribution(ep)
        record = PluginRecord(
            group=group, name=ep.name, value=ep.value, distribution=dist, version=version,
            status="filtered",
        )
        _records[(group, ep.name)] = record
        if allowed is not None and ep.name not in allowed:
            logger.debug("Plugin %s of group %s is filtered out by LOOM_PLUGINS", ep.name, group)
            continue
        if not _contract_allows(ep, group, record):
            continue
        start = time.perf_counter()
        try:
            with span(f"import plugin {ep.name}", group=group, value=ep.value):
                obj = ep.load()
        except Exception as e:  # a broken plugin must be reported, never skipped silently
            record.status = "failed"
            record.error = f"{type(e).__name__}: {e}"
            logger.error(
                "Failed to load plugin %r of group %s (%s, from %s): %s. Fix or uninstall "
                "%s, or leave it out with LOOM_PLUGINS.",
                ep.name, group, ep.value, dist or "unknown distribution", record.error,
                dist or "the distribution",
            )
            continue
        record.load_seconds = time.perf_counter() - start
        if not callable(obj):
            record.status = "failed"
            record.error = f"entry point value {ep.value!r} is a {type(obj).__name__}, not a callable"
            logger.error("Plugin %r of group %s is invalid: %s", ep.name, group, record.error)
            continue
        record.status = "loaded"
        plugins[ep.name] = obj
    if plugins:
        logger.info(
            "Loaded plugins of group %s in %.3f s: %s", group, time.perf_counter() - group_start,
            ", ".join(f"{name} ({_records[(group, name)].load_seconds:.3f} s)" for name in plugins),
        )
    _loaded_groups[group] = plugins
    return plugins


def load_plugins_strict(group: str, *, kind: str) -> dict[str, Callable[..., Any]]:
    """:func:`load_plugins_by_group`, raising when a plugin of ``group`` failed to load.

    For callers that cannot go on without every plugin of their group: the engine's
    general plugins, stat loggers and endpoints. A plugin that failed to import, is not
    callable or was refused for its contract range stops the caller with a
    :class:`PluginError` naming the first such plugin, its entry point and distribution,
    and what to do; ``kind`` is the word the message calls the plugin by (``"general"``,
    ``"stat-logger"``, ``"endpoint"``). Idempotent: the group is imported once per process
    (the cache of :func:`load_plugins_by_group`), and every later call raises the same error.
    """
    plugins = load_plugins_by_group(group)
    failed = next((r for r in plugin_records(group) if r.status == "failed"), None)
    if failed is not None:
        raise PluginError(
            f"{kind} plugin {failed.name!r} ({failed.value}, from {failed.distribution}) failed to load: "
            f"{failed.error}. Fix or uninstall it, or leave it out with LOOM_PLUGINS."
        )
    return plugins


def _contract_allows(ep: EntryPoint, group: str, record: PluginRecord) -> bool:
    """Check the distribution's range of loom-plugin-api; refuse the plugin when it excludes
    the installed contract (recorded and logged like an import failure)."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return True  # not from an installed distribution (nothing declares a range)
    spec = contract_range(dist)
    plugin = f"plugin {ep.name!r} of group {group}"
    if spec is None:
        logger.warning(
            "%s (%s %s) does not declare which loom-plugin-api it was built for; loading it anyway. "
            'Add "loom-plugin-api>=1,<2" (the range it supports) to its dependencies.',
            plugin, record.distribution, record.version,
        )
        return True
    record.contract_range = str(spec)
    mismatch = contract_mismatch(plugin, dist)
    record.compatible = mismatch is None
    if mismatch is None:
        return True
    record.status = "failed"
    record.error = str(PluginError(mismatch))
    logger.error("%s", record.error)
    return False


def plugin_records(group: str | None = None) -> list[PluginRecord]:
    """Records of every entry point seen so far in this process, optionally of one group."""
    return [r for (g, _), r in _records.items() if group is None or g == group]


def general_plugins_loaded() -> bool:
    """Whether :func:`load_general_plugins` has run in this process."""
    return _general_plugins_loaded


def load_general_plugins() -> None:
    """Run every general plugin once per process, in entry-point order.

    Called before the CLI builds its engine-argument parser and at the start of every
    child process; further calls in the same process do nothing. A plugin that fails to
    import or raises when called stops start-up with a :class:`PluginError` that names
    it: a serve must not run with half of its registrations made.
    """
    global _general_plugins_loaded, _general_plugins_error
    if _general_plugins_error is not None:
        # A failed run is not retried (plugins may have registered half of their things),
        # and every later caller gets the same error instead of a half-set-up process.
        raise _general_plugins_error
    if _general_plugins_loaded:
        return
    _general_plugins_loaded = True
    try:
        with span("general plugins"):
            _run_general_plugins()
    except PluginError as e:
        _general_plugins_error = e
        raise


def _run_general_plugins() -> None:
    plugins = load_plugins_strict(GENERAL_PLUGINS_GROUP, kind="general")
    for name, func in plugins.items():
        record = _records[(GENERAL_PLUGINS_GROUP, name)]
        start = time.perf_counter()
        try:
            with span(f"run general plugin {name}"):
                func()
        except Exception as e:
            record.status = "failed"
            record.error = f"{type(e).__name__}: {e}"
            raise PluginError(
                f"general plugin {name!r} ({record.value}, from {record.distribution}) raised "
                f"{record.error}. Fix or uninstall it, or leave it out with LOOM_PLUGINS."
            ) from e
        elapsed = time.perf_counter() - start
        record.calls.append(f"ran in {elapsed:.3f} s")
        logger.info("General plugin %s ran in %.3f s", name, elapsed)


def _reset_for_tests() -> None:
    """Forget everything loaded in this process (tests only)."""
    global _general_plugins_loaded, _general_plugins_error, _unknown_names_warned
    _records.clear()
    _loaded_groups.clear()
    _general_plugins_loaded = False
    _general_plugins_error = None
    _unknown_names_warned = False
    _scan.cache_clear()

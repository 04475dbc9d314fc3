"""The platform under test: its detector, its answer, its class and its distribution.

The kit finds a platform the way ``loom plugins`` names it: by its detector's name (an
entry point of ``loom.platform_plugins``, or a built-in detector of loom-engine such as
``cpu`` and ``cuda``), the same name ``LOOM_PLATFORM`` takes.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

from .._groups import GENERAL_PLUGINS_GROUP, PLATFORM_PLUGINS_GROUP
from .._qualname import resolve_obj_by_qualname
from ..platform import Platform
from ..validation import contract_range

__all__ = ["PlatformUnderTest", "find_detector", "inspect_platform"]

@dataclass(slots=True, kw_only=True)
class PlatformUnderTest:
    name: str
    """The detector's name (what ``--loom-platform`` and ``LOOM_PLATFORM`` take)."""
    entry_point: str
    """``module:function`` of the detector."""
    detector: Callable[[], str | None] | None
    """None when the entry point failed to load (``error`` says why)."""
    answer: str | None
    """What the detector returned here, or None (device absent)."""
    qualname: str | None
    """The class tested: the answer, else ``--loom-platform-class``."""
    platform_cls: type[Platform] | None
    error: str | None = None
    """Why the class could not be had (the detector raised, the name does not import...)."""
    distribution: str | None = None
    version: str | None = None
    contract_range: str | None = None
    """The range of loom-plugin-api the distribution requires (None: it declares none)."""

    @property
    def device_present(self) -> bool:
        return self.answer is not None

    def device(self) -> str:
        """Where op and attention checks allocate: the platform's device, or the host when the
        device is absent and the class was named with ``--loom-platform-class`` (kernels that
        run on host tensors, such as Triton's interpreter)."""
        if self.device_present and self.platform_cls is not None:
            return self.platform_cls.device_type
        return "cpu"


def _platform_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=PLATFORM_PLUGINS_GROUP)}


def _builtin_detectors() -> dict[str, Callable[[], str | None]]:
    try:
        from loom.platforms import builtin_platform_plugins  # engine-provided built-ins (cpu, cuda)
    except ImportError:
        return {}
    return dict(builtin_platform_plugins)


def known_names() -> list[str]:
    return sorted({*_builtin_detectors(), *_platform_entry_points()})


def find_detector(
    name: str,
) -> tuple[Callable[[], str | None] | None, str, importlib.metadata.EntryPoint | None]:
    """The detector called ``name``: ``(function, "module:function", entry point or None)``;
    the function is None when the entry point names nothing importable (``inspect_platform``
    loads it again to report why)."""
    eps = _platform_entry_points()
    if name in eps:
        ep = eps[name]
        try:
            return ep.load(), ep.value, ep
        except Exception:  # reported with its reason by inspect_platform and the static tier
            return None, ep.value, ep
    builtins = _builtin_detectors()
    if name in builtins:
        func = builtins[name]
        return func, f"{func.__module__}:{func.__qualname__}", None
    raise LookupError(
        f"no platform detector named {name!r} is installed; installed: "
        f"{', '.join(known_names()) or '(none)'} "
        "(the names `loom plugins` lists under [platform detectors])"
    )


def _distribution_of(module: str) -> tuple[str | None, str | None]:
    top = module.split(".")[0]
    names = importlib.metadata.packages_distributions().get(top) or []
    if not names:
        return None, None
    dist = importlib.metadata.distribution(names[0])
    return dist.metadata["Name"], dist.version


@functools.cache
def inspect_platform(name: str, forced_class: str | None) -> PlatformUnderTest:
    """Run the detector once and resolve the class (cached for the session)."""
    detector, value, ep = find_detector(name)
    put = PlatformUnderTest(
        name=name, entry_point=value, detector=detector, answer=None, qualname=None, platform_cls=None
    )
    if detector is None:
        assert ep is not None
        try:
            ep.load()
        except Exception as e:
            put.error = f"entry point {name} = {value} failed to load: {type(e).__name__}: {e}"
    else:
        try:
            put.answer = detector()
        except Exception as e:  # reported by the static tier, never swallowed
            if _is_not_available(e):
                put.error = f"detector {name} ({value}) answered None here: {e}"
            else:
                put.error = f"detector {name} ({value}) raised {type(e).__name__}: {e}"
    if put.answer is not None and not isinstance(put.answer, str):
        put.error = f"detector {name} ({value}) returned {put.answer!r}, not a qualified class name or None"
        put.answer = None
    put.qualname = put.answer or forced_class
    if put.qualname is None and put.error is None and detector is not None:
        put.error = (
            f"detector {name} ({value}) answered None here (its device is absent); run the kit where the "
            "device is, or name the class with --loom-platform-class to check what runs without it"
        )
    if put.qualname is not None:
        try:
            cls = resolve_obj_by_qualname(put.qualname)
        except (ImportError, ValueError) as e:
            put.error = f"detector {name} named {put.qualname!r}, which does not import: {e}"
        else:
            if isinstance(cls, type) and issubclass(cls, Platform):
                put.platform_cls = cls
            else:
                put.error = (
                    f"detector {name} named {put.qualname!r}, which is not a subclass of "
                    "loom_plugin_api.Platform; subclass it"
                )
    if ep is not None and getattr(ep, "dist", None) is not None:
        put.distribution, put.version = ep.dist.metadata["Name"], ep.dist.version
    elif put.qualname is not None:
        put.distribution, put.version = _distribution_of(put.qualname)
    if put.distribution is not None:
        spec = contract_range(importlib.metadata.distribution(put.distribution))
        put.contract_range = None if spec is None else str(spec)
    return put


def general_plugins_of(distribution: str | None) -> list[importlib.metadata.EntryPoint]:
    """The ``loom.general_plugins`` entry points that ``distribution`` declares."""
    return [
        ep
        for ep in importlib.metadata.entry_points(group=GENERAL_PLUGINS_GROUP)
        if distribution is not None
        and getattr(ep, "dist", None) is not None
        and ep.dist.metadata["Name"] == distribution
    ]


def _is_not_available(error: Exception) -> bool:
    """A built-in detector's way of answering None with a reason (``loom.platforms._NotAvailable``)."""
    return type(error).__name__ == "_NotAvailable" and type(error).__module__ == "loom.platforms"

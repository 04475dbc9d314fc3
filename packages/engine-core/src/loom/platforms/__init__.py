"""Platform resolution: ``current_platform`` is decided on first use in each process.

Rules (stop 3 of the start-up):

1. Built-in detectors run first (``cuda``, then ``cpu``), then every out-of-tree
   detector of the ``loom.platform_plugins`` group, in entry-point order.
2. Exactly one out-of-tree detector answering wins over the built-ins; it is called a
   second time for the class name. Two or more answering is an error naming them.
3. With no out-of-tree answer, the first built-in that answered wins (cuda before cpu).
4. ``LOOM_PLATFORM=<detector name>`` forces that detector's answer.

The winning class is validated against the contract as it is resolved (hook signatures,
names close to a hook's: ``loom_plugin_api.validation``); the names its hooks return are
checked by :func:`validate_platform_names` where the config is finished, once, before any
process is spawned (they import torch, which processes that never compute do not load).

Every verdict (answered, None, or raised with its reason) is logged and kept in
``detector_verdicts()`` for ``loom plugins``. ``import loom`` does not resolve anything.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loom_plugin_api import PLATFORM_PLUGINS_GROUP, Platform, PlatformError, load_plugins_by_group
from loom_plugin_api import context as _plugin_context
from loom_plugin_api._qualname import resolve_obj_by_qualname
from loom_plugin_api.loader import plugin_records
from loom_plugin_api.tracing import span
from loom_plugin_api.validation import validate_platform_cls, validate_worker_cls

from .. import envs
from ..logger import init_logger

if TYPE_CHECKING:
    current_platform: Platform

logger = init_logger(__name__)

__all__ = [
    "DetectorVerdict",
    "current_platform",
    "detector_verdicts",
    "platform_plugin",
    "resolve_current_platform",
    "validate_platform_names",
]


def cuda_platform_plugin() -> str | None:
    """Built-in detector: the CUDA platform, when its wheel is installed and a GPU is visible.

    Every process of a serve runs the detectors, and most of them never compute, so this
    asks the NVIDIA driver (NVML) rather than torch: importing torch and probing CUDA
    would cost each of them seconds and a CUDA context's memory.
    """
    # lazy: only asked when loom-platform-cuda is installed
    import importlib.util

    if importlib.util.find_spec("loom_platform_cuda") is None:
        raise _NotAvailable("loom-platform-cuda is not installed")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        raise _NotAvailable(f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU")
    count = _nvml_device_count()
    if count == 0:
        raise _NotAvailable("no CUDA device is visible (the NVIDIA driver reports 0 GPUs)")
    torch_cuda = _torch_cuda_version()
    if torch_cuda is None:
        raise _NotAvailable("the installed torch is a CPU-only build (torch.version.cuda is None)")
    return "loom_platform_cuda.platform.CudaPlatform"


def _nvml_device_count() -> int:
    """GPUs the NVIDIA driver reports, through NVML (no CUDA context is created)."""
    # lazy: only asked when loom-platform-cuda is installed
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        raise _NotAvailable("no CUDA device is visible: the NVIDIA driver (libnvidia-ml.so.1) is not "
                            "installed") from None
    if nvml.nvmlInit_v2() != 0:
        raise _NotAvailable("no CUDA device is visible: the NVIDIA driver failed to initialize (nvmlInit)")
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            raise _NotAvailable("no CUDA device is visible: NVML cannot count the GPUs")
        return int(count.value)
    finally:
        nvml.nvmlShutdown()


def _torch_cuda_version() -> str | None:
    """``torch.version.cuda`` read from torch's version file, without importing torch."""
    # lazy: only asked when loom-platform-cuda is installed
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        with open(path) as f:
            match = re.search(r"^cuda\b[^=]*=\s*['\"]([^'\"]+)['\"]", f.read(), re.MULTILINE)
    except OSError:
        return None
    return match.group(1) if match else None


def cpu_platform_plugin() -> str | None:
    """Built-in detector: the CPU platform answers on every host."""
    return "loom.platforms.cpu.CpuPlatform"


builtin_platform_plugins: dict[str, Callable[[], str | None]] = {
    "cuda": cuda_platform_plugin,
    "cpu": cpu_platform_plugin,
}


class _NotAvailable(Exception):
    """A built-in detector's reason for answering None."""


@dataclass(slots=True, kw_only=True)
class DetectorVerdict:
    name: str
    builtin: bool
    answer: str | None = None
    reason: str | None = None  # why None, or the exception when it raised
    raised: bool = False
    won: bool = False

    def describe(self) -> str:
        if self.raised:
            return f"raised: {self.reason}"
        if self.answer is None:
            return "None" + (f" ({self.reason})" if self.reason else "")
        return f"answered {self.answer}" + (" [winner]" if self.won else "")


_current_platform: Platform | None = None
_resolution_error: PlatformError | None = None
_verdicts: list[DetectorVerdict] = []


def _run_detector(name: str, func: Callable[[], str | None], builtin: bool) -> DetectorVerdict:
    verdict = DetectorVerdict(name=name, builtin=builtin)
    try:
        with span(f"platform detector {name}", builtin=builtin):
            answer = func()
    except _NotAvailable as e:
        verdict.reason = str(e)
    except Exception as e:  # reported at WARNING and shown by `loom plugins`, never hidden
        verdict.raised = True
        verdict.reason = f"{type(e).__name__}: {e}"
        logger.warning("Platform plugin %s failed during detection: %s", name, verdict.reason)
    else:
        if answer is not None and not isinstance(answer, str):
            verdict.raised = True
            verdict.reason = f"returned {answer!r}, not a qualified class name or None"
            logger.warning("Platform plugin %s is invalid: %s", name, verdict.reason)
        else:
            verdict.answer = answer
    logger.info("Platform detector %s: %s", name, verdict.describe())
    return verdict


def resolve_current_platform() -> Platform:
    """Run every detector and build this process's platform (called once per process)."""
    start = time.perf_counter()
    oot_plugins = load_plugins_by_group(PLATFORM_PLUGINS_GROUP)
    verdicts: list[DetectorVerdict] = []
    for name, func in builtin_platform_plugins.items():
        verdicts.append(_run_detector(name, func, builtin=True))
    for record in plugin_records(PLATFORM_PLUGINS_GROUP):
        if record.status == "failed":
            verdicts.append(DetectorVerdict(
                name=record.name, builtin=False, raised=True, reason=f"failed to load: {record.error}",
            ))
    for name, func in oot_plugins.items():
        verdicts.append(_run_detector(name, func, builtin=False))
    _verdicts[:] = verdicts

    forced = envs.LOOM_PLATFORM
    answered = [v for v in verdicts if v.answer is not None]
    oot = [v for v in answered if not v.builtin]
    if forced:
        chosen = [v for v in verdicts if v.name == forced]
        if not chosen or chosen[0].answer is None:
            known = ", ".join(v.name for v in verdicts)
            why = "is not installed" if not chosen else f"did not answer ({chosen[0].describe()})"
            raise PlatformError(f"LOOM_PLATFORM={forced!r} {why}; detectors: {known}")
        winner = chosen[0]
        qualname = winner.answer
    elif broken := [v for v in verdicts if v.raised and not v.builtin]:
        # A vendor's platform that fails must not leave the serve quietly on another device.
        raise PlatformError(
            "out-of-tree platform plugin " + "; ".join(f"{v.name} {v.describe()}" for v in broken)
            + ". Fix or uninstall it, leave it out with LOOM_PLUGINS, or choose a platform with LOOM_PLATFORM=<name>"
        )
    elif len(oot) >= 2:
        raise PlatformError(
            "Only one platform plugin can be activated, but these out-of-tree plugins all "
            f"answered: {[v.name for v in oot]}. Uninstall all but one, or choose one with "
            "LOOM_PLATFORM=<name> or LOOM_PLUGINS."
        )
    elif len(oot) == 1:
        winner = oot[0]
        try:
            qualname = oot_plugins[winner.name]()  # asked again for the class name, as the tour does
        except Exception as e:
            raise PlatformError(
                f"platform plugin {winner.name} raised when asked again for its class: {type(e).__name__}: {e}"
            ) from e
        logger.info("Platform plugin %s is activated", winner.name)
    elif answered:
        winner = answered[0]
        qualname = winner.answer
    else:
        raise PlatformError("no platform detector answered; install a platform plugin")
    winner.won = True
    if not isinstance(qualname, str):
        raise PlatformError(f"platform plugin {winner.name} returned {qualname!r} when asked again")
    try:
        platform_cls = resolve_obj_by_qualname(qualname)
    except (ImportError, ValueError) as e:
        raise PlatformError(f"platform plugin {winner.name} named {qualname!r}, which does not import: {e}") from e
    if not (isinstance(platform_cls, type) and issubclass(platform_cls, Platform)):
        raise PlatformError(
            f"platform plugin {winner.name} named {qualname!r}, which is not a loom_plugin_api.Platform "
            "subclass; fix the plugin or uninstall it"
        )
    plugin = _describe_plugin(winner)
    for warning in validate_platform_cls(platform_cls, plugin, resolve_names=False):
        logger.warning("%s", warning)
    platform = platform_cls()
    logger.info(
        "Resolved platform %s (%s) from detector %s in %.3f s",
        type(platform).__name__, platform.device_name, winner.name, time.perf_counter() - start,
    )
    return platform


def _describe_plugin(winner: DetectorVerdict) -> str:
    """``'name' (distribution version)``: where the platform class comes from, for messages."""
    if winner.builtin:
        return f"{winner.name!r} (built into loom-engine)"
    record = next((r for r in plugin_records(PLATFORM_PLUGINS_GROUP) if r.name == winner.name), None)
    if record is None or record.distribution is None:
        return f"{winner.name!r}"
    return f"{winner.name!r} ({record.distribution} {record.version})"


def platform_plugin() -> str:
    """Where this process's platform comes from (detector and distribution); resolves it."""
    platform = _get_current_platform()
    winner = next((v for v in _verdicts if v.won), None)
    if winner is None:  # set up without the detectors (tests)
        return repr(f"{type(platform).__module__}.{type(platform).__qualname__}")
    return _describe_plugin(winner)


def validate_platform_names(config: Any, *, worker_cls_chosen_by_user: bool = False) -> None:
    """Check the qualified names the platform's hooks returned for ``config``: ``worker_cls``
    (set by ``check_and_update_config``, or by the user), the attention backend for the
    model's head size and dtype, and the communicator must import and subclass the
    contract's bases.

    Called once, where the config is finished, before any process is spawned; raises
    ``PlatformError`` naming the plugin, the hook, what was expected and what was found.
    """
    platform_cls = type(_get_current_platform())
    plugin = platform_plugin()
    builtin = platform_cls.__module__.startswith("loom.")
    if builtin and not worker_cls_chosen_by_user:
        # The built-in platforms' names are the engine's own (its tests import them); importing
        # them here would put torch into the CLI process, which only the workers need.
        return
    validate_worker_cls(config.parallel_config.worker_cls, plugin, platform_cls,
                        chosen_by_user=worker_cls_chosen_by_user)
    if builtin:
        return
    # lazy: torch stays out of the processes that never compute
    import torch
    from loom_plugin_api import AttentionSelectorConfig

    selector = AttentionSelectorConfig(
        head_size=config.model_config.get_head_size(), dtype=getattr(torch, config.model_config.dtype),
        block_size=config.cache_config.block_size,
    )
    validate_platform_cls(platform_cls, plugin, selector=selector)


def detector_verdicts() -> list[DetectorVerdict]:
    """Each detector's verdict from this process's resolution (empty before it)."""
    return list(_verdicts)


def _get_current_platform() -> Platform:
    global _current_platform, _resolution_error
    if _resolution_error is not None:
        raise _resolution_error  # detectors run once per process, even when resolution failed
    if _current_platform is None:
        try:
            with span("resolve platform"):
                _current_platform = resolve_current_platform()
        except PlatformError as e:
            _resolution_error = e
            raise
        except Exception as e:  # never let an AttributeError escape the module __getattr__
            _resolution_error = PlatformError(f"platform resolution failed: {type(e).__name__}: {e}")
            raise _resolution_error from e
    return _current_platform


def _reset_for_tests() -> None:
    global _current_platform, _resolution_error
    _current_platform = None
    _resolution_error = None
    _verdicts.clear()


_plugin_context.set_platform_resolver(_get_current_platform)


def __getattr__(name: str) -> Any:
    if name == "current_platform":
        return _get_current_platform()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

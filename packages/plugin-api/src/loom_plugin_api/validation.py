"""Checks of a plugin against the contract, run when it loads (as pluggy verifies a hook).

The engine runs them before it spawns any process; a vendor's tests and the conformance
kit may call them too:

* :func:`contract_range` / :func:`contract_mismatch`: the distribution's ``Requires-Dist``
  on ``loom-plugin-api`` against the installed contract;
* :func:`validate_platform_cls`: every hook a ``Platform`` subclass overrides accepts the
  specification's parameters and stays a class method, a method named close to a hook is
  reported, and the qualified names the hooks return import and subclass the contract's
  bases;
* :func:`validate_worker_cls`: the ``worker_cls`` that ``check_and_update_config`` set.

Errors raise :class:`PlatformError` with one line that names the plugin, the hook, what was
expected and what was found; warnings are returned for the caller to log.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
from typing import TYPE_CHECKING, Any

from ._qualname import resolve_obj_by_qualname
from .errors import PlatformError
from .platform import Platform

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

    from .attention import AttentionSelectorConfig

__all__ = [
    "CONTRACT_DISTRIBUTION",
    "contract_mismatch",
    "contract_range",
    "hook_names",
    "installed_contract_version",
    "validate_platform_cls",
    "validate_worker_cls",
]

CONTRACT_DISTRIBUTION = "loom-plugin-api"
_CLOSE_NAME_CUTOFF = 0.85  # get_attn_backend_class -> get_attn_backend_cls is 0.95


# ---- the contract range a distribution asks for -----------------------------------------
def installed_contract_version() -> str:
    """The installed ``loom-plugin-api`` version, as its distribution metadata says."""
    try:
        return importlib.metadata.version(CONTRACT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        from . import __version__

        return __version__


def contract_range(dist: importlib.metadata.Distribution) -> SpecifierSet | None:
    """The range of ``loom-plugin-api`` that ``dist`` requires (its ``Requires-Dist``), or None
    when it declares no such requirement. Requirements of extras are not the plugin's."""
    # lazy: packaging costs start-up time; only a plugin that declares a contract range needs it
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    found: SpecifierSet | None = None
    for text in dist.requires or ():
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue  # not ours to judge; pip reports it
        if canonicalize_name(req.name) != CONTRACT_DISTRIBUTION:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        found = req.specifier if found is None else found & req.specifier
    return found


def contract_mismatch(plugin: str, dist: importlib.metadata.Distribution) -> str | None:
    """One line saying why ``plugin`` (of distribution ``dist``) cannot run on the installed
    contract, or None when its range includes it (or it declares none)."""
    # lazy: packaging costs start-up time; only a plugin that declares a contract range needs it
    from packaging.version import Version

    spec = contract_range(dist)
    if spec is None:
        return None
    installed = installed_contract_version()
    if spec.contains(Version(installed), prereleases=True):
        return None
    name, version = dist.metadata["Name"], dist.version
    wanted = f"{CONTRACT_DISTRIBUTION}{spec}" if str(spec) else CONTRACT_DISTRIBUTION
    return (
        f"{plugin} ({name} {version}) requires {wanted}, but {CONTRACT_DISTRIBUTION} {installed} is "
        f'installed: pip install "{wanted}", or upgrade {name} to a release built for '
        f"{CONTRACT_DISTRIBUTION} {installed}"
    )


# ---- hook signatures ----------------------------------------------------------------------
def hook_names() -> list[str]:
    """The hooks of the specification: the public methods of ``Platform``."""
    return sorted(
        name
        for name, value in vars(Platform).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, classmethod))
    )


def _describe(sig: inspect.Signature) -> str:
    """``(name, *args, **kwargs, name=default)``: names and defaults, no annotations."""
    parts = []
    for p in sig.parameters.values():
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        parts.append(text if p.default is p.empty else f"{text}={p.default!r}")
    return f"({', '.join(parts)})"


def _signature_problem(spec: inspect.Signature, impl: inspect.Signature) -> str | None:
    """Why ``impl`` cannot take what the engine passes for ``spec``, or None.

    The engine passes the specification's positional parameters by position and its
    keyword-only ones by keyword, and may leave out any that has a default.
    """
    params = list(impl.parameters.values())
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    taken: set[str] = set()
    for i, s in enumerate(spec.parameters.values()):
        if s.kind in (s.VAR_POSITIONAL, s.VAR_KEYWORD):
            continue
        if s.kind is s.KEYWORD_ONLY:
            p = by_name.get(s.name)
            if p is None and not var_kw:
                return f"it has no parameter {s.name!r} (passed by keyword)"
        else:
            p = positional[i] if i < len(positional) else None
            if p is None and not var_pos:
                return f"it takes no parameter at position {i} ({s.name!r})"
            if p is not None and p.name != s.name and s.kind is not s.POSITIONAL_ONLY:
                return f"parameter {i} is {p.name!r}, the specification's is {s.name!r}"
        if p is not None:
            taken.add(p.name)
            if s.default is not s.empty and p.default is p.empty:
                return f"parameter {p.name!r} needs a default: the engine may leave it out"
    extra = [
        p.name for p in params
        if p.name not in taken and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if extra:
        return f"it requires {', '.join(map(repr, extra))}, which the engine never passes"
    return None


def _bound_signature(cls: type, name: str) -> inspect.Signature:
    """The signature as the engine calls the hook: without ``cls`` / ``self``."""
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, (classmethod, staticmethod)):
        return inspect.signature(getattr(cls, name))
    sig = inspect.signature(raw)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def _hook_errors(cls: type[Platform], plugin: str) -> list[str]:
    errors = []
    for name in hook_names():
        raw = inspect.getattr_static(cls, name)
        spec_raw = vars(Platform)[name]
        if raw is spec_raw:
            continue  # not overridden
        where = f"platform plugin {plugin}: {cls.__name__}.{name}"
        if not callable(getattr(cls, name, None)):
            errors.append(f"{where} must be a method like Platform.{name}, found {type(raw).__name__} {raw!r}")
            continue
        if isinstance(spec_raw, classmethod) and not isinstance(raw, (classmethod, staticmethod)):
            errors.append(
                f"{where} must be a @classmethod like Platform.{name} (the engine calls it on the class), "
                "found a plain method"
            )
            continue
        spec, impl = _bound_signature(Platform, name), _bound_signature(cls, name)
        why = _signature_problem(spec, impl)
        if why is not None:
            errors.append(
                f"{where}{_describe(impl)} does not accept the specification's Platform.{name}"
                f"{_describe(spec)}: {why}"
            )
    return errors


def _close_names(cls: type[Platform], plugin: str) -> list[str]:
    hooks = hook_names()
    known = set(dir(Platform))
    warnings = []
    for name in sorted(dir(cls)):
        if name.startswith("_") or name in known or not callable(getattr(cls, name, None)):
            continue
        close = difflib.get_close_matches(name, hooks, n=1, cutoff=_CLOSE_NAME_CUTOFF)
        if close:
            warnings.append(
                f"platform plugin {plugin}: {cls.__name__}.{name} is not a hook of loom_plugin_api."
                f"Platform and the engine never calls it; did you mean {close[0]}?"
            )
    return warnings


# ---- the qualified names the hooks return ---------------------------------------------------
def _check_subclass(qualname: Any, base: type, where: str) -> str | None:
    """Why ``qualname`` (returned by ``where``) is not an importable subclass of ``base``, or None."""
    expected = f"{where} must name a subclass of loom_plugin_api.{base.__name__}"  # each base is a top-level name
    if not isinstance(qualname, str) or not qualname:
        return f"{expected} by its qualified name ('pkg.module.Class'), found {qualname!r}"
    try:
        obj = resolve_obj_by_qualname(qualname)
    except (ImportError, ValueError) as e:
        return f"{expected}, found {qualname!r}, which does not import: {e}"
    if not (isinstance(obj, type) and issubclass(obj, base)):
        found = obj.__name__ if isinstance(obj, type) else type(obj).__name__ + " object"
        bases = ", ".join(f"{b.__module__}.{b.__qualname__}" for b in getattr(obj, "__mro__", ())[1:2])
        return f"{expected}, found {qualname!r} ({found}{', based on ' + bases if bases else ''})"
    return None


def _representative_selector() -> AttentionSelectorConfig:
    import torch  # a torch dtype is part of the selector; only this check needs torch

    # lazy: with torch, for the check below
    from .attention import AttentionSelectorConfig

    return AttentionSelectorConfig(head_size=64, dtype=torch.float32, block_size=16)


def _returned_name_errors(
    cls: type[Platform], plugin: str, selector: AttentionSelectorConfig | None
) -> list[str]:
    # lazy: these import torch-typed modules that only the check below needs
    from .attention import AttentionBackend
    from .communicator import DeviceCommunicatorBase

    attn_hook = f"{cls.__name__}.get_attn_backend_cls(None, ...)"
    comm_hook = f"{cls.__name__}.get_device_communicator_cls()"
    errors = []
    try:
        backend = cls.get_attn_backend_cls(None, selector or _representative_selector(), None)
    except NotImplementedError as e:
        errors.append(
            f"platform plugin {plugin}: {attn_hook} must name a subclass of loom_plugin_api.AttentionBackend, "
            f"found none (it raised NotImplementedError: {e}); override get_attn_backend_cls"
        )
    except Exception as e:
        errors.append(f"platform plugin {plugin}: {attn_hook} must name a subclass of "
                      f"loom_plugin_api.AttentionBackend, but it raised {type(e).__name__}: {e}")
    else:
        errors.append(_check_subclass(backend, AttentionBackend, f"platform plugin {plugin}: {attn_hook}"))
    try:
        communicator = cls.get_device_communicator_cls()
    except Exception as e:
        errors.append(f"platform plugin {plugin}: {comm_hook} must name a subclass of "
                      f"loom_plugin_api.DeviceCommunicatorBase, but it raised {type(e).__name__}: {e}")
    else:
        errors.append(_check_subclass(communicator, DeviceCommunicatorBase, f"platform plugin {plugin}: {comm_hook}"))
    return [e for e in errors if e]


# ---- the public checks -------------------------------------------------------------------
def validate_platform_cls(
    cls: type[Platform],
    plugin: str,
    *,
    resolve_names: bool = True,
    selector: AttentionSelectorConfig | None = None,
) -> list[str]:
    """Check a ``Platform`` subclass against the specification; return the warnings.

    ``plugin`` names where the class comes from (entry point and distribution), for the
    messages. Raises :class:`PlatformError`, one line with every error joined by ``"; "``,
    when an overridden hook cannot take the specification's parameters, is not a class
    method where the hook is one, or (with ``resolve_names``) the attention backend or
    communicator it names does not import or subclass the contract's base. The names are
    resolved by importing them (and torch): the engine does that once, in the process that
    finishes the config. ``selector`` is what ``get_attn_backend_cls`` is asked with (a
    representative one by default: head size 64, float32, block size 16).
    """
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise PlatformError(
            f"platform plugin {plugin} must name a subclass of loom_plugin_api.Platform, found {cls!r}"
        )
    errors = _hook_errors(cls, plugin)
    if resolve_names and not errors:
        errors = _returned_name_errors(cls, plugin, selector)
    if errors:
        raise PlatformError("; ".join(errors))
    return _close_names(cls, plugin)


def validate_worker_cls(
    worker_cls: Any, plugin: str, platform_cls: type[Platform], *, chosen_by_user: bool = False
) -> None:
    """Check the ``worker_cls`` left in the config: it must import and subclass
    ``loom_plugin_api.WorkerBase``. ``chosen_by_user``: the user set it (``--worker-cls``), not
    the platform's ``check_and_update_config``. Raises :class:`PlatformError`."""
    # lazy: these import torch-typed modules that only the check below needs
    from .worker import WorkerBase

    if chosen_by_user:
        where = "--worker-cls (parallel_config.worker_cls)"
    else:
        where = f"platform plugin {plugin}: {platform_cls.__name__}.check_and_update_config(config) " \
                "(parallel_config.worker_cls)"
    error = _check_subclass(worker_cls, WorkerBase, where)
    if error:
        raise PlatformError(error)

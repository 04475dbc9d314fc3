"""Resolve ``pkg.module.Class`` and ``pkg.module:Class`` strings to objects."""

from __future__ import annotations

import importlib
from typing import Any


def resolve_obj_by_qualname(qualname: str) -> Any:
    """Import and return the object that ``qualname`` names.

    Accepts the dotted form (``"pkg.module.Class"``) and the entry-point form
    (``"pkg.module:Class"``). Errors name the string and what was missing.
    """
    if not isinstance(qualname, str) or not qualname:
        raise ValueError(f"expected a qualified name such as 'pkg.module.Class', got {qualname!r}")
    if ":" in qualname:
        module_name, _, attr = qualname.partition(":")
    else:
        module_name, _, attr = qualname.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{qualname!r} is not a qualified name such as 'pkg.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_name!r} named by {qualname!r}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(
                f"module {module_name!r} has no attribute {attr!r} (named by {qualname!r})"
            ) from None
    return obj

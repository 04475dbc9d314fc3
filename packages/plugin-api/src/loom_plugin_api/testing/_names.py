"""The qualified names a platform returns: they must import and subclass the contract's base."""

from __future__ import annotations

from typing import Any

import pytest

from .._qualname import resolve_obj_by_qualname

__all__ = ["resolve_subclass"]


def resolve_subclass(qualname: Any, base: type, what: str) -> type:
    """Import ``qualname`` (returned by ``what``) and fail the check unless it subclasses ``base``."""
    if not isinstance(qualname, str):
        pytest.fail(f"{what} returned {qualname!r}; it must return a qualified name such as "
                    "'pkg.module.Class'")
    try:
        obj = resolve_obj_by_qualname(qualname)
    except (ImportError, ValueError) as e:
        pytest.fail(f"{what} returned {qualname!r}, which does not import: {e}")
    if not (isinstance(obj, type) and issubclass(obj, base)):
        pytest.fail(
            f"{what} returned {qualname!r}, which is not a subclass of {base.__module__}.{base.__qualname__}"
        )
    return obj

"""The platform's worker class, resolved by the qualified name the config carries."""

from __future__ import annotations

from loom_plugin_api import WorkerBase, resolve_obj_by_qualname


def resolve_worker_cls(qualname: str) -> type[WorkerBase]:
    try:
        worker_cls = resolve_obj_by_qualname(qualname)
    except (ImportError, ValueError) as e:
        raise ValueError(f"worker_cls {qualname!r} does not resolve: {e}") from e
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, WorkerBase)):
        raise TypeError(f"worker_cls {qualname!r} is not a subclass of loom_plugin_api.WorkerBase")
    return worker_cls

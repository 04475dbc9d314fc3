"""The ``custom_ops`` switches (``all``, ``none``, ``+name``, ``-name``), parsed without torch.

The CLI validates them before anything is spawned; ``CustomOp`` applies them per layer.
"""

from __future__ import annotations

from .errors import CustomOpError

__all__ = ["resolve_custom_ops"]


def resolve_custom_ops(custom_ops: list[str]) -> tuple[str, set[str], set[str]]:
    """Split a ``custom_ops`` list into (base, enabled names, disabled names).

    ``base`` is ``"all"`` or ``"none"`` (the last one given; ``"all"`` when absent).
    Raises :class:`CustomOpError` for an entry of another form or for an op that is
    both enabled and disabled.
    """
    base = "all"
    enabled: set[str] = set()
    disabled: set[str] = set()
    for entry in custom_ops:
        if entry in ("all", "none"):
            base = entry
        elif entry.startswith("+") and len(entry) > 1:
            enabled.add(entry[1:])
        elif entry.startswith("-") and len(entry) > 1:
            disabled.add(entry[1:])
        else:
            raise CustomOpError(
                f"custom_ops entry {entry!r} is not 'all', 'none', '+name' or '-name'"
            )
    both = enabled & disabled
    if both:
        raise CustomOpError(
            f"custom_ops both enables and disables {', '.join(sorted(both))}; keep one of "
            f"'+{min(both)}' and '-{min(both)}'"
        )
    return base, enabled, disabled

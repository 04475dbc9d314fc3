"""Process checks shared by the tiers that start processes (worker, serve)."""

from __future__ import annotations

import os

__all__ = ["group_alive"]


def group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` is still alive."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True

"""Tensor parallelism: the group a worker belongs to and the collectives the layers call."""

from __future__ import annotations

from .parallel_state import *  # noqa: F403 - the package's names are parallel_state's
from .parallel_state import __all__  # noqa: F401

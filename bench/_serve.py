"""Shared by the serve benchmarks: the one copy lives in loom (``loom bench`` uses it too).

start ``loom serve`` on a free port, wait for /health, measure the process tree (memory, CPU time), stop it
(loom.benchmarks.server); ``pct``: a percentile, interpolated linearly (loom.benchmarks.report).
"""

from __future__ import annotations

from loom.benchmarks.report import percentile as pct
from loom.benchmarks.server import free_port, start, stop, tree_cpu_seconds, tree_rss_bytes, wait_healthy

__all__ = ["free_port", "pct", "start", "stop", "tree_cpu_seconds", "tree_rss_bytes", "wait_healthy"]

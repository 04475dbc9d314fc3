"""``loom bench``: fixed workloads, their figures on the terminal, every measurement as JSON, plots.

* :mod:`.workloads` what each mode sends (documented once);
* :mod:`.offline`, :mod:`.serve`, :mod:`.startup` the three modes, each a ``run`` returning the
  raw measurements and a ``table`` of them;
* :mod:`.server` a real ``loom serve`` to measure (start, wait for ``/health``, tree RSS, stop);
* :mod:`.trace` the ``--startup-trace`` file of ``loom serve``, read into spans;
* :mod:`.report` percentiles, the table, machine info and the JSON file; :mod:`.plots` matplotlib.

This package sits at the entry points' level: it may use ``loom.entrypoints`` and
``loom.engine``, and nothing in the engine imports it (packages/engine-core/pyproject.toml).
Importing it loads neither torch nor matplotlib.
"""

from __future__ import annotations

from .report import percentile, summarize
from .workloads import Workload

__all__ = ["Workload", "percentile", "summarize"]

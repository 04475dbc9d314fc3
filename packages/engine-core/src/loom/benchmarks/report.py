"""What ``loom bench`` prints and saves: percentiles, the terminal table, the JSON document."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile of ``values``, interpolated linearly between the two nearest
    ranks (numpy's default); NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``n``, ``mean``, ``min``, ``max`` and ``p50``/``p90``/``p99`` of ``values`` (NaN when empty)."""
    nan = float("nan")
    out: dict[str, float] = {"n": len(values), "mean": sum(values) / len(values) if values else nan,
                             "min": min(values, default=nan), "max": max(values, default=nan)}
    out.update({f"p{p}": percentile(values, p) for p in PERCENTILES})
    return out


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain-text columns: text left-aligned, numbers right-aligned, two spaces apart."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [all(_is_number(row[i]) for row in rows) and bool(rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) or value is None


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def machine_info() -> dict[str, Any]:
    """Where the figures were measured; reads versions without importing torch."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "loom": _version("loom-engine"),
        "torch": _version("torch"),
        "command": sys.argv,
    }


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: platform's answer below
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_output(path: str | None, flag: str) -> None:
    """Fail before a run, not after it, when ``--json``/``--plot`` cannot be written."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{flag} {path}: the folder {folder} does not exist; create it or pick another path")
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"{flag} {path}: the folder {folder} is not writable; pick another path")


def write_json(path: str, document: dict[str, Any]) -> None:
    """``document`` as strict JSON: a NaN or infinity (a percentile of nothing) becomes null."""
    with open(path, "w") as f:
        json.dump(_finite(document), f, indent=1, allow_nan=False)
        f.write("\n")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value

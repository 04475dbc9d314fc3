"""Fake installed distributions for loader tests."""

from __future__ import annotations

import textwrap
from pathlib import Path


def make_dist(root: Path, name: str, entry_points: dict[str, dict[str, str]],
              modules: dict[str, str] | None = None) -> Path:
    """Write a minimal installed distribution (dist-info + modules) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for mod, source in (modules or {}).items():
        (root / f"{mod}.py").write_text(textwrap.dedent(source))
    return root

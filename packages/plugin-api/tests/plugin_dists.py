"""Fake installed distributions for loader tests."""

from __future__ import annotations

import textwrap
from pathlib import Path


def make_dist(root: Path, name: str, entry_points: dict[str, dict[str, str]],
              modules: dict[str, str] | None = None, requires: list[str] | None = None,
              version: str = "0.1") -> Path:
    """Write a minimal installed distribution (dist-info + modules) under ``root``;
    ``requires`` become its ``Requires-Dist`` lines (e.g. ``"loom-plugin-api>=1,<2"``)."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires or [])
    (info / "METADATA").write_text(metadata)
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for mod, source in (modules or {}).items():
        (root / f"{mod}.py").write_text(textwrap.dedent(source))
    return root

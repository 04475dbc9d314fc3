"""Progress bars for long start-up work (weight loading, GGUF conversion) that read well
through the supervisor.

On a terminal: a tqdm bar redrawn in place. Anywhere else (a child of ``loom serve``, whose
stderr is a pipe the supervisor forwards line by line behind the process's prefix), tqdm's
carriage-return redraws would pile up into one long line; there each redraw is a line of its
own, at most one per ``LINE_INTERVAL_S``, and the final state once. Work that ends within
``DELAY_S`` shows nothing.
"""

from __future__ import annotations

import io
import sys
from typing import TextIO

from tqdm import tqdm

DELAY_S = 1.0
LINE_INTERVAL_S = 2.0


class _Lines(io.TextIOBase):
    """A stream that turns tqdm's ``\\r`` redraws into whole lines."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        for part in text.replace("\n", "\r").split("\r"):
            if part.strip():
                self._stream.write(part.rstrip() + "\n")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def progress_bar(total: int, desc: str, unit: str, *, disable: bool = False, stream: TextIO | None = None) -> tqdm:
    """A bar over ``total`` units of work on ``stream`` (stderr); ``disable`` shows nothing
    (the ranks other than 0 load the same weights)."""
    stream = sys.stderr if stream is None else stream
    if stream.isatty():
        return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=disable, leave=False,
                    mininterval=0.5, delay=DELAY_S)
    return tqdm(total=total, desc=desc, unit=unit, file=_Lines(stream), disable=disable, leave=True,
                mininterval=LINE_INTERVAL_S, delay=DELAY_S, ascii=True, ncols=100)

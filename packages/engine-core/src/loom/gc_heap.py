"""Keep CPython's cyclic garbage collector off the objects a loom process holds for its whole life."""

from __future__ import annotations

import gc

__all__ = ["freeze_long_lived"]


def freeze_long_lived() -> None:
    """Move every object the collector tracks now into its permanent generation.

    A process of ``loom serve`` imports torch or FastAPI: hundreds of thousands of objects
    (modules, functions, classes, the model's parameters) that live as long as the process.
    Every full collection traverses all of them: 30-40 ms each in a worker on a 2-core machine,
    three of them during the default model's load, and one in the middle of a decode step is an
    inter-token latency spike. Each process calls this after its imports and again at READY;
    what it makes later is collected as usual, and nothing frozen is ever freed (it was going to
    live until exit anyway).
    """
    gc.freeze()

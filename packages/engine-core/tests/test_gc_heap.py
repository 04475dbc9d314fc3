"""``freeze_long_lived``: what a process holds at the call leaves the collector's generations."""

from __future__ import annotations

import gc

from loom.gc_heap import freeze_long_lived


class _Node:
    def __init__(self) -> None:
        self.peer: _Node | None = None


def test_objects_alive_at_the_call_are_frozen_and_later_ones_collected() -> None:
    gc.unfreeze()
    held = [_Node() for _ in range(1000)]
    try:
        freeze_long_lived()
        assert gc.get_freeze_count() >= len(held)
        assert not any(gc.is_tracked(n) and n in gc.get_objects() for n in held[:3])  # not in any generation
        a, b = _Node(), _Node()  # a cycle made after the freeze is still collected
        a.peer, b.peer = b, a
        del a, b
        assert gc.collect() >= 2
    finally:
        gc.unfreeze()

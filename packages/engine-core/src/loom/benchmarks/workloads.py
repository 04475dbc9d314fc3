"""The fixed workloads of ``loom bench``, written down once.

Every mode sends the same kind of request: ``num_prompts`` prompts of ``input_len`` random
token ids, each asking for exactly ``output_len`` tokens, greedy, with EOS ignored (so every
request makes all of them). The ids are drawn uniformly from ``TOKEN_IDS`` (below the
vocabulary when it is smaller) by ``random.Random``, seeded by ``seed`` and the round: the same
seed gives the same prompts in every mode, on every model, and without importing torch. Each
round (an offline run, a serve concurrency level, the warm-up) draws its own prompts, so that
no round finds another's in the prefix cache.

* ``offline``: one :class:`Workload` through ``loom.LLM.generate``, every prompt at once.
* ``serve``:   the same workload at each concurrency level of ``CONCURRENCY`` (at most that
  many requests in flight), streamed from ``/v1/completions``.
* ``startup``: ``STARTUP_RUNS`` launches of ``loom serve`` after one warm-up launch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WARMUP_ROUND = -1
"""The warm-up request's own round: its prompt is none of the measured ones."""

TOKEN_IDS = (100, 10_000)
"""Prompt token ids are drawn from ``[low, high)``: clear of the special ids at the start of
most vocabularies, and inside every vocabulary loom serves."""

CONCURRENCY = (1, 4, 16, 64)
STARTUP_RUNS = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 64
    seed: int = 0

    def prompts(self, round: int = 0, vocab_size: int | None = None) -> list[list[int]]:
        """``num_prompts`` lists of ``input_len`` token ids: the same for the same seed and round."""
        low, high = TOKEN_IDS
        if vocab_size is not None:
            high = min(high, vocab_size)
            low = min(low, high // 2)
        rng = random.Random(f"loom-bench:{self.seed}:{round}")  # a str seed: stable across runs and versions
        return [[rng.randrange(low, high) for _ in range(self.input_len)] for _ in range(self.num_prompts)]

    def describe(self) -> str:
        return (f"{self.num_prompts} prompts x ({self.input_len} in -> {self.output_len} out), random token ids "
                f"(seed {self.seed}), greedy, EOS ignored")

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step; a longer prompt is prefilled in chunks."""
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    """Schedule each step while the one before runs (``loom serve`` with one worker;
    ``--async-scheduling``)."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")

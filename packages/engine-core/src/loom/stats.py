"""EngineStats: what the engine reports after a step, to stat loggers and ``/metrics``.

A leaf module: the engine produces it, the IPC messages carry it, the front end's metrics
read it, and none of them imports the others for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, kw_only=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Fraction of KV-cache blocks held by requests."""
    prefix_cache_hit_rate: float
    """Prompt tokens found in the prefix cache / prompt tokens looked up, since start."""
    num_prompt_tokens: int
    """Prompt tokens of the requests added, since start."""
    num_generation_tokens: int
    """Tokens generated since start."""
    num_preemptions: int

"""The kit's tiers (pytest markers), importable without pytest (``loom plugins`` lists them)."""

from __future__ import annotations

__all__ = ["TIERS"]

TIERS: dict[str, str] = {
    "static": "the entry point, the detector, hook signatures, the names the platform returns",
    "config": "check_and_update_config and update_block_size_for_backend on a config view",
    "ops": "every op the platform replaces against forward_native",
    "attention": "the platform's attention backend against a reference paged attention",
    "communicator": "two ranks: all_reduce, all_gather, broadcast through the platform's communicator",
    "worker": "the worker lifecycle on tiny Llama and OPT models, greedy tokens against HF transformers",
    "serve": "loom serve: a completion and a chat completion through the openai client, SIGTERM",
}

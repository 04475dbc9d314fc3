"""The dummy platform's replacement op, registered for ``RotaryEmbedding``."""

from __future__ import annotations

import os
from typing import Any

import torch
from loom_plugin_api.ops.rotary_embedding import RotaryEmbedding

from .logging import logger


@RotaryEmbedding.register_oot
class DummyRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding that runs through ``forward_oot`` on the dummy platform.

    ``forward_oot_calls`` counts calls in this process, so tests can see it ran.
    """

    forward_oot_calls = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.addition_config = True

    def forward_oot(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        cls = type(self)
        if cls.forward_oot_calls == 0:  # once per process, so the serve's log shows where it runs
            logger.info("DummyRotaryEmbedding.forward_oot runs in pid %d", os.getpid())
        cls.forward_oot_calls += 1
        return super().forward_oot(*args, **kwargs)

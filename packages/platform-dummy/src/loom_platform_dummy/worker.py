"""The dummy platform's worker: the contract's host-memory worker, under the platform's own class."""

from __future__ import annotations

from loom_plugin_api import CPUWorker

from .logging import logger


class DummyWorker(CPUWorker):
    def init_device(self) -> None:
        super().init_device()
        logger.info("DummyWorker rank %d owns DummyDevice (host memory)", self.rank)

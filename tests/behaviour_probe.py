"""A platform whose hooks do something observable, for test_hook_behaviour.py: the CPU platform
under another name, with

* ``validate_environ``: requires ``$PROBE_FIRMWARE``; raises with ``fail``, otherwise warns;
* ``apply_config_platform_defaults``: sets the block size to ``$PROBE_DEFAULT_BLOCK_SIZE`` unless the
  user chose one; ``check_and_update_config`` records the block size it sees;
* ``get_device_communicator_cls``: answers :class:`RecordingCommunicator`, which records each
  collective.

Each event appends one JSON line ``{"pid", "rank", "event", "detail"}`` to ``$PROBE_LOG``
(``rank`` is ``$LOOM_RANK`` in a worker the supervisor started, else None). The test installs the
module as a fake distribution (entry point ``behaviour_probe`` in ``loom.platform_plugins``).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from loom.platforms.cpu import CpuPlatform
from loom_plugin_api import PlatformEnum, TorchDistributedCommunicator

logger = logging.getLogger("loom.behaviour_probe")

FIRMWARE_MESSAGE = "BehaviourProbe needs PROBE_FIRMWARE: set it to the device firmware's path"


def record(event: str, detail: Any = None) -> None:
    line = json.dumps({"pid": os.getpid(), "rank": os.environ.get("LOOM_RANK"), "event": event, "detail": detail})
    with open(os.environ["PROBE_LOG"], "a") as f:  # one short O_APPEND write per line: lines never interleave
        f.write(line + "\n")


class RecordingCommunicator(TorchDistributedCommunicator):
    def __init__(self, group: Any = None, device: Any = None) -> None:
        super().__init__(group, device)
        record("communicator.__init__", self.world_size)

    def all_reduce(self, x: Any) -> Any:
        record("communicator.all_reduce")
        return super().all_reduce(x)

    def all_gather(self, x: Any, dim: int = -1) -> Any:
        record("communicator.all_gather")
        return super().all_gather(x, dim)

    def broadcast(self, x: Any, src: int = 0) -> Any:
        record("communicator.broadcast")
        return super().broadcast(x, src)


class BehaviourProbePlatform(CpuPlatform):
    _enum = PlatformEnum.OOT
    device_name = "behaviour_probe"

    @classmethod
    def validate_environ(cls, fail: bool) -> None:
        record("validate_environ", fail)
        if not os.environ.get("PROBE_FIRMWARE"):
            if fail:
                raise ValueError(FIRMWARE_MESSAGE)
            logger.warning(FIRMWARE_MESSAGE)

    @classmethod
    def apply_config_platform_defaults(cls, config: Any) -> None:
        default = os.environ.get("PROBE_DEFAULT_BLOCK_SIZE")
        if default and not config.cache_config.user_block_size:
            config.cache_config.block_size = int(default)

    @classmethod
    def check_and_update_config(cls, config: Any) -> None:
        record("check_and_update_config", config.cache_config.block_size)
        super().check_and_update_config(config)

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        record("get_device_communicator_cls")
        return f"{__name__}.RecordingCommunicator"


def behaviour_probe_platform() -> str:
    """The detector: always present."""
    return f"{__name__}.BehaviourProbePlatform"

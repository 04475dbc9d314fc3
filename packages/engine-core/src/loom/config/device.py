from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True, kw_only=True)
class DeviceConfig:
    """The torch device type that the platform computes on (its ``device_type``)."""

    device: str
    device_type: str = field(init=False)

    def __post_init__(self) -> None:
        self.device_type = self.device

    @property
    def torch_device(self) -> torch.device:
        import torch  # lazy: torch stays out of the CLI, front end and engine core; only workers compute

        return torch.device(self.device_type)

"""A deliberately broken platform for the conformance-kit tests, as a fake distribution.

``write_platform_dist(root, variant)`` writes ``loom-platform-kitprobe`` (a dist-info with
its ``Requires-Dist`` and entry points, and one module) under ``root``; put ``root`` on the
``PYTHONPATH`` of a subprocess. The ``ok`` variant is a correct host-memory platform built on
the contract alone; each other variant breaks one thing:

* ``no_worker_cls``   ``check_and_update_config`` leaves ``worker_cls`` at ``"auto"``;
* ``wrong_op``        its ``SiluAndMul`` replacement is off by 5 %;
* ``bad_signature``   ``get_attn_backend_cls`` lacks the ``attn_selector_config`` parameter;
* ``excluded_range``  the distribution asks for ``loom-plugin-api>=2,<3``;
* ``raising_detector`` the detector raises instead of answering None.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

DETECTOR = "kitprobe"
VARIANTS = ("ok", "no_worker_cls", "wrong_op", "bad_signature", "excluded_range", "raising_detector")

_SOURCE = """
from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from loom_plugin_api import AttentionBackend, AttentionImpl, Platform, PlatformEnum
from loom_plugin_api.ops import SiluAndMul

VARIANT = {variant!r}


def detect() -> str | None:
    if VARIANT == "raising_detector":
        raise RuntimeError("the probe device's driver crashed")
    return "kitprobe_platform.KitProbePlatform"


def register_ops() -> None:
    SiluAndMul.register_oot(KitProbeSiluAndMul)


class KitProbeSiluAndMul(SiluAndMul):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        scale = 1.05 if VARIANT == "wrong_op" else 1.0
        return (F.silu(x[..., :d].float()) * x[..., d:].float() * scale).to(x.dtype)


class KitProbeAttentionImpl(AttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata):
        raise NotImplementedError("the kit's probe platform runs no attention")


class KitProbeAttentionBackend(AttentionBackend):
    name: ClassVar[str] = "KITPROBE"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return KitProbeAttentionImpl


class KitProbePlatform(Platform):
    _enum: ClassVar[PlatformEnum] = PlatformEnum.OOT
    device_name: ClassVar[str] = "kitprobe"
    device_type: ClassVar[str] = "cpu"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")

    @classmethod
    def check_and_update_config(cls, config: Any) -> None:
        if config.parallel_config.worker_cls == "auto" and VARIANT != "no_worker_cls":
            config.parallel_config.worker_cls = "loom_plugin_api.cpu_worker.CPUWorker"
        if config.model_config.dtype not in cls.supported_dtypes:
            raise ValueError(f"dtype {{config.model_config.dtype}} is not supported on kitprobe; use float32")

    if VARIANT == "bad_signature":
        @classmethod
        def get_attn_backend_cls(cls, selected_backend: str | None) -> str:  # type: ignore[override]
            return "kitprobe_platform.KitProbeAttentionBackend"
    else:
        @classmethod
        def get_attn_backend_cls(cls, selected_backend: str | None, attn_selector_config: Any,
                                 num_heads: int | None = None) -> str:
            return "kitprobe_platform.KitProbeAttentionBackend"
"""


def write_platform_dist(root: Path, variant: str) -> Path:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")
    requires = "loom-plugin-api<3,>=2" if variant == "excluded_range" else "loom-plugin-api<2,>=1"
    root.mkdir(parents=True, exist_ok=True)
    info = root / "loom_platform_kitprobe-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: loom-platform-kitprobe\nVersion: 0.1\nRequires-Dist: {requires}\n"
    )
    (info / "entry_points.txt").write_text(
        f"[loom.platform_plugins]\n{DETECTOR} = kitprobe_platform:detect\n\n"
        "[loom.general_plugins]\nkitprobe_ops = kitprobe_platform:register_ops\n"
    )
    (info / "top_level.txt").write_text("kitprobe_platform\n")
    (info / "RECORD").write_text("kitprobe_platform.py,,\n")
    (root / "kitprobe_platform.py").write_text(textwrap.dedent(_SOURCE.format(variant=variant)))
    return root

"""``loom collect-env``: what a bug report needs."""

from __future__ import annotations

import argparse
import platform as pyplatform
from importlib import metadata

import torch

from ... import platforms
from .plugins import print_groups


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return subparsers.add_parser("collect-env", help="print versions, the platform and plugins")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def run(args: argparse.Namespace) -> int:
    print(f"Python: {pyplatform.python_version()} ({pyplatform.platform()})")
    for dist in ("loom-engine", "loom-plugin-api", "loom-platform-dummy", "loom-platform-cuda",
                 "loom-supervisor", "torch", "transformers", "tokenizers", "gguf", "triton"):
        print(f"{dist}: {_version(dist)}")
    print(f"torch threads: {torch.get_num_threads()}, CUDA available: {torch.cuda.is_available()}")
    current_platform = platforms.current_platform
    print(f"Platform: {type(current_platform).__name__} (device {current_platform.device_name}, "
          f"type {current_platform.device_type})")
    for v in platforms.detector_verdicts():
        print(f"  detector {v.name}: {v.describe()}")
    print_groups()
    return 0

"""The CUDA platform's tests run on a GPU as they are, and elsewhere in Triton's CPU
interpreter, which must be switched on before triton is first imported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/tiny_models.py builds the random-weight models the integration tests run.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

"""Set-up of the kernel tests; shared helpers live in kernel_helpers.py.

Without a GPU the kernels run in Triton's CPU interpreter, which must be switched on before
triton is imported; so this file sets ``TRITON_INTERPRET`` before anything imports the kernels.
The interpreter rounds fp32 -> bf16 by truncation (a GPU rounds to nearest), so bf16 results
may differ from torch by one bf16 ulp more than on a GPU; the bf16 tolerances allow for it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import loom_platform_cuda  # noqa: F401
except ImportError:  # not installed: test the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)

"""Off-GPU, check that every kernel launch also compiles for a real GPU (sm_90).

The interpreter runs the kernels as numpy code and accepts some programs the GPU compiler
rejects; ``compile_sm90.py`` runs the wrappers with launches replaced by compilations.
On a GPU the other tests compile and run the kernels, so this one is skipped there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from kernel_helpers import ON_GPU

SCRIPT = Path(__file__).with_name("compile_sm90.py")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernel tests compile and run every kernel")
def test_every_launch_compiles_for_sm90():
    assert PTXAS.exists(), f"triton ships no ptxas at {PTXAS}: the sm_90 compile check needs triton's own ptxas"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"compilation failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "kernels for sm_90" in proc.stdout.splitlines()[-1]

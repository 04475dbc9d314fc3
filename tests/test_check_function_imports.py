"""scripts/check_function_imports.py: an import inside a function needs a comment saying why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_function_imports.py"


def check(tmp_path: Path, source: str) -> tuple[int, list[str]]:
    """Run the checker on a module holding ``source``: its exit status and output lines."""
    (tmp_path / "mod.py").write_text(source)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    return proc.returncode, proc.stdout.splitlines()


def test_an_uncommented_import_in_a_function_fails_with_its_line(tmp_path):
    rc, out = check(tmp_path, "import os\n\n\ndef f():\n    import json\n    return json\n")
    assert rc == 1
    assert out[0].endswith("mod.py:5: import inside function without a comment saying why (keep it lazy only "
                           "to keep torch/heavy deps out of a process, or for an optional dependency)")
    assert out[-1] == "1 uncommented import(s) inside functions in 1 file(s)"


def test_a_commented_lazy_import_passes(tmp_path):
    source = '''
def above():
    # lazy: torch stays out of the front end
    import torch
    return torch


def same_line():
    from tqdm import tqdm  # lazy: optional dependency (tqdm)
    return tqdm


def a_run_under_one_comment():
    # lazy: transformers imports torch
    from transformers import AutoConfig
    from transformers import (
        AutoTokenizer,
    )
    return AutoConfig, AutoTokenizer
'''
    assert check(tmp_path, source) == (0, ["0 uncommented import(s) inside functions in 1 file(s)"])


def test_module_and_class_level_imports_and_type_checking_pass(tmp_path):
    source = '''
from typing import TYPE_CHECKING

import os

if TYPE_CHECKING:
    import torch


class Config:
    import json
'''
    assert check(tmp_path, source)[0] == 0


def test_methods_nested_functions_and_a_blank_line_after_a_comment_are_checked(tmp_path):
    source = '''
class Worker:
    async def run(self):
        if True:
            import json
        return json


def outer():
    def inner():
        import os
        return os
    # lazy: torch stays out of the engine core
    import torch

    import numpy
    return inner, torch, numpy
'''
    rc, out = check(tmp_path, source)
    assert rc == 1
    assert [line.split(": ", 1)[0].rsplit(":", 1)[1] for line in out[:-1]] == ["5", "11", "16"]
    assert out[-1].startswith("3 uncommented")

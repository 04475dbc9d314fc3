"""Rules for every test folder of the repo (pytest loads this conftest above all of them).

With ``LOOM_STRICT_SKIPS=1`` (every nox session sets it) a skipped test fails unless its
reason names an absent capability that no install step can provide. A skip because a
package is missing, or because of the ambient environment, would otherwise turn a broken
CI image into a quiet pass: in the matrix a missing dependency is a failure.
"""

from __future__ import annotations

import os

import pytest

CAPABILITIES = ("GPU", "AVX512-VNNI", "AMX-BF16", "AVX512-BF16")
"""Words a skip reason must contain to stand in a strict run: what the matrix's machine may lack
and no install step can provide (a GPU; AVX512-VNNI, which the int8 KV-cache kernels need;
AMX-BF16 tiles, which the bf16 prefill-attention kernel needs; AVX512-BF16, which loom's bf16
GEMM needs: CI has run on Xeons with AMX, on EPYCs with AVX512-BF16 and on AVX2-only EPYCs). Every other dependency is installed by the session."""


def _strict() -> bool:
    return os.environ.get("LOOM_STRICT_SKIPS") == "1"


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_unless_capability(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _reason(report)
    if any(word in reason for word in CAPABILITIES):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped in a strict run (LOOM_STRICT_SKIPS=1): {reason}\n"
                       f"Only an absent capability ({', '.join(CAPABILITIES)}) may skip here: install what "
                       "the test needs in its nox session, or make the test set the environment it depends on.")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    if _strict():
        _fail_unless_capability(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    if _strict():
        _fail_unless_capability(outcome.get_result())

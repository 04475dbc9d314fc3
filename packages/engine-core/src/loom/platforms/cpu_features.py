"""What the host CPU computes natively, read from ``/proc/cpuinfo`` without importing torch.

``dtype="auto"`` on a platform that computes on the host depends on it, and the config is
resolved in processes that never load torch (the CLI, ``loom.LLM`` before its worker starts),
so the answer cannot come from torch's own CPU capability checks. ``LOOM_CPU_BF16=1|0``
overrides the detection (operators; tests that exercise both branches on any machine).
"""

from __future__ import annotations

import functools

from .. import envs

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 flags of CPUs that compute bf16 natively (vLLM's CPU platform checks the same)."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags that every processor in ``cpuinfo`` (the text of ``/proc/cpuinfo``) reports
    on its ``flags`` line; empty when there is none (not x86, or not Linux)."""
    common: frozenset[str] | None = None
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags = frozenset(value.split())
            common = flags if common is None else common & flags
    return common or frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """``parse_cpu_flags`` of this machine's ``/proc/cpuinfo``, read once per process."""
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpu_flags(f.read())
    except OSError:
        return frozenset()


def native_bf16() -> tuple[bool, str]:
    """Whether the CPU computes bf16 natively, and why (for the log line of ``dtype="auto"``)."""
    override = (envs.LOOM_CPU_BF16 or "").strip().lower()
    if override in _TRUE:
        return True, f"LOOM_CPU_BF16={envs.LOOM_CPU_BF16}"
    if override in _FALSE:
        return False, f"LOOM_CPU_BF16={envs.LOOM_CPU_BF16}"
    if override:
        raise ValueError(f"LOOM_CPU_BF16={envs.LOOM_CPU_BF16!r} must be 1 or 0 (or unset: read /proc/cpuinfo)")
    found = [flag for flag in NATIVE_BF16_FLAGS if flag in cpu_flags()]
    if found:
        return True, f"the CPU reports {' and '.join(found)}"
    return False, f"the CPU reports neither {' nor '.join(NATIVE_BF16_FLAGS)}"

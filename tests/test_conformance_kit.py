"""The conformance kit (``loom_plugin_api.testing``) as a vendor runs it: through pytest's
``pytest11`` entry point, in a subprocess, from a folder outside the repo.

A probe platform (tests/conformance_fakes.py) passes the static, config and ops tiers as
written, and each deliberate break makes the right check of the right tier fail with a
message that says what to fix. The venv's active platform passes those tiers too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conformance_fakes import DETECTOR, write_platform_dist

TIERS = "static or config or ops"
ACTIVE_DETECTOR = {"cpu": "cpu", "dummy": "dummy_platform_plugin"}


def run_kit(
    tmp_path: Path, platform: str, tiers: str, pythonpath: Path | None = None, only: str | None = None
) -> dict:
    """Run the kit in a fresh interpreter with an empty pytest.ini, and return its JSON report."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "report.json"
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOOM_PLUGINS", "LOOM_PLATFORM", "PYTEST_ADDOPTS", "LOOM_STRICT_SKIPS")
    }
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    argv = ["--pyargs", "loom_plugin_api.testing", "--loom-platform", platform, "-m", tiers,
            "--loom-report", str(report), "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
            "--confcutdir", str(tmp_path),
            "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:hypothesispytest", "-q",
            *(["-k", only] if only else [])]
    proc = subprocess.run([sys.executable, "-m", "pytest", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert report.exists(), (
        f"the kit wrote no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    )
    result = json.loads(report.read_text())
    result["returncode"] = proc.returncode
    result["output"] = proc.stdout[-4000:]
    return result


def probe(tmp_path: Path, variant: str, tiers: str, only: str | None = None) -> dict:
    return run_kit(tmp_path, DETECTOR, tiers, write_platform_dist(tmp_path / "site", variant), only)


def only_failures(result: dict) -> dict[str, str]:
    return {c["name"]: c["message"] for c in result["checks"] if c["outcome"] == "fail"}


def test_probe_platform_passes_static_config_and_ops(tmp_path: Path) -> None:
    result = probe(tmp_path, "ok", TIERS)
    assert only_failures(result) == {}, result["output"]
    assert result["returncode"] == 0
    outcomes = {(c["tier"], c["name"]): c["outcome"] for c in result["checks"]}
    # Its SiluAndMul replacement is checked; the ops it does not replace skip with the reason.
    assert outcomes[("ops", "test_replaced_class_matches_forward_native[silu_and_mul-float32]")] == "pass"
    skipped = {c["name"]: c["message"] for c in result["checks"] if c["outcome"] == "skip"}
    assert skipped["test_replaced_class_matches_forward_native[rms_norm-float32]"] == (
        "the platform registers no replacement class for RMSNorm")
    assert skipped["test_replaced_class_matches_forward_native[silu_and_mul-float16]"] == (
        "KitProbePlatform.supported_dtypes does not declare float16")
    assert {c["tier"] for c in result["checks"]} == {"static", "config", "ops"}


def test_unset_worker_cls_fails_the_config_tier(tmp_path: Path) -> None:
    failures = only_failures(probe(tmp_path, "no_worker_cls", "config", only="worker_cls"))
    assert list(failures) == ["test_sets_worker_cls"]
    assert "left parallel_config.worker_cls 'auto'" in failures["test_sets_worker_cls"]
    assert "set it to the qualified name of your WorkerBase subclass" in failures["test_sets_worker_cls"]


def test_numerically_wrong_op_fails_the_ops_tier(tmp_path: Path) -> None:
    result = probe(tmp_path, "wrong_op", "ops", only="silu_and_mul")
    failures = only_failures(result)
    assert set(failures) == {
        "test_replaced_class_matches_forward_native[silu_and_mul-float32]",
        "test_replaced_class_matches_forward_native[silu_and_mul-bfloat16]",
    }
    message = failures["test_replaced_class_matches_forward_native[silu_and_mul-float32]"]
    assert "kitprobe_platform.KitProbeSiluAndMul.forward_oot" in message
    assert "differ from the reference beyond atol=1e-05, rtol=1e-05" in message
    assert result["returncode"] == 1


def test_hook_with_wrong_signature_fails_the_static_tier(tmp_path: Path) -> None:
    only = "hook_signatures or attention_backend"
    failures = only_failures(probe(tmp_path, "bad_signature", "static", only=only))
    assert failures["test_hook_signatures"] == (
        "platform plugin kitprobe: KitProbePlatform.get_attn_backend_cls(selected_backend) does not accept "
        "the specification's Platform.get_attn_backend_cls(selected_backend, attn_selector_config, "
        "num_heads=None): "
        "it takes no parameter at position 1 ('attn_selector_config')"
    )
    assert set(failures) <= {"test_hook_signatures", "test_attention_backend_resolves"}


def test_excluded_contract_range_fails_the_static_tier(tmp_path: Path) -> None:
    from importlib.metadata import version

    installed = version("loom-plugin-api")
    failures = only_failures(probe(tmp_path, "excluded_range", "static", only="contract_range"))
    assert failures == {"test_contract_range_includes_installed_contract": (
        f"kitprobe (loom-platform-kitprobe 0.1) requires loom-plugin-api<3,>=2, but "
        f'loom-plugin-api {installed} is installed: pip install "loom-plugin-api<3,>=2", or upgrade '
        f"loom-platform-kitprobe to a release built for loom-plugin-api {installed}"
    )}


def test_raising_detector_fails_the_static_tier(tmp_path: Path) -> None:
    failures = only_failures(probe(tmp_path, "raising_detector", "static", only="detector_answers"))
    assert failures == {"test_detector_answers_a_qualified_name_or_none": (
        "detector kitprobe (kitprobe_platform:detect) raised RuntimeError: the probe device's driver "
        "crashed. A detector must return the Platform's qualified name, or None when the device is absent, "
        "and never raise"
    )}


def test_active_platform_passes_static_config_and_ops(tmp_path: Path, expected_platform: str) -> None:
    result = run_kit(tmp_path, ACTIVE_DETECTOR[expected_platform], TIERS)
    assert only_failures(result) == {}, result["output"]
    assert result["returncode"] == 0
    assert result["platform"]["device_present"] is True
    assert {c["tier"] for c in result["checks"] if c["outcome"] == "pass"} >= {"static", "config"}


def test_kit_is_inert_in_a_normal_run(tmp_path: Path) -> None:
    """Installed but not asked for: no kit fixture, and the kit's own tests are deselected."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_plain.py").write_text(
        "def test_plain(request):\n"
        "    assert 'platform_cls' not in request.fixturenames\n"
        "    assert request.config.getoption('--loom-platform') is None\n"
    )
    kit_dir = Path(__import__("loom_plugin_api.testing", fromlist=["_"]).__file__).parent
    argv = ["-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"),
            "--rootdir", str(tmp_path), str(tmp_path), str(kit_dir)]
    proc = subprocess.run([sys.executable, "-m", "pytest", *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert re.search(r"\b1 passed, \d+ deselected", proc.stdout), proc.stdout


def test_plugins_check_runs_the_kit(tmp_path: Path) -> None:
    """``loom plugins check NAME`` (loom/entrypoints/cli/plugins_check.py) runs the same kit."""
    site = write_platform_dist(tmp_path / "site", "wrong_op")
    report = tmp_path / "report.json"
    code = (
        "import argparse, sys\n"
        "from loom.entrypoints.cli import plugins_check\n"
        "parser = argparse.ArgumentParser()\n"
        "plugins_check.add_subcommand(parser)\n"
        "sys.exit(plugins_check.run(parser.parse_args(sys.argv[1:])))\n"
    )
    argv = ["check", DETECTOR, "--tiers", "ops", "--report", str(report), "--pytest-args=-x"]
    pythonpath = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    # the kit's skips are the platform's declared capabilities, not this repo's strict-skip rule
    env = {**{k: v for k, v in os.environ.items() if k != "LOOM_STRICT_SKIPS"}, "PYTHONPATH": pythonpath}
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(report.read_text())
    # Only the ops tier ran, and -x reached pytest: it stopped at the first wrong op.
    assert {c["tier"] for c in result["checks"]} == {"ops"}
    failed = [c["name"] for c in result["checks"] if c["outcome"] == "fail"]
    assert len(failed) == 1
    assert failed[0].startswith("test_replaced_class_matches_forward_native[silu_and_mul-")

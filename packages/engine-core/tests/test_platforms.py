"""Platform resolution rules in this process, with fake detectors: fast, and what mutation testing
runs (tests/test_platform_resolution.py checks the same rules end to end in fresh interpreters)."""

from __future__ import annotations

import ctypes
import importlib.util
from types import SimpleNamespace

import pytest
from loom import envs, platforms
from loom.platforms.cpu import CpuPlatform
from loom_plugin_api import PlatformError

CPU = "loom.platforms.cpu.CpuPlatform"


def _not_available(reason):
    def detector():
        raise platforms._NotAvailable(reason)
    return detector


def _counting(answer):
    def detector():
        detector.calls += 1
        return answer
    detector.calls = 0
    return detector


@pytest.fixture
def resolve(monkeypatch):
    """resolve(builtins, oot, failed=()) -> the platform, with fake detectors and a fresh state."""
    saved = platforms._current_platform, platforms._resolution_error, list(platforms._verdicts)
    monkeypatch.delenv("LOOM_PLATFORM", raising=False)
    monkeypatch.delenv("LOOM_PLUGINS", raising=False)
    # An LLM built by an earlier test froze the LOOM_* variables in this process; read them afresh.
    monkeypatch.setattr(envs, "_cache_enabled", False)
    monkeypatch.setattr(envs, "_cache", {})

    def run(builtins, oot, failed=()):
        records = [SimpleNamespace(name=name, status="failed", error=error, distribution=None, version=None)
                   for name, error in failed]
        records += [SimpleNamespace(name=name, status="loaded", error=None, distribution=None, version=None)
                    for name in oot]
        monkeypatch.setattr(platforms, "builtin_platform_plugins", builtins)
        group = "loom.platform_plugins"
        monkeypatch.setattr(platforms, "load_plugins_by_group", lambda g: dict(oot) if g == group else {})
        monkeypatch.setattr(platforms, "plugin_records", lambda g: records if g == group else [])
        return platforms.resolve_current_platform()

    yield run
    platforms._current_platform, platforms._resolution_error = saved[:2]
    platforms._verdicts[:] = saved[2]


def _verdicts():
    return {v.name: v for v in platforms.detector_verdicts()}


def test_first_answering_builtin_wins_cuda_before_cpu(resolve):
    platform = resolve({"cuda": lambda: CPU, "cpu": lambda: CPU}, {})
    assert type(platform) is CpuPlatform
    verdicts = _verdicts()
    assert verdicts["cuda"].won and not verdicts["cpu"].won
    assert verdicts["cuda"].describe() == f"answered {CPU} [winner]"
    assert verdicts["cpu"].describe() == f"answered {CPU}"
    assert [v.builtin for v in platforms.detector_verdicts()] == [True, True]


def test_builtin_not_available_gives_its_reason(resolve):
    resolve({"cuda": _not_available("no GPU here"), "cpu": lambda: CPU}, {})
    cuda = _verdicts()["cuda"]
    assert (cuda.answer, cuda.raised, cuda.won) == (None, False, False)
    assert cuda.describe() == "None (no GPU here)"
    assert _verdicts()["cpu"].won


def test_one_out_of_tree_answer_wins_and_is_asked_again(resolve):
    oot = _counting(CPU)
    resolve({"cpu": lambda: CPU}, {"oot": oot, "quiet": lambda: None})
    verdicts = _verdicts()
    assert verdicts["oot"].won and not verdicts["cpu"].won and not verdicts["oot"].builtin
    assert verdicts["quiet"].describe() == "None"
    assert oot.calls == 2


def test_two_out_of_tree_answers_is_an_error(resolve):
    with pytest.raises(PlatformError) as e:
        resolve({"cpu": lambda: CPU}, {"one": lambda: CPU, "two": lambda: CPU})
    assert str(e.value) == ("Only one platform plugin can be activated, but these out-of-tree plugins all answered: "
                            "['one', 'two']. Uninstall all but one, or choose one with LOOM_PLATFORM=<name> or "
                            "LOOM_PLUGINS.")


def test_loom_platform_forces_its_detector(resolve, monkeypatch):
    monkeypatch.setenv("LOOM_PLATFORM", "cpu")
    resolve({"cuda": lambda: CPU, "cpu": lambda: CPU}, {"oot": lambda: CPU, "more": lambda: CPU})
    assert [v.name for v in platforms.detector_verdicts() if v.won] == ["cpu"]
    monkeypatch.setenv("LOOM_PLATFORM", "cuda")
    with pytest.raises(PlatformError) as e:
        resolve({"cuda": _not_available("no GPU"), "cpu": lambda: CPU}, {})
    assert str(e.value) == "LOOM_PLATFORM='cuda' did not answer (None (no GPU)); detectors: cuda, cpu"
    monkeypatch.setenv("LOOM_PLATFORM", "nosuch")
    with pytest.raises(PlatformError) as e:
        resolve({"cpu": lambda: CPU}, {"oot": lambda: None})
    assert str(e.value) == "LOOM_PLATFORM='nosuch' is not installed; detectors: cpu, oot"


def test_raising_invalid_and_unloadable_detectors_are_verdicts_and_stop_resolution(resolve):
    def raises():
        raise OSError("driver missing")

    with pytest.raises(PlatformError) as e:
        resolve({"cpu": lambda: CPU}, {"boom": raises, "odd": lambda: 3}, failed=[("broken", "ImportError: x")])
    # one message naming each broken out-of-tree platform, and what to do: no quiet fallback to cpu
    assert str(e.value) == (
        "out-of-tree platform plugin broken raised: failed to load: ImportError: x; boom raised: OSError: driver "
        "missing; odd raised: returned 3, not a qualified class name or None. Fix or uninstall it, leave it out "
        "with LOOM_PLUGINS, or choose a platform with LOOM_PLATFORM=<name>")
    verdicts = _verdicts()
    assert list(verdicts) == ["cpu", "broken", "boom", "odd"]
    assert verdicts["boom"].describe() == "raised: OSError: driver missing"
    assert verdicts["odd"].describe() == "raised: returned 3, not a qualified class name or None"
    assert verdicts["broken"].describe() == "raised: failed to load: ImportError: x"
    assert not any(v.won for v in verdicts.values())
    assert [v.builtin for v in verdicts.values()] == [True, False, False, False]


def test_a_broken_out_of_tree_platform_is_passed_over_when_another_is_chosen(resolve, monkeypatch):
    def raises():
        raise OSError("driver missing")

    monkeypatch.setenv("LOOM_PLATFORM", "cpu")
    resolve({"cpu": lambda: CPU}, {"boom": raises})
    assert _verdicts()["cpu"].won


def test_a_raising_builtin_detector_does_not_stop_resolution(resolve):
    def raises():
        raise OSError("no driver")

    resolve({"cuda": raises, "cpu": lambda: CPU}, {})
    assert _verdicts()["cpu"].won and _verdicts()["cuda"].raised


def test_nothing_answering_is_an_error(resolve):
    with pytest.raises(PlatformError) as e:
        resolve({"cpu": lambda: None}, {})
    assert str(e.value) == "no platform detector answered; install a platform plugin"


@pytest.mark.parametrize(("second", "message"), [
    (OSError("gone"), "platform plugin oot raised when asked again for its class: OSError: gone"),
    (5, "platform plugin oot returned 5 when asked again"),
])
def test_out_of_tree_second_answer_must_be_a_class_name(resolve, second, message):
    answers = [CPU, second]

    def oot():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    with pytest.raises(PlatformError) as e:
        resolve({"cpu": lambda: CPU}, {"oot": oot})
    assert str(e.value) == message


@pytest.mark.parametrize(("qualname", "message"), [
    ("nosuch_module_xyz.Platform", "platform plugin oot named 'nosuch_module_xyz.Platform', which does not import"),
    ("collections.OrderedDict", "platform plugin oot named 'collections.OrderedDict', which is not a "
                                "loom_plugin_api.Platform subclass"),
])
def test_winner_must_name_a_platform_class(resolve, qualname, message):
    with pytest.raises(PlatformError) as e:
        resolve({"cpu": lambda: CPU}, {"oot": lambda: qualname})
    assert str(e.value).startswith(message)


def test_current_platform_resolves_once_and_keeps_its_error(resolve, monkeypatch):
    calls = []

    def fails():
        calls.append(1)
        raise KeyError("bad")

    platforms._reset_for_tests()
    assert platforms.detector_verdicts() == []
    monkeypatch.setattr(platforms, "resolve_current_platform", fails)
    for _ in range(2):
        with pytest.raises(PlatformError, match="platform resolution failed: KeyError: 'bad'"):
            platforms.current_platform  # noqa: B018
    assert len(calls) == 1
    platforms._reset_for_tests()
    monkeypatch.setattr(platforms, "resolve_current_platform", lambda: calls.append(2) or CpuPlatform())
    first = platforms.current_platform
    assert platforms.current_platform is first and calls == [1, 2]
    with pytest.raises(AttributeError, match="has no attribute 'nosuch'"):
        platforms.nosuch  # noqa: B018


# ---- the built-in detectors' helpers (the driver and torch are faked: no GPU needed) ----
class FakeNvml:
    def __init__(self, init_rc=0, count_rc=0, count=3):
        self.init_rc, self.count_rc, self.count = init_rc, count_rc, count
        self.shutdowns = 0

    def nvmlInit_v2(self):
        return self.init_rc

    def nvmlDeviceGetCount_v2(self, ref):
        ref._obj.value = self.count
        return self.count_rc

    def nvmlShutdown(self):
        self.shutdowns += 1


@pytest.fixture
def nvml(monkeypatch):
    """nvml(fake or OSError) -> installs it as what ctypes.CDLL('libnvidia-ml.so.1') gives."""
    def use(fake):
        def cdll(name):
            assert name == "libnvidia-ml.so.1"
            if isinstance(fake, Exception):
                raise fake
            return fake
        monkeypatch.setattr(ctypes, "CDLL", cdll)
        return fake
    return use


def test_nvml_counts_the_gpus_and_shuts_down(nvml):
    fake = nvml(FakeNvml(count=3))
    assert platforms._nvml_device_count() == 3
    assert fake.shutdowns == 1


@pytest.mark.parametrize(("make", "reason", "shutdowns"), [
    (lambda: OSError("missing"), "the NVIDIA driver (libnvidia-ml.so.1) is not installed", None),
    (lambda: FakeNvml(init_rc=9), "the NVIDIA driver failed to initialize (nvmlInit)", 0),
    (lambda: FakeNvml(count_rc=2), "NVML cannot count the GPUs", 1),
])
def test_nvml_failures_are_reasons(nvml, make, reason, shutdowns):
    fake = nvml(make())
    with pytest.raises(platforms._NotAvailable) as e:
        platforms._nvml_device_count()
    assert str(e.value) == f"no CUDA device is visible: {reason}"
    if shutdowns is not None:
        assert fake.shutdowns == shutdowns


@pytest.fixture
def fake_torch(tmp_path, monkeypatch):
    """A torch package folder that find_spec('torch') points at; returns its version.py path."""
    real = importlib.util.find_spec
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path / "torch")])
    (tmp_path / "torch").mkdir()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: spec if name == "torch" else real(name, *a, **k))
    return tmp_path / "torch" / "version.py"


@pytest.mark.parametrize(("text", "cuda"), [
    ("__version__ = '2.13.0'\ncuda: Optional[str] = '12.8'\n", "12.8"),
    ('git_version = "abc"\ncuda = "12.1"\nhip = None\n', "12.1"),
    ("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n", None),
    ("cudnn = '9.1'\n  cuda = '11.0'\n", None),  # another name; not at the start of a line
])
def test_torch_cuda_version_is_read_from_the_version_file(fake_torch, text, cuda):
    fake_torch.write_text(text)
    assert platforms._torch_cuda_version() == cuda


def test_torch_cuda_version_without_torch_or_its_version_file(fake_torch, monkeypatch):
    assert platforms._torch_cuda_version() is None  # no version.py
    fake_torch.write_text("cuda = '12.8'\n")
    importlib.util.find_spec("torch").submodule_search_locations = []
    assert platforms._torch_cuda_version() is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    assert platforms._torch_cuda_version() is None


def test_builtin_detectors_cuda_first_then_cpu():
    assert list(platforms.builtin_platform_plugins) == ["cuda", "cpu"]
    assert platforms.builtin_platform_plugins["cpu"]() == CPU


def test_a_platform_error_is_kept_too(resolve, monkeypatch):
    calls = []

    def fails():
        calls.append(1)
        raise PlatformError("no platform")

    platforms._reset_for_tests()
    monkeypatch.setattr(platforms, "resolve_current_platform", fails)
    for _ in range(2):
        with pytest.raises(PlatformError, match="^no platform$"):
            platforms.current_platform  # noqa: B018
    assert calls == [1]


def test_cuda_detector_reasons(monkeypatch):
    real = importlib.util.find_spec
    installed = {"loom_platform_cuda": None}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: (
        installed[name] if name in installed else real(name, *a, **k)))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cases = [(None, 2, "12.8", "loom-platform-cuda is not installed"),
             (object(), 0, "12.8", "no CUDA device is visible (the NVIDIA driver reports 0 GPUs)"),
             (object(), 1, None, "the installed torch is a CPU-only build (torch.version.cuda is None)")]
    for spec, count, cuda, reason in cases:
        installed["loom_platform_cuda"] = spec
        monkeypatch.setattr(platforms, "_nvml_device_count", lambda count=count: count)
        monkeypatch.setattr(platforms, "_torch_cuda_version", lambda cuda=cuda: cuda)
        with pytest.raises(platforms._NotAvailable) as e:
            platforms.cuda_platform_plugin()
        assert str(e.value) == reason

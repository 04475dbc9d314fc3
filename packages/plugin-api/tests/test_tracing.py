"""Start-up spans (``loom_plugin_api.tracing``): nothing happens while nothing records; spans
nest per thread, and the file a process writes is whole and names it."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from loom_plugin_api import tracing


@pytest.fixture
def recording(tmp_path):
    tracing.start_recording(tmp_path, "worker", 3)
    try:
        yield tmp_path
    finally:
        tracing.stop_recording()


def test_off_span_is_one_shared_object_and_writes_nothing(tmp_path):
    assert not tracing.enabled()
    first, second = tracing.span("a", x=1), tracing.span("b")
    assert first is second  # no allocation per call: free while no trace is asked for
    with first:
        tracing.mark("ready")
        tracing.record("c", 0, 1)
    assert tracing.flush() is None
    assert list(tmp_path.iterdir()) == []


def test_spans_nest_per_thread_and_the_file_names_the_process(recording):
    with tracing.span("outer", model="m"):
        with tracing.span("inner"):
            time.sleep(0.01)
        worker = threading.Thread(target=lambda: tracing.span("elsewhere").__enter__().__exit__(None, None, None),
                                  name="helper")
        worker.start()
        worker.join()
    tracing.mark("ready")
    with pytest.raises(RuntimeError), tracing.span("fails"):
        raise RuntimeError("boom")
    path = tracing.flush()
    assert path == recording / f"worker-3-{os.getpid()}.json"
    assert not list(recording.glob("*.tmp"))
    doc = json.loads(path.read_text())
    assert (doc["role"], doc["rank"], doc["pid"]) == ("worker", 3, os.getpid())
    spans = {s[0]: s for s in doc["spans"]}
    outer, inner, other = spans["outer"], spans["inner"], spans["elsewhere"]
    assert outer[1] <= inner[1] < inner[2] <= outer[2]
    assert inner[2] - inner[1] >= 10_000_000  # ns
    assert outer[4] == {"model": "m"}
    assert spans["fails"][4] == {"error": "RuntimeError"}
    assert other[3] != outer[3] and doc["threads"][str(other[3])] == "helper"
    assert outer[3] == doc["main_tid"]
    assert outer[2] <= doc["marks"]["ready"]
    # the process's start, in the same clock, from /proc (10 ms ticks)
    assert doc["process_start_ns"] is not None and doc["process_start_ns"] < outer[1]


def test_record_takes_a_phase_that_ends_in_a_callback(recording):
    start = time.time_ns()
    tracing.record("listen", start, waits=True)
    doc = json.loads(tracing.flush().read_text())
    name, s, e, _, args = doc["spans"][0]
    assert (name, s, args) == ("listen", start, {"waits": True}) and e >= s


def test_a_child_records_when_its_environment_names_the_directory(tmp_path):
    import subprocess
    import sys

    code = ("from loom_plugin_api import tracing\n"
            "with tracing.span('work'):\n    pass\n")
    env = {**os.environ, tracing.TRACE_DIR_ENV: str(tmp_path), "LOOM_ROLE": "engine_core", "LOOM_RANK": "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    files = list(tmp_path.glob("engine_core-*.json"))  # written at exit; no rank for a unique role
    assert len(files) == 1
    assert [s[0] for s in json.loads(files[0].read_text())["spans"]] == ["work"]


def test_a_directory_removed_after_the_merge_is_not_made_again(tmp_path):
    trace = tmp_path / "trace"
    tracing.start_recording(trace, "frontend")
    try:
        with tracing.span("late"):
            pass
        trace.rmdir()  # the process that asked merged the trace and removed its directory
        with pytest.raises(OSError):
            tracing.flush()
        tracing._at_exit()  # a later exit says nothing and leaves nothing
        assert not trace.exists()
    finally:
        tracing._recorder = None


def test_a_program_a_waiting_shell_execs_starts_when_python_does(tmp_path):
    import subprocess
    import sys

    # the shell sleeps, then execs Python in its own process (as `bash -c "pip ... && loom serve"` may)
    code = "import time; from loom_plugin_api import tracing; print(time.time_ns() - tracing.process_start_ns())"
    script = f"sleep 2; exec {sys.executable} -c '{code}'"
    age_ns = int(subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True,
                                timeout=60).stdout)
    assert 0 < age_ns < 1.5e9  # not the 2 s the shell waited

"""What the engine does with a platform's answers (test_platform_hooks.py checks when hooks run):

* ``validate_environ``: with ``fail_on_environ_validation`` its error stops config creation with
  the platform's message; without it the problem is a warning and the config is made;
* ``apply_config_platform_defaults``: a default it sets reaches the final config and
  ``check_and_update_config`` sees it; a value the user chose is left alone;
* ``get_device_communicator_cls``: asked by each worker of a tensor-parallel group of two, whose
  collectives then go through that class (with one rank, no communicator is built).

One subprocess (the platform is resolved once per process) runs every case through the probe
platform of behaviour_probe.py, selected with LOOM_PLUGINS / LOOM_PLATFORM, then ``loom.LLM`` with
one rank and with two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import behaviour_probe
import loom_supervisor  # noqa: F401  (a missing supervisor wheel is an error, not a skip)
import pytest
from fake_dist import write_fake_dist

SCRIPT = r"""
import json, logging, os, sys
from loom import LLM, SamplingParams
from loom.engine.arg_utils import EngineArgs

model, result = sys.argv[1], {}
warnings = []
class Collect(logging.Handler):
    def emit(self, record):
        warnings.append([record.levelname, record.getMessage()])
logging.getLogger("loom.behaviour_probe").addHandler(Collect())

def config(**kwargs):
    return EngineArgs(model=model, max_model_len=128, **kwargs).create_engine_config()

try:
    config(fail_on_environ_validation=True)
    result["strict"] = None
except Exception as e:
    result["strict"] = f"{type(e).__name__}: {e}"
result["lenient_block_size"] = config().cache_config.block_size
result["lenient_warnings"] = warnings
os.environ["PROBE_FIRMWARE"] = "/lib/firmware/probe.bin"
config(fail_on_environ_validation=True)  # the problem fixed: no error
os.environ["PROBE_DEFAULT_BLOCK_SIZE"] = "32"
result["default_block_size"] = config().cache_config.block_size
result["user_block_size"] = config(block_size=16).cache_config.block_size
del os.environ["PROBE_DEFAULT_BLOCK_SIZE"]

params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 20)]
for tp in (1, 2):
    print("GENERATE", tp, flush=True)
    with open(os.environ["PROBE_LOG"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "rank": None, "event": "generate", "detail": tp}) + "\n")
    llm = LLM(model, dtype="float32", max_model_len=128, tensor_parallel_size=tp)
    result[f"tp{tp}"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.shutdown()
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def probe(tiny_llama, tmp_path_factory) -> tuple[dict, list[dict]]:
    """The script's results and the probe's records."""
    root = tmp_path_factory.mktemp("behaviour_probe")
    write_fake_dist(root / "site", "loom-behaviour-probe",
                    {"loom.platform_plugins": {"behaviour_probe": "behaviour_probe:behaviour_probe_platform"}},
                    "behaviour_probe", Path(behaviour_probe.__file__).read_text())
    log = root / "probe.jsonl"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PROBE_FIRMWARE", "PROBE_DEFAULT_BLOCK_SIZE", "LOOM_ATTENTION_BACKEND")}
    env.update({
        "PROBE_LOG": str(log),
        "LOOM_PLUGINS": "behaviour_probe",  # no other platform or general plugin that is installed
        "LOOM_PLATFORM": "behaviour_probe",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root / "site"), os.environ.get("PYTHONPATH")])),
    })
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), [json.loads(x) for x in log.read_text().splitlines()]


def test_validate_environ_stops_config_creation_when_asked_to_fail(probe):
    result, records = probe
    assert result["strict"] == f"ValueError: {behaviour_probe.FIRMWARE_MESSAGE}"
    # the platform heard the engine's choice; the strict attempt never reached the platform's last word
    asked = [r for r in records if r["event"] in ("validate_environ", "check_and_update_config")]
    assert [(r["event"], r["detail"]) for r in asked[:3]] == [
        ("validate_environ", True), ("validate_environ", False), ("check_and_update_config", 16)]


def test_validate_environ_only_warns_otherwise(probe):
    result, _ = probe
    assert result["lenient_block_size"] == 16  # the config was made
    assert result["lenient_warnings"] == [["WARNING", behaviour_probe.FIRMWARE_MESSAGE]]


def test_platform_defaults_reach_the_final_config_and_the_platforms_check(probe):
    result, records = probe
    assert result["default_block_size"] == 32
    seen = [r["detail"] for r in records if r["event"] == "check_and_update_config"]
    # lenient, fixed, with the default, user-chosen (then one per LLM)
    assert seen[:4] == [16, 16, 32, 16]


def test_a_value_the_user_chose_is_not_overridden_by_a_platform_default(probe):
    result, _ = probe
    assert result["user_block_size"] == 16


def test_workers_of_a_tensor_parallel_group_ask_for_the_platforms_communicator(probe):
    result, records = probe
    generate = [i for i, r in enumerate(records) if r["event"] == "generate"]
    tp1, tp2 = records[generate[0]:generate[1]], records[generate[1]:]
    # one rank: no communicator is built (the config's validation may still ask for its name)
    assert not [r for r in tp1 if r["event"].startswith("communicator.")]
    for rank in ("0", "1"):
        mine = [r for r in tp2 if r["rank"] == rank]
        assert len({r["pid"] for r in mine}) == 1  # one worker process per rank
        counts = Counter(r["event"] for r in mine)
        assert counts["get_device_communicator_cls"] == 1, counts
        assert counts["communicator.__init__"] == 1, counts
        assert [r["detail"] for r in mine if r["event"] == "communicator.__init__"] == [2]
        # the model's parallel layers reduce and gather through it on every step
        assert counts["communicator.all_reduce"] > 0 and counts["communicator.all_gather"] > 0, counts
    assert {r["rank"] for r in tp2 if r["event"].startswith("communicator.")} == {"0", "1"}
    assert result["tp2"] == result["tp1"]  # and they are right: the same greedy tokens as one rank

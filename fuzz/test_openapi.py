"""schemathesis against ``/openapi.json`` of a real server (uvicorn over the in-process engine on a
tiny Llama): generated requests, valid and invalid, never get a 5xx, and every answer is one the
schema declares (status code, content type, body shape). Run by ``nox -s fuzz``; the number of
examples per operation is bounded (``LOOM_FUZZ_EXAMPLES``, default 60)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "engine-core" / "tests"))

from loom.engine.arg_utils import EngineArgs  # noqa: E402
from loom.engine.inproc import InprocAsyncLLM  # noqa: E402
from loom.entrypoints.openai import build_app  # noqa: E402
from loom.entrypoints.openai.limits import RequestLimits  # noqa: E402
from server_thread import ServerThread  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

EXAMPLES = int(os.environ.get("LOOM_FUZZ_EXAMPLES", "60"))
CHECKS = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
          schemathesis.checks.content_type_conformance, schemathesis.checks.response_schema_conformance]


@pytest.fixture(scope="session")
def api_schema(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("models") / "llama", "llama", tie=False)
    # small limits keep every generated request cheap: at most 4 completions of 32 tokens
    engine = InprocAsyncLLM.from_engine_args(EngineArgs(model=str(path), served_model_name="tiny", dtype="float32",
                                                        max_model_len=32, max_num_seqs=8))
    engine.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    app = build_app(engine, "tiny", endpoint_plugins={}, limits=RequestLimits(max_n=4, max_request_body_bytes=65536))
    with ServerThread(app) as server:
        yield schemathesis.openapi.from_url(server.url + "/openapi.json")
    asyncio.run(engine.shutdown())


def operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
                         ids=lambda m: m.value)
def test_no_server_errors_and_only_declared_answers(api_schema, mode):
    ops = operations(api_schema)
    assert {f"{op.method.upper()} {op.path}" for op in ops} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health", "GET /ready"}
    for op in ops:
        if mode is schemathesis.GenerationMode.NEGATIVE and op.method.upper() != "POST":
            continue  # a route with no parameters and no body has no invalid request to generate
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case) -> None:
            case.call_and_validate(checks=CHECKS, timeout=60)

        run()

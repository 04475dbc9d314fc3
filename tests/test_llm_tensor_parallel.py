"""loom.LLM with tensor_parallel_size=2 runs its workers under the same supervisor as loom serve."""

from __future__ import annotations

import pytest
from loom import LLM, SamplingParams

pytest.importorskip("loom_supervisor")


def test_llm_tp2_matches_tp1_and_stops_its_workers(tiny_llama, tiny_opt):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    for model in (tiny_llama, tiny_opt):
        want = [o.outputs[0].token_ids for o in LLM(str(model), max_model_len=128).generate(prompts, params)]
        llm = LLM(str(model), max_model_len=128, tensor_parallel_size=2)
        executor = llm.llm_engine.executor
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
        assert got == want
        assert executor.exit_code == 0  # the supervisor stopped both workers cleanly
        assert not executor._thread.is_alive()

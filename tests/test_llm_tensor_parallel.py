"""loom.LLM with tensor_parallel_size=2 runs its workers under the same supervisor as loom serve."""

from __future__ import annotations

import loom_supervisor  # noqa: F401  (a missing supervisor wheel is an error, not a skip)
import pytest
from loom import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("every_installed_plugin")


def test_llm_tp2_matches_tp1_and_stops_its_workers(tiny_llama, tiny_opt):
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # every rank scores the prompt (the LM head gathers across ranks) and tracks the penalties
    scored = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=2, frequency_penalty=1.0)
    params = [plain, scored, scored]
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    for model in (tiny_llama, tiny_opt):
        # fp32 pinned: greedy tokens of two shardings agree to the bit only where rounding is fine
        want = LLM(str(model), dtype="float32", max_model_len=128).generate(prompts, params)
        llm = LLM(str(model), dtype="float32", max_model_len=128, tensor_parallel_size=2)
        executor = llm.llm_engine.executor
        got = llm.generate(prompts, params)
        llm.shutdown()
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        for g, w in zip(got[1:], want[1:]):
            assert len(g.prompt_logprobs) == len(w.prompt_logprobs) and g.prompt_logprobs[0] is None
            for ge, we in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
                assert ge.keys() == we.keys()
                assert all(abs(ge[t].logprob - we[t].logprob) < 1e-4 for t in ge)
        assert executor.exit_code == 0  # the supervisor stopped both workers cleanly
        assert not executor._thread.is_alive()

"""Prompt logprobs collected across prefill chunks, and again after a preemption (worker side)."""

from __future__ import annotations

import pytest
import torch
from loom.worker.prompt_logprobs import PromptLogprobsState, collect_prompt_logprobs
from loom_plugin_api.step import ScheduledRequest

V = 16
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def chunk(req_id: str, tokens: list[int], start: int) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=req_id, token_ids=tokens, num_computed_tokens=start, block_ids=[], sample=False
    )


def hidden_for(scheduled: list[ScheduledRequest]) -> torch.Tensor:
    # The "hidden state" of a position is a function of (position, token), so the LM head
    # below gives every position its own distribution and a misplaced row shows.
    rows = [
        torch.full((V,), 0.0).index_fill_(0, torch.tensor([(p * 7 + t) % V]), float(p % 5 + 1))
        for r in scheduled
        for p, t in enumerate(r.token_ids, start=r.num_computed_tokens)
    ]
    return torch.stack(rows)


def expected(position: int, token: int) -> torch.Tensor:
    return torch.log_softmax(hidden_for([chunk("x", [token], position)])[0], -1)


def test_chunks_score_the_next_prompt_token_and_skip_what_was_scored():
    states = {"a": PromptLogprobsState(list(PROMPT), num_top=2)}
    got = {}

    def step(scheduled):
        for out in collect_prompt_logprobs(lambda h: h, hidden_for(scheduled), scheduled, states):
            for j, value in enumerate(out.logprobs):
                assert out.start + j not in got, "scored twice"
                got[out.start + j] = (value, out.ranks[j], out.top_token_ids[j], out.top_logprobs[j])

    other = chunk("b", [7, 7], 0)  # a request without prompt logprobs shares the step
    step([other, chunk("a", PROMPT[:4], 0)])
    assert sorted(got) == [1, 2, 3, 4]  # the chunk's last position scores the next chunk's first token
    step([chunk("a", PROMPT[4:6], 4)])
    # preempted: recomputed from the start; the positions scored before are not sent again
    step([chunk("a", PROMPT[:7], 0), other])
    step([chunk("a", PROMPT[7:], 7)])
    assert sorted(got) == list(range(1, len(PROMPT)))
    assert "a" not in states  # the last prompt position is the sampler's
    step([chunk("a", [8], len(PROMPT))])  # decodes score nothing
    for pos in range(1, len(PROMPT)):
        row = expected(pos - 1, PROMPT[pos - 1])
        value, rank, top_ids, top_values = got[pos]
        assert value == pytest.approx(float(row[PROMPT[pos]]))
        assert rank == int((row > row[PROMPT[pos]]).sum()) + 1
        assert top_ids[0] == int(row.argmax())  # the rest of the row ties
        assert top_values == pytest.approx(row.topk(2).values.tolist())


def test_a_gap_in_the_prompt_is_an_error():
    states = {"a": PromptLogprobsState(list(PROMPT), num_top=0)}
    scheduled = [chunk("a", PROMPT[4:], 4)]  # as if the first 4 tokens came from the prefix cache
    with pytest.raises(RuntimeError, match="skipped prompt positions 0..3"):
        collect_prompt_logprobs(lambda h: h, hidden_for(scheduled), scheduled, states)

"""The tokens a worker process sampled, to fill in the ``PENDING_TOKEN`` of overlapped steps.

The engine schedules a step before it knows the tokens of the step running (see
:mod:`loom.engine.core`): a request that step samples feeds ``PENDING_TOKEN`` in the next. The
worker process runs its steps in order, so the token it sampled last for a request is the one.
"""

from __future__ import annotations

from loom_plugin_api.step import ModelRunnerOutput, SchedulerOutput

from ..ipc.messages import PENDING_TOKEN


class SampledTokens:
    """The token each running request sampled last, to fill in a step's ``PENDING_TOKEN``."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def fill(self, step: SchedulerOutput) -> None:
        last = self.last
        for req_id in step.finished_req_ids:
            last.pop(req_id, None)
        for r in step.scheduled:
            token_ids = r.token_ids
            if token_ids and token_ids[-1] == PENDING_TOKEN:
                token = last.get(r.req_id)
                if token is None or len(token_ids) > 1 and token_ids[-2] == PENDING_TOKEN:
                    raise RuntimeError(f"request {r.req_id!r} feeds a token this worker never sampled")
                token_ids[-1] = token

    def record(self, output: ModelRunnerOutput) -> None:
        self.last.update(zip(output.req_ids, output.sampled_token_ids))

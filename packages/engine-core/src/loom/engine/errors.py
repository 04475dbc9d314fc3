"""The errors an engine raises to its callers, and what each means for the request."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine could not serve a request."""


class EngineDeadError(EngineError):
    """The engine is gone; no request can be served. The message names the process and cause (503)."""


class ShuttingDownError(EngineError):
    """The server stopped before this request finished: its drain's grace period ran out (503)."""


class EngineOverloadedError(EngineError):
    """Requests wait to reach the engine faster than it takes them: refused now, retry shortly (503)."""


class RequestFailedError(EngineError):
    """The engine failed this request (e.g. its model step raised) and serves the others (500)."""


class EngineFatalError(RuntimeError):
    """The engine cannot go on (a worker stuck in a step): its process ends and the supervisor reports it."""


class StepTimeoutError(EngineFatalError):
    """A model step ran longer than ``--step-timeout``."""


class WorkerStepError(RuntimeError):
    """A worker raised while running a step (the engine isolates or aborts that step's requests)."""


class EngineStepError(RuntimeError):
    """A model step raised; the requests of that step were aborted, the engine goes on."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids

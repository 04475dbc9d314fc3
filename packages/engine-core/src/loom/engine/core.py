"""The engine loop: the one place that drives an ``LLMEngine``.

Every way of running the engine goes through :class:`EngineCore`: the engine-core process
of ``loom serve`` (:mod:`.core_proc`, commands from the front end's frames), the
in-process engine thread (:mod:`.inproc`, commands from the same process) and
``loom.LLM`` (commands from ``generate``). One iteration, :meth:`EngineCore.step`:
apply the commands that arrived (add, abort), step the engine if it has work, and report
the step's outputs, per-request errors and stats as one ``EngineOutputs``. A request the
engine rejects, or a model step that fails, ends those requests only; the engine goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from loom_plugin_api.step import SchedulerOutput

from ..ipc.messages import AbortRequests, AddRequest, EngineOutputs, RequestError
from ..logger import init_logger
from .errors import EngineStepError
from .llm_engine import LLMEngine

logger = init_logger(__name__)

Command = AddRequest | AbortRequests


class Inbox(Protocol):
    def get(self, block: bool) -> Sequence[Command] | None:
        """The commands that arrived (waiting for one when ``block``); None: stop the loop."""


class EngineCore:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def step(self, commands: Sequence[Command] = (), *, raise_errors: bool = False) -> EngineOutputs | None:
        """Apply ``commands``, step once if there is work; None when there is nothing to report.

        ``raise_errors`` (``loom.LLM``, whose caller is the user): a refused request or a failed
        step raises as it is instead of becoming a per-request error of the report.
        """
        errors = self.apply(commands, raise_errors=raise_errors)
        outputs = []
        if self.engine.has_unfinished_requests():
            started = self.engine.start_step()
            if started is not None:
                outputs = self._finish(started, errors, raise_errors)
        return self._report(outputs, errors, commands)

    def _finish(self, started: SchedulerOutput, errors: list[RequestError], raise_errors: bool = False) -> list:
        """The started step's outputs; a failed step's requests become ``errors``."""
        try:
            return self.engine.finish_step(started)
        except EngineStepError as e:
            if raise_errors:
                raise
            logger.error("%s", e, exc_info=e.__cause__)
            errors.extend(RequestError(request_id=i, message=str(e), status=500) for i in e.request_ids)
            return []

    def _report(self, outputs: list, errors: list[RequestError], commands: Sequence[Command]) -> EngineOutputs | None:
        if not (outputs or errors or commands):
            return None
        # Stats go with every report: a handful of integers beside the step's deltas.
        return EngineOutputs(outputs=outputs, errors=errors, stats=self.engine.get_stats())

    def apply(self, commands: Sequence[Command], *, raise_errors: bool = False) -> list[RequestError]:
        """Add and abort requests, in order; the errors of the adds the engine refused."""
        errors: list[RequestError] = []
        for command in commands:
            if isinstance(command, AbortRequests):
                self.engine.abort_request(command.request_ids)
            elif raise_errors:
                self._add_request(command)
            else:
                self._add(command, errors)
        return errors

    def _add_request(self, req: AddRequest) -> None:
        self.engine.add_request(req.request_id, req.prompt, req.prompt_token_ids, req.sampling_params,
                                stream=req.stream, lora_request=req.lora_request)

    def _add(self, req: AddRequest, errors: list[RequestError]) -> None:
        try:
            self._add_request(req)
        except ValueError as e:  # the request as given cannot run: the caller's error (400)
            errors.append(RequestError(request_id=req.request_id, message=str(e), status=400))
        except Exception as e:  # a bug met by this request alone: fail it (500), serve the others
            logger.exception("Adding request %r failed", req.request_id)
            errors.append(RequestError(request_id=req.request_id, message=f"{type(e).__name__}: {e}", status=500))

    def run(self, inbox: Inbox, report: Callable[[EngineOutputs], None]) -> None:
        """Step while there is work, wait for commands while there is none, until ``inbox`` says stop.

        Pipelined: a step's outputs are reported after the next step has started on the workers
        (``LLMEngine.start_step``), so the workers do not wait for the report (and the front end's
        wake-up) between two tokens. With ``LLMEngine.overlap`` the next step is even scheduled and
        started before the running one is finished, so the worker finds it queued when it ends a
        step instead of waiting for this loop's round trip; its decodes feed the tokens the
        running step samples. Commands are applied between steps: after the oldest step finished,
        before the next one is scheduled. While a step is out the inbox must leave the workers'
        answers to ``Executor.collect`` (the engine-core process's ``ChannelInbox`` does)."""
        engine = self.engine
        in_flight = engine.in_flight
        started = True  # whether the last iteration started a step
        while True:
            outputs: list = []
            errors: list[RequestError] = []
            if in_flight and (not started or not engine.can_start_step()):
                outputs = self._finish(in_flight[0][0], errors)
                commands = inbox.get(block=False)
            else:
                commands = inbox.get(block=not in_flight and not engine.has_unfinished_requests())
            started = False
            try:
                if commands is None:
                    return
                errors.extend(self.apply(commands))
                if engine.has_unfinished_requests() and engine.can_start_step():
                    started = engine.start_step() is not None
            finally:  # the finished step's outputs reach their requests, whatever happens to the next
                out = self._report(outputs, errors, commands or ())
                if out is not None:
                    report(out)

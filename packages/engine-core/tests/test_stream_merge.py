"""Deltas that queue up for a slow reader are yielded as one, and say the same."""

from __future__ import annotations

import asyncio

from loom.engine.client import EngineClient
from loom.engine.errors import RequestFailedError
from loom.outputs import CompletionOutput, Logprob, RequestOutput, merge_deltas


def _delta(texts: dict[int, str], finished: bool = False, logprobs: bool = False) -> RequestOutput:
    outputs = [
        CompletionOutput(
            index=i, text=t, token_ids=[ord(ch) for ch in t],
            logprobs=[{ord(ch): Logprob(-1.0)} for ch in t] if logprobs else None,
            cumulative_logprob=-float(len(t)) if logprobs else None,
            finish_reason="length" if finished else None,
        )
        for i, t in texts.items()
    ]
    return RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1], outputs=outputs, finished=finished)


def test_merge_concatenates_each_completion():
    merged = merge_deltas(_delta({0: "ab", 1: "x"}, logprobs=True), _delta({1: "yz"}, finished=True, logprobs=True))
    by_index = {c.index: c for c in merged.outputs}
    assert by_index[0].text == "ab" and by_index[0].finish_reason is None
    assert by_index[1].text == "xyz" and by_index[1].token_ids == [ord(c) for c in "xyz"]
    assert len(by_index[1].logprobs) == 3 and by_index[1].cumulative_logprob == -2.0
    assert by_index[1].finish_reason == "length" and merged.finished


class _Client(EngineClient):
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def is_ready(self) -> bool:
        return True

    def dead_error(self) -> str | None:
        return None

    def generate(self, request_id, prompt, prompt_token_ids, sampling_params):
        raise NotImplementedError

    def get_stats(self):
        return None

    async def shutdown(self) -> None:
        pass

    def _abort(self, request_id: str, *, end_stream: bool) -> None:
        self.aborted.append(request_id)


async def _collect(client: _Client, queue: asyncio.Queue) -> list[RequestOutput]:
    return [item async for item in client._stream("r", queue)]


def test_queued_deltas_are_yielded_as_one():
    async def run() -> list[RequestOutput]:
        queue: asyncio.Queue = asyncio.Queue()
        for text in "abc":
            queue.put_nowait(_delta({0: text}))
        queue.put_nowait(_delta({0: "d"}, finished=True))
        return await _collect(_Client(), queue)

    items = asyncio.run(run())
    assert len(items) == 1 and items[0].outputs[0].text == "abcd" and items[0].finished


def test_an_error_after_queued_deltas_comes_after_them():
    async def run() -> tuple[list[str], BaseException | None]:
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(_delta({0: "a"}))
        queue.put_nowait(_delta({0: "b"}))
        queue.put_nowait(RequestFailedError("step failed"))
        seen: list[str] = []
        try:
            async for item in _Client()._stream("r", queue):
                seen.append(item.outputs[0].text)
        except RequestFailedError as e:
            return seen, e
        return seen, None

    seen, error = asyncio.run(run())
    assert seen == ["ab"] and isinstance(error, RequestFailedError)


class _WatchedQueue(asyncio.Queue):
    """A queue that says when its reader is blocked waiting for the next item."""

    def __init__(self) -> None:
        super().__init__()
        self.reader_waiting = asyncio.Event()

    async def get(self):
        if self.empty():
            self.reader_waiting.set()
        return await super().get()


async def _feed_one_at_a_time(queue: _WatchedQueue, texts: str) -> None:
    """Put each delta only once the reader is blocked on the queue, so none can queue up."""
    for text in texts:
        await queue.reader_waiting.wait()
        queue.reader_waiting.clear()
        queue.put_nowait(_delta({0: text}))
    await queue.reader_waiting.wait()
    queue.put_nowait(_delta({0: ""}, finished=True))


def test_a_reader_that_keeps_up_sees_every_delta():
    async def run() -> list[str]:
        queue = _WatchedQueue()
        task = asyncio.create_task(_feed_one_at_a_time(queue, "abc"))
        texts = [item.outputs[0].text async for item in _Client()._stream("r", queue)]
        await task
        return texts

    assert asyncio.run(run()) == ["a", "b", "c", ""]


def test_stream_interval_holds_deltas_until_enough_tokens():
    async def run() -> list[RequestOutput]:
        queue = _WatchedQueue()
        client = _Client()
        client.stream_interval = 3
        task = asyncio.create_task(_feed_one_at_a_time(queue, "abcdefg"))
        items = [item async for item in client._stream("r", queue)]
        await task
        return items

    items = asyncio.run(run())
    # every delta arrived alone; the first token went out at once (time to first token), then
    # the interval, not a backlog, grouped them by three
    assert [item.outputs[0].text for item in items] == ["a", "bcd", "efg", ""]
    assert [item.finished for item in items] == [False, False, False, True]

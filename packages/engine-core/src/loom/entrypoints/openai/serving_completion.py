"""``POST /v1/completions``: one or more prompts, ``n`` choices each, JSON or SSE.

``echo`` puts the prompt before each choice's text (in a stream, in the choice's first
chunk); with ``logprobs`` the prompt tokens get logprobs too, the first one ``null``.
``echo`` with ``max_tokens: 0`` returns the prompt alone: the engine always samples at
least one token, so the request runs with a budget of one and that token is dropped (as
vLLM does); it is not counted in ``usage.completion_tokens``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ...outputs import CompletionOutput, Logprob, RequestOutput
from .protocol import (
    SSE_DONE,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TextChunks,
    UsageInfo,
    sse,
)
from .serving_engine import (
    APIError,
    ChoiceState,
    OpenAIServing,
    api_error_from,
    merge_async_iterators,
    sampled_logprobs,
    token_text,
)
from .streaming import Prefetched, SSEResponse, prefetch


@dataclass(slots=True)
class _Echo:
    """The prompts to put before the choices' text, and their logprobs once the engine sends them."""

    texts: list[str]
    prompt_token_ids: list[list[int]]
    only: bool
    """``max_tokens: 0``: the prompt alone; the one token generated is dropped."""
    decode: Callable[[int], str]
    prompt_logprobs: dict[int, list[dict[int, Logprob] | None]]
    """Prompt index -> its logprobs (from the prompt's first RequestOutput)."""

    def take(self, i: int, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[i] = out.prompt_logprobs


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | SSEResponse:
        model_name = self.check_request(request)
        lora = await self.models.lora_for(request.model)
        if request.suffix:
            raise APIError("suffix is not supported by loom", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise APIError("best_of must equal n (loom returns every sampled completion)", param="best_of")
        if request.stream_options is not None and not request.stream:
            raise APIError("stream_options is only allowed with stream=true", param="stream_options")
        items = self._prompt_items(request)
        self.check_limits(request, len(items))
        prompts = await self._prompts(items)
        echo = None
        if request.echo:
            texts = [text if text is not None else await self.tokenizer_thread.run(self.tokenizer.decode, ids)
                     for text, ids in prompts]
            echo = _Echo(texts=texts,
                         prompt_token_ids=[ids for _, ids in prompts], only=request.max_tokens == 0,
                         decode=self._decode_token, prompt_logprobs={})
        params = []
        for _, ids in prompts:
            max_tokens = self.resolve_max_tokens(len(ids), request.max_tokens, "max_tokens")
            if echo is not None and echo.only:
                max_tokens = 1
            params.append(self.sampling_params(request, max_tokens, request.logprobs,
                                               request.logprobs if request.echo else None))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        merged = merge_async_iterators([
            self.generate(request_id if len(prompts) == 1 else f"{request_id}-{i}", text, ids, p, lora)
            for i, ((text, ids), p) in enumerate(zip(prompts, params))
        ])
        merged = await prefetch(merged)  # an engine-side rejection is still an HTTP error here
        num_prompt_tokens = sum(len(ids) for _, ids in prompts)
        n = request.n
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            return SSEResponse(self._stream(merged, request_id, model_name, n, len(prompts), num_prompt_tokens,
                                            include_usage, request.return_tokens_as_token_ids, echo),
                               on_close=merged.aclose)
        states = [ChoiceState() for _ in range(len(prompts) * n)]
        logprobs = [CompletionLogprobs() for _ in states] if request.logprobs is not None else None
        try:
            async for i, out in merged:
                if echo is not None:
                    echo.take(i, out)
                for c in out.outputs:
                    index = i * n + c.index
                    state, lp = states[index], logprobs[index] if logprobs else None
                    if echo is not None:
                        c = _echo(echo, i, state, c, lp, request.return_tokens_as_token_ids)
                    _update(state, c, lp, request.return_tokens_as_token_ids)
        except Exception as e:
            raise api_error_from(e) from e
        finally:
            await merged.aclose()
        choices = [
            CompletionChoice(index=i, text="".join(s.text), logprobs=logprobs[i] if logprobs else None,
                             finish_reason=s.finish_reason or "abort", stop_reason=s.stop_reason)
            for i, s in enumerate(states)
        ]
        num_generated = sum(s.num_tokens for s in states)
        return CompletionResponse(
            id=request_id, model=model_name, choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated,
                            total_tokens=num_prompt_tokens + num_generated),
        )

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _prompt_items(self, request: CompletionRequest) -> list[str | list[int]]:
        """The prompts of a request, each a text or token ids (not tokenized yet)."""
        prompt = request.prompt
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError("prompt is empty; give a string, a list of strings or token ids", param="prompt")
        return items

    async def _prompts(self, items: list[str | list[int]]) -> list[tuple[str | None, list[int]]]:
        out: list[tuple[str | None, list[int]]] = []
        for item in items:
            if isinstance(item, str):
                out.append((item, await self.encode(item, "prompt")))
                continue
            if len(item) > self.max_model_len:
                raise APIError(f"a prompt has {len(item)} token ids, more than this model's maximum context "
                               f"length of {self.max_model_len} tokens. Shorten it.", param="prompt")
            bad = [t for t in item if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                               param="prompt")
            out.append((None, list(item)))
        return out

    async def _stream(self, merged: Prefetched[tuple[int, RequestOutput]], request_id: str, model_name: str,
                      n: int, num_prompts: int, num_prompt_tokens: int, include_usage: bool,
                      as_ids: bool, echo: _Echo | None) -> AsyncIterator[str]:
        created = int(time.time())
        states = [ChoiceState() for _ in range(num_prompts * n)]

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse(CompletionChunk(id=request_id, created=created, model=model_name, choices=choices,
                                       usage=usage))

        text_chunk = TextChunks(lambda index, text: chunk([CompletionChoice(index=index, text=text)]))
        try:
            async for i, out in merged:
                if echo is not None:
                    echo.take(i, out)
                for c in out.outputs:
                    index = i * n + c.index
                    state = states[index]
                    delta_logprobs = CompletionLogprobs() if c.logprobs is not None else None
                    num_texts = len(state.text)
                    if echo is not None:
                        c = _echo(echo, i, state, c, delta_logprobs, as_ids)
                    _update(state, c, delta_logprobs, as_ids)
                    text = "".join(state.text[num_texts:])  # the echoed prompt comes first
                    if delta_logprobs is None and c.finish_reason is None and text:
                        yield text_chunk(index, text)
                    elif text or c.finish_reason is not None or (delta_logprobs and delta_logprobs.tokens):
                        yield chunk([CompletionChoice(index=index, text=text, logprobs=delta_logprobs,
                                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
        except Exception as e:  # the status line is sent: the error goes in the stream
            yield sse(api_error_from(e).body())
            yield SSE_DONE
            return
        for index, s in enumerate(states):
            if s.finish_reason is None:  # aborted by the server
                yield chunk([CompletionChoice(index=index, text="", finish_reason="abort")])
        if include_usage:
            num_generated = sum(s.num_tokens for s in states)
            yield chunk([], UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated,
                                      total_tokens=num_prompt_tokens + num_generated))
        yield SSE_DONE


def _update(state: ChoiceState, c: CompletionOutput, logprobs: CompletionLogprobs | None, as_ids: bool) -> None:
    state.text.append(c.text)
    state.num_tokens += len(c.token_ids)
    if c.finish_reason is not None:
        state.finish_reason, state.stop_reason = c.finish_reason, c.stop_reason
    if logprobs is None:
        return
    for token_id, entry in sampled_logprobs(c):
        _append_logprob(state, logprobs, token_id, entry, as_ids)


def _append_logprob(state: ChoiceState, logprobs: CompletionLogprobs, token_id: int,
                    entry: dict[int, Logprob], as_ids: bool) -> None:
    sampled = entry.get(token_id)
    logprobs.tokens.append(token_text(sampled, token_id, as_ids))
    logprobs.token_logprobs.append(sampled.logprob if sampled is not None else None)
    logprobs.top_logprobs.append({token_text(lp, tid, as_ids): lp.logprob for tid, lp in entry.items()})
    logprobs.text_offset.append(state.text_offset)
    state.text_offset += len(token_text(sampled, token_id))


def _echo(echo: _Echo, i: int, state: ChoiceState, c: CompletionOutput, logprobs: CompletionLogprobs | None,
          as_ids: bool) -> CompletionOutput:
    """Put prompt ``i`` (and its logprobs) first in the choice on its first output; returns the
    output to add after it (without its token when the prompt alone was asked for)."""
    if not state.echoed:
        state.echoed = True
        state.text.append(echo.texts[i])
        ids = echo.prompt_token_ids[i]
        if logprobs is not None:
            entries = echo.prompt_logprobs.get(i) or [None] * len(ids)
            for token_id, entry in zip(ids, entries):
                if entry is None:  # the first token: nothing precedes it, so it has no logprob
                    text = echo.decode(token_id)
                    logprobs.tokens.append(f"token_id:{token_id}" if as_ids else text)
                    logprobs.token_logprobs.append(None)
                    logprobs.top_logprobs.append(None)
                    logprobs.text_offset.append(state.text_offset)
                    state.text_offset += len(text)
                else:
                    _append_logprob(state, logprobs, token_id, entry, as_ids)
    if not echo.only:
        return c
    return CompletionOutput(index=c.index, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                            finish_reason="length" if c.finish_reason is not None else None)

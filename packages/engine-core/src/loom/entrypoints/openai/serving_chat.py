"""``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template, JSON or SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ...engine.client import EngineClient
from ...metrics import ServerMetrics
from ...outputs import CompletionOutput, RequestOutput
from .protocol import (
    SSE_DONE,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    TextChunks,
    TokenLogprob,
    TopLogprob,
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
    top_alternatives,
)
from .streaming import Prefetched, SSEResponse, prefetch

_ROLES = {"system", "developer", "user", "assistant", "tool"}


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine_client: EngineClient, served_model_names: Sequence[str],
                 metrics: ServerMetrics | None = None, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(engine_client, served_model_names, metrics, **kwargs)
        self.chat_template = chat_template
        """Overrides the tokenizer's template (``--chat-template``)."""

    async def create_chat_completion(self, request: ChatCompletionRequest) -> ChatCompletionResponse | SSEResponse:
        model_name = self.check_request(request)
        lora = await self.models.lora_for(request.model)
        if request.tools and request.tool_choice != "none":
            raise APIError("tool calling is not supported by loom", param="tools")
        if request.response_format and request.response_format.get("type", "text") != "text":
            raise APIError("only response_format type 'text' is supported by loom", param="response_format")
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if request.stream_options is not None and not request.stream:
            raise APIError("stream_options is only allowed with stream=true", param="stream_options")
        prompt, prompt_ids = await self.render(request)
        if request.max_completion_tokens is not None:
            max_tokens = self.resolve_max_tokens(len(prompt_ids), request.max_completion_tokens,
                                                 "max_completion_tokens")
        else:
            max_tokens = self.resolve_max_tokens(len(prompt_ids), request.max_tokens, "max_tokens")
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, top_logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        merged = await prefetch(merge_async_iterators([self.generate(request_id, prompt, prompt_ids, params, lora)]))
        n = request.n
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            return SSEResponse(self._stream(merged, request_id, model_name, n, len(prompt_ids), top_logprobs,
                                            include_usage, request.return_tokens_as_token_ids),
                               on_close=merged.aclose)
        states = [ChoiceState() for _ in range(n)]
        try:
            async for _, out in merged:
                for c in out.outputs:
                    _update(states[c.index], c, top_logprobs, request.return_tokens_as_token_ids)
        except Exception as e:
            raise api_error_from(e) from e
        finally:
            await merged.aclose()
        choices = [
            ChatCompletionChoice(
                index=i, message=ChatResponseMessage(content="".join(s.text)),
                logprobs=ChatLogprobs(content=s.logprobs) if top_logprobs is not None else None,
                finish_reason=s.finish_reason or "abort", stop_reason=s.stop_reason)
            for i, s in enumerate(states)
        ]
        num_generated = sum(s.num_tokens for s in states)
        return ChatCompletionResponse(
            id=request_id, model=model_name, choices=choices,
            usage=UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=num_generated,
                            total_tokens=len(prompt_ids) + num_generated),
        )

    async def render(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The prompt text and its token ids, through the chat template (on the tokenizer's thread)."""
        tokenizer = self.tokenizer
        if self.chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise APIError(
                f"the model {self.served_model_names[0]!r} has no chat template (its tokenizer defines none), so "
                "chat messages cannot be formatted; use /v1/completions, or serve it with --chat-template",
                param="messages")
        if not request.messages:
            raise APIError("messages is empty; give at least one message", param="messages")
        messages = [_message_dict(m) for m in request.messages]
        # bounded before the template renders them: the prompt holds every message's content
        self.check_text_length(sum(len(m["content"]) for m in messages if isinstance(m["content"], str)), "messages")
        try:
            text = await self.tokenizer_thread.run(
                tokenizer.apply_chat_template,
                messages, tokenize=False, chat_template=self.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                **(request.chat_template_kwargs or {}),
            )
        except Exception as e:  # jinja2's TemplateError and the template's own raise_exception
            raise APIError(f"the chat template could not render these messages: {type(e).__name__}: {e}",
                           param="messages") from None
        return text, await self.encode(text, "messages", add_special_tokens=False)

    async def _stream(self, merged: Prefetched[tuple[int, RequestOutput]], request_id: str, model_name: str,
                      n: int, num_prompt_tokens: int, top_logprobs: int | None,
                      include_usage: bool, as_ids: bool) -> AsyncIterator[str]:
        created = int(time.time())
        states = [ChoiceState() for _ in range(n)]

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=choices,
                                           usage=usage))

        text_chunk = TextChunks(lambda i, text: chunk([ChatCompletionStreamChoice(
            index=i, delta=DeltaMessage(content=text))]))
        for i in range(n):  # the role first, as OpenAI does
            yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        try:
            async for _, out in merged:
                for c in out.outputs:
                    state = states[c.index]
                    num_logprobs = len(state.logprobs)
                    _update(state, c, top_logprobs, as_ids)
                    new_logprobs = state.logprobs[num_logprobs:]
                    if top_logprobs is None and c.finish_reason is None and c.text:
                        yield text_chunk(c.index, c.text)
                    elif c.text or c.finish_reason is not None or new_logprobs:
                        yield chunk([ChatCompletionStreamChoice(
                            index=c.index, delta=DeltaMessage(content=c.text),
                            logprobs=ChatLogprobs(content=new_logprobs) if top_logprobs is not None else None,
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
        except Exception as e:  # the status line is sent: the error goes in the stream
            yield sse(api_error_from(e).body())
            yield SSE_DONE
            return
        for i, s in enumerate(states):
            if s.finish_reason is None:  # aborted by the server
                yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(), finish_reason="abort")])
        if include_usage:
            num_generated = sum(s.num_tokens for s in states)
            yield chunk([], UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated,
                                      total_tokens=num_prompt_tokens + num_generated))
        yield SSE_DONE


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    if message.role not in _ROLES:
        raise APIError(f"unknown message role {message.role!r}; use one of {', '.join(sorted(_ROLES))}",
                       param="messages")
    content = message.content
    if isinstance(content, list):
        parts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(f"only text content parts are supported by loom, got type {part.get('type')!r}",
                               param="messages")
            parts.append(part["text"])
        content = "\n".join(parts)
    out: dict[str, Any] = {**(message.model_extra or {}), "role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out


def _update(state: ChoiceState, c: CompletionOutput, top_logprobs: int | None, as_ids: bool) -> None:
    state.text.append(c.text)
    state.num_tokens += len(c.token_ids)
    if c.finish_reason is not None:
        state.finish_reason, state.stop_reason = c.finish_reason, c.stop_reason
    if top_logprobs is None:
        return
    for token_id, entry in sampled_logprobs(c):
        sampled = entry.get(token_id)
        text = token_text(sampled, token_id, as_ids)
        state.logprobs.append(TokenLogprob(
            token=text, logprob=sampled.logprob if sampled is not None else float("-inf"),
            bytes=list(text.encode("utf-8")),
            top_logprobs=[
                TopLogprob(token=(t := token_text(lp, tid, as_ids)), logprob=lp.logprob, bytes=list(t.encode("utf-8")))
                for tid, lp in top_alternatives(entry, top_logprobs)
            ],
        ))

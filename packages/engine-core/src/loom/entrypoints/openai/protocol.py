"""The wire format of the OpenAI-compatible API: request bodies, responses, stream chunks, errors.

Requests accept OpenAI's fields plus the sampling extras vLLM's server takes in the body
(``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``repetition_penalty``, ...).
Fields loom does not know are kept in ``model_extra`` and logged as ignored; fields it knows
but cannot honour (``logit_bias``, ``suffix``, tools) are rejected with a 400 that says so,
rather than silently changing the output.

Types are strict: a string or a boolean is not a number (``"max_tokens": "10"`` and
``"max_tokens": true`` are refused, not coerced), ``"stream": "yes"`` is not a boolean, floats
must be finite, and text must be valid Unicode (a lone surrogate such as ``"\\ud800"`` cannot
be tokenized). The limits that depend on the model or the server's flags are checked in
:mod:`.serving_engine` and :mod:`.limits`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_serializer

# ---- errors --------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---- requests ------------------------------------------------------------------------------


def unicode_text(value: str) -> str:
    """Refuse text that is not valid Unicode (lone surrogates, which JSON's ``\\uXXXX`` can carry)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text has a lone surrogate {value[e.start]!r} at character {e.start}, which is not "
                         "valid Unicode; send UTF-8 text") from None
    return value


Text = Annotated[str, AfterValidator(unicode_text)]
"""A string field of a request: valid Unicode."""

_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow", **_STRICT)

    model: Text | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: Text | None = None
    # vLLM's sampling extras
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False
    """Logprob tokens as ``token_id:<id>`` (for tokens that are not valid UTF-8 on their own)."""


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", **_STRICT)

    role: Text
    content: Text | list[dict[str, Any]] | None = None
    name: Text | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


# ---- responses -----------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """What a chunk adds to a choice's message: the role once, then content; unset parts are left out."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "loom"
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model; None for the base model itself."""
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class TextChunks:
    """The events of a stream that only add text to a choice: no logprobs, no finish. Those
    are nearly every event of a stream, one a token, and rendering the chunk's models costs
    about 6 us against 1 here: ``render(index, text)`` (the full pydantic path) runs once per
    choice index with a placeholder for the text, and each event splices the JSON-encoded
    text into that. ``json.dumps(ensure_ascii=False)`` escapes a string exactly as pydantic
    does (tested byte for byte); if the placeholder cannot be found again, every event is
    rendered in full."""

    _MARK = "\x00loom:text\x00"

    def __init__(self, render: Callable[[int, str], str]) -> None:
        self._render = render
        self._parts: dict[int, tuple[str, str] | None] = {}

    def __call__(self, index: int, text: str) -> str:
        try:
            parts = self._parts[index]
        except KeyError:
            mark = json.dumps(self._MARK, ensure_ascii=False)
            head, found, tail = self._render(index, self._MARK).partition(mark)
            # exactly once: a field before the text that equals the placeholder would misplace it
            parts = self._parts[index] = (head, tail) if found and mark not in tail else None
        if parts is None:
            return self._render(index, text)
        return parts[0] + json.dumps(text, ensure_ascii=False) + parts[1]

"""What both OpenAI endpoints share: checks that keep bad requests from the engine, sampling
parameters from a request body, the engine stream with metrics, logprobs in OpenAI shapes.

Tokenizing and chat templating run on one thread of their own, never on the event loop: a
large prompt must not stop ``/health`` or other clients' streams from answering. Before a
text is tokenized its length is checked against a bound that needs no tokenizing: no token
of the vocabulary is longer than ``longest_token`` characters, so a text of more than
``max_model_len * longest_token`` characters has more tokens than the model takes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from loom_plugin_api import LoRARequest, SamplingParams

from ...engine.client import EngineClient
from ...engine.errors import EngineDeadError, EngineError, EngineOverloadedError, ShuttingDownError
from ...logger import init_logger
from ...metrics import ServerMetrics
from ...outputs import CompletionOutput, Logprob, RequestOutput
from .limits import RequestLimits
from .protocol import ErrorInfo, ErrorResponse, _SamplingRequest, unicode_text

logger = init_logger(__name__)

T = TypeVar("T")


class APIError(Exception):
    """An error answered in OpenAI's shape; raised anywhere in a handler."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code if self.code is not None else self.status))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def api_error_from(exc: BaseException) -> APIError:
    """The HTTP face of what ``EngineClient.generate`` raises."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), status=503, type="engine_dead_error")
    if isinstance(exc, ShuttingDownError):
        return APIError(str(exc), status=503, type="service_unavailable")
    if isinstance(exc, EngineOverloadedError):
        return APIError(str(exc), status=503, type="service_unavailable", headers={"Retry-After": "1"})
    if isinstance(exc, EngineError):
        return APIError(str(exc), status=500, type="server_error")
    logger.exception("Unexpected error while serving a request", exc_info=exc)
    return APIError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error")


@dataclass(slots=True)
class ChoiceState:
    """What has been produced for one choice so far."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[Any] = field(default_factory=list)
    text_offset: int = 0
    echoed: bool = False
    """The prompt was put before the text (completions with ``echo``)."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def longest_token(tokenizer: Any) -> int | None:
    """Characters of the vocabulary's longest token (byte-level BPE: bytes), None without a vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab()
    return max(map(len, vocab), default=None) if vocab else None


class TokenizerThread:
    """The one thread that tokenizes for a server (a tokenizer is not meant for concurrent calls),
    and the vocabulary's longest token, read once for every endpoint."""

    def __init__(self, tokenizer: Any) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-tokenizer")
        self.longest_token = longest_token(tokenizer)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, lambda: fn(*args, **kwargs))


def _serving_models() -> Any:
    from . import serving_models  # not at the top: serving_models imports APIError from here

    return serving_models


class OpenAIServing:
    def __init__(self, engine_client: EngineClient, served_model_names: Sequence[str],
                 metrics: ServerMetrics | None = None, *, limits: RequestLimits | None = None,
                 tokenizer_thread: TokenizerThread | None = None, models: Any = None) -> None:
        self.engine_client = engine_client
        self.served_model_names = list(served_model_names)
        self.metrics = metrics
        self.limits = limits or RequestLimits()
        self.tokenizer = engine_client.tokenizer
        self.tokenizer_thread = tokenizer_thread or TokenizerThread(self.tokenizer)
        model_config = engine_client.config.model_config
        self.model_aliases = {model_config.model} - {None} - set(self.served_model_names)
        """The model as given to ``loom serve`` (often a path): accepted in a request's ``model``, never
        shown, so clients written against the path keep working when the served name is the model's own."""
        self.models = models or _serving_models().OpenAIServingModels(engine_client.config, self.served_model_names, self.model_aliases)
        """The base model's names and the LoRA adapters (shared by every endpoint of an app)."""
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.get_vocab_size()
        longest = self.tokenizer_thread.longest_token
        self.max_prompt_chars: int | None = None if longest is None else self.max_model_len * max(longest, 1)
        """A text longer than this has more than max_model_len tokens, whatever they are."""

    # ---- tokenizing off the event loop --------------------------------------------------
    def check_text_length(self, num_chars: int, param: str) -> None:
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise APIError(
                f"{param} has {num_chars} characters, more than {self.max_prompt_chars}: that is more than this "
                f"model's maximum context length of {self.max_model_len} tokens whatever the tokens are. Shorten it.",
                param=param)

    async def encode(self, text: str, param: str, **kwargs: Any) -> list[int]:
        """Token ids of a text, after the checks that need no tokenizing; on the tokenizer's thread."""
        self.check_text_length(len(text), param)
        try:
            unicode_text(text)  # chat text comes from content parts and the template, not a checked field
        except ValueError as e:
            raise APIError(f"{param}: {e}", param=param) from None
        return list(await self.tokenizer_thread.run(self.tokenizer.encode, text, **kwargs))

    # ---- checks before anything reaches the engine --------------------------------------
    def check_request(self, request: _SamplingRequest) -> str:
        """Model name, engine health and fields loom cannot honour; returns the model name to answer with."""
        if request.model in self.model_aliases:
            request.model = None  # answered with the served name
        self.models.check_known(request.model)
        dead = self.engine_client.dead_error
        if dead is not None:
            raise APIError(dead, status=503, type="engine_dead_error")
        if self.engine_client.stopping:
            raise APIError("the server is shutting down and takes no new requests; retry them elsewhere or once "
                           "it is back", status=503, type="service_unavailable")
        if not self.engine_client.is_ready:
            raise APIError("the engine is not ready yet; retry when /health answers 200", status=503,
                           type="service_unavailable")
        if request.logit_bias:
            raise APIError("logit_bias is not supported by loom", param="logit_bias")
        if request.model_extra:  # names chosen by the client: escaped, so they cannot forge log lines
            names = sorted(request.model_extra)
            logger.warning("Ignored unknown request fields: %s%s", ", ".join(ascii(k) for k in names[:10]),
                           f" and {len(names) - 10} more" if len(names) > 10 else "")
        self.check_limits(request)
        return request.model or self.served_model_names[0]

    def check_limits(self, request: _SamplingRequest, num_prompts: int = 1) -> None:
        """The fields whose range depends on the model or the server's limits."""
        limits = self.limits
        if request.n * num_prompts > limits.max_n:
            what = f"n={request.n}" if num_prompts == 1 else f"n={request.n} for each of {num_prompts} prompts"
            raise APIError(f"{what} asks for {request.n * num_prompts} completions; the limit is {limits.max_n} "
                           "per request (--max-n)", param="n")
        if request.top_k is not None and not -1 <= request.top_k <= self.vocab_size:
            raise APIError(f"top_k must be -1, 0 or at most the vocabulary size {self.vocab_size}, got "
                           f"{request.top_k}", param="top_k")
        stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stop) > limits.max_stop:
            raise APIError(f"stop has {len(stop)} entries; the limit is {limits.max_stop}", param="stop")
        long = [len(s) for s in stop if len(s) > limits.max_stop_chars]
        if long:
            raise APIError(f"a stop string has {long[0]} characters; the limit is {limits.max_stop_chars}",
                           param="stop")
        ids = request.stop_token_ids or []
        if len(ids) > limits.max_stop:
            raise APIError(f"stop_token_ids has {len(ids)} entries; the limit is {limits.max_stop}",
                           param="stop_token_ids")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                           param="stop_token_ids")
        for name in ("min_tokens", "max_tokens", "max_completion_tokens"):
            value = getattr(request, name, None)
            if value is not None and value > self.max_model_len:
                raise APIError(f"{name} is {value}, more than this model's maximum context length of "
                               f"{self.max_model_len} tokens", param=name)

    def resolve_max_tokens(self, num_prompt_tokens: int, requested: int | None, param: str) -> int | None:
        if num_prompt_tokens == 0:
            raise APIError("the prompt is empty; give at least one token", param="prompt")
        if requested is None:
            if num_prompt_tokens >= self.max_model_len:
                raise APIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                    f"has {num_prompt_tokens} tokens, which leaves no room for a completion. Shorten the prompt.",
                    param="prompt")
            return self.max_model_len - num_prompt_tokens
        if requested >= 1 and num_prompt_tokens + requested > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} for "
                f"the completion). Shorten the prompt or lower {param}.", param=param)
        return requested

    def sampling_params(self, request: _SamplingRequest, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        stop = request.stop
        try:
            return SamplingParams(
                n=request.n,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=request.top_k or 0,
                seed=request.seed,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                stop=[stop] if isinstance(stop, str) else list(stop or []),
                stop_token_ids=list(request.stop_token_ids or []),
                ignore_eos=request.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                skip_special_tokens=request.skip_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
            )
        except ValueError as e:
            raise APIError(str(e)) from None

    # ---- the engine stream --------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """``engine_client.generate`` plus the request's metrics, observed when it ends (any way)."""
        start = time.monotonic()
        first_token: float | None = None
        num_tokens = 0
        reasons: dict[int, str] = {}
        accepted = True
        try:
            async with aclosing(self.engine_client.generate(request_id, prompt, prompt_token_ids, params,
                                                            lora_request=lora_request)) as stream:
                async for out in stream:
                    for c in out.outputs:
                        if c.token_ids and first_token is None:
                            first_token = time.monotonic()
                        num_tokens += len(c.token_ids)
                        if c.finish_reason is not None:
                            reasons[c.index] = c.finish_reason
                    yield out
        except ValueError:
            accepted = False
            raise
        except EngineError:
            reasons = {i: reasons.get(i, "error") for i in range(params.n)}
            raise
        finally:
            if accepted and self.metrics is not None:
                ended = [reasons.get(i, "abort") for i in range(params.n)]
                self.metrics.observe_request(
                    num_prompt_tokens=len(prompt_token_ids), num_generation_tokens=num_tokens,
                    finish_reasons=ended, ttft=None if first_token is None else first_token - start,
                    e2e=time.monotonic() - start)


async def merge_async_iterators(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's position.

    Closing the merged iterator (or an error in one input) cancels and closes every input,
    which aborts their requests.
    """
    if len(iterators) == 1:
        async with aclosing(iterators[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def drain(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except Exception as e:
            await queue.put((i, e))
        await queue.put((i, done))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for it in iterators:
            await it.aclose()  # type: ignore[attr-defined]


# ---- logprobs -------------------------------------------------------------------------------
def token_text(logprob: Logprob | None, token_id: int, as_id: bool = False) -> str:
    if not as_id and logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return f"token_id:{token_id}"


def sampled_logprobs(c: CompletionOutput) -> list[tuple[int, dict[int, Logprob]]]:
    """(sampled token id, its entry) per token of a delta; the entry holds the sampled token and the top ones."""
    if c.logprobs is None:
        return []
    return list(zip(c.token_ids, c.logprobs))


def top_alternatives(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens at a position, by rank."""
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda item: item[1].rank)[:k]  # type: ignore[arg-type,return-value]

"""``loom.LLM``: offline generation through the engine, in this process."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

from loom_plugin_api import LoRARequest, SamplingParams
from loom_plugin_api.tracing import span
from tqdm import tqdm

from .. import envs
from ..config.parallel import RAY_DRIVER_ENV
from ..engine.arg_utils import EngineArgs
from ..engine.core import EngineCore
from ..engine.executor import Executor
from ..engine.llm_engine import LLMEngine
from ..engine.uniproc_executor import UniProcExecutor
from ..ipc.messages import AbortRequests, AddRequest
from ..logger import init_logger
from ..outputs import RequestOutput
from ..transformers_utils.tokenizer import get_tokenizer
from .startup_trace import StartupTrace

logger = init_logger(__name__)

PromptType = str | dict[str, Any]


class LLM:
    """Generate text with a model. ``model=None`` uses the embedded default
    (SmolLM2-135M-Instruct); other keyword arguments are engine arguments
    (``dtype``, ``max_model_len``, ``block_size``, ``seed``, ``hf_overrides``, ...).

    ``generate`` drives the same engine loop (``EngineCore.step``) as the engine-core
    process of ``loom serve``, in the caller's thread, until its requests finish.

    ``startup_trace=FILE`` writes the start-up's phases (this process's, and those of the worker
    processes of ``tensor_parallel_size > 1``) to FILE as one Chrome trace, like
    ``loom serve --startup-trace``."""

    def __init__(self, model: str | None = None, *, startup_trace: str | os.PathLike[str] | None = None,
                 **kwargs: Any) -> None:
        valid = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
        unknown = sorted(set(kwargs) - valid)
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}; valid: {', '.join(sorted(valid))}")
        trace = StartupTrace(startup_trace, "llm", zero_ns=time.time_ns(), root="LLM() start-up until ready") \
            if startup_trace is not None else None
        try:
            self._start(model, kwargs)
        finally:
            if trace is not None:
                trace.finish(ready_ns=time.time_ns())

    def _start(self, model: str | None, kwargs: dict[str, Any]) -> None:
        self.config = EngineArgs(model=model, **kwargs).create_engine_config()
        with span("load tokenizer"):
            self.tokenizer = get_tokenizer(self.config.model_config)
        with span("start the executor: workers load, KV cache sized"):
            executor = self._executor()
        with span("build the engine"):
            self.llm_engine = LLMEngine(self.config, executor, self.tokenizer)
            self.engine_core = EngineCore(self.llm_engine)
        self._ids = itertools.count()
        envs.enable_envs_cache()
        logger.info("LLM is ready: %s", self.config.model_config.served_model_name)

    def _executor(self) -> Executor:
        executor: Executor
        if self.config.parallel_config.uses_ray:
            for key, value in RAY_DRIVER_ENV.items():
                os.environ.setdefault(key, value)  # before Ray is imported (if the caller has not)
            from ..engine.ray_executor import RayExecutor  # lazy: Ray is an optional dependency

            executor = RayExecutor(self.config)
        elif self.config.parallel_config.tensor_parallel_size > 1:
            # One worker process per rank, under the same supervisor as `loom serve`.
            from ..engine.supervised import SupervisedExecutor  # lazy: needs the optional loom_supervisor

            executor = SupervisedExecutor(self.config)
        else:
            executor = UniProcExecutor(self.config)
        return executor

    def shutdown(self) -> None:
        """Stop the engine and its worker processes (also done when the LLM is collected)."""
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            engine.shutdown()
            self.llm_engine = self.engine_core = None  # type: ignore[assignment]  # frees the model

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def _to_request(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            vocab = self.config.model_config.get_vocab_size()
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._to_request(prompt["prompt"])
        raise TypeError(f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one ``RequestOutput`` per prompt, in order.

        ``lora_request``: the adapter every prompt runs with, or one per prompt (None: the base
        model); the engine needs ``enable_lora=True``."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts; pass one or one per prompt")
        requests = [self._to_request(p) for p in prompts]  # validate all before adding any
        ids = [str(next(self._ids)) for _ in requests]
        adds = [AddRequest(request_id=i, prompt=text, prompt_token_ids=token_ids, sampling_params=params, stream=False,
                           lora_request=lora)
                for i, (text, token_ids), params, lora in zip(ids, requests, params_list, loras)]
        core = self.engine_core
        try:
            core.apply(adds, raise_errors=True)
        except BaseException:
            core.apply([AbortRequests(request_ids=ids)])  # all or nothing
            raise
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.llm_engine.has_unfinished_requests():
                report = core.step(raise_errors=True)
                if report is None:
                    continue
                for out in report.outputs:
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            core.apply([AbortRequests(request_ids=[i for i in ids if i not in finished])])  # leave the engine clean
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conversation in conversations:
            if getattr(self.tokenizer, "chat_template", None) is None and chat_template is None:
                raise ValueError("this model's tokenizer has no chat template; pass chat_template=...")
            ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                tokenize=True,
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

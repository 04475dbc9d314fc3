"""The engine-core process of ``loom serve``: scheduler, KV-cache manager, the step loop.

Start-up (stop 9): platform and general plugins again (a fresh interpreter), connect to
the supervisor, take the config, build the executor (it waits for every worker to load
and sizes the KV cache from the smallest offer), freeze the environment, READY. Then:
take requests from the front end, step while there is work, send each step's deltas.
"""

from __future__ import annotations

import sys
import time

from loom_plugin_api import load_general_plugins

from ..logger import init_logger

logger = init_logger("loom.engine_core")

_STATS_INTERVAL_S = 0.5


def main(argv: list[str] | None = None) -> int:
    from ..platforms import current_platform  # noqa: F401 - resolved first, in every process

    load_general_plugins()
    from .. import envs
    from ..ipc import messages as m
    from ..ipc.channel import Channel
    from ..transformers_utils.tokenizer import get_tokenizer
    from .llm_engine import EngineStepError, LLMEngine
    from .multiproc_executor import MultiprocExecutor

    channel = Channel("engine_core")
    config = channel.config()
    tokenizer = get_tokenizer(config.model_config)
    executor = MultiprocExecutor(config, channel)
    engine = LLMEngine(config, executor, tokenizer)
    envs.enable_envs_cache()
    channel.send("frontend", m.ENGINE_READY, m.EngineReady(num_blocks=executor.num_blocks,
                                                           block_size=config.cache_config.block_size))
    channel.ready()
    logger.info("Engine core is ready")
    last_stats = 0.0
    while True:
        # Block for work when idle; otherwise take what has arrived and step.
        busy = engine.has_unfinished_requests()
        messages = list(executor.pending)
        executor.pending.clear()
        msg = channel.recv(timeout=0 if (busy or messages) else None)
        while msg is not None:
            messages.append(msg)
            msg = channel.recv(timeout=0)
        errors: list[m.RequestError] = []
        for msg in messages:
            if msg.kind == m.ADD_REQUEST:
                req = msg.body
                try:
                    engine.add_request(req.request_id, req.prompt, req.prompt_token_ids, req.sampling_params,
                                       stream=req.stream)
                except ValueError as e:
                    errors.append(m.RequestError(request_id=req.request_id, message=str(e), status=400))
            elif msg.kind == m.ABORT:
                engine.abort_request(msg.body.request_ids)
        outputs = []
        if engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except EngineStepError as e:
                failed = e.request_ids
                errors.extend(m.RequestError(request_id=i, message=str(e), status=500) for i in failed)
        now = time.monotonic()
        stats = None
        if now - last_stats > _STATS_INTERVAL_S or not engine.has_unfinished_requests():
            stats = engine.get_stats()
            last_stats = now
        if outputs or errors or (stats is not None and messages):
            channel.send("frontend", m.OUTPUTS, m.EngineOutputs(outputs=outputs, errors=errors, stats=stats))


if __name__ == "__main__":
    sys.exit(main())

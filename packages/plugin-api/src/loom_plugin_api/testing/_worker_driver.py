"""The worker tier's driver, in its own interpreter (it imports loom-engine):
``python -m loom_plugin_api.testing._worker_driver MODEL_DIR SPEC.json EVENTS.jsonl``.

It drives the platform's worker through the lifecycle the engine drives, one stage at a
time, and appends one JSON line per stage to EVENTS (``{"stage", "ok", ...}``), so the
kit can say which stage failed. The steps are built here: a chunked prefill of one
request next to the full prefill of another, then decodes, all greedy.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from loom import platforms
from loom.engine.arg_utils import EngineArgs
from loom.engine.executor import num_blocks_for
from loom.worker.resolve import resolve_worker_cls
from loom.worker.services import EngineWorkerServices

from ..sampling_params import SamplingParams
from ..step import NewRequestData, ScheduledRequest, SchedulerOutput


class _Events:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, stage: str, **data: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"stage": stage, "ok": True, **data}) + "\n")

    def failed(self, stage: str, error: BaseException) -> None:
        with open(self.path, "a") as f:
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-3000:]
            f.write(
                json.dumps(
                    {
                        "stage": stage,
                        "ok": False,
                        "error": f"{type(error).__name__}: {error}",
                        "traceback": text,
                    }
                )
                + "\n"
            )


def _children() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return pids


def _run_steps(
    worker: Any,
    prompts: dict[str, list[int]],
    chunk: int,
    new_tokens: int,
    block_size: int,
    eos_token_id: int,
) -> dict[str, list[int]]:
    next_block = iter(range(1, 1 << 20))
    blocks: dict[str, list[int]] = {r: [] for r in prompts}
    computed = {r: 0 for r in prompts}
    outputs: dict[str, list[int]] = {r: [] for r in prompts}
    first, second = list(prompts)

    def scheduled(req: str, tokens: list[int], sample: bool) -> ScheduledRequest:
        while len(blocks[req]) * block_size < computed[req] + len(tokens):
            blocks[req].append(next(next_block))
        item = ScheduledRequest(
            req_id=req,
            token_ids=tokens,
            num_computed_tokens=computed[req],
            block_ids=list(blocks[req]),
            sample=sample,
            num_output_tokens=len(outputs[req]),
        )
        computed[req] += len(tokens)
        return item

    new = [
        NewRequestData(
            req_id=r,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=new_tokens),
            prompt_len=len(p),
            prompt_token_ids=list(p),
            eos_token_id=eos_token_id,
        )
        for r, p in prompts.items()
    ]
    steps = [
        SchedulerOutput(
            new_requests=new,
            scheduled=[
                scheduled(first, prompts[first][:chunk], False),
                scheduled(second, prompts[second], True),
            ],
        )
    ]
    finished: list[str] = []
    while True:
        step = steps.pop() if steps else None
        if step is None:
            work = []
            for req in prompts:
                if len(outputs[req]) >= new_tokens:
                    continue
                rest = (
                    prompts[req][computed[req] :] if computed[req] < len(prompts[req]) else [outputs[req][-1]]
                )
                work.append(scheduled(req, rest, True))
            if not work:
                break
            step = SchedulerOutput(scheduled=work, finished_req_ids=finished)
        output = worker.execute_model(step)
        finished = []
        for req, token in zip(output.req_ids, output.sampled_token_ids):
            outputs[req].append(int(token))
            if len(outputs[req]) == new_tokens:
                finished.append(req)
    return outputs


def main(model_dir: str, spec_path: str, events_path: str) -> int:
    current_platform = platforms.current_platform
    spec = json.loads(open(spec_path).read())
    event = _Events(events_path)
    stage = "config"
    try:
        config = EngineArgs(
            model=model_dir, dtype="float32", max_model_len=128, max_num_seqs=4, seed=0, enforce_eager=True
        ).create_engine_config()
        event(
            stage, worker_cls=config.parallel_config.worker_cls, platform=type(current_platform).__qualname__
        )
        stage = "init"
        current_platform.register_triton_kernel_overrides()
        worker = resolve_worker_cls(config.parallel_config.worker_cls)(
            config,
            local_rank=0,
            rank=0,
            distributed_init_method=None,
            is_driver_worker=True,
            services=EngineWorkerServices(),
        )
        worker.init_device()
        event(stage)
        stage = "load_model"
        worker.load_model()
        current_platform.update_block_size_for_backend(config)
        event(stage, block_size=config.cache_config.block_size)
        stage = "determine_available_memory"
        available = worker.determine_available_memory()
        if not isinstance(available, int) or available <= 0:
            raise ValueError(
                f"determine_available_memory() returned {available!r}; it must return a positive int "
                "(bytes the KV cache may take)"
            )
        block_bytes = worker.get_kv_cache_block_bytes()
        if not isinstance(block_bytes, int) or block_bytes <= 0:
            raise ValueError(
                f"get_kv_cache_block_bytes() returned {block_bytes!r}; it must be a positive int"
            )
        event(stage, available=available, block_bytes=block_bytes)
        stage = "initialize_cache"
        num_blocks = num_blocks_for(config, available, block_bytes)
        config.cache_config.num_blocks = num_blocks
        worker.initialize_cache(num_blocks)
        event(stage, num_blocks=num_blocks)
        stage = "execute_model"
        tokens = _run_steps(
            worker,
            spec["prompts"],
            spec["chunk"],
            spec["new_tokens"],
            config.cache_config.block_size,
            spec["eos_token_id"],
        )
        event(stage, tokens=tokens)
        stage = "shutdown"
        worker.shutdown()
        event(stage, children=_children())
    except BaseException as e:
        event.failed(stage, e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))

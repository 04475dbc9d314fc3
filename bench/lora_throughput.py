"""Multi-LoRA offline throughput: loom.LLM with 0, 1, 4 and 8 distinct adapters in one batch.

The offline benchmark's workload (defaults: 64 prompts, 128 input and 64 output tokens, greedy,
EOS ignored; ``offline_throughput.workload``) on one model, in these configurations:

* ``base``          LoRA off;
* ``0 (slots on)``  ``enable_lora=True`` but no request names an adapter: the cost of the slots alone;
* ``1``, ``4``, ``8`` that many distinct adapters (PEFT, rank 16, every attention and MLP projection:
  Llama q/k/v/o/gate/up/down_proj, OPT q/k/v/out_proj, fc1, fc2), the requests assigned to them
  round-robin, ``max_loras`` = the count so that all of them run in the same steps.

Models:

* ``tiny``      the 2-layer random Llama of the tests (``tiny_models.build_tiny_model``, hidden 64,
  GPT-2's vocabulary; serve_startup's ``tiny``): the LoRA op's per-call cost against tiny GEMMs
* ``opt-125m``  a random-weight model of OPT-125m's shape (``offline_throughput.build_random_model``)
* ``opt-2m``, ``smollm2-shape``  offline_throughput's other random shapes

    python bench/lora_throughput.py --models tiny opt-125m
    python bench/lora_throughput.py --models tiny --quick
    python bench/lora_throughput.py --models opt-125m --adapters 8 --repeats 5 --profile

Each configuration gets its own engine and one warm-up generate (one short request per adapter,
so the adapters are loaded and in their slots before the clock starts); all engines stay up and
take turns at ``--repeats`` timed generates, in a rotating order, so that load from elsewhere on a
shared machine lands on every configuration alike. Each timed generate has new prompts (the prefix
cache cannot help); every configuration gets the same prompt sets. The figure is the median output
tok/s; ratio = that / base's, cost = 1 - ratio. "cores busy" is this process's CPU seconds per
second of a run: a run below 85% of the thread count shared the cores with other work (its
threads wait for each other at every op; runs 10x slower were seen) and is run again with new
prompts, up to ``--retries`` times ("retried"). "differ" counts the requests of the first timed run
whose tokens are not base's: 0 with the slots alone, most of them with adapters (a check that the
adapters are applied at all). A tiny-shape run lasts about a second and varied by +-20% on a
shared 2-core VM even with its cores to itself: read its costs from --repeats 5 or more.

The goal (the multi-LoRA issue): 8 adapters cost under 30% of base throughput on the tiny and the
OPT-125m shapes; the script says whether this run meets it. ``--profile`` then runs the workload
once more for base and the largest adapter count under ``torch.profiler`` and prints the LoRA
code's self CPU time (``LoRASlots.forward`` around the ``BatchedLoRA`` op, per linear layer, and
``LoRAModelManager.prepare``, per step) by op, per call, and the largest changes outside it.

Base models and adapters are built once into ``--cache-dir`` (default ``$LOOM_CACHE_DIR/bench-lora``,
else ``/tmp/loom/bench-lora``) and reused; delete it after changing a shape or the adapters' recipe.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from offline_throughput import SHAPES, build_random_model, workload  # noqa: E402
from roofline import machine  # noqa: E402

CONTENDED = 0.85  # a run whose process got under this share of its threads' CPU time is run again
GOAL_ADAPTERS, GOAL_COST = 8, 0.30  # the bar: 8 adapters cost under 30% of base throughput
GOAL_MODELS = ("tiny", "opt-125m")
ADAPTER_STD = 0.05  # A and B entries: large enough to change greedy tokens, small enough to stay finite


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return ", ".join(f.read().split()[:3])


def cache_root() -> str:
    return os.path.join(os.environ.get("LOOM_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "loom"),
                        "bench-lora")


def _build_once(path: str, build: Any) -> str:
    """``path``, made by ``build(tmp_dir)`` into a sibling and renamed, unless it exists already
    (an interrupted build leaves no half-written model or adapter behind)."""
    if os.path.isdir(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}-")
    try:
        os.rename(build(tmp), path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def base_model(name: str, cache: str) -> str:
    def build(tmp: str) -> str:
        if name == "tiny":
            from tiny_models import build_tiny_model

            return str(build_tiny_model(Path(tmp) / name, "llama", tie=False))
        return build_random_model(name, tmp)

    return _build_once(os.path.join(cache, name), build)


def adapters(model: str, name: str, count: int, rank: int, cache: str) -> list[str]:
    """``count`` random PEFT adapters of ``model`` (seeds 1..count), every attention and MLP projection."""
    from lora_utils import LLAMA_TARGETS, OPT_TARGETS, build_adapter

    with open(os.path.join(model, "config.json")) as f:
        targets = {"llama": LLAMA_TARGETS, "opt": OPT_TARGETS}[json.load(f)["model_type"]]
    paths = []
    for i in range(1, count + 1):
        def build(tmp: str, seed: int = i) -> str:
            out = Path(tmp) / "adapter"
            build_adapter(Path(model), out, targets, r=rank, alpha=2 * rank, seed=seed, std=ADAPTER_STD)
            return str(out)

        paths.append(_build_once(os.path.join(cache, f"{name}-adapters", f"r{rank}-{i}"), build))
    return paths


class Config:
    """One configuration (``n``: None = LoRA off, else that many adapters) on its own engine."""

    def __init__(self, label: str, model: str, n: int | None, paths: list[str], args: argparse.Namespace,
                 kv_bytes: int) -> None:
        from loom import LLM, SamplingParams
        from loom_plugin_api import LoRARequest

        engine: dict[str, Any] = dict(dtype=args.dtype, max_model_len=max(args.input_len + args.output_len, 512),
                                      kv_cache_memory_bytes=kv_bytes)
        if n is not None:
            engine.update(enable_lora=True, max_loras=max(n, 1), max_lora_rank=args.rank)
        self.label, self.n = label, n
        self.llm = LLM(model, **engine)
        self.dtype = str(self.llm.config.model_config.dtype)
        self.loras = [LoRARequest(f"a{i}", i, paths[i - 1]) for i in range(1, (n or 0) + 1)]
        self.params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        self.rates: list[float] = []
        self.discarded = 0
        self.cores: list[float] = []
        """CPU seconds of this process per second of each timed run: below the thread count when
        other processes took the cores (such a run is retried, ``timed``)."""
        self.tokens: list[list[int]] | None = None
        self.ops: Counter[tuple[str, str]] | None = None
        self.calls: Counter[str] | None = None

    def generate(self, prompts: list[list[int]], params: Any = None) -> list[Any]:
        loras = [self.loras[i % len(self.loras)] for i in range(len(prompts))] if self.loras else None
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params or self.params,
                                 lora_request=loras)

    def warm_up(self, prompts: list[list[int]]) -> None:
        """A short request per adapter: the adapters load into their slots before any timed run."""
        from loom import SamplingParams

        self.generate([p[:8] for p in prompts[: max(len(self.loras), 1)]], SamplingParams(max_tokens=2))

    def timed(self, prompt_set: Any, retries: int) -> None:
        """One timed run on ``prompt_set(0)``; run again on ``prompt_set(1)``, ... (new prompts: the
        prefix cache holds the last ones) while other work took this process's cores."""
        for attempt in range(retries + 1):
            start, cpu = time.perf_counter(), time.process_time()
            outs = self.generate(prompt_set(attempt))
            elapsed = time.perf_counter() - start
            cores = (time.process_time() - cpu) / elapsed
            if self.tokens is None:  # the first run's tokens, the same prompts in every configuration
                self.tokens = [list(o.outputs[0].token_ids) for o in outs]
            if cores >= CONTENDED * torch.get_num_threads() or attempt == retries:
                break
            self.discarded += 1
        self.rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
        self.cores.append(cores)

    def profiled(self, prompts: list[list[int]]) -> None:
        """One more run under torch.profiler: ``ops`` gets the self CPU µs per (LoRA scope the op ran
        in, or ``OUTSIDE``; op name, ``PYTHON`` for a scope's own time), ``calls`` the scopes' calls."""
        from torch.profiler import ProfilerActivity, profile, record_function

        with scoped(), profile(activities=[ProfilerActivity.CPU]) as prof, record_function(GENERATE):
            self.generate(prompts)
        self.ops, self.calls = Counter(), Counter()
        labels = set(SCOPES.values())
        for e in prof.events():
            node = e
            while node is not None and node.name not in labels:
                node = node.cpu_parent
            if e.name in labels:
                self.calls[e.name] += 1
            scope = OUTSIDE if node is None else node.name
            self.ops[scope, PYTHON if e is node else e.name] += e.self_cpu_time_total

    @property
    def tok_s(self) -> float:
        return statistics.median(self.rates)


OUTSIDE, PYTHON = "outside the LoRA code", "(Python)"
GENERATE = "LLM.generate's Python (outside any op)"
SCOPES = {("loom.lora.manager", "LoRAModelManager", "prepare"): "lora: manager.prepare (per step)",
          ("loom.lora.layers", "LoRASlots", "forward"): "lora: LoRASlots.forward (per linear)"}


@contextlib.contextmanager
def scoped() -> Iterator[None]:
    """Name the LoRA code's calls in the profile (``record_function`` around each of ``SCOPES``)."""
    from torch.profiler import record_function

    patched = []
    for (module, cls_name, attr), label in SCOPES.items():
        cls = getattr(importlib.import_module(module), cls_name)
        fn = cls.__dict__[attr]

        def wrapper(*a: Any, _fn: Any = fn, _label: str = label, **kw: Any) -> Any:
            with record_function(_label):
                return _fn(*a, **kw)

        setattr(cls, attr, wrapper)
        patched.append((cls, attr, fn))
    try:
        yield
    finally:
        for cls, attr, fn in patched:
            setattr(cls, attr, fn)


def kv_cache_bytes(model: str, args: argparse.Namespace) -> int:
    """Room for the whole batch at full length, in fp32 (the engines share this machine's memory:
    the CPU default, 4 GiB each, would not fit five OPT-125m engines at once)."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * cfg["hidden_size"] // heads * 4
    return int(1.25 * per_token * args.num_prompts * (args.input_len + args.output_len + 16))


def print_profile(name: str, base: Config, lora: Config, top: int) -> None:
    """The LoRA code's self CPU time in the profiled generate, by op, and the largest changes outside it."""
    assert base.ops is not None and lora.ops is not None and lora.calls is not None
    total_b, total_l = sum(base.ops.values()) / 1e3, sum(lora.ops.values()) / 1e3
    inside = sorted(((t, scope, op) for (scope, op), t in lora.ops.items() if scope != OUTSIDE), reverse=True)
    lora_ms = sum(t for t, *_ in inside) / 1e3
    outside_b = sum(t for (scope, _), t in base.ops.items() if scope == OUTSIDE) / 1e3
    calls = ", ".join(f"{lora.calls[label]:,} calls of {label}" for label in SCOPES.values())
    print(f"\n### {name}: the LoRA code's time, {lora.n} adapters (one more generate of the workload under "
          f"torch.profiler)\n\nSelf CPU time of the generate: base {total_b:,.0f} ms; {lora.n} adapters "
          f"{total_l:,.0f} ms, of which {lora_ms:,.0f} ms ({lora_ms / total_l:.0%}) in the LoRA code ({calls}) "
          f"and {total_l - lora_ms:,.0f} ms outside it (base: {outside_b:,.0f}; the difference is noise or an "
          f"indirect cost). `{PYTHON}` is a scope's own time.\n\n| scope | op | ms | share of the LoRA code | "
          "µs per call of the scope |\n|---|---|---|---|---|")
    for t, scope, op in inside[:top]:
        print(f"| {scope} | {op} | {t / 1e3:,.1f} | {t / 1e3 / lora_ms:.0%} | {t / lora.calls[scope]:,.1f} |")
    changes = sorted(((lora.ops[OUTSIDE, op] - base.ops[OUTSIDE, op], op) for scope, op in {*base.ops, *lora.ops}
                      if scope == OUTSIDE), key=lambda d: -abs(d[0]))
    print(f"\nOutside the LoRA code, the largest changes from base (ms): "
          f"{', '.join(f'{op} {d / 1e3:+,.0f}' for d, op in changes[:5])}")


def run_model(name: str, args: argparse.Namespace) -> list[tuple[str, float, str]]:
    cache = args.cache_dir
    model = base_model(name, cache)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    counts = sorted(set(args.adapters))
    paths = adapters(model, name, max([*counts, 0]), args.rank, cache)
    def prompt_set(r: int, attempt: int = 0) -> list[list[int]]:  # run r's prompts, new ones for a retry
        return workload(args.num_prompts, args.input_len, vocab, args.seed + r + 1000 * attempt)

    biggest = max([c for c in counts if c > 0], default=None)
    kv_bytes = kv_cache_bytes(model, args)
    configs = [Config("base", model, None, paths, args, kv_bytes)] + [
        Config("0 (slots on)" if c == 0 else str(c), model, c, paths, args, kv_bytes) for c in counts]
    for c in configs:
        c.warm_up(prompt_set(0))
    # Every engine stays up and the timed runs take turns, in a rotating order: load from
    # elsewhere on a shared machine lands on every configuration alike, not on whichever ran then.
    for r in range(args.repeats):
        for c in configs[r % len(configs):] + configs[: r % len(configs)]:
            c.timed(functools.partial(prompt_set, r), args.retries)
            print(f"{name} {c.label}, run {r + 1}: {c.rates[-1]:,.0f} output tok/s, "
                  f"{c.cores[-1]:.2f} cores busy ({c.discarded} runs retried so far)", flush=True)
    if args.profile and biggest is not None:
        for c in configs:
            if c.n in (None, biggest):
                c.profiled(prompt_set(args.repeats))
    for c in configs:
        c.llm.shutdown()
    base = configs[0]
    assert base.tokens is not None
    print(f"\n## {name} ({base.dtype}), {args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out), "
          f"rank {args.rank}, median of {args.repeats}\n\n| adapters | tok/s | ratio to base | cost | differ | "
          "runs, tok/s | cores busy, least | retried |\n|---|---|---|---|---|---|---|---|")
    for c in configs:
        ratio = c.tok_s / base.tok_s
        differ = sum(a != b for a, b in zip(c.tokens or [], base.tokens))
        shown = "-" if c is base else f"{differ}/{len(base.tokens)}"
        runs = " / ".join(f"{x:,.0f}" for x in c.rates)
        print(f"| {c.label} | {c.tok_s:,.0f} | {ratio:.2f} | {1 - ratio:.0%} | {shown} | {runs} | "
              f"{min(c.cores):.2f} | {c.discarded} |")
    if args.profile and biggest is not None:
        print_profile(name, base, next(c for c in configs if c.n == biggest), args.top)
    return [(c.label, 1 - c.tok_s / base.tok_s, base.dtype) for c in configs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", "--model", nargs="+", default=list(GOAL_MODELS), choices=["tiny", *SHAPES])
    parser.add_argument("--adapters", nargs="+", type=int, default=[0, 1, 4, 8],
                        help="adapter counts besides base (0: LoRA on, no adapter named)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration; the median counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--retries", type=int, default=3,
                        help=f"runs again (new prompts) a timed run during which this process got under "
                             f"{CONTENDED * 100:.0f}%% of its threads' CPU time: another process shared the cores")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: loom's default (bf16 on a CPU with native bf16, else fp32)")
    parser.add_argument("--quick", action="store_true", help="16 prompts x (32 in, 16 out), 1 run each: a smoke test")
    parser.add_argument("--profile", action="store_true",
                        help="profile base and the largest adapter count once more; print the ops' extra time")
    parser.add_argument("--top", type=int, default=15, help="rows of the --profile table")
    parser.add_argument("--cache-dir", default=cache_root(), help="where base models and adapters are kept")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.input_len, args.output_len, args.repeats = 16, 32, 16, 1
    if any(c < 0 for c in args.adapters) or args.repeats < 1:
        parser.error("--adapters must be >= 0 and --repeats >= 1")
    print(f"# loom multi-LoRA throughput, {datetime.datetime.now():%Y-%m-%d %H:%M}\n\n`python {shlex.join(sys.argv)}`"
          f"\n\n{machine(args.dtype)}; {args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out), "
          f"greedy, EOS ignored; adapters of rank {args.rank} on every attention and MLP projection; "
          f"cache {args.cache_dir}; load average {load_average()}\n", flush=True)
    costs = {name: run_model(name, args) for name in args.models}
    print(f"\n| model | dtype | {' | '.join(f'cost, {label}' for label, _, _ in next(iter(costs.values())))} |\n"
          f"|---|---|{'---|' * len(next(iter(costs.values())))}")
    for name, rows in costs.items():
        print(f"| {name} | {rows[0][2]} | {' | '.join(f'{c:.0%}' for _, c, _ in rows)} |")
    goal = {name: c for name, rows in costs.items() for label, c, _ in rows if label == str(GOAL_ADAPTERS)}
    for name in GOAL_MODELS:
        if name in goal:
            met = "meets" if goal[name] < GOAL_COST else "misses"
            print(f"goal ({GOAL_ADAPTERS} adapters cost < {GOAL_COST:.0%} of base tok/s) on {name}: {met} it, "
                  f"cost {goal[name]:.0%}")
        elif name in costs:
            print(f"goal on {name}: not measured (--adapters lacks {GOAL_ADAPTERS})")
    print(f"load average at the end: {load_average()} (1, 5, 15 min; this run adds up to its thread count)")


if __name__ == "__main__":
    main()

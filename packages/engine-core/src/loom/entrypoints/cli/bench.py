"""``loom bench offline|serve|startup``: loom's figures on fixed workloads (loom.benchmarks).

Each mode prints a table, and with ``--json FILE`` saves every raw measurement (per request,
per run, the config and the machine), with ``--plot FILE.png`` a figure (needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from ...benchmarks import offline, plots, serve, startup
from ...benchmarks.report import check_output, machine_info, write_json
from ...benchmarks.trace import Span
from ...benchmarks.workloads import CONCURRENCY, STARTUP_RUNS, Workload
from ...config.cache import KV_CACHE_DTYPES
from ...config.model import QUANTIZATIONS
from ...config.server import positive_int
from ...transformers_utils.config import resolve_model_path

# The engine flags a benchmark passes on (to loom.LLM, or to `loom serve` as --flag=value); unset: the default.
ENGINE_FLAGS = ("dtype", "max_model_len", "quantization", "kv_cache_dtype", "tensor_parallel_size", "max_num_seqs",
                "max_num_batched_tokens")
DEFAULT = Workload()
EPILOG = f"""workload: {DEFAULT.describe()} (loom.benchmarks.workloads)
  loom bench offline [MODEL]        loom.LLM in this process: output and total tok/s
  loom bench serve [MODEL]          a loom serve on a free port (or --url): tok/s, TTFT, TPOT per concurrency
  loom bench startup [MODEL]        launches of loom serve: time to /health 200, process-tree RSS, trace
MODEL: a model path; default: the embedded SmolLM2-135M-Instruct, as for loom serve."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="measure loom on fixed workloads: offline, serve, startup",
                                   description=__doc__, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="bench_mode", metavar="MODE", required=True)
    p = _mode(modes, "offline", "loom.LLM in this process, every prompt at once: output and total tok/s",
              offline.__doc__)
    _workload_flags(p)
    p.add_argument("--runs", type=positive_int, default=1, help="timed generate calls after the warm-up (default 1)")
    p = _mode(modes, "serve", "stream from a loom serve at each concurrency: tok/s, TTFT, TPOT, tree RSS",
              serve.__doc__)
    _workload_flags(p)
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=list(CONCURRENCY),
                   help=f"requests in flight, one level each (default {' '.join(map(str, CONCURRENCY))})")
    p.add_argument("--url", default=None, help="bench a server already running here instead of launching one")
    p.add_argument("--api-key", default=None, help="the key of the --url server, sent as a bearer token")
    _serve_arg_flag(p)
    p = _mode(modes, "startup", "launch loom serve again and again: time to /health 200, tree RSS, trace",
              startup.__doc__)
    p.add_argument("--runs", type=positive_int, default=STARTUP_RUNS,
                   help=f"counted launches after one warm-up launch (default {STARTUP_RUNS})")
    p.add_argument("--no-trace", action="store_true", help="do not pass --startup-trace to loom serve")
    _serve_arg_flag(p)
    return parser


def _mode(modes: argparse._SubParsersAction, name: str, help_text: str, doc: str | None) -> argparse.ArgumentParser:
    p = modes.add_parser(name, help=help_text, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--json", metavar="FILE", default=None, help="write every raw measurement to FILE")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="draw the figure into FILE.png (matplotlib)")
    engine = p.add_argument_group("engine (unset: loom's default)")
    engine.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    engine.add_argument("--max-model-len", type=positive_int, default=None)
    engine.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS))
    engine.add_argument("--kv-cache-dtype", default=None, choices=list(KV_CACHE_DTYPES))
    engine.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=None)
    engine.add_argument("--max-num-seqs", type=positive_int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    return p


def _workload_flags(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=positive_int, default=DEFAULT.num_prompts)
    w.add_argument("--input-len", type=positive_int, default=DEFAULT.input_len, help="prompt tokens per request")
    w.add_argument("--output-len", type=positive_int, default=DEFAULT.output_len, help="output tokens per request")
    w.add_argument("--seed", type=int, default=DEFAULT.seed, help="seed of the prompts' random token ids")


def _serve_arg_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="another flag for loom serve, as one word (repeatable): --serve-arg=--stream-interval=8")


def run(args: argparse.Namespace) -> int:
    _check(args)
    workload = Workload(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                        seed=args.seed) if args.bench_mode != "startup" else None
    machine = machine_info()
    log_dir = tempfile.mkdtemp(prefix="loom-bench-")  # loom serve's logs (and start-up traces)
    try:
        results = MODES[args.bench_mode](args, workload, log_dir)
    except BaseException:
        if not os.listdir(log_dir):  # else kept: the error names the log in it
            os.rmdir(log_dir)
        raise
    shutil.rmtree(log_dir, ignore_errors=True)
    title = [f"loom bench {args.bench_mode}: {args.model or getattr(args, 'url', None) or 'the default model'}"]
    if workload is not None:
        title.append(workload.describe())
    print("; ".join(title))
    print(TABLES[args.bench_mode](results))
    if args.json:
        write_json(args.json, {"mode": args.bench_mode, "config": _config(args),
                               "workload": dataclasses.asdict(workload) if workload else None,
                               "machine": machine, "results": results})
        print(f"measurements: {args.json}")
    if args.plot:
        title.append(f"{machine['cpu']}, {machine['cpus_usable']} CPUs, loom {machine['loom']}, {machine['date']}")
        PLOTS[args.bench_mode](results, "\n".join(title), args.plot)
        print(f"plot: {args.plot}")
    return 0


def _check(args: argparse.Namespace) -> None:
    """What can be wrong before a run that may take minutes: each a one-line error."""
    check_output(args.json, "--json")
    check_output(args.plot, "--plot")
    if args.plot:
        plots.require_matplotlib()
    if getattr(args, "url", None) is None:
        resolve_model_path(args.model)  # a missing model or the default one not installed
        return
    given = [f"--{k.replace('_', '-')}" for k in ENGINE_FLAGS if getattr(args, k) is not None]
    if args.model is not None or given or args.serve_arg:
        raise ValueError("--url benches the server already running there: leave out MODEL, "
                         f"{', '.join(given) or 'the engine flags'} and --serve-arg")


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}


def _serve_argv(args: argparse.Namespace) -> list[str]:
    model = [os.path.abspath(os.path.expanduser(args.model))] if args.model else []
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in _engine_kwargs(args).items()]
    return [*model, *flags, *args.serve_arg]


def _run_offline(args: argparse.Namespace, workload: Workload, log_dir: str) -> dict[str, Any]:
    return offline.run(args.model, workload, _engine_kwargs(args), runs=args.runs)


def _run_serve(args: argparse.Namespace, workload: Workload, log_dir: str) -> dict[str, Any]:
    return serve.run(workload, args.concurrency, serve_args=None if args.url else _serve_argv(args), url=args.url,
                     api_key=args.api_key, log_dir=log_dir)


def _run_startup(args: argparse.Namespace, workload: None, log_dir: str) -> dict[str, Any]:
    return startup.run(_serve_argv(args), args.runs, trace=not args.no_trace, log_dir=log_dir)


def _plot_startup(results: dict[str, Any], title: str, path: str) -> None:
    ready = results["runs"][results["median_run"]]["time_to_ready_s"]
    spans = startup.spans_of(results) or [Span(process="loom serve", pid=0, name="launch -> /health 200 (no trace)",
                                               start_s=0.0, dur_s=ready, depth=0)]
    plots.plot_startup(spans, ready, f"{title}\nstart-up of run {results['median_run']} (the median)", path)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "subcommand"} | {"python": sys.executable}


MODES: dict[str, Callable[..., dict[str, Any]]] = {
    "offline": _run_offline, "serve": _run_serve, "startup": _run_startup,
}
TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "offline": offline.table, "serve": serve.table, "startup": startup.table,
}
PLOTS: dict[str, Callable[[dict[str, Any], str, str], None]] = {
    "offline": plots.plot_offline, "serve": plots.plot_serve, "startup": _plot_startup,
}

"""What a serve measures: stat-logger plugins (engine side) and Prometheus metrics (HTTP side).

Two consumers, two shapes:

* **Stat loggers** see :class:`~loom.stats.EngineStats` after every engine
  step. Built-ins and ``loom.stat_logger_plugins`` entry points are factories
  ``(config: LoomConfig) -> logger``; the logger has ``record(stats)`` and may have
  ``log()`` (called every ``log_stats_interval`` seconds while the engine is busy). The
  engine client (``loom.engine.client.EngineClient``)
  builds them once, with :func:`load_stat_loggers`.
* **ServerMetrics** is the front end's Prometheus registry: per-request counters and
  latency histograms that the OpenAI handlers observe, and gauges read from the engine's
  latest stats when ``/metrics`` is scraped. Each app owns its own ``CollectorRegistry``,
  so several apps can live in one process (tests) without name clashes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from loom_plugin_api import STAT_LOGGER_PLUGINS_GROUP, PluginError, load_plugins_strict
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from .logger import init_logger

if TYPE_CHECKING:
    from .config import LoomConfig
    from .stats import EngineStats

logger = init_logger(__name__)

__all__ = ["LoggingStatLogger", "ServerMetrics", "StatLogger", "load_stat_loggers"]


@runtime_checkable
class StatLogger(Protocol):
    """What a stat-logger factory must return. ``log()`` is optional."""

    def record(self, stats: EngineStats) -> None: ...


class LoggingStatLogger:
    """The built-in logger: one INFO line of throughput and queue state per interval of activity."""

    def __init__(self, config: LoomConfig | None = None) -> None:
        self._last: EngineStats | None = None
        self._logged: EngineStats | None = None
        self._logged_at = time.monotonic()

    def record(self, stats: EngineStats) -> None:
        self._last = stats

    def log(self) -> None:
        now, stats, prev = time.monotonic(), self._last, self._logged
        if stats is None or (prev is not None and _same_activity(prev, stats)):
            return
        elapsed = max(now - self._logged_at, 1e-6)
        prompt = stats.num_prompt_tokens - (prev.num_prompt_tokens if prev else 0)
        gen = stats.num_generation_tokens - (prev.num_generation_tokens if prev else 0)
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, avg generation throughput: %.1f tokens/s, "
            "running: %d reqs, waiting: %d reqs, KV-cache usage: %.1f%%, prefix-cache hit rate: %.1f%%",
            prompt / elapsed, gen / elapsed, stats.num_running, stats.num_waiting,
            100 * stats.kv_cache_usage, 100 * stats.prefix_cache_hit_rate,
        )
        self._logged, self._logged_at = stats, now


def _same_activity(a: EngineStats, b: EngineStats) -> bool:
    return (a.num_prompt_tokens, a.num_generation_tokens, a.num_running, a.num_waiting) == (
        b.num_prompt_tokens, b.num_generation_tokens, b.num_running, b.num_waiting)


def load_stat_loggers(config: LoomConfig, *, builtin: bool = True) -> list[Any]:
    """Build the stat loggers of this serve: the built-in one, then one per plugin factory.

    Call once per engine client (each factory is called once). A plugin that fails to
    import, a factory that raises, and a factory whose product has no ``record`` method
    are errors that name the plugin: a serve does not start with a broken logger.
    """
    factories: dict[str, Callable[..., Any]] = {}
    if builtin:
        factories["logging (built-in)"] = LoggingStatLogger
    plugins = load_plugins_strict(STAT_LOGGER_PLUGINS_GROUP, kind="stat-logger")
    factories.update(plugins)
    loggers = []
    for name, factory in factories.items():
        try:
            stat_logger = factory(config)
        except Exception as e:
            raise PluginError(
                f"stat-logger plugin {name!r} ({_qualname(factory)}) raised {type(e).__name__}: {e} "
                "when called with the config"
            ) from e
        if not callable(getattr(stat_logger, "record", None)):
            raise TypeError(
                f"stat-logger plugin {name!r} ({_qualname(factory)}) returned a {type(stat_logger).__name__}, "
                "which has no record(stats) method; a factory in group "
                f"{STAT_LOGGER_PLUGINS_GROUP} must return an object with record(stats) and optionally log()"
            )
        loggers.append(stat_logger)
    if plugins:
        logger.info("Stat loggers: %s", ", ".join(factories))
    return loggers


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__name__)}"


# ---- Prometheus ------------------------------------------------------------------------------
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0]
_TPOT_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_E2E_BUCKETS = [0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class ServerMetrics:
    """The front end's Prometheus metrics, in a registry of their own (``self.registry``).

    Names follow vLLM's with a ``loom:`` prefix and a ``model_name`` label, so vLLM
    dashboards map one to one.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        reg = {"registry": self.registry}
        self.request_success = Counter(
            "loom:request_success", "Completions finished, by finish reason (n per request).",
            labels + ["finished_reason"], **reg)
        self.prompt_tokens = Counter("loom:prompt_tokens", "Prompt tokens of accepted requests.", labels, **reg)
        self.generation_tokens = Counter("loom:generation_tokens", "Generated tokens.", labels, **reg)
        self.ttft = Histogram("loom:time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=_TTFT_BUCKETS, **reg)
        self.tpot = Histogram("loom:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              labels, buckets=_TPOT_BUCKETS, **reg)
        self.e2e = Histogram("loom:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=_E2E_BUCKETS, **reg)
        self.kv_cache_usage = Gauge("loom:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                                    labels, **reg)
        self.num_running = Gauge("loom:num_requests_running", "Requests in the running batch.", labels, **reg)
        self.num_waiting = Gauge("loom:num_requests_waiting", "Requests waiting to be scheduled.", labels, **reg)
        self.prefix_cache_hit_rate = Gauge("loom:prefix_cache_hit_rate",
                                           "Prompt tokens found in the prefix cache / looked up.", labels, **reg)
        self.num_preemptions = Gauge("loom:num_preemptions", "Preemptions since start.", labels, **reg)
        self._model = model_name
        # Touch every label set so each metric is exported (at zero) before its first event.
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e,
                       self.kv_cache_usage, self.num_running, self.num_waiting, self.prefix_cache_hit_rate,
                       self.num_preemptions):
            metric.labels(model_name)

    def observe_request(self, *, num_prompt_tokens: int, num_generation_tokens: int,
                        finish_reasons: list[str], ttft: float | None, e2e: float) -> None:
        """One request ended (any way): its tokens, finish reasons and latencies."""
        m = self._model
        self.prompt_tokens.labels(m).inc(num_prompt_tokens)
        self.generation_tokens.labels(m).inc(num_generation_tokens)
        for reason in finish_reasons:
            self.request_success.labels(m, reason).inc()
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
            if num_generation_tokens > len(finish_reasons):
                # per completion, tokens after the first are spread over e2e - ttft
                self.tpot.labels(m).observe((e2e - ttft) * len(finish_reasons)
                                            / (num_generation_tokens - len(finish_reasons)))
        self.e2e.labels(m).observe(e2e)

    def update_engine_stats(self, stats: EngineStats | None) -> None:
        if stats is None:
            return
        m = self._model
        self.kv_cache_usage.labels(m).set(stats.kv_cache_usage)
        self.num_running.labels(m).set(stats.num_running)
        self.num_waiting.labels(m).set(stats.num_waiting)
        self.prefix_cache_hit_rate.labels(m).set(stats.prefix_cache_hit_rate)
        self.num_preemptions.labels(m).set(stats.num_preemptions)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

"""``--plot FILE.png``: one figure per mode, drawn with matplotlib (Agg, imported only here).

* offline: output and total tokens a second, a pair of bars per timed run;
* serve:   output tok/s against concurrency, then the TTFT and TPOT distributions per level;
* startup: the start-up timeline as a Gantt chart, one row per process, each span a bar at its
  depth (nested spans thinner and on top), with a line where ``/health`` first answered 200.
"""

from __future__ import annotations

from typing import Any

from .trace import Span, processes

INSTALL = "pip install matplotlib (or pip install 'loom-engine[bench]')"


def require_matplotlib() -> None:
    """Raise a one-line ImportError naming the fix when matplotlib is missing (before a run)."""
    try:
        import matplotlib  # noqa: F401  # optional dependency: only --plot needs it
    except ImportError:
        raise ImportError(f"--plot needs matplotlib: {INSTALL}") from None


def _pyplot() -> Any:
    require_matplotlib()
    import matplotlib  # optional dependency: only --plot needs it

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt  # optional dependency, after the backend is chosen

    return plt


def plot_offline(results: dict[str, Any], title: str, path: str) -> None:
    plt = _pyplot()
    runs = results["runs"]
    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 * len(runs) + 2), 4.5))
    xs = list(range(len(runs)))
    ax.bar([x - 0.2 for x in xs], [r["output_tok_s"] for r in runs], width=0.4, label="output tok/s")
    ax.bar([x + 0.2 for x in xs], [r["total_tok_s"] for r in runs], width=0.4, label="total tok/s (prompt + output)")
    ax.set_xticks(xs, [f"run {i + 1}" for i in xs])
    ax.set_ylim(0, 1.3 * max(r["total_tok_s"] for r in runs))  # room for the legend above the bars
    ax.set_ylabel("tokens / s")
    ax.legend(loc="upper left", fontsize=8)
    _save(plt, fig, title, path)


def plot_serve(results: dict[str, Any], title: str, path: str) -> None:
    plt = _pyplot()
    levels = results["levels"]
    labels = [str(level["concurrency"]) for level in levels]
    fig, (tput, ttft, tpot) = plt.subplots(1, 3, figsize=(15, 4.5))
    concurrency = [level["concurrency"] for level in levels]
    tput.plot(concurrency, [level["output_tok_s"] for level in levels], marker="o")
    tput.set_xscale("log", base=2)
    tput.set_xticks(concurrency, labels)
    tput.minorticks_off()
    tput.set_ylim(bottom=0)
    tput.set(xlabel="concurrency (requests in flight)", ylabel="output tok/s", title="throughput")
    for ax, key, name in ((ttft, "ttft_s", "TTFT"), (tpot, "tpot_s", "TPOT")):
        data = [[v * 1e3 for v in level[key] if v is not None] or [float("nan")] for level in levels]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(labels) + 1), labels)
        ax.set(xlabel="concurrency", ylabel=f"{name} (ms)", title=f"{name} per request")
    _save(plt, fig, title, path)


def plot_startup(spans: list[Span], ready_s: float | None, title: str, path: str) -> None:
    """A Gantt chart of ``spans`` (one launch's trace); ``ready_s``: the launch's time to ``/health``.

    A span's label (its name and duration, shortened to fit) sits in its middle, or along its top
    edge when nested spans cover the middle; spans too short for any label are named in a legend."""
    plt = _pyplot()
    tracks = processes(spans)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.9 * max(1, len(tracks))))
    colors = plt.get_cmap("tab20").colors
    names = sorted({s.name for s in spans})
    end = max([s.end_s for s in spans] + [ready_s or 0.0]) or 1.0
    labels = []
    for s in spans:
        row = tracks.index(s.process)
        height = BAR_HEIGHT * NESTED_SCALE**s.depth  # nested spans thinner, drawn over their parent
        ax.barh(row, s.dur_s, left=s.start_s, height=height, color=colors[names.index(s.name) % len(colors)],
                edgecolor="black", linewidth=0.4, zorder=2 + s.depth)
        y = row - height / 2 + height * (1 - NESTED_SCALE) / 4 if _has_child(s, spans) else row
        text = ax.text(s.start_s + s.dur_s / 2, y, "", ha="center", va="center", zorder=20 + s.depth,
                       fontsize=7.5 if s.depth == 0 else 6.5)
        labels.append((text, s))
    if ready_s is not None:
        ax.axvline(ready_s, color="red", linestyle="--", linewidth=1, zorder=40)
        ax.text(ready_s, -0.5, "/health 200 ", color="red", ha="right", va="bottom", fontsize=8, zorder=41)
    ax.set_yticks(range(len(tracks)), tracks)
    ax.set_ylim(len(tracks) - 0.5, -0.6)  # the first process on top
    ax.set_xlim(0, end * 1.02)
    ax.set_xlabel("seconds from the first span")
    ax.grid(axis="x", alpha=0.3, zorder=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()  # the axes are final now: fit each label into its bar
    for text, s in labels:
        left, right = ax.transData.transform([(s.start_s, 0), (s.end_s, 0)])[:, 0]
        for candidate in _label_candidates(s):
            text.set_text(candidate)
            if text.get_window_extent(renderer).width <= right - left - 4:
                break
        else:
            text.set_text("")
    shown = {s.name for text, s in labels if text.get_text()}
    unlabelled = sorted({s.name for s in spans} - shown)
    if unlabelled:  # spans too short for their name: named in a legend by colour
        from matplotlib.patches import Patch  # optional dependency: only --plot needs it

        # beside the chart, never over it
        ax.legend(handles=[Patch(color=colors[names.index(n) % len(colors)], label=n) for n in unlabelled],
                  loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, title="short spans",
                  title_fontsize=7, ncol=1 + len(unlabelled) // 24)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


BAR_HEIGHT = 0.8
NESTED_SCALE = 0.6


def _has_child(span: Span, spans: list[Span]) -> bool:
    return any(t.process == span.process and t.depth == span.depth + 1 and span.start_s <= t.start_s
               and t.end_s <= span.end_s + 1e-6 for t in spans)


def _label_candidates(span: Span) -> list[str]:
    name = span.name
    return [f"{name} {span.dur_s:.2f} s", name, *(name[:n] + "…" for n in range(len(name) - 1, 2, -1))]


def _save(plt: Any, fig: Any, title: str, path: str) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""The timeline picture: one lane per pipeline stage showing compute, recomputation,
communication and idle time of one simulated training step (PNG and SVG, matplotlib).

Example::

    >>> import tempfile, pathlib
    >>> from lynx.viz import draw_timeline
    >>> bars = [(0, "compute", 0.0, 1.0), (0, "recompute", 1.0, 1.5), (1, "idle", 0.0, 1.0),
    ...         (1, "compute", 1.0, 2.0), (1, "comm", 2.0, 2.2)]
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "t"
    >>> sorted(p.suffix for p in draw_timeline(bars, 2.2, out, title="demo"))
    ['.png', '.svg']
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence, Union

__all__ = ["COLORS", "draw_timeline", "stage_totals", "timeline_bars"]

COLORS = {"compute": "#4C72B0", "recompute": "#DD8452", "comm": "#55A868", "idle": "#D9D9D9"}


def stage_totals(bars: Sequence[tuple[int, str, float, float]], step_time_s: float) -> dict[int, dict[str, float]]:
    """Seconds of compute, recompute, communication and idle per stage (idle = the rest)."""
    totals: dict[int, dict[str, float]] = {}
    for stage, kind, start, end in bars:
        entry = totals.setdefault(stage, {"compute": 0.0, "recompute": 0.0, "comm": 0.0, "idle": 0.0})
        if kind in ("compute", "recompute"):
            entry[kind] += end - start
    for stage, kind, start, end in bars:
        if kind == "comm":  # collectives overlapping compute are not idle time
            totals[stage]["comm"] += end - start
    for entry in totals.values():
        entry["idle"] = max(0.0, step_time_s - entry["compute"] - entry["recompute"])
    return totals


def draw_timeline(bars: Sequence[tuple[int, str, float, float]], step_time_s: float,
                  path: Union[str, Path], *, title: str = "") -> list[Path]:
    """Draw ``bars`` (see :attr:`lynx.Plan.timeline`) to ``path``.png and ``path``.svg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = sorted({b[0] for b in bars}) or [0]
    scale, unit = (1e3, "ms") if step_time_s < 10 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(stages) + 1.6))
    for stage in stages:
        y = len(stages) - 1 - stages.index(stage)
        ax.broken_barh([(0, step_time_s * scale)], (y - 0.4, 0.8), facecolors=COLORS["idle"])
        for kind in ("compute", "recompute", "idle"):
            spans = [(s * scale, (e - s) * scale) for st, k, s, e in bars if st == stage and k == kind]
            if spans:
                ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLORS[kind], linewidth=0)
        comm = [(s * scale, (e - s) * scale) for st, k, s, e in bars if st == stage and k == "comm"]
        if comm:  # drawn as a strip: collectives may overlap compute
            ax.broken_barh(comm, (y - 0.4, 0.25), facecolors=COLORS["comm"], linewidth=0)
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([f"stage {s}" for s in reversed(stages)])
    ax.set_xlim(0, step_time_s * scale * 1.01)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if len(stages) < 4 else -0.12), ncol=4, frameon=False)
    fig.tight_layout()
    base = Path(path)
    base = base.with_suffix("") if base.suffix in (".png", ".svg") else base
    base.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix in (".png", ".svg"):
        out = base.parent / (base.name + suffix)  # not with_suffix: "gpt-1.3b" has a dot
        fig.savefig(out, dpi=120)
        written.append(out)
    plt.close(fig)
    return written


_BAR_KIND = {"forward": "compute", "backward": "compute", "recompute": "recompute", "tp": "comm",
             "dp": "comm", "wait": "idle", "optimizer": "compute"}


def timeline_bars(timeline: Any) -> list[tuple[int, str, float, float]]:
    """The replayed step as merged bars per stage (sends overlap compute and are left out)."""
    bars: list[tuple[int, str, float, float]] = []
    last: dict[int, int] = {}
    for seg in sorted(timeline.segments, key=lambda g: (g.device, g.start)):
        kind = _BAR_KIND.get(seg.kind)
        if kind is None or seg.end <= seg.start:
            continue
        i = last.get(seg.device)
        if i is not None and bars[i][1] == kind and abs(bars[i][3] - seg.start) < 1e-12:
            bars[i] = (seg.device, kind, bars[i][2], seg.end)
        else:
            last[seg.device] = len(bars)
            bars.append((seg.device, kind, seg.start, seg.end))
    return bars

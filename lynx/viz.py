"""The timeline picture: one lane per pipeline stage showing compute, recomputation,
communication and idle time of one simulated training step (PNG and SVG, matplotlib); with
offload, the host link's copy lanes as strips under each stage (device→host, host→device).

With a plan's detailed timeline (:func:`timeline_detail`, ``Plan.timeline_detail``) the picture
labels each bar with its microbatch (``F3``, ``B3``, ``R3`` for recomputation serving ``B3``),
draws forward and backward in different colours, splits recomputation into the part hidden in
a communication window and the part exposed on the critical path (on demand, or beyond a
window's capacity), and draws communication where a stage waits for it: the part of an
activation or gradient transfer that a stage sits idle for, and tensor- and data-parallel
collectives; a transfer that runs while the stage computes is not drawn (it costs nothing).

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

__all__ = ["COLORS", "DETAIL_COLORS", "draw_timeline", "stage_totals", "timeline_bars", "timeline_detail"]

COLORS = {"compute": "#4C72B0", "recompute": "#DD8452", "runtime": "#8C8C8C", "comm": "#55A868", "idle": "#D9D9D9",
          "copy": "#DA8BC3"}
DETAIL_COLORS = {"forward": "#4C72B0", "backward": "#8172B3", "weight": "#64B5CD", "runtime": "#8C8C8C",
                 "recompute hidden": "#F2B880", "recompute exposed": "#C44E52", "comm": "#55A868",
                 "optimizer": "#937860", "window": "#333333", "idle": "#D9D9D9", "d2h": "#DA8BC3", "h2d": "#8C613C"}
_DETAIL_NAMES = {"forward": "forward", "backward": "backward (I: input grads)", "weight": "weight grads (W)",
                 "runtime": "the runtime's own host work", "recompute hidden": "recompute hidden in a window",
                 "recompute exposed": "recompute exposed", "comm": "communication waited for",
                 "optimizer": "optimizer step", "window": "window", "idle": "idle",
                 "d2h": "offload copy (device→host lane)", "h2d": "prefetch copy (host→device lane)"}
# copy lanes (offload): strips under a stage's lane, beside its compute
_LANE_Y = {"d2h": -0.50, "h2d": -0.58, "copy": -0.50}


def stage_totals(bars: Sequence[tuple[int, str, float, float]], step_time_s: float) -> dict[int, dict[str, float]]:
    """Seconds of compute, recompute, the runtime's own work, communication and idle per stage
    (idle = the rest)."""
    totals: dict[int, dict[str, float]] = {}
    for stage, kind, start, end in bars:
        entry = totals.setdefault(stage, {"compute": 0.0, "recompute": 0.0, "runtime": 0.0, "comm": 0.0, "idle": 0.0})
        if kind in ("compute", "recompute", "runtime"):
            entry[kind] += end - start
    for stage, kind, start, end in bars:
        if kind == "comm":  # collectives overlapping compute are not idle time
            totals[stage]["comm"] += end - start
    for entry in totals.values():
        entry["idle"] = max(0.0, step_time_s - entry["compute"] - entry["recompute"] - entry["runtime"])
    return totals


def draw_timeline(bars: Sequence[tuple[int, str, float, float]], step_time_s: float,
                  path: Union[str, Path], *, title: str = "",
                  detail: Sequence[tuple[int, str, float, float, str]] = ()) -> list[Path]:
    """Draw ``bars`` (see :attr:`lynx.Plan.timeline`) to ``path``.png and ``path``.svg; with
    ``detail`` (:attr:`lynx.Plan.timeline_detail`) the labelled picture of the module docstring."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = sorted({b[0] for b in (detail or bars)}) or [0]
    scale, unit = (1e3, "ms") if step_time_s < 10 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(stages) + 1.6))
    if detail:
        _draw_detail(ax, detail, stages, step_time_s, scale)
        handles = [Patch(color=DETAIL_COLORS[k], label=_DETAIL_NAMES[k]) for k in DETAIL_COLORS]
    else:
        _draw_merged(ax, bars, stages, step_time_s, scale)
        handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([f"stage {s}" for s in reversed(stages)])
    ax.set_xlim(0, step_time_s * scale * 1.01)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    ax.legend(handles=handles, loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if len(stages) < 4 else -0.12), ncol=5, frameon=False)
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


_BAR_KIND = {"forward": "compute", "backward": "compute", "weight": "compute", "recompute": "recompute",
             "runtime": "runtime", "tp": "comm", "dp": "comm", "wait": "idle", "optimizer": "compute",
             "d2h": "copy", "h2d": "copy"}


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


def _draw_merged(ax: Any, bars: Sequence[tuple[int, str, float, float]], stages: list[int],
                 step_time_s: float, scale: float) -> None:
    """Lanes of merged compute / recompute / comm / idle bars (plans without a detailed timeline)."""
    for stage in stages:
        y = len(stages) - 1 - stages.index(stage)
        ax.broken_barh([(0, step_time_s * scale)], (y - 0.4, 0.8), facecolors=COLORS["idle"])
        for kind in ("compute", "recompute", "runtime", "idle"):
            spans = [(s * scale, (e - s) * scale) for st, k, s, e in bars if st == stage and k == kind]
            if spans:
                ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLORS[kind], linewidth=0)
        comm = [(s * scale, (e - s) * scale) for st, k, s, e in bars if st == stage and k == "comm"]
        if comm:  # drawn as a strip: collectives may overlap compute
            ax.broken_barh(comm, (y - 0.4, 0.25), facecolors=COLORS["comm"], linewidth=0)
        copies = [(s * scale, (e - s) * scale) for st, k, s, e in bars if st == stage and k == "copy"]
        if copies:  # the host link's copies run beside compute: a strip under the lane
            ax.broken_barh(copies, (y + _LANE_Y["copy"], 0.08), facecolors=COLORS["copy"], linewidth=0)


def _draw_detail(ax: Any, detail: Sequence[tuple[int, str, float, float, str]], stages: list[int],
                 step_time_s: float, scale: float) -> None:
    """Lanes of labelled bars; a label is written where its bar is wide enough to hold it."""
    min_width = 0.018 * step_time_s
    for stage in stages:
        y = len(stages) - 1 - stages.index(stage)
        ax.broken_barh([(0, step_time_s * scale)], (y - 0.4, 0.8), facecolors=DETAIL_COLORS["idle"])
        for st, kind, start, end, label in detail:
            if st != stage or kind not in DETAIL_COLORS:
                continue
            if kind == "window":   # a strip above the lane: where recomputation could run
                ax.broken_barh([(start * scale, (end - start) * scale)], (y + 0.42, 0.08),
                               facecolors=DETAIL_COLORS[kind], linewidth=0)
                continue
            if kind in _LANE_Y:   # the copy lanes, under the lane: they run beside compute
                ax.broken_barh([(start * scale, (end - start) * scale)], (y + _LANE_Y[kind], 0.08),
                               facecolors=DETAIL_COLORS[kind], linewidth=0)
                continue
            ax.broken_barh([(start * scale, (end - start) * scale)], (y - 0.4, 0.8),
                           facecolors=DETAIL_COLORS[kind], edgecolor="white", linewidth=0.4)
            if label and end - start >= min_width:
                dark = kind in ("forward", "backward", "weight", "recompute exposed", "comm", "optimizer")
                ax.text((start + end) / 2 * scale, y, label, ha="center", va="center", fontsize=7,
                        color="white" if dark else "black", clip_on=True)


def _microbatch(label: str) -> str:
    """``"F3 block 2"`` -> ``"3"``; ``"I3c2 block 5"`` -> ``"3c2"``; ``"s0.recv_grad.mb3"`` -> ``"3"``; else ``""``."""
    head = label.split(" ", 1)[0]
    if head[:1] in ("F", "B", "I", "W") and head[1:2].isdigit():
        return head[1:]
    mark = label.rfind(".mb")
    if mark >= 0:
        digits = "".join(ch for ch in label[mark + 3:] if ch.isdigit())
        return digits
    return ""


def timeline_detail(timeline: Any) -> list[tuple[int, str, float, float, str]]:
    """The replayed step as labelled bars per stage: ``(stage, kind, start_s, end_s, label)``.

    ``kind`` is ``forward``, ``backward`` (a zero-bubble ``I`` too), ``weight`` (a deferred
    ``W``), ``runtime`` (the runtime's own host work for an action), ``recompute hidden``,
    ``recompute exposed``, ``comm`` (a transfer or collective the stage waits for),
    ``optimizer``, ``window`` (a window's capacity, labelled with its id) or ``d2h`` / ``h2d``
    (an offload copy on the host link's lanes); the label names the action (``F3``, ``B3``,
    ``I3``, ``W3``, ``R3``; ``F3c2`` for chunk 2 under interleaved schedules). Consecutive bars
    of one kind and label are merged.
    """
    windows = {(w.device, str(w.id)): w for w in timeline.windows}
    sends = [g for g in timeline.segments if g.kind == "send"]
    ordered = sorted(timeline.segments, key=lambda g: (g.device, g.start, g.end))
    out: list[tuple[int, str, float, float, str]] = []

    def add(stage: int, kind: str, start: float, end: float, label: str) -> None:
        if end - start <= 1e-15:
            return
        last = out[-1] if out else None
        if last and last[0] == stage and last[1] == kind and last[4] == label and abs(last[3] - start) < 1e-12:
            out[-1] = (stage, kind, last[2], end, label)
        else:
            out.append((stage, kind, start, end, label))

    for w in timeline.windows:
        if w.capacity_s > 1e-15:
            out.append((w.device, "window", w.start, w.start + w.capacity_s, str(w.id)))
    for i, seg in enumerate(ordered):
        s = seg.device
        if seg.kind in ("forward", "backward", "weight"):
            add(s, seg.kind, seg.start, seg.end, seg.label.split(" ", 1)[0])
        elif seg.kind == "runtime":
            add(s, "runtime", seg.start, seg.end, seg.label.split(" ", 1)[0])
        elif seg.kind == "recompute":
            window = windows.get((s, seg.label))
            if window is None:   # on demand, before the backward that follows it
                after = next((g for g in ordered[i + 1:] if g.device == s and g.kind == "backward"), None)
                add(s, "recompute exposed", seg.start, seg.end, "R" + (_microbatch(after.label) if after else ""))
                continue
            hidden_end = min(seg.end, seg.start + window.capacity_s)
            label = f"R{window.microbatch}"
            add(s, "recompute hidden", seg.start, hidden_end, label)
            add(s, "recompute exposed", hidden_end, seg.end, label)
        elif seg.kind in ("tp", "dp"):
            add(s, "comm", seg.start, seg.end, seg.kind)
        elif seg.kind == "optimizer":
            add(s, "optimizer", seg.start, seg.end, "opt")
        elif seg.kind in ("d2h", "h2d"):   # a copy lane: offload after a forward, prefetch before a backward
            add(s, seg.kind, seg.start, seg.end, "")
        elif seg.kind == "wait":   # waiting on a transfer (drawn) or on the peer's compute (idle)
            j = _microbatch(seg.label)
            what = "act" if ".recv_act." in seg.label else "grad"
            transfers = [g for g in sends if g.device != s and g.label == f"{what} {j}"
                         and g.start < seg.end and g.end > seg.start]
            for g in transfers:
                add(s, "comm", max(g.start, seg.start), min(g.end, seg.end), f"{what[0]}{j}")
    return out

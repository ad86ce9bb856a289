"""The host's cost of the pipeline link's traffic, charged to the compute each message overlaps.

On a link the kernel processes in software (the test bed's veth pairs, bridge and ``tbf``
queues; any TCP stack to a degree) every byte a rank sends or receives costs its core CPU time
while the message flows — softirqs charged to whatever runs there. A rank that computes while
its messages flow computes slower; one that waits meanwhile loses nothing it measures. The
link's figure, ``LinkSpec.host_s_per_byte`` (measured: :func:`lynx.testbed.host_probe.measure_link_host`),
reaches the timeline as ``PipelineCosts.link_host_s_per_byte``; :func:`link_host_charges` takes
a finished replay's messages (each boundary's bytes over its flight: an activation after its
``F``, a gradient after its ``B``'s input part or its ``I``, each once the link is free) and charges
each compute action of the sending and the receiving device ``host_s_per_byte × bytes`` times
the share of the message's flight the action overlaps. :func:`lynx.planner.timeline.run_timeline`
replays the step again with those charges (``runtime`` segments labelled ``link host`` at each
action's start, counted busy). Idle time absorbs the rest, as it does on the machine; window
recomputation that overlaps a message is not charged (a small under-count).

Example (pp 2, F 1 s and B 2 s, a 1 s link carrying 1000 B each way, 1 ms per byte)::

    >>> import dataclasses
    >>> from lynx.planner.timeline import PipelineCosts, run_timeline
    >>> pipe = PipelineCosts.uniform(pp=2, microbatches=4, forward_s=1.0, backward_s=2.0, p2p_s=1.0)
    >>> charged = dataclasses.replace(pipe, link_host_s_per_byte=1e-3, boundary_bytes=(1000,))
    >>> run_timeline(charged).step_time_s > run_timeline(pipe).step_time_s
    True
"""

from __future__ import annotations

from typing import Any

__all__ = ["link_host_charges"]

Key = tuple[int, str, int, int]   # (device, kind, chunk, microbatch) of a compute action


def link_host_charges(replay: Any) -> dict[Key, float]:
    """Per compute action of a finished replay (:class:`lynx.planner.timeline._Replay`), the
    host seconds its device's messages take from it (see module docstring); empty without a cost."""
    pipe = replay.pipe
    per_byte = pipe.link_host_s_per_byte
    if per_byte <= 0 or not pipe.boundary_bytes:
        return {}
    messages = [(src, dst, start, end, pipe.boundary_bytes[b]) for src, dst, start, end, b in replay.messages]
    charges: dict[Key, float] = {}
    for s, acts in enumerate(replay.actions):
        mine = [m for m in messages if s in (m[0], m[1])]
        for a in acts:
            cost = 0.0
            for _, _, start, end, nbytes in mine:
                overlap = min(a.end, end) - max(a.start, start)
                if overlap > 0:
                    cost += per_byte * nbytes * overlap / (end - start)
            if cost > 0:
                charges[(s, a.kind, a.chunk, a.microbatch)] = cost
    return charges

"""The frontend: from an ``nn.Module`` and example inputs to an annotated op graph.

``capture`` (torch.export, symbolic_trace fallback) → ``profile`` (FLOPs, output bytes and what
autograd saves, on fake tensors for a target device; ``profile_cache`` reads back a graph
profiled before) → ``graph`` (a networkx DiGraph of ops with
its repeated layers found) → ``measure`` (optional: node times measured on this host);
``analyze`` runs the chain and ``inspect`` reports it per layer.

This is the only part of planning that needs torch. It may import :mod:`lynx.planner` (hardware
specs, the roofline cost model), :mod:`lynx.models`, :mod:`lynx.errors` and :mod:`lynx.config`;
never the solvers, the rewrite or the runtime.
"""

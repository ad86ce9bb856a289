"""HEU: the layer-repetition heuristic.

``layers`` finds the repeated layer classes of a stage and reduces them to one representative
each; ``greedy`` decides keep / drop for the reduced problem; ``realise`` places the dropped
nodes' recomputation into windows; ``trade`` drops cheap kept tensors into windows with room to
prefetch exposed recomputation; ``books`` is the running account (memory, window capacity) they
share; ``solve`` ties them together as :func:`~lynx.solvers.heu.solve.solve_heu`.

It may import the shared stage model (:mod:`lynx.solvers.stage_model`) and the problem types,
never the CP-SAT code: HEU runs without OR-tools.
"""

"""The planner: torch-free, from an op graph and a hardware spec to per-stage problems and plans.

``hardware`` (specs and presets) and ``cost`` (roofline node times, α-β collectives) price the
graph — ``hardware_files`` reads a spec from a JSON/YAML file (``yaml_files``: PyYAML with YAML 1.2 numbers), and
``hardware_cache`` keeps this host's measurement for ``hardware="auto"`` (measured by
:mod:`lynx.calibrate` in a subprocess); ``partition`` cuts it into pipeline stages, ``comm`` prices what crosses them;
``schedule`` gives the action order of 1F1B / GPipe / interleaved 1F1B, ``timeline`` replays it
and finds the windows where a device waits; ``problems`` turns each stage into a
:class:`~lynx.solvers.problem.StageProblem`; ``simulator`` replays solver decisions on the
timeline; ``loop`` is the fixed-point planning loop behind :func:`lynx.compile`.

It imports no torch (``tests/test_layout.py`` keeps it so) and may import only
:mod:`lynx.solvers`, :mod:`lynx.plan`, :mod:`lynx.config`, :mod:`lynx.errors`, :mod:`lynx.phases` and
:mod:`lynx.units`.
"""

"""Capture and profile gpt-20b on the meta device: wall time and peak RSS.

The bar: ≤ 10 s and ≤ 1 GiB peak RSS, no weights allocated. Prints the time of each step
(import excluded and included) and the process's peak resident set size.

    python benchmarks/capture_20b.py [--model gpt-20b] [--attention math]
"""

from __future__ import annotations

import argparse
import resource
import time

START = time.perf_counter()

from lynx.frontend.analyze import analyze  # noqa: E402
from lynx.models import resolve_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-20b")
    parser.add_argument("--attention", default="math")
    args = parser.parse_args()
    imported = time.perf_counter()
    m = resolve_model(args.model, attention=args.attention)
    built = time.perf_counter()
    a = analyze(m.model, m.example_inputs, target="cuda", hardware="h100-sxm", dims=m.dims)
    done = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(p.numel() for p in m.model.parameters())
    print(f"model           {args.model} ({params / 1e9:.1f} B parameters, meta device: "
          f"{all(p.is_meta for p in m.model.parameters())})")
    print(f"graph           {a.graph.number_of_nodes()} nodes, {len(a.graph.graph['blocks'])} blocks, "
          f"folded={a.captured.folded is not None}")
    print(f"import          {imported - START:.2f} s")
    print(f"build (meta)    {built - imported:.2f} s")
    print(f"capture+profile {done - built:.2f} s")
    print(f"total           {done - START:.2f} s   (bar: <= 10 s)")
    print(f"peak RSS        {rss / 2**30:.3f} GiB (bar: <= 1 GiB)")


if __name__ == "__main__":
    main()

"""Saved activation bytes per GPT layer, measured by Lynx's profile vs Korthikanti et al. 2022.

For each GPT preset, CUDA target, fp16, dropout on, s = 2048, b = 1 and 4: the bytes autograd
saves per transformer layer as measured (fake tensors, saved_tensors_hooks, CUDA emulation of
dropout and flash attention) against the paper's ``s·b·h·(34 + 5·a·s/h)`` (math attention) and
``34·s·b·h`` (sdpa, no s×s term). Prints a markdown table and, with ``--write``, replaces the
table in ``docs/memory.md``.

    python benchmarks/memory_table.py --write
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from lynx.frontend.analyze import analyze
from lynx.models import resolve_model

PRESETS = ["gpt-1.3b", "gpt-2.7b", "gpt-6.7b", "gpt-13b", "gpt-20b"]
DOC = Path(__file__).resolve().parents[1] / "docs" / "memory.md"
BEGIN, END = "<!-- memory-table:begin -->", "<!-- memory-table:end -->"


def rows() -> list[str]:
    out = ["| model | h | a | b | attention | measured MiB/layer | Korthikanti MiB/layer | ratio |",
           "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for name in PRESETS:
        for b in (1, 4):
            for attention in ("math", "sdpa"):
                m = resolve_model(name, seq=2048, microbatch=b, attention=attention, dtype="fp16")
                G = analyze(m.model, m.example_inputs, target="cuda", dims=m.dims).graph
                layers = [b_ for b_ in G.graph["blocks"] if b_["kind"] == "layer"]
                per_layer = sum(G.nodes[n]["saved_bytes"] for n in layers[len(layers) // 2]["nodes"])
                s, h, a = 2048, m.dims["hidden"], m.dims["heads"]
                expected = s * b * h * (34 + (5 * a * s / h if attention == "math" else 0))
                out.append(f"| {name} | {h} | {a} | {b} | {attention} | {per_layer / 2**20:,.1f} | "
                           f"{expected / 2**20:,.1f} | {per_layer / expected:.4f} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/memory.md")
    args = parser.parse_args()
    start = time.perf_counter()
    table = "\n".join(rows())
    print(table)
    print(f"\n({time.perf_counter() - start:.1f} s)")
    if args.write:
        text = DOC.read_text()
        block = f"{BEGIN}\n{table}\n{END}"
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
        DOC.write_text(text)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Compare two configurations' greedy outputs in a `sglang_engine_bench.py` result file, prompt by prompt.

    python scripts/sglang_compare_outputs.py RESULT.json CONFIG_A CONFIG_B

Prints, per prompt set and concurrency, how many outputs are token-identical and where the others first differ.
Two configurations that run the same kernels at the same batch composition (e.g. fixed width 1 with one decode
forward per step and with several) must agree on every output, whatever the model's argmax margins."""
import json
import sys


def main(path: str, a: str, b: str) -> int:
    results = json.load(open(path))
    bad = 0
    for run, ra in results[a]["runs"].items():
        rb = results[b]["runs"].get(run)
        if rb is None:
            continue
        key = "output_ids" if ra["output_ids"][0] is not None else "texts"
        diffs = []
        for i, (x, y) in enumerate(zip(ra[key], rb[key])):
            if x != y:
                at = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                diffs.append((i, at))
        bad += len(diffs)
        print(f"{a} vs {b} {run}: {len(ra[key]) - len(diffs)}/{len(ra[key])} identical"
              + (f"; first differences (prompt, token): {diffs[:6]}" if diffs else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    raise SystemExit(main(*sys.argv[1:]))

#!/usr/bin/env python3
"""The step cost by verify width in a live SGLang server, beside the seeds' profile (seed-pcie8).

Reads the `adaptive_sweep` configuration of a `scripts/sglang_engine_bench.py` result (every width in turn, the
plugin's measured step periods per width and batch size) and plain decoding's step period from another result of the
same model, and prints, per batch size, each width's step period in ms and as a multiple of a plain decode step;
`--plot FILE.png` draws the multiples beside seed-pcie8's (decode 12.2 ms, a verify of n tokens 22.5 + 2.5 n ms).

    python scripts/cost_curve.py SWEEP.json PLAIN.json [--batches 1 16] [--plot curve.png] [--config adaptive]
        [--min-samples N]

`--config` reads the durations of another configuration (e.g. `adaptive`, where no sweep ran: only the widths it
chose). At batch 1, SGLang's NGRAM configurations in either file add their width (`ngram` 12, `ngram8` 8: they verify
that many tokens every step) from their c1 runs' scheduler periods.

Plain decoding's period at batch 1 is its c1 runs' scheduler period; at a larger batch, the adaptive run's measured
width-1 periods at that batch (the plain result's c16 runs decode at a mean batch below 16 as requests finish).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_replay import FIXED_WIDTH_CONFIGS  # noqa: E402  (SGLang's NGRAM configs and the width each verifies)

SEED = {"decode_ms": 12.2, "verify_base_ms": 22.5, "verify_per_token_ms": 2.5}


def _durations(result: dict) -> dict[tuple[int, int], tuple[int, float]]:
    """(width, batch) -> (samples, mean ms) over every run of a configuration."""
    acc: dict[tuple[int, int], list] = {}
    for run in result.get("runs", {}).values():
        for key, d in (((run.get("profile") or {}).get("controller") or {}).get("durations") or {}).items():
            w, b = (int(x) for x in key.split("/"))
            row = acc.setdefault((w, b), [0, 0.0])
            row[0] += d["n"]
            row[1] += d["n"] * d["mean_ms"]
    return {k: (n, s / n) for k, (n, s) in acc.items() if n}


def plain_ms(plain_bench: dict, batch: int) -> tuple[float, str]:
    """Plain decoding's step period at ``batch``."""
    if batch == 1:
        runs = [r for k, r in plain_bench["plain"]["runs"].items() if k.endswith("/c1")]
        steps = [r["scheduler"]["decode_steps"] for r in runs]
        ms = sum(r["scheduler"]["period_ms"] * s for r, s in zip(runs, steps)) / sum(steps)
        return ms, "plain c1 scheduler period"
    for name, result in plain_bench.items():
        d = _durations(result).get((1, batch))
        if d and name != "plain":
            return d[1], f"{name}'s width-1 steps at batch {batch} ({d[0]} samples)"
    raise SystemExit(f"cost_curve: no plain step period at batch {batch}")


def fixed_width_ms(benches: list[dict]) -> dict[int, tuple[int, float, str]]:
    """Width -> (steps, mean period ms, source) at batch 1 from the c1 runs of the fixed-width NGRAM configs."""
    out = {}
    for bench in benches:
        for name, w in FIXED_WIDTH_CONFIGS.items():
            runs = [r for k, r in ((bench.get(name) or {}).get("runs") or {}).items()
                    if k.endswith("/c1") and (r.get("scheduler") or {}).get("period_ms")]
            steps = sum(r["scheduler"]["decode_steps"] for r in runs)
            if steps and w not in out:
                ms = sum(r["scheduler"]["period_ms"] * r["scheduler"]["decode_steps"] for r in runs) / steps
                out[w] = (steps, ms, f"{name} c1 scheduler period")
    return out


def table(sweep: dict, plain_bench: dict, batches: list[int], config: str = "adaptive_sweep",
          min_samples: int = 1) -> list[dict]:
    if config not in sweep:
        raise SystemExit(f"cost_curve: no {config!r} configuration in the first file (--config names another)")
    dur = _durations(sweep[config])
    fixed = fixed_width_ms([sweep, plain_bench])
    rows = []
    for b in batches:
        base, source = plain_ms({**sweep, **plain_bench}, b)
        rows.append({"batch": b, "width": 1, "ms": base, "x_decode": 1.0, "samples": None, "source": source})
        cells = {w: (n, ms, config) for (w, bb), (n, ms) in dur.items() if bb == b and w > 1 and n >= min_samples}
        if b == 1:
            for w, (n, ms, src) in fixed.items():  # merged with the config's own samples of that width
                if w in cells:
                    n0, ms0, src0 = cells[w]
                    cells[w] = (n0 + n, (n0 * ms0 + n * ms) / (n0 + n), f"{src0}; {src}")
                else:
                    cells[w] = (n, ms, src)
        for w, (n, ms, src) in sorted(cells.items()):
            rows.append({"batch": b, "width": w, "ms": ms, "x_decode": ms / base, "samples": n, "source": src})
    return rows


def seed_x(width: int) -> float:
    if width == 1:
        return 1.0
    return (SEED["verify_base_ms"] + SEED["verify_per_token_ms"] * width) / SEED["decode_ms"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", help="bench result with the adaptive_sweep configuration")
    p.add_argument("plain", help="bench result of the same model with plain (and adaptive) decoding")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--plot", help="PNG file for the chart")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--config", default="adaptive_sweep", help="configuration whose durations give widths > 1")
    p.add_argument("--min-samples", type=int, default=1, help="leave out widths measured fewer times")
    p.add_argument("--label", default="padded MoE on one H200", help="the model's name in the chart")
    a = p.parse_args(argv)
    rows = table(json.load(open(a.sweep)), json.load(open(a.plain)), a.batches, a.config, a.min_samples)
    print(f"{'batch':>5} {'width':>5} {'ms':>8} {'x decode':>9} {'seed-pcie8 x':>12} {'samples':>8}  source")
    for r in rows:
        print(f"{r['batch']:5d} {r['width']:5d} {r['ms']:8.2f} {r['x_decode']:9.2f} {seed_x(r['width']):12.2f} "
              f"{r['samples'] if r['samples'] is not None else '-':>8}  {r['source']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        widths = sorted({r["width"] for r in rows})
        ax.plot(widths, [seed_x(w) for w in widths], "k--o", label="seed-pcie8 (8 PCIe GPUs, MoE): 22.5 + 2.5n ms "
                "/ 12.2 ms")
        for b in a.batches:
            mine = [r for r in rows if r["batch"] == b]
            ax.plot([r["width"] for r in mine], [r["x_decode"] for r in mine], "-o",
                    label=f"{a.label}, batch {b} (decode {mine[0]['ms']:.1f} ms)")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("verify width n (root included; 1 = plain decode step)")
        ax.set_ylabel("step period / plain decode step")
        ax.set_xticks(widths)
        ax.legend(fontsize=7)
        ax.set_title("What a verify step costs, as the server sees it", fontsize=9)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

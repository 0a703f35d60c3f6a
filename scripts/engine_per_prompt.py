"""Per-prompt speedups of a batch-1 run of `scripts/engine_gpu_bench.py`: each prompt's decode time (the sum of its
steps' milliseconds) under plain greedy over its decode time under each policy, same workload and mode.

    python scripts/engine_per_prompt.py DIR/bench.json [MORE.json ...]

With several runs of the same prompts it also prints, per policy, each prompt's median speedup over the runs: a
prompt's two turns (plain, then the policy) last about a second each, and a stretch of a slower host in one of
them moves that one ratio by several percent; the median over runs is the steadier per-prompt figure.
"""
from __future__ import annotations

import json
import sys


def per_prompt_ms(row: dict) -> list[float]:
    """Decode milliseconds of each prompt of a batch-1 row (from its step records, or kept per-prompt sums)."""
    if "decode_ms_per_prompt" in row:
        return row["decode_ms_per_prompt"]
    out, i = [], 0
    for n in row["steps"]:
        out.append(sum(r["ms"] for r in row["records"][i:i + n]))
        i += n
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def width1_costs(row: dict) -> str:
    """Median milliseconds of the row's width-1 steps: all, right after a drafting step, after a width-1 step;
    and their host part (outside the verify forward), where the records carry it."""
    recs = row.get("records")
    if not recs:
        return ""
    after_draft, after_plain, after_move, host, plan = [], [], [], [], []
    i = 0
    for n in row["steps"]:
        prev = None
        for r in recs[i:i + n]:
            if r["width"] == 1:
                if prev is not None:
                    (after_draft if prev["width"] > 1 else after_plain).append(r["ms"])
                    if prev.get("moved"):
                        after_move.append(r["ms"])
                if "host_ms" in r:
                    host.append(r["host_ms"])
                if "plan_ms" in r:
                    plan.append(r["plan_ms"])
            prev = r
        i += n
    moves = (f", after a step that moved KV slots {_median(after_move):.2f} ms x{len(after_move)}"
             if after_move else "")
    plans = f", of it the policy's drafts and plan {_median(plan):.3f} ms" if plan else ""
    return (f"  width-1 steps: median {_median(after_draft + after_plain):.2f} ms (after a draft "
            f"{_median(after_draft):.2f} ms x{len(after_draft)}{moves}, after width 1 {_median(after_plain):.2f} ms "
            f"x{len(after_plain)}; host part {_median(host):.3f} ms{plans})")


def main(path: str) -> dict:
    """Print one run's per-prompt speedups; return them, {(workload, mode, policy): [ratio per prompt]}."""
    rows = [r for r in json.load(open(path))["results"] if r.get("batch") == 1 and "error" not in r]
    ratios = {}
    plain = {(r["workload"], r["mode"]): per_prompt_ms(r) for r in rows if r["policy"] == "plain"}
    for r in rows:
        base = plain.get((r["workload"], r["mode"]))
        if r["policy"] == "plain" and r.get("records"):
            print(f"{r['workload']:5s} {r['mode']:5s} plain        {width1_costs(r)}")
        if r["policy"] == "plain" or base is None:
            continue
        x = [b / s for b, s in zip(base, per_prompt_ms(r))]
        ratios[(r["workload"], r["mode"], r["policy"])] = x
        print(f"{r['workload']:5s} {r['mode']:5s} {r['policy']:12s} overall {r['speedup']:.2f}x  per prompt "
              f"{min(x):.2f}-{max(x):.2f}x, below 0.97x: {sum(v < 0.97 for v in x)} of {len(x)}  "
              f"[{' '.join(f'{v:.2f}' for v in x)}]  identical {r['identical']}/{r['requests']}")
        if r.get("records"):
            print(f"{'':25s}{width1_costs(r)}")
    return ratios


def median_over_runs(runs: list[dict]) -> None:
    """Per prompt, the median speedup over the runs that have that workload, mode and policy."""
    for key in dict.fromkeys(k for run in runs for k in run):
        xs = [run[key] for run in runs if key in run]
        if len(xs) < 2 or len({len(x) for x in xs}) > 1:  # one run, or runs of different prompt sets
            continue
        med = [_median_mid([x[i] for x in xs]) for i in range(len(xs[0]))]
        workload, mode, policy = key
        print(f"{workload:5s} {mode:5s} {policy:12s} median of {len(xs)} runs per prompt {min(med):.3f}-"
              f"{max(med):.2f}x, below 0.97x: {sum(v < 0.97 for v in med)} of {len(med)}  "
              f"[{' '.join(f'{v:.2f}' for v in med)}]")


def _median_mid(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


if __name__ == "__main__":
    runs = []
    for path in sys.argv[1:]:
        if len(sys.argv) > 2:
            print(f"# {path}")
        runs.append(main(path))
    if len(runs) > 1:
        print("# per prompt, median over the runs")
        median_over_runs(runs)

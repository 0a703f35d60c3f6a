"""Trace replay simulator: `ngramspec simulate TRACE... --method M --profile P [--batch B]`.

Replay semantics: `batch` requests are in flight at once (file order; a new request joins as soon as one
finishes) and every step all of them advance together. Each step the method proposes a draft per request,
greedy verification against the recorded output accepts the longest root path of the draft that matches
it, and the step commits the accepted tokens plus one bonus token (a request's final step commits only
what is left). Before each step a method is told how many requests are still queued (`method.waiting`, as a
server's scheduler knows its queue). Methods only ever see tokens that were committed (their own request's and, through their
shared caches, other requests'), never a request's future, except the declared upper bounds.

A replay records how many batched steps ran at each (batch size, verify width); a cost profile turns that
into time, so one replay is costed under every profile unless the method's drafts depend on the profile
(adaptive methods, `oracle-ctl`), which are replayed once per profile. `speedup` is the time of plain
decoding (`none`) over the method's time, for the same trace, profile and batch. With `--host-cost measured`
each step's time also holds the host time the method really took for it (request admission, drafting,
bookkeeping: wall clock in this process), as a server pays it on the critical path; rows then carry both
figures, `speedup_no_host` and `speedup_with_host` (`speedup` is the latter).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
from numba import njit

from ngramspec.methods import Method, make_method
from ngramspec.profiles import CostProfile, get_profile
from ngramspec.traces import Trace, load_trace

BASELINE = "none"


@njit(cache=True)
def accepted_length(tokens, parents, output, pos):
    """Draft nodes greedy verification accepts against `output[pos:]`: from the root, step to the first child
    (in node order) whose token is the next true token, as a tree verify kernel walks it."""
    remaining = output.shape[0] - pos
    current = -1
    depth = 0
    for j in range(tokens.shape[0]):
        parent = parents[j]
        if parent >= j or parent < -1:
            raise ValueError("draft parents must satisfy -1 <= parents[j] < j")
        # the children of `current` all come after it, so one forward pass finds the path
        if parent == current and depth < remaining and tokens[j] == output[pos + depth]:
            current = j
            depth += 1
    return depth


@dataclass
class Replay:
    """What one replay of a trace by a method at a batch size measured (profile-free)."""

    trace: str
    method: str
    batch: int
    requests: int = 0
    tokens: int = 0
    steps: int = 0  # request-steps: one per request per batched step (tokens per step = tokens / steps)
    batch_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    proposer_s: float = 0.0
    replay_s: float = 0.0
    step_counts: dict = field(default_factory=dict)  # (batch size, width) -> number of batched steps
    profile: str | None = None  # set when the replay itself depended on the profile


def _check_draft(draft) -> tuple[np.ndarray, np.ndarray]:
    tokens, parents = draft
    if tokens.dtype != np.int32 or parents.dtype != np.int32 or tokens.shape != parents.shape:
        raise TypeError("a draft is (tokens int32, parents int32) of equal length")
    return tokens, parents


def replay(trace: Trace, method: Method, batch: int = 1, profile: CostProfile | None = None,
           progress: bool = False) -> Replay:
    """Replay `trace` with `method`, `batch` requests in flight; see the module docstring."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if method.profile_dependent:
        if profile is None:
            raise ValueError(f"method {method.name} depends on the cost profile; pass one")
        method.bind_profile(profile)
    prompts = [r.prompt for r in trace.requests]
    outputs = [r.output for r in trace.requests]
    result = Replay(trace.name, method.name, batch, requests=len(outputs),
                    profile=profile.name if method.profile_dependent else None)
    counts = result.step_counts
    pos = [0] * len(outputs)
    active: list[int] = []
    upcoming = 0
    steps = drafted = accepted = 0
    proposer_s = 0.0
    clock = time.perf_counter
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=trace.output_tokens, unit="tok", desc=f"{trace.name} {method.name} b{batch}",
                   leave=False, mininterval=0.5)
    committed_since_bar = 0
    method.warmup()  # JIT compilation / cache loading stays out of the proposer's time
    began = clock()
    while active or upcoming < len(outputs):
        while len(active) < batch and upcoming < len(outputs):
            if method.needs_future:
                method.see_future(upcoming, outputs[upcoming])
            t0 = clock()
            method.start(upcoming, prompts[upcoming])
            proposer_s += clock() - t0
            active.append(upcoming)
            upcoming += 1
        method.waiting = len(outputs) - upcoming  # what a server's scheduler knows: its queue
        t0 = clock()
        drafts = method.propose(active)
        proposer_s += clock() - t0
        if len(drafts) != len(active):
            raise ValueError(f"{method.name}: propose returned {len(drafts)} drafts for {len(active)} requests")
        width = int(method.verify_width(active, drafts))
        size = len(active)
        counts[(size, width)] = counts.get((size, width), 0) + 1
        finished = []
        for rid, draft in zip(active, drafts):
            tokens, parents = _check_draft(draft)
            output, p = outputs[rid], pos[rid]
            n_draft = len(tokens)
            if n_draft >= width:
                raise ValueError(f"{method.name}: verify width {width} cannot hold a draft of {n_draft} nodes")
            n_accepted = accepted_length(tokens, parents, output, p) if n_draft else 0
            n_commit = min(n_accepted + 1, len(output) - p)
            t0 = clock()
            method.update(rid, output[p: p + n_commit], n_accepted)
            proposer_s += clock() - t0
            pos[rid] = p + n_commit
            drafted += n_draft
            accepted += n_accepted
            committed_since_bar += n_commit
            if p + n_commit == len(output):
                finished.append(rid)
        steps += size
        if method.profile_dependent:
            method.observe_step(size, width, profile.cost_ms(size, width))
        t0 = clock()
        for rid in finished:
            method.finish(rid)
            active.remove(rid)
        proposer_s += clock() - t0
        if bar is not None and committed_since_bar >= 4096:
            bar.update(committed_since_bar)
            committed_since_bar = 0
    if bar is not None:
        bar.update(committed_since_bar)
        bar.close()
    result.replay_s = clock() - began
    result.tokens = sum(len(o) for o in outputs)
    result.steps, result.drafted, result.accepted, result.proposer_s = steps, drafted, accepted, proposer_s
    result.batch_steps = sum(counts.values())
    return result


HOST_COSTS = ("none", "measured")


def summarize(run: Replay, profile: CostProfile, baseline: Replay, host_cost: str = "none") -> dict:
    """One result row: `run` costed under `profile`, speedup against the `none` replay `baseline`; with
    ``host_cost="measured"`` both times also hold the host time the replay measured (see the module docstring)."""
    if host_cost not in HOST_COSTS:
        raise ValueError(f"host_cost must be one of {HOST_COSTS}, got {host_cost!r}")
    time_ms = profile.total_ms(run.step_counts)
    base_ms = profile.total_ms(baseline.step_counts)
    host = {}
    if host_cost == "measured":
        host_ms, base_host_ms = run.proposer_s * 1e3, baseline.proposer_s * 1e3
        host = {"speedup_no_host": base_ms / time_ms,
                "speedup_with_host": (base_ms + base_host_ms) / (time_ms + host_ms), "host_ms": host_ms}
        time_ms, base_ms = time_ms + host_ms, base_ms + base_host_ms
    widths = sum(w * n for (_, w), n in run.step_counts.items())
    return {
        "trace": run.trace, "method": run.method, "profile": profile.name, "batch": run.batch,
        "requests": run.requests, "tokens": run.tokens, "steps": run.steps, "batch_steps": run.batch_steps,
        "accept_len": run.tokens / run.steps,
        "drafted_per_step": run.drafted / run.steps,
        "accept_rate": run.accepted / run.drafted if run.drafted else 0.0,
        "mean_width": widths / run.batch_steps,
        "time_ms": time_ms,
        "tokens_per_s": run.tokens / time_ms * 1e3,
        "speedup": base_ms / time_ms,
        "proposer_us_per_token": run.proposer_s / run.tokens * 1e6,
        "replay_s": run.replay_s,
        **host,
    }


@lru_cache(maxsize=8)
def _cached_trace(path: str, max_requests: int | None) -> Trace:
    trace = load_trace(path)
    return trace.head(max_requests) if max_requests else trace


def _replay_task(task) -> Replay:
    path, spec, batch, profile_spec, max_requests, progress = task
    profile = get_profile(profile_spec) if profile_spec else None
    return replay(_cached_trace(path, max_requests), make_method(spec), batch, profile, progress)


def run_all(trace_paths, method_specs, profile_specs, batches, jobs: int = 1, max_requests: int | None = None,
            progress: bool = True, host_cost: str = "none") -> list[dict]:
    """Replay every (trace, method, batch), once per profile only where the method needs it; cost them all."""
    profiles = [get_profile(p) for p in profile_specs]
    # building each method once validates its spec before any replay starts
    per_profile = {spec: make_method(spec).profile_dependent for spec in method_specs}
    tasks = []
    for path in trace_paths:
        for batch in batches:
            for spec in dict.fromkeys([BASELINE, *method_specs]):
                if per_profile.get(spec):
                    tasks += [(str(path), spec, batch, p, max_requests) for p in profile_specs]
                else:
                    tasks.append((str(path), spec, batch, None, max_requests))
    runs: dict = {}
    if jobs <= 1:
        for task in tasks:
            runs[task] = _replay_task((*task, progress))
    else:
        from tqdm import tqdm
        with ProcessPoolExecutor(jobs) as pool:
            futures = {task: pool.submit(_replay_task, (*task, False)) for task in tasks}
            for task in tqdm(futures, desc="replays", disable=not progress):
                runs[task] = futures[task].result()
    rows = []
    for path in trace_paths:
        for batch in batches:
            baseline = runs[(str(path), BASELINE, batch, None, max_requests)]
            for profile, profile_spec in zip(profiles, profile_specs):
                for spec in method_specs:
                    run = runs.get((str(path), spec, batch, None, max_requests))
                    if run is None:
                        run = runs[(str(path), spec, batch, profile_spec, max_requests)]
                    rows.append(summarize(run, profile, baseline, host_cost))
    return rows


COLUMNS = [("trace", "s"), ("method", "s"), ("profile", "s"), ("batch", "d"), ("steps", "d"),
           ("accept_len", ".3f"), ("drafted_per_step", ".2f"), ("accept_rate", ".3f"), ("mean_width", ".2f"),
           ("speedup", ".3f"), ("proposer_us_per_token", ".2f")]


def format_table(rows: list[dict]) -> str:
    """A markdown table of the result rows."""
    columns = COLUMNS
    if rows and "speedup_with_host" in rows[0]:
        columns = COLUMNS + [("speedup_no_host", ".3f"), ("speedup_with_host", ".3f")]
    heads = [name for name, _ in columns]
    lines = ["| " + " | ".join(heads) + " |",
             "|" + "|".join("---" if fmt == "s" else "---:" for _, fmt in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(format(row[name], fmt) for name, fmt in columns) + " |")
    return "\n".join(lines)


def format_wide(rows: list[dict]) -> str:
    """One line per (trace, method): tokens per step per batch size, then speedup per (profile, batch)."""
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    panels = list(dict.fromkeys((r["profile"], r["batch"]) for r in rows))
    index = {(r["trace"], r["method"], r["profile"], r["batch"]): r for r in rows}
    heads = ["trace", "method"] + [f"accept_len b{b}" for b in batches] + [f"drafted/step b{b}" for b in batches] \
        + [f"speedup {p} b{b}" for p, b in panels]
    lines = ["| " + " | ".join(heads) + " |", "|---|---|" + "---:|" * (len(heads) - 2)]
    for trace, method in dict.fromkeys((r["trace"], r["method"]) for r in rows):
        def pick(batch, profile=None):
            profile = profile or next(p for p, b in panels if b == batch)
            return index[(trace, method, profile, batch)]
        cells = [f"{pick(b)['accept_len']:.3f}" for b in batches] + \
                [f"{pick(b)['drafted_per_step']:.2f}" for b in batches] + \
                [f"{pick(b, p)['speedup']:.3f}" for p, b in panels]
        lines.append(f"| {trace} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Speedup by trace and method, one panel per (profile, batch)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["profile"], r["batch"]) for r in rows))
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6, 1.6 * len(traces) * len(methods) / 3),
                                                      3.2 * len(panels)), squeeze=False)
    width = 0.8 / len(methods)
    for ax, (profile, batch) in zip(axes[:, 0], panels):
        for m, method in enumerate(methods):
            values = [next((r["speedup"] for r in rows if (r["profile"], r["batch"], r["trace"], r["method"])
                            == (profile, batch, trace, method)), np.nan) for trace in traces]
            ax.bar(np.arange(len(traces)) + (m - (len(methods) - 1) / 2) * width, values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(np.arange(len(traces)), traces)
        ax.set_ylabel("speedup vs none")
        ax.set_title(f"{profile}, batch {batch}")
    axes[0, 0].legend(fontsize="small", ncol=min(4, len(methods)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ngramspec simulate", description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="gzip JSONL trace files")
    parser.add_argument("--method", action="append", required=True,
                        help="method spec name:key=value,... (repeatable)")
    parser.add_argument("--profile", action="append", required=True,
                        help="seed-pcie8, h200-llama8b or FILE.json[:COLUMN] (repeatable)")
    parser.add_argument("--batch", type=int, action="append", help="requests in flight (repeatable; default 1)")
    parser.add_argument("--json", metavar="FILE", help="write the result rows as JSON ('-' for stdout)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw speedup by trace and method")
    parser.add_argument("--jobs", type=int, default=1, help="replays run in parallel processes")
    parser.add_argument("--max-requests", type=int, help="replay only the first N requests of each trace")
    parser.add_argument("--wide", action="store_true",
                        help="print one line per (trace, method) with every profile and batch side by side")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--host-cost", choices=HOST_COSTS, default="none",
                        help="measured: add each step's measured host time to its cost (reports both speedups)")
    args = parser.parse_args(argv)
    batches = args.batch or [1]
    if any(b < 1 for b in batches):
        parser.error("--batch must be >= 1")
    try:
        rows = run_all(args.traces, args.method, args.profile, batches, jobs=args.jobs,
                       max_requests=args.max_requests, progress=not args.no_progress, host_cost=args.host_cost)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"ngramspec simulate: error: {exc}", file=sys.stderr)
        return 2
    table_out = sys.stderr if args.json == "-" else sys.stdout
    print(format_wide(rows) if args.wide else format_table(rows), file=table_out)
    if args.json == "-":
        json.dump(rows, sys.stdout, indent=1)
        print()
    elif args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Trace replay simulator: `ngramspec simulate TRACE... --method M --profile P [--batch B]`.

Replay semantics: `batch` requests are in flight at once (file order; a new request joins as soon as one
finishes) and every step all of them advance together. Each step the method proposes a draft per request,
greedy verification against the recorded output accepts the longest root path of the draft that matches
it, and the step commits the accepted tokens plus one bonus token (a request's final step commits only
what is left). Before each step a method is told how many requests are still queued (`method.waiting`, as a
server's scheduler knows its queue). Methods only ever see tokens that were committed (their own request's and,
through their shared caches, other requests'), never a request's future, except the declared upper bounds.

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

from ngramspec.cli import check_output
from ngramspec.controller import DEFAULT_WIDTHS
from ngramspec.layout import accepted_length
from ngramspec.sim.methods import Method, make_method
from ngramspec.sim.profiles import CostProfile, get_profile
from ngramspec.sim.traces import Trace, load_trace, trace_name

BASELINE = "none"


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
    scores = None
    if getattr(method, "uses_scores", False):
        scores = [r.topk for r in trace.requests]
        if any(s is None for s in scores):
            raise ValueError(f"method {method.name} drafts from the model's top-k scores: the trace needs a "
                             "`topk` field in every record (scripts/record_topk.py writes one)")
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
    if progress and _have_tqdm():
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
            if scores is not None:  # the model's scores at the committed positions: the server has them now
                method.see_scores(rid, scores[rid][p: p + n_commit])
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
    if callable(getattr(method, "close", None)):  # the replay is over (e.g. a method writes what it learned)
        method.close()
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
        "width_steps": {str(w): n for w, n in sorted(_width_steps(run.step_counts).items())},
        **host,
    }


def _width_steps(step_counts: dict) -> dict:
    """Batched steps per verify width (over every batch size)."""
    out: dict = {}
    for (_, width), n in step_counts.items():
        out[width] = out.get(width, 0) + n
    return out


def _have_tqdm() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


@lru_cache(maxsize=4)
def _tokenizer(spec: str | None):
    if spec is None:
        return None
    from ngramspec.text import load_tokenizer

    return load_tokenizer(spec)


@lru_cache(maxsize=8)
def _cached_trace(path: str, max_requests: int | None, tokenizer: str | None = None) -> Trace:
    return load_trace(path, _tokenizer(tokenizer), max_requests)


def _replay_task(task) -> Replay:
    path, spec, batch, profile_spec, max_requests, progress = task
    profile = get_profile(profile_spec) if profile_spec else None
    return replay(_cached_trace(path, max_requests, _TOKENIZER), make_method(spec), batch, profile, progress)


_TOKENIZER: str | None = None  # the tokenizer spec of text traces, for this process and its workers


def _set_tokenizer(spec: str | None) -> None:
    global _TOKENIZER
    _TOKENIZER = spec


def check_profiles(profile_specs) -> list[CostProfile]:
    """Build the profiles; two with one name would share one column of the table and plot: an error."""
    profiles = [get_profile(p) for p in profile_specs]
    seen: dict = {}
    for spec, profile in zip(profile_specs, profiles):
        if profile.name in seen:
            raise ValueError(f"profiles {seen[profile.name]!r} and {spec!r} are both named {profile.name!r}; "
                             "give each once (rename a file to tell them apart)")
        seen[profile.name] = spec
    return profiles


def check_traces(trace_paths) -> None:
    """Each trace once, and no two with one name (they would share the rows, table lines and plot bars)."""
    seen: dict = {}
    for path in map(str, trace_paths):
        name = trace_name(path)
        if name in seen:
            if Path(seen[name]).resolve() == Path(path).resolve():
                raise ValueError(f"trace {path} is given twice; give each once")
            raise ValueError(f"traces {seen[name]} and {path} are both named {name!r}; give each once (rename a "
                             "file to tell them apart)")
        seen[name] = path


def run_all(trace_paths, method_specs, profile_specs, batches, jobs: int = 1, max_requests: int | None = None,
            progress: bool = True, tokenizer: str | None = None, host_cost: str = "none") -> list[dict]:
    """Replay every (trace, method, batch), once per profile only where the method needs it; cost them all.
    Text traces are tokenized with `tokenizer` (a spec for `ngramspec.text.load_tokenizer`)."""
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    if len(set(method_specs)) != len(method_specs):
        raise ValueError("a method is given twice")
    check_traces(trace_paths)
    profiles = check_profiles(profile_specs)
    _set_tokenizer(tokenizer)
    for path in trace_paths:  # load (and tokenize) each trace once up front: format errors before any replay
        _cached_trace(str(path), max_requests, tokenizer)
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
        with ProcessPoolExecutor(jobs, initializer=_set_tokenizer, initargs=(tokenizer,)) as pool:
            futures = {task: pool.submit(_replay_task, (*task, False)) for task in tasks}
            waiting = futures
            if progress and _have_tqdm():
                from tqdm import tqdm
                waiting = tqdm(futures, desc="replays")
            for task in waiting:
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
    """One line per (trace, method): tokens per step per batch size, then speedup per (profile, batch).

    The per-batch columns come from the first profile of that batch, which their heading names (a method that
    adapts to the cost profile drafts differently under each; the JSON rows hold every profile's figures)."""
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    panels = list(dict.fromkeys((r["profile"], r["batch"]) for r in rows))
    first = {b: next(p for p, pb in panels if pb == b) for b in batches}
    index = {(r["trace"], r["method"], r["profile"], r["batch"]): r for r in rows}
    heads = ["trace", "method"] + [f"accept_len {first[b]} b{b}" for b in batches] \
        + [f"drafted/step {first[b]} b{b}" for b in batches] + [f"speedup {p} b{b}" for p, b in panels]
    lines = ["| " + " | ".join(heads) + " |", "|---|---|" + "---:|" * (len(heads) - 2)]
    for trace, method in dict.fromkeys((r["trace"], r["method"]) for r in rows):
        def pick(batch, profile=None):
            return index[(trace, method, profile or first[batch], batch)]
        cells = [f"{pick(b)['accept_len']:.3f}" for b in batches] + \
                [f"{pick(b)['drafted_per_step']:.2f}" for b in batches] + \
                [f"{pick(b, p)['speedup']:.3f}" for p, b in panels]
        lines.append(f"| {trace} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def is_bound(method: str) -> bool:
    """Upper bounds (they see the future): drawn as markers, reported apart from the real methods."""
    return method.split(":")[0] in ("oracle", "perfect", "oracle-ctl")


def plot(rows: list[dict], path: str) -> None:
    """Speedup by trace and method, one panel per (profile, batch), then accept length per batch size.

    Real methods are bars with their value on top; the bounds (perfect drafter, oracle controller) are markers,
    so a large bound does not squash the bars (when one is off the scale it is drawn at the top edge with its
    value). The legend sits outside the panels, on the right."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["profile"], r["batch"]) for r in rows))
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    real = [m for m in methods if not is_bound(m)] or methods
    bounds = [m for m in methods if is_bound(m) and m in methods and m not in real]
    index = {(r["profile"], r["batch"], r["trace"], r["method"]): r for r in rows}
    markers = ["v", "*", "D", "P", "X"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {m: colors[i % len(colors)] for i, m in enumerate(real)}
    n_panels = len(panels) + len(batches)
    fig, axes = plt.subplots(n_panels, 1, figsize=(max(7.0, 1.1 * len(traces) * (len(real) + 1)),
                                                  3.3 * n_panels), squeeze=False)
    slots = len(real) + (1 if bounds else 0)  # the bounds' markers get their own slot, right of the bars
    width = 0.8 / slots
    x = np.arange(len(traces))
    bound_x = x + (len(real) - (slots - 1) / 2) * width

    def bars(ax, metric, pick):
        top = 0.0
        for m, method in enumerate(real):
            values = np.array([pick(trace, method)[metric] if pick(trace, method) else np.nan for trace in traces])
            pos = x + (m - (slots - 1) / 2) * width
            ax.bar(pos, values, width, label=method, color=color[method])
            for xi, v in zip(pos, values):
                if np.isfinite(v):
                    ax.annotate(f"{v:.2f}", (xi, v), xytext=(0, 2), textcoords="offset points", ha="center",
                                va="bottom", fontsize=7)
            top = max(top, np.nanmax(values) if np.isfinite(values).any() else 0.0)
        return top

    def draw_bounds(ax, metric, pick, top):
        ceiling = top * 1.6 if top > 0 else 1.0
        for b, method in enumerate(bounds):
            values = np.array([pick(trace, method)[metric] if pick(trace, method) else np.nan for trace in traces])
            shown = np.minimum(values, ceiling)
            ax.scatter(bound_x, shown, marker=markers[b % len(markers)], s=60, color="black", zorder=3,
                       label=f"bound: {method}")
            for xi, v, sv in zip(bound_x, values, shown):
                if np.isfinite(v):
                    clipped = v > ceiling
                    ax.annotate(f"{v:.2f}" + ("↑" if clipped else ""), (xi, sv), xytext=(7, -3),
                                textcoords="offset points", fontsize=7)
        ax.set_ylim(0, ceiling * 1.12)

    for ax, (profile, batch) in zip(axes[:n_panels - len(batches), 0], panels):
        def pick(trace, method, profile=profile, batch=batch):
            return index.get((profile, batch, trace, method))
        top = bars(ax, "speedup", pick)
        draw_bounds(ax, "speedup", pick, max(top, 1.0))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, traces)
        ax.set_ylabel("speedup vs none")
        ax.set_title(f"speedup: profile {profile}, batch {batch}")
    for ax, batch in zip(axes[n_panels - len(batches):, 0], batches):
        profile = next(p for p, b in panels if b == batch)

        def pick(trace, method, profile=profile, batch=batch):
            return index.get((profile, batch, trace, method))
        top = bars(ax, "accept_len", pick)
        draw_bounds(ax, "accept_len", pick, top)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, traces)
        ax.set_ylabel("tokens per request-step")
        ax.set_title(f"accept length, batch {batch}" + (f" (profile {profile})" if len(panels) > len(batches)
                                                        else ""))
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small", frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------------------- the answer
ANSWER_METHODS = [  # (label, spec); the first is the baseline of every speedup
    ("NGRAM_ADAPTIVE", "ngramspec-adaptive"),
    ("NGRAM (SGLang)", "sglang-ngram"),
    ("prompt lookup", "prompt-lookup:k=8"),
]
ANSWER_BOUNDS = [
    ("oracle controller", "oracle-ctl:k=15"),
    ("perfect drafter", "oracle:k=15"),
]
PLUGIN_WIDTHS = tuple(w for w in DEFAULT_WIDTHS if w > 1)  # the plugin's --speculative-num-draft-tokens choices
WORTH_IT = 1.05  # speedup below which the answer says to leave speculation off


def answer_methods() -> tuple[list[tuple[str, str]], list[str]]:
    """The answer's methods that can run here, and one line per one that cannot (its package is missing)."""
    usable, notes = [], []
    for label, spec in ANSWER_METHODS + ANSWER_BOUNDS:
        try:
            make_method(spec)
        except ImportError as exc:
            notes.append(f"{label} not simulated: {str(exc).splitlines()[0].split(';')[0]}")
            continue
        usable.append((label, spec))
    return usable, notes


def suggested_width(width_steps: dict) -> int:
    """The plugin's `--speculative-num-draft-tokens`: the largest width the controller used on at least 1% of
    its steps, rounded up to a candidate width (at least 2)."""
    total = sum(width_steps.values())
    used = [int(w) for w, n in width_steps.items() if n >= 0.01 * total]
    top = max(used, default=2)
    return next((w for w in PLUGIN_WIDTHS if w >= top), PLUGIN_WIDTHS[-1])


def format_answer(rows: list[dict], labels: dict[str, str], notes: list[str] = ()) -> str:
    """One screen: per trace, per (profile, batch), the speedup (and accept length) of NGRAM_ADAPTIVE against
    the others and the bounds, then the settings to use."""
    out = []
    index = {(r["trace"], r["profile"], r["batch"], r["method"]): r for r in rows}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    real = [m for m in methods if not is_bound(m)]
    bound = [m for m in methods if is_bound(m)]
    heads = [labels.get(m, m) for m in real] + [labels.get(m, m) for m in bound]
    adaptive = next((m for m in methods if m.startswith("ngramspec-adaptive")), None)
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    for trace in dict.fromkeys(r["trace"] for r in rows):
        first = next(r for r in rows if r["trace"] == trace)
        out.append(f"{trace}: {first['requests']:,} requests, {first['tokens']:,} output tokens")
        out.append("speedup over plain decoding (accept length = tokens per request-step); "
                   "the last columns are bounds, not methods")
        widths = [max(12, len(h) + 2) for h in heads]
        line = f"{'profile':16s} {'batch':>5s}  " + "".join(f"{h:>{w}s}" for h, w in zip(heads, widths))
        out.append(line)
        out.append("-" * len(line))
        settings = []
        for profile, batch in sorted(dict.fromkeys((r["profile"], r["batch"]) for r in rows if r["trace"] == trace),
                                     key=lambda pb: (profiles.index(pb[0]), pb[1])):
            cells = []
            for m, w in zip(real + bound, widths):
                r = index.get((trace, profile, batch, m))
                cells.append(f"{r['speedup']:.2f}x ({r['accept_len']:.2f})".rjust(w) if r else "n/a".rjust(w))
            out.append(f"{profile:16s} {batch:5d}  " + "".join(cells))
            if adaptive:
                settings.append(_setting(index, trace, profile, batch, adaptive, real, bound, labels))
        if settings:
            out.append("")
            out.append("settings:")
            out.extend(settings)
        out.append("")
    out.extend(f"note: {n}" for n in notes)
    return "\n".join(out).rstrip()


def _setting(index, trace, profile, batch, adaptive, real, bound, labels) -> str:
    r = index[(trace, profile, batch, adaptive)]
    where = f"  {profile}, batch {batch}: "
    if r["speedup"] < WORTH_IT:
        best = max((index[(trace, profile, batch, m)] for m in real if (trace, profile, batch, m) in index
                    and m != "none"), key=lambda x: x["speedup"])
        if best["speedup"] >= WORTH_IT:
            return where + (f"{labels.get(best['method'], best['method'])} is best here ({best['speedup']:.2f}x); "
                            f"NGRAM_ADAPTIVE gives {r['speedup']:.2f}x")
        return where + f"speculation does not pay on this traffic ({r['speedup']:.2f}x): leave it off"
    n = suggested_width(r["width_steps"])
    oracle = next((index.get((trace, profile, batch, m)) for m in bound if m.startswith("oracle-ctl")), None)
    room = f"; an oracle controller would reach {oracle['speedup']:.2f}x" \
        if oracle and oracle["speedup"] > r["speedup"] + 0.005 else ""
    return where + (f"--speculative-algorithm NGRAM_ADAPTIVE --speculative-num-draft-tokens {n} "
                    f"({r['speedup']:.2f}x{room})")


def _method_help() -> str:
    from ngramspec.sim.methods import describe_methods
    from ngramspec.sim.profiles import BUILTIN_PROFILES

    return ("methods (--method NAME:key=value,...; parameters and their defaults):\n" + describe_methods() +
            "\n\nprofiles (--profile): " + ", ".join(BUILTIN_PROFILES) +
            " (ngramspec profiles), or FILE.json[:COLUMN] from `ngramspec calibrate`\n\n"
            "Without --method: the answer to \"will n-gram speculation help on my traffic?\": NGRAM_ADAPTIVE vs "
            "plain decoding,\nSGLang's NGRAM and prompt lookup, with the bounds and the settings to use, under "
            "every built-in profile\n(or the --profile ones).\n\n"
            "Trace formats (JSON Lines, optionally .gz), one request per line: token ids {\"prompt\": [..], "
            "\"output\": [..]};\ntext {\"prompt\": \"..\", \"output\": \"..\"}; OpenAI chat {\"messages\": [..]} "
            "ending with the assistant's reply, or\nwith the reply in \"output\"/\"response\" (a string or a chat "
            "completion object). Plain text (.txt): each line is one request's output, or each block when\n"
            "blank lines separate them (its first token stands as the prompt). Text needs --tokenizer.")


def check_plot(path: str | None) -> None:
    """A plot file name with an image type matplotlib writes (it would add .png to a name without one)."""
    if not path:
        return
    from matplotlib.backend_bases import FigureCanvasBase

    types = FigureCanvasBase.get_supported_filetypes()
    if not Path(path).is_dir() and Path(path).suffix[1:].lower() not in types:
        kinds = ", ".join("." + t for t in sorted(types))
        raise ValueError(f"--plot {path}: give a file name ending in an image type ({kinds})")
    check_output(path, "--plot", "results.png")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ngramspec simulate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Replay request logs (token ids or text) under cost profiles and compare draft methods.",
        epilog=_method_help())
    parser.add_argument("traces", nargs="+", metavar="TRACE",
                        help="request logs: JSON Lines (.jsonl or .jsonl.gz) or plain text (.txt, with --tokenizer)")
    parser.add_argument("--method", action="append",
                        help="method spec NAME:key=value,... (repeatable); without it, the answer (see below)")
    parser.add_argument("--profile", action="append",
                        help="built-in profile name or FILE.json[:COLUMN] (repeatable; default: every built-in)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="for text logs: a local Hugging Face tokenizer folder or tokenizer.json, or a "
                             ".tiktoken encoding file")
    parser.add_argument("--batch", type=_positive, action="append",
                        help="requests in flight (repeatable; default 1)")
    parser.add_argument("--json", metavar="FILE", help="write the result rows as JSON ('-' for stdout)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw speedup and accept length by trace and method")
    parser.add_argument("--jobs", type=_positive, default=1, help="replays run in parallel processes")
    parser.add_argument("--max-requests", type=_positive, metavar="N",
                        help="replay only the first N requests of each trace")
    parser.add_argument("--wide", action="store_true",
                        help="print one line per (trace, method) with every profile and batch side by side")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--host-cost", choices=HOST_COSTS, default="none",
                        help="measured: add each step's measured host time to its cost (reports both speedups)")
    args = parser.parse_args(argv)
    batches = args.batch or [1]
    from ngramspec.sim.profiles import BUILTIN_PROFILES

    profiles = args.profile or list(BUILTIN_PROFILES)
    notes: list[str] = []
    labels: dict[str, str] = {}
    answer = not args.method
    try:
        check_output(args.json, "--json")
        check_plot(args.plot)
        if answer:
            usable, notes = answer_methods()
            methods = [spec for _, spec in usable]
            labels = {spec: label for label, spec in usable}
        else:
            methods = args.method
        rows = run_all(args.traces, methods, profiles, batches, jobs=args.jobs, max_requests=args.max_requests,
                       progress=not args.no_progress, tokenizer=args.tokenizer,
                       host_cost=args.host_cost)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"ngramspec simulate: error: {exc}", file=sys.stderr)
        return 2
    table_out = sys.stderr if args.json == "-" else sys.stdout
    if answer:
        print(format_answer(rows, labels, notes), file=table_out)
    else:
        print(format_wide(rows) if args.wide else format_table(rows), file=table_out)
    if args.json == "-":
        json.dump(rows, sys.stdout, indent=1)
        print()
    elif args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

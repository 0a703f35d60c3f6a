#!/usr/bin/env python3
"""Does the simulator predict what the real SGLang server measured? One `sglang_engine_bench.py` run, replayed.

    python scripts/server_replay.py BENCH.json [SWEEP.json] [--fit-profile OUT.json] [--json ROWS.json]
        [--sweep-config adaptive_sweep] [--profile P] [--method CONFIG=SPEC ...] [--no-carry] [--min-samples N]

BENCH.json (and the optional SWEEP.json, which adds or replaces configs, typically `adaptive_sweep` run separately
with short outputs) are what `scripts/sglang_engine_bench.py --out` writes: config name -> result, each with
`runs` ("copy/c1", "free/c1", "copy/c16", "free/c16": tok_s, seconds, accept_len, output_ids, profile,
scheduler), `prompt_ids` and `warm_prompt_ids`.

1. Cost profile (the `ngramspec calibrate` row format, so `ngramspec simulate --profile OUT.json` reads it too):
   width 1 from the `plain` config's mean period between decode launches (`scheduler.period_ms`, or the wall
   clock over the run's decode steps where the bench ran without --sched-profile) at the run's mean batch
   (`profile.mean_batch`, else the mean batch of plain decoding of the run's outputs, else the concurrency);
   widths > 1 from the sweep config's measured step periods (`profile.controller.durations`, "width/batch" ->
   mean_ms, merged over the runs weighted by their sample counts) and, at batch 1, from the c1 scheduler periods
   of SGLang's NGRAM configs, which verify one fixed width every step (`ngram`: 12, `ngram8`: 8;
   --no-fixed-width leaves them out). Cells of the (batch x width) grid that were
   not measured are filled linearly between the nearest narrower and wider widths measured at the same batch,
   else from a width measured at that batch scaled by the two widths' ratio where a batch measured both, else
   along the batch axis from the same width's measured batches (linear between the two nearest, the nearest one
   outside them); a filled cell never costs less than a narrower or more than a wider width measured at its batch.
   Each filled row says how (`filled`).
2. Replay: per run, in the server's order, the prompts with plain decoding's greedy outputs, at batch 1 (c1) or
   the concurrency (c16), under that profile: `none` (the baseline) and the method of each config present
   (`adaptive` -> ngramspec-adaptive, `ngram` -> sglang-ngram:d=12, `ngram8` -> sglang-ngram:d=8). One method
   object serves all runs of a config, so its n-gram cache and controller state carry over from set to set as
   the server's did (--no-carry: each run from a cold method); where the server flushed its caches before a
   concurrency level, the replay empties the n-gram caches there and the controller keeps what it learned, as
   the plugin does at a flush.
3. A table per run: measured speedup over plain (config tok/s / plain tok/s, same run), the simulator's
   speedup (plain time / method time under the profile), and predicted / measured; plus accept lengths and
   mean widths, and a check of the profile against plain decoding's own wall clock.

Not modelled: the server's warm-up traffic (its outputs are not saved: the caches start empty here, the
controller learns costs from scratch), prefill and anything outside decode steps (it is in the measured tok/s,
not in the predicted speedup; the `+outside` column adds plain decoding's, read from its scheduler profile, to both
sides of the speedup), configs whose outputs differ from plain's (every method replays plain's outputs).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from pathlib import Path

import numpy as np

from ngramspec.sim.methods import make_method
from ngramspec.sim.profiles import TableProfile, get_profile
from ngramspec.sim.simulate import BASELINE, replay, summarize
from ngramspec.sim.traces import make_trace

CONFIG_METHODS = {  # bench config -> simulator method
    "adaptive": "ngramspec-adaptive",  # NGRAM_ADAPTIVE at its defaults (widths 1,2,3,4,6,8,12,16)
    "ngram": "sglang-ngram:d=12",  # SGLang's NGRAM at its defaults: 12-token trees, BFS breadth up to 10
    "ngram8": "sglang-ngram:d=8",  # SGLang's NGRAM with 8-token trees
}
SWEEP_CONFIG = "adaptive_sweep"
# configs that verify one fixed width every step (SGLang's NGRAM pads its tree to its draft-token count): their c1
# runs' scheduler periods are measured step costs at batch 1 and that width
FIXED_WIDTH_CONFIGS = {"ngram": 12, "ngram8": 8}


def after_flush(method, spec: str):
    """The method as the server has it after a cache flush: a new one (empty n-gram caches), whose controller, if it
    has one, starts from what the old one learned (step costs, acceptance calibration), as the plugin's
    `clear_cache_pool` does."""
    fresh = make_method(spec)
    old_ctl, new_ctl = getattr(method, "ctl", None), getattr(fresh, "ctl", None)
    if old_ctl is not None and new_ctl is not None and hasattr(old_ctl, "state_dict"):
        new_ctl.load_state_dict(old_ctl.state_dict())
    return fresh


# ------------------------------------------------------------------------------------------------- input
def load_bench(paths: list[str]) -> dict:
    """Config name -> result, from one or more bench JSONs; a later file's config replaces an earlier one's."""
    out: dict = {}
    for path in paths:
        try:
            raw = Path(path).read_bytes()
            data = json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)
        except FileNotFoundError:
            raise ValueError(f"{path}: no such file") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected an object of config name -> result (sglang_engine_bench.py --out)")
        for name, res in data.items():
            if isinstance(res, dict) and res.get("runs"):
                out[name] = res
    return out


def parse_run(key: str) -> tuple[str, int]:
    """'copy/c16' -> ('copy', 16)."""
    name, _, conc = key.rpartition("/c")
    if not name or not conc.isdigit():
        raise ValueError(f"run name {key!r} is not SET/cN")
    return name, int(conc)


def run_records(result: dict, key: str) -> tuple[list[dict], list[int]]:
    """(prompt, output) records of one run, in the order the server got them, and the indices of prompts left out
    (no or empty output)."""
    set_name, _ = parse_run(key)
    prompts = (result.get("prompt_ids") or {}).get(set_name)
    outputs = result["runs"][key].get("output_ids")
    if not prompts or not outputs:
        raise ValueError(f"run {key}: the bench result has no prompt_ids or output_ids for it")
    if len(prompts) != len(outputs):
        raise ValueError(f"run {key}: {len(prompts)} prompts but {len(outputs)} outputs")
    records, dropped = [], []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        if p and o:
            records.append({"id": f"{key}#{i}", "prompt": p, "output": o})
        else:
            dropped.append(i)
    if not records:
        raise ValueError(f"run {key}: no prompt has an output")
    return records, dropped


def plain_mean_batch(outputs: list, conc: int) -> tuple[float, int]:
    """Mean batch over the steps of plain decoding of `outputs` with `conc` in flight (the simulator's admission:
    a request joins as soon as one finishes), and the number of steps."""
    lengths = [len(o) for o in outputs if o]
    if not lengths:
        return float(conc), 0
    queue = list(lengths[conc:])
    active = list(lengths[:conc])
    batch_sum = steps = 0
    while active:
        step = min(active)  # steps until the next request finishes, all at this batch size
        batch_sum += step * len(active)
        steps += step
        active = [n - step for n in active if n > step]
        while len(active) < conc and queue:
            active.append(queue.pop(0))
    return batch_sum / steps, steps


# ----------------------------------------------------------------------------------------------- profile
def _merge(cells: dict, key, weight: float, ms: float, source: str) -> None:
    cell = cells.setdefault(key, {"w": 0.0, "sum": 0.0, "sources": []})
    cell["w"] += weight
    cell["sum"] += weight * ms
    cell["sources"].append(source)


def _fill_along_batch(b: int, measured: dict[int, float]) -> tuple[float, str]:
    """The value at batch b from a width's measured batches: linear between the two nearest, else the nearest."""
    lo = max((x for x in measured if x < b), default=None)
    hi = min((x for x in measured if x > b), default=None)
    if lo is not None and hi is not None:
        t = (b - lo) / (hi - lo)
        return measured[lo] * (1 - t) + measured[hi] * t, f"interpolated over batch from B={lo} and B={hi}"
    near = lo if lo is not None else hi
    return measured[near], f"copied from the nearest measured batch B={near}"


def _fill_width(b: int, w: int, cells: dict, batches: list, widths: list) -> tuple[float, str]:
    """An unmeasured cell (b, w) and how it was filled. Width > 1: linear between the nearest narrower and wider
    widths measured at batch b (width 1, plain decoding, included), else `_fill_by_width_ratio`, else along the
    batch axis, and never below a narrower or above a wider width measured at b (a ratio taken at another batch can
    break that order). Width 1: along the batch axis."""
    lo = hi = None
    if w > 1:
        lo = max((x for x in widths if x < w and (b, x) in cells), default=None)
        hi = min((x for x in widths if x > w and (b, x) in cells), default=None)
    cost = {x: cells[(b, x)]["sum"] / cells[(b, x)]["w"] for x in (lo, hi) if x is not None}
    if lo is not None and hi is not None:
        return cost[lo] + (cost[hi] - cost[lo]) * (w - lo) / (hi - lo), f"linear between widths {lo} and {hi} at B={b}"
    ms, how = _fill_by_width_ratio(b, w, cells, batches, widths)
    if ms is None:
        ms, how = _fill_along_batch(b, {bb: cells[(bb, w)]["sum"] / cells[(bb, w)]["w"] for bb in batches
                                        if (bb, w) in cells})
    bounded = max(ms, cost[lo]) if lo is not None else ms
    bounded = min(bounded, cost[hi]) if hi is not None else bounded
    if bounded != ms:
        return bounded, how + ", bounded by the widths measured at this batch"
    return ms, how


def _fill_by_width_ratio(b: int, w: int, cells: dict, batches: list, widths: list) -> tuple[float | None, str]:
    """The value at (b, w) from a width measured at batch b, scaled by the two widths' ratio at the nearest batch
    that measured both: a width's cost grows with the batch as its neighbours' do (copying a small batch's value
    along the batch axis would make a wide verify as cheap at batch 13 as at batch 1). None if no width at b has
    a batch measuring both. Widths > 1 only: width 1 (plain decoding) is measured on its own."""
    if w == 1:
        return None, ""
    mean = {k: c["sum"] / c["w"] for k, c in cells.items()}
    for ref in sorted((x for x in widths if x > 1 and x != w and (b, x) in mean), key=lambda x: abs(x - w)):
        both = [bb for bb in batches if (bb, w) in mean and (bb, ref) in mean]
        if both:
            near = min(both, key=lambda bb: abs(bb - b))
            return (mean[(b, ref)] * mean[(near, w)] / mean[(near, ref)],
                    f"width {ref} at B={b} times the width ratio {w}/{ref} at B={near}")
    return None, ""


def fit_profile(bench: dict, sweep_config: str = SWEEP_CONFIG, min_samples: int = 1,
                name: str = "server-fit", fixed_width: dict | None = None) -> tuple[dict, list[str]]:
    """The cost profile (calibration rows) from the plain config's periods, the sweep's durations and the c1 periods
    of configs that verify a fixed width every step (``fixed_width``, default `FIXED_WIDTH_CONFIGS`; {} for none);
    and notes."""
    fixed_width = FIXED_WIDTH_CONFIGS if fixed_width is None else fixed_width
    notes: list[str] = []
    plain = bench.get("plain")
    if plain is None:
        raise ValueError("the bench has no 'plain' config (width 1 comes from it)")
    width1: dict = {}  # batch -> cell
    for key, run in plain["runs"].items():
        set_name, conc = parse_run(key)
        sched = run.get("scheduler") or {}
        outputs = [o for o in (run.get("output_ids") or []) if o]
        sim_batch, sim_steps = plain_mean_batch(outputs, conc)
        if sched.get("period_ms"):
            ms, weight = float(sched["period_ms"]), float(sched.get("decode_steps") or 1)
            how = f"plain {key} scheduler.period_ms"
        elif sim_steps and run.get("seconds"):
            ms, weight = 1e3 * float(run["seconds"]) / sim_steps, float(sim_steps)
            how = f"plain {key} wall clock / {sim_steps} decode steps (prefill included)"
            notes.append(f"width 1 at {key}: no scheduler period (bench run without --sched-profile); "
                         "used the wall clock per decode step, prefill included")
        else:
            notes.append(f"width 1 at {key}: neither a scheduler period nor outputs; left out")
            continue
        mean_batch = (run.get("profile") or {}).get("mean_batch")
        if mean_batch:
            batch_how = f"profile.mean_batch {mean_batch:.2f}"
        elif conc > 1 and outputs:
            mean_batch = sim_batch
            batch_how = f"mean batch {sim_batch:.2f} of plain decoding of its outputs at c{conc}"
        else:
            mean_batch = float(conc)
            batch_how = f"concurrency {conc}"
        b = max(1, int(round(mean_batch)))
        _merge(width1, b, weight, ms, f"{how} at B={b} ({batch_how})")
    sweep = bench.get(sweep_config)
    verify: dict = {}  # (batch, width) -> cell
    sweep_w1: dict = {}
    if sweep is None:
        raise ValueError(f"no {sweep_config!r} config in the bench files (widths > 1 come from its durations); "
                         "give the sweep's JSON as the second file or name another config with --sweep-config")
    for key, run in sweep["runs"].items():
        durations = (((run.get("profile") or {}).get("controller") or {}).get("durations")) or {}
        for wb, row in durations.items():
            w, _, b = wb.partition("/")
            w, b, n = int(w), int(b), int(row.get("n", 0))
            if n < min_samples or not row.get("mean_ms") or row["mean_ms"] <= 0:
                continue
            target = sweep_w1 if w == 1 else verify
            _merge(target, b if w == 1 else (b, w), n, float(row["mean_ms"]), f"{sweep_config} {key} n={n}")
    for config, w in fixed_width.items():
        for key, run in ((bench.get(config) or {}).get("runs") or {}).items():
            sched = run.get("scheduler") or {}
            if parse_run(key)[1] != 1 or not sched.get("period_ms") or not sched.get("decode_steps"):
                continue  # batch 1 only: at c16 the batch of its steps is not known
            _merge(verify, (1, w), float(sched["decode_steps"]), float(sched["period_ms"]),
                   f"{config} {key} scheduler.period_ms (width {w} every step) n={sched['decode_steps']}")
    if not verify:
        raise ValueError(f"the {sweep_config!r} config has no controller durations at widths > 1 "
                         "(was NGRAMSPEC_PROFILE on?)")
    if not width1:
        raise ValueError("no width-1 period could be measured from the plain config")
    cells = {(b, 1): c for b, c in width1.items()}
    cells.update(verify)
    batches = sorted({b for b, _ in cells})
    widths = sorted({w for _, w in cells})
    rows = []
    filled = []
    for b in batches:
        for w in widths:
            cell = cells.get((b, w))
            row = {"B": b, "k": w, "kind": "chain"}
            if cell is not None:
                row["graph_ms"] = round(cell["sum"] / cell["w"], 4)
                row["n"] = cell["w"]
                row["source"] = "; ".join(cell["sources"])
            elif w == 1 and b in sweep_w1:
                c = sweep_w1[b]
                row["graph_ms"] = round(c["sum"] / c["w"], 4)
                row["n"] = c["w"]
                row["filled"] = "width 1 measured by the sweep config (no plain run at this batch)"
                filled.append((b, w))
            else:
                ms, how = _fill_width(b, w, cells, batches, widths)
                row["graph_ms"] = round(ms, 4)
                row["filled"] = how
                filled.append((b, w))
            rows.append(row)
    if filled:
        w1 = [b for b, w in filled if w == 1]
        notes.append(f"{len(filled)} of {len(rows)} profile cells not measured, filled between the measured widths at "
                     "the same batch, else from another width at the same batch (scaled by the widths' ratio where "
                     "both were measured), else along the batch axis"
                     + (f" (width 1 at B={','.join(map(str, w1))})" if w1 else ""))
    data = {
        "name": name,
        "description": (f"SGLang server step periods per (batch, width): width 1 = plain config's mean period "
                        f"between decode launches, widths > 1 = {sweep_config} config's measured verify step "
                        f"periods and, at batch 1, the periods of configs verifying a fixed width "
                        f"({', '.join(f'{c}: {w}' for c, w in fixed_width.items()) or 'none'}); "
                        f"{len(rows) - len(filled)} measured cells, {len(filled)} filled"),
        "source": ("fitted by scripts/server_replay.py from sglang_engine_bench.py results: plain "
                   "runs[*].scheduler.period_ms (batch: profile.mean_batch, else plain decoding's mean batch of "
                   f"the run's outputs), {sweep_config} runs[*].profile.controller.durations mean_ms "
                   "(weighted by n over runs) and the fixed-width configs' c1 scheduler.period_ms"),
        "column": "graph_ms",
        "rows": rows,
    }
    return data, notes


def profile_from_data(data: dict):
    return TableProfile.from_data(data, "graph_ms", name=data.get("name", "server-fit"), source="fitted profile")


# ------------------------------------------------------------------------------------------------ replay
def replay_runs(bench: dict, profile, configs: dict[str, str], carry: bool = True) -> tuple[list, list, list]:
    """Rows (per run and config), plain checks (per run) and skipped configs."""
    plain = bench["plain"]
    order = list(plain["runs"])  # the server's order: concurrency outer, set inner
    traces = {}
    for key in order:
        records, dropped = run_records(plain, key)
        traces[key] = (make_trace(key, records), dropped)
    baselines = {}
    checks = []
    for key in order:
        _, conc = parse_run(key)
        trace, dropped = traces[key]
        base = replay(trace, make_method(BASELINE), conc, profile)
        baselines[key] = base
        pred_s = profile.total_ms(base.step_counts) / 1e3
        meas_s = plain["runs"][key].get("seconds")
        sched = plain["runs"][key].get("scheduler") or {}
        if meas_s and sched.get("decode_steps") and sched.get("period_ms"):
            # time outside decode steps, from the server's own profile: the wall clock less its decode steps
            # (steps x mean period between decode launches); a prefill between two launches is inside a period
            outside = max(0.0, meas_s - sched["decode_steps"] * sched["period_ms"] / 1e3)
        else:  # no scheduler profile: the wall clock less the replayed decode steps
            outside = meas_s - pred_s if meas_s else None
        checks.append({"plain_outside_s": outside, "run": key, "batch": conc, "requests": len(trace.requests),
                       "dropped": dropped,
                       "tokens": base.tokens, "batch_steps": base.batch_steps,
                       "mean_batch": sum(b * n for (b, _), n in base.step_counts.items()) / base.batch_steps,
                       "plain_measured_s": meas_s, "plain_predicted_s": pred_s,
                       "predicted_over_measured": pred_s / meas_s if meas_s else None})
    rows, skipped = [], []
    for config, spec in configs.items():
        result = bench.get(config)
        if result is None:
            continue
        try:
            method = make_method(spec)
        except ImportError as exc:
            skipped.append({"config": config, "method": spec, "reason": str(exc).splitlines()[0]})
            continue
        flushed, last_conc = set(result.get("flushed_before") or ()), None
        for key in order:
            run = result["runs"].get(key)
            if run is None:
                continue
            _, conc = parse_run(key)
            if not carry and key != order[0]:
                method = make_method(spec)  # a cold method
            elif conc != last_conc and conc in flushed:
                method = after_flush(method, spec)
            last_conc = conc
            trace, _ = traces[key]
            rep = replay(trace, method, conc, profile)
            s = summarize(rep, profile, baselines[key])
            base_run = plain["runs"][key]
            measured = run["tok_s"] / base_run["tok_s"] if base_run.get("tok_s") and run.get("tok_s") else None
            prof = run.get("profile") or {}
            # the measured time outside decode steps (prefill, the host between requests): plain decoding's, the
            # same prompts for every method
            check = next(c for c in checks if c["run"] == key)
            outside = check["plain_outside_s"]
            with_outside = ((check["plain_predicted_s"] + outside) / (s["time_ms"] / 1e3 + outside)
                            if outside is not None and s["time_ms"] / 1e3 + outside > 0 else None)
            rows.append({
                "predicted_speedup_with_outside": with_outside,
                "ratio_with_outside": with_outside / measured if with_outside and measured else None,
                "run": key, "set": parse_run(key)[0], "concurrency": conc, "batch": conc, "config": config,
                "method": spec, "measured_speedup": measured, "predicted_speedup": s["speedup"],
                "ratio": s["speedup"] / measured if measured else None,
                "measured_accept_len": run.get("accept_len"), "predicted_accept_len": s["accept_len"],
                "measured_mean_width": prof.get("mean_width"), "predicted_mean_width": s["mean_width"],
                "measured_s": run.get("seconds"), "predicted_s": s["time_ms"] / 1e3,
                "same_outputs_as_plain": run.get("output_ids") == base_run.get("output_ids"),
                "predicted_width_steps": s["width_steps"], "carried_state": carry,
            })
    return rows, checks, skipped


def _f(x, fmt=".3f", none="-"):
    return none if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def format_report(rows, checks, skipped, notes, profile_data, profile_path) -> str:
    out = []
    measured_cells = [r for r in profile_data["rows"] if "filled" not in r]
    batches = sorted({r["B"] for r in profile_data["rows"]})
    widths = sorted({r["k"] for r in profile_data["rows"]})
    out.append(f"profile {profile_data['name']}: {len(profile_data['rows'])} cells ({len(measured_cells)} measured), "
               f"batches {','.join(map(str, batches))}, widths {','.join(map(str, widths))}"
               + (f"; written to {profile_path}" if profile_path else ""))
    for r in profile_data["rows"]:
        if r["k"] == 1 and "filled" not in r:
            out.append(f"  width 1, B={r['B']}: {r['graph_ms']:.3f} ms ({r['source']})")
    for key in dict.fromkeys(r["run"] for r in rows):
        out.append("")
        out.append(f"{key} (batch {next(r['batch'] for r in rows if r['run'] == key)})")
        head = (f"  {'config':10s} {'method':20s} {'measured':>9s} {'predicted':>10s} {'pred/meas':>10s} "
                f"{'+outside':>9s} {'pred/meas':>10s} "
                f"{'accept meas':>12s} {'accept pred':>12s} {'width meas':>11s} {'width pred':>11s}")
        out.append(head)
        for r in rows:
            if r["run"] != key:
                continue
            out.append(f"  {r['config']:10s} {r['method']:20s} {_f(r['measured_speedup']):>8s}x "
                       f"{_f(r['predicted_speedup']):>9s}x {_f(r['ratio']):>10s} "
                       f"{_f(r['predicted_speedup_with_outside']):>8s}x {_f(r['ratio_with_outside']):>10s} "
                       f"{_f(r['measured_accept_len'], '.2f'):>12s} {_f(r['predicted_accept_len'], '.2f'):>12s} "
                       f"{_f(r['measured_mean_width'], '.2f'):>11s} {_f(r['predicted_mean_width'], '.2f'):>11s}")
    out.append("")
    out.append("plain decoding, the profile against the wall clock (measured includes prefill and the host time "
               "outside decode steps; '+outside' above adds plain decoding's time outside decode steps, from the "
               "scheduler's profile where the run has one, to every method's replayed time):")
    for c in checks:
        out.append(f"  {c['run']:10s} {c['requests']} requests, {c['tokens']} tokens, {c['batch_steps']} steps at "
                   f"mean batch {c['mean_batch']:.2f}: measured {_f(c['plain_measured_s'])} s, predicted "
                   f"{_f(c['plain_predicted_s'])} s ({_f(c['predicted_over_measured'])}), outside decode steps "
                   f"{_f(c['plain_outside_s'])} s"
                   + (f"; prompts without output left out: {c['dropped']}" if c["dropped"] else ""))
    for s in skipped:
        out.append(f"skipped {s['config']} ({s['method']}): {s['reason']}")
    for n in notes:
        out.append(f"note: {n}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench", nargs="+", metavar="BENCH.json",
                   help="sglang_engine_bench.py results; a later file's configs replace an earlier one's "
                        "(e.g. the adaptive_sweep run)")
    p.add_argument("--fit-profile", metavar="OUT.json", help="write the fitted cost profile here")
    p.add_argument("--profile", help="replay under this profile (built-in name or FILE.json) instead of the fitted one")
    p.add_argument("--sweep-config", default=SWEEP_CONFIG, help="config whose durations give widths > 1")
    p.add_argument("--min-samples", type=int, default=1, help="leave out duration cells with fewer samples")
    p.add_argument("--no-fixed-width", action="store_true",
                   help="fit widths > 1 from the sweep config alone (not from the NGRAM configs' c1 periods)")
    p.add_argument("--method", action="append", default=[], metavar="CONFIG=SPEC",
                   help="replay config CONFIG with simulator method SPEC (adds to or replaces the defaults: "
                        + ", ".join(f"{k}={v}" for k, v in CONFIG_METHODS.items()) + ")")
    p.add_argument("--no-carry", action="store_true",
                   help="replay each run with a cold method (default: the state carries over in the server's order)")
    p.add_argument("--json", metavar="OUT", help="write the rows (and the plain checks, skipped configs, notes)")
    a = p.parse_args(argv)
    configs = dict(CONFIG_METHODS)
    try:
        for item in a.method:
            config, eq, spec = item.partition("=")
            if not eq or not config or not spec:
                raise ValueError(f"--method {item!r}: expected CONFIG=SPEC")
            configs[config] = spec
        bench = load_bench(a.bench)
        if "plain" not in bench:
            raise ValueError("the bench files have no 'plain' config with runs")
        notes: list[str] = []
        profile_data, fit_notes = fit_profile(bench, a.sweep_config, a.min_samples,
                                              name=Path(a.fit_profile).stem if a.fit_profile else "server-fit",
                                              fixed_width={} if a.no_fixed_width else None)
        notes += fit_notes
        if a.fit_profile:
            Path(a.fit_profile).write_text(json.dumps(profile_data, indent=1))
            get_profile(a.fit_profile)  # the loader `--profile FILE.json` uses accepts it
        profile = get_profile(a.profile) if a.profile else profile_from_data(profile_data)
        rows, checks, skipped = replay_runs(bench, profile, configs, carry=not a.no_carry)
    except (ValueError, KeyError, TypeError) as exc:
        print(f"server_replay: error: {exc}", file=sys.stderr)
        return 2
    if a.no_carry:
        notes.append("--no-carry: every run replayed from a cold method (the server kept one cache for the run)")
    else:
        notes.append("state carried over: one method object per config replays the runs in the server's order "
                     f"({', '.join(bench['plain']['runs'])}), so its n-gram cache and controller start where the "
                     "previous run left them")
        sets = [parse_run(k)[0] for k in bench["plain"]["runs"]]
        again = sorted({x for x in sets if sets.count(x) > 1})
        flushed = sorted({c for r in bench.values() if isinstance(r, dict) for c in r.get("flushed_before") or ()})
        if flushed:
            notes.append("the server flushed its caches before concurrency level(s) "
                         f"{', '.join(map(str, flushed))}: the replay starts those levels with empty n-gram caches "
                         "too, the controller keeping what it learned (as the plugin's flush does)")
        elif again:
            notes.append(f"set(s) {', '.join(again)} ran at more than one concurrency with the same prompts: with the "
                         "state carried over, a later run's cache already holds the earlier run's outputs (as the "
                         "server's cache did)")
    warm = bench["plain"].get("warm_prompt_ids") or {}
    notes.append(f"warm-up not replayed ({sum(len(v) for v in warm.values())} warm-up prompts, and again before "
                 "each c>1 run on the server): their outputs are not saved, so the caches start empty and the "
                 "controller learns the costs from scratch")
    present = [c for c in configs if c in bench]
    if not present:
        notes.append(f"no config of {', '.join(configs)} in the bench files: nothing to compare")
    if any(r["same_outputs_as_plain"] is False for r in rows):
        diff = sorted({f"{r['config']} {r['run']}" for r in rows if r["same_outputs_as_plain"] is False})
        notes.append(f"outputs differ from plain's (every method replays plain's outputs): {', '.join(diff)}")
    print(format_report(rows, checks, skipped, notes, profile_data, a.fit_profile))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "plain_check": checks, "skipped": skipped, "notes": notes,
                       "profile": profile_data if not a.profile else a.profile}, f, indent=1,
                      default=lambda x: x.item() if isinstance(x, np.generic) else str(x))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

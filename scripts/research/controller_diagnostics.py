"""Where the adaptive controller's acceptance estimates go wrong on one trace (the figures in docs/controller.md).

    python scripts/research/controller_diagnostics.py TRACE PROFILE BATCH [MAX_REQUESTS]

Replays TRACE with `ngramspec-adaptive` and prints, for every proposed draft (sent or not):
  - expected vs realized tokens at the widest width, binned by the expected value (calibration);
  - for drafts whose first level fans out into 5+ siblings: predicted vs realized P(one of them is accepted);
  - the realized conditional acceptance by depth (from the controller's own top-level counts);
then the speedup of a second replay that starts from the first replay's calibration tables (a hindsight
warm start: an upper bound on what better cold-start estimates could give, not a legitimate setting).
"""
import sys
from collections import defaultdict

import numpy as np

from ngramspec.layout import accepted_length
from ngramspec.sim.methods import make_method
from ngramspec.sim.profiles import get_profile
from ngramspec.sim.simulate import replay, summarize
from ngramspec.sim.traces import load_trace


def instrumented(trace):
    method = make_method("ngramspec-adaptive")
    ctl = method.ctl
    outputs = [r.output for r in trace.requests]
    pos = defaultdict(int)
    rows = []  # (expected tokens at the widest width, realized, P(first level) predicted, first level hit, fan-out)
    step, update = ctl.step, method.update

    def spy_step(cache, rids, *args, **kwargs):
        result = step(cache, rids, *args, **kwargs)
        batch, P = result[0], ctl._sc.P  # the drafts and their calibrated P(accepted) as the step planned them
        for i, rid in enumerate(rids):
            a, b = int(batch.offsets[i]), int(batch.offsets[i + 1])
            if a == b:
                continue
            out, p = outputs[rid], pos[rid]
            first = batch.parents[a:b] < 0
            n = accepted_length(batch.tokens[a:b], batch.parents[a:b], out, p)
            rows.append((1 + P[a:b].sum(), n + 1, P[a:b][first].sum(), n > 0, first.sum()))
        return result

    def spy_update(rid, committed, n_accepted):
        pos[rid] += len(committed)
        return update(rid, committed, n_accepted)

    ctl.step, method.update = spy_step, spy_update
    return method, rows


def main():
    trace = load_trace(sys.argv[1])
    profile, batch = get_profile(sys.argv[2]), int(sys.argv[3])
    if len(sys.argv) > 4:
        trace = trace.head(int(sys.argv[4]))
    base = replay(trace, make_method("none"), batch)
    method, rows = instrumented(trace)
    cold = summarize(replay(trace, method, batch, profile), profile, base)["speedup"]
    R = np.array(rows, dtype=float)
    print(f"{trace.name} {profile.name} batch {batch}: {len(R)} drafts, speedup {cold:.3f}")
    print("expected tokens (widest width) -> realized:")
    for lo, hi in [(1, 1.2), (1.2, 1.4), (1.4, 1.7), (1.7, 2.2), (2.2, 3), (3, 99)]:
        s = (R[:, 0] >= lo) & (R[:, 0] < hi)
        if s.any():
            print(f"  [{lo}, {hi}): {s.sum():6d} drafts, expected {R[s, 0].mean():.2f}, realized {R[s, 1].mean():.2f}")
    s = R[:, 4] >= 5
    if s.any():
        print(f"first level with 5+ siblings: {s.sum()} drafts, P(one accepted) predicted {R[s, 2].mean():.3f}, "
              f"realized {R[s, 3].mean():.3f}")
    ctl = method.ctl
    succ, trials = ctl.calibration.by_depth()
    print("conditional acceptance by depth (1 | 2-3 | 4-7 | 8+):",
          " ".join(f"{a / max(t, 1):.2f} ({int(t)})" for a, t in zip(succ, trials)))
    warm = make_method("ngramspec-adaptive")
    warm.ctl.calibration.load(ctl.calibration)
    print(f"hindsight warm start (calibration of the first replay): "
          f"{summarize(replay(trace, warm, batch, profile), profile, base)['speedup']:.3f}")


if __name__ == "__main__":
    main()

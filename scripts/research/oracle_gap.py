"""Where the adaptive controller's gain falls short of the oracle controller's, step by step, at batch 1.

    python scripts/research/oracle_gap.py TRACE PROFILE [MAX_REQUESTS]

Replays TRACE with `ngramspec-adaptive` and, for every step, scores two choices on the same proposed draft: the
controller's (the prefix it sent, or nothing) and the oracle's (`oracle-ctl`: the accepted prefix, or nothing,
whichever pays more under PROFILE). A step's gain is the tokens it commits minus its cost in plain decode steps
(plain decoding: 0). Prints the two totals and where they differ: drafts the controller sent that accept nothing
(their cost), drafts it did not send that would have accepted something (the oracle's gain there), and both
choices per bin of the controller's own estimate of the draft's accepted nodes. Only the first replay's steps
are scored (both choices on the controller's path), so this is a decomposition, not a second simulation.
"""
import sys
from collections import defaultdict

import numpy as np

from ngramspec.layout import accepted_length
from ngramspec.sim.methods import make_method
from ngramspec.sim.profiles import get_profile
from ngramspec.sim.simulate import replay, summarize
from ngramspec.sim.traces import load_trace

BINS = (0.0, 0.1, 0.2, 0.33, 0.5, 1.0, 2.0, 4.0, 6.0, 8.0, 12.0, np.inf)


def record(trace, profile):
    """(estimated nodes accepted of the whole draft, accepted of the whole draft, nodes sent, accepted of those)
    per step and request, and the replay's speedup."""
    method = make_method("ngramspec-adaptive")
    ctl = method.ctl
    outputs = [r.output for r in trace.requests]
    pos = defaultdict(int)
    rows = []
    step, update = ctl.step, method.update

    def spy_step(cache, rids, *args, **kwargs):
        out = step(cache, rids, *args, **kwargs)
        batch, plan = out[0], out[1]
        inv = {s: r for r, s in ctl._slot_of.items()}
        for i, s in enumerate(ctl._slot_of[r] for r in rids):
            a, e = int(batch.offsets[i]), int(batch.offsets[i + 1])
            rid, kept = inv[s], int(plan.lengths[i])
            if a == e:
                rows.append((0.0, 0, 0, 0))
                continue
            o, p, par = outputs[rid], pos[rid], batch.parents[a:e]
            whole = accepted_length(batch.tokens[a:e], par, o, p)
            sent = accepted_length(batch.tokens[a:a + kept], par[:kept], o, p) if kept else 0
            rows.append((float(ctl._sc.P[a:e].sum()), whole, kept, sent))
        return out

    def spy_update(rid, committed, n_accepted):
        pos[rid] += len(committed)
        return update(rid, committed, n_accepted)

    ctl.step, method.update = spy_step, spy_update
    base = replay(trace, make_method("none"), 1)
    speed = summarize(replay(trace, method, 1, profile), profile, base)["speedup"]
    return np.array(rows, np.float64).reshape(-1, 4), speed


def main():
    trace = load_trace(sys.argv[1])
    profile = get_profile(sys.argv[2])
    if len(sys.argv) > 3:
        trace = trace.head(int(sys.argv[3]))
    rows, speed = record(trace, profile)
    est, whole, kept, sent = rows.T
    unit = profile.cost_ms(1, 1)
    cost = {w: profile.cost_ms(1, w) / unit for w in range(1, int(max(kept.max(), whole.max())) + 2)}
    ctl = np.where(kept > 0, 1 + sent - np.array([cost[int(k) + 1] for k in kept]), 0.0)
    orc = np.maximum(np.where(whole > 0, 1 + whole - np.array([cost[int(w) + 1] for w in whole]), 0.0), 0.0)
    sent_any, would = kept > 0, whole > 0
    print(f"{trace.name} {profile.name} batch 1: speedup {speed:.3f}; {len(rows)} steps, {sent_any.sum()} drafted")
    print(f"gain in plain steps: controller {ctl.sum():.0f}, oracle {orc.sum():.0f} (gap {orc.sum() - ctl.sum():.0f})")
    waste, missed, both = sent_any & (sent == 0), ~sent_any & would, sent_any & would
    print(f"  sent, accepted nothing: {waste.sum()} drafts costing {-ctl[waste].sum():.0f}")
    print(f"  not sent, would have accepted: {missed.sum()} drafts, the oracle's gain there {orc[missed].sum():.0f}")
    print(f"  sent and accepted: {both.sum()} drafts, controller {ctl[both].sum():.0f}, oracle {orc[both].sum():.0f}")
    print("  per bin of the controller's estimate (accepted nodes of the whole draft):")
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        s = (est > lo if lo == 0 else est >= lo) & (est < hi)
        if s.any():
            print(f"    {lo:.2f}-{hi:.2f}: {s.sum():6d} steps, sent {sent_any[s].mean():.2f}, P(accepts any) "
                  f"{would[s].mean():.3f}, accepted {whole[s].mean():.2f}; gain: oracle {orc[s].sum():.0f}, "
                  f"controller {ctl[s].sum():.0f}")


if __name__ == "__main__":
    main()

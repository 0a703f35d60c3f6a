"""Per-node acceptance events of the adaptive controller's drafts, and the log loss of acceptance predictors.

    python scripts/research/acceptance_events.py TRACE PROFILE BATCH [MAX_REQUESTS] [--out EVENTS.npz] [--conf]

Replays TRACE with `ngramspec-adaptive` and records, for every node of every proposed draft (sent or not) whose
parent the model accepted (a "trial": the events the calibration counts), the features the controller sees
(source, match length, raw conditional, depth, drafted siblings, the request's recent success and its copy run:
committed tokens since the last one no pending draft predicted), the calibrated conditional acceptance it used,
and whether the model accepted the node (from the trace's true output). Then it scores, prequentially over the
events in order (predict, then learn from the outcome), every predictor of `ngramspec.controller.predictor`
and prints the log loss, the Brier score and a calibration summary of each; then a draft-level proxy of what
better estimates could give at batch 1 (``policy_bound``; a rough indication only: it scores each recorded draft
on its own, while in a replay a draft not sent leaves its tokens to the next steps). With ``--conf`` (a trace
from ``confidence_trace.py``, whose records carry the model's confidence in each output token) the proxy
also calibrates on that confidence: a signal a server has that the cache does not.

Predictors scored (all prequential over the same events; "used" is what the replayed controller itself used,
with its delayed updates): the current hierarchical Beta cells ("beta: success"), the same with the copy run
in place of or beside the success axis, and the Beta estimate with an online logistic correction (the features
of ``AdaptiveController(predictor="logistic")``) at three AdaGrad steps.
"""
import argparse
import gzip
import json
from collections import defaultdict

import numpy as np
from numba import njit

from ngramspec.layout import accepted_length
from ngramspec.sim.methods import make_method
from ngramspec.sim.profiles import get_profile
from ngramspec.sim.simulate import replay, summarize
from ngramspec.sim.traces import load_trace

DRAFT_EXTRA = ("request", "pos", "nodes", "root_children", "p_first", "q_first", "source_first", "prev_accepted")
FIELDS = ("source", "mlen", "q", "depth", "siblings", "success", "run", "cell", "p_used", "hit", "draft", "p_path")


def record(trace, profile, batch, spec="ngramspec-adaptive", conf=None):
    """Events and drafts of a replay; ``conf``: per request, the model's confidence in each output token (adds
    that of the last committed token and the lowest of the last four to each draft; NaN without it)."""
    method = make_method(spec)
    ctl = method.ctl
    outputs = [r.output for r in trace.requests]
    pos = defaultdict(int)
    ndraft = [0]
    drafts = []
    prev = {}  # each request's last draft: (nodes it accepts, position in the output when it was proposed)
    ev = {f: [] for f in FIELDS}
    step_orig, update = ctl.step, method.update

    def spy_step(cache, rids, *args, **kwargs):
        out = step_orig(cache, rids, *args, **kwargs)
        b = out[0]
        P, cells = ctl._sc.P, ctl._sc.cells
        inv = {s: r for r, s in ctl._slot_of.items()}
        for i, s in enumerate(ctl._slot_of[r] for r in rids):
            a, e = int(b.offsets[i]), int(b.offsets[i + 1])
            if a == e:
                continue
            rid = inv[s]
            o, p = outputs[rid], pos[rid]
            par = b.parents[a:e]
            depth = np.zeros(e - a, np.int64)
            ok = np.zeros(e - a, bool)
            nsib = np.bincount(par + 1, minlength=e - a + 1)
            for j in range(e - a):
                pj = par[j]
                depth[j] = 1 if pj < 0 else depth[pj] + 1
                if pj >= 0 and not ok[pj]:
                    continue  # parent rejected: not a trial
                if p + depth[j] - 1 >= o.shape[0]:
                    continue
                hit = b.tokens[a + j] == o[p + depth[j] - 1]
                ok[j] = hit
                q = float(b.probs[a + j]) / max(float(b.probs[a + pj]), 1e-12) if pj >= 0 else float(b.probs[a + j])
                pu = P[a + j] / max(P[a + pj], 1e-300) if pj >= 0 else P[a + j]
                for f, v in zip(FIELDS, (b.sources[a + j], b.match_lens[i], q, depth[j], nsib[pj + 1],
                                         ctl._pend.success[s], ctl._pend.run[s], cells[a + j], pu, hit, ndraft[0],
                                         P[a + j])):
                    ev[f].append(v)
            ndraft[0] += 1
            c1 = c4 = np.nan
            if conf is not None and p >= 1:
                c1, c4 = conf[rid][p - 1], conf[rid][max(0, p - 4):p].min()
            acc = accepted_length(b.tokens[a:e], par, o, p)
            # what is known now of the request's previous draft: its accepted nodes, but only up to the tokens
            # committed since it was proposed (a draft not sent is known to match the one committed token at most)
            known = min(prev[rid][0], p - prev[rid][1]) if rid in prev else -1
            drafts.append((P[a:e].sum(), acc, ctl._pend.run[s], ctl._pend.success[s], b.match_lens[i],
                           P[a:e][:3].sum(), P[a:e][:7].sum(), c1, c4,
                           rid, p, e - a, (par < 0).sum(), P[a], b.probs[a], b.sources[a], known))
            prev[rid] = (acc, p)
        return out

    def spy_update(rid, committed, n_accepted):
        pos[rid] += len(committed)
        return update(rid, committed, n_accepted)

    ctl.step, method.update = spy_step, spy_update
    base = replay(trace, make_method("none"), batch)
    speed = summarize(replay(trace, method, batch, profile), profile, base)["speedup"]
    out = {f: np.array(v) for f, v in ev.items()}
    # E(15 nodes), accepted, run, success, mlen, E3, E7, confidence of the last token, lowest of the last four,
    # then (DRAFT_EXTRA) request, position in its output, nodes, root children, calibrated P of the first node,
    # its raw conditional, its source, the request's previous draft's accepted nodes as far as the tokens committed
    # since it was proposed tell (-1: none)
    out["drafts"] = np.array(drafts, np.float64).reshape(-1, 9 + len(DRAFT_EXTRA))
    return out, speed


MB, QB, DB, KB = np.array([2, 4, 8]), np.array([0.1, 0.25, 0.5, 0.75, 0.999]), np.array([2, 4, 8]), np.array([2, 3, 5])
RUNB = np.array([1, 4, 8, 16, 32])  # copy run: 0 | 1-3 | 4-7 | 8-15 | 16-31 | 32+
Q_MID = np.array([0.05, 0.175, 0.375, 0.625, 0.875, 1.0])
SCALE = np.array([0.2, 0.35, 0.5, 0.6])
CONFB = np.array([0.5, 0.8, 0.95, 0.99, 0.999])  # bins of the model's confidence (top-1 probability)


@njit(cache=True)
def beta3(fine, mid, top, prior, hit, strength):
    """Prequential hierarchical Beta means: fine cell shrunk to mid, mid to top, top to ``prior``."""
    n = hit.shape[0]
    out = np.empty(n)
    fs, ft = np.zeros(fine.max() + 1), np.zeros(fine.max() + 1)
    ms, mt = np.zeros(mid.max() + 1), np.zeros(mid.max() + 1)
    ts, tt = np.zeros(top.max() + 1), np.zeros(top.max() + 1)
    for i in range(n):
        f, m, t = fine[i], mid[i], top[i]
        pt = (ts[t] + strength * prior[i]) / (tt[t] + strength)
        pm = (ms[m] + strength * pt) / (mt[m] + strength)
        out[i] = (fs[f] + strength * pm) / (ft[f] + strength)
        h = 1.0 if hit[i] else 0.0
        fs[f] += h
        ft[f] += 1
        ms[m] += h
        mt[m] += 1
        ts[t] += h
        tt[t] += 1
    return out


@njit(cache=True)
def logistic(base, X, hit, lr, l2):
    """Prequential online logistic regression on logit(base) and the one-hot columns X (indices, -1: none),
    AdaGrad steps."""
    n, k = X.shape
    D = X.max() + 2
    w = np.zeros(D)
    w[D - 1] = 1.0  # weight of logit(base)
    g2 = np.full(D, 1e-6)
    out = np.empty(n)
    for i in range(n):
        b = min(max(base[i], 1e-4), 1 - 1e-4)
        lb = np.log(b / (1 - b))
        z = w[D - 1] * lb
        for c in range(k):
            if X[i, c] >= 0:
                z += w[X[i, c]]
        p = 1.0 / (1.0 + np.exp(-z))
        out[i] = p
        g = p - (1.0 if hit[i] else 0.0)
        gl = g * lb + l2 * (w[D - 1] - 1.0)
        g2[D - 1] += gl * gl
        w[D - 1] -= lr * gl / np.sqrt(g2[D - 1])
        for c in range(k):
            j = X[i, c]
            if j >= 0:
                gj = g + l2 * w[j]
                g2[j] += gj * gj
                w[j] -= lr * gj / np.sqrt(g2[j])
    return out


def score(name, p, hit, long=None):
    p = np.clip(p, 1e-6, 1 - 1e-6)
    y = hit.astype(float)
    ll = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    br = np.mean((p - y) ** 2)
    hi = p >= 0.7
    line = f"  {name:28s} logloss {ll:.4f}  brier {br:.4f}  mean p {p.mean():.3f} (hit {y.mean():.3f})"
    if hi.any():
        line += f"  p>=0.7: {hi.sum():6d} predicted {p[hi].mean():.3f} realized {y[hi].mean():.3f}"
    print(line)
    return ll


def score_all(ev):
    """Print the log loss, Brier score and calibration of every predictor over the events ``ev``."""
    hit = ev["hit"].astype(np.bool_)
    src = ev["source"].astype(np.int64)
    m = np.searchsorted(MB, ev["mlen"], side="right")
    qi = np.searchsorted(QB, ev["q"], side="right")
    di = np.searchsorted(DB, ev["depth"], side="right")
    ki = np.searchsorted(KB, ev["siblings"], side="right")
    sc = ev["success"]
    rb = np.where(sc < 0, 0, 1 + np.minimum(4, (sc * 5).astype(np.int64)))
    ru = np.searchsorted(RUNB, ev["run"], side="right")
    prior = SCALE[di] * Q_MID[qi]
    mid = (((src * 4 + m) * 6 + qi) * 4 + di) * 4 + ki
    top = ((src * 6 + qi) * 4 + di) * 4 + ki
    out = {}
    out["used (online, as run)"] = score("used (online, as run)", ev["p_used"], hit)
    cur = beta3(mid * 6 + rb, mid, top, prior, hit, 10.0)
    out["beta: success"] = score("beta: success", cur, hit)
    out["beta: run"] = score("beta: run", beta3(mid * 6 + ru, mid, top, prior, hit, 10.0), hit)
    out["beta: success x run"] = score("beta: success x run", beta3((mid * 6 + rb) * 6 + ru, mid * 6 + ru, top, prior,
                                                                    hit, 10.0), hit)
    out["beta: run, mid run"] = score("beta: run, mid run", beta3(mid * 6 + ru, mid, top * 6 + ru, prior, hit, 10.0),
                                      hit)
    # logistic corrections on top of the current Beta estimate
    cols = [ru, 6 + ru * 4 + di, 30 + rb, 36 + rb * 4 + di, 60 + qi * 6 + ru, 96 + m * 6 + ru]
    X = np.stack(cols, 1).astype(np.int64)
    for lr in (0.02, 0.05, 0.1):
        out[f"beta + logistic lr={lr}"] = score(f"beta + logistic lr={lr}", logistic(cur, X, hit, lr, 1e-4), hit)
    X2 = np.stack(cols[:2], 1).astype(np.int64)
    out["beta + logistic(run) 0.05"] = score("beta + logistic(run) 0.05", logistic(cur, X2, hit, 0.05, 1e-4), hit)
    return out


def by_run(drafts):
    """Per copy-run bin: drafts, their estimated and realized accepted nodes (15-node drafts), how often they
    accept 4+ nodes and their share of the tokens of all drafts accepting 4+ nodes."""
    E15, acc, run = drafts[:, 0], drafts[:, 1], drafts[:, 2]
    long = acc >= 4
    print("per copy run (tokens): drafts, estimated -> accepted nodes, P(4+ accepted), share of 4+ drafts' tokens")
    for lo, hi in ((0, 1), (1, 4), (4, 8), (8, 16), (16, 32), (32, None)):
        s = (run >= lo) & ((run < hi) if hi else True)
        if s.any():
            print(f"  {lo}-{hi - 1 if hi else ''}: {s.sum():7d}  {E15[s].mean():6.2f} -> {acc[s].mean():6.2f}  "
                  f"{long[s].mean():.3f}  {acc[s & long].sum() / max(acc[long].sum(), 1):.3f}")


def proxy_rate(acc, pred, profile, margin=0.0):
    """The draft-level proxy's rate: per draft, the width among 1 | 4 | 8 | 16 whose predicted tokens per unit
    time (``pred[w]``: predicted accepted nodes at width w, discounted by ``margin`` per extra decode of cost) is
    highest; tokens 1 + min(accepted, w - 1) at the profile's cost; (tokens / time) relative to plain decoding."""
    cost = {w: profile.cost_ms(1, w) for w in (1, 4, 8, 16)}
    tok, t = np.ones(len(acc)), np.full(len(acc), cost[1])
    best = np.full(len(acc), 1.0 / cost[1])
    for w in (4, 8, 16):
        v = (1 + pred[w]) / cost[w] / (1 + margin * (cost[w] / cost[1] - 1))
        s = v > best
        best[s] = v[s]
        tok[s], t[s] = 1 + np.minimum(acc[s], w - 1), cost[w]
    return tok.sum() / t.sum() * cost[1]


def policy_bound(drafts, profile):
    """A draft-level proxy of what better estimates could give at batch 1: over the recorded drafts (one per step
    that had a draft), each policy picks a width among 1 | 4 | 8 | 16 per draft; tokens 1 + min(accepted, w - 1),
    time the profile's cost; printed as (tokens / time) relative to plain decoding over the same steps. Policies:
    the oracle (knows the accepted length), the controller's estimates (ratio rule with its min_gain 0.1), and
    estimates calibrated *in hindsight* (on the same drafts) per bin of the controller's estimate, of the copy
    run and of the match length: the best any calibration of these features could do (in-sample)."""
    E15, acc, run, _, mlen, E3, E7, c1, c4 = drafts[:, :9].T
    est = {4: E3, 8: E7, 16: E15}

    def rate(pred, margin):
        return proxy_rate(acc, pred, profile, margin)

    print(f"draft-level proxy, {profile.name}, batch 1 ({len(acc)} drafts; tokens/time relative to plain):")
    print(f"  oracle {rate({w: np.minimum(acc, w - 1) for w in est}, 0.0):.3f}   controller's estimates "
          f"{rate(est, 0.1):.3f}")
    rb, mb = np.searchsorted(RUNB, run, side="right"), np.searchsorted([2, 4, 8, 12], mlen, side="right")
    cases = [("estimate", []), ("estimate x run", [rb]), ("estimate x run x match", [rb, mb])]
    if not np.isnan(c1).all():  # the model's confidence in the tokens just committed (a trace with ``conf``)
        cb1, cb4 = (np.searchsorted(CONFB, np.nan_to_num(c, nan=0.5), side="right") for c in (c1, c4))
        cases += [("estimate x conf", [cb1]), ("estimate x run x conf", [rb, cb1]),
                  ("estimate x run x match x conf x conf4", [rb, mb, cb1, cb4])]
    for name, keys in cases:
        pred = {}
        for w in est:
            k = np.searchsorted([0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10], est[w], side="right")
            for kk in keys:
                k = k * 10 + kk
            y = np.minimum(acc, w - 1)
            pred[w] = (np.bincount(k, y) / np.maximum(np.bincount(k), 1))[k]
        print(f"  hindsight-calibrated on {name:38s} margin 0: {rate(pred, 0.0):.3f}  "
              f"margin 0.1: {rate(pred, 0.1):.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("profile")
    ap.add_argument("batch", type=int)
    ap.add_argument("max_requests", type=int, nargs="?", default=0)
    ap.add_argument("--spec", default="ngramspec-adaptive")
    ap.add_argument("--out")
    ap.add_argument("--conf", action="store_true",
                    help="the trace's records carry `conf` (confidence_trace.py): score it as a feature")
    args = ap.parse_args()
    trace = load_trace(args.trace)
    if args.max_requests:
        trace = trace.head(args.max_requests)
    conf = None
    if args.conf:
        with gzip.open(args.trace, "rt") as f:
            conf = [np.array(json.loads(line)["conf"]) for line in f][:len(trace.requests)]
    ev, speed = record(trace, get_profile(args.profile), args.batch, args.spec, conf)
    print(f"{trace.name} {args.profile} batch {args.batch} {args.spec}: speedup {speed:.3f}, "
          f"{len(ev['hit'])} trials, acceptance {ev['hit'].mean():.3f}")
    if args.out:
        np.savez_compressed(args.out, **ev)
    score_all(ev)
    by_run(ev["drafts"])
    for name in ("seed-pcie8", "h200-llama8b"):
        policy_bound(ev["drafts"], get_profile(name))


if __name__ == "__main__":
    main()

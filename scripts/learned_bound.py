"""How far a learned acceptance predictor over the cache's features could go: gradient-boosted trees, cross-validated.

    python scripts/learned_bound.py TRACE [MAX_REQUESTS] [--replay-profile seed-pcie8] [--folds 5]

Needs scikit-learn (not a dependency of ngramspec: ``pip install scikit-learn``).

Replays TRACE with `ngramspec-adaptive` (``scripts/acceptance_events.py``'s ``record``) and takes every proposed
draft (sent or not) with what the cache and the controller know when it is proposed: the controller's estimates
of accepted nodes at 3, 7 and 15 nodes, the first node's calibrated probability, raw conditional and source, the
match length, the nodes and root children of the draft, the request's copy run (committed tokens since the last
one no pending draft predicted), its recent success, its previous draft's accepted nodes and the position in its
output. For each width w in 4 | 8 | 16 it fits ``HistGradientBoostingRegressor`` to min(accepted, w - 1) and
predicts each draft *out of fold* (GroupKFold by request: a request's drafts are never in the data that predicts
them), then scores those predictions with the draft-level proxy of ``acceptance_events.policy_bound`` (per draft
the width with the most predicted tokens per unit time; plain decoding = 1) under both profiles, beside the
oracle (knows the accepted length), the controller's own estimates and the same trees fitted and scored on all
drafts (in-sample: what memorising the trace gives). Captured share = (rate - 1) / (oracle - 1).

The proxy scores each draft on its own (a draft not sent leaves its tokens to later steps), so it indicates what
better prediction of these features is worth; it is not a simulation.
"""
import argparse

import numpy as np
from acceptance_events import DRAFT_EXTRA, proxy_rate, record

from ngramspec.sim.profiles import get_profile
from ngramspec.sim.traces import load_trace

FEATURES = ("E15", "run", "success", "mlen", "E3", "E7") + DRAFT_EXTRA[1:]


def features(drafts):
    E15, acc, run, success, mlen, E3, E7 = drafts[:, :7].T
    extra = drafts[:, 9:]
    X = np.column_stack([E15, run, success, mlen, E3, E7, extra[:, 1:]])
    return X, acc, extra[:, 0].astype(np.int64)


def fit_predict(X, y, groups, folds, seed=0, cols=None):
    """Out-of-fold predictions (GroupKFold by request) and in-sample ones; ``cols``: the features to use."""
    from sklearn.ensemble import HistGradientBoostingRegressor
    from sklearn.model_selection import GroupKFold

    cols = list(range(len(FEATURES))) if cols is None else list(cols)
    X = X[:, cols]
    src = FEATURES.index("source_first")

    def model():
        return HistGradientBoostingRegressor(max_iter=300, learning_rate=0.05, min_samples_leaf=40,
                                             categorical_features=[cols.index(src)] if src in cols else None,
                                             random_state=seed)

    oof = np.zeros(len(y))
    for tr, te in GroupKFold(n_splits=folds).split(X, y, groups):
        oof[te] = model().fit(X[tr], y[tr]).predict(X[te])
    ins = model().fit(X, y).predict(X)
    return np.maximum(oof, 0.0), np.maximum(ins, 0.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("max_requests", type=int, nargs="?", default=0)
    ap.add_argument("--replay-profile", default="seed-pcie8")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--ablate", action="store_true",
                    help="also: out-of-fold trees on the controller's estimates plus one group of features at a time")
    args = ap.parse_args()
    trace = load_trace(args.trace)
    if args.max_requests:
        trace = trace.head(args.max_requests)
    ev, speed = record(trace, get_profile(args.replay_profile), 1)
    X, acc, groups = features(ev["drafts"])
    X[:, FEATURES.index("source_first")] = np.maximum(X[:, FEATURES.index("source_first")], 0)
    folds = min(args.folds, len(np.unique(groups)))
    print(f"{trace.name}: replay under {args.replay_profile} speedup {speed:.3f}; {len(acc)} drafts of "
          f"{len(np.unique(groups))} requests; {folds}-fold by request")
    est = {4: ev["drafts"][:, 5], 8: ev["drafts"][:, 6], 16: ev["drafts"][:, 0]}
    oof, ins = {}, {}
    for w in (4, 8, 16):
        y = np.minimum(acc, w - 1)
        oof[w], ins[w] = fit_predict(X, y, groups, folds)
        print(f"  width {w:2d}: mean squared error of accepted nodes: controller {np.mean((est[w] - y) ** 2):.3f}  "
              f"trees out of fold {np.mean((oof[w] - y) ** 2):.3f}  in-sample {np.mean((ins[w] - y) ** 2):.3f}")
    for name in ("seed-pcie8", "h200-llama8b"):
        prof = get_profile(name)
        orc = proxy_rate(acc, {w: np.minimum(acc, w - 1) for w in est}, prof)

        def share(r):
            return (r - 1) / (orc - 1) if orc > 1 else float("nan")

        rows = [("controller's estimates (margin 0.1)", proxy_rate(acc, est, prof, 0.1)),
                ("controller's estimates (margin 0)", proxy_rate(acc, est, prof, 0.0)),
                ("trees, out of fold (margin 0)", proxy_rate(acc, oof, prof, 0.0)),
                ("trees, out of fold (margin 0.1)", proxy_rate(acc, oof, prof, 0.1)),
                ("trees, in-sample (margin 0)", proxy_rate(acc, ins, prof, 0.0))]
        print(f"  {name}: oracle {orc:.3f}")
        for label, r in rows:
            print(f"    {label:38s} {r:.3f}  share {share(r):5.2f}")
    if not args.ablate:
        return
    base = [FEATURES.index(f) for f in ("E3", "E7", "E15")]
    print("  ablation: out-of-fold trees on the controller's estimates plus one group (margin 0):")
    for group in ((), ("run",), ("success",), ("prev_accepted",), ("pos",), ("mlen", "source_first"),
                  ("p_first", "q_first"), ("nodes", "root_children")):
        cols = base + [FEATURES.index(f) for f in group]
        pred = {w: fit_predict(X, np.minimum(acc, w - 1), groups, folds, cols=cols)[0] for w in (4, 8, 16)}
        rates = [proxy_rate(acc, pred, get_profile(n)) for n in ("seed-pcie8", "h200-llama8b")]
        print(f"    + {', '.join(group) or 'nothing':28s} seed-pcie8 {rates[0]:.3f}  h200-llama8b {rates[1]:.3f}")


if __name__ == "__main__":
    main()

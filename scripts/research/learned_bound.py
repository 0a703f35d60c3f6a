"""How far a learned acceptance predictor over the cache's features could go: gradient-boosted trees, cross-validated.

    python scripts/research/learned_bound.py TRACE [MAX_REQUESTS] [--replay-profile seed-pcie8] [--folds 5] [--simulate]

Needs scikit-learn (not a dependency of ngramspec: ``pip install scikit-learn``).

Replays TRACE with `ngramspec-adaptive` (``acceptance_events.py``'s ``record``) and takes every proposed
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
better prediction of these features is worth; it is not a simulation. ``--simulate`` replays the trace at batch 1
under both profiles with the width chosen per step among 1 | 2 | 4 | 8 | 16 from predicted accepted nodes and the
profile's true costs (``ChosenWidth``): on the controller's own estimates, on the trees fitted on the other
requests' drafts, and on trees fitted on all drafts (in-sample), beside `ngramspec-adaptive` and `oracle-ctl:k=15`.
"""
import argparse

import numpy as np
from acceptance_events import DRAFT_EXTRA, proxy_rate, record
from numba import njit

from ngramspec.layout import accepted_length
from ngramspec.sim.methods import EMPTY_DRAFT, make_method
from ngramspec.sim.methods.adaptive import _EMPTY, AdaptiveMethod
from ngramspec.sim.profiles import get_profile
from ngramspec.sim.simulate import replay, summarize
from ngramspec.sim.traces import load_trace

FEATURES = ("E15", "run", "success", "mlen", "E3", "E7") + DRAFT_EXTRA[1:]


def features(drafts):
    E15, acc, run, success, mlen, E3, E7 = drafts[:, :7].T
    extra = drafts[:, 9:]
    X = np.column_stack([E15, run, success, mlen, E3, E7, extra[:, 1:]])
    return X, acc, extra[:, 0].astype(np.int64)


def fit_models(X, y, groups, folds, seed=0):
    """One model per fold (fitted on the other folds) and one on everything."""
    from sklearn.model_selection import GroupKFold
    per_fold = [_model(seed).fit(X[tr], y[tr]) for tr, _ in GroupKFold(n_splits=folds).split(X, y, groups)]
    return per_fold, _model(seed).fit(X, y)


def _model(seed=0):
    from sklearn.ensemble import HistGradientBoostingRegressor
    return HistGradientBoostingRegressor(max_iter=300, learning_rate=0.05, min_samples_leaf=40, random_state=seed)


class FlatTrees:
    """A fitted ``HistGradientBoostingRegressor`` as flat arrays, evaluated by a numba kernel: one row in
    microseconds, where the model's own ``predict`` takes milliseconds a call (too slow for a step-by-step replay)."""

    def __init__(self, model):
        nodes = [t.nodes for (t,) in model._predictors]
        self.root = np.cumsum([0] + [len(n) for n in nodes[:-1]]).astype(np.int64)
        allnodes = np.concatenate(nodes)
        shift = np.repeat(self.root, [len(n) for n in nodes])
        self.feature = allnodes["feature_idx"].astype(np.int64)
        self.threshold = allnodes["num_threshold"].astype(np.float64)
        self.left = allnodes["left"].astype(np.int64) + shift
        self.right = allnodes["right"].astype(np.int64) + shift
        self.leaf = allnodes["is_leaf"].astype(np.bool_)
        self.value = allnodes["value"].astype(np.float64)
        self.base = float(np.ravel(model._baseline_prediction)[0])

    def __call__(self, x):
        return _eval_trees(np.asarray(x, np.float64), self.root, self.feature, self.threshold, self.left,
                           self.right, self.leaf, self.value, self.base)


@njit(cache=True)
def _eval_trees(x, root, feature, threshold, left, right, leaf, value, base):
    out = base
    for r in root:
        i = r
        while not leaf[i]:
            i = left[i] if x[feature[i]] <= threshold[i] else right[i]
        out += value[i]
    return out


def fit_predict(X, y, groups, folds, seed=0, cols=None):
    """Out-of-fold predictions (GroupKFold by request) and in-sample ones; ``cols``: the features to use."""
    from sklearn.model_selection import GroupKFold

    cols = list(range(len(FEATURES))) if cols is None else list(cols)
    X = X[:, cols]
    oof = np.zeros(len(y))
    for tr, te in GroupKFold(n_splits=folds).split(X, y, groups):
        oof[te] = _model(seed).fit(X[tr], y[tr]).predict(X[te])
    ins = _model(seed).fit(X, y).predict(X)
    return np.maximum(oof, 0.0), np.maximum(ins, 0.0)


SIM_WIDTHS = (2, 4, 8, 16)


class ChosenWidth(AdaptiveMethod):
    """`ngramspec-adaptive`'s drafts and features at batch 1, with the width chosen among 1 | 2 | 4 | 8 | 16 by a
    predictor of accepted nodes at each width and the profile's true costs (as the oracle knows them): the most
    predicted tokens per unit time, discounted by ``margin`` per extra plain step of cost. ``predict(rid, x)``
    returns {width: predicted accepted nodes}; ``None`` uses the controller's own estimates (its calibrated P
    summed over the first w - 1 nodes)."""

    def __init__(self, predict, margin=0.0):
        super().__init__()
        self.predict, self.margin = predict, margin
        self.pos, self.prev = {}, {}

    def bind_profile(self, profile):
        super().bind_profile(profile)
        self.cost = {w: profile.cost_ms(1, w) for w in (1,) + SIM_WIDTHS}

    def start(self, rid, prompt):
        super().start(rid, prompt)
        self.pos[rid] = 0

    def observe_step(self, batch_size, width, duration_ms):
        pass  # the rule uses the profile's costs; a short draft's width need not be one of the controller's

    def propose(self, rids):
        (rid,) = rids
        committed = [self._committed.pop(rid, _EMPTY)]
        b, _ = self.ctl.step(self.cache, rids, committed, waiting=self.waiting, tree=self.tree)
        a, e = int(b.offsets[0]), int(b.offsets[1])
        if a == e:
            self._width = 1
            return [EMPTY_DRAFT]
        ctl, P = self.ctl, self.ctl._sc.P
        slot, p, par = ctl._slot_of[rid], self.pos[rid], b.parents[a:e]
        known = min(self.prev[rid][1], p - self.prev[rid][0]) if rid in self.prev else -1
        self.prev[rid] = (p, None)
        if self.predict is None:
            pred = {w: P[a:e][:w - 1].sum() for w in SIM_WIDTHS}
        else:
            x = np.array([P[a:e].sum(), ctl._pend.run[slot], ctl._pend.success[slot], b.match_lens[0],
                          P[a:e][:3].sum(), P[a:e][:7].sum(), p, e - a, (par < 0).sum(), P[a], b.probs[a],
                          max(b.sources[a], 0), known])
            pred = self.predict(rid, x)
        best, self._width = 1.0 / self.cost[1], 1
        for w in SIM_WIDTHS:
            v = (1 + pred[w]) / self.cost[w] / (1 + self.margin * (self.cost[w] / self.cost[1] - 1))
            if v > best:
                best, self._width = v, min(w, 1 + e - a)
        k = self._width - 1
        self._draft = (b.tokens[a:e].copy(), par.copy())
        return [(b.tokens[a:a + k].copy(), par[:k].copy())]

    def update(self, rid, committed, n_accepted):
        super().update(rid, committed, n_accepted)
        if rid in self.prev and self.prev[rid][1] is None:  # what the whole proposed draft accepts
            tokens, parents = self._draft
            self.prev[rid] = (self.prev[rid][0], accepted_length(tokens, parents, self.outputs[rid], self.pos[rid]))
        self.pos[rid] += len(committed)


def simulate(trace, X, acc, groups, folds):
    """Replays at batch 1 under both profiles: plain, the adaptive controller, the width rule on the controller's
    estimates and on the trees' out-of-fold and in-sample predictions, and the oracle controller."""
    from sklearn.model_selection import GroupKFold

    fold_of = {}
    for f, (_, te) in enumerate(GroupKFold(n_splits=folds).split(X, acc, groups)):
        for g in np.unique(groups[te]):
            fold_of[int(g)] = f
    oof_models, all_models = {}, {}
    for w in SIM_WIDTHS:
        y = np.minimum(acc, w - 1)
        oof_models[w], all_models[w] = fit_models(X, y, groups, folds)
    outputs = [r.output for r in trace.requests]

    oof_flat = {w: [FlatTrees(m) for m in oof_models[w]] for w in SIM_WIDTHS}
    all_flat = {w: FlatTrees(all_models[w]) for w in SIM_WIDTHS}
    for w in SIM_WIDTHS:  # the flat evaluation is the model's own
        sample = X[:: max(1, len(X) // 500)]
        flat = np.array([all_flat[w](x) for x in sample])
        assert np.allclose(flat, all_models[w].predict(sample), atol=1e-9), "flat trees disagree with sklearn"

    def oof(rid, x):
        return {w: max(oof_flat[w][fold_of[rid]](x), 0.0) for w in SIM_WIDTHS}

    def ins(rid, x):
        return {w: max(all_flat[w](x), 0.0) for w in SIM_WIDTHS}

    base = replay(trace, make_method("none"), 1)
    for name in ("seed-pcie8", "h200-llama8b"):
        prof = get_profile(name)

        def speed(method):
            return summarize(replay(trace, method, 1, prof), prof, base)["speedup"]

        orc = speed(make_method("oracle-ctl:k=15"))
        rows = [("ngramspec-adaptive", speed(make_method("ngramspec-adaptive")))]
        for label, fn, margin in (("rule on the controller's estimates", None, 0.0),
                                  ("rule on the controller's estimates, margin 0.1", None, 0.1),
                                  ("rule on trees, other requests", oof, 0.0),
                                  ("rule on trees, other requests, margin 0.1", oof, 0.1),
                                  ("rule on trees, in-sample", ins, 0.0),
                                  ("rule on trees, in-sample, margin 0.1", ins, 0.1)):
            m = ChosenWidth(fn, margin)
            m.outputs = outputs
            rows.append((label, speed(m)))
        print(f"  replay at batch 1, {name}: oracle-ctl:k=15 {orc:.3f}")
        for label, r in rows:
            print(f"    {label:48s} {r:.3f}  captured share {(r - 1) / (orc - 1):5.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("max_requests", type=int, nargs="?", default=0)
    ap.add_argument("--replay-profile", default="seed-pcie8")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--simulate", action="store_true",
                    help="also replay the trace at batch 1 with the width chosen from the trees' predictions")
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
    if args.simulate:
        simulate(trace, X, acc, groups, folds)
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

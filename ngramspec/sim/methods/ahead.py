"""`ngramspec-ahead`: `ngramspec-tree`'s drafts, drafted one step ahead (`ngramspec.lookahead`).

Each step's draft is looked up in the table built while the previous step ran, from the cache as it stood before
that step's tokens and the previous draft alone: the entry for the previous step's outcome (accepted node, bonus
token), or nothing when the table did not foresee it. A request's first step drafts from its prompt (known before
it is scheduled). Replayed beside `ngramspec-tree` with the same `k`, it measures what drafting ahead costs in
accepted tokens. Parameters: `k` (draft nodes per request, 8), `entries` (outcomes per request, 4), `tree` (1),
`depth` (the cache's max_depth), `miss`: what a request whose outcome the table did not foresee does next step,
`plain` (decode without a draft: nothing waits for the host) or `sync` (draft from its tokens as today, the host on
the critical path for that step: no tokens lost, fewer steps overlapped). `found`, `looked_up` and `synced` count
steps.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ngramspec.cache import DraftBatch
from ngramspec.lookahead import outcome_node, pick
from ngramspec.sim.methods import Method, positive_int, register_method
from ngramspec.sim.methods.ngramspec_static import make_cache

_EMPTY_I = np.zeros(0, np.int32)
_EMPTY_F = np.zeros(0, np.float32)


class NgramspecAhead(Method):
    def __init__(self, k: int = 8, entries: int = 4, tree: int = 1, depth: int | None = None, miss: str = "plain"):
        if miss not in ("plain", "sync"):
            raise ValueError(f"miss must be 'plain' or 'sync', got {miss!r}")
        self.miss = miss
        self.k = positive_int(k, "ngramspec-ahead k")
        self.entries = positive_int(entries, "ngramspec-ahead entries")
        self.tree = bool(int(tree))
        self.cache = make_cache(depth)
        self._width = 1
        self._table: dict = {}  # rid -> (Lookahead of one request, the draft it was built for (tokens, parents))
        self._outcome: dict = {}  # rid -> (committed tokens, accepted count) of its last step
        self.looked_up = 0  # steps drafted from a table
        self.found = 0  # of them, the outcome was in the table
        self.synced = 0  # steps drafted after the outcome (miss=sync)

    def warmup(self):
        from ngramspec.cache import NgramCache
        from ngramspec.warmup import warm_up

        warm_up()
        cache = NgramCache(max_depth=4, max_requests=1, local_nodes=64, use_shared=False)
        cache.start_request(0, [1, 2, 1, 2, 1])
        cache.propose_ahead([0], cache.propose([0], 2), entries=1, budget=2, tree=self.tree)

    def start(self, rid, prompt):
        self.cache.start_request(rid, prompt)

    def _first(self, rids):
        batch = self.cache.propose(rids, self.k, tree=self.tree)
        return {rid: (batch.draft(i).tokens, batch.draft(i).parents, batch.draft(i).probs)
                for i, rid in enumerate(rids)}

    def propose(self, rids):
        new = [rid for rid in rids if rid not in self._table]
        drafts = self._first(new) if new else {}
        missed = []
        for rid in rids:
            if rid in drafts:
                continue
            table, (d_tok, d_par) = self._table.pop(rid)
            committed, n_acc = self._outcome.pop(rid)
            node = outcome_node(d_tok, d_par, committed[:n_acc])
            idx, tok, par, length = pick(table, [node], [committed[n_acc]])
            self.looked_up += 1
            if idx[0] < 0:
                drafts[rid] = (_EMPTY_I, _EMPTY_I, _EMPTY_F)
                missed.append(rid)
            else:
                self.found += 1
                n = int(length[0])
                drafts[rid] = (tok[0, :n].copy(), par[0, :n].copy(), table.probs[0, idx[0], :n].copy())
        if missed and self.miss == "sync":
            drafts.update(self._first(missed))
            self.synced += len(missed)
        out = [drafts[rid][:2] for rid in rids]
        # the next step's table, from the cache before this step's tokens and this step's drafts alone
        flat = DraftBatch.of(*zip(*(drafts[r] for r in rids)))
        ahead = self.cache.propose_ahead(rids, flat, entries=self.entries, budget=self.k, tree=self.tree)
        for i, rid in enumerate(rids):
            row = SimpleNamespace(**{f: getattr(ahead, f)[i:i + 1] for f in
                                     ("node", "token", "weight", "tokens", "parents", "probs", "length")})
            self._table[rid] = (row, out[i])
        self._width = 1 + max((len(t) for t, _ in out), default=0)
        return out

    def verify_width(self, rids, drafts):
        return self._width

    def update(self, rid, committed, n_accepted):
        self.cache.add_tokens(rid, committed)
        self._outcome[rid] = (np.asarray(committed), int(n_accepted))

    def finish(self, rid):
        self.cache.finish_request(rid, share=True)
        self._table.pop(rid, None)
        self._outcome.pop(rid, None)


register_method("ngramspec-ahead", NgramspecAhead,
                "ngramspec-tree's drafts, drafted one step ahead for the likely outcomes of the step in flight")

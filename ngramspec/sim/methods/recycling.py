"""`recycle` and `ngramspec-recycle`: drafts from token recycling's table (`ngramspec.recycle`), alone or where
the n-gram cache has no match.

The table (one for all requests, as in the paper) takes, after every step, the model's top-k at the positions
that produced the committed tokens: row `prev` (the token before each committed token) becomes that top-k. The
trace must carry them (`topk`, recorded by the engine: scripts/record_topk.py); the rows of rejected draft nodes,
which a real verify also scores, are not in a trace, so the table here is updated less often than a server's.

Parameters: `k` (draft nodes per request, 8), `branching` (the breadth-first template, default 4-2-2-1-1-1),
`topk` (candidates kept per token, 8; at most the trace's), `vocab` (table rows, 262144), and for
`ngramspec-recycle` `depth` (the cache's max_depth) and `min_match` (the shortest n-gram match whose draft is
taken, 1; a shorter one leaves the step to recycling).
"""
from __future__ import annotations

import numpy as np

from ngramspec.sim.methods import EMPTY_DRAFT, Method, positive_int, register_method
from ngramspec.sim.methods.adaptive import AdaptiveMethod
from ngramspec.sim.methods.ngramspec_static import make_cache


class _Table:
    """What both recycling methods share: the table (one for all requests), each request's last token (the root
    of its next draft) and the scores of the positions that produced the tokens a step commits."""

    uses_scores = True

    def _init_table(self, branching: str, topk: int, vocab: int) -> None:
        from ngramspec.recycle import RecycleTable, bfs_template

        try:
            widths = [int(b) for b in str(branching).split("-")]
        except ValueError:
            raise ValueError(f"branching must look like 4-2-2-1, got {branching!r}") from None
        self.table = RecycleTable(positive_int(vocab, "recycle vocab"), positive_int(topk, "recycle topk"),
                                  bfs_template(widths))
        self._last: dict = {}  # rid -> its last committed token (the root of its next draft)

    def _warm_table(self) -> None:
        self.table.update(np.zeros(1, np.int32), np.zeros((1, self.table.k), np.int32))
        self.table.draft(0, 2)
        self.table.succ[0] = -1

    def see_scores(self, rid, rows):
        self._rows = rows[:, :self.table.k]  # one row per token `update` commits next

    def _learn(self, rid, committed) -> None:
        # the row of each committed token's predecessor (the request's last token, then the committed ones)
        self.table.update(np.concatenate(([self._last[rid]], committed[:-1])), self._rows)
        self._last[rid] = int(committed[-1])


class Recycle(_Table, Method):
    def __init__(self, k: int = 8, branching: str = "4-2-2-1-1-1", topk: int = 8, vocab: int = 1 << 18,
                 ngram: bool = False, depth: int | None = None, min_match: int = 1):
        self.k = positive_int(k, "recycle k")
        self._init_table(branching, topk, vocab)
        self.ngram = bool(ngram)
        self.min_match = positive_int(min_match, "min_match")
        self.cache = make_cache(depth) if self.ngram else None
        self.from_ngram = self.from_recycle = 0  # steps drafted by each source

    def warmup(self):
        from ngramspec.warmup import warm_up

        warm_up()
        self._warm_table()

    def start(self, rid, prompt):
        self._last[rid] = int(prompt[-1])
        if self.cache is not None:
            self.cache.start_request(rid, prompt)

    def propose(self, rids):
        out = [EMPTY_DRAFT] * len(rids)
        if self.cache is not None:
            batch = self.cache.propose(rids, self.k, tree=True)
            for i in range(len(rids)):
                d = batch.draft(i)
                if len(d) and batch.match_lens[i] >= self.min_match:
                    out[i] = (d.tokens, d.parents)
                    self.from_ngram += 1
        for i, rid in enumerate(rids):
            if not len(out[i][0]):
                tokens, parents = self.table.draft(self._last[rid], self.k)
                if len(tokens):
                    out[i] = (tokens, parents)
                    self.from_recycle += 1
        return out

    def update(self, rid, committed, n_accepted):
        self._learn(rid, committed)
        if self.cache is not None:
            self.cache.add_tokens(rid, committed)

    def finish(self, rid):
        self._last.pop(rid, None)
        if self.cache is not None:
            self.cache.finish_request(rid, share=True)


def _ngram_recycle(k: int = 8, branching: str = "4-2-2-1-1-1", topk: int = 8, vocab: int = 1 << 18,
                   depth: int | None = None, min_match: int = 1) -> Recycle:
    return Recycle(k, branching, topk, vocab, ngram=True, depth=depth, min_match=min_match)


def _recycle(k: int = 8, branching: str = "4-2-2-1-1-1", topk: int = 8, vocab: int = 1 << 18) -> Recycle:
    return Recycle(k, branching, topk, vocab)


register_method("recycle", _recycle, "token recycling: drafts from each token's latest top-k successors "
                "(needs a trace with topk)")
register_method("ngramspec-recycle", _ngram_recycle, "ngramspec-tree's drafts where the n-gram cache matches, "
                "token recycling's elsewhere (needs a trace with topk)")


class AdaptiveRecycle(_Table, AdaptiveMethod):
    """`ngramspec-adaptive-recycle`: `ngramspec-adaptive` (the controller picks width and prefix) over the n-gram
    cache's drafts, with recycling's draft (`ngramspec.recycle.with_recycled`, source 2) where the cache has no
    match of ``min_match`` tokens. The controller's verbs one by one (`observe_batch`, `plan`) around the merge,
    where `ngramspec-adaptive` runs them in one `step`."""

    def __init__(self, max_width: int = 16, branching: str = "4-1-1-1", topk: int = 8, vocab: int = 1 << 18,
                 depth: int = 16, min_match: int = 1, recycle: int = 1, widen: int = 0, **adaptive):
        super().__init__(max_width=max_width, depth=depth, **adaptive)
        self._init_table(branching, topk, vocab)
        self.recycle = bool(int(recycle))  # 0: the same verbs without recycling (its control)
        self.min_match = positive_int(min_match, "min_match")
        self.widen = bool(int(widen))  # also after every n-gram draft (`with_recycled`'s widen)
        self.budget = max(1, self.ctl.widths[-1] - 1)
        self.from_recycle = 0

    def warmup(self):
        super().warmup()
        self._warm_table()

    def start(self, rid, prompt):
        super().start(rid, prompt)
        self._last[rid] = int(prompt[-1])

    def propose(self, rids):
        from ngramspec.recycle import order_by_value, with_recycled

        empty = np.zeros(0, np.int32)
        committed = [self._committed.pop(r, empty) for r in rids]
        self.cache.add_tokens_batch(list(rids), committed)
        self.ctl.observe_batch(rids, committed)
        batch = self.cache.propose(list(rids), self.budget, tree=True)
        if self.recycle:
            batch, used = with_recycled(batch, self.table, [self._last[r] for r in rids], self.budget,
                                        self.min_match, widen=self.widen)
            self.from_recycle += used
            if self.widen:  # the best nodes of both sources first, where the merge put recycling's last
                batch = order_by_value(batch, self.ctl.node_values(rids, batch)[0])
        plan = self.ctl.plan(rids, batch, waiting=self.waiting)
        self._width = plan.width
        out = []
        for i in range(len(rids)):
            a, k = int(batch.offsets[i]), int(plan.lengths[i])
            out.append((batch.tokens[a:a + k].copy(), batch.parents[a:a + k].copy()))
        return out

    def update(self, rid, committed, n_accepted):
        self._learn(rid, committed)
        super().update(rid, committed, n_accepted)

    def finish(self, rid):
        super().finish(rid)
        self._last.pop(rid, None)


register_method("ngramspec-adaptive-recycle", AdaptiveRecycle,
                "ngramspec-adaptive with token recycling's draft (a third source the controller calibrates apart) "
                "where the n-gram cache has no match (needs a trace with topk; recycle=0: the same without it)")

"""`ngramspec-chain` and `ngramspec-tree`: our `NgramCache` with a fixed draft budget `k` every step.

Parameters: `k` (draft nodes per request, 8), `depth` (the cache's max_depth; its default when omitted).
The controller is `ngramspec.controller.FixedBudgetController`: width = 1 + the longest draft (no padding).
"""
from __future__ import annotations

from ngramspec.controller import FixedBudgetController
from ngramspec.sim.methods import Method, positive_int, register_method


def make_cache(depth=None):
    from ngramspec.cache import NgramCache

    return NgramCache() if depth is None else NgramCache(max_depth=positive_int(depth, "depth"))


class NgramspecStatic(Method):
    def __init__(self, k: int = 8, tree: bool = True, depth: int | None = None):
        self.k = positive_int(k, "ngramspec k")
        self.tree = tree
        self.cache = make_cache(depth)
        self.ctl = FixedBudgetController(self.k)
        self._width = 1

    def warmup(self):
        from ngramspec.warmup import warm_up

        warm_up()

    def start(self, rid, prompt):
        self.cache.start_request(rid, prompt)
        self.ctl.start(rid)

    def propose(self, rids):
        batch = self.cache.propose(rids, self.k, tree=self.tree)
        plan = self.ctl.plan(rids, batch)
        self._width = plan.width
        offsets, tokens, parents, lengths = batch.offsets, batch.tokens, batch.parents, plan.lengths
        return [(tokens[offsets[i]:offsets[i] + lengths[i]], parents[offsets[i]:offsets[i] + lengths[i]])
                for i in range(len(rids))]

    def verify_width(self, rids, drafts):
        return self._width

    def update(self, rid, committed, n_accepted):
        self.cache.add_tokens(rid, committed)
        self.ctl.observe_tokens(rid, committed)

    def finish(self, rid):
        self.cache.finish_request(rid, share=True)
        self.ctl.finish(rid)


def _chain(k: int = 8, depth: int | None = None) -> NgramspecStatic:
    return NgramspecStatic(k, tree=False, depth=depth)


def _tree(k: int = 8, depth: int | None = None) -> NgramspecStatic:
    return NgramspecStatic(k, tree=True, depth=depth)


register_method("ngramspec-chain", _chain, "ngramspec's suffix-trie cache, a chain of k tokens every step")
register_method("ngramspec-tree", _tree, "ngramspec's suffix-trie cache, a tree of k nodes every step")

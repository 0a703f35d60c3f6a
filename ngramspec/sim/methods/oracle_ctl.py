"""`oracle-ctl:k=K,tree=0|1`: the oracle controller over ngramspec's own drafts (an upper bound).

Each step it takes `NgramCache.propose` drafts (budget k), knows from the true future how many nodes of each
would be accepted (`a_i`), and drafts just that accepted prefix (as a chain) or nothing. At batch B it picks
one verify width w for the batch among {1} and {1 + a_i}: request i then drafts min(a_i, w - 1) tokens, and
w maximizes tokens per unit time under the cost profile, (B + sum_i min(a_i, w - 1)) / cost(B, w).
It is the best any controller can do with these drafts; the perfect drafter `oracle` bounds any drafter.
"""
from __future__ import annotations

from ngramspec.layout import accepted_length
from ngramspec.sim.methods import EMPTY_DRAFT, Method, chain, flag, register_method
from ngramspec.sim.methods.ngramspec_static import NgramspecStatic


class OracleController(NgramspecStatic):
    needs_future = True
    profile_dependent = True

    def __init__(self, k: int = 8, tree: int = 1, depth: int | None = None):
        super().__init__(k, tree=flag(tree, "oracle-ctl tree"), depth=depth)
        self._future: dict = {}
        self._pos: dict = {}
        self.profile = None

    def bind_profile(self, profile) -> None:
        self.profile = profile

    def see_future(self, rid, output) -> None:
        self._future[rid] = output
        self._pos[rid] = 0

    def propose(self, rids):
        accepted = []
        for rid, (tokens, parents) in zip(rids, super().propose(rids)):
            output, pos = self._future[rid], self._pos[rid]
            n = accepted_length(tokens, parents, output, pos) if len(tokens) else 0
            accepted.append(min(n, len(output) - pos - 1))
        batch = len(rids)
        best_width, best_rate = 1, batch / self.profile.cost_ms(batch, 1)
        for width in sorted({1 + a for a in accepted if a > 0}):
            rate = (batch + sum(min(a, width - 1) for a in accepted)) / self.profile.cost_ms(batch, width)
            if rate > best_rate:
                best_width, best_rate = width, rate
        return [chain(self._future[rid][self._pos[rid]: self._pos[rid] + min(a, best_width - 1)])
                if best_width > 1 and a else EMPTY_DRAFT for rid, a in zip(rids, accepted)]

    verify_width = Method.verify_width  # its own drafts' width, not the fixed budget's

    def update(self, rid, committed, n_accepted):
        super().update(rid, committed, n_accepted)
        self._pos[rid] += len(committed)

    def finish(self, rid):
        super().finish(rid)
        del self._future[rid], self._pos[rid]


def _oracle_ctl(k: int = 8, tree: int = 1, depth: int | None = None) -> OracleController:
    return OracleController(k, tree, depth)


register_method("oracle-ctl", _oracle_ctl, "bound: the oracle controller, ngramspec's drafts at the best width "
                "per step, knowing what will be accepted")

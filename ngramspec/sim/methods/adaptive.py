"""`ngramspec-adaptive`: NgramCache tree drafts with the width chosen by `ngramspec.controller.AdaptiveController`.

The simulator's adapter for the controller; it lives here so that the core (`ngramspec.controller`,
`ngramspec.cache`) never imports the simulator.
"""
from __future__ import annotations

import numpy as np

from ngramspec.cache import NgramCache
from ngramspec.controller import DEFAULT_WIDTHS, AdaptiveController
from ngramspec.sim.methods import Method, positive_int, register_method

_EMPTY = np.zeros(0, np.int32)


class AdaptiveMethod(Method):
    """`ngramspec-adaptive`: NgramCache tree drafts, controller-chosen width. Sees only reported durations.

    ``state_in=PATH`` starts the controller from a state saved by ``state_out=PATH`` of an earlier run (chain
    runs: learn on one trace, start warm on another); ``{profile}`` in either path is replaced by the cost
    profile's name (a state holds measured costs, so it belongs to one profile). ``min_gain``, ``strength``
    (prior_strength), ``alpha`` (request_alpha), ``predictor`` (beta | logistic), ``drain`` (gmean | min) and
    ``request_prior`` (0: no check of a request's own drafts), ``max_tokens`` (max_step_tokens, 0: no limit) and
    ``draft_batch`` (max_draft_batch, 0: no limit) are the controller's knobs."""

    profile_dependent = True  # its decisions depend on the durations it observes

    def __init__(self, max_width: int = 16, prior: str = "default", tree: int = 1, depth: int = 16,
                 explore_frac: float = 0.002, widths: str | None = None, clip: float = 2.0,
                 stale: int = 500, state_in: str | None = None, state_out: str | None = None,
                 min_gain: float = 0.1, strength: float = 10.0, alpha: float = 0.25, predictor: str = "beta",
                 drain: str = "gmean", request_prior: float = 4.0, max_tokens: int = 0,
                 draft_batch: int = 0):
        if widths is not None:  # e.g. widths=1-2-4-8-17
            try:
                widths = [int(w) for w in str(widths).split("-")]
            except ValueError:
                raise ValueError(f"widths must look like 1-2-4-8-16, got {widths!r}") from None
        else:
            widths = [w for w in DEFAULT_WIDTHS if w <= positive_int(max_width, "max_width")]
        if prior == "default":
            prior_fn = None
        elif prior in ("seed-pcie8", "h200-llama8b") or prior.endswith(".json"):
            from ngramspec.sim.profiles import get_profile
            prior_fn = get_profile(prior).cost_ms  # a deliberately *assumed* cost, e.g. a wrong one
        else:
            raise ValueError(f"prior must be 'default', a profile name or a .json file, got {prior!r}")
        self.ctl = AdaptiveController(widths, prior=prior_fn, explore_frac=explore_frac,
                                      cost_clip=float(clip) if float(clip) > 0 else None,
                                      stale_after=int(stale) if int(stale) > 0 else None,
                                      min_gain=float(min_gain), prior_strength=float(strength),
                                      request_alpha=float(alpha), predictor=str(predictor), drain=str(drain),
                                      request_prior=float(request_prior) if float(request_prior) > 0 else None,
                                      max_step_tokens=int(max_tokens) if int(max_tokens) > 0 else None,
                                      max_draft_batch=int(draft_batch) if int(draft_batch) > 0 else None)
        self.cache = NgramCache(max_depth=depth)
        self.tree = bool(tree)
        self._width = 1
        self._committed: dict = {}  # tokens committed this step, handed over in the next step's one call
        # start warm from / save to a controller state file ('{profile}' in the path: the profile's name)
        self.state_in = None if state_in is None else str(state_in)
        self.state_out = None if state_out is None else str(state_out)
        self._profile_name = ""

    def warmup(self) -> None:
        from ngramspec.warmup import warm_up

        warm_up()

    def bind_profile(self, profile) -> None:
        # the costs are deliberately not passed on (the controller learns them only from observe_step); the
        # profile's name only names the state files
        self._profile_name = profile.name
        if self.state_in:
            self.ctl.load_state(self._state_path(self.state_in))

    def _state_path(self, template: str) -> str:
        return template.replace("{profile}", self._profile_name)

    def close(self) -> None:
        if self.state_out:
            self.ctl.save_state(self._state_path(self.state_out))

    def start(self, rid, prompt):
        self.cache.start_request(rid, prompt)
        self.ctl.start(rid)

    def propose(self, rids):
        empty = _EMPTY
        committed = [self._committed.pop(r, empty) for r in rids]
        batch, plan = self.ctl.step(self.cache, rids, committed, waiting=self.waiting, tree=self.tree)
        self._width = plan.width
        out = []
        tokens, parents, offsets = batch.tokens, batch.parents, batch.offsets
        for i in range(len(rids)):
            a, k = int(offsets[i]), int(plan.lengths[i])
            out.append((tokens[a:a + k].copy(), parents[a:a + k].copy()))
        return out

    def verify_width(self, rids, drafts):
        return self._width

    def update(self, rid, committed, n_accepted):
        self._committed[rid] = committed

    def observe_step(self, batch_size, width, duration_ms):
        self.ctl.observe_step(batch_size, width, duration_ms)

    def finish(self, rid):
        committed = self._committed.pop(rid, None)
        if committed is not None:
            self.cache.add_tokens(rid, committed)
            self.ctl.observe_tokens(rid, committed)
        self.cache.finish_request(rid, share=True)
        self.ctl.finish(rid)


register_method("ngramspec-adaptive", AdaptiveMethod)

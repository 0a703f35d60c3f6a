"""`warm_up`: compile (or load from numba's cache) every kernel of the core, so that no first request stalls on
a compile. The top of the core's layers: it knows the cache, the controller and the verify layout, none of them
knows it (each warms only its own kernels: `ngramspec.cache.warm_up`, `ngramspec.layout.warm_up`)."""
from __future__ import annotations

import numpy as np

from ngramspec import cache, layout
from ngramspec.cache import NgramCache
from ngramspec.controller import AdaptiveController

__all__ = ["warm_up"]


def warm_up() -> None:
    """Compile (or load) every kernel of the cache, of the adaptive controller and of the verify layout, on
    throwaway objects: the first real ``propose`` + ``plan`` (or ``step``) is then fast. Touches no other state."""
    cache.warm_up()
    c = NgramCache(max_depth=4, max_requests=2, local_nodes=64, shared_nodes=64, shared_tokens=64)
    c.start_request(0, [1, 2, 3, 1, 2, 3])
    c.start_request(1, [1, 2, 1, 2])
    ctl = AdaptiveController(widths=(1, 2, 3))
    ctl.start(0)
    ctl.start(1)
    for waiting in (None, 0):
        ctl.step(c, [0, 1], [[1], [2, 1]], waiting=waiting)
        ctl.plan([0, 1], c.propose([0, 1], 2), waiting=waiting)
        ctl.observe_tokens(0, [2])
        ctl.observe_batch([0, 1], [[1], np.array([2], np.int32)])
        for w in (1, 2, 3):
            ctl.observe_step(2, w, 1.0 + w)
        ctl.observe_step(1, 2, 2.5)
    ctl.costs.estimate(64, 2)
    ctl.node_values([0], c.propose([0], 2))
    c.finish_request(0, share=True)
    c.finish_request(1, share=True)
    layout.warm_up()

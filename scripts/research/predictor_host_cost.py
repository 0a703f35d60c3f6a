"""Host time of the controller's step (cache + controller, `AdaptiveController.step`) per request-step at batch 1,
Beta vs logistic predictor, interleaved rounds on one trace's first requests (oracle-free: committed tokens are
each step's accepted draft prefix + the next true token, as a server's would be).

    python scripts/research/predictor_host_cost.py TRACE [REQUESTS] [ROUNDS]
"""
import sys
import time

import numpy as np

from ngramspec.cache import NgramCache
from ngramspec.controller import AdaptiveController
from ngramspec.layout import accepted_length
from ngramspec.sim.profiles import get_profile
from ngramspec.sim.traces import load_trace
from ngramspec.warmup import warm_up


def one(trace, predictor, profile):
    ctl, cache = AdaptiveController(predictor=predictor), NgramCache(max_depth=16)
    spent, steps = 0.0, 0
    for rid, r in enumerate(trace.requests):
        out = r.output
        cache.start_request(rid, r.prompt)
        ctl.start(rid)
        pos, committed = 0, None
        while pos < len(out):
            t0 = time.perf_counter()
            batch, plan = ctl.step(cache, [rid], None if committed is None else [committed])
            spent += time.perf_counter() - t0
            steps += 1
            k = int(plan.lengths[0])
            a = int(batch.offsets[0])
            n = accepted_length(batch.tokens[a:a + k], batch.parents[a:a + k], out, pos) if k else 0
            n = min(n, len(out) - pos - 1)
            committed = out[pos:pos + n + 1]
            pos += n + 1
            ctl.observe_step(1, plan.width, profile.cost_ms(1, plan.width))
        cache.add_tokens(rid, committed)
        ctl.observe_tokens(rid, committed)
        cache.finish_request(rid, share=True)
        ctl.finish(rid)
    return spent / steps * 1e6, steps


def main():
    trace = load_trace(sys.argv[1]).head(int(sys.argv[2]) if len(sys.argv) > 2 else 20)
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    warm_up()
    profile = get_profile("h200-llama8b")
    res = {"beta": [], "logistic": []}
    nsteps = {}
    for p in res:
        one(trace.head(2), p, profile)  # compile
    for _ in range(rounds):
        for p in res:
            us, steps = one(trace, p, profile)
            res[p].append(us)
            nsteps[p] = steps
    for p, v in res.items():
        print(f"{p:9s}: {np.median(v):.1f} us per request-step (median of {rounds}; rounds {[round(x, 1) for x in v]}; "
              f"{nsteps[p]} steps)")


if __name__ == "__main__":
    main()

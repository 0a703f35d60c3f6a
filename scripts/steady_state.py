"""Split a replay's throughput into steps with the batch full (steady state) and the drain at the end.

Usage: python scripts/steady_state.py TRACE PROFILE BATCH [MAX_REQUESTS]
"""
import sys, collections
from ngramspec.simulate import replay
from ngramspec.methods import make_method
from ngramspec.profiles import get_profile
from ngramspec.traces import load_trace
tr = load_trace(sys.argv[1]); prof = get_profile(sys.argv[2]); B=int(sys.argv[3])
if len(sys.argv) > 4: tr = tr.head(int(sys.argv[4]))
for spec in ("none", "ngramspec-adaptive"):
    m = make_method(spec)
    per = collections.defaultdict(lambda: [0, 0.0])  # size -> tokens, time
    cur = {"tok": 0, "size": None}
    orig_prop, orig_upd = m.propose, m.update
    def prop(rids, m=m):
        cur["tok"] = 0; cur["size"] = len(rids)
        return orig_prop(rids)
    def upd(rid, committed, n):
        cur["tok"] += len(committed); return orig_upd(rid, committed, n)
    m.propose = prop; m.update = upd
    widths = []
    orig_vw = m.verify_width
    def vw(rids, drafts):
        w = orig_vw(rids, drafts); widths.append((len(rids), w)); return w
    m.verify_width = vw
    # wrap observe via profile cost on each step: use update accumulation + widths
    toks_by_step = []
    orig_prop2 = m.propose
    def prop2(rids):
        if cur["size"] is not None: toks_by_step.append(cur["tok"])
        return prop(rids)
    m.propose = prop2
    r = replay(tr, m, B, prof)
    toks_by_step.append(cur["tok"])
    full_t = full_tok = 0.0
    for (size, w), tok in zip(widths, toks_by_step):
        if size == B:
            full_t += prof.cost_ms(size, w); full_tok += tok
    print(spec, "steady tokens/ms at B=%d: %.4f" % (B, full_tok / full_t), "overall tokens/ms %.4f" % (r.tokens / prof.total_ms(r.step_counts)))

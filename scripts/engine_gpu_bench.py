"""End-to-end speed of the reference engine: plain greedy vs speculation, batch 1 and 16, copy-heavy and free text.

    python scripts/engine_gpu_bench.py --out out/ [--gguf PATH] [--policies plain,tree:k=8,adaptive] [--batches 1,16]
                                 [--modes eager,graph] [--max-new-tokens 256] [--prompts 16]

For every workload x batch x mode it runs each policy on the same prompts (a fresh NgramCache per run, kept
across the run's requests) and records tokens/s of the decode phase, accept length, verify widths and whether
the outputs equal plain greedy's. Batch 1 decodes the prompts one after another; batch B decodes them B at a
time. Results, per-step records included, go to OUT/bench.json (and the plain batch-1 outputs to
OUT/trace_<workload>.jsonl.gz, for the simulator check). Each configuration is guarded: a failure is recorded and
the rest still runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class ConfigRun:
    """One policy at one batch size and mode over a workload's prompts: its own KV cache, CUDA graphs and
    NgramCache (kept across the run's requests). `group` decodes the next `batch` prompts; `result` sums up."""

    def __init__(self, model, prompts, batch, mode, spec, max_new, eos, sync_moves=False, kv_width=1):
        from ngramspec import NgramCache
        from ngramspec.engine.decode import SpecDecoder
        from ngramspec.engine.model import GraphRunner, KVModel
        from ngramspec.engine.policy import make_policy

        self.policy = make_policy(spec)
        max_width = self.policy.max_width if self.policy else 1
        # every policy of a run gets the same KV capacity (room for the widest policy's verify): graph-mode
        # attention spans the whole buffer, so a shorter buffer would make plain decoding's steps cheaper for
        # a reason no serving engine has
        kv = KVModel(model, batch=batch, max_len=max(map(len, prompts)) + max_new + max(max_width, kv_width) + 1)
        runner = GraphRunner(kv) if mode == "graph" else None
        if runner is not None:
            runner.prepare(range(1, max_width + 1))
        self.decoder = SpecDecoder(kv, runner, sync_moves=sync_moves)
        self.cache = NgramCache() if self.policy else None
        self.prompts, self.batch, self.max_new, self.eos = prompts, batch, max_new, eos
        self.outputs, self.steps, self.records = [], [], []
        self.decode_s = self.prefill_s = 0.0

    def groups(self) -> int:
        return len(self.prompts) // self.batch

    def group(self, g: int) -> None:
        start = g * self.batch
        res = self.decoder.generate(self.prompts[start:start + self.batch], self.max_new, policy=self.policy,
                                    cache=self.cache, rids=list(range(start, start + self.batch)) if self.policy
                                    else None, eos_token_id=self.eos)
        self.outputs += res.outputs
        self.steps += res.steps
        self.records += [{"width": r.width, "kept": r.kept, "accepted": r.accepted, "ms": r.seconds * 1e3,
                          "host_ms": r.host_seconds * 1e3, "plan_ms": r.plan_seconds * 1e3, "moved": r.moved}
                         for r in res.records]
        self.decode_s += res.decode_seconds
        self.prefill_s += res.prefill_seconds

    def result(self) -> dict:
        records, tokens = self.records, sum(map(len, self.outputs))
        widths = Counter(r["width"] for r in records)
        return {
            "outputs": self.outputs, "steps": self.steps, "tokens": tokens, "decode_s": self.decode_s,
            "prefill_s": self.prefill_s, "tok_s": tokens / self.decode_s,
            "accept_length": tokens / max(1, sum(self.steps)), "batch_steps": len(records),
            "mean_step_ms": 1e3 * self.decode_s / max(1, len(records)),
            "widths": {str(w): widths[w] for w in sorted(widths)},
            "mean_width": sum(r["width"] for r in records) / max(1, len(records)),
            "records": records,
        }


def run_config(model, prompts, batch, mode, spec, max_new, eos, sync_moves=False, kv_width=1):
    from ngramspec.engine.decode import freeze_gc

    run = ConfigRun(model, prompts, batch, mode, spec, max_new, eos, sync_moves, kv_width)
    freeze_gc()  # as SGLang after its warm-up: no full collection through the model, graphs and kernels
    for g in range(run.groups()):
        run.group(g)
    return run.result()


def run_interleaved(model, prompts, batch, mode, specs, max_new, eos, sync_moves=False, kv_width=1) -> dict:
    """Every policy of ``specs`` on the same prompts, group by group in turn (plain's group 0, then each other
    policy's group 0, then group 1, ...): a drift of the machine's speed during the run hits every policy alike,
    so per-prompt ratios compare steps taken seconds apart, not minutes. Returns {spec: result or exception}."""
    runs, out = {}, {}
    for spec in specs:
        try:
            runs[spec] = ConfigRun(model, prompts, batch, mode, spec, max_new, eos, sync_moves, kv_width)
        except Exception as exc:  # keep going: one broken configuration must not lose the others
            traceback.print_exc()
            out[spec] = exc
    from ngramspec.engine.decode import freeze_gc

    freeze_gc()  # as SGLang after its warm-up: no full collection through the model, graphs and kernels
    for g in range(len(prompts) // batch):
        for spec, run in list(runs.items()):
            try:
                run.group(g)
            except Exception as exc:
                traceback.print_exc()
                out[spec] = exc
                del runs[spec]
    out.update({spec: run.result() for spec, run in runs.items()})
    return {spec: out[spec] for spec in specs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--policies", default="plain,tree:k=8,adaptive")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--modes", default="eager,graph")
    parser.add_argument("--workloads", default="copy,free")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per workload (<= 16)")
    parser.add_argument("--ignore-eos", action="store_true", help="always decode max-new-tokens")
    parser.add_argument("--interleave", action="store_true",
                        help="run the policies group by group in turn (plain's first prompt, each policy's first "
                             "prompt, then the second...), not one policy after the other")
    parser.add_argument("--sync-moves", action="store_true",
                        help="a step waits for its KV moves (their time counts in that step, not the next)")
    args = parser.parse_args(argv)

    import torch

    from ngramspec.engine.model import load_model
    from ngramspec.engine.policy import make_policy
    from ngramspec.engine.prompts import chat_tokens, copy_heavy_prompts, free_text_prompts
    from ngramspec.engine.trace import write_trace

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = [p for p in args.policies.split(",") if p]
    if policies[0] != "plain":
        raise SystemExit("the first policy must be 'plain' (the reference for identity and speedup)")
    kv_width = max(getattr(make_policy(p), "max_width", 1) for p in policies)  # the KV capacity every policy gets
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.gguf, args.device, getattr(torch, args.dtype))
    device = next(model.parameters()).device
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
            "ignore_eos": args.ignore_eos, "sync_moves": args.sync_moves, "interleave": args.interleave,
            "kv_width": kv_width,
            "load_s": time.perf_counter() - t0,
            "policies": policies}
    print(json.dumps(meta), flush=True)
    eos = None if args.ignore_eos else tokenizer.eos_token_id
    texts = {"copy": copy_heavy_prompts(), "free": free_text_prompts()}
    workloads = {w: [chat_tokens(tokenizer, t) for t in texts[w][:args.prompts]] for w in args.workloads.split(",")}
    modes = [m for m in args.modes.split(",") if m and (m != "graph" or device.type == "cuda")]

    # warm-up: numba JIT of the cache, CUDA kernels, allocator
    run_config(model, workloads[next(iter(workloads))][:1], 1, "eager", policies[-1], 16, eos)

    results = []
    for workload, prompts in workloads.items():
        for batch in [int(b) for b in args.batches.split(",")]:
            for mode in modes:
                plain = None
                together = run_interleaved(model, prompts, batch, mode, policies, args.max_new_tokens, eos,
                                           args.sync_moves, kv_width) if args.interleave else {}
                for spec in policies:
                    tag = f"{workload} b{batch} {mode} {spec}"
                    try:
                        r = together[spec] if args.interleave else \
                            run_config(model, prompts, batch, mode, spec, args.max_new_tokens, eos, args.sync_moves,
                                       kv_width)
                        if isinstance(r, Exception):
                            raise r
                    except Exception as exc:  # keep going: one broken configuration must not lose the others
                        traceback.print_exc()
                        results.append({"workload": workload, "batch": batch, "mode": mode, "policy": spec,
                                        "error": f"{type(exc).__name__}: {exc}"})
                        continue
                    if spec == "plain":
                        plain = r
                        if batch == 1 and mode == "eager":
                            write_trace(out / f"trace_{workload}.jsonl.gz", prompts, r["outputs"],
                                        workload=f"engine-{workload}")
                    n = len(r["outputs"])
                    same = [a == b for a, b in zip(r["outputs"], plain["outputs"])] if plain else []
                    row = {"workload": workload, "batch": batch, "mode": mode, "policy": spec,
                           "requests": n, **{k: v for k, v in r.items() if k != "outputs"},
                           "speedup": r["tok_s"] / plain["tok_s"] if plain else None,
                           "identical": sum(same), "first_divergence": [
                               next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                               for a, b in zip(r["outputs"], plain["outputs"]) if a != b] if plain else []}
                    results.append(row)
                    print(f"{tag:26s} tok/s {row['tok_s']:8.1f}  x{row['speedup']:.2f}  accept "
                          f"{row['accept_length']:.2f}  width {row['mean_width']:.2f}  "
                          f"step {row['mean_step_ms']:.2f} ms"
                          f"  same {row['identical']}/{n}", flush=True)
                    (out / "bench.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "bench.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

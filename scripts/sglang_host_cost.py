"""Host-side cost per decode step: NGRAM_ADAPTIVE's planner vs SGLang NGRAM's C++ corpus, on trace replay.

Both run exactly the host work their worker does per decode step (ours: `DraftPlanner.plan` = cache sync,
propose, controller, layout; NGRAM: `NgramCorpus.batch_get` on the last `max_trie_depth` tokens, then
`batch_put` of the tails, as `NGRAMWorker` does; its insert runs on a C++ background thread that a server
hides behind the GPU step, which here shows up in the next step's `synchronize`, so `batch_get` alone is
listed too), at a fixed verify width for both so the drafts are
comparable (plus our controller's own choice). Verification is simulated: the trace output is the model's
greedy continuation, so a request commits its longest accepted draft path plus one bonus token; the verify
step's duration comes from an ngramspec cost profile (what the worker would measure with CUDA events) and
feeds the controller. Reported: mean host milliseconds per step
(wall clock, this process, after 10 untimed warm-up steps), tokens per step (accept length, bonus included),
mean verify width, and modelled tokens/s (committed tokens / summed profile step costs; host time excluded).
No GPU involved.

    python scripts/sglang_host_cost.py --trace ../shared/traces/chat_gpt4.jsonl.gz --batch 1 8 32
"""
from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

from ngramspec.controller import DEFAULT_WIDTHS
from ngramspec.layout import accepted_path, mask_parents
from ngramspec_sglang.config import AdaptiveConfig
from ngramspec_sglang.drafting import DraftPlanner, RequestView

WARMUP_STEPS = 10  # not timed: numba compilation / first-call costs


def load_records(path: Path, count: int) -> list[dict]:
    with gzip.open(path, "rt") as f:
        records = [json.loads(line) for _, line in zip(range(count), f)]
    if len(records) < count:
        raise SystemExit(f"{path} holds {len(records)} records, {count} asked")
    return records


def _commit(tokens, parents, truth) -> int:
    return len(accepted_path(tokens, parents, truth)) + 1


def run_ours(records, width: int, max_steps: int, adaptive: bool, profile=None) -> dict:
    cfg = AdaptiveConfig(widths=tuple(w for w in DEFAULT_WIDTHS if w < width) + (width,),
                         max_depth=18, fixed_width=None if adaptive else width,
                         draft_max_batch=None)  # drafting at every batch size, as NGRAM's host cost is measured
    planner = DraftPlanner(cfg)
    outs = {i: [] for i in range(len(records))}
    host, committed, steps, gpu_ms = 0.0, 0, 0, 0.0
    while outs and steps < max_steps:
        live = sorted(outs)
        views = [RequestView(i, records[i]["prompt"], outs[i]) for i in live]
        t0 = time.perf_counter()
        plan = planner.plan(views)
        host += (time.perf_counter() - t0) * (steps >= WARMUP_STEPS)
        if profile is not None:  # the worker measures this with CUDA events; here the profile stands in
            step_ms = profile.cost_ms(len(live), plan.width)
            gpu_ms += step_ms
            planner.record_duration(plan.width, len(live), step_ms / 1000.0)
        for b, i in enumerate(live):
            truth = records[i]["output"][len(outs[i]):]
            rows = plan.tokens[b, 1: 1 + int(plan.drafted[b])]
            parents = [-1 if p == 0 else int(p) - 1 for p in mask_parents(plan.mask[b])[1: 1 + int(plan.drafted[b])]]
            n = min(_commit(rows, parents, truth), len(truth))
            outs[i].extend(truth[:n])
            committed += n
            if len(outs[i]) >= len(records[i]["output"]):
                del outs[i]
        planner.release([i for i in live if i not in outs])
        steps += 1
    return {"host_ms_per_step": 1000 * host / max(1, steps - WARMUP_STEPS),
            "tokens_per_request_step": committed / _request_steps(planner),
            "steps": steps, "model_tok_s": 1000 * committed / gpu_ms if gpu_ms else float("nan"),
            "mean_width": planner.stats.width_tokens / _request_steps(planner)}


def _request_steps(planner: DraftPlanner) -> int:
    return max(1, planner.stats.verified_requests)


def _last_tokens(prompt, output, n):
    """The last n tokens of prompt + output, from tails only (NGRAMWorker._efficient_concat_last_n)."""
    tail = output[-n:]
    return tail if len(tail) >= n else list(prompt[-(n - len(tail)):]) + tail


def run_sglang_ngram(records, width: int, max_steps: int, profile=None) -> dict:
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

    depth = 18  # SGLang's default --speculative-ngram-max-trie-depth
    corpus = NgramCorpus(max_trie_depth=depth, min_bfs_breadth=1, max_bfs_breadth=10, draft_token_num=width,
                         capacity=10_000_000)
    outs = {i: [] for i in range(len(records))}
    host, host_get, committed, request_steps, steps, gpu_ms = 0.0, 0.0, 0, 0, 0, 0.0
    while outs and steps < max_steps:
        live = sorted(outs)
        gpu_ms += profile.cost_ms(len(live), width) if profile is not None else 0.0
        t0 = time.perf_counter()
        contexts = [_last_tokens(records[i]["prompt"], outs[i], depth) for i in live]
        corpus.synchronize()  # waits for the previous step's background insert
        t1 = time.perf_counter()
        ids, masks = corpus.batch_get([str(i) for i in live], contexts,
                                      [len(records[i]["prompt"]) + len(outs[i]) for i in live])
        t2 = time.perf_counter()
        host += (t2 - t0) * (steps >= WARMUP_STEPS)
        host_get += (t2 - t1) * (steps >= WARMUP_STEPS)
        ids = ids.reshape(len(live), width)
        masks = masks.reshape(len(live), width, width).astype(bool)
        tails = []
        for b, i in enumerate(live):
            truth = records[i]["output"][len(outs[i]):]
            parents = mask_parents(masks[b])
            n = min(_commit(ids[b, 1:], parents[1:] - 1, truth), len(truth))
            outs[i].extend(truth[:n])
            committed += n
            tails.append(_last_tokens(records[i]["prompt"], outs[i], depth))
            if len(outs[i]) >= len(records[i]["output"]):
                del outs[i]
        t0 = time.perf_counter()
        corpus.batch_put(tails)
        host += (time.perf_counter() - t0) * (steps >= WARMUP_STEPS)
        request_steps += len(live)
        steps += 1
    return {"host_ms_per_step": 1000 * host / max(1, steps - WARMUP_STEPS),
            "get_ms_per_step": 1000 * host_get / max(1, steps - WARMUP_STEPS),
            "tokens_per_request_step": committed / request_steps,
            "steps": steps, "model_tok_s": 1000 * committed / gpu_ms if gpu_ms else float("nan"),
            "mean_width": float(width)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="a trace of token-id records (.jsonl.gz)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--width", type=int, default=16, help="verify width for both (NGRAM's draft_token_num)")
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--profile", default="h200-llama8b",
                    help="ngramspec cost profile standing in for measured verify durations ('none': no timings)")
    args = ap.parse_args(argv)
    profile = None
    if args.profile != "none":
        from ngramspec.sim.profiles import get_profile

        profile = get_profile(args.profile)
    trace = Path(args.trace)
    if not trace.is_file():
        raise SystemExit(f"trace {trace} not found")
    print(f"trace {trace.name}, width {args.width}, up to {args.max_steps} steps per batch size, "
          f"step cost profile {args.profile}")
    print(f"{'B':>4} {'method':>28} {'host ms/step':>13} {'tokens/step':>12} {'mean width':>11} "
          f"{'model tok/s':>12} {'steps':>6}")
    for bs in args.batch:
        records = load_records(trace, bs)
        rows = [("NGRAM_ADAPTIVE fixed width", run_ours(records, args.width, args.max_steps, False, profile)),
                ("NGRAM_ADAPTIVE controller", run_ours(records, args.width, args.max_steps, True, profile))]
        try:
            ngram = run_sglang_ngram(records, args.width, args.max_steps, profile)
            rows.append(("SGLang NGRAM corpus", ngram))
            rows.append(("  of which batch_get", dict(ngram, host_ms_per_step=ngram["get_ms_per_step"])))
        except ImportError as e:
            print(f"(SGLang NGRAM skipped: {e})")
        for name, r in rows:
            print(f"{bs:>4} {name:>28} {r['host_ms_per_step']:>13.3f} {r['tokens_per_request_step']:>12.2f} "
                  f"{r['mean_width']:>11.2f} {r['model_tok_s']:>12.1f} {r['steps']:>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

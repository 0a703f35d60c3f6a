"""Host time per request-step: what a server pays on the critical path of every decode step for its drafts.

    .venv-sglang/bin/python -m pytest bench/test_bench_host.py --benchmark-only -s

Closed-loop trace replay (continuous batching, greedy verification against the recorded output: a request
commits its accepted draft path plus one bonus token), at batch 1, 8, 32 and 64, one test per batch size that
runs every method in the same process, interleaved, ``ROUNDS`` rounds each; the figure is the median over
rounds of (host time / request-steps). Methods, each doing exactly the host work its server does per step:

- **cache**: `NgramCache.add_tokens_batch` (the step's committed tokens) + `propose` (tree, 15 nodes).
- **cache + controller**: `AdaptiveController.step` (commit tokens to cache and controller, propose, plan) +
  `observe_step` (the step's duration, from the h200-llama8b cost profile standing in for the GPU timer).
- **cache + controller, verb by verb**: the same through `add_tokens_batch`, `observe_batch`, `propose` and
  `plan` (what a caller pays that does not use `step`).
- **planner**: the SGLang plugin's `DraftPlanner.plan` (views -> committed-token sync, propose, controller,
  verify layout arrays) + `record_duration`; the views themselves are built untimed (the worker's part).
- **SGLang NgramCorpus** (sglang 0.5.23, its defaults, draft_token_num 16): `synchronize` + `batch_get` with
  the last 18 tokens of every request + `batch_put` of the tails, as `NGRAMWorker` does (its insert thread's
  CPU time counts).
- **Arctic SuffixDecodingCache** (arctic-inference): one `speculate` per request (15 tokens, tree) +
  `add_active_response` per request.

Time is the calling thread's CPU time (robust to other jobs on a shared machine; a cheap clock, where process
CPU time costs several µs a read here), with the cost of reading the clocks subtracted; wall time is reported
beside it. NgramCorpus inserts on a background thread, whose CPU time is not in that column (which therefore
flatters it); the column "all threads" adds the CPU time of the method's other threads over the whole replay
(process minus calling thread), scaled to the timed steps: what the method costs on one core. ``extra_info`` holds
the medians (`*_us_per_request_step`) and the ratios to NgramCorpus measured in the same run. Trace:
``HOST_BENCH_TRACE`` (default chat_gpt4), the first max(16, 2 x batch) requests, outputs cut to 128 tokens; the
first 10 steps of each replay are untimed. Skips without ../shared/traces; SGLang and Arctic rows skip when their
packages are missing.

``HOST_BENCH_COLD=1``: before each timed step 8 MB of other data is written (several times a core's L2 cache), as
in a server, where the device wait and the server's own host work between two steps evict the step's code and
data from the core's caches. Every method pays it; the figures are several times the default (warm) ones.
"""
from __future__ import annotations

import os
import statistics
import time
from functools import lru_cache

import numpy as np
import pytest

from ngramspec import NgramCache
from ngramspec.controller import DEFAULT_WIDTHS, AdaptiveController
from ngramspec.layout import accepted_path
from ngramspec.sim.profiles import get_profile
from ngramspec.sim.traces import dev_trace_paths, load_trace
from ngramspec.warmup import warm_up

TRACES = {p.name.split(".")[0]: p for p in dev_trace_paths()}
TRACE = os.environ.get("HOST_BENCH_TRACE", "chat_gpt4")
BATCHES = (1, 8, 32, 64)
ROUNDS = int(os.environ.get("HOST_BENCH_ROUNDS", "5"))
COLD = os.environ.get("HOST_BENCH_COLD", "0") == "1"
_EVICT = np.zeros(1 << 20) if COLD else None  # 8 MB written before each timed step when COLD
OUTPUT_CAP, WIDTH, UNTIMED_STEPS = 128, 16, 10
SGLANG_DEPTH = 18
PROFILE = get_profile("h200-llama8b")

pytestmark = pytest.mark.skipif(TRACE not in TRACES, reason=f"trace {TRACE} (../shared/traces) is absent")


@lru_cache(maxsize=None)
def _step_ms(batch: int, width: int) -> float:
    """The profile's step cost, looked up once (a server reads a GPU timer: no interpolation on its host path)."""
    return PROFILE.cost_ms(batch, width)


def _clock_cost() -> tuple[float, float]:
    """Seconds an empty (wall, cpu) interval records."""
    n, w, c = 2000, 0.0, 0.0
    for _ in range(n):
        w0, c0 = time.perf_counter(), time.thread_time()
        c1, w1 = time.thread_time(), time.perf_counter()
        w += w1 - w0
        c += c1 - c0
    return w / n, c / n


class Replay:
    """Drives one method over the workload; ``method.step(rids, committed, waiting)`` is the timed host work
    and returns one (tokens, parents) draft per request (the verified prefix)."""

    def __init__(self, prompts, outputs, batch):
        self.prompts, self.outputs, self.batch = prompts, outputs, batch

    def run(self, method) -> dict:
        prompts, outputs = self.prompts, self.outputs
        pos, active, upcoming = {}, [], 0
        committed: dict = {}
        wall = cpu = 0.0
        request_steps = steps = tokens = all_request_steps = 0
        clock_w, clock_c = CLOCK
        proc0, thread0 = time.process_time(), time.thread_time()
        while active or upcoming < len(outputs):
            while len(active) < self.batch and upcoming < len(outputs):
                method.start(upcoming, prompts[upcoming])
                pos[upcoming] = 0
                active.append(upcoming)
                upcoming += 1
            commits = [committed.pop(r, ()) for r in active]
            method.prepare(active, commits)  # untimed: what the server does anyway (e.g. build request views)
            if COLD:
                np.add(_EVICT, 1.0, out=_EVICT)  # untimed: other work between two steps evicts the step's code, data
            w0, c0 = time.perf_counter(), time.thread_time()
            raw = method.step(active, commits, len(outputs) - upcoming)
            c1, w1 = time.thread_time(), time.perf_counter()
            drafts = method.unpack(raw, len(active))  # untimed: the verifier's side
            if steps >= UNTIMED_STEPS:
                wall += w1 - w0 - clock_w
                cpu += c1 - c0 - clock_c
                request_steps += len(active)
            steps += 1
            all_request_steps += len(active)
            done = []
            for rid, (toks, pars) in zip(active, drafts):
                out, p = outputs[rid], pos[rid]
                n = min(len(accepted_path(toks, pars, out[p:p + len(toks) + 1])) + 1, len(out) - p)
                committed[rid] = out[p:p + n]
                pos[rid] = p + n
                tokens += n
                if pos[rid] == len(out):
                    done.append(rid)
            for rid in done:
                active.remove(rid)
                committed.pop(rid, None)
                method.finish(rid)
        # CPU time of the method's other threads (NgramCorpus inserts on one), over the whole replay, scaled to the
        # timed request-steps: on one core a server pays it too
        background = (time.process_time() - proc0) - (time.thread_time() - thread0)
        background *= request_steps / max(all_request_steps, 1)
        return {"cpu_us": 1e6 * max(cpu, 0.0) / max(request_steps, 1),
                "all_threads_cpu_us": 1e6 * (max(cpu, 0.0) + max(background, 0.0)) / max(request_steps, 1),
                "wall_us": 1e6 * max(wall, 0.0) / max(request_steps, 1),
                "tokens_per_request_step": tokens / max(all_request_steps, 1), "steps": steps}


class CacheAlone:
    name = "ngramspec cache"

    def __init__(self):
        self.cache = NgramCache(max_depth=16)

    def start(self, rid, prompt):
        self.cache.start_request(rid, prompt)

    def prepare(self, rids, commits):
        self.new = [(r, c) for r, c in zip(rids, commits) if len(c)]

    def step(self, rids, commits, waiting):
        if self.new:
            self.cache.add_tokens_batch([r for r, _ in self.new], [c for _, c in self.new])
        return self.cache.propose(rids, WIDTH - 1, tree=True)

    def unpack(self, b, n):
        return [(b.tokens[b.offsets[i]:b.offsets[i + 1]], b.parents[b.offsets[i]:b.offsets[i + 1]]) for i in range(n)]

    def finish(self, rid):
        self.cache.finish_request(rid, share=True)


class CacheController:
    name = "ngramspec cache + controller"

    def __init__(self):
        self.cache = NgramCache(max_depth=16)
        self.ctl = AdaptiveController()

    def start(self, rid, prompt):
        self.cache.start_request(rid, prompt)
        self.ctl.start(rid)

    def prepare(self, rids, commits):
        pass

    def step(self, rids, commits, waiting):
        b, plan = self.ctl.step(self.cache, rids, commits, waiting=waiting)
        self.ctl.observe_step(len(rids), plan.width, _step_ms(len(rids), plan.width))
        return b, plan

    def unpack(self, raw, n):
        b, plan = raw
        o, k = b.offsets, plan.lengths
        return [(b.tokens[o[i]:o[i] + k[i]], b.parents[o[i]:o[i] + k[i]]) for i in range(n)]

    def finish(self, rid):
        self.cache.finish_request(rid, share=True)
        self.ctl.finish(rid)


class CacheControllerVerbs(CacheController):
    """The same work through the verbs (`add_tokens_batch`, `observe_batch`, `propose`, `plan`): what a caller
    pays that does not use the one-call `step`."""

    name = "ngramspec cache + controller, verb by verb"

    def step(self, rids, commits, waiting):
        new = [(r, c) for r, c in zip(rids, commits) if len(c)]
        if new:
            self.cache.add_tokens_batch([r for r, _ in new], [c for _, c in new])
            self.ctl.observe_batch([r for r, _ in new], [c for _, c in new])
        b = self.cache.propose(rids, WIDTH - 1, tree=True)
        plan = self.ctl.plan(rids, b, waiting=waiting)
        self.ctl.observe_step(len(rids), plan.width, _step_ms(len(rids), plan.width))
        return b, plan


class Planner:
    name = "NGRAM_ADAPTIVE planner"

    def __init__(self):
        from ngramspec_sglang.config import AdaptiveConfig
        from ngramspec_sglang.drafting import DraftPlanner, RequestView

        self.view = RequestView
        # every batch size drafts (the server's default stops at 48 requests): the planner's work at 64 too
        self.planner = DraftPlanner(AdaptiveConfig(widths=DEFAULT_WIDTHS, max_depth=16, draft_max_batch=None))
        self.prompts, self.outs = {}, {}

    def start(self, rid, prompt):
        self.prompts[rid], self.outs[rid] = prompt.tolist(), []

    def prepare(self, rids, commits):
        for r, c in zip(rids, commits):
            self.outs[r].extend(c.tolist() if len(c) else ())  # a server's output ids are Python ints
        self.views = [self.view(r, self.prompts[r], self.outs[r]) for r in rids]

    def step(self, rids, commits, waiting):
        plan = self.planner.plan(self.views, waiting=waiting)
        self.planner.record_duration(plan.width, len(rids), _step_ms(len(rids), plan.width) / 1e3)
        return plan

    def unpack(self, plan, n):
        out = []
        for b, k in enumerate(plan.drafted.tolist()):
            mask = plan.mask[b]
            parents = [int(np.flatnonzero(mask[j, :j])[-1]) - 1 for j in range(1, k + 1)]
            out.append((plan.tokens[b, 1:k + 1], parents))
        return out

    def finish(self, rid):
        self.planner.release([rid])


class SglangCorpus:
    name = "SGLang NgramCorpus"

    def __init__(self):
        from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

        from ngramspec.sim.methods.sglang_ngram import split_sglang_drafts

        self.split = split_sglang_drafts
        self.corpus = NgramCorpus(max_trie_depth=SGLANG_DEPTH, min_bfs_breadth=1, max_bfs_breadth=10,
                                  draft_token_num=WIDTH, match_type="BFS", capacity=10_000_000)
        self.tail, self.length = {}, {}

    def start(self, rid, prompt):
        self.tail[rid] = prompt[-SGLANG_DEPTH:].tolist()
        self.length[rid] = prompt.size

    def prepare(self, rids, commits):
        for r, c in zip(rids, commits):
            if len(c):
                self.tail[r] = (self.tail[r] + list(c))[-SGLANG_DEPTH:]
                self.length[r] += len(c)

    def step(self, rids, commits, waiting):
        self.corpus.synchronize()
        ids, mask = self.corpus.batch_get([str(r) for r in rids], [self.tail[r] for r in rids],
                                          [self.length[r] for r in rids])
        self.corpus.batch_put([self.tail[r] for r in rids])
        return ids, mask

    def unpack(self, raw, n):
        return self.split(raw[0], raw[1], n, WIDTH)

    def finish(self, rid):
        self.corpus.erase_match_state([str(rid)])


class ArcticSuffix:
    name = "Arctic SuffixDecodingCache"

    def __init__(self):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=64, max_cached_requests=-1)
        self.seq, self.length = {}, {}

    def start(self, rid, prompt):
        self.seq[rid] = np.empty(prompt.size + OUTPUT_CAP, np.int32)
        self.seq[rid][:prompt.size] = prompt
        self.length[rid] = prompt.size
        self.cache.start_request(rid, prompt)

    def prepare(self, rids, commits):
        pass

    def step(self, rids, commits, waiting):
        out = []
        for rid, c in zip(rids, commits):
            if len(c):
                self.cache.add_active_response(rid, c)
                n = self.length[rid]
                self.seq[rid][n:n + len(c)] = c
                self.length[rid] = n + len(c)
            n = self.length[rid]
            d = self.cache.speculate(rid, self.seq[rid][max(0, n - 64):n], max_spec_tokens=WIDTH - 1,
                                     use_tree_spec=True)
            out.append(d)
        return out

    def unpack(self, raw, n):
        return [(d.token_ids, d.parents) for d in raw]

    def finish(self, rid):
        self.cache.stop_request(rid)


METHODS = (CacheAlone, CacheController, CacheControllerVerbs, Planner, SglangCorpus, ArcticSuffix)
CLOCK = (0.0, 0.0)


@pytest.fixture(scope="module")
def workload():
    global CLOCK
    warm_up()
    CLOCK = _clock_cost()
    trace = load_trace(TRACES[TRACE])
    return [r.prompt for r in trace.requests], [np.ascontiguousarray(r.output[:OUTPUT_CAP]) for r in trace.requests]


@pytest.mark.parametrize("batch", BATCHES)
def test_host_time_per_request_step(benchmark, workload, batch, capsys):
    prompts, outputs = workload
    n = max(16, 2 * batch)
    replay = Replay(prompts[:n], outputs[:n], batch)
    available, skipped = [], []
    for cls in METHODS:
        try:
            cls()
            available.append(cls)
        except ImportError as exc:
            skipped.append(f"{cls.name}: {exc}")
    results = {cls.name: [] for cls in available}

    def rounds():
        for _ in range(ROUNDS):
            for cls in available:  # interleaved: a noisy neighbour hits every method alike
                results[cls.name].append(replay.run(cls()))

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    med = {name: {k: statistics.median(r[k] for r in rs)
                  for k in ("cpu_us", "all_threads_cpu_us", "wall_us", "tokens_per_request_step")}
           for name, rs in results.items()}
    info = {"trace": TRACE, "batch": batch, "rounds": ROUNDS, "requests": n, "skipped": skipped, "cold": COLD,
            "load_average_1min": os.getloadavg()[0]}
    ref = med.get(SglangCorpus.name)
    for name, m in med.items():
        key = name.replace(" ", "_").replace("+", "and")
        info[f"{key}_us_per_request_step"] = m["cpu_us"]
        info[f"{key}_all_threads_us_per_request_step"] = m["all_threads_cpu_us"]
        info[f"{key}_wall_us_per_request_step"] = m["wall_us"]
        info[f"{key}_tokens_per_request_step"] = m["tokens_per_request_step"]
        if ref is not None:
            info[f"{key}_x_below_ngramcorpus"] = ref["cpu_us"] / max(m["cpu_us"], 1e-9)
            info[f"{key}_x_below_ngramcorpus_all_threads"] = ref["all_threads_cpu_us"] / max(m["all_threads_cpu_us"],
                                                                                          1e-9)
    benchmark.extra_info.update(info)
    with capsys.disabled():
        print(f"\n{TRACE} batch {batch}: host time per request-step{' (cold caches)' if COLD else ''}, median of "
              f"{ROUNDS} rounds (1-min load {info['load_average_1min']:.1f})")
        print("| method | CPU us | CPU us, all threads | wall us | x below NgramCorpus: CPU / all threads / wall "
              "| tokens/request-step |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, m in med.items():
            x = " / ".join(f"{ref[k] / max(m[k], 1e-9):.1f}" for k in ("cpu_us", "all_threads_cpu_us", "wall_us")) \
                if ref else "-"
            print(f"| {name} | {m['cpu_us']:.2f} | {m['all_threads_cpu_us']:.2f} | {m['wall_us']:.2f} | {x} "
                  f"| {m['tokens_per_request_step']:.2f} |")
        for s in skipped:
            print(f"(skipped {s})")
    assert all(m["tokens_per_request_step"] >= 1.0 for m in med.values())

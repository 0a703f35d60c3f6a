"""Core cache benchmarks on the real dev traces, with the two anchors measured on the same data in the same run.

    .venv-sglang/bin/python -m pytest bench/test_bench_core.py --benchmark-only

Methods (each skips with a reason when its package is missing; the whole file skips without ../shared/traces):

- **ngramspec** `NgramCache(max_depth=16)`, budget 8, chain and tree.
- **SGLang** `NgramCorpus` (sglang 0.5.23, its server defaults: max_trie_depth 18, BFS breadth 1..10, capacity
  10M, draft_token_num 9 = root + 8), fed as `NGRAMWorker` feeds it: each step one `batch_get` for the batch
  with the last 18 tokens of every sequence; after the verify one `batch_put` of every sequence's last 18
  tokens (from before the step) followed by `synchronize()` (the insert runs on its own thread).
- **Arctic** `SuffixDecodingCache` (arctic-inference 0.3.0, max_tree_depth 64, no request limit):
  `start_request(prompt)`, one `speculate` per request (max_spec_tokens 8, its defaults otherwise),
  `add_active_response(new tokens)`, `stop_request`; int32 arrays throughout.

Workload per trace: its first 128 requests, outputs cut to their first 128 tokens, served closed-loop with
continuous batching at batch 1 or 64: each step every active request gets a draft, greedy verification against
the recorded output accepts a prefix, accepted + 1 tokens are committed. Only the method's own calls are
timed, never the driver; each is timed in process CPU time (all threads, so SGLang's insert thread counts:
the cost on one core, robust to a loaded machine) and in wall time (`*_wall_*`). `extra_info` holds:

- `insert_us_per_token`: start_request + per-step append time per token indexed (prompt + committed).
  ngramspec: `start_request` + `add_tokens_batch`; `append_us_per_token` the decode-time part alone;
  `finish_us_per_request` `finish_request(share=True)` (frees the request, indexes its output in the shared
  trie); `kernel_*` the jitted entry points alone (numba dispatch included), the rest is the Python API.
  Arctic: `start_request` + `add_active_response`. SGLang: `put_us` per request per step (18 tokens each),
  `insert_us_per_token` the same per committed token.
- `propose_us_per_request`: draft time per request per step (`propose` / `batch_get` divided by the batch,
  `speculate` per call); `..._full_batch` over the steps at the full batch size only.
- memory: ngramspec `bytes_allocated` (fixed at construction, default capacities), peak `live_nodes`,
  `cached_tokens` (active histories + shared cache) and `live_bytes_per_cached_token` (live nodes x bytes per
  node + 4 per token); Arctic `estimate_memory()` of its trees per cached token; SGLang the resident memory
  its constructor allocates.
"""
from __future__ import annotations

import os
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest

from ngramspec import NgramCache, _draft, _shared
from ngramspec.layout import accepted_path
from ngramspec.sim.traces import dev_trace_paths, load_trace

D, BUDGET = 16, 8
BATCHES = (1, 64)
N_REQUESTS, OUTPUT_CAP = 128, 128
SGLANG_DEPTH, SGLANG_WIDTH = 18, BUDGET + 1
ARCTIC_DEPTH = 64
MEMORY_EVERY = 64  # steps between memory samples (untimed)

TRACES = {p.name.split(".")[0]: p for p in dev_trace_paths()}
pytestmark = pytest.mark.skipif(not TRACES, reason="shared dev traces (../shared/traces) are absent")


@pytest.fixture(scope="module", autouse=True)
def calibrated_clock():
    return Clock.calibrate()


# ------------------------------------------------------------------------------------------------- workload
@dataclass
class Workload:
    name: str
    prompts: list  # int32 arrays
    outputs: list  # int32 arrays
    output_lists: list = field(default_factory=list)

    def __post_init__(self):
        self.output_lists = [o.tolist() for o in self.outputs]


_WORKLOADS: dict[str, Workload] = {}


def workload(name: str) -> Workload:
    if name not in _WORKLOADS:
        trace = load_trace(TRACES[name])
        reqs = trace.requests[:N_REQUESTS]
        _WORKLOADS[name] = Workload(name, [r.prompt for r in reqs],
                                    [np.ascontiguousarray(r.output[:OUTPUT_CAP]) for r in reqs])
    return _WORKLOADS[name]


class Clock:
    """Accumulates, per operation kind, wall time and process CPU time (all threads: SGLang inserts on its own
    thread). On a loaded machine wall time includes waiting for a core; CPU time is the cost on one core.
    Reading the CPU clock is a system call (~1-2 µs here): the cost of an empty interval, measured once, is
    subtracted from every interval."""

    overhead = {"cpu": 0.0, "wall": 0.0}  # seconds an empty interval records

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    @staticmethod
    def now():
        return time.perf_counter(), time.process_time()

    def add(self, kind: str, t0) -> None:
        c, w = time.process_time(), time.perf_counter()
        self.wall[kind] = self.wall.get(kind, 0.0) + w - t0[0]
        self.cpu[kind] = self.cpu.get(kind, 0.0) + c - t0[1]
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def us(self, kind: str, per: int, basis: str = "cpu") -> float | None:
        spent = (self.cpu if basis == "cpu" else self.wall).get(kind)
        if spent is None or per == 0:
            return None
        return 1e6 * max(0.0, spent - self.calls[kind] * Clock.overhead[basis]) / per

    @classmethod
    def calibrate(cls, n: int = 5000) -> dict:
        """Measure what an empty interval records (the best of a few tries: the floor, not the noise)."""
        best = {"cpu": float("inf"), "wall": float("inf")}
        for _ in range(5):
            c = cls()
            for _ in range(n):
                t0 = c.now()
                c.add("empty", t0)
            for basis in best:
                best[basis] = min(best[basis], (c.cpu if basis == "cpu" else c.wall)["empty"] / n)
        cls.overhead = best
        return best


@dataclass
class Run:
    clock: Clock = field(default_factory=Clock)
    prompt_tokens: int = 0
    committed_tokens: int = 0
    steps: int = 0
    proposals: int = 0  # request-steps
    full_proposals: int = 0  # request-steps of steps at the full batch size
    finished: int = 0
    drafted: int = 0
    peak: dict = field(default_factory=dict)  # memory sample with the most live bytes


def replay(w: Workload, batch: int, drafter) -> Run:
    """Closed-loop continuous batching over ``w``; times only the drafter's own calls."""
    run = Run()
    clock = run.clock
    pending = deque(range(len(w.prompts)))
    pos: dict[int, int] = {}

    def admit():
        while pending and len(pos) < batch:
            rid = pending.popleft()
            t0 = clock.now()
            drafter.start(rid, w.prompts[rid])
            clock.add("start", t0)
            run.prompt_tokens += w.prompts[rid].size
            pos[rid] = 0

    def sample():
        mem = drafter.memory()
        if mem and mem.get("live_bytes", 0) >= run.peak.get("live_bytes", -1):
            run.peak = mem

    admit()
    while pos:
        rids = list(pos)
        t0 = clock.now()
        raw = drafter.propose(rids)
        clock.add("propose", t0)
        if len(rids) == batch:
            clock.add("propose_full", t0)
            run.full_proposals += len(rids)
        drafts = drafter.unpack(raw, len(rids))
        commits = []
        for rid, (tokens, parents) in zip(rids, drafts):
            p = pos[rid]
            out = w.output_lists[rid]
            n = len(accepted_path(tokens, parents, out[p:p + BUDGET + 1]))
            commits.append(w.outputs[rid][p:min(p + n + 1, len(out))])
            run.drafted += len(tokens)
        t0 = clock.now()
        drafter.commit(rids, commits)
        clock.add("commit", t0)
        drafter.observe(rids, commits)
        run.steps += 1
        run.proposals += len(rids)
        for rid, c in zip(rids, commits):
            pos[rid] += c.size
            run.committed_tokens += c.size
        if run.steps % MEMORY_EVERY == 0:
            sample()
        done = [rid for rid in rids if pos[rid] == len(w.outputs[rid])]
        if done and len(done) == len(pos):
            sample()  # the last moment before the final requests leave
        for rid in done:
            t0 = clock.now()
            drafter.finish(rid)
            clock.add("finish", t0)
            run.finished += 1
            del pos[rid]
        admit()
    sample()
    return run


def common_info(benchmark, w: Workload, batch: int, method: str, run: Run) -> dict:
    c = run.clock
    info = {
        "trace": w.name, "method": method, "batch": batch, "requests": len(w.prompts),
        "prompt_tokens": run.prompt_tokens, "committed_tokens": run.committed_tokens, "steps": run.steps,
        "mean_batch": run.proposals / run.steps,
        "propose_us_per_request": c.us("propose", run.proposals),
        "propose_us_per_request_full_batch": c.us("propose_full", run.full_proposals),
        "propose_wall_us_per_request": c.us("propose", run.proposals, "wall"),
        "accept_len": run.committed_tokens / run.proposals,  # tokens per step per request (accepted + bonus)
        "drafted_per_step": run.drafted / run.proposals,
        "load_average_1min": os.getloadavg()[0],
        "timer_overhead_us_cpu": 1e6 * Clock.overhead["cpu"], "timer_overhead_us_wall": 1e6 * Clock.overhead["wall"],
        **run.peak,
    }
    benchmark.extra_info.update(info)
    return info


# ---------------------------------------------------------------------------------------------- ngramspec
class Ngramspec:
    def __init__(self, tree: bool):
        self.cache = NgramCache(max_depth=D)
        self.tree = tree
        self.held: dict = {}  # tokens in each active request's history

    def start(self, rid, prompt):
        self.cache.start_request(rid, prompt)
        self.held[rid] = prompt.size

    def propose(self, rids):
        return self.cache.propose(rids, BUDGET, tree=self.tree)

    @staticmethod
    def unpack(batch, n):
        tok, par, off = batch.tokens.tolist(), batch.parents.tolist(), batch.offsets.tolist()
        return [(tok[off[i]:off[i + 1]], par[off[i]:off[i + 1]]) for i in range(n)]

    def commit(self, rids, commits):
        self.cache.add_tokens_batch(rids, commits)

    def observe(self, rids, commits):
        for rid, c in zip(rids, commits):
            self.held[rid] += c.size

    def finish(self, rid):
        self.cache.finish_request(rid, share=True)
        del self.held[rid]

    def memory(self):
        s = self.cache.stats()
        cached = s["shared_tokens_held"] + sum(self.held.values())
        live = s["local_nodes_live"] + s["shared_nodes_live"]
        live_bytes = live * s["bytes_per_node"] + 4 * cached
        return {"bytes_allocated": s["bytes_allocated"], "live_nodes": live, "cached_tokens": cached,
                "live_bytes": live_bytes, "live_bytes_per_cached_token": live_bytes / max(cached, 1),
                "allocated_bytes_per_cached_token": s["bytes_allocated"] / max(cached, 1)}


@contextmanager
def kernel_clock():
    """Time ngramspec's jitted entry points (batch append, batch propose, share; numba's argument dispatch
    included) apart from the Python API around them. Yields a Clock filled while the block runs."""
    clock = Clock()
    entries = [(_draft, "append_batch"), (_draft, "propose_batch"), (_shared, "share_tokens")]
    originals = [(mod, name, getattr(mod, name)) for mod, name in entries]

    def timed(name, fn):
        def call(*args):
            t0 = clock.now()
            try:
                return fn(*args)
            finally:
                clock.add(name, t0)
        return call

    try:
        for mod, name, fn in originals:
            setattr(mod, name, timed(name, fn))
        yield clock
    finally:
        for mod, name, fn in originals:
            setattr(mod, name, fn)


@pytest.fixture(scope="module")
def warm_numba():
    """Compile (or load) every kernel before anything is timed."""
    w = Workload("warmup", [np.arange(40, dtype=np.int32) % 7], [np.arange(30, dtype=np.int32) % 5])
    for tree in (True, False):
        replay(w, 1, Ngramspec(tree))
    return True


_SCHEDULES: dict = {}


def schedule(w: Workload, batch: int):
    """The (start / commit / finish) events of a closed-loop ngramspec tree replay, to replay insert-only."""
    key = (w.name, batch)
    if key not in _SCHEDULES:
        events = []

        class Recorder(Ngramspec):
            def start(self, rid, prompt):
                events.append(("start", rid, prompt))
                super().start(rid, prompt)

            def commit(self, rids, commits):
                events.append(("commit", rids, commits))
                super().commit(rids, commits)

            def finish(self, rid):
                events.append(("finish", rid, None))
                super().finish(rid)

        replay(w, batch, Recorder(tree=True))
        _SCHEDULES[key] = events
    return _SCHEDULES[key]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("trace", sorted(TRACES))
def test_ngramspec_insert(benchmark, core_rows, warm_numba, trace, batch):
    """Indexing alone: the start / add_tokens_batch / finish_request(share) calls of a recorded replay."""
    w = workload(trace)
    events = schedule(w, batch)
    rounds = []

    def feed(cache):
        clock = Clock()
        for kind, a, b in events:
            t0 = clock.now()
            if kind == "commit":
                cache.add_tokens_batch(a, b)
            elif kind == "start":
                cache.start_request(a, b)
            else:
                cache.finish_request(a, share=True)
            clock.add(kind, t0)
        rounds.append(clock)

    benchmark.group = f"insert {trace}"
    benchmark.pedantic(feed, setup=lambda: ((NgramCache(max_depth=D),), {}), rounds=2, iterations=1)
    clock = min(rounds, key=lambda c: sum(c.cpu.values()))
    with kernel_clock() as kernels:  # a separate pass: the kernels' clock would inflate the API's figures
        feed(NgramCache(max_depth=D))
    prompt = sum(b.size for k, _, b in events if k == "start")
    committed = sum(c.size for k, _, cs in events if k == "commit" for c in cs)
    finished = sum(k == "finish" for k, _, _ in events)
    benchmark.extra_info.update({
        "trace": trace, "method": "ngramspec insert only", "batch": batch, "prompt_tokens": prompt,
        "committed_tokens": committed, "load_average_1min": os.getloadavg()[0],
        "timer_overhead_us_cpu": 1e6 * Clock.overhead["cpu"], "timer_overhead_us_wall": 1e6 * Clock.overhead["wall"],
        **insert_info(clock, kernels, prompt, committed, finished),
    })
    core_rows.append(dict(benchmark.extra_info))
    assert committed == sum(o.size for o in w.outputs) and finished == len(w.outputs)


def insert_info(clock: Clock, kernels: Clock, prompt: int, committed: int, finished: int) -> dict:
    return {
        "insert_us_per_token": (clock.us("start", prompt + committed) or 0) + clock.us("commit", prompt + committed),
        "insert_wall_us_per_token": ((clock.us("start", prompt + committed, "wall") or 0)
                                     + clock.us("commit", prompt + committed, "wall")),
        "prompt_us_per_token": clock.us("start", prompt),
        "append_us_per_token": clock.us("commit", committed),
        "finish_us_per_request": clock.us("finish", finished),
        # the jitted kernels alone: append_batch indexes prompts and appended tokens; share_tokens the outputs
        "kernel_insert_us_per_token": kernels.us("append_batch", prompt + committed),
        "kernel_share_us_per_token": kernels.us("share_tokens", committed),
    }


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("trace", sorted(TRACES))
def test_ngramspec_propose(benchmark, core_rows, warm_numba, trace, batch, tree):
    w = workload(trace)
    benchmark.group = f"replay {trace}"
    run = benchmark.pedantic(lambda: replay(w, batch, Ngramspec(tree)), rounds=1, iterations=1)
    with kernel_clock() as kernels:  # a separate, identical pass: the kernels' clock would inflate the API's
        replay(w, batch, Ngramspec(tree))
    info = common_info(benchmark, w, batch, f"ngramspec {'tree' if tree else 'chain'}", run)
    benchmark.extra_info.update({
        "kernel_propose_us_per_request": kernels.us("propose_batch", run.proposals),
        **insert_info(run.clock, kernels, run.prompt_tokens, run.committed_tokens, run.finished),
    })
    core_rows.append(dict(benchmark.extra_info))
    assert run.committed_tokens == sum(o.size for o in w.outputs)
    assert info["drafted_per_step"] <= BUDGET


# ------------------------------------------------------------------------------------------------- SGLang
def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module")
def sglang_corpus():
    """One NgramCorpus at SGLang's server defaults (its constructor allocates the whole capacity: build once,
    `reset()` per benchmark). Returns (corpus, resident bytes its constructor added, construction seconds)."""
    try:
        from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
    except Exception as exc:  # ImportError, or the JIT build of its C++ failing
        pytest.skip(f"SGLang NgramCorpus unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    before = _rss_bytes()
    t0 = time.perf_counter()
    corpus = NgramCorpus(max_trie_depth=SGLANG_DEPTH, min_bfs_breadth=1, max_bfs_breadth=10,
                         draft_token_num=SGLANG_WIDTH, match_type="BFS", capacity=10_000_000)
    seconds = time.perf_counter() - t0
    after = _rss_bytes()
    return corpus, (after - before if before is not None and after is not None else None), seconds


class SglangCorpus:
    def __init__(self, corpus):
        from ngramspec.sim.methods.sglang_ngram import split_sglang_drafts

        self.split = split_sglang_drafts
        corpus.reset()
        self.corpus = corpus
        self.tail: dict = {}
        self.length: dict = {}
        self.name: dict = {}

    def start(self, rid, prompt):
        self.tail[rid] = prompt[-SGLANG_DEPTH:].tolist()  # the prompt itself is never inserted (as the worker)
        self.length[rid] = prompt.size
        self.name[rid] = str(rid)

    def propose(self, rids):
        self.corpus.synchronize()
        return self.corpus.batch_get([self.name[r] for r in rids], [self.tail[r] for r in rids],
                                     [self.length[r] for r in rids])

    def unpack(self, raw, n):
        ids, mask = raw
        return [(t.tolist(), p.tolist()) for t, p in self.split(ids, mask, n, SGLANG_WIDTH)]

    def commit(self, rids, commits):
        self.corpus.batch_put([self.tail[r] for r in rids])  # the sequence as it was before this step
        self.corpus.synchronize()

    def observe(self, rids, commits):
        for rid, c in zip(rids, commits):
            self.tail[rid] = (self.tail[rid] + c.tolist())[-SGLANG_DEPTH:]
            self.length[rid] += c.size

    def finish(self, rid):
        self.corpus.erase_match_state([self.name[rid]])
        del self.tail[rid], self.length[rid]

    def memory(self):
        return None


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("trace", sorted(TRACES))
def test_sglang_ngram_corpus(benchmark, core_rows, sglang_corpus, trace, batch):
    corpus, rss, build_s = sglang_corpus
    w = workload(trace)
    benchmark.group = f"replay {trace}"
    run = benchmark.pedantic(lambda: replay(w, batch, SglangCorpus(corpus)), rounds=1, iterations=1)
    common_info(benchmark, w, batch, f"SGLang NgramCorpus BFS D={SGLANG_WIDTH}", run)
    benchmark.extra_info.update({
        "put_us": run.clock.us("commit", run.proposals),  # one 18-token put per request per step
        "put_wall_us": run.clock.us("commit", run.proposals, "wall"),
        "insert_us_per_token": run.clock.us("commit", run.committed_tokens),
        "bytes_allocated": rss, "construct_s": build_s,
    })
    core_rows.append(dict(benchmark.extra_info))
    assert run.committed_tokens == sum(o.size for o in w.outputs)


# ------------------------------------------------------------------------------------------------- Arctic
@pytest.fixture(scope="module")
def arctic_cls():
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except Exception as exc:
        pytest.skip(f"Arctic SuffixDecodingCache unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return SuffixDecodingCache


class ArcticSuffix:
    def __init__(self, cls, tree: bool):
        self.cache = cls(max_tree_depth=ARCTIC_DEPTH, max_cached_requests=-1)
        self.tree = tree
        self.seq: dict = {}
        self.length: dict = {}
        self.prompt_len: dict = {}
        self.finished_outputs = 0  # tokens of finished outputs, all still in the global tree

    def start(self, rid, prompt):
        self.prompt_len[rid] = prompt.size
        self.seq[rid] = np.empty(prompt.size + OUTPUT_CAP, np.int32)
        self.seq[rid][:prompt.size] = prompt
        self.length[rid] = prompt.size
        self.cache.start_request(rid, prompt)

    def propose(self, rids):
        spec = self.cache.speculate
        out = []
        for rid in rids:
            n = self.length[rid]
            out.append(spec(rid, self.seq[rid][max(0, n - ARCTIC_DEPTH):n], max_spec_tokens=BUDGET,
                            use_tree_spec=self.tree))
        return out

    @staticmethod
    def unpack(raw, n):
        return [(d.token_ids, d.parents) for d in raw]

    def commit(self, rids, commits):
        add = self.cache.add_active_response
        for rid, c in zip(rids, commits):
            add(rid, c)

    def observe(self, rids, commits):
        for rid, c in zip(rids, commits):
            n = self.length[rid]
            self.seq[rid][n:n + c.size] = c
            self.length[rid] = n + c.size

    def finish(self, rid):
        self.cache.stop_request(rid)
        self.finished_outputs += self.length[rid] - self.prompt_len[rid]
        del self.seq[rid], self.length[rid], self.prompt_len[rid]

    def memory(self):
        trees = [self.cache._global_tree, *self.cache._local_trees.values()]
        live = sum(int(t.estimate_memory()) for t in trees)
        cached = sum(self.length.values()) + self.finished_outputs  # active histories + finished outputs
        return {"live_bytes": live, "cached_tokens": cached, "live_bytes_per_cached_token": live / max(cached, 1)}


@pytest.mark.parametrize("batch, tree", [(1, False), (64, False), (64, True)], ids=["1-path", "64-path", "64-tree"])
@pytest.mark.parametrize("trace", sorted(TRACES))
def test_arctic_suffix(benchmark, core_rows, arctic_cls, trace, batch, tree):
    w = workload(trace)
    benchmark.group = f"replay {trace}"
    run = benchmark.pedantic(lambda: replay(w, batch, ArcticSuffix(arctic_cls, tree)), rounds=1, iterations=1)
    common_info(benchmark, w, batch, f"Arctic suffix {'tree' if tree else 'path'}", run)
    c, tokens = run.clock, run.prompt_tokens + run.committed_tokens
    benchmark.extra_info.update({
        "insert_us_per_token": c.us("start", tokens) + c.us("commit", tokens),
        "insert_wall_us_per_token": c.us("start", tokens, "wall") + c.us("commit", tokens, "wall"),
        "prompt_us_per_token": c.us("start", run.prompt_tokens),
        "append_us_per_token": c.us("commit", run.committed_tokens),
        "finish_us_per_request": c.us("finish", run.finished),
    })
    core_rows.append(dict(benchmark.extra_info))
    assert run.committed_tokens == sum(o.size for o in w.outputs)

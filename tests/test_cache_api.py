"""API-level tests of `NgramCache`: bad input raises a clear exception and changes nothing; request lifecycle,
determinism, and the shared cache's sources and bounds.

"Changes nothing" is checked against a twin cache fed the same valid calls but never the bad one: histories,
stats and drafts (chain and tree, several budgets) must stay identical, also after both are fed more tokens.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngramspec import NgramCache
from ngramspec.cache import MAX_TOKEN, DraftBatch

CONFIG = dict(max_depth=8, max_requests=4, local_nodes=4096, shared_nodes=2048, shared_tokens=2048,
              shared_segments=16)
RIDS = ["a", 7]  # one str and one int request id stay active in every scenario
PROMPTS = {"a": [5, 6, 7, 8, 5, 6, 7, 9, 5, 6], 7: [40, 41, 42, 40, 41, 43, 40, 41]}
SHARED_OUTPUT = [90, 91, 92, 93, 94, 95, 96, 97]  # a finished request's output, in the shared cache
MORE = {"a": [7, 8, 5, 6, 7], 7: [42, 40, 41, 42]}


def assert_valid_batch(batch: DraftBatch, budgets, tree: bool = True) -> None:
    """Structural contract of a DraftBatch (docs/api.md)."""
    offsets = batch.offsets
    assert offsets.dtype == np.int64 and offsets[0] == 0 and np.all(np.diff(offsets) >= 0)
    assert offsets[-1] == batch.tokens.size == batch.parents.size == batch.probs.size == batch.sources.size
    assert (batch.tokens.dtype, batch.parents.dtype, batch.probs.dtype, batch.sources.dtype) == (
        np.int32, np.int32, np.float32, np.int8)
    assert len(batch) == len(budgets)
    for i in range(len(batch)):
        d = batch.draft(i)
        assert len(d) <= budgets[i]
        if not tree:
            assert d.parents.tolist() == list(range(-1, len(d) - 1))
        for j in range(len(d)):
            p = int(d.parents[j])
            assert -1 <= p < j
            assert 0 < d.probs[j] <= (1.0 if p < 0 else d.probs[p]) + 1e-6
        assert np.all((d.tokens >= 0) & (d.tokens <= MAX_TOKEN))
        assert set(d.sources.tolist()) <= {0, 1}


def assert_batches_equal(x: DraftBatch, y: DraftBatch) -> None:
    for name in ("offsets", "tokens", "parents", "probs", "sources"):
        a, b = getattr(x, name), getattr(y, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)


def scenario():
    """A cache with two active requests with repeats in their prompts, and one shared output."""
    cache = NgramCache(**CONFIG)
    cache.start_request("done", [1, 2, 3])
    cache.add_tokens("done", SHARED_OUTPUT)
    cache.finish_request("done", share=True)
    for rid in RIDS:
        cache.start_request(rid, PROMPTS[rid])
    cache.propose(RIDS, 4)
    return cache


def assert_same_state(bad: NgramCache, twin: NgramCache) -> None:
    """Everything observable agrees, now and after both caches see the same further tokens."""
    for step in range(2):
        assert bad.active_requests == twin.active_requests
        assert bad.stats() == twin.stats()
        for rid in RIDS:
            np.testing.assert_array_equal(bad.history(rid), twin.history(rid))
        for tree in (True, False):
            for budget in (1, 8):
                assert_batches_equal(bad.propose(RIDS, budget, tree=tree), twin.propose(RIDS, budget, tree=tree))
        if step == 0:
            for c in (bad, twin):
                c.add_tokens_batch(RIDS, [MORE[r] for r in RIDS])
                c.add_tokens("a", SHARED_OUTPUT[:3])  # reaches into the shared cache


def _add(rid, tokens):
    return lambda c: c.add_tokens(rid, tokens)


def _start(rid, prompt):
    return lambda c: c.start_request(rid, prompt)


def _batch(rids, lists):
    return lambda c: c.add_tokens_batch(rids, lists)


def _propose(rids, budgets, tree=True):
    return lambda c: c.propose(rids, budgets, tree=tree)


BAD_TOKENS = {  # name: (tokens, exception)
    "float list": ([1.5, 2.0], TypeError),
    "int then float": ([1, 2.0], TypeError),
    "strings": (["1", "2"], TypeError),
    "a str": ("abc", TypeError),
    "bytes": (b"\x01\x02", TypeError),
    "None": (None, TypeError),
    "None inside": ([1, None], TypeError),
    "bare int": (5, TypeError),
    "nested ragged": ([[1, 2], [3]], TypeError),
    "int and list": ([1, [2]], TypeError),
    "bool array": (np.array([True, False]), TypeError),
    "bool list": ([True, False], TypeError),
    "float array": (np.array([1.0, 2.0]), TypeError),
    "float32 array": (np.array([1, 2], dtype=np.float32), TypeError),
    "object array": (np.array([1, 2], dtype=object), TypeError),
    "2-D array": (np.array([[1, 2], [3, 4]]), ValueError),
    "0-D array": (np.array(5), ValueError),
    "negative": ([3, -1], ValueError),
    "negative array": (np.array([-5], dtype=np.int64), ValueError),
    "negative int32 array": (np.array([3, -1], dtype=np.int32), ValueError),
    "int32 min": (np.array([-(2**31)], dtype=np.int32), ValueError),
    "a set": ({1, 2}, TypeError),
    "a frozenset": (frozenset([3]), TypeError),
    "a dict": ({1: 2}, TypeError),
    "dict keys": ({1: 2}.keys(), TypeError),
    "2**31": ([2**31], ValueError),
    "int64 2**40": (np.array([2**40]), ValueError),
    "uint64 2**63": (np.array([2**63], dtype=np.uint64), ValueError),
    "python int 2**64": ([1, 2**64], ValueError),
    "python int -2**70": ([-(2**70)], ValueError),
}

BAD_CALLS = {  # name: (call, exception, message pattern)
    "add to unknown id": (_add("ghost", [1]), KeyError, "ghost"),
    "add to finished id": (_add("done", [1]), KeyError, "done"),
    "propose unknown id": (_propose(["a", "ghost"], 4), KeyError, "ghost"),
    "propose finished id": (_propose([7, "done"], 4), KeyError, "done"),
    "finish unknown id": (lambda c: c.finish_request("ghost"), KeyError, "ghost"),
    "finish finished id": (lambda c: c.finish_request("done"), KeyError, "done"),
    "duplicate start": (_start("a", [1, 2, 3]), ValueError, "'a'"),
    "duplicate start int id": (_start(7, [1, 2, 3]), ValueError, "7"),
    "empty prompt": (_start("new", []), ValueError, "prompt"),
    "empty prompt array": (_start("new", np.zeros(0, dtype=np.int64)), ValueError, "prompt"),
    "batch lengths differ": (_batch(RIDS, [[1]]), ValueError, "2 request ids but 1"),
    "batch id twice": (_batch(["a", "a"], [[1], [2]]), ValueError, "twice"),
    "batch unknown id": (_batch(["a", "ghost"], [[1], [2]]), KeyError, "ghost"),
    "batch, second list bad": (_batch(RIDS, [[1, 2], [1.5]]), TypeError, "tokens"),
    "batch, second array bad": (_batch(RIDS, [np.array([1, 2]), np.array([-3])]), ValueError, "-3"),
    "batch, second int32 array bad": (_batch(RIDS, [np.array([1, 2], np.int32), np.array([-3], np.int32)]),
                                      ValueError, "request 7.*-3"),
    "batch, mixed kinds bad": (_batch(RIDS, [np.array([1, 2]), [2**31]]), ValueError, "tokens"),
    "budget 0": (_propose(RIDS, 0), ValueError, "budget"),
    "budget negative": (_propose(RIDS, -3), ValueError, "budget"),
    "one budget 0": (_propose(RIDS, [8, 0]), ValueError, "budget"),
    "chain budget 0": (_propose(RIDS, 0, tree=False), ValueError, "budget"),
    "budget float": (_propose(RIDS, 2.5), (TypeError, ValueError), "budget"),
    "budget integral float": (_propose(RIDS, [8.0, 8.0]), (TypeError, ValueError), "budget"),
    "budget str": (_propose(RIDS, "8"), (TypeError, ValueError), "budget"),
    "budget None": (_propose(RIDS, None), (TypeError, ValueError), "budget"),
    "budget bool": (_propose(RIDS, True), (TypeError, ValueError), "budget"),
    "budgets length differs": (_propose(RIDS, [8]), ValueError, "budgets"),
    "budgets 2-D": (_propose(RIDS, [[8], [8]]), (TypeError, ValueError), "budget"),
    "propose id twice": (_propose(["a", "a", 7], 4), ValueError, "twice"),
    "propose a bare int id": (_propose(7, 4), TypeError, "list"),
    "propose a bare str id": (_propose("a", 4), TypeError, "list"),
    "propose a set of ids": (_propose({"a", 7}, 4), TypeError, "list"),
    "propose a 2-D id array": (_propose(np.array([[7]]), 4), TypeError, "list"),
    "batch, a bare id": (_batch("a", [[1]]), TypeError, "list"),
    "batch, a dict of token lists": (_batch(RIDS, {"a": [1], 7: [2]}), TypeError, "token_lists"),
    "batch, one str of tokens": (_batch(["a"], "1"), TypeError, "token_lists"),
    "history of unknown id": (lambda c: c.history("ghost"), KeyError, "ghost"),
    "match_length of unknown id": (lambda c: c.match_length("ghost"), KeyError, "ghost"),
    "match_length bad source": (lambda c: c.match_length("a", source="both"), ValueError, "source"),
    "count bad source": (lambda c: c.count([5, 6], source="both", rid="a"), ValueError, "source"),
    "count unknown id": (lambda c: c.count([5, 6], rid="ghost"), KeyError, "ghost"),
    "count empty ngram": (lambda c: c.count([], source="shared"), ValueError, "ngram"),
    "count too long": (lambda c: c.count(list(range(9)), source="shared"), ValueError, "max_depth"),
    "count float ngram": (lambda c: c.count([1.5], source="shared"), TypeError, "ngram"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_call_raises_and_changes_nothing(name):
    call, exc, pattern = BAD_CALLS[name]
    bad, twin = scenario(), scenario()
    with pytest.raises(exc, match=pattern):
        call(bad)
    assert "new" not in bad and "ghost" not in bad
    assert_same_state(bad, twin)


@pytest.mark.parametrize("verb", ["start", "add", "add_batch"])
@pytest.mark.parametrize("name", list(BAD_TOKENS))
def test_bad_tokens_raise_and_change_nothing(name, verb):
    tokens, exc = BAD_TOKENS[name]
    what = "prompt" if verb == "start" else "tokens"
    call = {"start": _start("new", tokens), "add": _add("a", tokens),
            "add_batch": _batch([7, "a"], [[40, 41], tokens])}[verb]
    bad, twin = scenario(), scenario()
    with pytest.raises(exc, match=what):
        call(bad)
    assert "new" not in bad
    assert_same_state(bad, twin)


BAD_CONFIGS = {  # name: (constructor arguments, the argument the message must name)
    "max_depth 1": (dict(max_depth=1), "max_depth"),
    "max_depth 128": (dict(max_depth=128), "max_depth"),
    "max_depth float": (dict(max_depth=8.5), "max_depth"),
    "max_requests 0": (dict(max_requests=0), "max_requests"),
    "max_requests float": (dict(max_requests=3.5), "max_requests"),
    "local_nodes below max_requests + 1": (dict(max_requests=8, local_nodes=8), "local_nodes"),
    "local_nodes float": (dict(local_nodes=4096.5), "local_nodes"),
    "shared_nodes too small": (dict(shared_nodes=3), "shared_nodes"),
    "shared_tokens 1": (dict(shared_tokens=1), "shared_tokens"),
    "shared_segments 0": (dict(shared_segments=0), "shared_segments"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_configuration_is_rejected(name):
    kwargs, argument = BAD_CONFIGS[name]
    with pytest.raises((TypeError, ValueError), match=argument):
        NgramCache(**{**CONFIG, **kwargs})


def test_numpy_integer_configuration_is_accepted():
    cache = NgramCache(**{k: np.int64(v) for k, v in CONFIG.items()})
    cache.start_request("a", PROMPTS["a"])
    assert cache.max_depth == CONFIG["max_depth"] and cache.propose(["a"], 4).offsets[-1] > 0


def test_too_many_active_requests():
    cache = NgramCache(**{**CONFIG, "max_requests": 2})
    twin = NgramCache(**{**CONFIG, "max_requests": 2})
    for c in (cache, twin):
        for rid in RIDS:
            c.start_request(rid, PROMPTS[rid])
    with pytest.raises(RuntimeError, match="max_requests=2"):
        cache.start_request("third", [1, 2, 3])
    assert "third" not in cache and cache.active_requests == 2
    assert_same_state(cache, twin)
    cache.finish_request(7)
    cache.start_request("third", [1, 2, 3])  # a freed slot is usable again
    np.testing.assert_array_equal(cache.history("third"), [1, 2, 3])


@pytest.mark.parametrize("tree", [True, False])
def test_empty_batch_proposes_nothing(tree):
    """Every request of a batch may have finished: proposing for none is an empty DraftBatch, not an error."""
    bad, twin = scenario(), scenario()
    for budgets in (8, []):
        batch = bad.propose([], budgets, tree=tree)
        assert len(batch) == 0 and batch.offsets.tolist() == [0] and batch.tokens.size == 0
    bad.add_tokens_batch([], [])
    assert_same_state(bad, twin)


def test_returned_arrays_are_copies():
    """Mutating what the cache hands out (histories, drafts) changes nothing inside it."""
    bad, twin = scenario(), scenario()
    bad.history("a")[:] = 0
    batch = bad.propose(RIDS, 8)
    twin.propose(RIDS, 8)
    for arr in (batch.tokens, batch.parents, batch.probs, batch.sources, batch.offsets):
        arr[:] = 0
    assert_same_state(bad, twin)


def test_largest_token_id_is_accepted_indexed_and_drafted():
    """docs/api.md: token ids lie in [0, 2**31). The largest, 2**31 - 1, is an ordinary token."""
    top = 2**31 - 1
    assert MAX_TOKEN == top
    cache = NgramCache(**CONFIG)
    cache.start_request("r", [5])
    cache.add_tokens("r", [top, 3, top])
    cache.add_tokens("r", np.array([3], dtype=np.int64))
    assert cache.history("r").tolist() == [5, top, 3, top, 3]
    assert cache.count([top, 3], rid="r") == 2
    d = cache.propose(["r"], 2, tree=False).draft(0)
    assert d.tokens.tolist() == [top, 3]
    cache.finish_request("r", share=True)
    assert cache.count([3, top], source="shared") == 1
    cache.start_request("s", [7, 3])
    assert cache.propose(["s"], 1).draft(0).tokens.tolist() == [top]


def test_unhashable_request_id_is_a_type_error():
    bad, twin = scenario(), scenario()
    with pytest.raises(TypeError):
        bad.start_request(["list", "id"], [1, 2])
    with pytest.raises(TypeError):
        bad.add_tokens(["list", "id"], [1, 2])
    assert_same_state(bad, twin)


@pytest.mark.parametrize("tree", [True, False])
def test_huge_budget_is_rejected_clearly_or_served(tree):
    """A budget far beyond any history either gets a clear ValueError naming the budget, or a valid draft.

    (An O(budget**2) scratch allocation would surface here as a MemoryError.)"""
    bad, twin = scenario(), scenario()
    try:
        batch = bad.propose(RIDS, 10**6, tree=tree)
    except ValueError as e:
        assert "budget" in str(e)
        twin_batch = None
    else:
        assert_valid_batch(batch, [10**6] * len(RIDS), tree)
        twin_batch = twin.propose(RIDS, 10**6, tree=tree)
        assert_batches_equal(batch, twin_batch)
    assert_same_state(bad, twin)


# ------------------------------------------------------------------------------------------------ lifecycle
def _stream(seed: int, n: int, vocab: int) -> list[int]:
    """Repetitive token stream: phrases from a small phrase book, with random fillers."""
    rng = np.random.default_rng(seed)
    book = [rng.integers(0, vocab, size=rng.integers(3, 9)).tolist() for _ in range(12)]
    out: list[int] = []
    while len(out) < n:
        out += book[rng.integers(len(book))] if rng.random() < 0.8 else [int(rng.integers(0, vocab))]
    return out[:n]


def _run_requests(cache: NgramCache, rids, steps: int, seed: int, budget=6, tree=True, finish_at=None):
    """Start `rids`, then `steps` rounds of propose + add_tokens; requests in `finish_at` (rid -> step) finish
    (share=False) between rounds. Returns {rid: [DraftBatch rows as tuples]} of every proposal."""
    streams = {rid: _stream(seed + i, 40 + 6 * steps, 50) for i, rid in enumerate(rids)}
    for rid in rids:
        cache.start_request(rid, streams[rid][:40])
    live = list(rids)
    seen = {rid: [] for rid in rids}
    for step in range(steps):
        for rid, at in (finish_at or {}).items():
            if at == step and rid in live:
                cache.finish_request(rid, share=False)
                live.remove(rid)
        if not live:
            break
        batch = cache.propose(live, budget, tree=tree)
        assert_valid_batch(batch, [budget] * len(live), tree)
        for i, rid in enumerate(live):
            d = batch.draft(i)
            seen[rid].append((d.tokens.tolist(), d.parents.tolist(), d.probs.tolist(), d.sources.tolist()))
        cache.add_tokens_batch(live, [streams[rid][40 + 6 * step: 46 + 6 * step][: 1 + step % 5] for rid in live])
    return seen


def test_request_finished_mid_batch_leaves_the_others_alone():
    """Finishing one request between rounds of a batch changes nothing for the rest: their drafts equal those
    of a cache in which it never existed; the finished id is then unknown everywhere."""
    cache = NgramCache(**CONFIG)
    seen = _run_requests(cache, ["x", "y", "z"], steps=12, seed=3, finish_at={"y": 5})
    alone = _run_requests(NgramCache(**CONFIG), ["x", "_", "z"], steps=12, seed=3, finish_at={"_": 0})
    assert seen["x"] == alone["x"] and seen["z"] == alone["z"]
    assert len(seen["y"]) == 5
    assert any(d[0] for d in seen["x"]), "the streams repeat: some drafts must be non-empty"
    with pytest.raises(KeyError, match="'y'"):
        cache.propose(["x", "y", "z"], 4)
    with pytest.raises(KeyError, match="'y'"):
        cache.add_tokens("y", [1])


def test_reused_slot_starts_clean():
    """A request started after another finished (its slot reused) drafts exactly as in a fresh cache."""
    used = NgramCache(**{**CONFIG, "max_requests": 1, "use_shared": False})
    _run_requests(used, ["old"], steps=10, seed=5, finish_at={"old": 9})
    fresh = NgramCache(**{**CONFIG, "max_requests": 1, "use_shared": False})
    assert used.stats()["local_nodes_live"] == 0
    assert _run_requests(used, ["new"], steps=10, seed=8) == _run_requests(fresh, ["new"], steps=10, seed=8)
    np.testing.assert_array_equal(used.history("new"), fresh.history("new"))


@pytest.mark.parametrize("tree", [True, False])
def test_identically_fed_caches_draft_identically(tree):
    """Determinism (the tensor-parallel contract): same calls, same DraftBatch arrays, with the shared cache
    active and evicting. Request ids may differ: drafts depend on tokens only."""
    small = {**CONFIG, "shared_nodes": 300, "shared_tokens": 400, "shared_segments": 4}
    caches = [NgramCache(**small) for _ in range(2)]
    names = [lambda i: f"r{i}", lambda i: 1000 + i]
    for c, name in zip(caches, names):
        for i in range(3):
            c.start_request(name(i), _stream(i, 40, 30))
    drafted = 0
    for step in range(40):
        batches = []
        for c, name in zip(caches, names):
            rids = [name(i) for i in range(step, step + 3)]
            batches.append(c.propose(rids, [1 + (step + k) % 8 for k in range(3)], tree=tree))
            c.add_tokens_batch(rids, [_stream(100 * step + k, 1 + (step + k) % 4, 30) for k in range(3)])
            c.finish_request(rids[0], share=True)
            c.start_request(name(step + 3), _stream(step + 3, 40, 30))
        assert_batches_equal(*batches)
        drafted += len(batches[0].tokens)
    assert drafted > 0
    assert caches[0].stats() == caches[1].stats()
    assert caches[0].stats()["shared_segments"] <= 4


# --------------------------------------------------------------------------------------------- shared cache
CONTEXT = [300, 301, 302, 303]  # a context only the finished request's output contains
CONTINUATION = [304, 305, 306, 307, 308, 309]


def _share_one(cache: NgramCache, share: bool = True) -> None:
    cache.start_request("first", [1, 2, 3])
    cache.add_tokens("first", CONTEXT + CONTINUATION)
    cache.finish_request("first", share=share)


@pytest.mark.parametrize("tree", [True, False])
def test_finished_output_drafts_for_a_new_request(tree):
    cache = NgramCache(**CONFIG)
    _share_one(cache)
    cache.start_request("second", [7, 8] + CONTEXT)
    d = cache.propose(["second"], 6, tree=tree).draft(0)
    assert d.tokens.tolist() == CONTINUATION
    assert d.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    assert d.sources.tolist() == [1] * 6
    assert cache.count(CONTEXT, source="shared") == 1


def test_own_history_wins_ties_and_is_source_0():
    cache = NgramCache(**CONFIG)
    _share_one(cache)
    cache.start_request("second", CONTEXT + [500, 501] + CONTEXT)  # own history continues with 500
    d = cache.propose(["second"], 4, tree=False).draft(0)
    assert d.tokens[0] == 500 and d.sources[0] == 0


def test_longer_shared_match_wins_over_own_history():
    cache = NgramCache(**CONFIG)
    _share_one(cache)
    cache.start_request("second", [303, 999] + CONTEXT)  # own history: only "303" seen before (match 1)
    d = cache.propose(["second"], 3, tree=False).draft(0)
    assert d.tokens.tolist() == CONTINUATION[:3] and d.sources.tolist() == [1, 1, 1]


def test_share_false_keeps_the_output_private():
    cache = NgramCache(**CONFIG)
    _share_one(cache, share=False)
    cache.start_request("second", [7, 8] + CONTEXT)
    assert len(cache.propose(["second"], 6).draft(0)) == 0
    assert cache.stats()["shared_segments"] == 0 and cache.count(CONTEXT, source="shared") == 0


def test_use_shared_false_never_drafts_from_other_requests():
    cache = NgramCache(**{**CONFIG, "use_shared": False})
    _share_one(cache, share=True)
    cache.start_request("second", [7, 8] + CONTEXT)
    assert len(cache.propose(["second"], 6).draft(0)) == 0
    assert cache.stats()["shared_segments"] == 0 and cache.stats()["shared_tokens_held"] == 0


def test_full_shared_cache_evicts_and_stays_bounded():
    """A long stream of finished requests through a small shared cache: bounds always hold, the oldest outputs
    leave (their unique n-grams are no longer counted), the newest are still drafted."""
    bounds = dict(shared_nodes=400, shared_tokens=600, shared_segments=8)
    cache = NgramCache(**{**CONFIG, **bounds})
    for i in range(300):
        rid = f"req{i}"
        unique = [100_000 + 3 * i, 100_001 + 3 * i, 100_002 + 3 * i]  # occurs in this output only
        cache.start_request(rid, [1, 2])
        cache.add_tokens(rid, _stream(i % 17, 30 + i % 50, 40) + unique)
        batch = cache.propose([rid], 5)
        assert_valid_batch(batch, [5])
        cache.finish_request(rid, share=True)
        s = cache.stats()
        assert s["shared_nodes_live"] <= bounds["shared_nodes"]
        assert s["shared_tokens_held"] < bounds["shared_tokens"]
        assert s["shared_segments"] <= bounds["shared_segments"]
        assert s["active_requests"] == 0 and s["local_nodes_live"] == 0
    assert cache.count([100_000, 100_001], source="shared") == 0  # evicted long ago
    assert cache.count([100_000 + 3 * 299, 100_001 + 3 * 299], source="shared") == 1
    cache.start_request("probe", [5, 100_000 + 3 * 299])
    d = cache.propose(["probe"], 2, tree=False).draft(0)
    assert d.tokens.tolist() == [100_001 + 3 * 299, 100_002 + 3 * 299] and d.sources.tolist() == [1, 1]


def test_full_local_pool_never_crashes():
    """Histories far larger than the per-request pool: appends, drafts and finishes all keep working, the pool
    never exceeds its capacity, histories stay complete, and finishing frees every node."""
    cache = NgramCache(**{**CONFIG, "local_nodes": 64, "use_shared": False})
    streams = {rid: _stream(i, 2000, 20) for i, rid in enumerate(RIDS)}
    for rid in RIDS:
        cache.start_request(rid, streams[rid][:10])
    for p in range(10, 2000, 10):
        cache.add_tokens_batch(RIDS, [streams[rid][p:p + 10] for rid in RIDS])
        for tree in (True, False):
            assert_valid_batch(cache.propose(RIDS, 8, tree=tree), [8, 8], tree)
        assert cache.stats()["local_nodes_live"] <= 64
    for rid in RIDS:
        np.testing.assert_array_equal(cache.history(rid), streams[rid])
    assert cache.stats()["local_nodes_live"] >= 64 - CONFIG["max_requests"]  # it did fill up
    for rid in RIDS:
        cache.finish_request(rid)
    assert cache.stats()["local_nodes_live"] == 0


def test_full_local_pool_still_admits_requests():
    """When one request's history has filled the per-request pool, new requests (up to max_requests) can still
    start: the pool is sized >= max_requests + 1, so a root per request can always be had."""
    cache = NgramCache(**{**CONFIG, "local_nodes": 64, "use_shared": False})
    cache.start_request("big", _stream(0, 3000, 20))
    assert cache.stats()["local_nodes_live"] >= 64 - CONFIG["max_requests"]
    for rid in ["b", "c", "d"]:
        cache.start_request(rid, [1, 2, 3, 1, 2])
        assert_valid_batch(cache.propose([rid, "big"], 4), [4, 4])


# ------------------------------------------------------------------------------------------- random lifecycles
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_lifecycles_keep_bounds_and_histories(seed):
    """Random interleavings of every verb on tiny pools (eviction and full pools all the time): no crash, bounds
    hold, histories equal what was fed, drafts are valid, and once all requests finish no local node is live."""
    rng = np.random.default_rng(seed)
    D, R = int(rng.integers(2, 10)), int(rng.integers(1, 5))
    cfg = dict(max_depth=D, max_requests=R, local_nodes=int(rng.integers(R + 1, 200)),
               shared_nodes=int(rng.integers(2 * D + 2, 200)), shared_tokens=int(rng.integers(2, 150)),
               shared_segments=int(rng.integers(1, 5)), use_shared=bool(rng.random() < 0.8))
    cache = NgramCache(**cfg)
    vocab = int(rng.choice([2, 3, 20, 10**6]))
    fed: dict[int, list] = {}
    next_id = 0
    for _ in range(150):
        op = rng.random()
        if op < 0.15 and len(fed) < R:
            prompt = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
            try:
                cache.start_request(next_id, prompt)
                fed[next_id] = prompt
            except RuntimeError:  # the local pool is full (see test_full_local_pool_still_admits_requests)
                assert next_id not in cache
            next_id += 1
        elif op < 0.55 and fed:
            rids = [int(r) for r in rng.permutation(list(fed))[: int(rng.integers(1, len(fed) + 1))]]
            tokens = [rng.integers(0, vocab, int(rng.integers(0, 6))).astype(np.int32) for _ in rids]
            cache.add_tokens_batch(rids, tokens)
            for r, t in zip(rids, tokens):
                fed[r] += t.tolist()
        elif op < 0.85 and fed:
            rids = [int(r) for r in rng.permutation(list(fed))[: int(rng.integers(1, len(fed) + 1))]]
            budgets = [int(b) for b in rng.integers(1, 12, len(rids))]
            tree = bool(rng.random() < 0.5)
            assert_valid_batch(cache.propose(rids, budgets, tree=tree), budgets, tree)
        elif fed:
            rid = list(fed)[int(rng.integers(len(fed)))]
            assert cache.history(rid).tolist() == fed.pop(rid)
            cache.finish_request(rid, share=bool(rng.random() < 0.8))
        s = cache.stats()
        assert s["local_nodes_live"] <= cfg["local_nodes"] and s["shared_nodes_live"] <= cfg["shared_nodes"]
        assert s["shared_segments"] <= cfg["shared_segments"] and s["shared_tokens_held"] < cfg["shared_tokens"]
        assert s["active_requests"] == len(fed)
    for rid in list(fed):
        cache.finish_request(rid)
    assert cache.stats()["local_nodes_live"] == 0


@pytest.mark.parametrize("tree", [True, False])
def test_budgets_beyond_the_reused_scratch_draft_the_prefix_extension(tree):
    """Budgets above the cache's preallocated proposal scratch (SCRATCH_BUDGET) get scratch of their own: the
    draft of the larger budget extends the smaller one (a best-first tree's and a chain's prefixes are the
    drafts of their sizes), and the reused scratch still serves small budgets afterwards."""
    from ngramspec._draft import SCRATCH_BUDGET

    stream = _stream(7, 3000, 20)
    cache = NgramCache(max_depth=8, max_requests=2)
    cache.start_request("a", stream)
    small = cache.propose(["a"], SCRATCH_BUDGET, tree=tree).draft(0)
    big = cache.propose(["a"], 3 * SCRATCH_BUDGET, tree=tree).draft(0)
    again = cache.propose(["a"], SCRATCH_BUDGET, tree=tree).draft(0)
    assert len(small) == SCRATCH_BUDGET and len(big) > SCRATCH_BUDGET
    for d in (big, again):
        assert d.tokens[:len(small)].tolist() == small.tokens.tolist()
        assert d.parents[:len(small)].tolist() == small.parents.tolist()


def test_a_dropped_cache_and_controller_are_freed_without_the_cyclic_collector():
    """A server replaces its cache and controller at a cache flush. The old ones (hundreds of MB at a server's
    capacity) must go with their last reference: a long-running process may not run the cyclic collector for a
    long time. Used or not, neither holds itself in a cycle (nor does the controller hold the cache)."""
    import gc
    import weakref

    from ngramspec.controller import AdaptiveController

    for used in (False, True):
        cache = NgramCache(local_nodes=4096, shared_nodes=4096, shared_tokens=4096, max_requests=8)
        ctl = AdaptiveController()
        if used:
            for rid in ("a", "b"):
                cache.start_request(rid, [1, 2, 3, 1, 2, 3, 1, 2])
                ctl.start(rid)
            cache.add_tokens("a", [3])
            cache.propose(["a", "b"])
            ctl.step(cache, ["a", "b"], [[1], [3]])  # a batch of two: the controller remembers its slots
        refs = [weakref.ref(cache), weakref.ref(ctl)]
        gc.disable()
        try:
            del cache, ctl
            assert [r() is None for r in refs] == [True, True], used
        finally:
            gc.enable()

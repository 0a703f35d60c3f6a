"""Property tests of the suffix-trie cache against brute-force references (hypothesis)."""
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngramspec import NgramCache, _trie
from ngramspec.layout import check_tree

D = 6
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# random sequences over a small alphabet are repetitive ("low entropy"); a large alphabet gives few repeats
low_entropy = st.lists(st.integers(0, 2), min_size=1, max_size=80)
mixed = st.lists(st.integers(0, 12), min_size=1, max_size=80)
high_entropy = st.lists(st.integers(0, 10**6), min_size=1, max_size=60)
sequences = st.one_of(low_entropy, mixed, high_entropy)


def brute_counts(seq, max_len):
    c = Counter()
    for n in range(1, max_len + 1):
        for i in range(len(seq) - n + 1):
            c[tuple(seq[i:i + n])] += 1
    return c


def brute_match(seq, max_len):
    """Longest m <= max_len whose suffix occurred earlier *with a continuation* (ending before the last token)."""
    L = len(seq)
    for m in range(min(max_len, L - 1), 0, -1):
        suf = seq[L - m:]
        if any(seq[i:i + m] == suf for i in range(0, L - m)):
            return m
    return 0


def check_invariants(nodes, table, meta, arena, alen, max_depth):
    """Structural invariants of a trie's flat arrays; returns the number of live nodes."""
    live = 0
    for n in range(int(meta[_trie.M_HIGH])):
        if nodes[n, _trie.DEP] < 0:
            continue  # free
        live += 1
        p = nodes[n, _trie.PAR]
        if p >= 0:
            assert nodes[n, _trie.DEP] == nodes[p, _trie.DEP] + 1 <= max_depth
            assert _trie.find_child(nodes, table, p, nodes[n, _trie.TOK]) == n
            assert nodes[n, _trie.CNT] >= 1
        total = 0
        toks = set()
        c = nodes[n, _trie.CHILD]
        while c >= 0:
            assert nodes[c, _trie.PAR] == n and nodes[c, _trie.DEP] >= 0
            assert nodes[c, _trie.TOK] not in toks
            toks.add(nodes[c, _trie.TOK])
            total += nodes[c, _trie.CNT]
            c = nodes[c, _trie.NEXT]
        tl = nodes[n, _trie.TAIL]
        if 0 <= tl < alen and arena[tl] >= 0:
            assert arena[tl] not in toks, "a tail's first token must differ from every child's"
            assert nodes[n, _trie.DEP] < max_depth
            total += 1
        if p >= 0:
            assert total <= nodes[n, _trie.CNT]
    assert live == meta[_trie.M_LIVE] <= meta[_trie.M_CAP]
    return live


@SETTINGS
@given(seq=sequences, split=st.integers(1, 80))
def test_counts_and_match_equal_brute_force(seq, split):
    cache = NgramCache(max_depth=D, max_requests=4, local_nodes=4096, shared_nodes=64, shared_tokens=64)
    split = min(split, len(seq))
    cache.start_request("r", seq[:split])
    for t in seq[split:]:
        cache.add_tokens("r", [t])
    ref = brute_counts(seq, D)
    for g, n in ref.items():
        assert cache.count(list(g), rid="r") == n, g
    # absent n-grams count zero
    assert cache.count([10**6 + 7], rid="r") == 0
    assert cache.match_length("r") == brute_match(seq, D - 1)
    check_invariants(cache._l_nodes, cache._l_table, cache._l_meta, cache._hists[0], len(seq), D)


def occurs_followed_by(seq, ctx, tok):
    m = len(ctx)
    return any(list(seq[i:i + m]) == list(ctx) and seq[i + m] == tok for i in range(len(seq) - m))


@SETTINGS
@given(seq=sequences, budget=st.integers(1, 12), steps=st.integers(0, 5))
def test_chain_drafts_follow_real_occurrences(seq, budget, steps):
    cache = NgramCache(max_depth=D, max_requests=2, local_nodes=4096, use_shared=False)
    cache.start_request(0, seq)
    hist = list(seq)
    for _ in range(steps + 1):
        m = brute_match(hist, D - 1)
        d = cache.propose([0], budget, tree=False).draft(0)
        assert len(d) <= budget
        assert (len(d) > 0) == (m > 0)
        assert list(d.parents) == list(range(-1, len(d) - 1))
        if m:
            # the first token really followed an occurrence of the matched suffix
            assert occurs_followed_by(hist, hist[len(hist) - m:], d.tokens[0])
        ext = list(hist)
        for t in d.tokens:  # every later token followed some earlier suffix of history + draft (backoff)
            assert any(occurs_followed_by(hist, ext[len(ext) - k:], t) for k in range(1, D))
            ext.append(int(t))
        assert np.all(np.diff(d.probs) <= 1e-7) and np.all((d.probs > 0) & (d.probs <= 1))
        nxt = int(d.tokens[0]) if len(d) else 0
        hist.append(nxt)
        cache.add_tokens(0, [nxt])


@SETTINGS
@given(seq=sequences, budget=st.integers(1, 16))
def test_trees_are_valid_and_respect_budgets(seq, budget):
    cache = NgramCache(max_depth=D, max_requests=2, local_nodes=4096, use_shared=False)
    cache.start_request(0, seq)
    d = cache.propose([0], budget, tree=True).draft(0)
    assert len(d) <= budget
    check_tree(d.tokens, d.parents)
    assert np.all((d.probs >= 0) & (d.probs <= 1))
    for j, p in enumerate(d.parents):
        if p >= 0:
            assert d.probs[j] <= d.probs[p] + 1e-7
    # the chain draft is the tree's most probable path prefix: its first token is the tree's first node
    c = cache.propose([0], budget, tree=False).draft(0)
    if len(c):
        assert len(d) and c.tokens[0] == d.tokens[0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outputs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=12),
       ring=st.integers(8, 60), node_cap=st.integers(2 * D + 2, 200))
def test_shared_eviction_keeps_exact_counts_and_bounds(outputs, ring, node_cap):
    cache = NgramCache(max_depth=D, max_requests=2, local_nodes=2048, shared_nodes=node_cap,
                       shared_tokens=ring, shared_segments=4)
    for i, out in enumerate(outputs):
        cache.start_request(i, [7])
        cache.add_tokens(i, out)
        cache.finish_request(i, share=True)
        s = cache.stats()
        assert s["shared_nodes_live"] <= node_cap and s["shared_segments"] <= 4
        assert s["shared_tokens_held"] < ring
        check_invariants(cache._s_nodes, cache._s_table, cache._s_meta, cache._arena, cache._arena.size, D)
    # counts equal brute force over the indexed part of the segments still held
    ref = Counter()
    for h in cache._held_segments():
        start, length, indexed = (int(x) for x in cache._seg[h])
        seg = cache._arena[start:start + indexed].tolist()
        ref += brute_counts(seg, D)
    for g, n in ref.items():
        assert cache.count(list(g), source="shared") == n
    for g in brute_counts([t for o in outputs for t in o], 3):
        if g not in ref:
            assert cache.count(list(g), source="shared") == 0


def test_finishing_requests_frees_all_their_nodes():
    rng = np.random.default_rng(0)
    cache = NgramCache(max_depth=8, max_requests=8, local_nodes=20000, use_shared=False)
    base = cache.stats()["local_nodes_live"]
    for r in range(8):
        cache.start_request(r, rng.integers(0, 5, 300))
        cache.add_tokens(r, rng.integers(0, 5, 50))
    assert cache.stats()["local_nodes_live"] > base + 8
    for r in range(8):
        cache.finish_request(r)
    assert cache.stats()["local_nodes_live"] == base
    assert cache.active_requests == 0


def test_full_local_pool_degrades_without_crashing():
    rng = np.random.default_rng(1)
    cache = NgramCache(max_depth=8, max_requests=4, local_nodes=200, use_shared=False)
    cache.start_request("a", rng.integers(0, 6, 2000))
    assert cache.stats()["local_nodes_live"] <= 200
    cache.add_tokens("a", rng.integers(0, 6, 500))
    d = cache.propose(["a"], 8).draft(0)
    check_tree(d.tokens, d.parents)
    check_invariants(cache._l_nodes, cache._l_table, cache._l_meta, cache._hists[0], 2500, 8)


# ------------------------------------------------------------------------------- full pools: partial indexing
def brute_match_indexed(cache, rid, source, vocab, D):
    """Longest m <= D-1 whose suffix of the request's history is indexed with some continuation, read through
    ``count`` alone: the definition of a match, over what a (possibly full) pool actually indexed."""
    hist = cache.history(rid).tolist()
    for m in range(min(D - 1, len(hist)), 0, -1):
        if any(cache.count(hist[len(hist) - m:] + [c], source=source, rid=rid) for c in vocab):
            return m
    return 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_drafts_are_a_function_of_the_tokens_fed_under_full_pools(seed):
    """Twin caches fed the same tokens propose identical drafts, however many extra proposals one of them made
    in between, on pools so small that occurrences are dropped all the time; and every proposal's match
    length is the longest suffix indexed with a continuation (brute force over ``count``)."""
    rng = np.random.default_rng(seed)
    depth, R, vocab = int(rng.integers(3, 7)), 4, range(int(rng.integers(2, 4)))
    use_shared = bool(rng.random() < 0.5)
    cfg = dict(max_depth=depth, max_requests=R, local_nodes=R + int(rng.integers(1, 40)), shared_nodes=200,
               shared_tokens=64, shared_segments=4, use_shared=use_shared)
    busy, quiet = NgramCache(**cfg), NgramCache(**cfg)  # busy also proposes when quiet does not
    live: list[int] = []
    for _ in range(40):
        op, rid = rng.choice(["start", "add", "add", "propose", "propose", "finish"]), int(rng.integers(0, R))
        toks = rng.integers(0, len(vocab), int(rng.integers(0, 30))).tolist()
        if op == "start" and rid not in live and toks:
            for c in (busy, quiet):
                c.start_request(rid, toks)
            live.append(rid)
        elif op == "add" and rid in live:
            for c in (busy, quiet):
                c.add_tokens(rid, toks)
        elif op == "finish" and rid in live:
            for c in (busy, quiet):
                c.finish_request(rid, share=True)
            live.remove(rid)
        elif op == "propose" and live:
            rids = live[rid % len(live):] + live[:rid % len(live)]
            budget, tree = int(rng.integers(1, 9)), bool(rng.random() < 0.5)
            got = busy.propose(rids, budget, tree=tree)
            if rng.random() < 0.5:
                ref = quiet.propose(rids, budget, tree=tree)
                for name in ("offsets", "tokens", "parents", "probs", "sources", "match_lens"):
                    np.testing.assert_array_equal(getattr(got, name), getattr(ref, name), err_msg=name)
            for i, r in enumerate(rids):
                want = brute_match_indexed(busy, r, "own", vocab, depth)
                if use_shared:
                    want = max(want, brute_match_indexed(busy, r, "shared", vocab, depth))
                assert got.match_lens[i] == want, (r, busy.history(r).tolist())
                check_tree(got.draft(i).tokens, got.draft(i).parents)
    for c in (busy, quiet):
        check_invariants(c._l_nodes, c._l_table, c._l_meta, np.zeros(0, np.int32), 0, depth)
    assert busy.stats() == quiet.stats()


@pytest.mark.parametrize("tree", [False, True])
def test_full_pool_proposal_does_not_depend_on_an_earlier_proposal(tree):
    """The case that showed it: with the pool full, ``count([1, 0]) == 1`` while ``count([0]) == 0`` for
    request 2, and one extra ``propose`` before ``add_tokens`` used to change the next draft."""
    cfg = dict(max_depth=4, max_requests=4, local_nodes=13, shared_nodes=4096, shared_tokens=4096)
    prompts = [[1, 1, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1],
               [1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0]]
    busy, quiet = NgramCache(**cfg), NgramCache(**cfg)
    for c in (busy, quiet):
        for rid, p in enumerate(prompts):
            c.start_request(rid, p)
    busy.propose([2], 4, tree=tree)
    for c in (busy, quiet):
        c.add_tokens(2, [1, 0])
    assert busy.count([1, 0], rid=2) == 1 and busy.count([0], rid=2) == 0  # the pool dropped occurrences
    a, b = busy.propose([2], 4, tree=tree), quiet.propose([2], 4, tree=tree)
    assert a.tokens.tolist() == b.tokens.tolist() and a.match_lens.tolist() == b.match_lens.tolist()
    assert a.match_lens[0] == busy.match_length(2) == brute_match_indexed(busy, 2, "own", range(3), 4)

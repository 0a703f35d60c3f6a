"""Drafting one step ahead (`NgramCache.propose_ahead`, `ngramspec.lookahead`): the outcomes it foresees against a
brute-force model of the trie's statistics, its drafts, and the device-side pick."""
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngramspec import NgramCache
from ngramspec.layout import check_tree
from ngramspec.lookahead import NO_ENTRY, outcome_node, pick, pick_torch

D = 6
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
sequences = st.one_of(st.lists(st.integers(0, 2), min_size=1, max_size=60),
                      st.lists(st.integers(0, 12), min_size=1, max_size=60))


def next_counts(hist, ctx, lim=D - 1):
    """The counts of the tokens that followed the longest suffix of ``ctx`` (<= lim) occurring in ``hist`` with a
    continuation: what the trie's longest match sees."""
    for m in range(min(lim, len(ctx)), 0, -1):
        suf = list(ctx[len(ctx) - m:])
        nxt = [hist[i + m] for i in range(len(hist) - m) if list(hist[i:i + m]) == suf]
        if nxt:
            return Counter(nxt)
    return Counter()


def path(tokens, parents, n):
    out = []
    while n >= 0:
        out.append(int(tokens[n]))
        n = int(parents[n])
    return out[::-1]


def follows(hist, ext, tok):
    """``tok`` followed some suffix (length 1..D-1) of ``ext`` in ``hist`` (what a draft with back-off may use)."""
    for m in range(1, D):
        suf = list(ext[len(ext) - m:])
        if len(suf) == m and any(list(hist[i:i + m]) == suf and hist[i + m] == tok for i in range(len(hist) - m)):
            return True
    return False


def cut(batch, n):
    """The first ``n`` nodes of a one-request DraftBatch, as `propose_ahead` takes drafts."""
    d = batch.draft(0).prefix(n)
    return SimpleNamespace(tokens=d.tokens, parents=d.parents, probs=d.probs,
                           offsets=np.array([0, len(d)], np.int64)), d


def test_a_handmade_history():
    cache = NgramCache(max_depth=D, use_shared=False)
    cache.start_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 10, 11, 1, 2, 3, 4, 5, 6])
    draft = cache.propose(["a"], 4, tree=True)
    assert list(draft.tokens) == [7, 8, 10, 9] and list(draft.parents) == [-1, 0, 0, 1]
    ahead = cache.propose_ahead(["a"], draft, entries=4, budget=4)
    # the root's and node 0's and node 1's continuations are all in the draft: the outcomes left are the bonus after
    # "7 10" (11) and after "7 8 9" (1), each half the draft's mass
    assert ahead.node[0].tolist() == [2, 3, NO_ENTRY, NO_ENTRY]
    assert ahead.token[0].tolist() == [11, 1, -1, -1]
    assert np.allclose(ahead.weight[0], [0.5, 0.5, 0, 0])
    assert ahead.length[0].tolist() == [4, 4, 0, 0]
    assert ahead.tokens[0, 0].tolist() == [1, 2, 3, 4] and ahead.tokens[0, 1].tolist() == [2, 3, 4, 5]
    assert ahead.parents[0, 0].tolist() == [-1, 0, 1, 2]
    # step t accepted "7 10" and the model said 11: the next draft is found without the host
    node = outcome_node(draft.tokens, draft.parents, [7, 10])
    idx, tokens, parents, lengths = pick(ahead, [node], [11])
    assert idx.tolist() == [0] and tokens[0].tolist() == [1, 2, 3, 4] and lengths.tolist() == [4]
    # an outcome it did not foresee: nothing to draft (the request decodes plainly next step)
    idx, _, _, lengths = pick(ahead, [outcome_node(draft.tokens, draft.parents, [7])], [3])
    assert idx.tolist() == [-1] and lengths.tolist() == [0]


@SETTINGS
@given(seq=sequences, k=st.integers(1, 10), keep=st.integers(0, 10), entries=st.integers(1, 6),
       budget=st.integers(1, 6), tree=st.booleans())
def test_outcomes_are_the_tries_best_and_their_drafts_follow_the_history(seq, k, keep, entries, budget, tree):
    cache = NgramCache(max_depth=D, max_requests=2, local_nodes=4096, use_shared=False)
    cache.start_request(0, seq)
    before = cache.propose([0], k, tree=tree)
    drafts, d = cut(before, min(keep, len(before.draft(0))))
    ahead = cache.propose_ahead([0], drafts, entries=entries, budget=budget, tree=tree)
    hist = list(seq)
    # brute force: every outcome (node, bonus) the draft did not take, weighted reach * count / total
    children = {(int(p), int(t)) for p, t in zip(d.parents, d.tokens)}
    want = []
    for n in range(-1, len(d)):
        counts = next_counts(hist, hist + path(d.tokens, d.parents, n))
        total = sum(counts.values())
        reach = 1.0 if n < 0 else float(d.probs[n])
        want += [reach * c / total for tok, c in counts.items() if (n, tok) not in children]
    want = sorted(want, reverse=True)[:entries]
    used = ahead.node[0] != NO_ENTRY
    n_used = int(used.sum())
    assert used.tolist() == [True] * n_used + [False] * (entries - n_used)  # used entries first
    assert np.allclose(ahead.weight[0, :n_used], want, rtol=1e-5, atol=1e-7)
    assert np.all(np.diff(ahead.weight[0, :n_used]) <= 1e-7)
    seen = set()
    for e in range(n_used):
        n, b = int(ahead.node[0, e]), int(ahead.token[0, e])
        assert -1 <= n < len(d) and (n, b) not in children and (n, b) not in seen
        seen.add((n, b))
        ctx = hist + path(d.tokens, d.parents, n)
        assert next_counts(hist, ctx)[b] > 0  # the bonus it foresees really followed the matched context
        L = int(ahead.length[0, e])
        toks, pars = ahead.tokens[0, e, :L], ahead.parents[0, e, :L]
        check_tree(toks, pars)
        if not tree:
            assert pars.tolist() == list(range(-1, L - 1))
        for j in range(L):  # each draft token followed some suffix of context + bonus + its path
            assert follows(hist, ctx + [b] + path(toks, pars, int(pars[j])), int(toks[j]))
        assert np.all(ahead.tokens[0, e, L:] == -1)
    assert np.all(ahead.length[0, n_used:] == 0)
    # nothing in the cache changed
    after = cache.propose([0], k, tree=tree)
    assert np.array_equal(after.tokens, before.tokens) and np.array_equal(after.probs, before.probs)


def test_a_batch_is_its_requests_one_by_one():
    rng = np.random.default_rng(3)
    cache = NgramCache(max_depth=D)
    seqs = [list(rng.integers(0, 5, 50)) for _ in range(3)]
    for i, s in enumerate(seqs):
        cache.start_request(i, s)
    batch = cache.propose([2, 0, 1], 6)
    both = cache.propose_ahead([2, 0, 1], batch, entries=3, budget=5)
    for i, rid in enumerate([2, 0, 1]):
        one = cache.propose_ahead([rid], cache.propose([rid], 6), entries=3, budget=5)
        for f in ("node", "token", "weight", "tokens", "parents", "length"):
            assert np.array_equal(getattr(both, f)[i], getattr(one, f)[0]), f


def test_bad_calls_are_refused_and_change_nothing():
    cache = NgramCache(max_depth=D)
    cache.start_request("a", [1, 2, 1, 2, 1])
    d = cache.propose(["a"], 4)
    with pytest.raises(KeyError):
        cache.propose_ahead(["b"], d)
    with pytest.raises(ValueError, match="entries"):
        cache.propose_ahead(["a"], d, entries=0)
    with pytest.raises(ValueError, match="budget"):
        cache.propose_ahead(["a"], d, budget=5000)
    with pytest.raises(ValueError, match="1 requests, not 2"):
        cache.start_request("c", [3])
        cache.propose_ahead(["a", "c"], d)
    with pytest.raises(ValueError, match="not a root path"):
        outcome_node(d.tokens, d.parents, [99])
    assert cache.propose(["a"], 4).tokens.tolist() == d.tokens.tolist()


def test_pick_on_the_device_is_pick():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    B, E, L = 7, 5, 4
    node = rng.integers(-2, 3, (B, E)).astype(np.int32)
    token = rng.integers(0, 4, (B, E)).astype(np.int32)
    table = SimpleNamespace(node=node, token=token, tokens=rng.integers(0, 9, (B, E, L)).astype(np.int32),
                            parents=rng.integers(-1, 3, (B, E, L)).astype(np.int32),
                            length=rng.integers(0, L + 1, (B, E)).astype(np.int32))
    nodes, bonus = rng.integers(-1, 3, B), rng.integers(0, 4, B)
    want = pick(table, nodes, bonus)
    t = {k: torch.from_numpy(v) for k, v in vars(table).items()}
    got = pick_torch(t["node"], t["token"], t["tokens"], t["parents"], t["length"], torch.from_numpy(nodes),
                     torch.from_numpy(bonus))
    assert (want[0] >= 0).any() and (want[0] < 0).any()  # both cases occur
    for w, g in zip(want, got):
        found = want[0] >= 0
        assert np.array_equal(np.asarray(w)[found], g.numpy()[found])
    assert np.array_equal(want[3], got[3].numpy()) and np.array_equal(want[0], got[0].numpy())


# ------------------------------------------------------------------------------------ the simulator's method
def repetitive_trace(seed=0, n=6):
    from ngramspec.sim.traces import make_trace

    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        body = list(rng.integers(0, 40, 30))
        edit = list(body)
        edit[rng.integers(0, 30)] = 41  # a copy with an edit: the draft breaks there and resumes after
        records.append({"prompt": body + list(rng.integers(0, 40, 5)), "output": edit + list(rng.integers(0, 40, 8))})
    return make_trace("t", records)


def test_drafting_ahead_costs_tokens_and_its_sync_fallback_costs_none():
    from ngramspec.sim.methods import make_method
    from ngramspec.sim.simulate import replay

    trace = repetitive_trace()
    today = replay(trace, make_method("ngramspec-tree:k=6"))
    ahead = make_method("ngramspec-ahead:k=6,entries=4")
    run = replay(trace, ahead)
    sync = make_method("ngramspec-ahead:k=6,entries=4,miss=sync")
    run_sync = replay(trace, sync)
    assert run.tokens == today.tokens == run_sync.tokens
    # unforeseen outcomes (the edit, the bonus after a rejected draft) draft nothing the next step
    assert 0 < ahead.found < ahead.looked_up and run.accepted < today.accepted
    # with the after-the-fact fallback the drafts of foreseen outcomes are today's drafts: the same replay
    assert sync.synced > 0 and (run_sync.steps, run_sync.accepted) == (today.steps, today.accepted)


def test_the_method_refuses_a_bad_miss_policy():
    from ngramspec.sim.methods import make_method

    with pytest.raises(ValueError, match="miss must be"):
        make_method("ngramspec-ahead:miss=wait")

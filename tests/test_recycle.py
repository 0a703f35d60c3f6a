"""Token recycling's table (`ngramspec.recycle`) against a brute-force model: rows are each token's latest top-k,
drafts are the template expanded breadth-first, memory never grows, bad input is refused by name."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.layout import check_tree
from ngramspec.recycle import RecycleTable, bfs_template


class Model:
    """The brute-force table: a dict of lists."""

    def __init__(self, k):
        self.k, self.rows = k, {}

    def update(self, tokens, topk):
        for t, row in zip(tokens, topk):
            self.rows[t] = list(row)[: self.k] + [-1] * (self.k - len(row))

    def draft(self, root, parents, ranks, cap):
        out_t, out_p, slot = [], [], {}
        for j, (p, r) in enumerate(zip(parents, ranks)):
            if len(out_t) >= cap:
                break
            if p >= 0 and p not in slot:
                continue
            q = slot[p] if p >= 0 else -1
            prev = out_t[q] if p >= 0 else root
            row = self.rows.get(prev, [-1] * self.k)
            t = row[r] if r < self.k else -1
            if t < 0 or any(pp == q and tt == t for tt, pp in zip(out_t, out_p)):
                continue
            slot[j] = len(out_t)
            out_t.append(t)
            out_p.append(q)
        return out_t, out_p


def test_template_is_breadth_first():
    parents, ranks = bfs_template((4, 2, 2, 1, 1, 1))
    assert len(parents) == 4 + 8 + 16 + 16 + 16 + 16
    assert all(-1 <= p < j for j, p in enumerate(parents.tolist()))
    assert parents[:4].tolist() == [-1] * 4 and ranks[:4].tolist() == [0, 1, 2, 3]
    assert parents[4:6].tolist() == [0, 0] and ranks[4:6].tolist() == [0, 1]


def test_rows_are_the_latest_top_k_and_drafts_follow_them():
    t = RecycleTable(10, k=3, template=bfs_template((2, 1)))
    t.update([1, 2], [[2, 3, 4], [5, 6, 7]])
    t.update([1], [[8, 2, 9]])  # the latest distribution after token 1 replaces the old one
    assert t.succ[1].tolist() == [8, 2, 9] and t.succ[2].tolist() == [5, 6, 7]
    tokens, parents = t.draft(1)
    # root 1 -> 8 (rank 0), 2 (rank 1); 8 has no row (left out); 2 -> 5
    assert tokens.tolist() == [8, 2, 5] and parents.tolist() == [-1, -1, 1]
    check_tree(tokens, parents)
    assert t.draft(0)[0].size == 0  # a token never seen drafts nothing
    assert t.draft(1, max_nodes=1)[0].tolist() == [8]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_against_the_brute_force_model(data):
    vocab, k = 12, data.draw(st.integers(1, 4))
    branching = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    parents, ranks = bfs_template(branching)
    table, model = RecycleTable(vocab, k=k, template=(parents, ranks)), Model(k)
    nbytes = table.nbytes
    for _ in range(data.draw(st.integers(0, 6))):
        n = data.draw(st.integers(0, 5))
        width = data.draw(st.integers(1, k))
        tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
        topk = [data.draw(st.lists(st.integers(0, vocab - 1), min_size=width, max_size=width)) for _ in range(n)]
        table.update(np.asarray(tokens, np.int64).reshape(n), np.asarray(topk, np.int64).reshape(n, width))
        model.update(tokens, topk)
    for tok in range(vocab):
        assert table.succ[tok].tolist() == model.rows.get(tok, [-1] * k)
    root = data.draw(st.integers(0, vocab - 1))
    cap = data.draw(st.integers(0, len(parents)))
    tokens, pars = table.draft(root, max_nodes=cap)
    assert (tokens.tolist(), pars.tolist()) == model.draft(root, parents.tolist(), ranks.tolist(), cap)
    check_tree(tokens, pars)
    assert table.nbytes == nbytes == vocab * k * 4  # bounded by construction


@pytest.mark.parametrize("call, message", [
    (lambda t: t.update([10], [[1, 2]]), "token id 10 is outside 0..9"),
    (lambda t: t.update([1], [[1, -2]]), "token id -2 is outside 0..9"),
    (lambda t: t.update([1, 2], [[1, 2]]), "one row per token"),
    (lambda t: t.update([1.5], [[1, 2]]), "integer token ids"),
    (lambda t: t.draft(10), "root must be a token id in 0..9"),
    (lambda t: RecycleTable(0), "vocab_size must be an int >= 1"),
    (lambda t: RecycleTable(10, k=0), "k must be an int >= 1"),
    (lambda t: RecycleTable(10, template=(np.array([0]), np.array([0]))), "parents\\[j\\] must be in"),
    (lambda t: bfs_template(()), "branching must be a non-empty list"),
])
def test_bad_input_is_refused_by_name(call, message):
    t = RecycleTable(10, k=2)
    before = t.succ.copy()
    with pytest.raises(ValueError, match=message):
        call(t)
    assert np.array_equal(t.succ, before)  # nothing half-written


# ------------------------------------------------------------------------ the simulator's recycling methods
def _cycle_trace(n_req=3, out_len=40, topk_noise=False):
    """Outputs walk a fixed successor cycle; each output token's top-k row has the true token first."""
    from ngramspec.sim.traces import make_trace

    rng = np.random.default_rng(1)
    nxt = {t: (t * 7 + 3) % 50 for t in range(50)}
    records = []
    for r in range(n_req):
        prompt = [int(rng.integers(50, 90)) for _ in range(4)] + [r]
        out, prev = [], r
        for _ in range(out_len):
            prev = nxt[prev]
            out.append(prev)
        topk = [[t, 99, 98] for t in out]
        records.append({"prompt": prompt, "output": out, "topk": topk})
    return make_trace("cycle", records), nxt


def test_recycling_drafts_what_the_model_scored_before():
    from ngramspec.sim.methods import make_method
    from ngramspec.sim.simulate import replay

    trace, nxt = _cycle_trace()
    method = make_method("recycle:k=6,topk=3,vocab=128")
    run = replay(trace, method)
    assert run.tokens == trace.output_tokens
    # the table holds, for every token seen as a predecessor, its latest top-3 row: the true successor first
    for t, s in nxt.items():
        row = method.table.succ[t]
        assert row[0] in (-1, s) and (row[0] == -1 or row[1:].tolist() == [99, 98])
    # once the cycle has been scored, the chains of rank-0 candidates are accepted
    assert run.accepted > run.tokens // 3


def test_scores_are_required_and_checked():
    from ngramspec.sim.methods import make_method
    from ngramspec.sim.simulate import replay
    from ngramspec.sim.traces import make_trace

    bare = make_trace("t", [{"prompt": [1, 2], "output": [3, 4]}])
    with pytest.raises(ValueError, match="topk"):
        replay(bare, make_method("recycle"))
    with pytest.raises(ValueError, match="one row of k >= 1"):
        make_trace("t", [{"prompt": [1, 2], "output": [3, 4], "topk": [[3, 5]]}])
    with pytest.raises(ValueError, match="outside"):
        make_trace("t", [{"prompt": [1, 2], "output": [3], "topk": [[-3]]}])


def test_ngram_first_then_recycling(tmp_path):
    from ngramspec.engine.trace import read_trace, write_trace
    from ngramspec.sim.methods import make_method
    from ngramspec.sim.simulate import replay
    from ngramspec.sim.traces import load_trace

    trace, _ = _cycle_trace()
    path = write_trace(tmp_path / "t.jsonl.gz", [r.prompt for r in trace.requests],
                       [r.output for r in trace.requests], workload="cycle",
                       topk=[r.topk for r in trace.requests])
    assert read_trace(path)[0]["topk"][0] == trace.requests[0].topk[0].tolist()
    again = load_trace(path)
    method = make_method("ngramspec-recycle:k=6,topk=3,vocab=128,min_match=2")
    run = replay(again, method)
    assert run.tokens == trace.output_tokens
    assert method.from_ngram > 0 and method.from_recycle > 0


def test_recycled_drafts_join_the_batch_as_their_own_source():
    """`with_recycled`: a request whose n-gram draft is empty or grew from too short a match takes recycling's
    draft, marked source 2 with rank-based path probabilities (non-increasing along every path) and match length 0;
    the others keep their arrays. The result is a valid batch the controller plans over."""
    from ngramspec import NgramCache
    from ngramspec.controller import AdaptiveController
    from ngramspec.recycle import RANK_CONDITIONAL, RECYCLED, with_recycled

    cache = NgramCache(max_depth=8)
    cache.start_request("copy", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6])  # matches: an n-gram draft
    cache.start_request("new", [40, 41, 42])  # no match: recycling's
    table = RecycleTable(64, 3, bfs_template([2, 1, 1]))
    table.update(np.array([42, 10, 11, 12, 13]), np.array([[10, 20, 30], [11, 21, 31], [12, 22, 32],
                                                           [13, 23, 33], [14, 24, 34]]))
    batch = cache.propose(["copy", "new"], 7, tree=True)
    assert batch.match_lens[0] > 0 and len(batch.draft(1)) == 0
    merged, used = with_recycled(batch, table, [6, 42], budget=7)
    assert used == 1 and len(merged) == 2
    kept, rec = merged.draft(0), merged.draft(1)
    assert kept.tokens.tolist() == batch.draft(0).tokens.tolist() and (kept.sources != RECYCLED).all()
    t, p = table.draft(42, 7)
    assert rec.tokens.tolist() == t.tolist() and rec.parents.tolist() == p.tolist()
    assert (rec.sources == RECYCLED).all() and merged.match_lens.tolist() == [batch.match_lens[0], 0]
    assert rec.probs[0] == pytest.approx(RANK_CONDITIONAL[0]) and rec.probs[1] == pytest.approx(RANK_CONDITIONAL[1])
    check_tree(rec.tokens, rec.parents)
    for j, parent in enumerate(rec.parents.tolist()):
        if parent >= 0:
            assert rec.probs[j] <= rec.probs[parent]
    # a match shorter than min_match goes to recycling too: the copy request's root (6) has no row in the table,
    # so its draft becomes empty and does not count as drafted by recycling
    merged2, used2 = with_recycled(batch, table, [6, 42], budget=7, min_match=99)
    assert used2 == 1 and len(merged2.draft(0)) == 0
    ctl = AdaptiveController((1, 2, 4, 8))
    for r in ("copy", "new"):
        ctl.start(r)
    plan = ctl.plan(["copy", "new"], merged)
    assert plan.width in (1, 2, 4, 8)


def test_the_controller_over_recycled_drafts_learns_them_apart_and_stays_exact():
    """`ngramspec-adaptive-recycle` on a trace whose successors recycling can predict, drafting from recycling
    wherever it can (min_match=99): outputs exact, recycling drafted, and the controller's calibration counted
    source-2 nodes; with recycle=0 it is `ngramspec-adaptive` run verb by verb: the same tokens, steps and
    accepted drafts."""
    from ngramspec.controller.calibration import TOP_SHAPE
    from ngramspec.sim.methods import make_method
    from ngramspec.sim.profiles import get_profile
    from ngramspec.sim.simulate import replay

    trace, _ = _cycle_trace(n_req=4, out_len=60)
    profile = get_profile("h200-llama8b")
    method = make_method("ngramspec-adaptive-recycle:topk=3,vocab=128,branching=2-1-1,min_match=99")
    run = replay(trace, method, profile=profile)
    assert run.tokens == trace.output_tokens and method.from_recycle > 0
    assert method.ctl.calibration.top_trials.reshape(TOP_SHAPE)[2].sum() > 0
    assert run.accepted > 0
    verbs = replay(trace, make_method("ngramspec-adaptive-recycle:topk=3,vocab=128,recycle=0"), profile=profile)
    fused = replay(trace, make_method("ngramspec-adaptive"), profile=profile)
    assert (verbs.tokens, verbs.steps, verbs.accepted) == (fused.tokens, fused.steps, fused.accepted)


def test_widening_appends_recycled_alternatives_after_the_ngram_draft():
    """`with_recycled(widen=True)`: a request that keeps its n-gram draft gets recycling's nodes after it, those
    whose first token is not already a first token of the n-gram draft (with their subtrees); the n-gram nodes stay
    a prefix (what a controller keeping few nodes verifies), and the result is a valid tree."""
    from ngramspec import NgramCache
    from ngramspec.recycle import RECYCLED, with_recycled

    cache = NgramCache(max_depth=8)
    cache.start_request("copy", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    batch = cache.propose(["copy"], 4, tree=True)
    ngram = batch.draft(0)
    first = int(ngram.tokens[0])  # 7: what followed 5 6 before
    table = RecycleTable(64, 3, bfs_template([3, 1]))
    table.update(np.array([6, first, 30, 31]), np.array([[first, 30, 31], [40, 41, 42], [50, 51, 52],
                                                         [60, 61, 62]]))
    merged, used = with_recycled(batch, table, [6], budget=7, widen=True)
    d = merged.draft(0)
    n = len(ngram)
    assert used == 1 and d.tokens[:n].tolist() == ngram.tokens.tolist() and (d.sources[:n] != RECYCLED).all()
    extra = d.tokens[n:].tolist()
    # recycling's first tokens 30 and 31 (its 7 is the n-gram draft's), each with its rank-0 successor
    assert extra == [30, 31, 50, 60] and d.parents[n:].tolist() == [-1, -1, n, n + 1]
    assert (d.sources[n:] == RECYCLED).all() and merged.match_lens[0] == batch.match_lens[0]
    check_tree(d.tokens, d.parents)


def _with_recycled_reference(batch, table, roots, budget, min_match, widen):
    """`with_recycled` written out in Python over `RecycleTable.draft` (the kernel's reference): per request, the
    n-gram draft kept, replaced by recycling's, or followed by recycling's other first tokens and their subtrees."""
    from ngramspec.recycle import RANK_CONDITIONAL, RECYCLED

    parents_t, ranks_t = table.tpl_parents.tolist(), table.tpl_ranks.tolist()
    rows, used = [], 0
    for i in range(len(batch)):
        d = batch.draft(i)
        ngram = list(zip(d.tokens.tolist(), d.parents.tolist(), d.probs.tolist(), d.sources.tolist()))
        keep = len(ngram) > 0 and batch.match_lens[i] >= min_match
        mlen = int(batch.match_lens[i])
        if keep and not widen:
            rows.append((ngram, mlen))
            continue
        # the template expanded (as the brute-force Model above), with each output node's template rank
        out, slot = [], {}
        for j, (p, r) in enumerate(zip(parents_t, ranks_t)):
            if len(out) >= min(budget, len(parents_t)):
                break
            if p >= 0 and p not in slot:
                continue
            prev = roots[i] if p < 0 else out[slot[p]][0]
            tok = int(table.succ[prev, r]) if r < table.k else -1
            q = -1 if p < 0 else slot[p]
            if tok < 0 or any(o[0] == tok and o[1] == q for o in out):
                continue
            prob = RANK_CONDITIONAL[min(r, len(RANK_CONDITIONAL) - 1)] * (1.0 if q < 0 else out[q][2])
            slot[j] = len(out)
            out.append((tok, q, prob))
        assert [o[0] for o in out] == table.draft(roots[i], budget)[0].tolist()
        if keep:
            firsts = {t for t, p, _, _ in ngram if p < 0}
            new, add = {}, []
            for j, (tok, q, prob) in enumerate(out):
                if (q < 0 and tok in firsts) or (q >= 0 and q not in new):
                    continue
                new[j] = len(ngram) + len(add)
                add.append((tok, -1 if q < 0 else new[q], prob, RECYCLED))
            used += bool(add)
            rows.append((ngram + add, mlen))
        else:
            used += bool(out)
            rows.append(([(t, q, prob, RECYCLED) for t, q, prob in out], 0))
    return rows, used


@settings(max_examples=150, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=30), min_size=1, max_size=5),
       updates=st.lists(st.tuples(st.integers(0, 9), st.lists(st.integers(0, 7), min_size=3, max_size=3)),
                        max_size=40),
       branching=st.lists(st.integers(1, 3), min_size=1, max_size=4), budget=st.integers(0, 12),
       min_match=st.integers(0, 4), widen=st.booleans(), seed=st.integers(0, 99))
def test_with_recycled_matches_its_python_reference(seqs, updates, branching, budget, min_match, widen, seed):
    """The merge kernel against the Python reference on random caches, tables and templates: the same nodes,
    parents, probabilities, sources, match lengths and count, and every merged draft a valid tree."""
    from ngramspec import NgramCache
    from ngramspec.recycle import with_recycled

    cache = NgramCache(max_depth=6)
    rids = list(range(len(seqs)))
    for r, s in zip(rids, seqs):
        cache.start_request(r, s)
    batch = cache.propose(rids, 6, tree=bool(seed % 2))
    table = RecycleTable(16, 3, bfs_template(branching))
    if updates:
        table.update(np.array([u[0] for u in updates]), np.array([u[1] for u in updates]))
    roots = [s[-1] for s in seqs]
    merged, used = with_recycled(batch, table, roots, budget, min_match=min_match, widen=widen)
    rows, ref_used = _with_recycled_reference(batch, table, roots, budget, min_match, widen)
    assert used == ref_used and merged.match_lens.tolist() == [m for _, m in rows]
    for i, (nodes, _) in enumerate(rows):
        d = merged.draft(i)
        assert d.tokens.tolist() == [n[0] for n in nodes] and d.parents.tolist() == [n[1] for n in nodes]
        assert d.sources.tolist() == [n[3] for n in nodes]
        assert np.allclose(d.probs, np.array([n[2] for n in nodes], np.float32))
        check_tree(d.tokens, d.parents)


def test_a_recycled_nodes_probability_follows_its_own_rank():
    """A candidate left out (here a repeated one) does not shift the ranks of the nodes after it: the root's
    children are the row's ranks 0 and 2, at RANK_CONDITIONAL[0] and [2]."""
    from ngramspec import NgramCache
    from ngramspec.recycle import RANK_CONDITIONAL, with_recycled

    cache = NgramCache(max_depth=6)
    cache.start_request(0, [1, 2, 3])
    table = RecycleTable(16, 3, bfs_template([3, 1]))
    table.update(np.array([3, 5]), np.array([[5, 5, 7], [9, 10, 11]]))
    merged, used = with_recycled(cache.propose([0], 6), table, [3], 8)
    d = merged.draft(0)
    assert used == 1 and d.tokens.tolist() == [5, 7, 9] and d.parents.tolist() == [-1, -1, 0]
    assert np.allclose(d.probs, [RANK_CONDITIONAL[0], RANK_CONDITIONAL[2], RANK_CONDITIONAL[0] ** 2])


def _paths(d):
    """Every node's token path from the root, as a multiset (a tree's content, whatever its node order)."""
    toks, pars = d.tokens.tolist(), d.parents.tolist()

    def path(j):
        return () if j < 0 else path(pars[j]) + (toks[j],)
    return sorted((path(j), float(d.probs[j]), int(d.sources[j])) for j in range(len(toks)))


@settings(max_examples=150, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=30), min_size=1, max_size=5),
       updates=st.lists(st.tuples(st.integers(0, 9), st.lists(st.integers(0, 7), min_size=3, max_size=3)),
                        max_size=40),
       budget=st.integers(0, 12), min_match=st.integers(0, 4), seed=st.integers(0, 999))
def test_order_by_value_puts_each_mixed_drafts_best_nodes_first(seqs, updates, budget, min_match, seed):
    """`order_by_value` on widened merges with random node values: each request keeps the same tree (the same
    token paths with their probabilities and sources), parents stay before children, a request mixing both sources
    has its values (each capped by its parent's) non-increasing, any other request is unchanged, the input too."""
    from ngramspec import NgramCache
    from ngramspec.recycle import RECYCLED, order_by_value, with_recycled

    cache = NgramCache(max_depth=6)
    rids = list(range(len(seqs)))
    for r, s in zip(rids, seqs):
        cache.start_request(r, s)
    batch = cache.propose(rids, 6, tree=bool(seed % 2))
    table = RecycleTable(16, 3, bfs_template([3, 2, 1]))
    if updates:
        table.update(np.array([u[0] for u in updates]), np.array([u[1] for u in updates]))
    merged, _ = with_recycled(batch, table, [s[-1] for s in seqs], budget, min_match=min_match, widen=True)
    values = np.random.default_rng(seed).random(merged.tokens.shape[0])
    before = [a.copy() for a in (merged.tokens, merged.parents, merged.probs, merged.sources)]
    out = order_by_value(merged, values)
    for a, b in zip(before, (merged.tokens, merged.parents, merged.probs, merged.sources)):
        assert np.array_equal(a, b)
    assert np.array_equal(out.offsets, merged.offsets) and np.array_equal(out.match_lens, merged.match_lens)
    for i in range(len(merged)):
        d, e = merged.draft(i), out.draft(i)
        assert _paths(d) == _paths(e)
        check_tree(e.tokens, e.parents)
        assert all(p < k for k, p in enumerate(e.parents.tolist()))
        rec = d.sources == RECYCLED
        if rec.any() and not rec.all():
            a = int(merged.offsets[i])
            capped = {}
            for j, p in enumerate(d.parents.tolist()):
                capped[j] = values[a + j] if p < 0 else min(values[a + j], capped[p])
            # the new order by those capped values: find each output node's source node through its path
            where = {}
            for j in range(len(d.tokens)):
                key, q = [], j
                while q >= 0:
                    key.append(int(d.tokens[q]))
                    q = int(d.parents[q])
                where[tuple(reversed(key))] = capped[j]
            seq = []
            for k in range(len(e.tokens)):
                key, q = [], k
                while q >= 0:
                    key.append(int(e.tokens[q]))
                    q = int(e.parents[q])
                seq.append(where[tuple(reversed(key))])
            assert all(x >= y for x, y in zip(seq, seq[1:]))
        else:
            assert e.tokens.tolist() == d.tokens.tolist() and e.parents.tolist() == d.parents.tolist()


def test_order_by_value_checks_its_values():
    from ngramspec import NgramCache
    from ngramspec.recycle import order_by_value

    cache = NgramCache(max_depth=4)
    cache.start_request(0, [1, 2, 1, 2, 1])
    batch = cache.propose([0], 3)
    with pytest.raises(ValueError, match="one per draft node"):
        order_by_value(batch, np.zeros(batch.tokens.shape[0] + 1))

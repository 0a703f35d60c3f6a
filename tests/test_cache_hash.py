"""The tries' hash tables are views of their buffers sized to the live nodes, grown as nodes are added: a cache
whose views grow drafts, plans and counts exactly as one that hashes into its whole buffers from the start."""
from __future__ import annotations

import numpy as np

from ngramspec import NgramCache, _trie
from ngramspec.controller import AdaptiveController


def _whole_buffers(cache: NgramCache) -> NgramCache:
    """Make ``cache`` (empty) hash into its whole buffers: its views never grow."""
    cache._l_table, cache._s_table = cache._l_hash, cache._s_hash
    cache._own_state = cache._own_state._replace(table=cache._l_hash)
    cache._shared_state = cache._shared_state._replace(table=cache._s_hash)
    return cache


def _check_hash(nodes, table, meta):
    """Every live node but the roots is found through ``table``, and ``table`` holds nothing else."""
    hashed = 0
    for n in range(int(meta[_trie.M_HIGH])):
        p = nodes[n, _trie.PAR]
        if nodes[n, _trie.DEP] >= 0 and p >= 0:
            assert _trie.find_child(nodes, table, p, nodes[n, _trie.TOK]) == n
            hashed += 1
    assert int((table >= 0).sum()) == hashed
    assert 2 * hashed <= table.size  # load factor at most 1/2, as with the whole buffer


def test_hash_views_grow_and_change_nothing():
    rng = np.random.default_rng(7)
    kw = dict(max_depth=8, max_requests=8, local_nodes=1 << 17, shared_nodes=1 << 17, shared_tokens=1 << 15)
    grown, whole = NgramCache(**kw), _whole_buffers(NgramCache(**kw))
    ctl_g, ctl_w = AdaptiveController(), AdaptiveController()
    assert grown._l_table.size == _trie.MIN_TABLE < grown._l_hash.size

    def text(n):  # repetitive text over a small alphabet: many repeated n-grams, O(D) nodes per token
        return rng.integers(0, 40, n).astype(np.int32)

    for round_ in range(3):
        rids = [f"{round_}-{i}" for i in range(3)]
        prompts = [text(3000 if i == 0 else 200) for i in range(3)]
        for rid, p in zip(rids, prompts):
            for cache, ctl in ((grown, ctl_g), (whole, ctl_w)):
                cache.start_request(rid, p)
                ctl.start(rid)
        outs = {r: [] for r in rids}
        for step in range(40):
            commits = [text(int(rng.integers(0, 12))) for _ in rids]
            res = [ctl.step(cache, rids, commits) for cache, ctl in ((grown, ctl_g), (whole, ctl_w))]
            (bg, pg), (bw, pw) = res
            for a, b in ((bg.tokens, bw.tokens), (bg.parents, bw.parents), (bg.offsets, bw.offsets)):
                np.testing.assert_array_equal(a, b)
            assert (pg.width, pg.reason) == (pw.width, pw.reason)
            np.testing.assert_array_equal(pg.lengths, pw.lengths)
            for r, c in zip(rids, commits):
                outs[r].extend(c.tolist())
            if step % 10 == 9:  # the verbs too
                extra = [text(5) for _ in rids]
                for cache in (grown, whole):
                    cache.add_tokens_batch(rids, extra)
                for r, c in zip(rids, extra):
                    outs[r].extend(c.tolist())
        for rid in rids:
            for cache in (grown, whole):
                assert cache.count(outs[rid][-3:], rid=rid) >= 1
                assert cache.count(outs[rid][-4:], "shared") == whole.count(outs[rid][-4:], "shared")
        _check_hash(grown._l_nodes, grown._l_table, grown._l_meta)
        for cache, ctl in ((grown, ctl_g), (whole, ctl_w)):
            for rid in rids:
                cache.finish_request(rid, share=True)
                ctl.finish(rid)
        _check_hash(grown._s_nodes, grown._s_table, grown._s_meta)
        # the next round drafts from the shared outputs too
        probe = "probe"
        drafts = []
        for cache in (grown, whole):
            cache.start_request(probe, outs[rids[1]][:50])
            drafts.append(cache.propose([probe], 15))
            cache.finish_request(probe, share=False)
        np.testing.assert_array_equal(drafts[0].tokens, drafts[1].tokens)
        assert drafts[0].tokens.size > 0
    # the views grew with the nodes, and stayed below the whole buffers
    assert _trie.MIN_TABLE < grown._l_table.size < grown._l_hash.size
    assert _trie.MIN_TABLE < grown._s_table.size < grown._s_hash.size
    assert grown.stats()["local_nodes_live"] == whole.stats()["local_nodes_live"]
    assert grown.stats()["shared_nodes_live"] == whole.stats()["shared_nodes_live"]

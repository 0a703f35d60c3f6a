"""Our verify layout equals what SGLang's own code derives for the same trees (CPU, real sglang files).

References (SGLang's code, see sglang_reference.py): the NGRAM tree-mask kernel (positions and
retrieve arrays on device), `_derive_tree_links` (host links used for grammar), the greedy
tree-verification kernel (which nodes get accepted), and `NgramCorpus.leaf_paths_from_mask`.
Trees: random tries of every shape up to width 16 (seeded), edge cases, and drafts our cache makes
on real traces (when ../shared is present).
"""
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sglang")
pytest.importorskip("torch")
pytest.importorskip("triton")

import sglang_reference as ref

from ngramspec.layout import accepted_path, tree_layout

pytestmark = pytest.mark.sglang
SHARED = Path(__file__).resolve().parents[3] / "shared"
MISS = 99  # the model's prediction where the path left the truth: a token no draft uses


def random_trie(rng, max_nodes=15, alphabet=4):
    """A draft: parents[j] < j, tokens in [1, alphabet], no parent with two children of one token."""
    tokens, parents, used = [], [], set()
    for _ in range(int(rng.integers(0, max_nodes + 1))):
        p = int(rng.integers(-1, len(tokens)))
        t = int(rng.integers(1, alphabet + 1))
        if (p, t) not in used:
            used.add((p, t))
            tokens.append(t)
            parents.append(p)
    return np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64)


def edge_drafts():
    chain = (np.arange(1, 16), np.arange(-1, 14))
    star = (np.arange(1, 16), np.full(15, -1))
    return [(np.zeros(0, np.int64), np.zeros(0, np.int64)), chain, star, (np.array([3]), np.array([-1]))]


def model_targets(lay, truths):
    """target[b, i]: the model's argmax after row i = the truth's next token if row i's path follows the truth."""
    bs, width = lay.tokens.shape
    target = np.full((bs, width), MISS, dtype=np.int64)
    for b in range(bs):
        for i in range(width):
            path, k = [], i
            while k > 0:
                path.append(int(lay.tokens[b, k]))
                k = int(lay.parents[b, k])
            path = path[::-1]
            if path == list(truths[b][: len(path)]) and len(path) < len(truths[b]):
                target[b, i] = truths[b][len(path)]
    return target


def make_cases(seed=0, count=150):
    rng = np.random.default_rng(seed)
    cases = []
    for c in range(count):
        bs = int(rng.integers(1, 5))
        width = int(rng.integers(1, 17))
        drafts = [edge_drafts()[c % 4] if b == 0 and c < 16 else random_trie(rng) for b in range(bs)]
        roots = rng.integers(1, 10, size=bs)
        truths = [rng.integers(1, 5, size=width) for _ in range(bs)]
        lay = tree_layout(drafts, roots, width)
        cases.append({
            "drafts": drafts, "truths": truths, "layout": lay,
            "tokens": lay.tokens, "mask": lay.mask, "retrieve_index": lay.retrieve_index,
            "retrieve_next_token": lay.retrieve_next_token, "retrieve_next_sibling": lay.retrieve_next_sibling,
            "seq_lens": rng.integers(1, 5000, size=bs), "target": model_targets(lay, truths),
        })
    return cases


@pytest.fixture(scope="module")
def checked():
    cases = make_cases()
    return cases, ref.run_reference(cases)


def test_positions_and_retrieve_arrays_equal_sglang_kernel(checked):
    cases, results = checked
    for case, res in zip(cases, results):
        lay = case["layout"]
        np.testing.assert_array_equal(res["positions"], lay.depths + case["seq_lens"][:, None])
        np.testing.assert_array_equal(res["retrieve_index"], lay.retrieve_index)
        np.testing.assert_array_equal(res["retrieve_next_token"], lay.retrieve_next_token)
        np.testing.assert_array_equal(res["retrieve_next_sibling"], lay.retrieve_next_sibling)


def test_host_links_equal_sglang_derive_tree_links(checked):
    cases, results = checked
    for case, res in zip(cases, results):
        np.testing.assert_array_equal(res["host_next_token"], case["layout"].retrieve_next_token)
        np.testing.assert_array_equal(res["host_next_sibling"], case["layout"].retrieve_next_sibling)


def test_sglang_greedy_verify_accepts_exactly_our_accepted_path(checked):
    cases, results = checked
    accepted_any = 0
    for case, res in zip(cases, results):
        width = case["tokens"].shape[1]
        for b, (t, p) in enumerate(case["drafts"]):
            n = min(len(t), width - 1)
            path = accepted_path(t[:n], p[:n], case["truths"][b])
            assert int(res["accept_num"][b]) == len(path)
            assert int(res["accept_index"][b, 0]) == b * width  # the root row
            assert res["accept_index"][b, 1: 1 + len(path)].tolist() == [b * width + j + 1 for j in path]
            # the committed tokens: accepted drafts, then the model's bonus token
            rows = [0] + [j + 1 for j in path]
            assert res["predicts"][b, rows].tolist() == list(case["truths"][b][: len(path) + 1])
            accepted_any += len(path) > 0
    assert accepted_any > 20  # the cases exercise real acceptance, not only rejections


def test_mask_encodes_the_draft_paths_sglang_reads():
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

    rng = np.random.default_rng(1)
    for c in range(200):
        tokens, parents = edge_drafts()[c] if c < 4 else random_trie(rng)
        width, root = int(rng.integers(2, 17)), int(rng.integers(1, 10))
        lay = tree_layout([(tokens, parents)], [root], width)
        n = min(len(tokens), width - 1)
        has_child = set(parents[:n].tolist())
        expected = []
        for j in range(n):
            if j not in has_child:
                path, k = [], j
                while k >= 0:
                    path.append(int(tokens[k]))
                    k = int(parents[k])
                expected.append([root] + path[::-1])
        expected += [[root, 0]] * (width - 1 - n)  # padding rows: token 0 under the root
        # leaf_paths_from_mask does not use its instance (no C++ corpus needed)
        got = NgramCorpus.leaf_paths_from_mask(None, lay.tokens[0].tolist(), lay.mask[0].astype(int).tolist())
        assert sorted(got) == sorted(expected)


def test_drafts_of_our_cache_on_real_traces_match_sglang_kernel():
    from ngramspec.cache import NgramCache

    path = SHARED / "traces" / "agent_swe_gpt4_dev.jsonl.gz"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    with gzip.open(path, "rt") as f:
        records = [json.loads(line) for _, line in zip(range(3), f)]
    cache = NgramCache(max_depth=12)
    width, cases, multi = 16, [], 0
    for r, rec in enumerate(records):
        cache.start_request(r, rec["prompt"])
        for pos in range(0, len(rec["output"]), 5):
            draft = cache.propose([r], width - 1, tree=True).draft(0)
            hist = cache.history(r)
            lay = tree_layout([draft], [int(hist[-1])], width)
            truth = np.array(rec["output"][pos: pos + width], dtype=np.int64)
            truth = np.concatenate([truth, np.full(width - truth.size, MISS + 1)])
            cases.append({"draft": draft, "truth": truth, "layout": lay, "tokens": lay.tokens, "mask": lay.mask,
                          "retrieve_index": lay.retrieve_index, "retrieve_next_token": lay.retrieve_next_token,
                          "retrieve_next_sibling": lay.retrieve_next_sibling, "seq_lens": np.array([len(hist)]),
                          "target": model_targets(lay, [truth])})
            multi += len(draft) > 1
            cache.add_tokens(r, rec["output"][pos: pos + 5])
        cache.finish_request(r)
    assert multi > 0  # real multi-node drafts are compared, not only empty ones
    for case, res in zip(cases, ref.run_reference(cases)):
        lay = case["layout"]
        np.testing.assert_array_equal(res["positions"], lay.depths + case["seq_lens"][:, None])
        np.testing.assert_array_equal(res["retrieve_next_token"], lay.retrieve_next_token)
        np.testing.assert_array_equal(res["retrieve_next_sibling"], lay.retrieve_next_sibling)
        # over all verified rows: padding (token 0 under the root) is accepted when the model says 0
        path = accepted_path(lay.tokens[0, 1:], lay.parents[0, 1:] - 1, case["truth"])
        assert int(res["accept_num"][0]) == len(path)


def test_trees_sglang_ngram_builds_are_laid_out_identically():
    """SGLang's NGRAM corpus (its C++ trie, built on CPU) drafts trees as (tokens, mask); reading the parents
    off its mask and laying them out with ours reproduces its tokens and mask exactly, padding included."""
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

    rng = np.random.default_rng(2)
    width = 12
    corpus = NgramCorpus(max_trie_depth=8, draft_token_num=width, max_bfs_breadth=4)
    phrases = [list(rng.integers(1, 30, size=int(rng.integers(4, 9)))) for _ in range(12)]
    streams = [sum((phrases[int(i)] for i in rng.integers(0, 12, size=40)), []) for _ in range(6)]
    corpus.batch_put(streams)
    corpus.synchronize()
    contexts = [s[: int(rng.integers(3, len(s)))][-8:] for s in streams for _ in range(5)]
    ids, masks = corpus.batch_get([f"q{i}" for i in range(len(contexts))], contexts, [len(c) for c in contexts])
    ids = ids.reshape(len(contexts), width)
    masks = masks.reshape(len(contexts), width, width).astype(bool)
    branching = 0
    for tokens, mask in zip(ids, masks):
        rows = np.arange(width)
        ancestors = mask & (rows[None, :] < rows[:, None])
        parent_rows = np.where(ancestors.any(1), (ancestors * rows).argmax(1), -1)
        draft = (tokens[1:], parent_rows[1:] - 1)  # draft node j is row j + 1; -1: child of the root
        lay = tree_layout([draft], [int(tokens[0])], width)
        np.testing.assert_array_equal(lay.tokens[0], tokens)
        np.testing.assert_array_equal(lay.mask[0], mask)
        real_parents = [int(p) for p, t in zip(parent_rows[1:], tokens[1:]) if t != 0]
        branching += len(real_parents) != len(set(real_parents))  # a node with two real children
    assert branching > 0  # some of SGLang's drafts are real trees, not only chains

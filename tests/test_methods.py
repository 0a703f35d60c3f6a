"""Draft methods: prompt lookup against a brute-force reference, SGLang draft decoding, ngramspec trees."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.sim.methods import EMPTY_DRAFT, METHODS, Method, make_method, register_method
from ngramspec.sim.methods.sglang_ngram import split_sglang_drafts
from ngramspec.sim.simulate import replay
from ngramspec.sim.traces import make_trace


def reference_prompt_lookup(tokens, k, min_n, max_n):
    """vLLM's rule by brute force: longest n first, earliest earlier occurrence, copy up to k, not past the end."""
    total = len(tokens)
    for n in range(min(max_n, total), min_n - 1, -1):
        suffix = tokens[total - n:]
        for start in range(0, total - n):
            if tokens[start:start + n] == suffix:
                begin = start + n
                return tokens[begin: begin + min(k, total - begin)]
    return []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=60), st.integers(1, 20), st.integers(1, 6),
       st.integers(1, 8), st.integers(1, 3))
def test_prompt_lookup_matches_reference(sequence, prompt_len, k, max_n, min_n):
    min_n = min(min_n, max_n)
    prompt_len = min(prompt_len, len(sequence) - 1)
    method = make_method(f"prompt-lookup:k={k},min={min_n},max={max_n}")
    method.start(0, np.array(sequence[:prompt_len], np.int32))
    for end in range(prompt_len, len(sequence)):
        (draft, parents), = method.propose([0])
        assert draft.tolist() == reference_prompt_lookup(sequence[:end], k, min_n, max_n)
        assert parents.tolist() == list(range(-1, len(draft) - 1))
        method.update(0, np.array(sequence[end:end + 1], np.int32), 0)


def test_prompt_lookup_is_per_request_only():
    trace = make_trace("t", [{"prompt": [1, 2, 3], "output": [4, 5, 6, 7, 8]},
                             {"prompt": [9, 4, 5], "output": [6, 7, 8]}])
    run = replay(trace, make_method("prompt-lookup:k=8"))
    assert run.accepted == 0  # request 1's [4, 5] never matches request 0's output


def test_split_sglang_drafts_strips_trailing_padding_only():
    d = 5
    # request 0: root, a (root child), b (child of a), 0 under the root (real: followed by c), c (child of b)
    # request 1: root, x, then three padding rows (token 0 under the root)
    ids = np.array([7, 11, 12, 0, 13, 8, 21, 0, 0, 0])
    parents_0 = [-1, 0, 1, 0, 2]
    parents_1 = [-1, 0, 0, 0, 0]
    mask = np.zeros((2, d, d), dtype=np.int64)
    for b, parents in enumerate((parents_0, parents_1)):
        for i, p in enumerate(parents):
            mask[b, i, i] = 1
            while p >= 0:
                mask[b, i, p] = 1
                p = parents[p]
    drafts = split_sglang_drafts(ids, mask.reshape(-1), 2, d)
    assert drafts[0][0].tolist() == [11, 12, 0, 13] and drafts[0][1].tolist() == [-1, 0, -1, 1]
    assert drafts[1][0].tolist() == [21] and drafts[1][1].tolist() == [-1]


def test_register_method_makes_a_name_available():
    class Constant(Method):
        def propose(self, rids):
            return [EMPTY_DRAFT] * len(rids)

    register_method("test-constant", Constant)
    try:
        assert make_method("test-constant").name == "test-constant"
    finally:
        METHODS.pop("test-constant")
    with pytest.raises(ValueError):
        register_method("bad:name", Constant)


def test_ngramspec_tree_accepts_a_second_branch_where_the_chain_misses():
    pytest.importorskip("ngramspec.cache")
    # after [1, 2] history continues with 3 twice and with 4 once; the true continuation is 4
    prompt = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 8, 5, 1, 2]
    trace = make_trace("branches", [{"prompt": prompt, "output": [4, 8]}])
    chain = replay(trace, make_method("ngramspec-chain:k=8"))
    tree = replay(trace, make_method("ngramspec-tree:k=8"))
    assert tree.steps < chain.steps
    assert tree.accepted > chain.accepted


def test_oracle_controller_only_drafts_what_is_accepted():
    pytest.importorskip("ngramspec.cache")
    from ngramspec.sim.profiles import SEED_PCIE8

    rng = np.random.default_rng(5)
    phrases = [rng.integers(0, 30, size=6).tolist() for _ in range(5)]
    records = [{"prompt": sum((phrases[i] for i in rng.integers(0, 5, 3)), []),
                "output": sum((phrases[i] for i in rng.integers(0, 5, 8)), [])} for _ in range(4)]
    trace = make_trace("ctl", records)
    for batch in (1, 3):
        run = replay(trace, make_method("oracle-ctl:k=8"), batch, SEED_PCIE8)
        assert run.accepted == run.drafted > 0

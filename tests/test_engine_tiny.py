"""The decoding loop's bookkeeping on a small random-weight Llama (fast; needs torch and transformers only):
tree verification, keep-the-accepted-path, per-sequence lengths, finished rows, tight caches, bad input."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_oracle import OracleCache  # noqa: E402

from ngramspec import NgramCache  # noqa: E402
from ngramspec.engine.decode import FixedPolicy, SpecDecoder, freeze_gc  # noqa: E402
from ngramspec.engine.model import KVModel  # noqa: E402
from ngramspec.engine.policy import make_policy  # noqa: E402
from ngramspec.layout import greedy_walk, tree_rows  # noqa: E402

VOCAB = 256


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    motif = rng.integers(0, VOCAB, 12).tolist()
    # repetitive prompts of different lengths, so the n-gram cache drafts and rows differ in length
    return [motif * (2 + i) + rng.integers(0, VOCAB, 3 + 2 * i).tolist() for i in range(4)]


def plain(model, prompts, new_tokens):
    dec = SpecDecoder(KVModel(model, batch=1, max_len=max(map(len, prompts)) + new_tokens + 1))
    return [dec.generate([p], new_tokens).outputs[0] for p in prompts]


def test_tree_rows_mask_depths_and_padding():
    tokens, parents = np.array([5, 6, 7, 8]), np.array([-1, 0, -1, 2])
    row_tokens, row_parent, depth, anc = tree_rows(tokens, parents, root=9, width=6)
    assert row_tokens.tolist() == [9, 5, 6, 7, 8, 0]
    assert row_parent.tolist() == [-1, 0, 1, 0, 3, 0]
    assert depth.tolist() == [0, 1, 2, 1, 2, 1]
    assert anc[2].tolist() == [True, True, True, False, False, False]
    assert anc[4].tolist() == [True, False, False, True, True, False]
    assert anc[5].tolist() == [True, False, False, False, False, True]   # padding: root and itself only
    with pytest.raises(ValueError, match="does not fit"):
        tree_rows(tokens, parents, root=9, width=4)
    with pytest.raises(ValueError, match="parents must precede"):
        tree_rows(np.array([1, 2]), np.array([-1, 1]), root=0, width=3)


def test_greedy_walk_follows_predicted_children_only():
    row_tokens, row_parent, _, _ = tree_rows(np.array([5, 6, 7, 8]), np.array([-1, 0, -1, 2]), root=9, width=6)
    predicted = np.array([7, 0, 0, 8, 4, 0])      # root predicts 7 (row 3), row 3 predicts 8 (row 4)
    assert greedy_walk(row_tokens, row_parent, 4, predicted) == [3, 4]
    predicted[0] = 0                                # token 0 is only in the padding row: never accepted
    assert greedy_walk(row_tokens, row_parent, 4, predicted) == []


@pytest.mark.parametrize("spec", ["chain:k=8", "tree:k=8", "adaptive", "adaptive:prefetch=0"])
@pytest.mark.parametrize("batch", [1, 4])
def test_ngram_speculation_equals_plain_greedy(tiny_model, prompts, spec, batch):
    new_tokens = 64
    reference = plain(tiny_model, prompts, new_tokens)
    policy = make_policy(spec)
    dec = SpecDecoder(KVModel(tiny_model, batch=batch, max_len=max(map(len, prompts)) + new_tokens + 17))
    cache, outputs, accepted = NgramCache(), [], 0
    for start in range(0, len(prompts), batch):
        res = dec.generate(prompts[start:start + batch], new_tokens, policy=policy, cache=cache,
                           rids=list(range(start, start + batch)))
        outputs += res.outputs
        accepted += sum(sum(r.accepted) for r in res.records)
    assert outputs == reference
    if not spec.startswith("adaptive"):  # the controller may rightly decline to draft; fixed ones always verify
        assert accepted > 0


@pytest.mark.parametrize("sync_moves", [False, True])
def test_oracle_trees_with_decoys_move_the_accepted_kv(tiny_model, prompts, sync_moves):
    new_tokens, width = 40, 14
    truth = dict(enumerate(plain(tiny_model, prompts, new_tokens)))
    dec = SpecDecoder(KVModel(tiny_model, batch=4, max_len=max(map(len, prompts)) + new_tokens + width),
                      sync_moves=sync_moves)
    res = dec.generate(prompts, new_tokens, policy=FixedPolicy(width - 1, tree=True),
                       cache=OracleCache(truth, decoy_offset=5, depth=6, seed=0, vocab=VOCAB), rids=[0, 1, 2, 3])
    assert res.outputs == [truth[i] for i in range(4)]
    assert max(max(r.accepted) for r in res.records) >= 2   # accepted paths ran through non-first children
    assert any(r.moved for r in res.records)  # ... so the step records count KV moves
    assert all(0.0 <= r.plan_seconds <= r.host_seconds <= r.seconds for r in res.records)


def test_rows_that_overshoot_and_finish_early_stay_inside_a_tight_cache(tiny_model, prompts):
    """The longest-prompt row verifies 13 true tokens a step and finishes at step 3 having verified 13 tokens
    past its budget, while the other rows go on with wide drafts, in a cache with no slack beyond
    prompt + new tokens + width."""
    new_tokens, width = 29, 14
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    prompts = [prompts[i] for i in order]           # row 0 holds the longest prompt
    truth = dict(enumerate(plain(tiny_model, prompts, 2 * new_tokens)))
    dec = SpecDecoder(KVModel(tiny_model, batch=4, max_len=len(prompts[0]) + new_tokens + width))
    depth = {0: width - 1, 1: 6, 2: 6, 3: 6}
    res = dec.generate(prompts, new_tokens, policy=FixedPolicy(width - 1, tree=False),
                       cache=OracleCache(truth, decoy_offset=None, depth=depth, seed=1, vocab=VOCAB),
                       rids=[0, 1, 2, 3])
    assert res.outputs == [truth[i][:new_tokens] for i in range(4)]
    assert res.steps == [3, 5, 5, 5]


def test_eos_stops_a_request_and_is_kept(tiny_model, prompts):
    reference = plain(tiny_model, prompts[:1], 30)[0]
    eos = reference[10]
    first = reference.index(eos)
    dec = SpecDecoder(KVModel(tiny_model, batch=1, max_len=len(prompts[0]) + 40))
    res = dec.generate(prompts[:1], 30, eos_token_id=eos, policy=FixedPolicy(8, tree=True), cache=NgramCache())
    assert res.outputs[0] == reference[:first + 1]


def test_freeze_gc_takes_what_is_loaded_out_of_later_collections():
    """After `freeze_gc` a full collection no longer walks the objects that existed (a chain of lists stands
    for a loaded model); objects made afterwards are still collected."""
    import gc

    loaded = [[] for _ in range(2000)]
    for a, b in zip(loaded, loaded[1:]):
        a.append(b)
    try:
        assert freeze_gc() >= len(loaded)
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in loaded)
        later = []
        later.append(later)  # a cycle made after the freeze
        assert id(later) in {id(o) for o in gc.get_objects()}
        del later
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()


def test_bad_input_raises(tiny_model, prompts):
    dec = SpecDecoder(KVModel(tiny_model, batch=2, max_len=128))
    with pytest.raises(ValueError, match="1..2 prompts"):
        dec.generate([], 4)
    with pytest.raises(ValueError, match="rids"):
        dec.generate(prompts[:2], 4, rids=[1])
    with pytest.raises(ValueError, match="outside"):
        dec.generate([[VOCAB]], 4)
    with pytest.raises(ValueError, match="batch >= 1"):
        KVModel(tiny_model, batch=0, max_len=16)
    kv = KVModel(tiny_model, batch=1, max_len=16)
    with pytest.raises(ValueError, match="shape mismatch"):
        kv.forward(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
                   torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="Llama-family"):
        KVModel(torch.nn.Linear(2, 2), batch=1, max_len=16)


def test_adaptive_policy_takes_a_calibration_prior():
    from pathlib import Path

    from ngramspec.sim.profiles import TableProfile

    path = Path(__file__).resolve().parents[1] / "docs" / "engine" / "h200_smollm2_sdpa.json"
    policy = make_policy(f"adaptive:max_width=8,prior={path}")
    assert policy.max_width == 8
    expected = TableProfile.from_json(str(path), "graph_ms").cost_ms(4, 6)
    assert policy.costs.estimate(4, 6) == pytest.approx(expected)
    assert make_policy("adaptive:prefetch=0").prefetch is None and callable(make_policy("adaptive").prefetch)
    for bad in ("adaptive:explore_every=5", "adaptive:max_width=x", "adaptive:prefetch=2"):
        with pytest.raises(ValueError):
            make_policy(bad)



@pytest.mark.parametrize("batch", [1, 2])
def test_adaptive_one_call_step_decides_as_the_verbs_do(tiny_model, prompts, batch):
    """The decoder gives an AdaptiveController each row's tokens with the next step's `step` call (and a
    finished row's last tokens through the verbs); with the verbs alone (propose, plan, add_tokens,
    observe_tokens) every plan, output and learned state is the same. Step costs are fixed by width, so both
    runs see the same durations. Groups get different token budgets, so rows finish at different steps."""
    from ngramspec.engine.policy import AdaptivePolicy

    class Timed(AdaptivePolicy):
        def observe_step(self, batch, width, duration_ms):
            super().observe_step(batch, width, 4.0 + 0.25 * width)

    class VerbsOnly(Timed):
        step = None

    new_tokens = 48
    reference = plain(tiny_model, prompts, new_tokens)
    runs = []
    for policy in (Timed(max_width=8), VerbsOnly(max_width=8)):
        dec = SpecDecoder(KVModel(tiny_model, batch=batch, max_len=max(map(len, prompts)) + new_tokens + 9))
        cache, outputs, plans = NgramCache(), [], []
        for start in range(0, len(prompts), batch):
            res = dec.generate(prompts[start:start + batch], new_tokens - 8 * start, policy=policy, cache=cache,
                               rids=list(range(start, start + batch)))
            assert res.outputs == [reference[i][:new_tokens - 8 * start] for i in range(start, start + batch)]
            outputs += res.outputs
            plans += [(r.width, r.kept, r.accepted) for r in res.records]
        cache.start_request("probe", prompts[0] + outputs[0][:5])   # what the shared part learned
        probe = cache.propose(["probe"], 7).draft(0)
        runs.append((outputs, plans, policy.state_dict(), probe.tokens.tolist(), probe.parents.tolist()))
    (out_a, plans_a, state_a, *probe_a), (out_b, plans_b, state_b, *probe_b) = runs
    assert out_a == out_b and plans_a == plans_b and probe_a == probe_b
    assert any(w > 1 for w, _, _ in plans_a)          # it drafted, so the two paths were compared on drafts
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        np.testing.assert_array_equal(state_a[key], state_b[key], err_msg=key)


def test_other_policies_plans_are_checked_and_may_hold_lists(tiny_model, prompts):
    """A policy other than the controller itself may return its lengths as a list (taken as is) and has its plan
    checked: a prefix longer than the width it chose is a ValueError, not a wrong decode."""
    from ngramspec.controller.protocol import Plan

    class ListLengths(FixedPolicy):
        def plan(self, rids, batch, waiting=None):
            p = super().plan(rids, batch, waiting)
            return Plan(p.width, p.lengths.tolist(), p.expected, p.cost, p.reason)

    class TooLong(FixedPolicy):
        def plan(self, rids, batch, waiting=None):
            p = super().plan(rids, batch, waiting)
            return Plan(1, [int(k) + 1 for k in p.lengths], p.expected, p.cost, p.reason)

    new_tokens = 24
    reference = plain(tiny_model, prompts[:1], new_tokens)
    dec = SpecDecoder(KVModel(tiny_model, batch=1, max_len=max(map(len, prompts)) + new_tokens + 9))
    res = dec.generate(prompts[:1], new_tokens, policy=ListLengths(8, tree=True), cache=NgramCache())
    assert res.outputs == reference
    with pytest.raises(ValueError, match="policy chose width 1"):
        dec.generate(prompts[:1], new_tokens, policy=TooLong(8, tree=True), cache=NgramCache())


@pytest.mark.parametrize("spec", [None, "tree:k=6"])
def test_recorded_topk_is_the_distribution_of_each_output_token(tiny_model, prompts, spec):
    """`record_topk`: one row per output token, its first entry the token itself (greedy), and, plain or
    speculative, the same rows (the scores at the committed positions do not depend on the drafts)."""
    new = 20
    dec = SpecDecoder(KVModel(tiny_model, batch=2, max_len=max(map(len, prompts)) + new + 8), record_topk=4)
    policy = make_policy(spec) if spec else None
    res = dec.generate(prompts[:2], new, policy=policy, cache=NgramCache(max_depth=8) if spec else None)
    ref = SpecDecoder(KVModel(tiny_model, batch=1, max_len=max(map(len, prompts)) + new + 1), record_topk=4)
    for i in range(2):
        assert res.topk[i].shape == (len(res.outputs[i]), 4)
        assert res.topk[i][:, 0].tolist() == res.outputs[i]
        one = ref.generate([prompts[i]], new)
        assert one.outputs[0] == res.outputs[i] and np.array_equal(one.topk[0], res.topk[i])
    if spec:
        assert sum(sum(r.accepted) for r in res.records) > 0  # drafts were accepted: rows came from tree paths
    with pytest.raises(ValueError, match="record_topk"):
        SpecDecoder(KVModel(tiny_model, batch=1, max_len=8), record_topk=-1)


@pytest.mark.parametrize("spec, widen", [("tree:k=8", False), ("adaptive", False), ("adaptive", True)])
@pytest.mark.parametrize("min_match", [1, 100])
def test_recycling_is_lossless_and_drafts_where_the_cache_does_not(tiny_model, prompts, min_match, spec, widen):
    """Recycling as a second source, with a fixed tree policy and with the adaptive controller (which calibrates
    recycled nodes apart and plans over both sources); the accepted draft tokens are split by source."""
    from ngramspec.engine.policy import make_policy
    from ngramspec.recycle import RecycleTable

    new = 24
    want = plain(tiny_model, prompts[:2], new)
    table = RecycleTable(VOCAB, k=4)
    dec = SpecDecoder(KVModel(tiny_model, batch=2, max_len=max(map(len, prompts)) + new + 17))
    res = dec.generate(prompts[:2], new, policy=make_policy(spec), cache=NgramCache(max_depth=8),
                       recycle=table, recycle_min_match=min_match, recycle_widen=widen)
    assert res.outputs == want
    ngram, recycled = res.recycled
    assert recycled > 0 and (ngram == 0) == (min_match == 100)  # a match of 100 never happens: recycling only
    assert (table.succ >= 0).any(axis=1).sum() > new  # the table learned rows for the verified tokens
    from_ngram, from_recycling = res.accepted_by_source
    assert from_ngram + from_recycling == sum(sum(r.accepted) for r in res.records)
    if min_match == 100:
        assert from_ngram == 0
        if spec.startswith("tree"):
            assert from_recycling > 0  # the tiny model's own top-1 chains get accepted
    with pytest.raises(ValueError, match="recycle needs"):
        dec.generate(prompts[:1], 4, recycle=table)
    with pytest.raises(ValueError, match="rows for a vocabulary"):
        dec.generate(prompts[:1], 4, policy=FixedPolicy(8, tree=True), cache=NgramCache(), recycle=RecycleTable(8))

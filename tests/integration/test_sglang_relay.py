"""Step outputs at changing widths through SGLang's real overlap relay (`FutureMap`) and batch ops, on CPU."""
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_server]
MAX_WIDTH = 16


@pytest.fixture(scope="module")
def sglang_parts():
    from sglang.srt.managers.overlap_utils import RelayPayload
    from sglang.srt.speculative.ngram_info import NgramVerifyInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    import ngramspec_sglang

    ngramspec_sglang.register()
    return SpeculativeAlgorithm.from_string("NGRAM_ADAPTIVE"), RelayPayload, NgramVerifyInput


def step_output(accepted: list[list[int]], width: int):
    """What the worker returns after a verify at `width`: [bs, width] tokens (garbage past accept_len)."""
    from ngramspec_sglang.relay import next_draft_input, padded_rows

    rows = torch.full((len(accepted), width), 777, dtype=torch.int32)
    for i, toks in enumerate(accepted):
        rows[i, : len(toks)] = torch.tensor(toks, dtype=torch.int32)
    lens = torch.tensor([len(t) for t in accepted], dtype=torch.int32)
    return next_draft_input(padded_rows(rows, MAX_WIDTH), lens, torch.tensor([100] * len(accepted)), MAX_WIDTH)


def test_relay_carries_each_steps_tokens_whatever_the_width(sglang_parts):
    from ngramspec_sglang.relay import request_views

    algo, RelayPayload, NgramVerifyInput = sglang_parts
    pool = SimpleNamespace(req_to_token=torch.zeros(8, 64, dtype=torch.int32))
    future_map = algo.create_future_map(torch.device("cpu"), pool, needs_cpu_seq_lens=False)
    reqs = [SimpleNamespace(rid="a", origin_input_ids_unpadded=[1, 2], output_ids=[3]),
            SimpleNamespace(rid="b", origin_input_ids_unpadded=[4], output_ids=[])]
    slots = torch.tensor([3, 5])
    steps = [(4, [[9, 8, 7], [6]]), (16, [[1] * 16, [2, 3]]), (1, [[5], [4]]), (12, [[6, 6], [1, 2, 3, 4, 5]])]
    for width, accepted in steps:
        future_map.stash(slots, RelayPayload.from_ngram(step_output(accepted, width)))
        batch = SimpleNamespace(reqs=reqs, spec_info=NgramVerifyInput(future_indices=slots, new_seq_lens=slots))
        future_map._resolve_spec_extras(batch)  # what the scheduler does before the next forward
        views = request_views(batch, use_prev_tokens=True)
        assert [list(v.pending) for v in views] == accepted
        # a verify prepared before the wait replaces the batch's spec info: the relay is passed beside it
        relay, batch.spec_info = batch.spec_info, SimpleNamespace(draft_token_num=width)
        assert [list(v.pending) for v in request_views(batch, True, relay=relay)] == accepted


def test_requests_that_join_after_a_prefill_do_not_count_their_relayed_tokens_twice(sglang_parts):
    """Decode [a, b], then a prefill of c (the scheduler processes the decode's result meanwhile: a and b's tokens
    reach their outputs), then the merged decode [a, b, c]: the relay still holds a and b's last tokens, but only
    c's (its prefill token) are pending. Counting a and b's again put their committed length (and so the verify's
    positions and the drafts' context) one step ahead of their KV cache."""
    from ngramspec_sglang.relay import request_views

    algo, RelayPayload, NgramVerifyInput = sglang_parts
    pool = SimpleNamespace(req_to_token=torch.zeros(8, 64, dtype=torch.int32))
    future_map = algo.create_future_map(torch.device("cpu"), pool, needs_cpu_seq_lens=False)
    a = SimpleNamespace(rid="a", origin_input_ids_unpadded=[1, 2], output_ids=[3])
    b = SimpleNamespace(rid="b", origin_input_ids_unpadded=[4], output_ids=[5])
    c = SimpleNamespace(rid="c", origin_input_ids_unpadded=[6, 7, 8], output_ids=[])
    future_map.stash(torch.tensor([3, 5]), RelayPayload.from_ngram(step_output([[9, 8], [6]], 4)))
    future_map.stash(torch.tensor([6]), RelayPayload.from_ngram(step_output([[4]], 1)))  # c's prefill
    a.output_ids += [9, 8]
    b.output_ids += [6]
    slots = torch.tensor([3, 5, 6])
    batch = SimpleNamespace(reqs=[a, b, c], spec_info=NgramVerifyInput(future_indices=slots, new_seq_lens=slots))
    future_map._resolve_spec_extras(batch)
    views = request_views(batch, use_prev_tokens=True, relayed_rids={"c"})
    assert [list(v.pending) for v in views] == [[], [], [4]]
    assert [v.committed_len for v in views] == [5, 3, 4]
    assert [v.last_token() for v in views] == [8, 6, 4]
    # every row counted as pending: a and b ahead by their last step's tokens
    assert [v.committed_len for v in request_views(batch, use_prev_tokens=True)] == [7, 4, 4]


def test_a_relay_at_the_step_width_would_break(sglang_parts):
    """Why the stride stays at the largest width: SGLang sizes the relay buffer from the first payload."""
    algo, RelayPayload, NgramVerifyInput = sglang_parts
    pool = SimpleNamespace(req_to_token=torch.zeros(8, 64, dtype=torch.int32))
    future_map = algo.create_future_map(torch.device("cpu"), pool, needs_cpu_seq_lens=False)
    slots = torch.tensor([1])

    def unpadded(width):
        return NgramVerifyInput(draft_token_num=width, new_seq_lens=slots, accept_lens=torch.tensor([1]),
                                accept_tokens=torch.zeros(width, dtype=torch.int32))

    future_map.stash(slots, RelayPayload.from_ngram(unpadded(4)))
    with pytest.raises(RuntimeError):
        future_map.stash(slots, RelayPayload.from_ngram(unpadded(8)))


def test_filter_and_merge_keep_rows_aligned_across_widths(sglang_parts):
    first = step_output([[1, 2], [3]], width=4)
    second = step_output([[4, 5, 6, 7, 8, 9, 10, 11]], width=12)
    first.merge_batch(second)
    first.filter_batch(torch.tensor([2, 0]))
    rows = first.accept_tokens.view(-1, MAX_WIDTH)
    assert rows[0, :8].tolist() == [4, 5, 6, 7, 8, 9, 10, 11] and rows[1, :2].tolist() == [1, 2]
    assert first.accept_lens.tolist() == [8, 2]


def test_padded_rows_rejects_bad_shapes():
    from ngramspec_sglang.relay import padded_rows

    with pytest.raises(ValueError, match="exceeds"):
        padded_rows(torch.zeros((2, 17), dtype=torch.int32), MAX_WIDTH)
    with pytest.raises(ValueError, match=r"\[bs, width\]"):
        padded_rows(torch.zeros(16, dtype=torch.int32), MAX_WIDTH)
    assert padded_rows(torch.ones((2, 3), dtype=torch.int32), 4).tolist() == [1, 1, 1, 0, 1, 1, 1, 0]


def test_padded_rows_cast_in_one_pass_equals_pad_then_cast():
    from ngramspec_sglang.relay import padded_rows

    rows = torch.tensor([[7], [100_000]], dtype=torch.int64)  # a sampler's int64 tokens, width 1
    out = padded_rows(rows, MAX_WIDTH, torch.int32)
    assert out.dtype == torch.int32 and out.shape == (2 * MAX_WIDTH,)
    assert torch.equal(out, padded_rows(rows.to(torch.int32), MAX_WIDTH))
    same = torch.ones((2, 3), dtype=torch.int32)
    assert torch.equal(padded_rows(same, 4, torch.int32), padded_rows(same, 4))


def test_full_verify_mask_equals_ngram_workers_construction():
    from ngramspec_sglang.relay import full_verify_mask

    gen = torch.Generator().manual_seed(0)
    for bs, width in [(1, 1), (3, 4), (5, 16), (2, 7)]:
        tree = torch.rand((bs, width, width), generator=gen) < 0.5
        seq_lens = torch.randint(0, 40, (bs,), generator=gen)
        # NGRAMWorker._prepare_for_speculative_decoding (USE_FULL_MASK), per request
        expected = torch.cat([
            torch.cat((torch.ones((width, int(seq_lens[i]))), tree[i]), dim=1).to(torch.bool).flatten()
            for i in range(bs)])
        got = full_verify_mask(tree, seq_lens)
        assert torch.equal(got, expected)
        # the size NgramVerifyInput.generate_attn_arg_prefill expects
        assert got.numel() == int(seq_lens.sum()) * width + width * width * bs
    with pytest.raises(ValueError, match="sequence lengths"):
        full_verify_mask(torch.ones((2, 3, 3), dtype=torch.bool), [1])


def test_full_verify_mask_sized_from_a_host_sum_without_reading_device_lengths():
    from ngramspec_sglang.relay import full_verify_mask

    tree = torch.tensor([[[1, 0], [1, 1]], [[1, 0], [0, 1]]], dtype=torch.bool)
    seq = torch.tensor([3, 1])
    got = full_verify_mask(tree, seq, seq_lens_sum=4)
    assert torch.equal(got, full_verify_mask(tree, seq))
    assert got.numel() == 4 * 2 + 2 * 2 * 2


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8])
def test_full_verify_mask_written_into_a_backends_buffer(dtype):
    """`preplan` writes the mask into the attention backend's own buffer (uint8 in SGLang's Triton backend), larger
    than the mask, over whatever the buffer held: the prefix equals the mask built alone, the rest is untouched."""
    from ngramspec_sglang.relay import full_verify_mask

    gen = torch.Generator().manual_seed(1)
    tree = torch.rand((3, 5, 5), generator=gen) < 0.5
    seq = torch.tensor([4, 0, 9])
    want = full_verify_mask(tree, seq)
    buf = torch.full((want.numel() + 17,), 7 if dtype == torch.uint8 else False, dtype=dtype)
    got = full_verify_mask(tree, seq, seq_lens_sum=13, out=buf)
    assert got.data_ptr() == buf.data_ptr() and got.numel() == want.numel()
    assert torch.equal(buf[: want.numel()].to(torch.bool), want)
    assert torch.equal(buf[want.numel():], torch.full((17,), 7 if dtype == torch.uint8 else False, dtype=dtype))
    with pytest.raises(ValueError, match="at least"):
        full_verify_mask(tree, seq, out=torch.zeros(want.numel() - 1, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8])
def test_a_verify_mask_prefilled_before_the_drafts_equals_the_mask_built_after(dtype):
    """`preplan` fills the mask's ones and finds the tree cells before the wait, from the device lengths and a
    host bound on the size, then writes only the tree masks: the same mask as `full_verify_mask` builds at once,
    over a buffer holding an older, larger mask (zeros at other places). A buffer smaller than the bound is left
    alone (None)."""
    from ngramspec_sglang.relay import full_verify_mask, prefill_verify_mask, write_tree_masks

    gen = torch.Generator().manual_seed(2)
    for bs, width in [(1, 2), (3, 4), (4, 16)]:
        tree = torch.rand((bs, width, width), generator=gen) < 0.5
        seq = torch.randint(0, 30, (bs,), generator=gen)
        want = full_verify_mask(tree, seq)
        buf = (torch.rand(want.numel() + 200, generator=gen) < 0.5).to(dtype)  # a stale mask's cells
        bound = want.numel() + 50  # the host's bound: at least the real size
        index = prefill_verify_mask(buf, seq, width, bound)
        write_tree_masks(buf, index, tree)
        assert torch.equal(buf[: want.numel()].to(torch.bool), want)
        assert prefill_verify_mask(torch.zeros(bound - 1, dtype=dtype), seq, width, bound) is None


def test_relayed_last_tokens_reads_each_requests_last_accepted_token(sglang_parts):
    from ngramspec_sglang.relay import relayed_last_tokens

    NgramVerifyInput = sglang_parts[2]
    relay = NgramVerifyInput(draft_token_num=4, new_seq_lens=torch.tensor([5, 9, 2]),
                             accept_tokens=torch.tensor([7, 8, 0, 0, 1, 2, 3, 4, 6, 0, 0, 0], dtype=torch.int32),
                             accept_lens=torch.tensor([2, 4, 1], dtype=torch.int32))
    got = relayed_last_tokens(relay, 3)
    assert got.tolist() == [8, 4, 6] and got.dtype == torch.int64
    assert relayed_last_tokens(NgramVerifyInput(draft_token_num=4, new_seq_lens=torch.tensor([1])), 1) is None
    assert relayed_last_tokens(None, 2) is None


def test_the_worker_decides_whether_the_relay_carries_host_sequence_lengths(sglang_parts):
    from ngramspec_sglang.host_seq_lens import set_cpu_seq_lens_need

    algo = sglang_parts[0]
    pool = SimpleNamespace(req_to_token=torch.zeros((8, 64), dtype=torch.int32))
    try:
        for backends_need in (False, True):
            set_cpu_seq_lens_need(lambda: backends_need)
            # SGLang asks for host lengths for any n-gram algorithm; the worker's answer wins
            assert algo.create_future_map(torch.device("cpu"), pool, needs_cpu_seq_lens=True).needs_cpu_seq_lens \
                is backends_need
        set_cpu_seq_lens_need(None)  # no worker in this process: SGLang's decision stands
        assert algo.create_future_map(torch.device("cpu"), pool, needs_cpu_seq_lens=True).needs_cpu_seq_lens
    finally:
        set_cpu_seq_lens_need(None)


def test_scored_rows_are_each_requests_root_and_real_drafts():
    """`scored_rows`: of a verify's bs x width score rows, request i's root and its ``drafted[i]`` real draft
    nodes, in order (what token recycling keeps), the same as listing them request by request."""
    import numpy as np

    from ngramspec_sglang.relay import scored_rows

    rng = np.random.default_rng(0)
    for _ in range(50):
        w = int(rng.integers(1, 17))
        drafted = rng.integers(0, w, int(rng.integers(1, 9)))
        want = np.concatenate([i * w + np.arange(int(d) + 1) for i, d in enumerate(drafted)])
        assert scored_rows(w, drafted).tolist() == want.tolist()
    assert scored_rows(4, [3, 0]).tolist() == [0, 1, 2, 3, 4]

"""`device_drafts`' token table and prompt lookup on the device (torch; run here on the CPU) against a host reference:
rows written from prompts and relayed steps hold each request's committed tokens, and the drafts are the latest
match's continuation."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ngramspec_sglang.device_drafts import DeviceHistory, lookup_reference  # noqa: E402


def replay(seed: int, steps: int, window: int, max_n: int, min_n: int, vocab: int, stride: int = 4):
    """Requests in four slots of six, each step a random batch of them committing 1..stride tokens (the relay's
    rows, some repeated from a step already written, as after a join), then drafts for the batch."""
    rng = np.random.default_rng(seed)
    h = DeviceHistory(6, 400, "cpu", window=window, max_n=max_n, min_n=min_n)
    seqs = {row: rng.integers(0, vocab, int(rng.integers(1, 30))).tolist() for row in (0, 2, 3, 5)}
    h.write_prompts(list(seqs), list(seqs.values()))
    last_step = {}
    for _ in range(steps):
        rows = sorted(rng.choice(list(seqs), size=int(rng.integers(1, 5)), replace=False).tolist())
        toks = torch.zeros((len(rows), stride), dtype=torch.int64)
        lens = torch.zeros(len(rows), dtype=torch.int32)
        for i, row in enumerate(rows):
            if row in last_step and rng.random() < 0.3:  # the relay repeats a row already written
                new = last_step[row]
            else:
                new = rng.integers(0, vocab, int(rng.integers(1, stride + 1))).tolist()
                if len(seqs[row]) + len(new) >= 390:
                    new = new[:1]
                seqs[row] += new
                last_step[row] = new
            toks[i, :len(new)] = torch.tensor(new)
            lens[i] = len(new)
        seq_lens = torch.tensor([len(seqs[r]) - 1 for r in rows])
        h.append(torch.tensor(rows), seq_lens, toks.view(-1), lens)
        k = int(rng.integers(1, 8))
        drafts, found = h.propose(torch.tensor(rows), seq_lens, k)
        for i, row in enumerate(rows):
            assert h.tokens[row, :len(seqs[row])].tolist() == seqs[row]
            want, want_found = lookup_reference(seqs[row], k, max_n, min_n, window)
            assert drafts[i].tolist() == want and bool(found[i]) == want_found, (row, seqs[row][-12:])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), window=st.sampled_from([4, 16, 64, 400]), max_n=st.integers(1, 4),
       vocab=st.sampled_from([2, 5, 50]))
def test_rows_and_drafts_match_the_host_reference(seed, window, max_n, vocab):
    replay(seed, steps=25, window=window, max_n=max_n, min_n=1 if max_n == 1 else 2, vocab=vocab)


def test_a_copied_stretch_is_drafted_on():
    h = DeviceHistory(2, 100, "cpu", window=64)
    text = [5, 6, 7, 8, 9, 10, 11, 3, 4, 5, 6, 7]
    h.write_prompts([1], [text])
    drafts, found = h.propose(torch.tensor([1]), torch.tensor([len(text) - 1]), 4)
    assert bool(found[0]) and drafts[0].tolist() == [8, 9, 10, 11]  # "5 6 7" seen before, then "8 9 10 11"
    drafts, found = h.propose(torch.tensor([0]), torch.tensor([0]), 3)  # one token, nothing to match
    assert not bool(found[0]) and drafts[0].tolist() == [0, 0, 0]


def test_chain_mask_and_bad_sizes():
    h = DeviceHistory(1, 10, "cpu")
    assert h.chain_mask(3).view(3, 3).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    with pytest.raises(ValueError):
        DeviceHistory(0, 10, "cpu")
    with pytest.raises(ValueError):
        DeviceHistory(1, 10, "cpu", max_n=1, min_n=2)


def test_warm_up_runs_every_kernel_and_leaves_the_table_as_it_was():
    """Start-up runs `append` and `propose` at every batch size's power of two and every draft length (so no served
    step pays for loading them) and builds the chain masks; the table is left all zeros."""
    h = DeviceHistory(4, 64, "cpu", window=32)
    calls = []
    append, propose = h.append, h.propose
    h.append = lambda rows, *a: (calls.append(("append", rows.numel())), append(rows, *a))
    h.propose = lambda rows, seq, k: (calls.append(("propose", rows.numel(), k)), propose(rows, seq, k))[1]
    h.warm_up([1, 2, 4, 8], max_bs=5)
    assert {c[1] for c in calls} == {1, 2, 4, 5}
    assert {c[2] for c in calls if c[0] == "propose"} == {1, 3, 7}
    assert set(h._chain) == {2, 4, 8}
    assert int(h.tokens.abs().sum()) == 0

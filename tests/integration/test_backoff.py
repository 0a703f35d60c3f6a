"""The worker's planning back-off (`ngramspec_sglang.backoff.PlanBackoff`), on CPU."""
from types import SimpleNamespace

import pytest

from ngramspec_sglang.backoff import ForwardsChooser, PlanBackoff, plain_forwards


def run(widths_when_planning, steps, max_skipped=3):
    """Which steps plan, given the width each successive plan picks."""
    b, widths, planned = PlanBackoff(max_skipped), iter(widths_when_planning), []
    for step in range(steps):
        if b.skip_planning():
            continue
        planned.append(step)
        b.planned(next(widths))
    return planned


def test_planning_backs_off_while_nothing_is_drafted_and_resumes_on_the_first_draft():
    # plans at 0, then skips 1, 2, 3, then 3 (max) ...
    assert run([1] * 50, 20) == [0, 2, 5, 9, 13, 17]
    # a plan that drafts: every step plans again until plans stop drafting
    assert run([1, 1, 8, 8, 8, 1, 1] + [1] * 20, 16) == [0, 2, 5, 6, 7, 8, 10, 13]


def test_no_backoff_and_bad_arguments():
    assert run([1] * 50, 6, max_skipped=0) == [0, 1, 2, 3, 4, 5]
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError):
            PlanBackoff(bad)


def test_planning_every_step_when_told_not_to_skip():
    b = PlanBackoff()
    for _ in range(5):
        b.planned(1, skip=False)
        assert not b.skip_planning()
    assert b.idle_plans == 5
    b.planned(1)  # the idle run still counts: skipping resumes at its length, capped
    assert [b.skip_planning() for _ in range(4)] == [True, True, True, False]


def test_reset_forgets_the_idle_run():
    b = PlanBackoff()
    for _ in range(5):
        b.planned(1)
    b.reset()
    assert not b.skip_planning() and b.idle_plans == 0


def batch_of(remaining, *, penalties=False, custom=False, masks=None, hidden=False, max_new=100):
    """A duck-typed decode batch whose requests may still generate ``remaining[i]`` tokens."""
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(max_new_tokens=max_new),
                            output_ids=[0] * (max_new - r if max_new is not None else 5)) for r in remaining]
    info = SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=penalties),
                           has_custom_logit_processor=custom, return_sampling_masks=masks)
    return SimpleNamespace(reqs=reqs, sampling_info=info, return_hidden_states=hidden)


def test_plain_forwards_run_up_to_the_limit_and_no_further_than_any_request_may_go():
    assert plain_forwards(4, batch_of([50, 60])) == 4
    assert plain_forwards(4, batch_of([2, 3])) == 3  # the longest remaining budget bounds the chunk
    assert plain_forwards(4, batch_of([1])) == 1
    assert plain_forwards(4, batch_of([0, -2])) == 1  # finished rows still in the batch (overlap): one forward
    assert plain_forwards(1, batch_of([50])) == 1
    assert plain_forwards(8, batch_of([50], max_new=None)) == 8


def test_plain_forwards_only_for_batches_up_to_the_limit():
    assert plain_forwards(4, batch_of([50]), max_batch=1) == 4
    assert plain_forwards(4, batch_of([50, 50]), max_batch=1) == 1
    assert plain_forwards(4, batch_of([50, 50]), max_batch=2) == 4


@pytest.mark.parametrize("state", [dict(penalties=True), dict(custom=True), dict(masks=[False, True]),
                                   dict(hidden=True)])
def test_one_forward_where_a_later_forward_would_need_host_state_the_chunk_skips(state):
    assert plain_forwards(4, batch_of([50, 50], **state)) == 1
    assert plain_forwards(4, batch_of([50, 50], masks=[False, False])) == 4


def _choose(single_ms, chunk_ms, steps=80, **kw):
    """Drive a ForwardsChooser at batch size 1 as the worker does: each plain step takes the limit it gives, and its
    period per forward (single or chunked) comes back as a sample. Returns the forwards of every step."""
    c, seen = ForwardsChooser(4, 1, samples=3, revisit=20, **kw), []
    for _ in range(steps):
        f = c.forwards_limit(1)
        c.stepped(1, f)
        c.observe(1, f, (single_ms if f == 1 else chunk_ms) / 1e3)
        seen.append(f)
    return c, seen


def test_auto_forwards_chunk_only_where_a_forward_costs_less_chunked():
    # host-bound model: a chunk of 4 forwards costs 0.5 ms a forward against 2 ms alone -> chunks after exploring
    c, seen = _choose(2.0, 0.5)
    assert seen[:6] == [4, 4, 4, 1, 1, 1] and c.chunked(1)
    assert seen[6:26].count(4) == 20 and seen[26:29] == [1, 1, 1]  # revisits the single arm after `revisit` steps
    # GPU-bound model: chunks cost as much per forward (here 2% more) -> one forward per step, chunks only to revisit
    c, seen = _choose(4.6, 4.7)
    assert seen[:6] == [4, 4, 4, 1, 1, 1] and not c.chunked(1)
    assert seen[6:26] == [1] * 20 and seen[26:29] == [4, 4, 4]
    # within the margin (5% cheaper, margin 10%): not worth delaying drafts for
    assert not _choose(4.0, 3.8)[0].chunked(1)
    # summary for the profile
    assert _choose(2.0, 0.5)[0].summary()["1"]["chunked"] is True


def test_auto_forwards_follow_a_change_of_cost_and_leave_larger_batches_alone():
    c = ForwardsChooser(4, 1, samples=3, revisit=10)
    for f, ms in [(4, 1.0), (4, 1.0), (4, 1.0), (1, 2.0), (1, 2.0), (1, 2.0)]:
        c.observe(1, f, ms / 1e3)
    assert c.chunked(1)
    c.observe(1, 4, 3.0 / 1e3)  # chunks become dear (the same samples every rank gets): one slow chunk is noise,
    assert c.chunked(1)
    c.observe(1, 4, 3.0 / 1e3)  # most of the last `samples` is a change of cost
    assert not c.chunked(1)
    assert c.forwards_limit(2) == 1  # above max_batch
    c.observe(2, 4, 0.1)  # ignored
    assert "2" not in c.summary()
    assert ForwardsChooser(1, 1).forwards_limit(1) == 1
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError):
            ForwardsChooser(bad, 1)


def test_auto_forwards_a_lone_slow_single_forward_does_not_buy_chunks():
    """A large model: one forward costs what a chunk's forward does (6.5 ms), and one single step among them stalled
    (13.7 ms, as seen at 8B cost). A mean of the single steps would put a chunk's forward 10% below one alone; the
    median keeps one forward per step."""
    c = ForwardsChooser(4, 16, samples=6, revisit=100)
    for ms in (6.5, 6.6, 6.5, 6.6, 6.5, 6.5):
        c.observe(16, 4, ms / 1e3)
    for ms in (6.6, 6.7, 13.7, 6.6, 6.7, 6.6):
        c.observe(16, 1, ms / 1e3)
    assert not c.chunked(16)
    assert c.summary()["9-16"]["single_ms"] == 6.65
    mean = sum((6.6, 6.7, 13.7, 6.6, 6.7, 6.6)) / 6
    assert 6.5 < 0.9 * mean  # what a mean would have chosen: chunks


def test_auto_forwards_share_one_arm_per_batch_size_bucket():
    """A batch's size drifts as its requests end: sizes 9-16 share what was measured, 5-8 explore anew."""
    assert [ForwardsChooser.bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 48)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 64]
    c = ForwardsChooser(4, 48, samples=2, revisit=10)
    for b, f, ms in [(16, 4, 1.0), (13, 4, 1.0), (15, 1, 2.0), (9, 1, 2.0)]:
        c.observe(b, f, ms / 1e3)
    assert all(c.chunked(b) for b in range(9, 17))
    assert c.forwards_limit(12) == 4
    assert c.forwards_limit(8) == 4 and c.forwards_limit(48) == 4  # unmeasured buckets explore, chunked first
    for b, f, ms in [(8, 4, 3.0), (7, 4, 3.0), (6, 1, 2.0), (5, 1, 2.0)]:
        c.observe(b, f, ms / 1e3)
    assert not c.chunked(6) and c.chunked(16)  # each bucket decides on its own samples
    assert c.forwards_limit(49) == 1  # above max_batch
    assert set(c.summary()) == {"9-16", "5-8"}



def _drive(c, batch_size, single_ms, chunk_ms, steps):
    seen = []
    for _ in range(steps):
        f = c.forwards_limit(batch_size)
        c.stepped(batch_size, f)
        c.observe(batch_size, f, (single_ms if f == 1 else chunk_ms) / 1e3)
        seen.append(f)
    return seen


def test_a_bucket_starts_from_the_choice_a_decided_bucket_made():
    """GPU-bound (an 8B model): batch 1 measured that chunks cost as much per forward, so batches of 9-16 start from
    one forward and try chunks only at their first revisit, instead of exploring them first."""
    c = ForwardsChooser(4, 48, samples=3, revisit=20, first_revisit=20)
    _drive(c, 1, 6.3, 6.3, 10)
    assert not c.chunked(1)
    seen = _drive(c, 16, 6.8, 6.8, 30)
    assert seen[:23] == [1] * 23 and seen[23:26] == [4, 4, 4]  # `revisit` steps after its singles were measured
    assert not c.chunked(12) and c.summary()["9-16"]["chunked_n"] == 3
    # host-bound (a 135M model): batch 1 found chunks pay, so batches of 9-16 start chunked and measure single
    # forwards at their first revisit; then they decide on their own samples
    c = ForwardsChooser(4, 48, samples=3, revisit=20, first_revisit=20)
    _drive(c, 1, 2.0, 0.5, 10)
    seen = _drive(c, 16, 2.3, 0.6, 30)
    assert seen[:23] == [4] * 23 and seen[23:26] == [1, 1, 1] and seen[26:] == [4] * 4
    assert c.summary()["9-16"]["single_n"] == 3 and c.chunked(16)
    # where the choice does not hold (chunks pay at batch 1, not at 16) it holds only until the first revisit,
    # `first_revisit` plain steps, sooner than later ones
    c = ForwardsChooser(4, 48, samples=3, revisit=100, first_revisit=10)
    _drive(c, 1, 2.0, 0.5, 10)
    seen = _drive(c, 16, 6.5, 6.4, 40)
    assert seen[:13] == [4] * 13 and seen[13:16] == [1, 1, 1] and seen[16:] == [1] * 24
    assert not c.chunked(16)


def test_a_draining_batch_explores_chunks_in_its_first_bucket_only():
    """An 8B model's batch of 16 drains to 1 as its requests end: the 9-16 bucket measures both arms, finds that
    chunks do not pay, and the smaller buckets the batch passes through run one forward per step from the start
    (each would otherwise spend `samples` plain steps on chunks, every one of them a step that does not draft)."""
    c = ForwardsChooser(4, 48, samples=3, revisit=100)
    assert _drive(c, 16, 6.6, 6.5, 10) == [4, 4, 4, 1, 1, 1, 1, 1, 1, 1]
    for bs in (8, 4, 2, 1):
        assert _drive(c, bs, 6.3, 6.3, 10) == [1] * 10
    assert all(arm["chunked_n"] == 0 for b, arm in c.summary().items() if b != "9-16")

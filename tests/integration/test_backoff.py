"""The worker's planning back-off (`ngramspec_sglang.backoff.PlanBackoff`), on CPU."""
from types import SimpleNamespace

import pytest

from ngramspec_sglang.backoff import PlanBackoff, plain_forwards


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

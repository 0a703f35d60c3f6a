"""The worker's planning back-off (`ngramspec_sglang.backoff.PlanBackoff`), on CPU."""
import pytest

from ngramspec_sglang.backoff import PlanBackoff


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

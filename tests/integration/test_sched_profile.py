"""The diagnostic files' writer thread (`ngramspec_sglang.sched_profile.dump_periodically`), on CPU."""
import time

from ngramspec_sglang.sched_profile import dump_periodically


def test_dumps_while_the_count_changes_and_retries_after_a_failure():
    state = {"n": 0, "dumps": 0, "fail": True}

    def dump():
        if state["fail"]:
            state["fail"] = False
            raise RuntimeError("dictionary changed size during iteration")
        state["dumps"] += 1

    dump_periodically(lambda: state["n"], dump, "test-dumper", period_s=0.01)
    deadline = time.time() + 5
    while state["dumps"] < 1 and time.time() < deadline:  # the first tick fails, a later one writes
        time.sleep(0.01)
    assert state["dumps"] == 1
    time.sleep(0.1)
    assert state["dumps"] == 1  # nothing changed: no rewrite
    state["n"] = 5
    deadline = time.time() + 5
    while state["dumps"] < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert state["dumps"] == 2

"""The diagnostic files' writer thread (`ngramspec_sglang.sched_profile.dump_periodically`), on CPU."""
import json
import threading
import time

from ngramspec_sglang.sched_profile import dump_periodically, write_json


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


def test_two_writers_and_a_reader_only_ever_see_whole_files(tmp_path):
    """The periodic dump and a final dump may write the same file at once (the CPU worker scenario failed on a file
    left with two dumps in it); a reader meanwhile must never see half of one."""
    path = str(tmp_path / "profile.json")
    write_json(path, {})
    bad, stop = [], threading.Event()

    def writer(size):
        for i in range(300):
            write_json(path, {"rows": list(range(size + i % 7))})

    def reader():
        while not stop.is_set():
            try:
                with open(path) as f:
                    json.load(f)
            except json.JSONDecodeError as e:
                bad.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in (50, 4000)]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    r.join()
    with open(path) as f:
        assert len(json.load(f)["rows"]) >= 50
    assert not bad
    assert not list(tmp_path.glob("*.tmp"))  # every writer's own file was renamed into place

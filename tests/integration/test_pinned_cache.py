"""`pinned_cache_mb` (`ngramspec_sglang.pinned_cache.PinnedCacheCap`): torch's cached pinned host memory kept under a
cap, on CPU with a model of torch's host allocator."""
import pytest

from ngramspec_sglang.config import DEFAULT_PINNED_CACHE_MB, AdaptiveConfig, resolve_config
from ngramspec_sglang.pinned_cache import MB, PinnedCacheCap


class HostAllocator:
    """torch's caching host allocator as its counts show it: blocks in use and blocks cached for reuse, never
    returned until emptied."""

    def __init__(self):
        self.active = 0
        self.free = {}  # block size -> cached blocks of that size
        self.empties = 0

    @property
    def cached(self):
        return sum(size * n for size, n in self.free.items())

    def alloc(self, nbytes):
        size = 1 << (nbytes - 1).bit_length()  # a power of two, as torch rounds; a cached block of that size is reused
        if self.free.get(size):
            self.free[size] -= 1
        self.active += size
        return size

    def release(self, size):
        self.active -= size
        self.free[size] = self.free.get(size, 0) + 1

    def stats(self):
        return {"allocated_bytes.current": self.active + self.cached, "active_bytes.current": self.active}

    def empty(self):
        self.empties += 1
        self.free = {}


def cap(limit_mb=64, every=4):
    a = HostAllocator()
    return a, PinnedCacheCap(limit_mb, a.stats, a.empty, every=every)


def test_nothing_is_returned_under_the_cap():
    a, c = cap()
    a.release(a.alloc(40 * MB))
    assert not any(c.step() for _ in range(100))
    assert a.empties == 0 and a.cached == 64 * MB  # 40 MB rounds up to a 64 MB block: at the cap, kept


def test_unused_blocks_over_the_cap_go_back_at_the_next_check_and_blocks_in_use_stay():
    a, c = cap(limit_mb=16, every=4)
    in_use = a.alloc(8 * MB)
    a.release(a.alloc(32 * MB))
    results = [c.step() for _ in range(4)]
    assert results == [False, False, False, True]  # checked every 4th step only
    assert a.cached == 0 and a.active == in_use == 8 * MB
    assert c.trims == 1 and c.returned_bytes == 32 * MB
    assert not c.step() and not any(c.step() for _ in range(8))  # nothing left over the cap: no more trims


def test_a_flush_returns_every_unused_block_and_an_empty_cache_is_left_alone():
    a, c = cap(limit_mb=64)
    assert not c.trim(force=True) and a.empties == 0
    a.release(a.alloc(2 * MB))
    assert c.trim(force=True) and a.cached == 0


def bitmask_steps(c, a, steps=3000):
    """A verify's buffer per step, batch x width rows of 6 KB, batch and width cycling through their ranges (every
    size class of blocks comes back again and again). Returns what stayed cached after each step."""
    after = []
    for step in range(steps):
        batch, width = 1 + (step * 7) % 48, (1, 2, 4, 8, 16)[step % 5]
        a.release(a.alloc(6144 * batch * width))
        if c is not None:
            c.step()
        after.append(a.cached)
    return after


def test_the_cache_is_back_under_the_cap_at_every_check():
    uncapped = HostAllocator()
    grown = bitmask_steps(None, uncapped)[-1]
    assert grown > 8 * MB  # without a cap every size class stays cached: 8+4+2+1 MB and the small ones
    a, c = cap(limit_mb=2, every=8)
    after = bitmask_steps(c, a)
    checks = after[7::8]  # right after each check
    assert c.trims > 0 and max(checks) <= 2 * MB
    assert max(after) < grown  # between checks it regrows only what 7 steps allocate


class DriftingCount(HostAllocator):
    """torch's host allocator as a GPU soak showed its counts: the in-use count grows at every allocation and never
    falls (759 MB "in use" against 172 MB held)."""

    def __init__(self):
        super().__init__()
        self.counted = 0

    def alloc(self, nbytes):
        size = super().alloc(nbytes)
        self.counted += size
        return size

    def stats(self):
        return {"allocated_bytes.current": self.active + self.cached, "active_bytes.current": self.counted}


def test_an_in_use_count_that_only_grows_does_not_stop_the_cap():
    a = DriftingCount()
    c = PinnedCacheCap(16, a.stats, a.empty, every=4)
    in_use = a.alloc(8 * MB)
    for _ in range(3):
        a.release(a.alloc(32 * MB))  # the same cached block each time, counted as in use each time
    assert a.stats()["active_bytes.current"] > a.stats()["allocated_bytes.current"]
    assert [c.step() for _ in range(4)] == [False, False, False, True]
    assert a.cached == 0 and a.active == in_use and c.returned_bytes == 32 * MB
    assert not any(c.step() for _ in range(8))  # what the trim left is in use: nothing over the cap since
    a.release(a.alloc(32 * MB))
    assert [c.step() for _ in range(4)] == [False, False, False, True] and a.active == in_use


def test_before_any_trim_nothing_is_taken_as_in_use_and_the_first_trim_learns_it():
    a, c = cap(limit_mb=16, every=1)
    a.alloc(64 * MB)  # in use, nothing cached
    assert c.step() and c.returned_bytes == 0  # one trim that returns nothing
    assert not any(c.step() for _ in range(8))  # then it knows the 64 MB are in use


def test_missing_counts_read_as_nothing_cached():
    c = PinnedCacheCap(0, dict, lambda: pytest.fail("emptied without counts"), every=1)
    assert c.cached_bytes() == 0 and not c.step()


def test_config_default_null_and_bad_values():
    assert AdaptiveConfig(widths=(1, 2, 4)).pinned_cache_mb == DEFAULT_PINNED_CACHE_MB == 64
    assert AdaptiveConfig(widths=(1, 2, 4), pinned_cache_mb=None).pinned_cache_mb is None
    assert AdaptiveConfig(widths=(1, 2, 4), pinned_cache_mb=0).pinned_cache_mb == 0
    for bad in (-1, True, "64", float("inf"), float("nan")):
        with pytest.raises(ValueError, match="pinned_cache_mb"):
            AdaptiveConfig(widths=(1, 2, 4), pinned_cache_mb=bad)
    assert PinnedCacheCap.for_torch(None) is None


def test_the_config_file_key_reaches_the_config(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('{"pinned_cache_mb": null}')

    class Args:
        speculative_num_draft_tokens = 8
        speculative_adaptive_config = str(path)

    assert resolve_config(Args()).pinned_cache_mb is None
    path.write_text("{}")
    assert resolve_config(Args()).pinned_cache_mb == 64


def test_without_cuda_there_is_no_cap():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert PinnedCacheCap.for_torch(64) is None


def test_counts_for_the_gauges_say_what_is_held_what_is_in_use_and_how_often_it_trimmed():
    a, c = cap(limit_mb=16, every=1)
    in_use = a.alloc(8 * MB)
    a.release(a.alloc(32 * MB))
    assert c.counts() == {"allocated_mb": 40.0, "active_mb": 8.0, "trims": 0.0}
    c.step()
    assert c.counts() == {"allocated_mb": 8.0, "active_mb": 8.0, "trims": 1.0} and in_use == 8 * MB


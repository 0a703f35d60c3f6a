"""`draft_max_batch`: verify graphs captured only up to it (`capped_capture_sizes`), the controller and the planner
drafting only up to it."""
import numpy as np
import pytest

pytest.importorskip("sglang")


def _bag(bs):
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig
    from sglang.srt.runtime_context import _ConfigBag

    bag = _ConfigBag("exec.graph")
    cfg = CudaGraphConfig()
    cfg.decode = PhaseConfig(backend=cfg.decode.backend, max_bs=max(bs) if bs else None, bs=bs)
    bag._set("cuda_graph_config", cfg)
    return bag


def test_capture_sizes_are_capped_inside_the_scope_only():
    from ngramspec_sglang.graph_sizes import capped_capture_sizes

    sizes = list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4)) + list(range(72, 257, 8))
    bag = _bag(sizes)
    with capped_capture_sizes(bag, 48):
        assert bag.cuda_graph_config.decode.bs == [s for s in sizes if s <= 48]
        assert bag.cuda_graph_config.decode.max_bs == 48
    assert bag.cuda_graph_config.decode.bs == sizes and bag.cuda_graph_config.decode.max_bs == 256
    with capped_capture_sizes(bag, 50):  # not a size of the list: added, so batches of 49-50 have a graph
        assert bag.cuda_graph_config.decode.bs[-2:] == [48, 50]
    with capped_capture_sizes(bag, 1000):  # above the list: unchanged
        assert bag.cuda_graph_config.decode.bs == sizes
    with capped_capture_sizes(bag, None):
        assert bag.cuda_graph_config.decode.bs == sizes
    unresolved = _bag(None)
    with capped_capture_sizes(unresolved, 48):
        assert unresolved.cuda_graph_config.decode.bs is None


def test_no_batch_above_draft_max_batch_drafts():
    """The adaptive controller gets `max_draft_batch` from the config; a fixed width is cut to plain decoding by
    the planner above it; at or below it both draft as before."""
    from ngramspec_sglang.config import AdaptiveConfig
    from ngramspec_sglang.drafting import DraftPlanner, RequestView, make_controller

    with pytest.raises(ValueError, match="draft_max_batch"):
        AdaptiveConfig(widths=(1, 2, 4), draft_max_batch=0)
    assert make_controller(AdaptiveConfig(widths=(1, 2, 4), draft_max_batch=3)).max_draft_batch == 3
    assert make_controller(AdaptiveConfig(widths=(1, 2, 4))).max_draft_batch == 48  # the default
    assert make_controller(AdaptiveConfig(widths=(1, 2, 4), draft_max_batch=None)).max_draft_batch is None
    text = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3] * 3
    for limit, batch, drafts in ((2, 3, False), (3, 3, True), (None, 3, True)):
        p = DraftPlanner(AdaptiveConfig(widths=(1, 2, 4, 8), fixed_width=8, capacity=1 << 16,
                                        draft_max_batch=limit))
        views = [RequestView(i, text, text[:5]) for i in range(batch)]
        p.plan(views)
        plan = p.plan([RequestView(i, text, text[:6]) for i in range(batch)])
        assert (plan.width > 1 and np.asarray(plan.drafted).max() > 0) == drafts, (limit, batch)

"""The controller's optional logistic acceptance predictor and the request's copy run it reads."""
import numpy as np
import pytest
from test_controller_state import _records, run, seed_cost

from ngramspec import NgramCache
from ngramspec.controller import AdaptiveController
from ngramspec.controller.calibration import N_LOGIT


def test_predictor_knob_is_checked():
    with pytest.raises(ValueError, match="predictor"):
        AdaptiveController(predictor="forest")
    assert AdaptiveController().calibration.logit_w.shape == (0,)
    assert AdaptiveController(predictor="logistic").calibration.logit_w.shape == (N_LOGIT,)


def test_logistic_starts_as_the_beta_estimate_and_then_learns():
    """Before any outcome the correction is the identity (up to clipping P into [1e-4, 1 - 1e-4]); it moves once
    drafts are decided, and the Beta counts it corrects are the same as the Beta predictor's."""
    beta, logi = AdaptiveController(prior=seed_cost), AdaptiveController(prior=seed_cost, predictor="logistic")
    cache = NgramCache(max_depth=12)
    for ctl in (beta, logi):
        ctl.start("x")
    cache.start_request("x", [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3])
    drafts = cache.propose(["x"], 15)
    (pb, cb), (pl, cl) = beta.node_values(["x"], drafts), logi.node_values(["x"], drafts)
    assert len(pb) > 3 and np.array_equal(cb, cl) and np.allclose(pb, pl, rtol=1e-3)
    logi.finish("x")
    w0 = logi.calibration.logit_w.copy()
    run([logi], _records(5, n=4))
    assert not np.array_equal(logi.calibration.logit_w, w0)
    assert np.isfinite(logi.calibration.logit_w).all()


def test_copy_run_counts_predicted_tokens_and_resets_on_a_miss():
    ctl = AdaptiveController(prior=seed_cost)
    cache = NgramCache(max_depth=12)
    passage = list(range(100, 140))
    cache.start_request(0, passage + [7, 8, 9])
    ctl.start(0)
    run_of = []
    for tokens in ([passage[0]], passage[1:4], passage[4:5], [999], passage[:3]):
        drafts, plan = ctl.step(cache, [0], [tokens])
        run_of.append(int(ctl._pend.run[ctl._slot_of[0]]))
    # first call: no pending draft before it (nothing predicted its token); then 3 and 1 predicted tokens; then
    # a token the pending drafts got wrong; then tokens after an unseen one (no draft predicted them)
    assert run_of == [0, 3, 4, 0, 0]
    ctl.finish(0)
    ctl.start(1)
    assert ctl._pend.run[ctl._slot_of[1]] == 0


def test_logistic_state_round_trip_and_cross_loading(tmp_path):
    logi = AdaptiveController(prior=seed_cost, predictor="logistic")
    run([logi], _records(6, n=4))
    path = tmp_path / "s.npz"
    logi.save_state(path)
    saved = logi.state_dict()
    again = AdaptiveController(prior=seed_cost, predictor="logistic")
    again.load_state(path)
    for a, b in zip(logi.calibration, again.calibration):
        assert np.array_equal(a, b)
    assert run([logi], _records(7, n=3), rid0=50) == run([again], _records(7, n=3), rid0=50)
    # a Beta controller takes the counts of a logistic state, and a logistic one starts its correction afresh
    # from a Beta state (or from a state written before the correction existed)
    beta = AdaptiveController(prior=seed_cost)
    beta.load_state(path)
    assert np.array_equal(beta.calibration.succ, saved["cal_succ"]) and beta.calibration.logit_w.shape == (0,)
    state = beta.state_dict()
    fresh = AdaptiveController(prior=seed_cost, predictor="logistic")
    run([fresh], _records(8, n=2))
    fresh.load_state_dict(state)
    assert fresh.calibration.logit_w[-1] == 1.0 and not fresh.calibration.logit_w[:-1].any()
    old_format = {k: v for k, v in saved.items() if not k.startswith("cal_logit")}
    fresh.load_state_dict(old_format)
    assert np.array_equal(fresh.calibration.succ, saved["cal_succ"])
    bad = logi.state_dict()
    bad["cal_logit_w"] = np.full(N_LOGIT, np.nan)
    with pytest.raises(ValueError, match="non-finite"):
        again.load_state_dict(bad)

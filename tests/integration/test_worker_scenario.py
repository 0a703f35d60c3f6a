"""NgramAdaptiveWorker's own decode-step code on CPU around a scripted model (`worker_scenario.py`, in a subprocess:
it stubs a CUDA-only package to import the worker). Lossless whatever the path, and the verify prepared before the
wait (`preplan`) reads the drafts, positions and mask written after it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")
from ngramspec_sglang.config import AdaptiveConfig  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_server]  # the worker imports sglang's server modules
SCENARIO = Path(__file__).with_name("worker_scenario.py")
CONFIGS = {
    "defaults": {"widths": [1, 2, 4, 8, 16]},
    "preplan": {"widths": [1, 2, 4, 8, 16], "preplan": True},
    "preplan_chain": {"widths": [1, 2, 4, 8, 16], "preplan": True, "tree": False},
    "fixed16": {"widths": [1, 2, 4, 8, 16], "fixed_width": 16},
    "fixed16_preplan": {"widths": [1, 2, 4, 8, 16], "fixed_width": 16, "preplan": True},
    "abort_preplan": {"widths": [1, 2, 4, 8, 16], "preplan": True},
    "abort_fixed16_preplan": {"widths": [1, 2, 4, 8, 16], "fixed_width": 16, "preplan": True},
    "join": {"widths": [1, 2, 4, 8, 16]},
    "join_preplan": {"widths": [1, 2, 4, 8, 16], "preplan": True},
    "join_fixed16_preplan": {"widths": [1, 2, 4, 8, 16], "fixed_width": 16, "preplan": True},
    "fail_load": {"widths": [1, 2, 4, 8, 16], "fixed_width": 16, "preplan": True},
    "fail_replay": {"widths": [1, 2, 4, 8, 16], "fixed_width": 16, "preplan": True},
}
FAIL = {"fail_load": ("load", 6), "fail_replay": ("replay", 6)}  # what raises, from which step on
CONFIGS.update({"logprobs": {"widths": [1, 2, 4, 8, 16]}, "logprobs_preplan": {"widths": [1, 2, 4, 8, 16],
                                                                               "preplan": True}})
LOGPROB_EVERY = {"logprobs": 3, "logprobs_preplan": 3}  # every third step a request of the batch wants logprobs
CONFIGS.update({"recycle": {"widths": [1, 2, 4, 8, 16], "recycle": True},
                "recycle_fixed16_preplan": {"widths": [1, 2, 4, 8, 16], "fixed_width": 16, "preplan": True,
                                            "recycle": True, "recycle_min_match": 3}})
# widths up to 64 with recycling's 64-node trees (the paper's shape)
CONFIGS.update({"recycle64": {"widths": [1, 2, 4, 8, 16, 32, 64], "recycle": True, "recycle_min_match": 3,
                              "recycle_branching": [4, 2, 2, 1, 1, 1]},
                "recycle64_fixed_preplan": {"widths": [1, 2, 4, 8, 16, 32, 64], "fixed_width": 64, "preplan": True,
                                            "recycle": True, "recycle_min_match": 3,
                                            "recycle_branching": [4, 2, 2, 1, 1, 1]}})
RECYCLE = ("recycle", "recycle_fixed16_preplan", "recycle64", "recycle64_fixed_preplan")
# draft_max_batch 2 with three requests: plain steps while all three run, drafting once one has left
CONFIGS.update({"dmb2": {"widths": [1, 2, 4, 8, 16], "draft_max_batch": 2},
                "dmb2_fixed16_preplan": {"widths": [1, 2, 4, 8, 16], "fixed_width": 16, "preplan": True,
                                         "draft_max_batch": 2}})
ABORT_AT_DMB = {"dmb2": 9, "dmb2_fixed16_preplan": 5}
# the step the second request leaves
ABORT_AT = {"abort_preplan": 9, "abort_fixed16_preplan": 5, "device_abort": 9, **ABORT_AT_DMB}
CONFIGS.update({"sync": {"widths": [1, 2, 4, 8, 16]}, "sync_fixed16": {"widths": [1, 2, 4, 8, 16],
                                                                       "fixed_width": 16}})
CONFIGS.update({"device": {"widths": [1, 2, 4, 8, 16], "device_drafts": 1},
                "device3": {"widths": [1, 2, 4, 8, 16], "device_drafts": 3},
                "device_fixed16": {"widths": [1, 2, 4, 8, 16], "fixed_width": 16, "device_drafts": 2},
                "device_join": {"widths": [1, 2, 4, 8, 16], "device_drafts": 3},
                "device_abort": {"widths": [1, 2, 4, 8, 16], "device_drafts": 3}})
DEVICE = ("device", "device3", "device_fixed16", "device_join", "device_abort")
SYNC_FROM = {"sync": 0, "sync_fixed16": 20}  # from this step on, batches run synchronously (a grammar's)
# the step a fourth request joins before
JOIN_AT = {"join": 12, "join_preplan": 12, "join_fixed16_preplan": 6, "device_join": 12}
# verifies that sample (SGLang's sampled tree verification, its torch version), with and without preplan, with a
# request joining and one leaving: the paths of a server's sampled traffic
CONFIGS.update({"sampled": {"widths": [1, 2, 4, 8, 16]},
                "sampled_preplan": {"widths": [1, 2, 4, 8, 16], "preplan": True},
                "sampled_join_preplan": {"widths": [1, 2, 4, 8, 16], "preplan": True},
                "sampled_abort_preplan": {"widths": [1, 2, 4, 8, 16], "preplan": True},
                "sampled_nograph_preplan": {"widths": [1, 2, 4, 8, 16], "preplan": True}})
SAMPLED = ("sampled", "sampled_preplan", "sampled_join_preplan", "sampled_abort_preplan", "sampled_nograph_preplan")
GRAPH_MAX_TOKENS = {"sampled_nograph_preplan": 12}  # verifies of three requests wider than 4 run without a graph
JOIN_AT["sampled_join_preplan"] = 12
ABORT_AT["sampled_abort_preplan"] = 9
# planning while plans draft nothing: never skipped, or skipped after idle plans whatever they cost
CONFIGS.update({"backoff_never": {"widths": [1, 2, 4, 8, 16], "plan_backoff": False},
                "backoff_always": {"widths": [1, 2, 4, 8, 16], "plan_backoff": True}})
# `preplan` "auto" where it is measured not to pay: the worker prepares nothing before the wait
CONFIGS.update({"preplan_auto_dear": {"widths": [1, 2, 4, 8, 16], "preplan": "auto"},
                "preplan_auto_sync1": {"widths": [1, 2, 4, 8, 16], "fixed_width": 16, "preplan": "auto",
                                       "tp_sync_interval": 1}})
PREPLAN_PAYS = {"preplan_auto_dear": False}
# every configuration but "defaults" says whether it prepares verifies before the wait ("defaults": the worker's own)
for _name, _config in CONFIGS.items():
    if _name != "defaults":
        _config.setdefault("preplan", False)
# paths that need drafts at batch sizes 2-3: on this CPU model, chunked plain steps cost so little per forward that
# the controller would rightly draft nothing there, so their plain steps run one forward
for _name in ("recycle", "recycle64", "dmb2", "sampled_nograph_preplan"):
    CONFIGS[_name]["plain_forwards_max_batch"] = 1
# a request leaving a batch whose plain steps run several forwards (the defaults, without preplan)
CONFIGS["abort"] = {"widths": [1, 2, 4, 8, 16], "preplan": False}
ABORT_AT["abort"] = 9


@pytest.fixture(scope="module")
def results():
    runs = [[c, {"abort_at": ABORT_AT.get(name), "join_at": JOIN_AT.get(name),
                 "logprob_every": LOGPROB_EVERY.get(name, 0), "sync_from": SYNC_FROM.get(name),
                 "sampled": name in SAMPLED, "graph_max_tokens": GRAPH_MAX_TOKENS.get(name),
                 "preplan_pays": PREPLAN_PAYS.get(name),
                 **({"fail": FAIL[name][0], "fail_at": FAIL[name][1]} if name in FAIL else {})}]
            for name, c in CONFIGS.items()]
    return dict(zip(CONFIGS, _run(runs)))


def _run(runs: list) -> list:
    proc = subprocess.run([sys.executable, str(SCENARIO), json.dumps(runs)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_split_kv_verify_reaches_every_width_and_prefill_keeps_the_start_up_backend():
    """SGLang captures the largest width's verify graphs when it starts the model, before the worker exists: with
    `split_kv_verify` (on by default) that width gets a backend and graphs of its own through the split kernel, like
    every other width; prefill stays on the start-up backend. Off, or on a backend without the Triton backend's hook,
    the kernel is not built and the largest width runs on the start-up state."""
    widths = [1, 2, 4, 8, 16]
    proc = subprocess.run([sys.executable, str(SCENARIO), "startup", json.dumps(
        [{"widths": widths, "split_kv_verify": False}, {"widths": widths},
         {"widths": widths, "_triton": False}])],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    off, on, other = json.loads(proc.stdout.strip().splitlines()[-1])
    for state in (off, other):
        assert state["widths"]["16"] == state["prefill"] == {"backend": "startup", "graphs": "startup graphs",
                                                             "split": False}
        assert not any(w["split"] for w in state["widths"].values())
        assert not state["kernel_built"]
    assert set(on["widths"]) == set(map(str, widths)) and on["kernel_built"]
    for state in on["widths"].values():
        assert state == {"backend": "new", "graphs": "graphs of new", "split": True}
    assert on["prefill"]["backend"] == "startup" and on["prefill"]["graphs"] == "startup graphs"


def test_the_profiles_views_read_nothing_while_a_flush_replaces_the_planner():
    """`NGRAMSPEC_PROFILE`'s dump thread reads the planner's live state beside the scheduler; during a cache flush
    the worker holds no planner for a moment: the views read None there and the dump goes through."""
    proc = subprocess.run([sys.executable, str(SCENARIO), "views"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    views = json.loads(proc.stdout.strip().splitlines()[-1])
    assert views == {"forwards": None, "stats": None, "preplan": None, "sources": {}}


def test_the_length_check_reports_host_lengths_that_lag_the_device():
    """`NGRAMSPEC_CHECK_LENS` (on in the scenario) against a fault put in on purpose: the worker forgets which
    requests the last forward ran, so it leaves their relayed tokens out and its lengths lag the device's."""
    [r] = _run([[{"widths": [1, 2, 4, 8, 16], "fixed_width": 4}, {"forget_relay_at": 7}]])
    assert r["lens_reports"] >= 1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_output_equals_the_models_greedy_tokens(results, name):
    r = results[name]
    assert r["outputs_equal_truth"] and r["preplan_failed"] == (name in FAIL)
    assert r["histories_ok"]  # the drafting cache saw each request's tokens once, in order, every step
    assert r["verifies"] > 0  # copy-heavy requests: the worker drafted
    assert r["profile_steps"] == r["steps"]  # NGRAMSPEC_PROFILE saw every decode step
    preplan = CONFIGS[name].get("preplan", AdaptiveConfig.preplan)
    assert (r["preplan_s"] > 0) == (preplan is True or (preplan == "auto" and PREPLAN_PAYS.get(name, True)))


def test_plain_steps_of_several_requests_run_several_forwards_and_stay_exact(results):
    """`plain_forwards` "auto" measures chunks at every batch size up to `plain_forwards_max_batch` (48 by default):
    the three-request batches of these runs take chunked plain steps, a request leaving or joining included."""
    for name in ("defaults", "abort", "join"):
        r = results[name]
        assert r["outputs_equal_truth"] and max(r["chunked_sizes"]) >= 3, (name, r["chunked_sizes"])
    assert results["recycle"]["chunked_sizes"] in ([], [1])  # plain_forwards_max_batch 1


@pytest.mark.parametrize("name", list(ABORT_AT))
def test_a_request_that_leaves_mid_run_is_released_and_the_others_stay_exact(results, name):
    r = results[name]
    assert r["aborted"] == ["r1"] and r["lengths"][1] < r["lengths"][0] == r["lengths"][2] == 160
    assert r["outputs_equal_truth"]  # r1's tokens so far are right too
    assert "r1" not in r["tracked_after"]  # the planner let it go (as every request that left the batch)


@pytest.mark.parametrize("name", list(JOIN_AT))
def test_a_request_that_joins_mid_run_decodes_exactly(results, name):
    r = results[name]
    assert r["joined"] == ["r0", "r1", "r2", "r3"] and r["lengths"] == [160] * 4 and r["outputs_equal_truth"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_host_lengths_lent_to_a_verify_match_the_device(results, name):
    """A verify not prepared before the wait lends the batch host lengths counted from the tokens it waited for;
    they must be the KV lengths on the device (after a join, only the new request's relayed token is new)."""
    r = results[name]
    unprepared = r["verifies"] - r["prepared_verifies"]
    assert len(r["host_lens_checks"]) == unprepared and all(r["host_lens_checks"])
    assert r["lens_reports"] == 0  # NGRAMSPEC_CHECK_LENS (on in the scenario) found every verify's lengths right


@pytest.mark.parametrize("name", ["preplan", "preplan_chain", "fixed16_preplan", "abort_preplan",
                                  "abort_fixed16_preplan", "join_preplan", "join_fixed16_preplan", "sampled_preplan",
                                  "sampled_join_preplan", "sampled_abort_preplan"])
def test_prepared_verifies_run_and_read_what_was_written_after_the_wait(results, name):
    r = results[name]
    used = r["preplan"].get("used", 0) + r["preplan"].get("fitted", 0)
    assert used > 0 and r["prepared_verifies"] == used
    assert r["loads"] == used + r["preplan"].get("dropped", 0)  # every prepared batch was loaded once
    assert len(r["mask_checks"]) == used and all(r["mask_checks"])
    assert r["preplan_s"] > 0  # the profile times the preparation, apart from the rest of the planning


@pytest.mark.parametrize("name", list(LOGPROB_EVERY))
def test_batches_that_return_logprobs_mix_with_drafting_ones(results, name):
    """A batch with a request that wants logprobs takes neither the plain decode path nor a prepared verify: each
    of its steps is a verify (1 token where nothing is drafted) whose logprobs SGLang computes; the other steps
    draft and decode as usual, and every output stays exact."""
    r = results[name]
    assert r["outputs_equal_truth"] and r["logprob_batches"] > 5
    assert len(r["logprob_steps"]) == r["logprob_batches"]
    assert all(wants and not prepared for wants, _, prepared in r["logprob_steps"])
    assert 1 in {w for _, w, _ in r["logprob_steps"]}


@pytest.mark.parametrize("name", RECYCLE)
def test_recycling_learns_from_the_verifiers_scores_and_stays_exact(results, name):
    """With `recycle`, every forward's scored rows reach the planner's table at the next step that waits, and the
    table's drafts join the n-gram ones; outputs stay exact (with preplan too)."""
    r = results[name]
    assert r["outputs_equal_truth"] and r["recycle_rows"] > 100 and r["recycled_requests"] > 0
    # each row's token is paired with its own row's scores: its first successor follows it in the scripted text
    # (rows a rejected draft token wrote pair it with the scripted next token instead), not two tokens on
    pairs = r["recycle_pairs"]
    assert pairs["seen"] >= 20 and pairs["seen"] > 5 * pairs["skip"]
    others = [n for n in CONFIGS if n not in RECYCLE]
    assert all(results[n]["recycle_rows"] == 0 and results[n]["recycled_requests"] == 0 for n in others)
    # the metrics' split by source: recycling's share of what was drafted and accepted, none without it
    # (the adaptive controller may keep none of recycling's nodes on this scripted text; width 16 sends them all)
    st = r["stats"]
    assert st["accepted_recycled"] <= min(st["drafted_recycled"], st["realized_accepted"])
    assert st["drafted_recycled"] < st["drafted_tokens"]
    if CONFIGS[name].get("fixed_width"):
        assert st["accepted_recycled"] > 0
    assert all(results[n]["stats"]["drafted_recycled"] == results[n]["stats"]["accepted_recycled"] == 0
               for n in others)


@pytest.mark.parametrize("name", list(FAIL))
def test_a_failing_prepared_path_turns_the_option_off_and_loses_nothing(results, name):
    """Where SGLang does not fit the prepared path (its load or its replay raises), the step runs unprepared, the
    option goes off for the server, and every output stays exact: the server keeps serving."""
    r, whole = results[name], results["fixed16_preplan"]
    assert r["preplan_failed"] and r["outputs_equal_truth"] and r["lengths"] == whole["lengths"]
    assert 0 < r["prepared_verifies"] < r["verifies"] == whole["verifies"]


def test_at_a_fixed_width_every_verify_is_prepared(results):
    r, off = results["fixed16_preplan"], results["fixed16"]
    assert r["prepared_verifies"] == r["verifies"] == off["verifies"]
    assert off["prepared_verifies"] == 0 and off["loads"] == 0


@pytest.mark.parametrize("name", ["dmb2", "dmb2_fixed16_preplan"])
def test_no_batch_above_draft_max_batch_verifies(results, name):
    """With `draft_max_batch` 2, the three requests' steps are plain until one leaves; then the two left draft."""
    r = results[name]
    assert r["outputs_equal_truth"] and r["verifies"] > 0 and max(r["verify_sizes"]) <= 2
    assert max(results["abort_fixed16_preplan"]["verify_sizes"]) == 3  # the same run without the limit
    assert max(r["planned_sizes"]) <= 2  # nor does the planner run for them: they step as plain decoding does
    assert max(results["abort_fixed16_preplan"]["planned_sizes"]) == 3


@pytest.mark.parametrize("name", DEVICE)
def test_steps_drafted_on_the_device_stay_exact_and_accept_drafts(results, name):
    """`device_drafts`: steps right after a drafting step draft by prompt lookup on the device, without waiting
    for the previous step's tokens; outputs stay the model's, the drafts are accepted on these copy-heavy texts,
    and at most `device_drafts` such steps run in a row (then a step plans on the host again)."""
    r = results[name]
    assert r["outputs_equal_truth"] and r["lens_reports"] == 0
    assert r["device_steps"] > 0 and r["verifies"] > r["device_steps"]
    assert r["preplan"].get("used", 0) + r["preplan"].get("fitted", 0) + r["device_steps"] == r["prepared_verifies"]
    assert all(r["mask_checks"])
    assert r["steps"] < results["defaults"]["steps"] * 1.5  # drafts on the device are accepted: few extra steps


@pytest.mark.parametrize("name", ["defaults", "fixed16", "join", "device3"])
def test_the_kernel_profile_splits_one_window_of_decode_steps(results, name):
    """NGRAMSPEC_KERNEL_PROFILE in the worker: a window opened by its start file covers the next decode steps
    (here the host's ops stand in for kernels), then is written once and the start file removed."""
    r = results[name]
    k = r["kernel_profile"]
    assert r["kernel_windows"] == 1 and not r["kernel_start_left"]
    assert r["memtrace_ticks"] == r["steps"]  # NGRAMSPEC_MEM_TRACE's hook runs at every decode step
    assert r["pinned_trims"] == r["steps"]  # so does the pinned cache's cap (here: over it at every check)
    summary, pinned = r["gauges_published"]  # at SGLang's decode log: the interval's gauges, then the cap's counts
    assert summary == "summary" and pinned["trims"] == r["steps"] and pinned["active_mb"] == 0
    assert pinned["allocated_mb"] > r["steps"]  # this allocator's cache grows by 1 MB at every look
    assert k["steps"] == 6 and sum(k["widths"].values()) == 6 == sum(k["batch_sizes"].values())
    assert k["forwards"] >= 6 and k["prefills_in_window"] == 0
    assert k["kernels"] and k["gpu_ms_per_step"] > 0
    assert sum(k["by_category_ms_per_step"].values()) == pytest.approx(k["gpu_ms_per_step"], rel=1e-3, abs=1e-3)


@pytest.mark.parametrize("name", ["defaults", "preplan", "recycle", "device3", "dmb2"])
def test_a_cache_flush_frees_the_old_cache_at_once_and_keeps_what_was_served(results, name):
    """SGLang's /flush_cache replaces the planner. Its old cache (hundreds of MB at the default capacity) must go
    with its last reference, not wait for the cyclic collector (a GPU soak's scheduler grew by one cache at a flush)."""
    r = results[name]
    assert r["flush_freed"] == [True, True, True]  # planner, cache, controller
    assert r["outputs_kept_by_flush"] and r["planner_after_flush_empty"] and r["cache_after_flush_empty"]
    # the text is forgotten, not what the controller learned about the model and the machine
    assert r["learned_kept"] is True


@pytest.mark.parametrize("name", SAMPLED)
def test_sampled_verifies_read_only_indices_inside_the_verify(results, name):
    """Every verify of these runs went through sampled tree verification, whose torch version raises on an index
    outside its tensors (the retrieve arrays, drafts and scores the worker hands it), and kept the model's tokens."""
    r = results[name]
    assert r["sampled_steps"] == r["verifies"] > 0 and r["outputs_equal_truth"]


def test_a_verify_without_a_graph_runs_unprepared_after_a_preparation_was_given_up(results):
    """Where the graph runner takes no verify of that size (a wide verify of a large batch), the preparation before
    the wait is given up and the verify runs unprepared, sampled verification included."""
    r = results["sampled_nograph_preplan"]
    assert r["preplan"].get("unavailable", 0) > 0 and r["verifies"] > r["prepared_verifies"] > 0


def test_preplan_auto_prepares_where_it_pays_and_times_waits_and_preparations(results):
    """`preplan` "auto" (the defaults): waits for the previous step's tokens and the verifies prepared before them
    are timed for the planner (`record_preplan`, shared at a sync); here nothing is measured to say otherwise, so
    the worker prepares. Where the planner finds it does not pay, the worker prepares nothing before the wait, and
    still times the waits (so that it may turn back on). Outputs stay exact either way."""
    auto, dear, off = results["defaults"], results["preplan_auto_dear"], results["fixed16"]
    for r in (auto, dear, off):
        assert r["outputs_equal_truth"] and r["verifies"] > 0 and r["waits_timed"] > 0
    assert auto["preplan_s"] > 0 and auto["preplans_timed"] > 0
    assert auto["preplan"].get("used", 0) + auto["preplan"].get("fitted", 0) > 0
    assert dear["preplan_s"] == 0 and not dear["preplan"] and dear["preplans_timed"] == 0
    assert off["preplans_timed"] == 0
    # shared at every plan: the profile shows the medians the rule compares and its answer
    rule = results["preplan_auto_sync1"]["preplan_rule"]
    assert results["preplan_auto_sync1"]["outputs_equal_truth"]
    assert set(rule) == {"wait_ms", "preparation_ms", "pays"} and rule["wait_ms"] > 0 and rule["preparation_ms"] > 0
    assert rule["pays"] == (rule["wait_ms"] >= rule["preparation_ms"] + 0.2)


def test_plan_backoff_decides_which_steps_plan_and_outputs_stay_exact(results):
    """`plan_backoff` false plans every decode step (a step that waits plans twice); true skips steps after plans
    that drafted nothing; "auto" (the defaults) skips as true does until a plain step is measured, which this
    scenario's clock never does. Every plan made before the wait is timed and shared (`plan_ms`)."""
    never, always, auto = results["backoff_never"], results["backoff_always"], results["defaults"]
    for r in (never, always, auto):
        assert r["outputs_equal_truth"]
        assert r["plan_ms"] is not None and r["plan_ms"] > 0
    assert never["plans"] >= never["steps"]
    assert always["plans"] < always["steps"]  # the scripted text has stretches where nothing is drafted
    assert auto["plans"] < auto["steps"]

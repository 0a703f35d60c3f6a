"""The plugin against the real sglang package, on CPU: discovery, server-args resolution, the algorithm
object, the worker factory, and the metrics hook. What needs a GPU is in docs/sglang.md."""
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("sglang")

pytestmark = pytest.mark.sglang
REPO = Path(__file__).resolve().parents[2]
ALGO = "NGRAM_ADAPTIVE"
TINY_LLAMA = {  # a config.json only: server-args resolution reads the model config, never weights
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}


def installed_entry_point():
    return [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "ngram_adaptive"]


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """A fresh interpreter: plugins load once per process, as in SGLang's spawned workers."""
    full_env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=600, cwd=REPO)


needs_install = pytest.mark.skipif(
    not installed_entry_point(), reason="ngramspec is not installed here (pip install -e '.[sglang]')"
)


@pytest.mark.sglang_server
@needs_install
def test_entry_point_is_discovered_by_sglang_load_plugins():
    proc = run_python("""
        import json
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        algo = SpeculativeAlgorithm.from_string("ngram_adaptive")
        from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter
        print(json.dumps({"type": type(algo).__name__, "name": algo.name, "ngram": algo.is_ngram(),
                          "hooked": hasattr(SchedulerMetricsReporter.report_decode_stats, "__wrapped__")}))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"type": "NgramAdaptiveAlgo", "name": ALGO, "ngram": True, "hooked": True}


@needs_install
def test_sglang_plugins_allow_list_is_respected():
    proc = run_python("""
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        try:
            SpeculativeAlgorithm.from_string("NGRAM_ADAPTIVE")
        except ValueError as e:
            print("rejected:", e)
    """, SGLANG_PLUGINS="some_other_plugin")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rejected: Unknown speculative algorithm name" in proc.stdout


@pytest.fixture(scope="module")
def plugin():
    """Register in this process (what the entry point does) and apply the hooks."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    import ngramspec_sglang

    ngramspec_sglang.register()
    ngramspec_sglang.register()  # idempotent: SGLang calls it in every process, maybe twice
    HookRegistry.apply_hooks()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm.from_string(ALGO)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


def resolve(plugin, model_dir, *extra):
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", str(model_dir), "--device", "cpu",
                                "--speculative-algorithm", "ngram_adaptive", *extra])
    args.resolve_once()
    return args


@pytest.mark.sglang_server
def test_command_line_resolves_our_defaults(plugin, model_dir):
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(resolve(plugin, model_dir))
    assert view.speculative_algorithm == ALGO
    assert view.speculative_num_draft_tokens == 16  # our default largest width
    # drafting only at batches of up to 48 (draft_max_batch): plain decoding's running-request cap
    assert view.max_running_requests == resolved_view(resolve_plain(model_dir)).max_running_requests != 48
    assert view.speculative_eagle_topk == 10  # tree breadth bound, as NGRAM (--speculative-ngram-max-bfs-breadth)
    assert view.speculative_num_steps == 1  # 16 // 10: KV reserved per decode step stays at the width
    assert view.enable_mixed_chunk is False
    assert view.disable_overlap_schedule is True  # CPU device: SGLang has no speculative overlap there
    assert view.speculative_adaptive is False  # EAGLE's knob stays off; we always adapt


@pytest.mark.sglang_server
def test_command_line_knobs_reach_our_config(plugin, model_dir, tmp_path):
    from sglang.srt.arg_groups.overrides import resolved_view

    from ngramspec_sglang.config import resolve_config

    cfg_file = tmp_path / "adaptive.json"
    cfg_file.write_text(json.dumps({"widths": [1, 2, 4, 8], "tp_sync_interval": 4}))
    args = resolve(plugin, model_dir, "--speculative-num-draft-tokens", "8", "--speculative-ngram-max-trie-depth",
                   "12", "--speculative-ngram-max-bfs-breadth", "1", "--speculative-adaptive-config", str(cfg_file),
                   "--max-running-requests", "7")
    view = resolved_view(args)
    assert view.max_running_requests == 7
    assert view.speculative_eagle_topk == 1 and view.speculative_num_steps == 8  # chains
    cfg = resolve_config(view)
    assert cfg.widths == (1, 2, 4, 8) and cfg.max_depth == 12 and cfg.tree is False and cfg.tp_sync_interval == 4
    assert plugin.resolve_max_speculative_num_draft_tokens(args) == 8


@pytest.mark.sglang_server
def test_draft_max_batch_leaves_the_request_cap_to_sglang(plugin, model_dir, tmp_path):
    """With `draft_max_batch` the running-request cap is SGLang's own default (as for plain decoding), not 48;
    an explicit --max-running-requests still wins."""
    from sglang.srt.arg_groups.overrides import resolved_view

    from ngramspec_sglang.config import resolve_config

    cfg_file = tmp_path / "adaptive.json"
    cfg_file.write_text(json.dumps({"draft_max_batch": 32}))
    view = resolved_view(resolve(plugin, model_dir, "--speculative-adaptive-config", str(cfg_file)))
    assert view.max_running_requests != 48 and resolve_config(view).draft_max_batch == 32
    plain = resolved_view(resolve_plain(model_dir))
    assert view.max_running_requests == plain.max_running_requests
    view = resolved_view(resolve(plugin, model_dir, "--speculative-adaptive-config", str(cfg_file),
                                 "--max-running-requests", "64"))
    assert view.max_running_requests == 64


@pytest.mark.sglang_server
def test_draft_max_batch_null_lets_every_batch_draft_under_a_cap_of_48(plugin, model_dir, tmp_path):
    """The default is 48; `null` turns the limit off, and then the running-request cap is 48 (as NGRAM's)."""
    from sglang.srt.arg_groups.overrides import resolved_view

    from ngramspec_sglang.config import resolve_config

    assert resolve_config(resolved_view(resolve(plugin, model_dir))).draft_max_batch == 48
    cfg_file = tmp_path / "adaptive.json"
    cfg_file.write_text(json.dumps({"draft_max_batch": None}))
    view = resolved_view(resolve(plugin, model_dir, "--speculative-adaptive-config", str(cfg_file)))
    assert view.max_running_requests == 48 and resolve_config(view).draft_max_batch is None


def resolve_plain(model_dir):
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", str(model_dir), "--device", "cpu"])
    args.resolve_once()
    return args


@pytest.fixture(scope="module")
def published(plugin, model_dir):
    """Publish a resolved config in this process, as the scheduler does before building workers."""
    from sglang.srt.runtime_context import get_context

    get_context().set_server_args(resolve(plugin, model_dir, "--speculative-num-draft-tokens", "12"))


@pytest.mark.sglang_server
def test_published_spec_bag_carries_the_largest_width(published):
    from sglang.srt.runtime_context import get_spec

    from ngramspec_sglang.config import resolve_config

    spec = get_spec()
    assert spec.max_speculative_num_draft_tokens == 12  # KV reservation and FutureMap rows
    assert resolve_config(spec).widths == (1, 2, 3, 4, 6, 8, 12)


@pytest.mark.parametrize("extra, message", [
    (["--speculative-ngram-external-corpus-path", "/tmp/corpus.jsonl"], "external corpora"),
    (["--pp-size", "2"], "pipeline parallelism"),
    (["--lora-paths", "a=/tmp/lora"], "LoRA"),
    (["--page-size", "16", "--attention-backend", "triton"], "flashinfer"),
    (["--speculative-num-draft-tokens", "8", "--speculative-adaptive-config", "{missing}"], "no such file"),
])
@pytest.mark.sglang_server
def test_unsupported_command_lines_fail_with_a_reason(plugin, model_dir, tmp_path, extra, message):
    extra = [e.replace("{missing}", str(tmp_path / "nope.json")) for e in extra]
    with pytest.raises(ValueError, match=message):
        resolve(plugin, model_dir, *extra)


def test_algorithm_answers_every_enum_predicate_like_ngram(plugin):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    ngram = SpeculativeAlgorithm.NGRAM
    for name in vars(SpeculativeAlgorithm):
        if name.startswith(("is_", "supports_")) and name not in ("is_some", "is_none", "is_speculative"):
            assert getattr(plugin, name)() == getattr(ngram, name)(), name
    # the methods SGLang 0.5.23's CustomSpecAlgo lacks and the scheduler calls at start-up
    assert plugin.carries_draft_hidden_states() is False
    assert plugin.need_topk() is False
    assert callable(plugin.create_future_map)
    assert plugin.has_draft_kv() is False and plugin.is_speculative() and not plugin.is_none()


@pytest.mark.sglang_server
def test_factory_returns_our_worker_or_fails_only_for_lack_of_a_gpu(plugin, model_dir):
    args = resolve(plugin, model_dir)
    try:
        worker_cls = plugin.create_worker(args)
    except ImportError as e:  # CPU machine: sgl_kernel cannot load without libcuda
        assert "libcuda" in str(e) or "sgl_kernel" in str(e), e
        pytest.skip(f"worker import needs a GPU build of sglang: {str(e).splitlines()[0] or e}")
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    assert worker_cls.__name__ == "NgramAdaptiveWorker" and issubclass(worker_cls, NGRAMWorker)


@pytest.mark.sglang_server
def test_decode_report_runs_with_the_mean_width(published):
    """SGLang's rate formula, evaluated inside our hook, gives correct drafts / drafted tokens."""
    from types import SimpleNamespace

    from sglang.srt.runtime_context import get_spec

    from ngramspec_sglang.drafting import IntervalStats
    from ngramspec_sglang.hooks import report_with_mean_width

    stats = IntervalStats(verified_requests=10, drafted_tokens=23)
    published = []
    worker = SimpleNamespace(interval_stats=stats, ngramspec_on_decode_log=lambda: published.append(True))
    reporter = SimpleNamespace(scheduler=SimpleNamespace(draft_worker=worker), spec_num_forward_ct=10,
                               spec_num_correct_drafts=12)

    def sglang_formula(rep):  # metrics_reporter.report_decode_stats, speculative part
        draft_per_round = get_spec().speculative_num_draft_tokens - 1
        rate = rep.spec_num_correct_drafts / (rep.spec_num_forward_ct * draft_per_round)
        rep.spec_num_forward_ct = 0
        return rate

    before = get_spec().speculative_num_draft_tokens
    assert report_with_mean_width(sglang_formula, reporter) == pytest.approx(12 / 23)
    assert get_spec().speculative_num_draft_tokens == before  # scoped: restored afterwards
    assert published == [True]


def test_our_gauges_export_the_interval_summary():
    from prometheus_client import REGISTRY

    from ngramspec_sglang.drafting import IntervalStats
    from ngramspec_sglang.metrics import NgramspecGauges

    stats = IntervalStats(verify_steps=2, verified_requests=4, width_tokens=40, drafted_tokens=30,
                          expected_tokens=9.0, observed_requests=4, realized_accepted=6, drafted_recycled=10,
                          accepted_recycled=4)
    gauges = NgramspecGauges()
    gauges.publish(stats.summary())
    assert REGISTRY.get_sample_value("ngramspec:verify_width") == 10.0
    assert REGISTRY.get_sample_value("ngramspec:drafted_tokens") == 7.5
    assert REGISTRY.get_sample_value("ngramspec:predicted_accept_length") == 2.25
    assert REGISTRY.get_sample_value("ngramspec:realized_accept_length") == 2.5
    by_source = {(name, source): REGISTRY.get_sample_value(f"ngramspec:{name}_tokens_by_source", {"source": source})
                 for name in ("drafted", "accepted") for source in ("ngram", "recycled")}
    assert by_source == {("drafted", "ngram"): 5.0, ("drafted", "recycled"): 2.5, ("accepted", "ngram"): 0.5,
                         ("accepted", "recycled"): 1.0}
    gauges.publish_pinned({"allocated_mb": 174.0, "active_mb": 12.5, "trims": 3.0})  # the pinned-memory cap's counts
    assert [REGISTRY.get_sample_value(f"ngramspec:pinned_host_{k}") for k in ("mb", "active_mb", "trims")] == [
        174.0, 12.5, 3.0]


def test_run_batch_hook_tells_the_worker_the_queue_length(plugin):
    """The Scheduler.run_batch hook records the waiting-queue length on our worker before the batch runs."""
    from types import SimpleNamespace

    from ngramspec_sglang.hooks import record_waiting

    seen = []
    worker = SimpleNamespace(waiting_requests=None)
    scheduler = SimpleNamespace(draft_worker=worker, waiting_queue=["a", "b", "c"])
    assert record_waiting(lambda s, batch: seen.append((batch, s.draft_worker.waiting_requests)) or "ran",
                          scheduler, "batch") == "ran"
    assert seen == [("batch", 3)]
    other = SimpleNamespace(draft_worker=SimpleNamespace(), waiting_queue=[])  # another algorithm's worker
    record_waiting(lambda s, batch: None, other, "batch")
    assert not hasattr(other.draft_worker, "waiting_requests")
    try:
        from sglang.srt.managers.scheduler import Scheduler
    except ImportError as e:  # CPU machine without a GPU build of sgl_kernel
        pytest.skip(f"scheduler import needs a GPU build of sglang: {str(e).splitlines()[0] or e}")
    assert "record_waiting" in repr(Scheduler.run_batch) or getattr(Scheduler.run_batch, "__wrapped__", None)



def test_token_rows_hold_a_decode_steps_reserve_under_ngram_adaptive(plugin, monkeypatch):
    """SGLang 0.5.23 at page size 1 gives a request's token-to-KV row 4 + the largest width past the context
    length, while a decode step reserves twice the largest width: near the context limit the reserve ran past the
    row. Under NGRAM_ADAPTIVE the hook makes room for the reserve; other algorithms keep SGLang's size."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache import allocation_sizing

    from ngramspec_sglang.hooks import row_room_for_reserve

    monkeypatch.setattr(allocation_sizing, "get_alloc_reserve_per_decode", lambda: 32)
    monkeypatch.setattr(allocation_sizing, "get_alloc_page_size", lambda: 1)
    for algorithm, want in (("NGRAM_ADAPTIVE", 32), ("ngram_adaptive", 32), ("NGRAM", 20), (None, 20)):
        monkeypatch.setattr("sglang.srt.runtime_context.get_spec",
                            lambda a=algorithm: SimpleNamespace(speculative_algorithm=a))
        assert row_room_for_reserve(lambda: 20) == want, algorithm
    monkeypatch.setattr(allocation_sizing, "get_alloc_page_size", lambda: 16)
    monkeypatch.setattr("sglang.srt.runtime_context.get_spec",
                        lambda: SimpleNamespace(speculative_algorithm="NGRAM_ADAPTIVE"))
    assert row_room_for_reserve(lambda: 20) == 47 and row_room_for_reserve(lambda: 60) == 60

    def unpublished():
        raise ValueError("no published configuration")

    monkeypatch.setattr("sglang.srt.runtime_context.get_spec", unpublished)
    assert row_room_for_reserve(lambda: 20) == 20
    monkeypatch.undo()
    wrapped = allocation_sizing.get_req_to_token_extra_context_len  # the hook is applied where SGLang reads it
    assert "row_room_for_reserve" in repr(wrapped) or getattr(wrapped, "__wrapped__", None) is not None

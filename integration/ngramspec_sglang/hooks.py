"""SGLang hooks for places that compare the raw algorithm name "NGRAM".

Handled here (through SGLang's `HookRegistry`, applied by `load_plugins()`):

- `SchedulerMetricsReporter.report_decode_stats`: SGLang's decode log and `sglang:spec_accept_rate`
  divide correct drafts by `forward_ct * (speculative_num_draft_tokens - 1)`. With a width that
  changes every step, the report runs under a scoped `speculative_num_draft_tokens` equal to
  1 + the interval's mean drafted tokens per request, which makes that quotient exactly
  correct drafts / drafted tokens. `spec_accept_length` needs no fix (it counts accepted tokens).

- `Scheduler.run_batch`: records the scheduler's waiting-queue length on the NGRAM_ADAPTIVE worker before
  each batch runs (`worker.waiting_requests`). The controller uses it to tell a busy server (requests
  queued: maximize the batch's tokens per second) from one whose batch is draining (nobody queued: judge a
  width by the requests' geometric-mean speed, so one request's long draft does not slow the others down).
  Every TP rank schedules the same requests, so every rank sees the same length.

- `TokenizerManager._validate_one_request` (`request_guard.py`): under NGRAM_ADAPTIVE, a prompt of no tokens
  (`{"text": ""}`) or with an id outside the model's vocabulary gets SGLang's HTTP 400 instead of reaching the
  scheduler, whose forward would crash on it (SGLang 0.5.23 goes down on these; other algorithms keep that).

- `Req._locate_str_stop_finished_len` (`finish_order.py`): under NGRAM_ADAPTIVE, a step that adds several tokens
  holding two stops (two stop strings; an EOS before a stop string) ends the request at the first of them, as
  plain decoding does; SGLang 0.5.23 takes the first stop string in the request's list.

- `allocation_sizing.get_req_to_token_extra_context_len`: under NGRAM_ADAPTIVE, each request's row of SGLang's
  token-to-KV table gets room for what a decode step reserves (twice the largest width, the overlap's double
  buffer). SGLang 0.5.23 sizes that room so only for a page size above 1; at page size 1 it leaves 4 + the largest
  width, so a request near the context limit reserved KV past its row: the slots leaked (the idle memory check
  then stops the server) and the table's next row could be overwritten.
Left as they are (documented in docs/sglang.md): the LoRA allow-list in `lora_hook.py` (LoRA is
rejected, and our validator says why first: per-width verify graphs, like `--speculative-adaptive`,
do not rebuild LoRA cuda-graph metadata), the external-corpus endpoints in
`tokenizer_control_mixin.py` answer "not enabled" (NGRAM_ADAPTIVE has no external corpus), the
watermark allow-list in `validation_hook.py` rejects `--enable-watermark`, and the SM100 NVFP4
allow-list in `kv_cache_hook.py` rejects NGRAM_ADAPTIVE on that path.
"""
from __future__ import annotations

import os

from .config import ALGORITHM_NAME

DECODE_REPORT = (
    "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter.report_decode_stats"
)

RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
ROW_EXTRA = "sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len"

_registered = False


_fallback_checked = False


def record_waiting(original, scheduler, *args, **kwargs):
    """AROUND hook: tell the NGRAM_ADAPTIVE worker how many requests wait, then run the batch. Before the first
    batch of a scheduler process, with NGRAMSPEC_SAMPLING_FALLBACK=1 in the environment, also install the sampled
    verification fallback for any speculative algorithm (`sampling_fallback.install_if_needed`: only where flashinfer
    is missing; NGRAM_ADAPTIVE's worker installs it for itself): a like-for-like control, SGLang's NGRAM, in an
    environment without flashinfer (the sampling check sets it)."""
    global _fallback_checked
    if not _fallback_checked:
        _fallback_checked = True
        if os.environ.get("NGRAMSPEC_SAMPLING_FALLBACK") == "1":
            from .sampling_fallback import install_if_needed

            install_if_needed()
    worker = getattr(scheduler, "draft_worker", None)
    if worker is not None and hasattr(worker, "waiting_requests"):
        worker.waiting_requests = len(getattr(scheduler, "waiting_queue", ()))
    return original(scheduler, *args, **kwargs)


def report_with_mean_width(original, reporter, *args, **kwargs):
    """AROUND hook: run SGLang's decode report with the interval's mean verify width."""
    worker = getattr(reporter.scheduler, "draft_worker", None)
    stats = getattr(worker, "interval_stats", None)
    if stats is None or stats.verified_requests == 0:
        return original(reporter, *args, **kwargs)
    from sglang.srt.runtime_context import get_spec

    forward_ct_before = reporter.spec_num_forward_ct
    with get_spec().override(speculative_num_draft_tokens=stats.mean_width()):
        result = original(reporter, *args, **kwargs)
    if forward_ct_before > 0 and reporter.spec_num_forward_ct == 0:
        worker.ngramspec_on_decode_log()  # SGLang logged and reset its spec counters: publish, restart
    return result


def row_room_for_reserve(original, *args, **kwargs):
    """AROUND hook: a request's token-to-KV row holds what a decode step may reserve past the context length
    (NGRAM_ADAPTIVE only; SGLang's own answer otherwise)."""
    extra = original(*args, **kwargs)
    try:
        from sglang.srt.runtime_context import get_spec

        algorithm = get_spec().speculative_algorithm
    except Exception:  # no published configuration (a bare construction): SGLang's answer
        return extra
    if algorithm is None or str(algorithm).upper() != ALGORITHM_NAME:
        return extra
    from sglang.srt.mem_cache import allocation_sizing

    return max(extra, allocation_sizing.get_alloc_reserve_per_decode() + allocation_sizing.get_alloc_page_size() - 1)


def register_hooks() -> None:
    """Register the hooks once per process (SGLang applies them after all plugins ran)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(DECODE_REPORT, report_with_mean_width, HookType.AROUND)
    HookRegistry.register(RUN_BATCH, record_waiting, HookType.AROUND)
    HookRegistry.register(ROW_EXTRA, row_room_for_reserve, HookType.AROUND)
    from .request_guard import VALIDATE_ONE_REQUEST, guard_request

    HookRegistry.register(VALIDATE_ONE_REQUEST, guard_request, HookType.AROUND)  # a no-op unless NGRAM_ADAPTIVE
    from .finish_order import LOCATE_STOP, earliest_stop

    HookRegistry.register(LOCATE_STOP, earliest_stop, HookType.AROUND)  # likewise
    from .sched_profile import register_profile_hooks

    register_profile_hooks()  # diagnosis only: NGRAMSPEC_SCHED_PROFILE=FILE
    _registered = True

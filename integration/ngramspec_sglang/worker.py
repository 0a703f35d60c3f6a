"""`NgramAdaptiveWorker`: SGLang's NGRAM worker with ngramspec drafts and a per-step verify width.

Needs a CUDA build of sglang (importing `sglang.srt.speculative.ngram_worker` loads `sgl_kernel`).

What it reuses from SGLang unchanged: `TARGET_VERIFY` through the target worker, `eagle_sample`
(greedy tree verification and sampling), the KV move of accepted tokens, mamba/grammar/logprob
handling, the overlap relay of `NgramVerifyInput`, and SGLang's own tree-mask kernel for positions
and retrieve arrays on device.

What it changes: drafts come from `ngramspec.NgramCache` via `DraftPlanner`; each step verifies at
the width the controller picked, using a target attention backend and a `TARGET_VERIFY` CUDA graph
runner captured for that width (built at start-up like `EAGLEWorkerV2.build_adaptive_runtime_state`,
swapped by assignment). Width 1 runs SGLang's plain decode path: a DECODE forward through a decode-mode
CUDA graph captured at start-up (as a server without speculation captures it) and the normal sampler, no
tree mask, no verify kernels. Output rows (`accept_tokens`, the overlap `FutureMap`, `prev_token_ids`) keep the
stride of the largest width; `speculative_num_draft_tokens` on the result is the active width.

The class and the step it runs are here; each phase a reader follows has its own module:
- `worker_startup.py` (`WorkerStartup`): buffers, an attention backend and CUDA graph per width, the DECODE
  state of width 1, kernels built before the first request;
- `worker_forward.py` (`WorkerForward`): the forwards a step launches (plain decode, verify, prefill) and
  the result SGLang receives;
- `diagnostics.py` (`HostProfile`, `DraftLog`): the opt-in profile and draft log.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Optional

import numpy as np
import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.observability.req_time_stats import set_time_batch
from sglang.srt.runtime_context import (
    get_device,
    get_observability,
    get_parallel,
    get_schedule,
    get_spec,
)
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.ngram_worker import NGRAMWorker
from sglang.srt.speculative.spec_utils import record_stream_for_v2_verify
from sglang.srt.utils import is_cpu

from .backoff import PlanBackoff, plain_forwards
from .config import DEFAULT_PLAN_SHARE, DEFAULT_PREPLAN_SLACK_MS, resolve_config
from .diagnostics import DraftLog, HostProfile, MemTrace, stacks_on_sigusr1
from .drafting import DraftPlanner
from .host_seq_lens import set_cpu_seq_lens_need
from .kernel_profile import KernelProfile
from .pinned_cache import PinnedCacheCap
from .relay import request_views
from .sampling_fallback import install_if_needed as install_sampling_fallback
from .state import StateKeeper
from .timing import StepTimer
from .worker_forward import WorkerForward
from .worker_startup import WorkerStartup

logger = logging.getLogger(__name__)
_is_cpu = is_cpu()
TOPK_PENDING = 32  # forwards whose scored rows wait for a flush at most (older ones are dropped, on every rank)


class NgramAdaptiveWorker(WorkerStartup, WorkerForward, NGRAMWorker):
    """Speculative worker for `--speculative-algorithm NGRAM_ADAPTIVE`.

    The mixins come before `NGRAMWorker` so that their methods override its own (`init_cuda_graphs`,
    `_init_preallocated_tensors`)."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        # NGRAMWorker.__init__ would build SGLang's C++ corpus; we set its fields ourselves.
        BaseSpecWorker.__init__(self)
        stacks_on_sigusr1()  # NGRAMSPEC_STACKS_ON_SIGUSR1: where a hung scheduler waits (diagnostics.py)
        install_sampling_fallback(logger)  # sampled verify without flashinfer (sampling_fallback.py)
        self.server_args = server_args
        self.enable_overlap = not get_schedule().disable_overlap_schedule
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.page_size = get_schedule().page_size
        self.device = get_device().device
        self.config = resolve_config(get_spec())
        self.max_width = self.config.max_width
        self.draft_token_num = self.max_width  # output stride (NGRAMWorker helpers read it)
        self.speculative_num_draft_tokens = self.max_width  # active width; SGLang's gauge reads it
        self.speculative_num_steps = get_spec().speculative_num_steps
        self.topk = get_spec().speculative_eagle_topk  # tree breadth bound, as NGRAM
        self.max_trie_depth = self.config.max_depth
        self.adaptive_controller = None
        self.grammar_tree_host: Optional[tuple] = None
        self._prev_decode_rids: set = set()
        # the requests of the last forward (decode or prefill): only their tokens are still on the device when
        # the next decode step starts (the scheduler processed every earlier result): `request_views`
        self._relayed_rids: set = set()
        self._tp_group = get_parallel().tp_group
        self._max_requests = 2 * max(1024, get_schedule().max_running_requests or 0)
        self.planner = self._new_planner()
        # start warm from the controller's saved state (every rank loads it; rank 0 writes it)
        self._state = StateKeeper.from_config(self.config, self._tp_group.rank_in_group)
        if self._state is not None:
            self._state.attach(lambda: self.planner.controller)
        self.waiting_requests: int | None = None  # set by the Scheduler.run_batch hook (hooks.py)
        self._width_states: dict[int, tuple] = {}
        self._prefill_state: tuple | None = None  # (attention backend, graph runner) SGLang started the model with
        self._decode_state: tuple | None = None  # (attention backend, DECODE-mode graph runner) for width 1
        self._profile = HostProfile.from_env(self._tp_group.rank_in_group)
        if self._profile is not None:
            self._wire_profile(self._profile)
            if not _is_cpu:
                self._profile.device_marks(torch.get_device_module(self.device))
        self._kprof = KernelProfile.from_env(self._tp_group.rank_in_group,
                                             None if _is_cpu else torch.get_device_module(self.device).synchronize)
        self._memtrace = MemTrace.from_env(self._tp_group.rank_in_group)
        self._pinned = None if _is_cpu else PinnedCacheCap.for_torch(self.config.pinned_cache_mb)
        self._fwd_marks = [None, None]  # device marks around the last forward call (profile only)
        self._timer = StepTimer.for_device(
            self._record_duration, None if _is_cpu else torch.get_device_module(self.device),
            record_wait=self._record_wait if self.config.charge_waits_to_drafts else None,
            record_plain=self._record_plain,
        )
        self._drafted_last = False  # the last decode step drafted: the next one waits for its tokens
        self._history = None  # device drafts' token table (`device_drafts`; built with the step buffers)
        self._device_streak = 0  # steps in a row drafted on the device
        self._backoff = PlanBackoff()  # plan less often while plans draft nothing
        self._next_roots: tuple | None = None  # (request ids, their last committed tokens on the device)
        self._last_width: int | None = None  # the width of the last drafting step (what `preplan` prepares)
        self._preplan_failed = False  # preparing a verify raised once: `preplan` is off for this server
        # token recycling (`recycle`): each forward's scored rows (their tokens, the top-k after each, the rows a
        # verify keeps, and on a GPU the event of their copy to the host), handed to the planner's table at the next
        # step that waits for the previous step (every rank alike)
        self._topk_pending: deque = deque(maxlen=TOPK_PENDING)
        self._forward_s = 0.0
        self._verify_parts = (0.0, 0.0, 0.0)  # the last verify's host seconds: prepare, sample, after (profile)
        self._draft_log = DraftLog.from_env(self._tp_group.rank_in_group)
        set_cpu_seq_lens_need(self._backends_need_cpu_seq_lens)
        self._gauges = None
        # NGRAMSPEC_CHECK_LENS=1: every verify compares the host's sequence lengths with the device's (a sync per
        # step, for diagnosis only) and logs the requests and the recent forwards where they differ
        self._check_lens = os.environ.get("NGRAMSPEC_CHECK_LENS", "") not in ("", "0")
        self._events: deque = deque(maxlen=16)  # the last forwards: (kind, rids[, width, forwards]), for the check
        self._lens_reports = 0
        if get_observability().enable_metrics and self._tp_group.rank_in_group == 0:
            from .metrics import NgramspecGauges

            self._gauges = NgramspecGauges()
        t0 = time.perf_counter()
        self.planner.warm_up()  # compile every numba kernel now, not inside the first request
        logger.info("NGRAM_ADAPTIVE: widths %s, tree=%s, max_depth=%d, controller=%s (kernels ready in %.1f s)",
                    self.config.widths, self.config.tree, self.config.max_depth,
                    type(self.planner.controller).__name__, time.perf_counter() - t0)

    def _new_planner(self) -> DraftPlanner:
        tp = self._tp_group
        return DraftPlanner(
            self.config,
            is_timing_rank=tp.rank_in_group == 0,
            broadcast=lambda obj: tp.broadcast_object(obj, src=0),
            max_requests=self._max_requests,
            vocab_size=self._vocab_size() if self.config.recycle else None,
        )

    def _vocab_size(self) -> int:
        """Rows of token recycling's table: the model's vocabulary (its logits' width, padding included)."""
        config = self.model_runner.model_config
        return int(getattr(config, "vocab_size", 0) or config.hf_config.vocab_size)

    def _wire_profile(self, profile: HostProfile) -> None:
        """`NGRAMSPEC_PROFILE`'s views of the planner's live state (read at each dump, from the dump's thread: None
        while a cache flush replaces the planner)."""
        def view(read):
            def get():
                planner = self.planner
                return None if planner is None else read(planner)
            return get

        profile.forwards_summary = view(lambda p: p.forwards.summary() if p.forwards is not None else None)
        profile.live_stats = view(lambda p: p.stats)
        profile.preplan_summary = view(lambda p: p.preplan_summary(DEFAULT_PREPLAN_SLACK_MS))

    def _preplan_on(self) -> bool:
        """`preplan`: true, false, or with "auto" where the wait it fills is measured to outlast it
        (`DraftPlanner.preplan_pays`; the same on every TP rank)."""
        on = self.config.preplan
        return on is True or (on == "auto" and self.planner.preplan_pays(DEFAULT_PREPLAN_SLACK_MS))

    def _maybe_preplan(self, batch: ScheduleBatch, width: int | None):
        """The verify at ``width`` prepared before the wait (`_preplan_verify`; the callers check `_preplan_on`),
        or None."""
        limit = self.config.draft_max_batch
        if self._preplan_failed or _is_cpu or width is None or width <= 1 or (
                limit is not None and len(batch.reqs) > limit):  # too large a batch to draft: no verify to prepare
            return None
        try:
            pre = self._preplan_verify(batch, width)  # the batch as it was if it raises
        except Exception:  # an SGLang the option does not fit: serve on without it, as if it were off
            self._preplan_failed = True
            logger.exception("NGRAM_ADAPTIVE: preparing a verify before the wait failed; preplan is off from now")
            return None
        if pre is None:
            self._count_preplan("unavailable")
        return pre

    def _flush_topk(self) -> None:
        """The scored rows of the steps since the last flush into the recycling table (after a wait: they are
        done). Rows naming a token outside the table (padded vocabulary) are left out."""
        if not self._topk_pending:
            return
        table = self.planner.recycle_table
        while self._topk_pending:
            tokens, topk, rows, done = self._topk_pending.popleft()
            if done is not None:  # pinned host copies (a GPU): complete once their event is
                done.synchronize()
            tokens, topk = tokens.cpu().numpy(), topk.cpu().numpy()
            if rows is not None:  # a verify's: its roots' and real drafts' rows (`scored_rows`)
                tokens, topk = tokens[rows], topk[rows]
            ok = (tokens < table.vocab_size) & (topk < table.vocab_size).all(axis=1) & (tokens >= 0)
            self.planner.recycle_update(tokens[ok], topk[ok])

    def _count_preplan(self, outcome: str) -> None:
        if self._profile is not None:
            self._profile.count_preplan(outcome)

    def _dmark(self):
        """A device mark for the profile (None when it is off or there is no GPU)."""
        return self._profile.mark() if self._profile is not None else None

    def _record_wait(self, batch_size: int, seconds: float) -> None:
        self.planner.record_wait(batch_size, seconds)

    def _record_plain(self, batch_size: int, forwards: int, seconds: float) -> None:
        self.planner.record_plain(batch_size, forwards, seconds)

    def _record_duration(self, width: int, batch_size: int, seconds: float) -> None:
        self.planner.record_duration(width, batch_size, seconds)
        if self._profile is not None:
            self._profile.add_duration(width, batch_size, seconds)

    @property
    def interval_stats(self):
        return self.planner.stats

    def ngramspec_on_decode_log(self) -> None:
        """Called by the decode-report hook after SGLang logged: publish gauges, start a new interval."""
        if self._gauges is not None and self.planner.stats.verified_requests:
            self._gauges.publish(self.planner.stats.summary())
        if self._gauges is not None and self._pinned is not None:
            self._gauges.publish_pinned(self._pinned.counts())
        if self._profile is not None:
            self._profile.fold(self.planner.stats)
        self.planner.stats.reset()

    # -------------------------------------------------------------------- SGLang callbacks
    def clear_cache_pool(self):
        if self._profile is not None:
            self._profile.fold(self.planner.stats)
            self._profile.controller = None  # the new planner's comes with its first step
        # what the controller learned (step costs by width and batch, acceptance calibration) is about the model and
        # the machine, not the cached text: the new planner starts from it
        learned = getattr(self.planner.controller, "state_dict", None)
        learned = learned() if learned is not None else None
        self.planner = None  # the old cache (hundreds of MB at the default capacity) goes before the new one comes
        self.planner = self._new_planner()
        if learned is not None:
            try:
                self.planner.controller.load_state_dict(learned)
            except ValueError as e:  # not expected: the same config builds the same controller
                logger.warning("NGRAM_ADAPTIVE: the controller's learned state was not kept across the flush: %s", e)
                learned = None
        if learned is None and self._state is not None:
            self._state.load(self.planner.controller)
        self._prev_decode_rids = set()
        self._relayed_rids = set()
        self._timer.interrupt()
        self._drafted_last = False
        self._backoff.reset()
        self._next_roots = None
        self._last_width = None
        self._topk_pending.clear()
        if self._pinned is not None:
            self._pinned.trim(force=True)

    def add_external_corpus(self, corpus_id, token_chunks):
        raise NotImplementedError("NGRAM_ADAPTIVE has no external corpus; use --speculative-algorithm NGRAM")

    def commit_corpus_load(self, corpus_id, loaded_token_count):
        raise NotImplementedError("NGRAM_ADAPTIVE has no external corpus")

    def remove_external_corpus(self, corpus_id):
        raise NotImplementedError("NGRAM_ADAPTIVE has no external corpus")

    def list_external_corpora(self):
        return {}

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
        # Acceptance is learnt from committed-length growth at the next draft (DraftPlanner._collect).
        return None

    # ------------------------------------------------------------------------------ stepping
    def _step_launched(self, width: int, bs: int, forwards: int = 1, waited: bool = False) -> None:
        self._timer.step_launched(width, bs, forwards, waited)
        if self._kprof is not None:
            self._kprof.launched(width, bs, forwards)

    def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None, pp_proxy_tensors=None):
        """One decode step. Under the overlap schedule the previous step's tokens are still on the device when
        this runs. Waiting for them idles the GPU, so a step first plans on what the host already has (the
        requests' tokens up to the step before): if that plan drafts nothing, the step runs as a plain decode
        of the relayed last tokens, without waiting, exactly as SGLang's own decode overlaps. Only a step that
        drafts (or follows one: its accepted tokens are needed to draft on) waits, and plans on exact tokens.
        While plans keep drafting nothing, planning backs off (`PlanBackoff`): after n such plans in a row the next
        min(n, 3) steps run plain without planning (the cache catches up on their tokens at the next plan)."""
        if not batch.forward_mode.is_decode():
            if self._check_lens:
                self._events.append(("extend", tuple(req.rid for req in batch.reqs)))
            self._timer.interrupt()
            if self._profile is not None:
                self._profile.interrupt()
            if self._kprof is not None:
                self._kprof.prefill()
            return self._forward_extend(batch, on_publish, pp_proxy_tensors)
        t0 = time.perf_counter()
        if self._kprof is not None:
            self._kprof.before_step()
        if self._memtrace is not None:
            self._memtrace.tick()
        if self._pinned is not None:
            self._pinned.step()
        if self._state is not None:
            self._state.maybe_save(self.planner.controller)  # rank 0, every state_save_minutes
        fwd_stream = torch.get_device_module(self.device).current_stream()
        record_stream_for_v2_verify(batch, None, fwd_stream)
        set_time_batch(batch.reqs, "set_spec_draft_start_time", trace_only=True)
        bs = len(batch.reqs)
        rids = tuple(req.rid for req in batch.reqs)
        current_rids = set(rids)
        self.planner.release(self._prev_decode_rids - current_rids)
        self._prev_decode_rids = current_rids
        relayed_rids, self._relayed_rids = self._relayed_rids, current_rids
        self._timer.harvest()
        relayed = self.enable_overlap and not batch.grammar_needs_sync()  # previous tokens still on the device
        if self._history is not None:
            self._history_append(batch)
        plain_fits = self._decode_state is not None and self._plain_decode_fits(batch)
        lagging = relayed and plain_fits and not self._drafted_last
        waited = 0.0
        preplan_s = 0.0  # host seconds preparing a verify before the wait (`preplan`)
        roots = None
        limit = self.config.draft_max_batch
        too_large = limit is not None and bs > limit  # a batch that never drafts: no plan, as plain decoding
        if lagging and (self.config.fixed_width == 1 or self._backoff.to_skip > 0 or too_large):  # no planner
            roots = self._last_tokens(batch, rids)
            if roots is not None:
                self._backoff.skip_planning()
                t_plan = time.perf_counter()
                m0 = self._dmark()
                forwards = plain_forwards(self.planner.forwards_limit(bs), batch)
                result = self._forward_plain(batch, roots, on_publish, pp_proxy_tensors, rids, forwards)
                if self._check_lens:
                    self._events.append(("decode, unplanned", rids, 1, forwards))
                self.planner.plain_stepped(bs, forwards)
                self._step_launched(1, bs, forwards)
                if self._profile is not None:
                    self._profile.add_device(1, bs, (m0, *self._fwd_marks, self._dmark()))
                    self._profile.add(1, bs, True, 0.0, t_plan - t0, time.perf_counter() - t_plan,
                                      self._forward_s, result.can_run_cuda_graph, forwards=forwards)
                return result
        if (self._history is not None and relayed and not lagging and plain_fits and not too_large
                and self._device_streak < self.config.device_drafts and (self._last_width or 1) > 1):
            result = self._forward_device_drafts(batch, rids, on_publish, pp_proxy_tensors, t0)
            if result is not None:
                return result
        self._device_streak = 0
        t_pre = time.perf_counter()
        relay = batch.spec_info
        pre = None
        t_preplanned = t_pre
        if relayed and not lagging:
            # the views wait for the previous step's tokens: meanwhile prepare the verify, warm the CPU caches
            if self._preplan_on():
                pre = self._maybe_preplan(batch, self._last_width)
                t_preplanned = time.perf_counter()
            if self.config.prefetch:
                self.planner.prefetch(rids)
        t_views = time.perf_counter()
        views = request_views(batch, relayed and not lagging, relayed_rids, relay=relay)
        if relayed and not lagging:
            t_waited = time.perf_counter()
            self._flush_topk()  # every step before this one is done: its scores are on the host at once
            # the wait as it would have been without the preparation (`preplan` "auto" weighs the two)
            prepared = t_preplanned - t_pre if pre is not None else None
            self.planner.record_preplan((prepared or 0.0) + t_waited - t_views, prepared)
        t_planner = time.perf_counter()
        # the scheduler's queue length, set by the run_batch hook (hooks.py); None if the hook did not run
        plan = self.planner.plan(views, waiting=self.waiting_requests, after_draft=self._drafted_last,
                                 fit_width=pre.width if pre is not None else None)
        t_planned = time.perf_counter()
        planned_early = lagging  # planned before waiting for the previous step's tokens: what skipping one saves
        if lagging and plan.width == 1:
            roots = self._last_tokens(batch, rids)
        if lagging and roots is None:  # drafting looks worth it (or no relay): wait for exact tokens, plan again
            if relayed and self._preplan_on():
                t1 = time.perf_counter()
                pre = self._maybe_preplan(batch, plan.width)
                preplan_s = time.perf_counter() - t1
            t1 = time.perf_counter()
            views = request_views(batch, True, relayed_rids, relay=relay)
            waited = time.perf_counter() - t1
            if relayed:
                self.planner.record_preplan(preplan_s + waited, preplan_s if pre is not None else None)
            self._flush_topk()
            plan = self.planner.plan(views, waiting=self.waiting_requests, after_draft=self._drafted_last,
                                     fit_width=pre.width if pre is not None else None)
            lagging = False
        if pre is not None:
            if plan.width != pre.width:
                self._drop_preplan(batch, pre)
                pre = None
                self._count_preplan("dropped")
            else:
                self._count_preplan("fitted" if self.planner.fitted else "used")
        t_plan = time.perf_counter()
        m0 = self._dmark()
        forwards = 1
        if plan.width == 1 and plain_fits:
            if roots is None:
                roots = torch.from_numpy(np.ascontiguousarray(plan.tokens[:, 0], dtype=np.int64))
            # the step right after a drafting step stays one forward: it waited, and its period is that wait's
            if not self._drafted_last:
                forwards = plain_forwards(self.planner.forwards_limit(bs), batch)
                self.planner.plain_stepped(bs, forwards)
            result = self._forward_plain(batch, roots, on_publish, pp_proxy_tensors, rids, forwards)
        else:
            # the root is the last committed token, not yet in the KV cache
            seq_lens_host = [v.committed_len - 1 for v in views]
            if not relayed:
                self._finished_lens(batch, seq_lens_host)
            if self._check_lens:
                self._check_host_lens(batch, views, seq_lens_host, relayed_rids, relayed and not lagging)
            result = self._forward_verify(batch, plan, seq_lens_host, on_publish, pp_proxy_tensors, pre=pre)
            self._next_roots = None
        self._drafted_last = plan.width > 1
        if plan.width > 1:
            self._last_width = plan.width
        if planned_early:
            self.planner.record_plan(t_planned - t_pre)
        backoff = self.config.plan_backoff
        self._backoff.planned(plan.width, skip=backoff is True or (
            backoff == "auto" and not self.planner.plans_are_cheap(bs, DEFAULT_PLAN_SHARE)))
        self._step_launched(plan.width, bs, forwards, waited > 0)
        if self._profile is not None:
            self._profile.add_device(plan.width, bs, (m0, *self._fwd_marks, self._dmark()))
            self._profile.add(plan.width, bs, lagging, waited, t_plan - t0 - waited, time.perf_counter() - t_plan,
                              self._forward_s, result.can_run_cuda_graph, plan, self.planner.controller, forwards,
                              parts=(t_views - t_preplanned, t_planner - t_views, t_planned - t_planner,
                                     t_preplanned - t_pre + preplan_s),
                              verify_parts=self._verify_parts if plan.width > 1 else None)
        if self._draft_log is not None:
            self._draft_log.write(plan)
        if self._check_lens:
            self._events.append(("decode", rids, plan.width, forwards))
        return result

    def _finished_lens(self, batch: ScheduleBatch, seq_lens_host: list) -> None:
        """A batch that runs after the previous step's result was processed (a grammar's, or no overlap): its
        requests' tokens are all on the host, except for a request that this result finished. SGLang built the
        batch before processing the result, so the request is still in it, but its output ends at its last token
        (a stop, or its length limit) while its KV holds every token the step accepted. Its length is read from the
        device (the step before was waited for already: a short copy); the host's count would undersize the verify
        mask and the attention's KV index for the batch."""
        stale = [i for i, req in enumerate(batch.reqs) if req.finished()]
        if stale:
            device = batch.seq_lens[: len(seq_lens_host)].cpu()
            for i in stale:
                seq_lens_host[i] = int(device[i])
            if self._check_lens:
                logger.info("NGRAM_ADAPTIVE: %d finished request(s) in a batch after a processed step: lengths "
                            "read from the device", len(stale))

    def _check_host_lens(self, batch: ScheduleBatch, views, seq_lens_host: list, relayed_rids, used_relay: bool):
        """`NGRAMSPEC_CHECK_LENS`: the host's lengths (from the tokens it counted) against the device's; where they
        differ, an error in the log with each request's counts and the recent forwards, then the device's lengths
        replace the host's for this step (so that the mask fits the batch)."""
        device = batch.seq_lens[: len(views)].cpu().tolist()
        if device == seq_lens_host:
            return
        self._lens_reports += 1
        if self._lens_reports <= 20:
            rows = [
                f"{i}: rid={req.rid} host={h} device={d} prompt={len(v.prompt)} output={len(v.output)} "
                f"pending={len(v.pending)} relayed={req.rid in relayed_rids if relayed_rids is not None else None} "
                f"finished={req.finished() if hasattr(req, 'finished') else None} "
                f"max_new={getattr(req.sampling_params, 'max_new_tokens', None)}"
                for i, (req, v, h, d) in enumerate(zip(batch.reqs, views, seq_lens_host, device)) if h != d]
            logger.error("NGRAM_ADAPTIVE: host lengths differ from the device's (report %d; used relay %s, grammar "
                         "sync %s, logprob %s, bs %d):\n  %s\n  recent forwards (oldest first):\n  %s",
                         self._lens_reports, used_relay, batch.grammar_needs_sync(), batch.return_logprob,
                         len(views), "\n  ".join(rows),
                         "\n  ".join(str(e) for e in self._events))
        seq_lens_host[:] = device

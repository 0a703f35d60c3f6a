"""NgramAdaptiveWorker's decode steps on CPU, around a scripted model: the worker's own control flow, with SGLang's
GPU parts replaced (run in a subprocess by test_worker_scenario.py; prints one JSON line: a list of results).

`ngramspec_sglang.worker` imports sglang modules that load `sgl_kernel`, a CUDA-only package: a stub stands in for
it (any attribute is an inert object), so the modules import. The worker is built without `__init__` (no model,
no graphs); what it reaches of SGLang at run time is replaced by fakes in its modules' namespaces:
- the target worker: a "model" whose greedy next token at every position is known (`truth`); a DECODE forward
  returns it for every request, a TARGET_VERIFY forward records what it read;
- `eagle_sample`: greedy tree verification of the forward's draft tokens against `truth`, from the retrieve arrays
  that the fake `reconstruct_indices_from_tree_mask_func` derived from the tree mask (positions too);
- the CUDA graph runner of each width (`can_run_graph`, `load_batch`, counted) and its Triton-like backend's
  verify-mask buffer; `ForwardBatch.init_new` (a record of the batch's tensors, by reference).
The driver plays SGLang's overlap scheduler: the relay of each step's result becomes the next step's spec info
and lengths, and a step's tokens reach the requests' outputs one step later.

Checks (by the caller, from the JSON): every request's output equals `truth` (verification is exact whatever was
drafted); with `preplan` the verify forwards it prepared read the tokens, positions and mask written after the wait
(the full mask in the backend's buffer equals the one built at once), and the prepared verifies were used.
"""
from __future__ import annotations

import contextlib
import gc
import importlib.abc
import importlib.machinery
import json
import sys
import tempfile
import types
import weakref
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
VOCAB = 512  # the scripted model's vocabulary (its tokens are 1..499)
KERNEL_WINDOW = 6  # decode steps in the kernel profile's window (NGRAMSPEC_KERNEL_PROFILE)


class _Anything:
    def __init__(self, name):
        self._n = name

    def __getattr__(self, k):
        if k.startswith("__"):
            raise AttributeError(k)
        return _Anything(f"{self._n}.{k}")

    def __call__(self, *a, **k):
        return _Anything(f"{self._n}()")

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "sgl_kernel" or name.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def import_worker():
    sys.meta_path.insert(0, _StubFinder())
    sys.path.insert(0, str(REPO / "integration"))
    import ngramspec_sglang.worker as worker_mod
    import ngramspec_sglang.worker_forward as forward_mod

    return worker_mod, forward_mod


def tree_links(mask: np.ndarray):
    """First child and next sibling of every row of one request's ancestor mask (-1: none), and depths."""
    from ngramspec.layout import mask_parents

    w = mask.shape[0]
    parents = mask_parents(mask)
    first, sibling, last = [-1] * w, [-1] * w, {}
    for j in range(1, w):
        p = int(parents[j])
        if p < 0:
            continue
        if first[p] < 0:
            first[p] = j
        else:
            sibling[last[p]] = j
        last[p] = j
    depth = mask.sum(-1) - 1
    return first, sibling, depth


class Scripted:
    """The model and SGLang's GPU parts, for one run."""

    def __init__(self, truth: dict, prompts: dict):
        self.truth, self.prompts = truth, prompts
        self.rids: list = []
        self.worker = None
        self.loads = 0
        self.verify_reads = []  # per verify forward: (prepared, tokens read, positions read)
        self.verify_sizes = []  # per verify forward: its batch size
        self.mask_checks = []
        self.host_lens_checks = []
        self.fail = None  # "load" or "replay": the graph runner's load, or a prepared replay, raises (once on)
        self.logprob_steps = []  # (batch returns logprobs, verify width, prepared) per logprob computation
        self.sampled = None  # a torch.Generator: verifies sample (`sampled_verify`) instead of taking the argmax
        self.sampled_steps = 0
        self.graph_max_tokens = None
        self._last_prepared = None

    # the request's tokens so far and its next true token at a KV position
    def next_token(self, rid, pos):
        seq = self.prompts[rid] + self.truth[rid]
        return seq[pos + 1] if pos + 1 < len(seq) else 0

    def reconstruct(self, tree_mask, seq_lens, positions, retrieve_index, retrieve_next_token,
                    retrieve_next_sibling, bs, w):
        masks = tree_mask.view(bs, w, w).numpy()
        for i in range(bs):
            first, sib, depth = tree_links(masks[i])
            positions[i * w:(i + 1) * w] = torch.as_tensor(depth + int(seq_lens[i]))
            retrieve_index[i] = torch.arange(i * w, (i + 1) * w)
            retrieve_next_token[i] = torch.as_tensor(first)
            retrieve_next_sibling[i] = torch.as_tensor(sib)

    def eagle_sample(self, verify_input, batch, logits_output, grammar_mask, watermark_state=None):
        if self.sampled is not None:
            return self.sampled_verify(verify_input, batch, logits_output)
        bs, w = len(batch.reqs), verify_input.draft_token_num
        tokens = verify_input.draft_token.view(bs, w)
        predict = torch.zeros(bs * w, dtype=torch.int64)
        lens, index = [], torch.zeros((bs, w), dtype=torch.int64)
        for i, req in enumerate(batch.reqs):
            pos0 = int(batch.seq_lens[i])  # the root's KV position
            path, node = [0], 0
            while True:
                want = self.next_token(req.rid, pos0 + len(path) - 1)
                predict[i * w + node] = want
                child = int(verify_input.retrieve_next_token[i, node])
                while child >= 0 and int(tokens[i, child]) != want:
                    child = int(verify_input.retrieve_next_sibling[i, child])
                if child < 0:
                    break
                path.append(child)
                node = child
            lens.append(len(path))
            index[i, :len(path)] = torch.as_tensor([i * w + j for j in path])
            index[i, len(path):] = i * w + path[-1]
        return predict, torch.tensor(lens, dtype=torch.int32), index

    def sampled_verify(self, verify_input, batch, logits_output):
        """SGLang's sampled tree verification (`eagle_sample`'s branch for a batch that samples, with the torch
        version of its kernel, which checks every index it reads) over the verify the worker built: a distribution
        so sharp that sampling keeps the model's tokens, so the outputs can still be compared with them."""
        from ngramspec_sglang.sampling_fallback import tree_speculative_sampling_target_only_torch

        bs, w = len(batch.seq_lens), verify_input.draft_token_num  # as eagle_sample counts them
        logits = logits_output.next_token_logits
        candidates = verify_input.draft_token.reshape(bs, w)
        target_probs = torch.softmax(logits.float() * 10.0, dim=-1).reshape(bs, w, -1)
        predict = torch.zeros(logits.shape[0], dtype=torch.int32)
        accept_index = torch.full((bs, verify_input.max_tree_depth), -1, dtype=torch.int32)
        num_correct = torch.empty((bs,), dtype=torch.int32)
        coins = torch.rand(candidates.shape, generator=self.sampled, dtype=torch.float32)
        final_coins = torch.rand((bs,), generator=self.sampled, dtype=torch.float32)
        tree_speculative_sampling_target_only_torch(
            predicts=predict, accept_index=accept_index, accept_token_num=num_correct, candidates=candidates,
            retrive_index=verify_input.retrieve_index, retrive_next_token=verify_input.retrieve_next_token,
            retrive_next_sibling=verify_input.retrieve_next_sibling, uniform_samples=coins,
            uniform_samples_for_final_sampling=final_coins, target_probs=target_probs,
            draft_probs=torch.zeros_like(target_probs))
        self.sampled_steps += 1
        return predict, num_correct + 1, accept_index

    def spec_logprobs(self, batch, logits_output, predict, accept_index=None):
        # logprobs of a verify's accepted tokens: a batch that asked for them ran a verify, never prepared
        self.logprob_steps.append((batch.return_logprob, batch.spec_info.draft_token_num,
                                   batch.spec_info is self._last_prepared))

    def forward(self, batch=None, forward_batch=None, pp_proxy_tensors=None, is_verify=False):
        source = forward_batch if forward_batch is not None else batch
        if not is_verify:  # a DECODE forward: the next token of each request's last one
            pos = source.seq_lens - 1
            nxt = [self.next_token(r.rid, int(p)) for r, p in zip(batch.reqs, pos)]
            return SimpleNamespace(logits_output=self.logits(nxt), can_run_cuda_graph=True,
                                   next_token_ids=torch.tensor(nxt, dtype=torch.int64))
        spec = source.spec_info
        if forward_batch is not None and self.fail == "replay":
            raise RuntimeError("scripted failure of a prepared verify's replay")
        self._last_prepared = spec if forward_batch is not None else None
        if forward_batch is not None:
            # what a replay reads: the inputs copied at replay, the mask in the backend's buffer
            worker = self.worker
            bs, w = len(forward_batch.reqs), spec.draft_token_num
            state = worker._width_states[w]
            buf = state[0]._verify_mask.buffer
            from ngramspec_sglang.relay import full_verify_mask

            want = full_verify_mask(worker.tree_mask[: bs * w * w].view(bs, w, w), forward_batch.seq_lens)
            self.mask_checks.append(bool(torch.equal(buf[: want.numel()].to(torch.bool), want)))
            assert forward_batch.input_ids is spec.draft_token and forward_batch.positions is spec.positions
        if forward_batch is None and batch.seq_lens_cpu is not None:
            # the host lengths the worker lent for this forward (from the tokens it counted) match the device's
            self.host_lens_checks.append(bool(torch.equal(batch.seq_lens_cpu.to(torch.int64),
                                                          batch.seq_lens.to(torch.int64))))
        self.verify_reads.append(forward_batch is not None)
        self.verify_sizes.append(len(source.reqs))
        bs, w = len(source.reqs), spec.draft_token_num
        rows = [self.next_token(source.reqs[j // w].rid, int(spec.positions[j])) for j in range(bs * w)]
        return SimpleNamespace(logits_output=self.logits(rows), can_run_cuda_graph=True)

    @staticmethod
    def logits(best):
        """Logits whose argmax at row i is ``best[i]``, then the next token ids in order."""
        out = torch.zeros((len(best), VOCAB))
        for i, t in enumerate(best):
            out[i, t] = 10.0
            out[i, (t + 1) % VOCAB] = 5.0
            out[i, (t + 2) % VOCAB] = 4.0
        return SimpleNamespace(next_token_logits=out)


class FakeRunner:
    def __init__(self, world):
        self.world = world

    def can_run_graph(self, fb):  # no graph for verifies of more tokens than `graph_max_tokens` (None: any)
        limit = self.world.graph_max_tokens
        return limit is None or len(fb.input_ids) <= limit

    def load_batch(self, fb):
        if self.world.fail == "load":
            raise RuntimeError("scripted failure of the graph runner's load")
        self.world.loads += 1


class FakeForwardBatch:
    @staticmethod
    def init_new(batch, model_runner, capture_hidden_mode=None, return_hidden_states_before_norm=False):
        return SimpleNamespace(reqs=batch.reqs, input_ids=batch.input_ids, positions=batch.spec_info.positions,
                               seq_lens=batch.seq_lens, spec_info=batch.spec_info,
                               mark_forward_metadata_ready=lambda: None)


def build_worker(worker_mod, forward_mod, world, config, profile_path, bs_max=8):
    from ngramspec_sglang.backoff import PlanBackoff

    W = worker_mod.NgramAdaptiveWorker
    w = object.__new__(W)
    w.config = config
    w.max_width = config.max_width
    w.draft_token_num = w.speculative_num_draft_tokens = config.max_width
    w.enable_overlap = True
    w._target_worker = SimpleNamespace(forward_batch_generation=world.forward)
    w.model_runner = SimpleNamespace(attn_backend=None, decode_cuda_graph_runner=None, watermark_state=None,
                                     model_config=SimpleNamespace(vocab_size=VOCAB))
    w.device = "cpu"
    w._tp_group = SimpleNamespace(rank_in_group=0, broadcast_object=lambda obj, src=0: obj)
    w._max_requests = 64
    w.planner = w._new_planner()  # as at start-up and at a cache flush
    w._topk_pending = deque(maxlen=worker_mod.TOPK_PENDING)
    w._state = None
    w._prev_decode_rids, w._relayed_rids = set(), set()
    w.waiting_requests = 0
    w._width_states = {}
    w._prefill_state = None
    for width in config.widths:  # as at start-up: a verify state per width, width 1 included (1-token verifies)
        backend = SimpleNamespace(_verify_mask=SimpleNamespace(
            buffer=torch.zeros(bs_max * width * (4096 + width), dtype=torch.uint8), fits=lambda bs: bs <= bs_max))
        w._width_states[width] = (backend, FakeRunner(world))
    w._decode_state = (SimpleNamespace(), FakeRunner(world))
    w._plain_ok = True
    from ngramspec_sglang.diagnostics import HostProfile

    w._profile = HostProfile(str(profile_path))  # the real one: the worker's calls into it run too
    w._wire_profile(w._profile)
    from ngramspec_sglang.kernel_profile import KernelProfile

    # the real window logic and torch's profiler; on CPU there are no kernels, so the host's ops stand in for them
    kpath = str(profile_path) + ".kernels"
    open(kpath + ".start", "w").close()  # a window from the first decode step
    w._kprof = KernelProfile(kpath, steps=KERNEL_WINDOW, synchronize=lambda: None,
                             kernels_of=lambda prof: [(e.name, e.time_range.elapsed_us()) for e in prof.events()])
    w._memtrace = SimpleNamespace(ticks=0)  # NGRAMSPEC_MEM_TRACE's hook: counts the decode steps that call it
    w._memtrace.tick = lambda: setattr(w._memtrace, "ticks", w._memtrace.ticks + 1)
    from ngramspec_sglang.pinned_cache import PinnedCacheCap

    # `pinned_cache_mb`'s cap, the real one, over a host allocator whose unused cache grows by 1 MB at every check
    pinned = {"checks": 0}

    def pinned_stats():
        pinned["checks"] += 1
        return {"allocated_bytes.current": pinned["checks"] << 20, "active_bytes.current": 0}

    w._pinned = PinnedCacheCap(0.0, pinned_stats, lambda: None, every=1)
    w._fwd_marks = [None, None]
    w._timer = SimpleNamespace(harvest=lambda: None, step_launched=lambda *a: None, interrupt=lambda: None)
    w._drafted_last = False
    w._backoff = PlanBackoff()
    w._next_roots = None
    w._last_width = None
    w._preplan_failed = False
    w._forward_s = 0.0
    w._verify_parts = (0.0, 0.0, 0.0)
    w._draft_log = None
    w._check_lens, w._events, w._lens_reports = True, deque(maxlen=16), 0  # NGRAMSPEC_CHECK_LENS on
    w._device_streak = 0
    w._history = None
    if config.device_drafts:  # as at start-up: a row per request slot (`req_pool_idx`: the request's index here)
        from ngramspec_sglang.device_drafts import DeviceHistory

        w._history = DeviceHistory(8, 1024, "cpu")
    w.grammar_tree_host = None
    w.token_to_kv_pool_allocator = None
    long = dict(dtype=torch.int64)
    n = bs_max * w.max_width
    w.draft_tokens, w.positions = torch.zeros(n, **long), torch.zeros(n, **long)
    w.retrieve_indexes, w.retrieve_next_token = torch.zeros(n, **long), torch.zeros(n, **long)
    w.retrieve_next_sibling = torch.zeros(n, **long)
    w.tree_mask = torch.zeros(n * w.max_width, dtype=torch.bool)
    w._plain_lens = torch.arange(1, w.max_width + 1, dtype=torch.int32)[:, None].repeat(1, bs_max)
    world.worker = w
    return w


@contextlib.contextmanager
def patched(worker_mod, forward_mod, world):
    """SGLang's GPU-side functions in the worker's modules replaced for the run."""
    spec_bag = SimpleNamespace(override=lambda **k: contextlib.nullcontext())
    repl = {
        (forward_mod, "_is_cpu"): False, (worker_mod, "_is_cpu"): False,
        (forward_mod, "get_spec"): lambda: spec_bag,
        (forward_mod, "get_exec"): lambda: SimpleNamespace(mamba=SimpleNamespace(enable_mamba_extra_buffer=False)),
        (forward_mod, "assign_extend_cache_locs_func"): lambda **k: torch.zeros(
            k["batch_size"] * k["draft_token_num"], dtype=torch.int64),
        (forward_mod, "reconstruct_indices_from_tree_mask_func"): world.reconstruct,
        (forward_mod, "eagle_sample"): world.eagle_sample,
        (forward_mod, "prepare_mamba_track_for_verify"): lambda batch: None,
        (forward_mod, "commit_mamba_states_after_verify"): lambda *a: None,
        (forward_mod, "move_accept_tokens_to_target_kvcache"): lambda *a: None,
        (forward_mod, "set_time_batch"): lambda *a, **k: None,
        (forward_mod, "ForwardBatch"): FakeForwardBatch,
        (forward_mod, "compute_spec_logprobs"): world.spec_logprobs,
        (worker_mod, "set_time_batch"): lambda *a, **k: None,
        (worker_mod, "record_stream_for_v2_verify"): lambda *a: None,
    }
    old = {key: getattr(*key) for key in repl}
    for (mod, name), value in repl.items():
        setattr(mod, name, value)
    try:
        yield
    finally:
        for (mod, name), value in old.items():
            setattr(mod, name, value)


def run(config_json: dict, n_requests: int = 3, steps: int = 400, seed: int = 0, abort_at: int | None = None,
        join_at: int | None = None, fail: str | None = None, fail_at: int = 0, logprob_every: int = 0,
        forget_relay_at: int | None = None, sync_from: int | None = None, sampled: bool = False,
        graph_max_tokens: int | None = None, preplan_pays: bool | None = None):
    """One run; ``abort_at``: at that step the second request leaves the batch unfinished (a client abort);
    ``join_at``: before that step one more request is prefilled and joins the running batch (continuous batching:
    the prefill's token is the only one the relay holds for the next decode step); ``fail`` ("load" or "replay")
    from step ``fail_at`` on: the graph runner's load, or a prepared verify's replay, raises; ``logprob_every``:
    every that many steps the batch returns logprobs (a request asked for them): no plain or prepared path;
    ``forget_relay_at``: before that step the worker forgets which requests the last forward ran (a fault put in on
    purpose: its host lengths then lag the device's, which `NGRAMSPEC_CHECK_LENS` must report); ``sync_from``: from
    that step on the scheduler runs synchronously, as SGLang does for a batch with a grammar under speculation: it
    builds the batch, then processes the previous step's result, then runs the step, so a request that this result
    finished (its output cut at its last token, its KV past it) is still in the batch; ``sampled``: every verify
    runs SGLang's sampled tree verification (`Scripted.sampled_verify`); ``graph_max_tokens``: the CUDA graph runners
    take no verify of more tokens (a verify prepared before the wait is then given up, and the step runs unprepared);
    ``preplan_pays``: what the planner answers `preplan` "auto" (default: its own measurement)."""
    worker_mod, forward_mod = import_worker()
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from ngramspec_sglang.config import resolve_config
    from ngramspec_sglang.relay import next_draft_input, padded_rows

    # the profile's periodic dump (a daemon thread) may be writing its next file here when the run ends
    tmp = tempfile.TemporaryDirectory(ignore_cleanup_errors=True)
    path = Path(tmp.name) / "adaptive.json"
    path.write_text(json.dumps(config_json))
    config = resolve_config(SimpleNamespace(speculative_adaptive_config=str(path),
                                            speculative_num_draft_tokens=max(config_json.get("widths", [16]))))
    rng = np.random.default_rng(seed)
    prompts, truth = {}, {}
    for i in range(n_requests + (join_at is not None)):
        # copy-heavy: the output repeats stretches of the prompt, with novel tokens between
        prompt = rng.integers(1, 500, 120).tolist()
        out = []
        while len(out) < 160:
            s = int(rng.integers(0, 100))
            out += prompt[s:s + int(rng.integers(8, 30))] + rng.integers(1, 500, 2).tolist()
        prompts[f"r{i}"], truth[f"r{i}"] = prompt, out[:160]
    world = Scripted(truth, prompts)
    if sampled:
        world.sampled = torch.Generator().manual_seed(seed)
    world.graph_max_tokens = graph_max_tokens
    worker = build_worker(worker_mod, forward_mod, world, config, Path(tmp.name) / "profile.json")
    if preplan_pays is not None:
        worker.planner.preplan_pays = lambda slack_ms: preplan_pays
    reqs = [SimpleNamespace(rid=r, origin_input_ids_unpadded=p, origin_input_ids=p, output_ids=[truth[r][0]],
                            sampling_params=SimpleNamespace(max_new_tokens=len(truth[r])))
            for r, p in prompts.items()]
    # after the prefill: each request's first token committed and in its output; its KV holds the prompt
    seq_lens = torch.tensor([len(p) for p in prompts.values()], dtype=torch.int64)
    stride = worker.max_width
    relay = next_draft_input(padded_rows(torch.tensor([[r.output_ids[0]] for r in reqs]), stride),
                             torch.ones(len(reqs), dtype=torch.int32), seq_lens, stride)
    joined = {r.rid for r in reqs[:n_requests]}
    worker._relayed_rids = set(joined)
    # the relay holds the prefill's token; the scheduler adds it to the outputs after launching the first step
    unprocessed = (reqs[:n_requests], torch.tensor([[r.output_ids[0]] + [0] * (stride - 1) for r in reqs]),
                   torch.ones(n_requests, dtype=torch.int32))
    for i, r in enumerate(reqs):
        r.output_ids = []
        r.finished = (lambda r=r: len(r.output_ids) >= len(truth[r.rid]))
    if worker._history is not None:  # the first requests' prefill (run before the scenario starts) wrote them
        worker._history.write_prompts(list(range(n_requests)), [r.origin_input_ids_unpadded
                                                                 for r in reqs[:n_requests]])
    planned_sizes = []  # the batch size of every plan (a batch above draft_max_batch runs without one)
    plan = worker.planner.plan
    worker.planner.plan = lambda views, **kw: planned_sizes.append(len(views)) or plan(views, **kw)
    chunked_sizes = set()  # batch sizes whose plain steps ran several forwards (multi-step decoding)
    forward_plain = worker._forward_plain

    def counted_forward_plain(batch, roots, *args):
        if len(args) > 3 and args[3] > 1:
            chunked_sizes.add(len(batch.reqs))
        return forward_plain(batch, roots, *args)
    worker._forward_plain = counted_forward_plain
    device_steps = []  # the steps drafted on the device (`device_drafts`): (batch size, width)
    on_device = worker._forward_device_drafts

    def count_device(batch, *a):
        out = on_device(batch, *a)
        if out is not None:
            device_steps.append((len(batch.reqs), worker._last_width))
        return out
    worker._forward_device_drafts = count_device
    with patched(worker_mod, forward_mod, world):
        aborted, decode_steps, histories_ok = set(), 0, True
        for step in range(steps):
            if step == abort_at:
                aborted.add(reqs[1].rid)
            if step == forget_relay_at:
                worker._relayed_rids = set()
            if step == fail_at:
                world.fail = fail
            if step == join_at:  # prefill the late request, then the scheduler processes the last decode step
                late = reqs[n_requests]
                result = worker.forward_batch_generation(SimpleNamespace(
                    reqs=[late], forward_mode=ForwardMode.EXTEND, seq_lens=torch.tensor([len(late.origin_input_ids)]),
                    req_pool_indices=torch.tensor([n_requests]),
                    spec_info=None, has_grammar=False, return_logprob=False))
                commit(*unprocessed, truth)
                first = result.next_draft_input
                unprocessed = ([late], first.accept_tokens.view(1, stride).clone(), first.accept_lens.clone())
                toks, lens = relay.accept_tokens.view(-1, stride).clone(), relay.accept_lens.clone()
                toks[n_requests], lens[n_requests] = first.accept_tokens.view(stride), 1
                seq_lens[n_requests] = len(late.origin_input_ids)
                relay = next_draft_input(toks.view(-1), lens, seq_lens.clone(), stride)
                joined.add(late.rid)
            live = [r for r in reqs if r.rid in joined and len(r.output_ids) < len(truth[r.rid])
                    and r.rid not in aborted]
            sync = sync_from is not None and step >= sync_from
            if sync and unprocessed is not None:  # the previous step's result, processed before this step runs
                commit(*unprocessed, truth)
                unprocessed = None
            if not live:
                break
            idx = [reqs.index(r) for r in live]
            batch = SimpleNamespace(
                reqs=live, forward_mode=ForwardMode.DECODE, spec_info=relay_rows(relay, idx, stride),
                seq_lens=seq_lens[idx].clone(), seq_lens_cpu=None, seq_lens_sum=None, orig_seq_lens=None,
                req_pool_indices=torch.tensor(idx), req_to_token_pool=SimpleNamespace(req_to_token=None),
                input_ids=None, out_cache_loc=None, has_grammar=False,
                return_logprob=bool(logprob_every) and step % logprob_every == 0,
                sampling_info=SimpleNamespace(has_watermark_candidates=False),
                grammar_needs_sync=lambda: sync)
            result = worker.forward_batch_generation(batch)
            decode_steps += 1
            for r in live:  # what the drafts grow from: the request's tokens, each once, in order (past its
                # last token, a step's relayed tokens may run on before the request stops: not compared)
                if r.rid in worker.planner.tracked_requests:
                    full = prompts[r.rid] + truth[r.rid]
                    seen = worker.planner.cache.history(r.rid).tolist()[:len(full)]
                    histories_ok &= seen == full[:len(seen)]
            # the scheduler processes the previous step's result now (overlap), this one at the next step
            if unprocessed is not None:
                commit(*unprocessed, truth)
            toks = result.next_draft_input.accept_tokens.view(len(live), stride)
            lens = result.next_draft_input.accept_lens
            unprocessed = (live, toks.clone(), lens.clone())
            new = seq_lens.clone()
            new[idx] = result.new_seq_lens.to(torch.int64)
            seq_lens = new
            full_toks = torch.zeros((len(reqs), stride), dtype=toks.dtype)
            full_lens = torch.zeros(len(reqs), dtype=torch.int32)
            full_toks[idx], full_lens[idx] = toks, lens.to(torch.int32)
            relay = next_draft_input(full_toks.view(-1), full_lens, seq_lens, stride)
        if unprocessed is not None:
            commit(*unprocessed, truth)
    worker._profile.dump()
    profile = json.loads((Path(tmp.name) / "profile.json").read_text())
    kpath = Path(tmp.name) / "profile.json.kernels"
    kernels = json.loads(kpath.read_text()) if kpath.exists() else None
    kernel_start_left = Path(str(kpath) + ".start").exists()
    tmp.cleanup()
    outputs_ok = all(r.output_ids == truth[r.rid] for r in reqs if r.rid not in aborted)
    outputs_ok &= all(r.output_ids == truth[r.rid][:len(r.output_ids)] for r in reqs)
    preplan_samples = [s for s in worker.planner._local_durations if type(s).__name__ == "PreplanSample"]
    res = {"outputs_equal_truth": outputs_ok, "steps": decode_steps, "aborted": sorted(aborted),
           "joined": sorted(joined), "histories_ok": histories_ok,
           "tracked_after": sorted(map(str, worker.planner.tracked_requests)),
           "lengths": [len(r.output_ids) for r in reqs], "preplan": profile["_diag"]["preplan"],
           "preplan_rule": profile["_diag"]["preplan_rule"],
           "profile_steps": sum(v["steps"] for k, v in profile.items() if not k.startswith("_")),
           "preplan_s": sum(v["preplan_s"] for k, v in profile.items() if not k.startswith("_")),
           "loads": world.loads, "prepared_verifies": sum(world.verify_reads), "sampled_steps": world.sampled_steps,
           "verifies": len(world.verify_reads), "verify_sizes": world.verify_sizes, "mask_checks": world.mask_checks,
           "host_lens_checks": world.host_lens_checks, "logprob_steps": world.logprob_steps,
           "logprob_batches": sum(1 for k in range(decode_steps) if logprob_every and k % logprob_every == 0),
           "preplan_failed": worker._preplan_failed, "lens_reports": worker._lens_reports,
           "planned_sizes": sorted(set(planned_sizes)), "plans": len(planned_sizes),
           "plan_ms": worker.planner._plan_ms,
           # waits and prepared verifies timed on this (the timing) rank: shared at a sync, or waiting for the next
           "waits_timed": len(worker.planner._preplan_waits) + len(preplan_samples),
           "preplans_timed": len(worker.planner._preplan_costs) + sum(s.preplan is not None for s in preplan_samples),
           "device_steps": len(device_steps),
           "chunked_sizes": sorted(chunked_sizes),
           "recycled_requests": worker.planner.recycled_requests,
           "recycle_rows": (int((worker.planner.recycle_table.succ[:, 0] >= 0).sum())
                             if worker.planner.recycle_table is not None else 0),
           "recycle_pairs": recycle_pairs(worker.planner.recycle_table, prompts, truth),
           "stats": dict(worker.planner.stats.__dict__), "kernel_profile": kernels,
           "kernel_start_left": kernel_start_left, "kernel_windows": worker._kprof.windows,
           "memtrace_ticks": worker._memtrace.ticks, "pinned_trims": worker._pinned.trims}
    # SGLang's decode log: the interval's gauges, then the pinned cache's counts (published whatever the interval)
    res["gauges_published"] = published = []
    worker._gauges = SimpleNamespace(publish=lambda summary: published.append("summary"),
                                     publish_pinned=published.append)
    worker.ngramspec_on_decode_log()
    outputs_before_flush = [list(r.output_ids) for r in reqs]
    # SGLang's /flush_cache on the idle server: the old planner, its cache and its controller must be freed at once
    # (the cyclic collector may not run for a long time in a server), and nothing served is touched
    del worker.planner.plan  # this scenario's counting wrapper, which holds the planner
    plan = None  # and the planner's own method it wraps
    old = [weakref.ref(worker.planner), weakref.ref(worker.planner.cache), weakref.ref(worker.planner.controller)]
    learned = getattr(worker.planner.controller, "state_dict", lambda: None)()
    gc.disable()
    try:
        worker.clear_cache_pool()
        flush_freed = [w() is None for w in old]
    finally:
        gc.enable()
    kept = getattr(worker.planner.controller, "state_dict", lambda: None)()
    learned_kept = None if learned is None else (
        kept is not None and learned.keys() == kept.keys()
        and all(np.array_equal(learned[k], kept[k], equal_nan=learned[k].dtype.kind == "f") for k in learned)
        and int(learned["counters"][0]) > 0)
    res.update(flush_freed=flush_freed, outputs_kept_by_flush=outputs_before_flush == [r.output_ids for r in reqs],
               planner_after_flush_empty=not worker.planner.tracked_requests, learned_kept=learned_kept,
               cache_after_flush_empty=worker.planner.cache.stats()["shared_tokens_held"] == 0
               and worker.planner.cache.stats()["local_nodes_live"] == 0)
    return res


def relay_rows(relay, idx, stride):
    """The relay as the scheduler hands it to a batch of the requests ``idx`` (their rows, in order)."""
    from ngramspec_sglang.relay import next_draft_input

    toks = relay.accept_tokens.view(-1, stride)[idx].reshape(-1)
    return next_draft_input(toks, relay.accept_lens[idx], relay.new_seq_lens[idx], stride)


def commit(reqs, toks, lens, truth):
    for r, row, n in zip(reqs, toks.tolist(), lens.tolist()):
        r.output_ids.extend(row[:n])
        del r.output_ids[len(truth[r.rid]):]


def startup(config_json: dict) -> dict:
    """`init_cuda_graphs` with SGLang's parts faked (the target worker's own capture, attention backends, graph
    runners; the split-KV kernel a stand-in, as if on a GPU): for each width, and for prefill, which attention backend
    it runs on and whether that backend's verifies go through the split kernel. The start-up backend is "startup",
    a new one "new". ``config_json["_triton"]`` false: the backends lack the Triton backend's split-KV hook."""
    config_json = dict(config_json)
    triton = config_json.pop("_triton", True)
    worker_mod, _ = import_worker()
    import ngramspec_sglang.worker_startup as startup_mod
    from ngramspec_sglang.config import resolve_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "adaptive.json"
        path.write_text(json.dumps(config_json))
        config = resolve_config(SimpleNamespace(speculative_adaptive_config=str(path),
                                                speculative_num_draft_tokens=max(config_json["widths"])))
    worker_mod.NGRAMWorker.init_cuda_graphs = lambda self: None  # the target worker captured its width at start-up
    startup_mod._is_cpu = False
    startup_mod.check_cuda_graph_backend = lambda *args: False  # graphs enabled
    startup_mod.get_spec = lambda: SimpleNamespace(override=lambda **kw: contextlib.nullcontext())
    def backend(name):  # a Triton-like one, or one without its hook
        return SimpleNamespace(name=name, use_verify_splitkv=False) if triton else SimpleNamespace(name=name)
    w = object.__new__(worker_mod.NgramAdaptiveWorker)
    w.config, w.max_width, w.topk = config, config.max_width, 1
    w.model_runner = SimpleNamespace(
        attn_backend=backend("startup"), decode_cuda_graph_runner="startup graphs",
        _decode_cuda_graph_runner_cls=lambda: lambda runner, attn_backend, **kw: f"graphs of {attn_backend.name}")
    w._width_states, w._prefill_state, w._plain_ok = {}, None, False
    w._new_attention_backend = lambda: backend("new")
    built = []
    w._new_split_kv = lambda: built.append(1) or (lambda *args, **kwargs: True)
    w._warm_step_kernels = lambda: None
    w._verify_capture_sizes = lambda width: contextlib.nullcontext()  # SGLang's batch sizes
    w.init_cuda_graphs()

    def seen(state):
        return {"backend": state[0].name, "graphs": state[1], "split": bool(getattr(state[0], "use_verify_splitkv",
                                                                                          False))}

    return {"widths": {str(k): seen(v) for k, v in sorted(w._width_states.items())},
            "prefill": seen(w._prefill_state), "kernel_built": bool(built)}


def recycle_pairs(table, prompts, truth) -> dict | None:
    """How many of the recycling table's rows name, as their first successor, a token that follows the row's token
    somewhere in the scripted text ("seen"), and how many name one found two tokens on ("skip"): the scripted model
    scores a row with its position's next token, so a table that pairs each row's token with the scores of its own
    row reads "seen"; one shifted by a row would read "skip"."""
    if table is None:
        return None
    seen, skip = set(), set()
    for rid in truth:
        seq = prompts[rid] + truth[rid]
        seen.update(zip(seq, seq[1:]))
        skip.update(zip(seq, seq[2:]))
    rows = [(x, int(table.succ[x, 0])) for x in range(table.succ.shape[0]) if table.succ[x, 0] >= 0]
    return {"rows": len(rows), "seen": sum(r in seen for r in rows), "skip": sum(r in skip for r in rows)}


def profile_views() -> dict:
    """The opt-in profile's views of the planner (`_wire_profile`) read while a cache flush has dropped the planner
    (its dump thread runs beside the scheduler)."""
    worker_mod, _ = import_worker()
    from ngramspec_sglang.diagnostics import HostProfile

    w = object.__new__(worker_mod.NgramAdaptiveWorker)
    w.planner = None
    with tempfile.TemporaryDirectory() as tmp:
        prof = HostProfile(str(Path(tmp) / "p.json"))
        w._wire_profile(prof)
        prof.dump()
        diag = json.loads((Path(tmp) / "p.json").read_text())["_diag"]
    return {"forwards": prof.forwards_summary(), "stats": prof.live_stats(), "preplan": prof.preplan_summary(),
            "sources": diag["sources"]}


if __name__ == "__main__":  # argv[1]: a JSON list of [adaptive config, {run's keyword arguments}]; prints results
    if sys.argv[1] == "startup":  # argv[2]: a JSON list of adaptive configs
        print(json.dumps([startup(c) for c in json.loads(sys.argv[2])]))
    elif sys.argv[1] == "views":
        print(json.dumps(profile_views()))
    else:
        print(json.dumps([run(c, **kw) for c, kw in json.loads(sys.argv[1])]))

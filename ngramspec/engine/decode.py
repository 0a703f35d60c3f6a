"""The speculative decoding loop: draft from `NgramCache`, verify a tree in one forward, keep the accepted path.

Conventions (the same as the trace simulator's, so its replay of our outputs is comparable step for step):
the prompt minus its last token is prefilled; every decode step has the last committed token as root, verifies
root + draft in one forward and commits the accepted draft tokens plus one bonus token. Plain greedy decoding is
the same loop with no draft (width 1), so both share every kernel but the verify width.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ngramspec.controller import AdaptiveController, Controller, FixedBudgetController
from ngramspec.layout import greedy_walk, layout_flat
from ngramspec.recycle import RECYCLED, order_by_value, with_recycled

from .model import KVModel

PREFILL_CHUNK = 512


class FixedPolicy(FixedBudgetController):
    """Draft up to `k` nodes (chain or tree), verify all of them; width = 1 + longest draft in the batch."""

    def __init__(self, k: int, tree: bool):
        super().__init__(k)
        self.tree = bool(tree)

    @property
    def name(self) -> str:
        return f"{'tree' if self.tree else 'chain'}:k={self.k}"


@dataclass
class StepRecord:
    width: int
    kept: list[int]        # draft nodes verified, per active request
    accepted: list[int]    # draft nodes accepted, per active request
    seconds: float
    host_seconds: float = 0.0   # the part of `seconds` outside the verify forward (drafts, plan, walk, moves)
    plan_seconds: float = 0.0   # the part of `host_seconds` in the policy's drafts and plan
    moved: int = 0              # KV slots moved to compact accepted tree paths


@dataclass
class GenerationResult:
    outputs: list[list[int]]
    steps: list[int]               # decode steps each request took
    prefill_seconds: float
    decode_seconds: float
    records: list[StepRecord] = field(default_factory=list)
    # with `SpecDecoder(record_topk=k)`: per request, per output token, the k most likely tokens of the
    # distribution that produced it (the model's scores at the committed position before it), [n_out, k] int32
    topk: list[np.ndarray] | None = None
    recycled: tuple[int, int] | None = None  # with `recycle`: request-steps drafted by the n-gram cache, by recycling
    # with `recycle`: draft tokens accepted that the n-gram cache drafted, that recycling drafted
    accepted_by_source: tuple[int, int] | None = None

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def accept_length(self) -> float:
        """Committed tokens per request-step (accepted + bonus), the simulator's accept_len."""
        return self.new_tokens / max(1, sum(self.steps))

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def widths(self) -> list[int]:
        return [r.width for r in self.records]


_warmed = False


def _warm_up_once() -> None:
    """Compile (or load) every kernel of the cache and controller once per process, before the first
    speculative request, so that no step of it stalls on a first-time compile (`ngramspec.warmup.warm_up`)."""
    global _warmed
    if not _warmed:
        from ngramspec.warmup import warm_up

        warm_up()
        _warmed = True


def freeze_gc() -> int:
    """Take every object the process holds now (model, tokenizer, compiled kernels, CUDA graphs) out of the
    cyclic garbage collector's reach, as SGLang's server does after its warm-up (`gc.freeze`). Call it once
    everything long-lived is loaded and warmed up. Otherwise, whenever enough new objects have accumulated, a full
    collection walks them all: with SmolLM2 and the kernels loaded some 460,000 objects, a third of a second or
    more, which one decode step pays. Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Verifier:
    """Builds one verify forward for a batch of tree drafts and reads the greedy verdict."""

    def __init__(self, kv: KVModel, runner=None):
        self.kv = kv
        self.runner = runner  # optional CUDA-graph runner with the same call signature as kv.forward

    def forward(self, tokens, positions, slots, mask):
        if self.runner is not None:
            return self.runner(tokens, positions, slots, mask)
        return self.kv.forward(tokens, positions, slots, mask, rows=slice(0, tokens.shape[0]))


class SpecDecoder:
    """Greedy decoding of a batch of prompts, with optional n-gram speculation.

    One decoder owns one `KVModel` (its batch rows and slots). `generate` decodes up to `kv.batch` prompts
    together; the `NgramCache`, if any, is the caller's and persists across calls (its shared part learns).
    """

    def __init__(self, kv: KVModel, runner=None, sync_moves: bool = False, record_topk: int = 0):
        if not isinstance(record_topk, int) or not 0 <= record_topk <= kv.shape.vocab:
            raise ValueError(f"record_topk must be an integer in [0, {kv.shape.vocab}], got {record_topk!r}")
        self.record_topk = record_topk  # > 0: keep the top-k of every committed position (token recycling)
        self._topk = None  # the last verify's top-k [B, width, k] (host), when recording
        self.kv = kv
        self.verifier = Verifier(kv, runner)
        self.sync_moves = bool(sync_moves)  # wait for a step's KV moves inside the step (its time, not the next's)
        self.device = kv.device
        self._arange = torch.arange(kv.max_len, device=kv.device)  # for the verify masks
        self._while_forward = None  # host work to do while the device runs a step's forward (or None)

    # -- prefill --------------------------------------------------------------------------------------
    def _prefill(self, row: int, tokens: Sequence[int]) -> None:
        dev = self.device
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = torch.as_tensor(tokens[start:start + PREFILL_CHUNK], dtype=torch.long, device=dev)[None]
            m = chunk.shape[1]
            pos = torch.arange(start, start + m, device=dev)[None]
            L = start + m
            mask = torch.arange(L, device=dev)[None, None, :] <= pos[:, :, None]
            self.kv.forward(chunk, pos, pos, mask, rows=slice(row, row + 1))

    # -- decode ---------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, policy: Controller | None = None,
                 cache=None, rids: Sequence | None = None, eos_token_id: int | None = None,
                 share: bool = True, progress=None, recycle=None, recycle_min_match: int = 1,
                 recycle_widen: bool = False) -> GenerationResult:
        """Decode greedily up to `max_new_tokens` per prompt (fewer if `eos_token_id` is emitted).

        With `policy` (a `ngramspec.controller.Controller`, e.g. `FixedPolicy` or `AdaptivePolicy`; its `tree`
        attribute, if any, picks tree or chain drafts) and `cache` (an `NgramCache`), drafts are verified each
        step; outputs are identical to plain greedy decoding up to floating-point ties. `rids` name the requests
        in the cache (default 0..B-1); `share` is passed to `finish_request`. `progress` (a tqdm bar or None) is
        advanced by committed tokens.

        `recycle` (a `ngramspec.recycle.RecycleTable`): token recycling as a second source. After every step the
        table takes the model's top-k at every row it verified (the root and each draft node, accepted or not); a
        request whose n-gram draft is empty or grew from a match shorter than `recycle_min_match` tokens drafts from
        the table instead (`ngramspec.recycle.with_recycled`; `recycle_widen`: a kept n-gram draft is followed by
        the table's other first tokens, and an adaptive policy's `node_values` then order each such draft's nodes
        best first, `ngramspec.recycle.order_by_value`); an `AdaptiveController` calibrates recycled nodes apart
        and plans over both. `GenerationResult.recycled` counts the request-steps each source drafted,
        `accepted_by_source` the draft tokens each had accepted.
        """
        B = len(prompts)
        if not 1 <= B <= self.kv.batch:
            raise ValueError(f"need 1..{self.kv.batch} prompts, got {B}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if (policy is None) != (cache is None):
            raise ValueError("policy and cache go together: both for speculation, neither for plain greedy")
        if recycle is not None and policy is None:
            raise ValueError("recycle needs a policy (and a cache): it is a draft source")
        if recycle is not None and recycle.vocab_size < self.kv.shape.vocab:
            raise ValueError(f"the recycling table has {recycle.vocab_size} rows for a vocabulary of "
                             f"{self.kv.shape.vocab}")
        topk_k = max(self.record_topk, recycle.k if recycle is not None else 0)
        prompts = [[int(t) for t in p] for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        rids = list(range(B)) if rids is None else list(rids)
        if len(rids) != B:
            raise ValueError(f"{len(rids)} rids for {B} prompts")
        vocab = self.kv.shape.vocab
        if any(t < 0 or t >= vocab for p in prompts for t in p):
            raise ValueError(f"prompt token outside [0, {vocab})")
        longest = max(len(p) for p in prompts)
        max_width = policy.max_width if policy is not None else 1
        if longest + max_new_tokens + max_width > self.kv.max_len:
            raise ValueError(f"prompt {longest} + {max_new_tokens} new + width {max_width} exceeds the KV cache "
                             f"({self.kv.max_len} slots)")

        if cache is not None:
            _warm_up_once()
        runner = self.verifier.runner
        if runner is not None:
            if B != self.kv.batch:
                raise ValueError(f"CUDA graphs were captured for batch {self.kv.batch}, got {B} prompts")
            runner.prepare(range(1, max_width + 1))
        dev = self.device
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            self._prefill(i, p[:-1])
        _sync(dev)
        prefill_seconds = time.perf_counter() - t0

        length = np.array([len(p) - 1 for p in prompts], np.int64)   # valid cache slots per row
        root = np.array([p[-1] for p in prompts], np.int64)           # last committed token, not yet in cache
        outputs: list[list[int]] = [[] for _ in range(B)]
        topk_rows: list[list[np.ndarray]] | None = [[] for _ in range(B)] if self.record_topk else None
        sources = [0, 0]  # steps of a request drafted by the n-gram cache, by the recycling table
        accepted_by = [0, 0]  # draft tokens accepted from the n-gram cache, from the recycling table
        steps = [0] * B
        records: list[StepRecord] = []
        # a controller with the one-call `step` (AdaptiveController) takes each row's tokens of the last step
        # with the next step's drafts and plan; a row's last tokens go to the cache when it finishes
        one_call = policy is not None and callable(getattr(policy, "step", None)) and recycle is None
        # the controller's own step and plan make plans that fit their drafts by construction (not a subclass's)
        trusted = one_call and getattr(type(policy), "step", None) is AdaptiveController.step \
            and getattr(type(policy), "plan", None) is AdaptiveController.plan
        tree = getattr(policy, "tree", True)
        fresh: list[np.ndarray] = [np.zeros(0, np.int32) for _ in range(B)]
        if cache is not None:
            for rid, p in zip(rids, prompts):
                cache.start_request(rid, p)
                policy.start(rid)

        t0 = time.perf_counter()
        act = list(range(B))                       # rows still decoding (finished rows ride along, parked)
        counts = np.zeros(B, np.int64)             # draft nodes each row verifies this step
        row_offsets = np.zeros(B + 1, np.int64)    # where each row's draft starts in the step's flat arrays
        root_parent, root_depth = np.full((B, 1), -1, np.int64), np.zeros((B, 1), np.int64)
        root_mask = np.ones((B, 1, 1), bool)
        act_rids = [rids[i] for i in act]
        # while the device runs a step's forward, warm the CPU caches for the next step's drafts and plan
        prefetch = getattr(policy, "prefetch", None) if one_call else None
        while act:
            t_step = time.perf_counter()
            n_act = len(act)
            counts[:] = 0
            width, kept = 1, None
            t_plan = t_step
            if policy is not None:
                if one_call:  # a fixed set of prompts: none queue
                    batch, plan = policy.step(cache, act_rids, [fresh[i] for i in act], waiting=0, tree=tree)
                else:
                    batch = cache.propose(act_rids, max(1, policy.max_width - 1), tree=tree)
                    if recycle is not None:
                        sizes = batch.offsets[1:] - batch.offsets[:-1]
                        sources[0] += int(((sizes > 0) & (batch.match_lens >= recycle_min_match)).sum())
                        batch, used = with_recycled(batch, recycle, root[act], max(1, policy.max_width - 1),
                                                    recycle_min_match, widen=recycle_widen)
                        sources[1] += used
                        if recycle_widen and hasattr(policy, "node_values"):  # both sources' best nodes first
                            batch = order_by_value(batch, policy.node_values(act_rids, batch)[0])
                    plan = policy.plan(act_rids, batch, waiting=0)
                t_plan = time.perf_counter()
                if trusted:
                    width, kept = plan.width, plan.lengths
                    kl = kept.tolist()
                else:
                    width, kept = int(plan.width), np.asarray(plan.lengths, np.int64)
                    kl = kept.tolist() if kept.ndim == 1 else None
                    if width < 1 or kl is None or len(kl) != n_act or min(kl) < 0 or max(kl) > width - 1:
                        raise ValueError(f"policy chose width {width} and kept {kept.tolist()} for {n_act} requests")
            if width == 1:  # the root alone: no layout to compute
                tok, parents, depth, anc = root[:, None].copy(), root_parent, root_depth, root_mask
            else:
                offs = batch.offsets
                if n_act == B:
                    counts[:] = kept
                else:  # finished rows verify nothing
                    counts[act] = kept
                    offs = row_offsets
                    offs[act] = batch.offsets[:-1]
                lay = layout_flat(batch.tokens, batch.parents, offs, counts, root, width)
                tok, parents, depth, anc = lay.tokens, lay.parents, lay.depths, lay.mask
            L = int(length.max()) + width
            t_verify = time.perf_counter()
            self._while_forward = None if prefetch is None else (prefetch, cache, act_rids)
            predicted = self._verify(tok, depth, anc, length, L, topk_k)
            if recycle is not None:  # every verified row's top-k: the root's and each draft node's
                rows = [(i, int(counts[i]) + 1) for i in act]
                recycle.update(np.concatenate([tok[i, :n] for i, n in rows]).astype(np.int64),
                               np.concatenate([self._topk[i, :n, :recycle.k] for i, n in rows]))
            t_verified = time.perf_counter()

            accepted_counts = [0] * n_act
            mv_rows, mv_src, mv_dst = [], [], []
            finished = []
            for j, i in enumerate(act):
                row_tokens, pred = tok[i], predicted[i]
                path = greedy_walk(row_tokens, parents[i], int(counts[i]), pred) if counts[i] else []
                new = [int(row_tokens[r]) for r in path] + [int(pred[path[-1] if path else 0])]
                for depth_k, r in enumerate(path, start=1):
                    if r != depth_k:
                        mv_rows.append(i)
                        mv_src.append(length[i] + r)
                        mv_dst.append(length[i] + depth_k)
                room = max_new_tokens - len(outputs[i])
                new = new[:room]
                if eos_token_id is not None and eos_token_id in new:
                    new = new[:new.index(eos_token_id) + 1]
                outputs[i].extend(new)
                if topk_rows is not None:  # the rows whose distributions produced `new`: the root, then the path
                    topk_rows[i].append(self._topk[i, ([0] + path)[:len(new)], :self.record_topk])
                accepted_counts[j] = n_acc = min(len(path), len(new))   # as the simulator counts a truncated last step
                if recycle is not None and n_acc:  # row r of the layout is node r - 1 of the request's draft
                    nodes = batch.offsets[j] + np.asarray(path[:n_acc]) - 1
                    rec = int(np.count_nonzero(batch.sources[nodes] == RECYCLED))
                    accepted_by[1] += rec
                    accepted_by[0] += n_acc - rec
                steps[i] += 1
                length[i] += 1 + len(path)
                root[i] = new[-1]
                done = len(outputs[i]) >= max_new_tokens or (eos_token_id is not None and new[-1] == eos_token_id)
                if one_call and not done:
                    fresh[i] = np.array(new, np.int32)
                elif cache is not None:
                    cache.add_tokens(rids[i], new)
                    policy.observe_tokens(rids[i], new)
                if done:
                    finished.append(i)
                    # a finished row still rides along in the batch: park it at slot 0 so that its dummy
                    # verify block never runs past the cache, whatever its last step overshot
                    length[i] = 0
                if progress is not None:
                    progress.update(len(new))
            if finished:
                act = [i for i in act if i not in finished]
                act_rids = [rids[i] for i in act]
            self.kv.move(mv_rows, mv_src, mv_dst)
            if mv_rows and self.sync_moves:
                _sync(dev)
            t_end = time.perf_counter()
            seconds = t_end - t_step
            if policy is not None:
                policy.observe_step(n_act, width, seconds * 1e3)
            records.append(StepRecord(width, kl if kept is not None else [0] * n_act, accepted_counts, seconds,
                                      (t_verify - t_step) + (t_end - t_verified), t_plan - t_step, len(mv_rows)))
        _sync(dev)
        decode_seconds = time.perf_counter() - t0
        if cache is not None:
            for rid in rids:
                cache.finish_request(rid, share=share)
                policy.finish(rid)
        topk = None if topk_rows is None else [
            np.concatenate(rows).astype(np.int32) if rows else np.zeros((0, self.record_topk), np.int32)
            for rows in topk_rows]
        return GenerationResult(outputs, steps, prefill_seconds, decode_seconds, records, topk,
                                tuple(sources) if recycle is not None else None,
                                tuple(accepted_by) if recycle is not None else None)

    def _verify(self, tok, depth, anc, length, L, topk: int = 0) -> np.ndarray:
        """Greedy prediction `[B, width]` after each row of the verify block."""
        dev = self.device
        B, n = tok.shape
        if self.verifier.runner is not None:
            L = self.kv.max_len
        # one host-to-device copy: tokens, positions, slots [3, B, n], the ancestor masks [B, n, n], lengths [B]
        host = np.empty(3 * B * n + B * n * n + B, np.int64)
        ints = host[:3 * B * n].reshape(3, B, n)
        ints[0] = tok
        np.add(length[:, None], depth, out=ints[1])
        np.add(length[:, None], np.arange(n), out=ints[2])
        host[3 * B * n:-B] = anc.reshape(-1)
        host[-B:] = length
        dev_all = torch.from_numpy(host).to(dev)
        tokens, positions, slots = dev_all[:3 * B * n].view(3, B, n)
        ancestors = dev_all[3 * B * n:-B].view(B, n, n) != 0
        mask = self._arange[:L].expand(B, n, L) < dev_all[-B:, None, None]
        mask.scatter_(2, slots[:, None, :].expand(B, n, n), ancestors)
        logits = self.verifier.forward(tokens, positions, slots, mask)
        predicted = logits.argmax(-1)
        if topk:
            self._topk = logits.topk(topk, dim=-1).indices.cpu().numpy()
        if self._while_forward is not None:  # the launches above are asynchronous on a GPU: use the wait
            fn, *args = self._while_forward
            fn(*args)
        return predicted.cpu().numpy()

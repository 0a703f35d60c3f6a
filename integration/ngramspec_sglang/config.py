"""Knobs of `--speculative-algorithm NGRAM_ADAPTIVE`, resolved from SGLang's server args.

Pure Python (no sglang import) so it is testable anywhere. Where a knob comes from:

- `--speculative-num-draft-tokens N`: the largest verify width (root + N-1 draft tokens); default 16.
- `--speculative-ngram-max-trie-depth`: the cache's suffix depth (longest n-gram matched).
- `--speculative-ngram-max-bfs-breadth`: 1 drafts chains only, >1 drafts trees.
- `--speculative-ngram-capacity`: trie nodes in all (half per-request histories, half the shared cache;
  40 bytes each on the host).
- `--speculative-adaptive-config FILE`: a JSON object with any of the keys of `ADAPTIVE_CONFIG_KEYS`
  (candidate widths, fixed width, TP sync interval, controller options, the controller's state file).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

ALGORITHM_NAME = "NGRAM_ADAPTIVE"
DEFAULT_MAX_WIDTH = 16
DEFAULT_MAX_RUNNING_REQUESTS = 48  # SGLang's NGRAM default: the cap when every batch may draft
DEFAULT_DRAFT_MAX_BATCH = 48  # larger decode batches run plainly, under plain decoding's running-request cap
DEFAULT_TP_SYNC_INTERVAL = 8
DEFAULT_STATE_SAVE_MINUTES = 10.0
DEFAULT_PLAIN_FORWARDS = 4
DEFAULT_PREPLAN_SLACK_MS = 0.2  # preplan "auto": on where the wait it fills outlasts preparing a verify by this
DEFAULT_PLAN_SHARE = 0.05  # plan_backoff "auto": skip plans only where one costs more than this share of a plain step
DEFAULT_PLAIN_FORWARDS_MAX_BATCH = 48  # "auto" measures per batch-size bucket up to here
DEFAULT_PINNED_CACHE_MB = 64

# SGLang `--speculative-ngram-*` options we do not use, with the reason shown to the user.
IGNORED_NGRAM_OPTIONS = {
    "speculative_ngram_min_bfs_breadth": "the suffix trie ranks children by count; there is no BFS breadth floor",
    "speculative_ngram_match_type": "drafts are always ranked by estimated acceptance probability",
}
UNSUPPORTED_OPTIONS = {
    "speculative_ngram_external_corpus_path": "external corpora are not supported by NGRAM_ADAPTIVE",
}

ADAPTIVE_CONFIG_KEYS = {
    "widths": "candidate verify widths (ints >= 1; 1 = plain decode step, always added)",
    "fixed_width": "always verify at this width (disables adaptation; for A/B runs)",
    "tree": "true: tree drafts, false: chain drafts (overrides --speculative-ngram-max-bfs-breadth)",
    "max_depth": "suffix depth of the cache (overrides --speculative-ngram-max-trie-depth)",
    "tp_sync_interval": "verify steps between broadcasts of rank 0's step timings (tensor parallel)",
    "controller": "keyword options of ngramspec.controller.AdaptiveController (e.g. prior: a calibration JSON path)",
    "state_file": "path of the controller's learned state: loaded at start-up if it exists, written by TP rank 0",
    "state_save_minutes": "minutes between writes of state_file (and once at exit); default 10",
    "charge_waits_to_drafts": "true: the wait a drafting step causes the plain step after it is charged to "
                              "starting to draft, not to plain decoding (default); false: it counts as "
                              "plain decoding's cost",
    "plain_forwards": "decode forwards a step that drafts nothing runs back to back (multi-step decoding: the "
                      "scheduler's per-step host work is paid once for them); \"auto\" (default): up to "
                      f"{DEFAULT_PLAIN_FORWARDS}, only while the measured period per forward shows it pays; an int "
                      "from 1 to the largest width: always that many; 1 = one forward per scheduler step, like "
                      "SGLang's own decode",
    "plain_forwards_max_batch": "the largest decode batch (requests) whose plain steps run plain_forwards forwards; "
                                "larger batches run one per step. Default "
                                f"{DEFAULT_PLAIN_FORWARDS_MAX_BATCH}",
    "plan_backoff": "\"auto\" (default): while plans draft nothing, skip planning on the next steps (after n such "
                    "plans in a row, min(n, 3) steps) only where a plan's host time, measured, is more than "
                    f"{DEFAULT_PLAN_SHARE:.0%} of a plain decode step's period (a small model); else plan every step, "
                    "so that a copy that starts is drafted at once; true: always skip so; false: never",
    "prefetch": "true: a step that must wait for the previous step's tokens first runs the drafting code on what "
                "the host already holds (changing nothing), so that its real drafting after the wait finds the "
                "CPU caches warm; pays only where that wait is long. Default false",
    "preplan": "\"auto\" (default): as true where the wait for the previous step's tokens, measured, outlasts "
               f"preparing a verify, measured, by {DEFAULT_PREPLAN_SLACK_MS} ms or more (a long GPU step: large "
               "models), else as false. true: a step that must wait for the previous step's tokens prepares its "
               "verify forward before the wait "
               "(batch, attention metadata and CUDA graph inputs at the width of the last drafting step), so that "
               "only drafting and the token copy stand between the previous step's end and the next forward; a plan "
               "at another width is fitted to the prepared one (drafts cut, or the width grown up to 2x) or, further "
               "off, runs unprepared. Pays where the GPU step is long enough to hide that host work. false: the "
               "whole verify is built after the wait",
    "recycle": "true: token recycling as a third draft source (experimental, default false): a table of each "
               "token's latest top-k successors from the verifier's own scores of every verified and decoded "
               "position, drafting where the n-gram cache matches fewer than recycle_min_match tokens (and, with "
               "recycle_widen, after the n-gram draft); the controller calibrates its acceptance apart",
    "recycle_topk": "successors kept per token (default 8)",
    "recycle_branching": "the recycled tree's breadth-first template, children per level (default [4, 1, 1, 1])",
    "recycle_min_match": "the shortest n-gram match whose draft is kept (default 1)",
    "recycle_widen": "true (default): requests that keep an n-gram draft get recycling's other first tokens after it",
    "draft_max_batch": "the largest decode batch (requests) that may draft: larger batches decode plainly, and verify "
                       "CUDA graphs (all widths but the largest, which SGLang captures itself) are captured only up "
                       "to it; the running-request cap is SGLang's own default, as for plain decoding, unless "
                       "--max-running-requests is given. Default 48; null: every batch may draft, and the cap is 48",
    "device_drafts": "experimental, default 0 (off): up to this many steps in a row right after a drafting step "
                     "draft on the device instead of waiting for that step's tokens on the host: a chain from prompt "
                     "lookup over the request's own tokens (kept in a device table, 4 bytes per token of every "
                     "request slot's row), verified at the width of the last drafting step. Needs preplan's "
                     "conditions (CUDA graphs, Triton attention); not with recycle",
    "split_kv_verify": "default \"grouped\": a verify's attention splits each request's prefix over many GPU "
                       "programs, as a decode step's does, with one program per KV head for all the query heads "
                       "that share it (each KV block read once per GQA group), instead of SGLang's prefill kernel "
                       "(one program per request and head walking the whole prefix); trees and chains. true: the "
                       "same with one program per query head; false: SGLang's kernel. Triton attention only (off "
                       "for another backend); checked against SGLang's kernel at start-up, off if it differs. On, it "
                       "captures one more set of verify CUDA graphs (the largest width's own, through the kernel)",
    "pinned_cache_mb": "the most pinned host memory (MB) torch may keep cached but unused in the scheduler: above it "
                       "the unused blocks go back to the driver (checked every 256 decode steps, and at a cache "
                       "flush). A verify's host buffers grow with batch x width, and torch never returns pinned "
                       f"blocks on its own. Default {DEFAULT_PINNED_CACHE_MB}; null: no cap",
    "width_cycle": "diagnostic: verify at these widths in turn, one step each, drafting what fits (a sweep of "
                   "the step cost by width: the NGRAMSPEC_PROFILE durations); replaces the controller",
}


@dataclass(frozen=True)
class AdaptiveConfig:
    """Everything the NGRAM_ADAPTIVE worker needs, validated."""

    widths: tuple[int, ...]
    tree: bool = True
    max_depth: int = 18
    fixed_width: int | None = None
    capacity: int = 10_000_000
    tp_sync_interval: int = DEFAULT_TP_SYNC_INTERVAL
    controller: Mapping[str, Any] = field(default_factory=dict)
    state_file: str | None = None
    state_save_minutes: float = DEFAULT_STATE_SAVE_MINUTES
    charge_waits_to_drafts: bool = True
    plain_forwards: int | str | None = None  # None / "auto": up to DEFAULT_PLAIN_FORWARDS where measured to pay
    plain_forwards_max_batch: int = DEFAULT_PLAIN_FORWARDS_MAX_BATCH
    plan_backoff: bool | str = "auto"
    prefetch: bool = False
    preplan: bool | str = "auto"
    recycle: bool = False
    recycle_topk: int = 8
    recycle_branching: tuple[int, ...] = (4, 1, 1, 1)
    recycle_min_match: int = 1
    recycle_widen: bool = True
    width_cycle: tuple[int, ...] | None = None
    draft_max_batch: int | None = DEFAULT_DRAFT_MAX_BATCH
    device_drafts: int = 0
    split_kv_verify: bool | str = "grouped"
    pinned_cache_mb: float | None = DEFAULT_PINNED_CACHE_MB
    plain_forwards_auto: bool = field(default=False, init=False)

    def __post_init__(self):
        widths = tuple(self.widths)
        if not widths or any(not _is_int(w) or w < 1 for w in widths):
            raise ValueError(f"widths must be a non-empty list of ints >= 1, got {self.widths!r}")
        if list(widths) != sorted(set(widths)):
            raise ValueError(f"widths must be strictly increasing, got {self.widths!r}")
        if widths[0] != 1:
            widths = (1,) + widths  # the plain decode step is always available (as the controller assumes)
        if not _is_int(self.max_depth) or self.max_depth < 1:
            raise ValueError(f"max_depth must be an int >= 1, got {self.max_depth!r}")
        if self.fixed_width is not None and self.fixed_width not in widths:
            raise ValueError(f"fixed_width={self.fixed_width!r} is not one of widths {widths}")
        if not _is_int(self.capacity) or self.capacity < 1 << 12:
            raise ValueError(f"--speculative-ngram-capacity must be an int >= 4096, got {self.capacity!r}")
        if not _is_int(self.tp_sync_interval) or self.tp_sync_interval < 1:
            raise ValueError(f"tp_sync_interval must be an int >= 1, got {self.tp_sync_interval!r}")
        if not isinstance(self.charge_waits_to_drafts, bool):
            raise ValueError(f"charge_waits_to_drafts must be true or false, got {self.charge_waits_to_drafts!r}")
        if not isinstance(self.plan_backoff, bool) and self.plan_backoff != "auto":
            raise ValueError(f"plan_backoff must be true, false or \"auto\", got {self.plan_backoff!r}")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"prefetch must be true or false, got {self.prefetch!r}")
        if not isinstance(self.preplan, bool) and self.preplan != "auto":
            raise ValueError(f"preplan must be true, false or \"auto\", got {self.preplan!r}")
        for name in ("recycle", "recycle_widen"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("recycle_topk", "recycle_min_match"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        branching = self.recycle_branching
        if (isinstance(branching, (str, bytes)) or not isinstance(branching, (list, tuple)) or not branching
                or any(not _is_int(b) or b < 1 for b in branching)):
            raise ValueError(f"recycle_branching must be a non-empty list of ints >= 1, got {branching!r}")
        object.__setattr__(self, "recycle_branching", tuple(int(b) for b in branching))
        if not isinstance(self.tree, bool):
            raise ValueError(f"tree must be true or false, got {self.tree!r}")
        if not isinstance(self.controller, Mapping):
            raise ValueError(f"controller must be a JSON object, got {self.controller!r}")
        if self.state_file is not None and (not isinstance(self.state_file, str) or not self.state_file):
            raise ValueError(f"state_file must be a file path, got {self.state_file!r}")
        if self.state_file is not None and self.fixed_width is not None:
            raise ValueError("state_file needs the adaptive controller; drop fixed_width or state_file")
        m = self.state_save_minutes
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not m > 0 or m == float("inf"):
            raise ValueError(f"state_save_minutes must be a positive number, got {m!r}")
        if self.plain_forwards is None or self.plain_forwards == "auto":
            object.__setattr__(self, "plain_forwards", min(DEFAULT_PLAIN_FORWARDS, widths[-1]))
            object.__setattr__(self, "plain_forwards_auto", True)
        if not _is_int(self.plain_forwards) or not 1 <= self.plain_forwards <= widths[-1]:
            raise ValueError(f"plain_forwards must be \"auto\" or an int from 1 to the largest width ({widths[-1]}), "
                             f"got {self.plain_forwards!r}")
        if not _is_int(self.plain_forwards_max_batch) or self.plain_forwards_max_batch < 1:
            raise ValueError(f"plain_forwards_max_batch must be an int >= 1, got {self.plain_forwards_max_batch!r}")
        if self.draft_max_batch is not None and (not _is_int(self.draft_max_batch) or self.draft_max_batch < 1):
            raise ValueError(f"draft_max_batch must be an int >= 1, got {self.draft_max_batch!r}")
        if not _is_int(self.device_drafts) or self.device_drafts < 0:
            raise ValueError(f"device_drafts must be an int >= 0, got {self.device_drafts!r}")
        if not isinstance(self.split_kv_verify, bool) and self.split_kv_verify != "grouped":
            raise ValueError(f"split_kv_verify must be true, false or \"grouped\", got {self.split_kv_verify!r}")
        m = self.pinned_cache_mb
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < float("inf")):
            raise ValueError(f"pinned_cache_mb must be a number >= 0 or null, got {m!r}")
        if self.device_drafts and self.recycle:
            raise ValueError("device_drafts and recycle do not go together (device drafts are not recorded for "
                             "recycling); drop one")
        if self.width_cycle is not None:
            cycle = tuple(self.width_cycle) if isinstance(self.width_cycle, (list, tuple)) else ()
            if not cycle or any(not _is_int(w) or w not in widths for w in cycle):
                raise ValueError(f"width_cycle must be a non-empty list of widths from {widths}, got "
                                 f"{self.width_cycle!r}")
            if self.fixed_width is not None or self.state_file is not None:
                raise ValueError("width_cycle replaces the controller: drop fixed_width and state_file")
            object.__setattr__(self, "width_cycle", cycle)
        object.__setattr__(self, "widths", widths)

    @property
    def max_width(self) -> int:
        return self.widths[-1]

    def cache_sizes(self) -> dict[str, int]:
        """NgramCache pool sizes from `capacity` (nodes in all)."""
        half = self.capacity // 2
        return {"local_nodes": half, "shared_nodes": half, "shared_tokens": max(2, self.capacity // 4)}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def widths_up_to(max_width: int, base: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The default candidate widths (`ngramspec.controller.DEFAULT_WIDTHS`) below `max_width`, plus `max_width`
    itself."""
    if base is None:  # imported here: this module stays importable without numba (the plugin's entry point)
        from ngramspec.controller import DEFAULT_WIDTHS as base
    if not _is_int(max_width) or max_width < 1:
        raise ValueError(f"--speculative-num-draft-tokens must be an int >= 1, got {max_width!r}")
    return tuple(w for w in base if w < max_width) + (max_width,)


def load_adaptive_file(path: str) -> dict:
    """Read and check a `--speculative-adaptive-config` JSON file for NGRAM_ADAPTIVE."""
    if not os.path.isfile(path):
        raise ValueError(f"--speculative-adaptive-config {path!r}: no such file")
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-adaptive-config {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--speculative-adaptive-config {path!r} must hold a JSON object")
    unknown = sorted(set(data) - set(ADAPTIVE_CONFIG_KEYS))
    if unknown:
        hint = ""
        if any(k.isdigit() for k in unknown):
            hint = " (that looks like an EAGLE adaptive config keyed by batch size)"
        raise ValueError(
            f"--speculative-adaptive-config {path!r}: unknown key(s) {unknown}{hint}; "
            f"NGRAM_ADAPTIVE accepts {sorted(ADAPTIVE_CONFIG_KEYS)}"
        )
    return data


def resolve_config(args: Any) -> AdaptiveConfig:
    """Build the config from an object with SGLang's `speculative_*` attributes (ServerArgs or a view)."""
    max_width = getattr(args, "speculative_num_draft_tokens", None) or DEFAULT_MAX_WIDTH
    file_path = getattr(args, "speculative_adaptive_config", None)
    data = load_adaptive_file(file_path) if file_path else {}
    widths = tuple(data["widths"]) if "widths" in data else widths_up_to(max_width)
    if "widths" in data and widths and widths[-1] != max_width and getattr(args, "speculative_num_draft_tokens", None):
        raise ValueError(
            f"largest width in {file_path!r} ({widths[-1]}) differs from "
            f"--speculative-num-draft-tokens ({max_width}); make them agree or drop one"
        )
    breadth = getattr(args, "speculative_ngram_max_bfs_breadth", 10)
    return AdaptiveConfig(
        widths=widths,
        tree=data.get("tree", breadth is None or breadth > 1),
        max_depth=data.get("max_depth", getattr(args, "speculative_ngram_max_trie_depth", 18)),
        fixed_width=data.get("fixed_width"),
        capacity=getattr(args, "speculative_ngram_capacity", None) or 10_000_000,
        tp_sync_interval=data.get("tp_sync_interval", DEFAULT_TP_SYNC_INTERVAL),
        controller=data.get("controller", {}),
        state_file=data.get("state_file"),
        state_save_minutes=data.get("state_save_minutes", DEFAULT_STATE_SAVE_MINUTES),
        charge_waits_to_drafts=data.get("charge_waits_to_drafts", AdaptiveConfig.charge_waits_to_drafts),
        plain_forwards=data.get("plain_forwards"),
        plain_forwards_max_batch=data.get("plain_forwards_max_batch", DEFAULT_PLAIN_FORWARDS_MAX_BATCH),
        plan_backoff=data.get("plan_backoff", AdaptiveConfig.plan_backoff),
        prefetch=data.get("prefetch", AdaptiveConfig.prefetch),
        preplan=data.get("preplan", AdaptiveConfig.preplan),
        recycle=data.get("recycle", AdaptiveConfig.recycle),
        recycle_topk=data.get("recycle_topk", AdaptiveConfig.recycle_topk),
        recycle_branching=data.get("recycle_branching", AdaptiveConfig.recycle_branching),
        recycle_min_match=data.get("recycle_min_match", AdaptiveConfig.recycle_min_match),
        recycle_widen=data.get("recycle_widen", AdaptiveConfig.recycle_widen),
        width_cycle=data.get("width_cycle"),
        draft_max_batch=data.get("draft_max_batch", DEFAULT_DRAFT_MAX_BATCH),
        device_drafts=data.get("device_drafts", AdaptiveConfig.device_drafts),
        split_kv_verify=data.get("split_kv_verify", AdaptiveConfig.split_kv_verify),
        pinned_cache_mb=data.get("pinned_cache_mb", DEFAULT_PINNED_CACHE_MB),
    )

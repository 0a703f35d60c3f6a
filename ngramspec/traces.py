"""Trace loading: gzip JSON Lines of recorded generations (format of `shared/traces/README.md`).

Each record needs `prompt` and `output`, non-empty lists of token ids in [0, 2**31); `id` is optional.
The output is taken as the model's greedy continuation of the prompt.
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKEN_LIMIT = 2**31


@dataclass(frozen=True)
class Request:
    id: str
    prompt: np.ndarray  # int32
    output: np.ndarray  # int32


@dataclass(frozen=True)
class Trace:
    name: str
    requests: tuple[Request, ...]

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output) for r in self.requests)

    def head(self, n: int) -> "Trace":
        """The first `n` requests (replay order is file order)."""
        if n < 1:
            raise ValueError(f"need at least one request, got {n}")
        return Trace(self.name, self.requests[:n])


def token_array(values, what: str) -> np.ndarray:
    """Validate a token list and return it as int32; raise ValueError on anything else."""
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) == 0:
        raise ValueError(f"{what} must be a non-empty list of token ids")
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a flat list of integers, got dtype {arr.dtype} shape {arr.shape}")
    if arr.min() < 0 or arr.max() >= TOKEN_LIMIT:
        raise ValueError(f"{what} has token ids outside [0, 2**31)")
    return arr.astype(np.int32)


def make_trace(name: str, records) -> Trace:
    """Build a Trace from dicts with `prompt` and `output` (and optionally `id`)."""
    requests = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or "prompt" not in rec or "output" not in rec:
            raise ValueError(f"{name}: record {i} needs 'prompt' and 'output' fields")
        rid = str(rec.get("id", i))
        requests.append(Request(rid, token_array(rec["prompt"], f"{name}: record {i} prompt"),
                                token_array(rec["output"], f"{name}: record {i} output")))
    if not requests:
        raise ValueError(f"{name}: no records")
    return Trace(name, tuple(requests))


def trace_name(path: str | os.PathLike) -> str:
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def load_trace(path: str | os.PathLike) -> Trace:
    """Load a `.jsonl.gz` (or plain `.jsonl`) trace file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
    return make_trace(trace_name(path), records)


def shared_dir() -> Path | None:
    """`<repo>/../shared` when it exists (read-only data: traces, anchors, calibration), else None."""
    path = Path(__file__).resolve().parent.parent.parent / "shared"
    return path if path.is_dir() else None


def dev_trace_paths() -> list[Path]:
    """The dev traces in `<repo>/../shared/traces`, sorted by name; empty when absent."""
    root = shared_dir()
    if root is None or not (root / "traces").is_dir():
        return []
    return sorted((root / "traces").glob("*.jsonl.gz"))

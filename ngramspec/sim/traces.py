"""Trace loading: JSON Lines (optionally gzip) of recorded generations, one request per line.

A token record has `prompt` and `output`, non-empty lists of token ids in [0, 2**31); `id` is optional.
A text record (`prompt`/`output` strings, or OpenAI-style `messages` with the assistant's reply; see
`ngramspec.text`) is tokenized with the tokenizer passed to `load_trace`. The output is taken as the model's
greedy continuation of the prompt.
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
    skipped: int = 0  # text records left out because their reply was empty

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output) for r in self.requests)

    def head(self, n: int) -> "Trace":
        """The first `n` requests (replay order is file order)."""
        if n < 1:
            raise ValueError(f"need at least one request, got {n}")
        return Trace(self.name, self.requests[:n], self.skipped)


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


def load_trace(path: str | os.PathLike, tokenizer=None, max_requests: int | None = None) -> Trace:
    """Load a `.jsonl.gz` (or plain `.jsonl`) trace file; text records need `tokenizer` (`ngramspec.text`).

    `max_requests` keeps the first N requests (and tokenizes only those). Text records whose reply is empty are
    skipped (a chat log has some, e.g. tool-only turns); how many is in the trace's `skipped`.
    """
    from ngramspec.text import is_text_record, tokenize_record

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    skipped = 0
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if is_text_record(rec):
                if tokenizer is None:
                    raise ValueError(f"{path}:{lineno}: this record holds text, not token ids: pass a tokenizer "
                                     "(ngramspec simulate --tokenizer FOLDER|FILE)")
                rec = tokenize_record(rec, tokenizer, f"{path}:{lineno}")
                if not rec["output"]:
                    skipped += 1
                    continue
                if not rec["prompt"]:
                    raise ValueError(f"{path}:{lineno}: the prompt is empty")
            records.append(rec)
            if max_requests is not None and len(records) == max_requests:
                break
    trace = make_trace(trace_name(path), records)
    return Trace(trace.name, trace.requests, skipped) if skipped else trace


DATA_ENV = "NGRAMSPEC_DATA"


def data_dir() -> Path | None:
    """The folder named by `$NGRAMSPEC_DATA` (dev traces in `traces/`, calibration in `calibration/`), if set
    and present. The library knows no other place: tests and benchmarks point it at their data."""
    value = os.environ.get(DATA_ENV)
    path = Path(value) if value else None
    return path if path is not None and path.is_dir() else None


def dev_trace_paths() -> list[Path]:
    """The `*.jsonl.gz` traces in `$NGRAMSPEC_DATA/traces`, sorted by name; empty when unset or absent."""
    root = data_dir()
    if root is None or not (root / "traces").is_dir():
        return []
    return sorted((root / "traces").glob("*.jsonl.gz"))

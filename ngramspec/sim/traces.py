"""Trace loading: JSON Lines (optionally gzip) of recorded generations, one request per line, or plain text.

A token record has `prompt` and `output`, non-empty lists of token ids in [0, 2**31); `id` is optional.
A text record (`prompt`/`output` strings, or OpenAI-style `messages` with the assistant's reply; see
`ngramspec.text`) is tokenized with the tokenizer passed to `load_trace`. The output is taken as the model's
greedy continuation of the prompt. A plain-text log (`.txt`) holds outputs only: one request per line, or one
per block when blank lines separate them; its first token stands as the prompt (a model never starts from
nothing). Files are UTF-8 (a byte-order mark is allowed); gzip is recognised by its content, whatever the name.
"""
from __future__ import annotations

import codecs
import gzip
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKEN_LIMIT = 2**31
FORMATS = ("accepted: JSON Lines (.jsonl or .jsonl.gz), one request per line, with token ids {\"prompt\": [..], "
           "\"output\": [..]} or text/OpenAI chat records, or plain text (.txt), one request per line or per "
           "blank-line-separated block; text needs --tokenizer (see ngramspec simulate --help)")
# the first bytes of compressed files this reader does not open (gzip it does, by content)
_OTHER_COMPRESSION = {b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"PK\x03\x04": "zip"}


@dataclass(frozen=True)
class Request:
    id: str
    prompt: np.ndarray  # int32
    output: np.ndarray  # int32
    # optional (`topk` in a record): per output token, the model's k most likely tokens of the distribution that
    # produced it, [len(output), k] int32 (what a server's verify scores at the committed positions)
    topk: np.ndarray | None = None


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


def _first_non_int(values) -> str:
    for j, v in enumerate(values):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            return f"item {j + 1} is {json.dumps(v) if isinstance(v, (list, str, float, bool)) else type(v).__name__}"
    return "its items are not integers"


def token_array(values, what: str) -> np.ndarray:
    """Validate a token list and return it as int32; raise ValueError on anything else."""
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) == 0:
        raise ValueError(f"{what} must be a non-empty list of token ids")
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError):  # a ragged nested list
        arr = None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a flat list of integer token ids: {_first_non_int(values)[:80]}")
    if arr.min() < 0 or arr.max() >= TOKEN_LIMIT:
        raise ValueError(f"{what} has token ids outside [0, 2**31)")
    return arr.astype(np.int32)


def topk_array(values, n_out: int, at: str) -> np.ndarray:
    """A record's `topk`: one row of k >= 1 token ids per output token."""
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError):
        arr = None
    if arr is None or arr.ndim != 2 or arr.shape[0] != n_out or arr.shape[1] < 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{at}: topk must hold one row of k >= 1 integer token ids per output token ({n_out})")
    if arr.min() < 0 or arr.max() >= TOKEN_LIMIT:
        raise ValueError(f"{at}: topk has token ids outside [0, 2**31)")
    return arr.astype(np.int32)


def make_trace(name: str, records, where: list[str] | None = None) -> Trace:
    """Build a Trace from dicts with `prompt` and `output` (and optionally `id`); `where[i]` names record i in
    errors (default `NAME: record i+1`, counted from 1 as editors count lines)."""
    requests = []
    for i, rec in enumerate(records):
        at = where[i] if where else f"{name}: record {i + 1}"
        if not isinstance(rec, dict) or "prompt" not in rec or "output" not in rec:
            raise ValueError(f"{at}: a record needs 'prompt' and 'output' fields ({FORMATS})")
        rid = str(rec.get("id", i))
        output = token_array(rec["output"], f"{at}: output")
        requests.append(Request(rid, token_array(rec["prompt"], f"{at}: prompt"), output,
                                None if rec.get("topk") is None else topk_array(rec["topk"], len(output), at)))
    if not requests:
        raise ValueError(f"{name}: no records")
    return Trace(name, tuple(requests))


def trace_name(path: str | os.PathLike) -> str:
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json", ".txt"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def _open_binary(path: Path):
    """The file opened for reading bytes: gunzipped when its content is gzip, whatever its name."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(6)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    if head.startswith(b"\x1f\x8b"):
        return gzip.open(path, "rb")
    kind = next((k for magic, k in _OTHER_COMPRESSION.items() if head.startswith(magic)), None)
    if kind:
        raise ValueError(f"{path}: is {kind}-compressed; only gzip is read (decompress it first)")
    return open(path, "rb")


def read_lines(path: Path):
    """(line number, text) of every line of a UTF-8 file (a byte-order mark is dropped), gzip or not;
    ValueError, one line naming the file, for text that is not UTF-8 or a truncated or corrupt gzip file."""
    lineno = 0
    try:
        with _open_binary(path) as fh:
            for lineno, raw in enumerate(fh, 1):
                if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                    raw = raw[len(codecs.BOM_UTF8):]
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                                     f"{exc.start + 1}); save the log as UTF-8") from None
                yield lineno, text
    except EOFError:
        raise ValueError(f"{path}: the gzip file is truncated (it ends after line {lineno}); copy it again") from None
    except (OSError, zlib.error) as exc:  # e.g. a gzip file's bad CRC or corrupt data
        raise ValueError(f"{path}: corrupt or unreadable after line {lineno} ({exc})") from None


def is_plain_text(path: Path) -> bool:
    return ".txt" in Path(path).suffixes[-2:]


def _jsonl_records(path: Path, tokenizer, max_requests: int | None):
    """(records, where, skipped) of a JSON Lines log."""
    from ngramspec.text import is_text_record, tokenize_record

    records, where, skipped = [], [], 0
    for lineno, line in read_lines(path):
        if not line.strip():
            continue
        at = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            hint = f"; {FORMATS}" if not records else ""  # a first line that is not JSON: not a JSON Lines file
            raise ValueError(f"{at}: not valid JSON ({exc.msg}){hint}") from None
        if is_text_record(rec):
            if tokenizer is None:
                raise ValueError(f"{at}: this record holds text, not token ids: pass a tokenizer "
                                 "(ngramspec simulate --tokenizer FOLDER|FILE)")
            rec = tokenize_record(rec, tokenizer, at)
            if not rec["output"]:
                skipped += 1
                continue
            if not rec["prompt"]:
                raise ValueError(f"{at}: the prompt is empty")
        records.append(rec)
        where.append(at)
        if max_requests is not None and len(records) == max_requests:
            break
    return records, where, skipped


def _text_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of each request of a plain-text log: each line, or each block of lines when blank
    lines separate the file into more than one."""
    blocks: list[list[tuple[int, str]]] = [[]]
    for lineno, line in read_lines(path):
        if line.strip():
            blocks[-1].append((lineno, line))
        elif blocks[-1]:
            blocks.append([])
    blocks = [b for b in blocks if b]
    if len(blocks) == 1:  # no blank line between requests: one request per line
        blocks = [[item] for item in blocks[0]]
    return [(b[0][0], "".join(line for _, line in b).rstrip("\r\n")) for b in blocks]


def _plain_text_records(path: Path, tokenizer, max_requests: int | None):
    """(records, where, skipped) of a plain-text log; a request of fewer than 2 tokens is skipped."""
    from ngramspec.text import tokenize_record

    if tokenizer is None:
        raise ValueError(f"{path}: a plain-text log needs a tokenizer (ngramspec simulate --tokenizer FOLDER|FILE)")
    records, where, skipped = [], [], 0
    for lineno, text in _text_blocks(path):
        ids = tokenize_record({"prompt": "", "output": text}, tokenizer, f"{path}:{lineno}")["output"]
        if len(ids) < 2:
            skipped += 1
            continue
        records.append({"prompt": ids[:1], "output": ids[1:]})
        where.append(f"{path}:{lineno}")
        if max_requests is not None and len(records) == max_requests:
            break
    return records, where, skipped


def load_trace(path: str | os.PathLike, tokenizer=None, max_requests: int | None = None) -> Trace:
    """Load a `.jsonl.gz`, `.jsonl` or plain-text `.txt` log; text needs `tokenizer` (`ngramspec.text`).

    `max_requests` keeps the first N requests (and tokenizes only those). Text records whose reply is empty are
    skipped (a chat log has some, e.g. tool-only turns), as are plain-text requests of fewer than two tokens;
    how many is in the trace's `skipped`. Errors are ValueErrors of one line naming the file and line.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a folder, not a request log; give the log files ({FORMATS})")
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    read = _plain_text_records if is_plain_text(path) else _jsonl_records
    records, where, skipped = read(path, tokenizer, max_requests)
    if not records:
        raise ValueError(f"{path}: no requests in it" + (f" ({skipped} too short or with an empty reply)"
                                                         if skipped else f" ({FORMATS})"))
    trace = make_trace(trace_name(path), records, where)
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

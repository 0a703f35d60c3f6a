"""Benchmark helpers: `core_rows` collects one summary row per core benchmark (bench/test_bench_core.py); the
terminal summary prints them as one Markdown table (ngramspec vs the anchors, same data, same run)."""
from __future__ import annotations

import os

import pytest

_ROWS: list[dict] = []

COLUMNS = [  # (extra_info key, header); times are µs of CPU unless marked wall
    ("trace", "trace"), ("method", "method"), ("batch", "batch"), ("mean_batch", "mean batch"),
    ("insert_us_per_token", "insert /token"), ("append_us_per_token", "append /token"),
    ("kernel_insert_us_per_token", "kernel insert /token"), ("finish_us_per_request", "finish /req"),
    ("put_us", "put /req"),
    ("propose_us_per_request", "propose /req"), ("propose_us_per_request_full_batch", "propose /req, full batch"),
    ("kernel_propose_us_per_request", "kernel propose /req"), ("propose_wall_us_per_request", "propose /req wall"),
    ("accept_len", "tokens/step"), ("drafted_per_step", "drafted/step"),
    ("bytes_allocated", "bytes allocated"), ("live_nodes", "live nodes"), ("cached_tokens", "cached tokens"),
    ("live_bytes_per_cached_token", "live B/cached token"),
]


@pytest.fixture
def core_rows():
    return _ROWS


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def pytest_terminal_summary(terminalreporter):
    if not _ROWS:
        return
    rows = sorted(_ROWS, key=lambda r: (str(r.get("trace")), r.get("batch", 0), str(r.get("method"))))
    used = [(k, h) for k, h in COLUMNS if any(r.get(k) is not None for r in rows)]
    tr = terminalreporter
    tr.section("core cache: ngramspec vs anchors (same traces, same run)")
    loads = [r["load_average_1min"] for r in rows if r.get("load_average_1min") is not None]
    if loads:
        tr.write_line(f"times in µs of process CPU time (wall where marked); 1-min load average during the run "
                      f"{min(loads):.1f}..{max(loads):.1f} on {os.cpu_count()} CPUs")
    tr.write_line("| " + " | ".join(h for _, h in used) + " |")
    tr.write_line("|" + "|".join("---" for _ in used) + "|")
    for r in rows:
        tr.write_line("| " + " | ".join(_fmt(r.get(k)) for k, _ in used) + " |")

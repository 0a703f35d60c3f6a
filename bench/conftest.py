"""Benchmark helpers: `core_rows` collects one summary row per core benchmark (bench/test_bench_core.py); the
terminal summary prints them as one Markdown table (ngramspec vs the anchors, same data, same run)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# the library reads dev traces only from $NGRAMSPEC_DATA: point it at the shared data beside the repository
_SHARED = Path(__file__).resolve().parents[2] / "shared"
if _SHARED.is_dir():
    os.environ.setdefault("NGRAMSPEC_DATA", str(_SHARED))

_ROWS: list[dict] = []
_SIM_ROWS: list[dict] = []

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


@pytest.fixture
def sim_rows():
    """Summary rows of the replay benchmarks (bench/test_bench_sim.py), printed at the end."""
    return _SIM_ROWS


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _sim_summary(tr) -> None:
    rows = sorted(_SIM_ROWS, key=lambda r: (r["batch"], r["method"]))
    profiles = sorted({k[len("speedup_"):] for r in rows for k in r if k.startswith("speedup_")})
    tr.section("replay: accept length and simulated speedup vs plain decoding (same trace, same run)")
    heads = ["trace", "method", "batch", "tokens/step", "drafted/step", "accept rate"] + \
        [f"speedup {p}" for p in profiles] + ["proposer µs/token", "replay tok/s"]
    tr.write_line("| " + " | ".join(heads) + " |")
    tr.write_line("|" + "|".join("---" for _ in heads) + "|")
    for r in rows:
        cells = [r["trace"], r["method"], r["batch"], r["accept_len"], r["drafted_per_step"], r["accept_rate"]] + \
            [r.get(f"speedup_{p}") for p in profiles] + [r["proposer_us_per_token"], r["replay_tokens_per_s"]]
        tr.write_line("| " + " | ".join(_fmt(c) for c in cells) + " |")


def pytest_terminal_summary(terminalreporter):
    if _SIM_ROWS:
        _sim_summary(terminalreporter)
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

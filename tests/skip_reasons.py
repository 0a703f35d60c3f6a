"""Skip reasons as one line: what is missing and how to get it. `pytest.importorskip` puts the whole import
error in the reason, and some import errors run to 20 lines (numpy's and torch's advice on broken installs).
tests/conftest.py installs the hooks; `pytest -p skip_reasons` does too, for a test run of its own."""
from __future__ import annotations

import re

import pytest

from ngramspec.cli import _EXTRAS


def one_line_reason(reason: str) -> str:
    """`could not import 'X': ...` -> which package is missing and the pip command; any other reason -> its
    first non-empty line (with ` ...` when there was more)."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    if not lines:
        return reason
    found = re.match(r"could not import '([\w.]+)': ?(.*)", reason, re.S)
    if found:
        detail = " ".join(found.group(2).split())
        missing = re.search(r"No module named '([\w.]+)'", detail)
        name = (missing.group(1) if missing else found.group(1)).split(".")[0]
        how = f"pip install '{_EXTRAS.get(name, name)}'"
        if missing:
            return f"needs the package {name!r}, not installed ({how})"
        first = next((line.strip() for line in found.group(2).splitlines() if line.strip()), "")
        return f"{found.group(1)!r} does not import ({first[:120]}); reinstall it ({how})"
    return lines[0] + (" ..." if len(lines) > 1 else "")


def _shorten(report) -> None:
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        path, lineno, reason = report.longrepr
        prefix = "Skipped: " if reason.startswith("Skipped: ") else ""
        report.longrepr = (path, lineno, prefix + one_line_reason(reason[len(prefix):]))


@pytest.hookimpl(tryfirst=True)
def pytest_collectreport(report) -> None:
    _shorten(report)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report) -> None:
    _shorten(report)

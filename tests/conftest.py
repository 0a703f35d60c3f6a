"""Test data: the library reads dev traces and calibration only from `$NGRAMSPEC_DATA`; the tests point it at
the project's shared data folder beside the repository (`../shared`) when that exists and it is unset.
Skip reasons are cut to one line naming what is missing and how to get it (`skip_reasons`)."""
import os
from pathlib import Path

from skip_reasons import pytest_collectreport, pytest_runtest_logreport  # noqa: F401 (hooks)

_SHARED = Path(__file__).resolve().parents[2] / "shared"
if _SHARED.is_dir():
    os.environ.setdefault("NGRAMSPEC_DATA", str(_SHARED))

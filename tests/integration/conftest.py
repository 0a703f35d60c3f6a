"""Make `ngramspec_sglang` importable from a plain checkout (it ships from integration/ when installed)."""
import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("ngramspec_sglang") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))

"""Cost profiles: the time of one batched step of `batch` sequences, each verifying `width` tokens.

`width` counts the root, so width 1 is a plain decode step. Built in:

- `seed-pcie8`: decode 12.2 ms; a verify of width n > 1 costs 22.5 + 2.5 n ms (any batch size).
- `h200-llama8b`: the CUDA-graph (`graph_ms`) chain rows of `shared/calibration/h200_llama8b_sdpa.json`,
  interpolated piecewise-linearly over batch and width.

Any JSON file of that shape (`{"rows": [{"B": .., "k": .., "graph_ms": .., "kind": "chain"}, ...]}`) is a
profile too: `--profile FILE.json`, or `FILE.json:COLUMN` to read another column (e.g. `eager_ms`).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ngramspec.traces import shared_dir

CALIBRATION_FILE = "h200_llama8b_sdpa.json"


class CostProfile:
    name: str

    def cost_ms(self, batch: int, width: int) -> float:
        raise NotImplementedError

    def total_ms(self, step_counts: dict[tuple[int, int], int]) -> float:
        """Total time of a replay given how many steps ran at each (batch, width)."""
        return float(sum(n * self.cost_ms(b, w) for (b, w), n in step_counts.items()))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def _check_shape(batch: int, width: int) -> None:
    if batch < 1 or width < 1:
        raise ValueError(f"batch and width must be >= 1, got batch={batch} width={width}")


class LinearProfile(CostProfile):
    """Decode costs `decode_ms`; a verify of width n > 1 costs `verify_base_ms + verify_per_token_ms * n`."""

    def __init__(self, name: str, decode_ms: float, verify_base_ms: float, verify_per_token_ms: float):
        if decode_ms <= 0 or verify_base_ms < 0 or verify_per_token_ms < 0 or verify_base_ms + verify_per_token_ms <= 0:
            raise ValueError(f"{name}: step costs must be positive")
        self.name = name
        self.decode_ms = decode_ms
        self.verify_base_ms = verify_base_ms
        self.verify_per_token_ms = verify_per_token_ms

    def cost_ms(self, batch: int, width: int) -> float:
        _check_shape(batch, width)
        if width == 1:
            return self.decode_ms
        return self.verify_base_ms + self.verify_per_token_ms * width


def _interp(x: float, grid: np.ndarray, values: np.ndarray) -> float:
    """Piecewise-linear interpolation along the last axis; linear extrapolation past either end."""
    if len(grid) == 1:
        return float(values[..., 0])
    i = int(np.clip(np.searchsorted(grid, x) - 1, 0, len(grid) - 2))
    t = (x - grid[i]) / (grid[i + 1] - grid[i])
    return float(values[..., i] * (1 - t) + values[..., i + 1] * t)


class TableProfile(CostProfile):
    """Measured step times on a (batch x width) grid, interpolated piecewise-linearly in both."""

    def __init__(self, name: str, batches, widths, ms):
        self.name = name
        self.batches = np.asarray(batches, dtype=np.float64)
        self.widths = np.asarray(widths, dtype=np.float64)
        self.ms = np.asarray(ms, dtype=np.float64)
        if self.ms.shape != (len(self.batches), len(self.widths)):
            raise ValueError(f"{name}: cost table shape {self.ms.shape} does not match the grid")
        if not (np.all(np.diff(self.batches) > 0) and np.all(np.diff(self.widths) > 0)):
            raise ValueError(f"{name}: batch and width grids must be strictly increasing")
        if self.widths[0] != 1:
            raise ValueError(f"{name}: the table needs width 1 (plain decode)")
        if not np.all(self.ms > 0):
            raise ValueError(f"{name}: step times must be positive")
        self._cache: dict[tuple[int, int], float] = {}

    def cost_ms(self, batch: int, width: int) -> float:
        key = (batch, width)
        hit = self._cache.get(key)
        if hit is None:
            _check_shape(batch, width)
            by_batch = np.array([_interp(width, self.widths, row) for row in self.ms])
            hit = max(_interp(batch, self.batches, by_batch), 1e-6)
            self._cache[key] = hit
        return hit

    @classmethod
    def from_json(cls, path: str | Path, column: str = "graph_ms", name: str | None = None) -> "TableProfile":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"profile file not found: {path}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg})") from None
        rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{path}: expected an object with a non-empty 'rows' list")
        table: dict[tuple[int, int], float] = {}
        for i, row in enumerate(rows):
            if not all(key in row for key in ("B", "k", column)):
                raise ValueError(f"{path}: row {i} needs 'B', 'k' and '{column}'")
            if row.get("kind", "chain") != "chain":
                continue
            table[(int(row["B"]), int(row["k"]))] = float(row[column])
        batches = sorted({b for b, _ in table})
        widths = sorted({k for _, k in table})
        missing = [(b, k) for b in batches for k in widths if (b, k) not in table]
        if missing:
            raise ValueError(f"{path}: the (B, k) grid is incomplete, missing {missing[:5]}")
        ms = [[table[(b, k)] for k in widths] for b in batches]
        return cls(name or path.stem, batches, widths, ms)


SEED_PCIE8 = LinearProfile("seed-pcie8", decode_ms=12.2, verify_base_ms=22.5, verify_per_token_ms=2.5)


def calibration_path() -> Path | None:
    root = shared_dir()
    path = root / "calibration" / CALIBRATION_FILE if root else None
    return path if path and path.is_file() else None


def get_profile(spec: str) -> CostProfile:
    """A profile by name (`seed-pcie8`, `h200-llama8b`) or JSON file (`FILE.json` or `FILE.json:COLUMN`)."""
    if spec == "seed-pcie8":
        return SEED_PCIE8
    if spec == "h200-llama8b":
        path = calibration_path()
        if path is None:
            raise FileNotFoundError(f"h200-llama8b needs <repo>/../shared/calibration/{CALIBRATION_FILE}")
        return TableProfile.from_json(path, "graph_ms", name="h200-llama8b")
    path, _, column = spec.partition(".json:")
    if column:
        return TableProfile.from_json(path + ".json", column)
    if spec.endswith(".json"):
        return TableProfile.from_json(spec)
    raise ValueError(f"unknown profile {spec!r}: use seed-pcie8, h200-llama8b or a FILE.json cost table")


BUILTIN_PROFILES = ("seed-pcie8", "h200-llama8b")

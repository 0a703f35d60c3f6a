"""The controller's cost model c(B, n): the time of a step of B requests verified at width n, learned online
from the step durations the server reports, over a prior's shape; and the calibration tables (from
`ngramspec calibrate`) a prior may come from.

The learned state is one bundle of flat arrays (``CostState``) that the numba kernels take whole.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np
from numba import njit

from ngramspec._cache_api import Direct
from ngramspec.controller.protocol import DEFAULT_WIDTHS, check_widths, is_int

# a first sample of a (batch size, width) capped at `clip` times what the others imply (most likely a stall: a
# compile, a GC pause) may be re-measured after stale_after // SUSPECT_DIV samples instead of stale_after
SUSPECT_DIV = 10

def default_prior(batch: int, width: int) -> float:
    """Conservative relative cost when nothing is known: a verify of n tokens costs 2 + 0.25 (n - 1) decodes.
    (The seed PCIe deployment measured 2.25 at n = 2; a single H200 1.3: erring high only delays drafting.)"""
    return 1.0 if width <= 1 else 2.0 + 0.25 * (width - 1)


def batch_bucket(batch: int) -> int:
    return batch if batch <= 4 else 1 << (batch - 1).bit_length()


# ------------------------------------------------------------------------------------- calibration tables
def interp(x: float, grid: np.ndarray, values: np.ndarray) -> float:
    """Piecewise-linear interpolation along the last axis; linear extrapolation past either end."""
    if len(grid) == 1:
        return float(values[..., 0])
    i = int(np.clip(np.searchsorted(grid, x) - 1, 0, len(grid) - 2))
    t = (x - grid[i]) / (grid[i + 1] - grid[i])
    return float(values[..., i] * (1 - t) + values[..., i + 1] * t)


def read_json(path: Path) -> dict:
    """A cost file's JSON, with a clear error for a missing file or bad JSON."""
    if not path.is_file():
        raise FileNotFoundError(f"profile file not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg})") from None


def check_shape(batch: int, width: int) -> None:
    """ValueError unless batch and width are >= 1."""
    if batch < 1 or width < 1:
        raise ValueError(f"batch and width must be >= 1, got batch={batch} width={width}")


class CostTable:
    """Measured step times on a (batch x width) grid, interpolated piecewise-linearly in both: a calibration
    file (`ngramspec calibrate`: ``{"rows": [{"B": .., "k": .., "graph_ms": .., "eager_ms": .., "kind":
    "chain"}, ...]}``)."""

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
            check_shape(batch, width)
            by_batch = np.array([interp(width, self.widths, row) for row in self.ms])
            hit = max(interp(batch, self.batches, by_batch), 1e-6)
            self._cache[key] = hit
        return hit

    @classmethod
    def from_json(cls, path: str | Path, column: str | None = None, name: str | None = None):
        path = Path(path)
        return cls.from_data(read_json(path), column, name=name or path.stem, source=str(path))

    @classmethod
    def from_data(cls, data, column: str | None, name: str, source: str):
        """From a calibration object; `column` None reads `graph_ms`, or `eager_ms` where no row has `graph_ms`."""
        rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{source}: expected an object with a non-empty 'rows' list")
        chain_rows = [r for r in rows if r.get("kind", "chain") == "chain"]
        if column is None:
            column = "graph_ms" if any(r.get("graph_ms") is not None for r in chain_rows) else "eager_ms"
        table: dict[tuple[int, int], float] = {}
        for i, row in enumerate(rows):
            if not all(row.get(key) is not None for key in ("B", "k", column)):
                raise ValueError(f"{source}: row {i} needs 'B', 'k' and '{column}'")
            if row.get("kind", "chain") != "chain":
                continue
            table[(int(row["B"]), int(row["k"]))] = float(row[column])
        batches = sorted({b for b, _ in table})
        widths = sorted({k for _, k in table})
        missing = [(b, k) for b in batches for k in widths if (b, k) not in table]
        if missing:
            raise ValueError(f"{source}: the (B, k) grid is incomplete, missing {missing[:5]}")
        ms = [[table[(b, k)] for k in widths] for b in batches]
        return cls(name, batches, widths, ms)


def prior_from_calibration(path: str, column: str = "graph_ms") -> Callable[[int, int], float]:
    """c(B, n) from a calibration JSON (rows of B, k, kind, eager_ms, graph_ms), interpolated over B and n."""
    return CostTable.from_json(path, column).cost_ms


# ---------------------------------------------------------------------------------------------- cost model
class CostState(NamedTuple):
    """The cost model's learned state, the bundle its kernels take. Rows are batch sizes, columns width indices."""

    ewma: np.ndarray  # [batch, width] float64: moving average of the measured step time (nan: never measured)
    last: np.ndarray  # [batch, width] int64: clock of the latest sample (-1: none)
    prior: np.ndarray  # [batch, width] float64: the prior, tabulated
    blist: np.ndarray  # [width, k] int64: the batch sizes measured at each width, in order of first measurement
    nblist: np.ndarray  # [width] int64: how many of them
    ratio: np.ndarray  # [bucket] float64: measured / prior, moving average per batch bucket
    has_ratio: np.ndarray  # [bucket] bool: the bucket has a ratio
    global_ratio: np.ndarray  # [1] float64: measured / prior, moving average over every sample
    has_global: np.ndarray  # [1] bool: any sample yet


class CostRow(NamedTuple):
    """Per width at one batch size: the estimate, whether measured near it, whether that measurement is stale,
    and the estimate the other widths imply for it."""

    costs: np.ndarray
    measured: np.ndarray
    stale: np.ndarray
    implied: np.ndarray


@njit(cache=True)
def _bucket_id(b):
    """Index of ``batch_bucket(b)``: 1-4 as themselves, then one per power of two."""
    if b <= 4:
        return b
    k = 0
    x = b - 1
    while x > 0:
        x >>= 1
        k += 1
    return k + 2


@njit(cache=True)
def _nearest_measured(s, B, wi):
    """The measured batch size of width index ``wi`` nearest to B in ratio (the smaller on a tie); -1: none."""
    blist, nblist = s.blist, s.nblist
    best_b = -1
    best_d = np.inf
    for k in range(nblist[wi]):
        b = blist[wi, k]
        d = abs(math.log(b / B))
        if d < best_d or (d == best_d and b < best_b):
            best_d = d
            best_b = b
    return best_b


@njit(cache=True)
def _prior_scale(s, B):
    """Measured over prior: the batch bucket's ratio, else the global one; NaN when nothing is measured."""
    bi = _bucket_id(B)
    if bi < s.has_ratio.shape[0] and s.has_ratio[bi]:
        return s.ratio[bi]
    if s.has_global[0]:
        return s.global_ratio[0]
    return np.nan


@njit(cache=True)
def _first_ref(s, B, wi):
    """What the samples so far imply for c(B, width wi), not yet measured: the nearest measured batch size of
    the same width rescaled by the prior's shape, else the prior times `_prior_scale`; NaN when nothing is
    measured."""
    best_b = _nearest_measured(s, B, wi)
    if best_b > 0:
        return s.ewma[best_b, wi] * s.prior[B, wi] / s.prior[best_b, wi]
    return s.prior[B, wi] * _prior_scale(s, B)


@njit(cache=True)
def _cost_observe(s, B, wi, ms, alpha, clip, clock, stale_after):
    """One measured step. Updates are clipped to [old / clip, old * clip] (clip <= 0: not clipped). The first
    sample of a (B, width), and of a batch bucket's ratio to the prior, is capped at ``clip`` times what the
    samples so far imply for it (`_first_ref`; nothing measured yet: not capped): a stall makes a step longer,
    never shorter, and an overestimate is never corrected if it keeps the width from being chosen again, while
    an underestimate is measured away as soon as the width is chosen. A key not measured for ``stale_after``
    steps (<= 0: never stale) restarts from the new sample, likewise capped at ``clip`` times its old value.
    Returns False, and changes nothing, when a first sample of this (B, width) finds no room in ``blist`` (the
    caller grows it)."""
    ewma, last, blist, nblist, prior = s.ewma, s.last, s.blist, s.nblist, s.prior
    ratio, has_ratio = s.ratio, s.has_ratio
    g, has_g = s.global_ratio, s.has_global
    old = ewma[B, wi]
    if np.isnan(old) and nblist[wi] >= blist.shape[1]:
        return False
    suspect = False
    if np.isnan(old):
        x = ms
        ref = _first_ref(s, B, wi) if clip > 0 else np.nan
        if not np.isnan(ref) and x > ref * clip:
            x = ref * clip
            suspect = True
        ewma[B, wi] = x
        k = nblist[wi]
        blist[wi, k] = B
        nblist[wi] = k + 1
    elif stale_after > 0 and clock - last[B, wi] > stale_after:
        ewma[B, wi] = min(ms, old * clip) if clip > 0 else ms
    else:
        x = ms
        if clip > 0:
            x = min(max(x, old / clip), old * clip)
        ewma[B, wi] = old + alpha * (x - old)
    last[B, wi] = clock
    if suspect and stale_after > 0:  # a first sample at the cap is likely a stall: stale after a tenth of the wait
        last[B, wi] = clock - stale_after + max(1, stale_after // SUSPECT_DIV)
    r = ms / prior[B, wi]
    bi = _bucket_id(B)
    if not has_ratio[bi]:
        if clip > 0 and has_g[0]:
            r = min(r, g[0] * clip)
        ratio[bi] = r
        has_ratio[bi] = True
    else:
        x = r
        if clip > 0:
            x = min(max(x, ratio[bi] / clip), ratio[bi] * clip)
        ratio[bi] = ratio[bi] + alpha * (x - ratio[bi])
    if not has_g[0]:
        g[0] = r
        has_g[0] = True
    else:
        x = r
        if clip > 0:
            x = min(max(x, g[0] / clip), g[0] * clip)
        g[0] = g[0] + alpha * (x - g[0])
    return True


@njit(cache=True)
def _cost_row(s, B, widths, exclude, out, direct):
    """c(B, w) for every width into ``out``; width index ``exclude`` (-1: none) is treated as never measured.
    ``direct``: scratch of one float per width."""
    ewma, prior = s.ewma, s.prior
    W = widths.shape[0]
    nb = ewma.shape[0]
    for wi in range(W):
        direct[wi] = np.nan
        if wi == exclude:
            continue
        if B < nb and not np.isnan(ewma[B, wi]):
            direct[wi] = ewma[B, wi]
            continue
        best_b = _nearest_measured(s, B, wi)
        if best_b > 0:
            direct[wi] = ewma[best_b, wi] * prior[B, wi] / prior[best_b, wi]
    for wi in range(W):
        if not np.isnan(direct[wi]):
            out[wi] = direct[wi]
            continue
        w = widths[wi]
        if w > 1:
            lo = -1
            lo2 = -1
            hi = -1
            hi2 = -1
            for v in range(W):
                if widths[v] <= 1 or np.isnan(direct[v]):
                    continue
                if widths[v] < w:
                    lo2 = lo
                    lo = v
                elif widths[v] > w:
                    if hi < 0:
                        hi = v
                    elif hi2 < 0:
                        hi2 = v
            if lo >= 0 and hi >= 0:  # between two measured verify widths: interpolate their ratios to the prior
                r_lo = direct[lo] / prior[B, lo]
                r_hi = direct[hi] / prior[B, hi]
                t = (w - widths[lo]) / (widths[hi] - widths[lo])
                out[wi] = prior[B, wi] * ((1 - t) * r_lo + t * r_hi)
                continue
            # outside: extend the measured slope (never downhill); below a pair whose wider width came out cheaper
            # the slope is noise, and the nearest width scales the prior's shape (the one-width case below)
            if lo >= 0 and lo2 >= 0 or lo < 0 and hi2 >= 0 and direct[hi2] >= direct[hi]:
                if lo >= 0:
                    w0, w1 = lo2, lo
                else:
                    w0, w1 = hi, hi2
                c0 = direct[w0]
                c1 = direct[w1]
                slope = max(0.0, (c1 - c0) / (widths[w1] - widths[w0]))
                if lo >= 0:
                    out[wi] = max(1e-9, c1 + slope * (w - widths[w1]))
                else:
                    out[wi] = max(1e-9, c0 + slope * (w - widths[w0]))
                continue
            side = lo if lo >= 0 else hi
            if side >= 0:
                out[wi] = prior[B, wi] * direct[side] / prior[B, side]
                continue
        scale = _prior_scale(s, B)
        out[wi] = prior[B, wi] * (1.0 if np.isnan(scale) else scale)


@njit(cache=True)
def _cost_near(s, B, widths, clock, stale_after, measured, stale):
    """Per width: measured at a batch size within a factor of two of B; and if so, whether all such
    measurements are older than ``stale_after`` steps."""
    last, blist, nblist = s.last, s.blist, s.nblist
    for wi in range(widths.shape[0]):
        newest = -(1 << 62)  # a suspect first sample's time may lie before the clock's start (`_cost_observe`)
        found = False
        for k in range(nblist[wi]):
            b = blist[wi, k]
            if B <= 2 * b and b <= 2 * B:
                found = True
                if last[b, wi] > newest:
                    newest = last[b, wi]
        measured[wi] = found
        stale[wi] = found and stale_after > 0 and clock - newest > stale_after


@njit(cache=True)
def _cost_row_all(s, B, widths, clock, stale_after, costs, measured, stale, implied, tmp):
    """A whole `CostRow` in one call: ``_cost_row`` into ``costs``, ``_cost_near`` into ``measured`` / ``stale``,
    and ``implied``: ``costs``, but for a stale width the estimate the other widths imply for it. ``tmp``: scratch
    of two floats per width. Allocates nothing (it runs in the step kernel, compiled without numba's reference
    counting: see ``choose._ctl_step``)."""
    W = widths.shape[0]
    direct = tmp[W:]
    _cost_row(s, B, widths, -1, costs, direct)
    _cost_near(s, B, widths, clock, stale_after, measured, stale)
    for wi in range(W):
        implied[wi] = costs[wi]
        if stale[wi]:
            _cost_row(s, B, widths, wi, tmp, direct)
            implied[wi] = tmp[wi]


class CostModel:
    """Online c(B, n) over the verify widths ``widths``. A measured (B, n) is a moving average of its samples,
    each update clipped to a factor ``clip`` of the current value (``clip=None``: plain EWMA). An unmeasured
    batch size borrows the nearest measured batch size of the same width, rescaled by the prior's shape; an
    unmeasured width is interpolated between measured widths, extended along their slope, or the prior times
    the ratio measured / prior (per batch bucket, else anywhere, else 1). A (B, n) not measured for
    ``stale_after`` samples (``None``: never) restarts from its next sample. State: flat arrays, kernels in
    numba; the prior is tabulated once per batch size."""

    def __init__(self, prior: Callable[[int, int], float] = default_prior, alpha: float = 0.2,
                 widths: Sequence[int] = DEFAULT_WIDTHS, clip: float | None = 2.0, stale_after: int | None = 500):
        self.prior = prior
        self.alpha = float(alpha)
        ws = check_widths(widths)
        if clip is not None and not clip > 1:
            raise ValueError(f"clip must be > 1 or None, got {clip!r}")
        if stale_after is not None and (not is_int(stale_after) or stale_after < 1):
            raise ValueError(f"stale_after must be an int >= 1 or None, got {stale_after!r}")
        self.widths = ws
        self._w = np.asarray(ws, np.int64)
        self._wi = {w: i for i, w in enumerate(ws)}
        self.clip = 0.0 if clip is None else float(clip)
        self.stale_after = 0 if stale_after is None else int(stale_after)
        self.clock = 0  # samples observed
        W = len(ws)
        self.state = CostState(ewma=np.full((2, W), np.nan), last=np.full((2, W), -1, np.int64),
                               prior=np.zeros((2, W)), blist=np.zeros((W, 8), np.int64),
                               nblist=np.zeros(W, np.int64), ratio=np.zeros(40), has_ratio=np.zeros(40, np.bool_),
                               global_ratio=np.zeros(1), has_global=np.zeros(1, np.bool_))
        self._prior_rows = 0  # rows of state.prior filled (batch sizes 1 .. _prior_rows - 1)
        self._rows: dict = {}
        # the kernels through their compiled entry points (numba's per-call dispatch costs a few us; see Direct)
        self._observe_kernel = Direct(self, "_observe_kernel", _cost_observe)
        self._row_kernel = Direct(self, "_row_kernel", _cost_row_all)

    def _ensure(self, batch: int) -> None:
        """Grow the tables to hold batch size ``batch`` and tabulate the prior up to it."""
        s = self.state
        if batch >= s.ewma.shape[0]:
            n = max(batch + 1, 2 * s.ewma.shape[0])
            W = len(self.widths)
            grown = {}
            for name, fill, dt in (("ewma", np.nan, np.float64), ("last", -1, np.int64), ("prior", 0.0, np.float64)):
                old = getattr(s, name)
                new = np.full((n, W), fill, dt)
                new[: old.shape[0]] = old
                grown[name] = new
            self.state = s._replace(**grown)
        if batch >= self._prior_rows:
            for b in range(max(1, self._prior_rows), batch + 1):
                row = [float(self.prior(b, w)) for w in self.widths]
                if not all(v > 0 and math.isfinite(v) for v in row):
                    raise ValueError(f"the cost prior must be positive and finite, got {row} at batch {b}")
                self.state.prior[b] = row
            self._prior_rows = batch + 1

    def _check(self, batch, width) -> int:
        if not is_int(batch) or batch < 1:
            raise ValueError(f"batch size must be an integer >= 1, got {batch!r}")
        if not is_int(width) or int(width) not in self._wi:
            raise ValueError(f"width must be one of {self.widths}, got {width!r}")
        return self._wi[int(width)]

    def observe(self, batch: int, width: int, ms: float) -> None:
        """A measured step of ``batch`` requests at ``width``: ``ms``. ValueError, and nothing changes, for a
        batch size < 1, a width not in ``widths`` or a duration that is not a positive finite number."""
        if type(batch) is int and type(ms) is float and 0 < batch < self._prior_rows and 0.0 < ms < math.inf:
            wi = self._wi.get(width) if type(width) is int else None  # the common case, checked in one line
            if wi is not None and self._observe_kernel(self.state, batch, wi, ms, self.alpha, self.clip,
                                                       self.clock + 1, self.stale_after):
                self.clock += 1
                self._rows.clear()
                return
        wi = self._check(batch, width)
        if isinstance(ms, (bool, np.bool_)) or not isinstance(ms, (int, float, np.integer, np.floating)) \
                or not (ms > 0 and math.isfinite(ms)):
            raise ValueError(f"step duration must be a positive finite number of ms, got {ms!r}")
        batch = int(batch)
        self._ensure(batch)
        s = self.state
        if s.nblist[wi] >= s.blist.shape[1] and np.isnan(s.ewma[batch, wi]):
            grown = np.zeros((s.blist.shape[0], 2 * s.blist.shape[1]), np.int64)
            grown[:, : s.blist.shape[1]] = s.blist
            self.state = s = s._replace(blist=grown)
        if batch_bucket(batch) > 1 << 36:
            raise ValueError(f"batch size {batch} is out of range")
        self._observe_kernel(s, batch, wi, float(ms), self.alpha, self.clip, self.clock + 1, self.stale_after)
        self.clock += 1
        self._rows.clear()

    def row(self, batch: int) -> CostRow:
        """(c(B, n), measured near B, stale near B, c(B, n) as the other widths imply it) for every width;
        cached until the next observe. Do not modify the arrays."""
        got = self._rows.get(batch)
        if got is not None:
            return got
        if batch >= self._prior_rows:
            self._ensure(batch)
        W = len(self.widths)
        costs, implied, tmp = np.empty(W), np.empty(W), np.empty(2 * W)
        measured, stale = np.empty(W, np.bool_), np.empty(W, np.bool_)
        self._row_kernel(self.state, int(batch), self._w, self.clock, self.stale_after, costs, measured, stale,
                         implied, tmp)
        got = CostRow(costs, measured, stale, implied)
        if len(self._rows) > 64:
            self._rows.clear()
        self._rows[batch] = got
        return got

    def measured(self, batch: int, width: int) -> bool:
        """Whether this width was measured at a batch size within a factor of two of ``batch``."""
        wi = self._check(batch, width)
        return bool(self.row(int(batch))[1][wi])

    def estimate(self, batch: int, width: int) -> float:
        wi = self._check(batch, width)
        return float(self.row(int(batch))[0][wi])

    # ------------------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, np.ndarray]:
        """The learned state as named arrays (copies): the ``CostState`` fields, the sample clock and how many
        batch sizes of the prior are tabulated (the prior itself is not saved state: it is checked on load)."""
        out = {f"cost_{name}": np.array(a, copy=True) for name, a in zip(CostState._fields, self.state)}
        out["cost_clock"] = np.array([self.clock], np.int64)
        out["cost_prior_rows"] = np.array([self._prior_rows], np.int64)
        return out

    def load_state_dict(self, data: dict) -> None:
        """Replace the learned state with ``data`` (from ``state_dict``). ValueError, and nothing changes, if
        it does not fit these widths or was learned under a different prior (the ratios measured / prior
        would mean something else)."""
        W = len(self.widths)
        try:
            arrays = {name: np.asarray(data[f"cost_{name}"]) for name in CostState._fields}
            clock = int(np.asarray(data["cost_clock"]).reshape(-1)[0])
            prior_rows = int(np.asarray(data["cost_prior_rows"]).reshape(-1)[0])
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"cost state is incomplete or malformed: {e}") from None
        dtypes = {"last": np.int64, "blist": np.int64, "nblist": np.int64, "has_ratio": np.bool_,
                  "has_global": np.bool_}
        fixed = {"nblist": (W,), "ratio": (40,), "has_ratio": (40,), "global_ratio": (1,), "has_global": (1,)}
        rows = arrays["ewma"].shape[0] if arrays["ewma"].ndim == 2 else -1
        for name, a in arrays.items():
            if a.dtype != np.dtype(dtypes.get(name, np.float64)):
                raise ValueError(f"cost state: {name} has dtype {a.dtype}, expected "
                                 f"{np.dtype(dtypes.get(name, np.float64))}")
            if name in fixed:
                ok = a.shape == fixed[name]
            elif name == "blist":
                ok = a.ndim == 2 and a.shape[0] == W
            else:
                ok = a.shape == (rows, W)
            if not ok or rows < 2:
                raise ValueError(f"cost state: {name} has shape {a.shape}, which does not fit {W} widths "
                                 f"{self.widths} (the state was saved with other widths?)")
        if not 1 <= prior_rows <= rows or clock < 0:
            raise ValueError(f"cost state: bad clock {clock} or prior rows {prior_rows}")
        nb = arrays["nblist"]
        if nb.min() < 0 or nb.max() > arrays["blist"].shape[1] or any(
                np.any((arrays["blist"][wi, :k] < 1) | (arrays["blist"][wi, :k] >= rows)) for wi, k in enumerate(nb)):
            raise ValueError("cost state: the measured batch lists are inconsistent")
        saved_prior = arrays["prior"]
        mine = np.zeros_like(saved_prior)
        for b in range(1, prior_rows):
            mine[b] = [float(self.prior(b, w)) for w in self.widths]
        if not np.allclose(mine[1:prior_rows], saved_prior[1:prior_rows], rtol=1e-9, atol=0.0):
            raise ValueError("cost state was learned under a different cost prior; load it into a controller "
                             "with the same prior (or start cold)")
        self.state = CostState(**{name: arrays[name].copy() for name in CostState._fields})
        self.clock = clock
        self._prior_rows = prior_rows
        self._rows.clear()

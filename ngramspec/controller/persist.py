"""The adaptive controller's learned state, saved and loaded: the acceptance counts, the cost model's state and
the step counters (`Persisting`), in a small .npz file (`read_state_file`). Not the per-request state: a
restarted server starts with no requests."""
from __future__ import annotations

import os

import numpy as np

from ngramspec.controller.calibration import Calibration

_COUNTS = Calibration._fields[:6]  # the Beta counts: every state has them
STATE_FORMAT = "ngramspec-controller-state"
STATE_VERSION = 2  # 2: a third draft source (token recycling) in the calibration tables


class Persisting:
    """`AdaptiveController`'s persistence: `state_dict` / `load_state_dict` (named arrays), `save_state` /
    `load_state` (a file)."""

    def state_dict(self) -> dict[str, np.ndarray]:
        """What the controller learned, as named arrays (copies): the acceptance counts (``calibration``), the
        cost model's estimates and ratios, and the step counters behind the exploration budget. Not the
        per-request state (recent success, pending drafts): a restarted server starts with no requests."""
        out = {"format": np.array(STATE_FORMAT), "version": np.array([STATE_VERSION], np.int64),
               "widths": np.asarray(self.widths, np.int64),
               "counters": np.array([self._n_steps, self._n_explored, self._n_remeasured, self._step], np.int64)}
        out.update({f"cal_{name}": np.array(a, copy=True) for name, a in zip(Calibration._fields, self.calibration)})
        out.update(self.costs.state_dict())
        return out

    def load_state_dict(self, data) -> None:
        """Start from a learned state (``state_dict``, e.g. of a previous run): replaces the acceptance counts,
        the cost model's state and the counters; requests in flight keep their own state. ValueError, and
        nothing changes, for another format or version, other widths, other table shapes or a different cost
        prior."""
        try:
            fmt = str(np.asarray(data["format"]))
            version = int(np.asarray(data["version"]).reshape(-1)[0])
            widths = tuple(int(w) for w in np.asarray(data["widths"]).reshape(-1))
            counters = np.asarray(data["counters"], np.int64).reshape(-1)
            cal = Calibration(*(np.asarray(data[f"cal_{name}"]) if name in _COUNTS or f"cal_{name}" in data
                                else np.zeros(0) for name in Calibration._fields))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"not a controller state: {e}") from None
        if fmt != STATE_FORMAT:
            raise ValueError(f"not a controller state (format {fmt!r}, expected {STATE_FORMAT!r})")
        if version != STATE_VERSION:
            raise ValueError(f"controller state version {version} is not supported (this version reads "
                             f"{STATE_VERSION})")
        if widths != tuple(self.widths):
            raise ValueError(f"controller state was learned with widths {list(widths)}, this controller has "
                             f"{list(self.widths)}")
        if counters.shape != (4,) or counters.min() < 0:
            raise ValueError(f"controller state: bad counters {counters.tolist()}")
        for name, mine, theirs in zip(Calibration._fields, self.calibration, cal):
            if name not in _COUNTS:  # the logistic correction: taken only if this controller has one of that shape
                if theirs.shape == mine.shape and not np.all(np.isfinite(theirs)):
                    raise ValueError(f"controller state: non-finite {name}")
                continue
            if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
                raise ValueError(f"controller state: calibration {name} has shape {theirs.shape} {theirs.dtype}, "
                                 f"expected {mine.shape} {mine.dtype} (saved by another version?)")
            if not np.all(np.isfinite(theirs)) or theirs.min() < 0:
                raise ValueError(f"controller state: calibration {name} holds negative or non-finite counts")
        if np.any(cal.succ > cal.trials) or np.any(cal.mid_succ > cal.mid_trials) or \
                np.any(cal.top_succ > cal.top_trials):
            raise ValueError("controller state: more successes than trials in the calibration")
        self.costs.load_state_dict(data)  # validates everything first: raises before anything changes
        self.calibration.load(cal)
        self._n_steps, self._n_explored, self._n_remeasured, self._step = (int(c) for c in counters)

    def save_state(self, path) -> None:
        """Write ``state_dict`` to ``path`` (a small compressed .npz file, tens of kB), atomically: a reader never sees
        a half-written file."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                np.savez_compressed(f, **self.state_dict())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def load_state(self, path) -> None:
        """``load_state_dict`` from a file written by ``save_state``. FileNotFoundError for a missing file,
        ValueError for an unreadable or mismatched one; nothing changes on failure."""
        path = os.fspath(path)
        data = read_state_file(path)
        try:
            self.load_state_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def read_state_file(path) -> dict[str, np.ndarray]:
    """The arrays of a state file (``AdaptiveController.save_state``), unchecked. FileNotFoundError for a
    missing file, ValueError for one that is not a readable .npz."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"controller state file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as e:  # a truncated or foreign file: zipfile, pickle or format errors
        raise ValueError(f"{path}: not a readable controller state file ({type(e).__name__}: {e})") from None

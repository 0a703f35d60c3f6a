"""Start warm: the controller's learned state (acceptance calibration, cost model) kept in a file across server
restarts (`"state_file"` in `--speculative-adaptive-config`).

Every TP rank loads the same file at start-up (and after a cache flush), so their decisions stay identical; only
TP rank 0 writes it, every `"state_save_minutes"` (checked at each decode step) and at interpreter exit where
Python gets to run its exit handlers. Writes are atomic (a temporary file, then a rename). A missing file
starts cold; an unreadable or mismatched one (other widths, another cost prior) is logged and starts cold.
Pure Python over `AdaptiveController.save_state` / `load_state`: testable on CPU.
"""
from __future__ import annotations

import atexit
import logging
import time
from typing import Callable

logger = logging.getLogger(__name__)


class StateKeeper:
    """Loads and saves a controller's state file. ``writer``: this process writes it (TP rank 0 only)."""

    def __init__(self, path: str, every_s: float, writer: bool, clock: Callable[[], float] = time.monotonic):
        self.path = path
        self.every_s = float(every_s)
        self.writer = bool(writer)
        self._clock = clock
        self._last = clock()
        self.saves = 0

    @classmethod
    def from_config(cls, config, rank: int) -> "StateKeeper | None":
        """A keeper for ``config.state_file`` (None without one)."""
        if not config.state_file:
            return None
        return cls(config.state_file, 60.0 * config.state_save_minutes, writer=rank == 0)

    @staticmethod
    def _persistent(controller) -> bool:
        return hasattr(controller, "save_state") and hasattr(controller, "load_state")

    def load(self, controller) -> bool:
        """Start ``controller`` from the file if it exists; True if it did. Never raises for a bad file."""
        if not self._persistent(controller):
            return False
        try:
            controller.load_state(self.path)
        except FileNotFoundError:
            logger.info("NGRAM_ADAPTIVE: no controller state at %s yet, starting cold", self.path)
            return False
        except (ValueError, OSError) as e:
            logger.warning("NGRAM_ADAPTIVE: ignoring the controller state file, starting cold: %s", e)
            return False
        logger.info("NGRAM_ADAPTIVE: controller state loaded from %s", self.path)
        return True

    def save(self, controller) -> bool:
        """Write the file now (the writer only); True if written. Never raises: logs a failure."""
        self._last = self._clock()
        if not self.writer or not self._persistent(controller):
            return False
        try:
            controller.save_state(self.path)
        except OSError as e:
            logger.warning("NGRAM_ADAPTIVE: could not write the controller state to %s: %s", self.path, e)
            return False
        self.saves += 1
        return True

    def maybe_save(self, controller) -> bool:
        """``save`` if ``every_s`` seconds passed since the last one (cheap to call every step)."""
        if self.writer and self._clock() - self._last >= self.every_s:
            return self.save(controller)
        return False

    def attach(self, get_controller: Callable[[], object]) -> None:
        """Load the file into the current controller and save at interpreter exit (the writer only)."""
        self.load(get_controller())
        if self.writer:
            atexit.register(lambda: self.save(get_controller()))

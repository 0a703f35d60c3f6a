"""Draft policies by name: `plain`, `chain:k=K`, `tree:k=K`, `adaptive` (the controller, `NGRAM_ADAPTIVE`)."""
from __future__ import annotations

import numpy as np

from .decode import FixedPolicy


def controller_available() -> bool:
    try:
        import ngramspec.controller  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "ngramspec.controller":
            raise
        return False
    return True


class AdaptivePolicy:
    """`ngramspec.controller.AdaptiveController` behind the engine's `DraftPolicy` seam."""

    tree = True

    def __init__(self, max_draft: int = 16, **kwargs):
        from ngramspec.controller import AdaptiveController

        self.controller = AdaptiveController(max_draft=max_draft, **kwargs)
        self.max_draft = max_draft
        self.name = "adaptive"

    def budgets(self, n_requests: int) -> int:
        return self.max_draft

    def choose(self, batch) -> tuple[int, np.ndarray]:
        width, kept = self.controller.choose(batch)
        return int(width), np.asarray(kept, np.int64)

    def observe(self, width, kept, accepted, seconds) -> None:
        self.controller.observe(width, kept, accepted, seconds)


def make_policy(spec: str):
    """`plain` -> None; `chain:k=8` / `tree:k=8` -> FixedPolicy; `adaptive` -> AdaptivePolicy."""
    name, _, rest = spec.partition(":")
    params = dict(item.split("=", 1) for item in rest.split(",") if "=" in item) if rest else {}
    if rest and len(params) != len([i for i in rest.split(",") if i]):
        raise ValueError(f"policy {spec!r}: parameters are key=value")
    if name == "plain" and not params:
        return None
    if name in ("chain", "tree"):
        if set(params) - {"k"}:
            raise ValueError(f"policy {spec!r}: {name} takes only k")
        try:
            k = int(params.get("k", 8))
        except ValueError:
            raise ValueError(f"policy {spec!r}: k must be an integer") from None
        return FixedPolicy(k, tree=(name == "tree"))
    if name == "adaptive":
        if not controller_available():
            raise RuntimeError("policy 'adaptive' needs ngramspec.controller, which is not installed yet")
        return AdaptivePolicy(**{key: int(v) for key, v in params.items()})
    raise ValueError(f"unknown policy {spec!r}: plain, chain:k=K, tree:k=K or adaptive")

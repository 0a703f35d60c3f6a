"""Draft policies by name: `plain`, `chain:k=K`, `tree:k=K`,
`adaptive[:max_width=16,prior=CALIBRATION.json,prefetch=1]` (the controller: NGRAM_ADAPTIVE; ``prefetch=0``: the
decoder does not warm the host's caches for the next step while the device works, for A/B measurements)."""
from __future__ import annotations

from ngramspec.controller import DEFAULT_WIDTHS, AdaptiveController
from ngramspec.controller.protocol import check_positive

from .decode import FixedPolicy


class AdaptivePolicy(AdaptiveController):
    """`ngramspec.controller.AdaptiveController` over the default widths up to `max_width`, tree drafts
    (NGRAM_ADAPTIVE)."""

    tree = True
    name = "adaptive"

    def __init__(self, max_width: int = 16, **controller_kwargs):
        max_width = check_positive(max_width, "max_width")  # the widest verify, root included
        super().__init__([w for w in DEFAULT_WIDTHS if w <= max_width], **controller_kwargs)


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
        if set(params) - {"max_width", "prior", "prefetch"}:
            raise ValueError(f"policy {spec!r}: adaptive takes max_width, prior (a calibration JSON file) and "
                             f"prefetch (0 or 1)")
        if params.get("prefetch", "1") not in ("0", "1"):
            raise ValueError(f"policy {spec!r}: prefetch must be 0 or 1")
        kwargs = {}
        if "max_width" in params:
            try:
                kwargs["max_width"] = int(params["max_width"])
            except ValueError:
                raise ValueError(f"policy {spec!r}: max_width must be an integer") from None
        if "prior" in params:  # c(B, n) measured by `ngramspec calibrate`, used until measured online
            kwargs["prior"] = params["prior"]
        try:
            policy = AdaptivePolicy(**kwargs)
        except ValueError as exc:
            raise ValueError(f"policy {spec!r}: {exc}") from None
        if params.get("prefetch") == "0":
            policy.prefetch = None  # the decoder calls prefetch only when the policy has one
        return policy
    raise ValueError(f"unknown policy {spec!r}: plain, chain:k=K, tree:k=K or adaptive")

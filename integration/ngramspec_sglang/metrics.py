"""Prometheus gauges of NGRAM_ADAPTIVE, exported next to SGLang's `sglang:spec_*` metrics.

Set once per SGLang decode log interval (`--decode-log-interval`) on TP rank 0, from the same
interval SGLang's own `sglang:spec_accept_length` covers:

- `ngramspec:verify_width`: mean verify width per request (1 = plain decode step).
- `ngramspec:drafted_tokens`: real draft tokens per request and step (width minus root minus padding).
- `ngramspec:predicted_accept_length` / `ngramspec:realized_accept_length`: 1 + expected accepted
  drafts (sum of node probabilities of what was sent) vs 1 + drafts actually accepted.
- `ngramspec:drafted_tokens_by_source` / `ngramspec:accepted_tokens_by_source`, label `source` ("ngram": the
  suffix tries, "recycled": token recycling, `recycle`): draft tokens sent / accepted per request and step from
  each source; over the sources they sum to `drafted_tokens` / `realized_accept_length` - 1.
- `ngramspec:pinned_host_mb` / `ngramspec:pinned_host_active_mb` / `ngramspec:pinned_host_trims` (with the cap
  `pinned_cache_mb` on): the scheduler's pinned host memory that torch holds (in use or cached), the part in use,
  and how often the cap returned cached blocks. Read from torch's counters once per interval.
"""
from __future__ import annotations

GAUGES = {
    "verify_width": ("ngramspec:verify_width", "Mean verify width per request (1 = plain decode)."),
    "drafted_tokens": ("ngramspec:drafted_tokens", "Draft tokens sent per request and verify step."),
    "predicted_accept_length": (
        "ngramspec:predicted_accept_length",
        "1 + expected accepted draft tokens per step, as the cache estimated them.",
    ),
    "realized_accept_length": (
        "ngramspec:realized_accept_length",
        "1 + accepted draft tokens per step, as verified.",
    ),
}
BY_SOURCE = {
    "drafted": ("ngramspec:drafted_tokens_by_source", "Draft tokens sent per request and verify step, by source."),
    "accepted": ("ngramspec:accepted_tokens_by_source", "Draft tokens accepted per request and step, by source."),
}
PINNED = {
    "allocated_mb": ("ngramspec:pinned_host_mb", "Pinned host memory torch holds in the scheduler (MB), used or not."),
    "active_mb": ("ngramspec:pinned_host_active_mb",
                  "Pinned host memory in use by torch's own count (MB; it can run above what torch holds)."),
    "trims": ("ngramspec:pinned_host_trims", "Times the pinned_cache_mb cap returned cached pinned memory."),
}
SOURCES = ("ngram", "recycled")
SUMMARY_KEYS = {
    "verify_width": "mean_verify_width",
    "drafted_tokens": "drafted_tokens_per_request",
    "predicted_accept_length": "predicted_accept_length",
    "realized_accept_length": "realized_accept_length",
}


class NgramspecGauges:
    """The gauges, created once per process (prometheus_client must be importable)."""

    def __init__(self, labels: dict[str, str] | None = None):
        from prometheus_client import Gauge

        self.labels = dict(labels or {})
        self._gauges = {
            key: Gauge(name=name, documentation=doc, labelnames=list(self.labels), multiprocess_mode="mostrecent")
            for key, (name, doc) in GAUGES.items()
        }

        self._by_source = {
            key: Gauge(name=name, documentation=doc, labelnames=[*self.labels, "source"],
                       multiprocess_mode="mostrecent")
            for key, (name, doc) in BY_SOURCE.items()
        }
        self._pinned = {
            key: Gauge(name=name, documentation=doc, labelnames=list(self.labels), multiprocess_mode="mostrecent")
            for key, (name, doc) in PINNED.items()
        }

    def publish(self, summary: dict[str, float]) -> None:
        for key, gauge in self._gauges.items():
            target = gauge.labels(**self.labels) if self.labels else gauge
            target.set(float(summary[SUMMARY_KEYS[key]]))
        for key, gauge in self._by_source.items():
            for source in SOURCES:
                gauge.labels(**self.labels, source=source).set(float(summary[f"{key}_{source}_per_request"]))

    def publish_pinned(self, counts: dict[str, float]) -> None:
        for key, gauge in self._pinned.items():
            (gauge.labels(**self.labels) if self.labels else gauge).set(float(counts[key]))

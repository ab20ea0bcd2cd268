"""What an S3 server was asked, counted at the server, and what that would cost at S3's list prices.

Benchmarks and tests read SeaweedFS's own counters (`SeaweedFS_s3_request_total{bucket, type, code}` on its
`-metricsPort`; the embedded server and the test fixtures' servers export it), so every client in the run
is counted the same way: vLLM's engines, our node agents, vLLM's own tiers. SeaweedFS counts a HEAD as a
GET. Users pay per request, so each benchmark reports these beside its throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import httpx

from kvstore.connector.harness.metrics import metric_total, parse_metrics

__all__ = ["S3_PRICES_PER_MILLION", "RequestCounts", "read_request_counts"]

# US dollars per million requests, S3 Standard list prices (us-east-1): PUT, COPY, POST and LIST at
# $0.005 per 1,000; GET, HEAD and the rest at $0.0004 per 1,000; DELETE is free.
S3_PRICES_PER_MILLION = {"get": 0.4, "put": 5.0, "list": 5.0, "delete": 0.0, "other": 0.4}
_TYPES = {"GET": "get", "HEAD": "get", "PUT": "put", "POST": "put", "LIST": "list", "DELETE": "delete"}


@dataclass(frozen=True)
class RequestCounts:
    """Requests by kind (a HEAD counts as a GET, as SeaweedFS counts it), any status; and of the GETs, those
    that found nothing (404: a probe of a chunk nobody stored)."""

    get: float = 0.0
    put: float = 0.0
    list: float = 0.0
    delete: float = 0.0
    other: float = 0.0
    get_missing: float = 0.0

    def __sub__(self, earlier: RequestCounts) -> RequestCounts:
        return RequestCounts(*(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)))

    def cost_usd(self) -> float:
        """What these requests cost at S3's list prices."""
        return sum(float(getattr(self, kind)) * price / 1e6 for kind, price in S3_PRICES_PER_MILLION.items())

    def usd_per_million(self, chunks: float) -> float:
        """What these requests cost per million of ``chunks`` (loaded, moved...) at S3's list prices; 0 for
        no chunks."""
        return self.cost_usd() / chunks * 1e6 if chunks else 0.0


def read_request_counts(
    metrics_url: str, *, bucket: str | None = None, timeout_s: float = 5.0
) -> RequestCounts:
    """The server's request counters now (for ``bucket`` only, if given)."""
    snapshot = parse_metrics(httpx.get(metrics_url, timeout=timeout_s).text)
    labels = {"bucket": bucket} if bucket is not None else {}
    counts = dict.fromkeys(("get", "put", "list", "delete", "other"), 0.0)
    seen = 0.0
    for kind_name, kind in _TYPES.items():
        n = metric_total(snapshot, "SeaweedFS_s3_request_total", type=kind_name, **labels)
        counts[kind] += n
        seen += n
    counts["other"] = metric_total(snapshot, "SeaweedFS_s3_request_total", **labels) - seen
    missing = metric_total(snapshot, "SeaweedFS_s3_request_total", type="GET", code="404", **labels)
    return RequestCounts(**counts, get_missing=missing)

"""Prometheus metrics for /metrics, on the app's own registry (several servers per process work).

Scheduler and pool figures are read at scrape time by a collector (nothing to keep in sync);
request latency, time to first token and response counts are recorded as requests end.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


class _SchedulerCollector:
    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        s = self.scheduler.stats()
        pool = s["pool"]
        yield GaugeMetricFamily("kipp_queue_depth", "Requests waiting for admission",
                                value=s["queue_depth"])
        yield GaugeMetricFamily("kipp_active_requests", "Requests admitted and running",
                                value=s["active_requests"])
        yield GaugeMetricFamily("kipp_active_sequences", "Choices being prefilled or decoded",
                                value=s["active_sequences"])
        blocks = GaugeMetricFamily("kipp_kv_blocks", "KV pool blocks by state",
                                   labels=["state"])
        for state in ("in_use", "free", "evictable", "reserved"):
            blocks.add_metric([state], pool[state])
        yield blocks
        yield GaugeMetricFamily("kipp_kv_blocks_total", "KV pool size in 32-token blocks",
                                value=s["pool_blocks"])
        yield GaugeMetricFamily("kipp_kv_pool_occupancy",
                                "Fraction of KV blocks referenced by running sequences",
                                value=pool["in_use"] / s["pool_blocks"])
        counters = [
            ("kipp_prefix_hit_blocks", "Published KV blocks adopted by new sequences",
             pool["hits"]),
            ("kipp_prefix_reused_tokens", "Prompt tokens whose KV was adopted, not evaluated",
             s["reused_tokens"]),
            ("kipp_prompt_tokens", "Prompt tokens of admitted requests", s["prompt_tokens"]),
            ("kipp_generated_tokens", "Tokens generated (all choices)", s["generated_tokens"]),
            ("kipp_requests_submitted", "Requests accepted into the queue", s["requests"]),
            ("kipp_requests_finished", "Requests that ran to completion", s["finished"]),
            ("kipp_requests_cancelled", "Requests cancelled (client gone)", s["cancelled"]),
            ("kipp_requests_failed", "Requests that failed in the engine", s["failed"]),
            ("kipp_engine_steps", "Batched eval steps run", s["steps"]),
            ("kipp_engine_step_seconds", "Wall time of those steps: admission, batched eval, "
             "sampling, streaming", s["step_seconds"]),
            ("kipp_engine_eval_seconds", "Of the step time, the backend's batched eval",
             s["eval_seconds"]),
            ("kipp_engine_compiles", "Step programs compiled (each new shape bucket, once)",
             s["compiles"]),
            ("kipp_engine_compile_seconds", "Of the eval time, compiling those programs",
             s["compile_seconds"]),
            ("kipp_prefix_tail_hits", "Cached partial last blocks adopted (repeated prompts)",
             pool["tail_hits"]),
            ("kipp_spec_drafted_tokens", "Draft tokens verified (speculative serving)",
             s["spec_drafted"]),
            ("kipp_spec_accepted_tokens", "Draft tokens accepted", s["spec_accepted"]),
            ("kipp_kv_blocks_published", "KV blocks published to the prefix cache",
             pool["published"]),
            ("kipp_kv_blocks_evicted", "Cached KV blocks evicted for reuse", pool["evictions"]),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        # per drafter (lookup, model): the scheduler counts spec_drafted_<name>
        for what, doc in (("drafted", "Draft tokens verified, per drafter"),
                          ("accepted", "Draft tokens accepted, per drafter")):
            family = CounterMetricFamily(f"kipp_spec_drafter_{what}_tokens", doc,
                                         labels=["drafter"])
            prefix = f"spec_{what}_"
            for key, value in s.items():
                if key.startswith(prefix):
                    family.add_metric([key[len(prefix):]], value)
            yield family
        yield from _disk_metrics(s.get("disk"))


def _disk_metrics(disk: dict | None):
    """The KV disk tier (kipp.engine.kv_disk); nothing without one."""
    if disk is None:
        return
    for key, doc in (("hits", "KV blocks restored from the disk tier"),
                     ("misses", "Disk tier lookups past a prefix that found no block file"),
                     ("bytes_read", "Bytes of block files read back"),
                     ("bytes_written", "Bytes of block files written"),
                     ("evictions", "Block files removed to keep the tier under its size"),
                     ("bad_blocks", "Block files refused (truncated, corrupt, foreign) and "
                      "recomputed"),
                     ("dropped", "Blocks not written: the writer's queue was full"),
                     ("write_errors", "Blocks not written: the disk refused (full, read-only)"),
                     ("restored_tokens", "Prompt tokens whose KV came from the disk tier")):
        yield CounterMetricFamily(f"kipp_kv_disk_{key}", doc, value=disk[key])
    yield GaugeMetricFamily("kipp_kv_disk_bytes", "Bytes of block files in the tier folder",
                            value=disk["used_bytes"])
    yield GaugeMetricFamily("kipp_kv_disk_limit_bytes", "The tier's size bound",
                            value=disk["limit_bytes"])


class Metrics:
    def __init__(self, scheduler):
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(scheduler))
        self.latency = Histogram("kipp_request_latency_seconds",
                                 "Submit to last token, per finished request, by endpoint",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("kipp_time_to_first_token_seconds",
                              "Submit to the first streamed text, per request, by endpoint",
                              ["endpoint"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.responses = Counter("kipp_http_responses", "HTTP responses by path and status",
                                 ["path", "status"], registry=self.registry)

    def observe(self, ticket, endpoint: str) -> None:
        """Record a finished Ticket, or every ticket of a TicketGroup, under its endpoint
        ("completions", "chat", "responses", "messages")."""
        for t in getattr(ticket, "tickets", [ticket]):
            if t.ended_at is not None:
                self.latency.labels(endpoint).observe(t.ended_at - t.submitted_at)
            if t.first_token_at is not None:
                self.ttft.labels(endpoint).observe(t.first_token_at - t.submitted_at)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

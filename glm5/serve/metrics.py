"""Prometheus metrics of `glm5 serve` (``GET /metrics``), one `CollectorRegistry` per app.

Engine gauges and counters are read from `AsyncEngine.stats` when the endpoint is scraped (one
consistent snapshot per scrape; nothing is counted twice). Latency histograms are observed by
the app as each request finishes, from the engine's `RequestMetrics`. Rates (tokens/s, the
prefix-cache hit rate over a window) come from the counters: ``rate(glm5_generation_tokens_total
[1m])``.

=========================================  =========  ===========================================
metric                                     type       meaning
=========================================  =========  ===========================================
glm5_num_requests_waiting                  gauge      requests queued (not yet admitted)
glm5_num_requests_running                  gauge      requests in the running batch
glm5_cache_usage_ratio                     gauge      pages in use / all pages (0..1)
glm5_cache_pages_total                     gauge      pages in the paged cache
glm5_cache_pages_free                      gauge      pages nobody holds
glm5_prefix_cache_pages                    gauge      pages held by the prefix cache
glm5_prompt_tokens_total                   counter    prompt tokens of admitted requests
glm5_generation_tokens_total               counter    tokens generated
glm5_prefill_tokens_total                  counter    tokens computed in prefill (and recompute)
glm5_prefix_cache_queried_tokens_total     counter    prompt tokens looked up in the prefix cache
glm5_prefix_cache_hit_tokens_total         counter    of those, tokens served from the cache
glm5_prefix_cache_hit_rate                 gauge      hit / queried since start (0 before any)
glm5_spec_decode_draft_tokens_total        counter    MTP draft tokens verified
glm5_spec_decode_accepted_tokens_total     counter    MTP draft tokens accepted
glm5_spec_decode_acceptance_rate           gauge      accepted / drafted since start
glm5_num_preemptions_total                 counter    requests preempted (recomputed later)
glm5_engine_steps_total                    counter    engine steps run
glm5_requests_total{outcome}               counter    finished | failed | aborted | rejected
glm5_time_to_first_token_seconds           histogram  arrival to first generated token
glm5_time_per_output_token_seconds         histogram  (finish - first token) / (tokens - 1)
glm5_e2e_request_latency_seconds           histogram  arrival to finish
glm5_requests_aborted_total{reason}        counter    HTTP requests ended early: client_gone (it
                                                      disconnected), stalled (it stopped reading
                                                      its stream), too_large (413), timeout (its
                                                      headers or body did not arrive in time: 408),
                                                      shutdown (open at the graceful timeout)
glm5_http_errors_total{code}               counter    error responses by status (400, 404, 408,
                                                      413, 429, 500, 503); a 500 is an engine
                                                      failure or a bug, and says which
glm5_http_connections_open                 gauge      HTTP connections open now
glm5_http_connections_refused_total        counter    connections over max_connections (a 503)
glm5_stream_backlog_aborts_total           counter    engine requests aborted because their
                                                      reader fell stream_backlog outputs behind
glm5_rank_*{rank}                          both       a multi-rank server (--tp / --ep): each
                                                      rank's waiting / running requests, free
                                                      and prefix-cache pages, steps, generated
                                                      tokens, prefix-cache hit tokens
=========================================  =========  ===========================================
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

ABORT_REASONS = ("client_gone", "stalled", "too_large", "timeout", "shutdown")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


# A multi-rank server's per-rank series: (snapshot key, metric, help, type)
PER_RANK = (
    ("waiting", "glm5_rank_num_requests_waiting", "Requests queued on this rank.", "gauge"),
    ("running", "glm5_rank_num_requests_running", "Requests in this rank's running batch.",
     "gauge"),
    ("free_pages", "glm5_rank_cache_pages_free", "This rank's free cache pages.", "gauge"),
    ("cached_pages", "glm5_rank_prefix_cache_pages", "Pages held by this rank's prefix cache.",
     "gauge"),
    ("steps", "glm5_rank_engine_steps", "Engine steps this rank ran.", "counter"),
    ("generation_tokens", "glm5_rank_generation_tokens", "Tokens this rank generated.",
     "counter"),
    ("prefix_hit_tokens", "glm5_rank_prefix_cache_hit_tokens", "Prompt tokens served by this "
     "rank's prefix cache.", "counter"),
)


class _EngineCollector:
    """Turns one `AsyncEngine.stats()` snapshot into gauges and counters at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def describe(self) -> list:  # nothing to describe ahead of time: collect() is cheap enough
        return []

    def collect(self) -> Iterator:
        s = self._stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        n = s["num_pages"]
        yield gauge("glm5_num_requests_waiting", "Requests queued, not yet admitted.",
                    s["waiting"])
        yield gauge("glm5_num_requests_running", "Requests in the running batch.", s["running"])
        yield gauge("glm5_cache_usage_ratio", "Cache pages in use (by requests or the prefix "
                    "cache) over all pages.", (n - s["free_pages"]) / n if n else 0.0)
        yield gauge("glm5_cache_pages_total", "Pages of the paged latent cache.", n)
        yield gauge("glm5_cache_pages_free", "Pages nobody holds.", s["free_pages"])
        yield gauge("glm5_prefix_cache_pages", "Pages held by the prefix cache.",
                    s["cached_pages"])
        yield counter("glm5_prompt_tokens", "Prompt tokens of admitted requests.",
                      s["prompt_tokens"])
        yield counter("glm5_generation_tokens", "Tokens generated.", s["generation_tokens"])
        yield counter("glm5_prefill_tokens", "Tokens computed in prefill (prompts and "
                      "recomputes after preemption).", s["prefill_tokens"])
        q, h = s["prefix_queried_tokens"], s["prefix_hit_tokens"]
        yield counter("glm5_prefix_cache_queried_tokens", "Prompt tokens looked up in the "
                      "prefix cache.", q)
        yield counter("glm5_prefix_cache_hit_tokens", "Prompt tokens served by the prefix "
                      "cache.", h)
        yield gauge("glm5_prefix_cache_hit_rate", "Prefix cache hit tokens / queried tokens "
                    "since start.", h / q if q else 0.0)
        d, a = s["drafted"], s["accepted"]
        yield counter("glm5_spec_decode_draft_tokens", "MTP draft tokens verified.", d)
        yield counter("glm5_spec_decode_accepted_tokens", "MTP draft tokens accepted.", a)
        yield gauge("glm5_spec_decode_acceptance_rate", "Accepted / drafted MTP tokens since "
                    "start.", a / d if d else 0.0)
        yield counter("glm5_num_preemptions", "Requests preempted (recomputed later).",
                      s["preemptions"])
        yield counter("glm5_engine_steps", "Engine steps run.", s["steps"])
        yield counter("glm5_stream_backlog_aborts", "Engine requests aborted because their "
                      "reader fell stream_backlog outputs behind.", s.get("stalled", 0))
        per = s.get("per_rank")
        if per:  # a multi-rank server (glm5.engine.lockstep): each rank's own, as of the last round
            for key, name, doc, kind in PER_RANK:
                fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                    name, doc, labels=["rank"])
                for r, snap in enumerate(per):
                    if key in snap:
                        fam.add_metric([str(r)], snap[key])
                yield fam
        c = CounterMetricFamily("glm5_requests", "Requests by outcome (rejected: refused by "
                                "the engine at admission).", labels=["outcome"])
        for outcome in ("finished", "failed", "aborted", "rejected"):
            c.add_metric([outcome], s[outcome])
        yield c


class ServerMetrics:
    """The registry of one app: engine gauges/counters plus the latency histograms."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.ttft = Histogram("glm5_time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("glm5_time_per_output_token_seconds",
                              "Mean time per generated token after the first, per request.",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("glm5_e2e_request_latency_seconds",
                             "Time from arrival to finish.", buckets=E2E_BUCKETS,
                             registry=self.registry)
        self.aborted = Counter("glm5_requests_aborted", "HTTP requests ended before their "
                               "response was complete, by reason.", ["reason"],
                               registry=self.registry)
        for reason in ABORT_REASONS:
            self.aborted.labels(reason)
        self.http_errors = Counter("glm5_http_errors", "Error responses by HTTP status.",
                                   ["code"], registry=self.registry)
        self.connections_open = Gauge("glm5_http_connections_open", "HTTP connections open.",
                                      registry=self.registry)
        self.connections_refused = Counter("glm5_http_connections_refused", "Connections "
                                           "refused over max_connections.",
                                           registry=self.registry)

    def abort(self, reason: str) -> None:
        """Count an HTTP request that ended early (``reason`` one of `ABORT_REASONS`)."""
        if reason not in ABORT_REASONS:
            raise ValueError(f"glm5 ServerMetrics.abort: reason expected one of "
                             f"{ABORT_REASONS}, got {reason!r}")
        self.aborted.labels(reason).inc()

    def error(self, status: int) -> None:
        """Count an error response with HTTP ``status``."""
        self.http_errors.labels(str(status)).inc()

    def observe(self, output: Any) -> None:
        """Record a finished `RequestOutput` (stopped or at its length; not aborted/failed)."""
        m = output.metrics
        if m is None or m.finished is None or output.finish_reason not in ("stop", "length"):
            return
        self.e2e.observe(m.finished - m.arrival)
        if m.first_token is not None:
            self.ttft.observe(m.first_token - m.arrival)
            n = len(output.token_ids)
            if n > 1:
                self.tpot.observe((m.finished - m.first_token) / (n - 1))

    def render(self) -> bytes:
        """The text exposition format (call it off the event loop: it takes the engine lock)."""
        return generate_latest(self.registry)

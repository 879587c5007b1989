"""Prometheus metrics under vLLM's names, so existing dashboards read this server unchanged.

Two sources:
- the engine's ``StatsSnapshot``, read at scrape time: ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (fraction of pages in use, 0-1),
  and the engine-wide counters ``vllm:prompt_tokens_total`` (prompt tokens prefilled, including
  recomputation), ``vllm:generation_tokens_total``, ``vllm:num_preemptions_total`` and
  ``ds4:num_evictions_total`` (resident sessions evicted);
- this server's own observation of each request, timed as its client sees it:
  ``vllm:request_success_total{finished_reason}``, ``vllm:time_to_first_token_seconds`` (to the
  first streamed text), ``vllm:inter_token_latency_seconds`` (between successive text deltas,
  about one token each), ``vllm:e2e_request_latency_seconds``; and ``ds4:requests_aborted_total
  {reason}`` (disconnect, slow_client, shutdown, error), ``ds4:request_errors_total{type}`` (answers
  with an error status) and ``ds4:requests_in_flight``.

Every series carries the ``model_name`` label, as vLLM's do. The registry is per app, never the
process-global default, so several apps (tests) can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from ds4_app.engine.api import Finished, StatsSnapshot

# vLLM's buckets (vllm/v1/metrics/loggers.py); inter-token latency gets finer low buckets because
# a fast backend decodes in a few milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _LiveCollector(Collector):
    """Reads one engine snapshot per scrape (zeros while the model is loading), and the server's
    in-flight count."""

    def __init__(self, model_name: str, snapshot: Callable[[], StatsSnapshot | None],
                 in_flight: Callable[[], int]) -> None:
        self._model = model_name
        self._snapshot = snapshot
        self._in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        labels = ["model_name"]
        values = [self._model]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, v)
            return c

        pool = s.pool if s is not None else None
        yield gauge("vllm:num_requests_running", "Requests in prefill or decode.", s.n_running if s else 0)
        yield gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", s.queue_len if s else 0)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV pages in use (0-1).",
                    pool.used / pool.n_pages if pool and pool.n_pages else 0.0)
        yield counter("vllm:prompt_tokens", "Prompt tokens prefilled.", s.prompt_tokens_total if s else 0)
        yield counter("vllm:generation_tokens", "Tokens generated.", s.generation_tokens_total if s else 0)
        yield counter("vllm:num_preemptions", "Requests preempted (recomputed later).",
                      pool.preemptions if pool else 0)
        yield counter("ds4:num_evictions", "Idle resident sessions evicted to free pages.",
                      pool.evictions if pool else 0)
        yield gauge("ds4:requests_in_flight", "Generation requests this server is answering.", self._in_flight())


class ServerMetrics:
    """The app's registry and the per-request observations."""

    def __init__(self, model_name: str, snapshot: Callable[[], StatsSnapshot | None],
                 in_flight: Callable[[], int]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        self.registry.register(_LiveCollector(model_name, snapshot, in_flight))
        lbl = ["model_name"]
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               lbl + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first streamed text.", lbl,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between successive text deltas.", lbl,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency from arrival to finish.", lbl,
                             buckets=E2E_BUCKETS, registry=r)
        self.aborted = Counter("ds4:requests_aborted", "Requests cancelled by the server, by reason.",
                               lbl + ["reason"], registry=r)
        self.errors = Counter("ds4:request_errors", "Requests answered with an error status, by error type.",
                              lbl + ["type"], registry=r)
        for reason in ("stop", "length"):  # so the series exist (at 0) before the first request
            self.success.labels(model_name, reason)

    def request_timer(self) -> "RequestTimer":
        """Start timing one admitted request."""
        return RequestTimer(self)

    def aborted_request(self, reason: str) -> None:
        """Count a request the server cancelled (disconnect, slow_client, shutdown, error)."""
        self.aborted.labels(self.model_name, reason).inc()

    def error_answer(self, error_type: str) -> None:
        """Count an error answer by its OpenAI error type."""
        self.errors.labels(self.model_name, error_type).inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's first text, the gaps between its deltas, and its end."""

    __slots__ = ("_m", "_t0", "_last")

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._t0 = time.monotonic()
        self._last: float | None = None

    def delta(self) -> None:
        """A piece of text was produced."""
        now = time.monotonic()
        if self._last is None:
            self._m.ttft.labels(self._m.model_name).observe(now - self._t0)
        else:
            self._m.itl.labels(self._m.model_name).observe(now - self._last)
        self._last = now

    def finished(self, fin: Finished) -> None:
        """The request ended (any reason)."""
        self._m.e2e.labels(self._m.model_name).observe(time.monotonic() - self._t0)
        self._m.success.labels(self._m.model_name, fin.finish_reason).inc()

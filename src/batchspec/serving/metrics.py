"""Prometheus metrics of `batchspec serve` (GET /metrics), in a registry of their own per server.

Names follow the DESIGN.md metrics where they overlap: `batchspec_vsr` (accepted / verified drafts) and
`batchspec_mean_accepted_length` (tokens emitted per request per target step), both over the server's lifetime;
their counters are exported too, so a dashboard can take rates over any window.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from batchspec.engine.request import Request, spec_metrics

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter("batchspec_http_requests", "HTTP requests by endpoint and status code",
                                     ["endpoint", "code"], registry=r)
        self.requests_finished = Counter(
            "batchspec_requests_finished", "Generation requests by outcome (stop, length, abort = client left, "
            "error, cancelled = shutdown)", ["reason"], registry=r)
        self.prompt_tokens = Counter("batchspec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("batchspec_generation_tokens", "Output tokens of finished requests",
                                         registry=r)
        self.step_seconds = Histogram("batchspec_step_seconds", "Engine step time (prefill or decode/verify step)",
                                      ["phase"], buckets=STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("batchspec_batch_size", "Requests in one decode / speculative step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.running = Gauge("batchspec_running_requests", "Requests holding a KV-cache slot", registry=r)
        self.queue_depth = Gauge("batchspec_queue_depth", "Requests waiting for a slot", registry=r)
        self.verified = Counter("batchspec_draft_tokens_verified", "Draft tokens sent to the target (sum of l)",
                                registry=r)
        self.accepted = Counter("batchspec_draft_tokens_accepted", "Draft tokens the target accepted", registry=r)
        self.request_steps = Counter("batchspec_request_steps", "Sum over steps of the requests in the step",
                                     registry=r)
        self.step_tokens = Counter("batchspec_step_tokens", "Tokens emitted by decode / speculative steps",
                                   registry=r)
        self.vsr = Gauge("batchspec_vsr", "Verification success rate since start: accepted / verified drafts",
                         registry=r)
        self.mean_accepted_length = Gauge("batchspec_mean_accepted_length",
                                          "Tokens emitted per request per target step since start", registry=r)
        self.request_accepted_length = Histogram(
            "batchspec_request_accepted_length", "Mean accepted length of each finished request",
            buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 7.0, 9.0), registry=r)
        self.ttft = Histogram("batchspec_time_to_first_token_seconds", "Arrival at the engine to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("batchspec_request_latency_seconds", "Arrival at the engine to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self._totals = [0, 0, 0, 0]  # verified, accepted, request_steps, step_tokens

    def observe_step(self, seconds: float, phase: str, batch: int, verified: int, accepted: int,
                     request_steps: int, step_tokens: int) -> None:
        """One engine step; the counts are what the step added to the engine's RunStats."""
        self.step_seconds.labels(phase).observe(seconds)
        if phase == "decode":
            self.batch_size.observe(batch)
        for index, (counter, value) in enumerate(((self.verified, verified), (self.accepted, accepted),
                                                  (self.request_steps, request_steps),
                                                  (self.step_tokens, step_tokens))):
            counter.inc(value)
            self._totals[index] += value
        total_verified, total_accepted, total_steps, total_tokens = self._totals
        if total_verified:
            self.vsr.set(total_accepted / total_verified)
        if total_steps:
            self.mean_accepted_length.set(total_tokens / total_steps)

    def observe_finished(self, request: Request, completion_tokens: int) -> None:
        """A request that finished normally (the outcome counter is bumped by the engine loop)."""
        self.prompt_tokens.inc(len(request.prompt_ids))
        self.generation_tokens.inc(completion_tokens)
        if request.first_token_s is not None:
            self.ttft.observe(request.first_token_s - request.arrival_s)
        if request.finish_s is not None:
            self.latency.observe(request.finish_s - request.arrival_s)
        accepted_length = spec_metrics(request)["mean_accepted_length"]
        if accepted_length is not None:
            self.request_accepted_length.observe(accepted_length)

    def set_load(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.queue_depth.set(waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""``/metrics``: Prometheus text under vLLM's metric names (its dashboards, aiperf and guidellm read
them), each labelled ``model_name`` as vLLM labels them, in a registry of the server's own (not
prometheus_client's global one, so two servers in one process never share a series).

Times are measured by the engine thread around each step: a request's queue time ends when the step
that admits it starts, its prefill time is that step, its time to first token ends with it. The
prefix-cache counters count prompt tokens (looked up / found), as vLLM's do. One series is this
project's own: ``rfa:attention_path_total{phase, path}`` counts the engine steps by the attention
path that ran them ("fused:CPU": RoPE inside the attention kernel; "unfused": the fallback that runs
RoPE as a standalone op), so whether RoPE ran on its own is read from /metrics.
"""
from __future__ import annotations

try:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
except ImportError as exc:  # the serve extra
    raise ImportError("models.llama.serve needs the serve extra: pip install 'ms_rope_attention[serve]'") from exc

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token (arrival to the end of "
                              "the step that sampled it).", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between a request's successive tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to the request's last token.",
                             REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to the start of the step that "
                               "admitted the request.", REQUEST_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "The step that prefilled the request.",
                                 REQUEST_BUCKETS)
        self.running = gauge("vllm:num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache's blocks held by requests "
                              "(0 to 1; cached blocks no request holds count as free).")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of the requests admitted.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self._success = Counter("vllm:request_success", "Requests finished, by reason.",
                                labels + ["finished_reason"], registry=self.registry)
        for reason in FINISHED_REASONS:
            self._success.labels(model_name, reason)
        self._paths = Counter("rfa:attention_path", "Engine steps by phase and the attention path that ran them.",
                              labels + ["phase", "path"], registry=self.registry)

    def finished(self, reason: str, e2e_s: float) -> None:
        self._success.labels(self.model_name, reason).inc()
        self.e2e.observe(e2e_s)

    def attention_path(self, phase: str, path: str) -> None:
        self._paths.labels(self.model_name, phase, path).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""An engine's `/metrics`: vLLM's metric names, labels (`model_name`, `engine`) and histogram
buckets (vllm/v1/metrics/loggers.py, buckets.py), and the kvstore connector's counters
(`vllm:kvstore_*_total`), in the Prometheus text format. Times are the engine's own clock:
simulated seconds.

Rendered by hand: routers scrape every engine every second, and prometheus_client's exposition
cost ~10 ms a scrape, a sixth of this process's CPU with 12 engines."""
from __future__ import annotations

import bisect
from typing import Callable

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
GAUGES = {"num_requests_running": "Number of requests in model execution batches.",
          "num_requests_waiting": "Number of requests waiting to be processed.",
          "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage."}
COUNTERS = {  # vLLM counter -> the scheduler stat it follows
    "prefix_cache_queries": ("queries", "Prefix cache queries, in terms of number of queried tokens."),
    "prefix_cache_hits": ("hits", "Prefix cache hits, in terms of number of cached tokens."),
    "external_prefix_cache_queries": ("external_queries", "External prefix cache queries from KV connector "
                                                          "cross-instance cache sharing, in terms of number of queried tokens."),
    "external_prefix_cache_hits": ("external_hits", "External prefix cache hits from KV connector cross-instance "
                                                    "cache sharing, in terms of number of cached tokens."),
    "num_preemptions": ("preemptions", "Cumulative number of preemption from the engine."),
    "prompt_tokens": ("prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens": ("generation_tokens", "Number of generation tokens processed."),
}
CONNECTOR = ("hit_tokens", "loaded_blocks", "load_bytes", "load_seconds", "load_failures", "saved_blocks", "save_bytes",
             "save_failures")
REASONS = ("stop", "length", "abort", "error")


def _value(v: float) -> str:
    return repr(float(v))


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip(self.bounds, self.counts):
            total += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {_value(total)}')
        total += self.counts[-1]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {_value(total)}')
        out.append(f"{name}_count{{{labels}}} {_value(total)}")
        out.append(f"{name}_sum{{{labels}}} {_value(self.sum)}")
        return out


class EngineMetrics:
    def __init__(self, model: str, index: int, running: Callable[[], float], waiting: Callable[[], float],
                 usage: Callable[[], float], cache_config: dict[str, object] | None = None) -> None:
        self.labels = f'engine="{index}",model_name="{model}"'
        self.gauges = {"num_requests_running": running, "num_requests_waiting": waiting, "kv_cache_usage_perc": usage}
        self.success = dict.fromkeys(REASONS, 0)
        self.connector = dict.fromkeys(CONNECTOR, 0.0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue = Histogram(LATENCY_BUCKETS)
        # vLLM's info gauge of its CacheConfig (a gauge at 1, the settings as labels), engine last
        info = {k: str(v) for k, v in (cache_config or {}).items()}
        self.cache_info = ",".join(f'{k}="{v}"' for k, v in sorted(info.items())) + f',engine="{index}"'

    def render(self, stats: dict[str, float]) -> bytes:
        lab = self.labels
        lines: list[str] = ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                            "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{self.cache_info}}} 1.0"]
        for name, read in self.gauges.items():
            lines += [f"# HELP vllm:{name} {GAUGES[name]}", f"# TYPE vllm:{name} gauge",
                      f"vllm:{name}{{{lab}}} {_value(read())}"]
        for name, (stat, text) in COUNTERS.items():
            lines += [f"# HELP vllm:{name}_total {text}", f"# TYPE vllm:{name}_total counter",
                      f"vllm:{name}_total{{{lab}}} {_value(stats.get(stat, 0))}"]
        lines += ["# HELP vllm:request_success_total Count of successfully processed requests.",
                  "# TYPE vllm:request_success_total counter"]
        lines += [f'vllm:request_success_total{{{lab},finished_reason="{r}"}} {_value(n)}'
                  for r, n in self.success.items()]
        for name, value in self.connector.items():
            lines += [f"# HELP vllm:kvstore_{name}_total kvstore connector {name}",
                      f"# TYPE vllm:kvstore_{name}_total counter", f"vllm:kvstore_{name}_total{{{lab}}} {_value(value)}"]
        for name, hist, text in (("time_to_first_token_seconds", self.ttft, "Histogram of time to first token in seconds."),
                                 ("inter_token_latency_seconds", self.itl, "Histogram of inter-token latency in seconds."),
                                 ("e2e_request_latency_seconds", self.e2e, "Histogram of e2e request latency in seconds."),
                                 ("request_queue_time_seconds", self.queue,
                                  "Histogram of time spent in WAITING phase for request.")):
            lines += [f"# HELP vllm:{name} {text}", f"# TYPE vllm:{name} histogram"]
            lines += hist.lines(f"vllm:{name}", lab)
        return ("\n".join(lines) + "\n").encode()

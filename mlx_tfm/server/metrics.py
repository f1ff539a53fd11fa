"""``GET /metrics``: the server's counters in Prometheus' text format (version 0.0.4)."""

from __future__ import annotations

from collections import Counter

PREFIX = "mlx_tfm"


class RequestCounter:
    """HTTP requests answered, by route and status (unknown paths counted as "other")."""

    def __init__(self, routes: set[str]):
        self.routes = routes
        self.counts: Counter = Counter()

    def add(self, path: str, status: int) -> None:
        self.counts[(path if path in self.routes else "other", status)] += 1


def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> list[str]:
    lines = [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{key}="{value_}"' for key, value_ in labels.items())
        lines.append(f"{PREFIX}_{name}{{{label_text}}} {value}" if label_text else f"{PREFIX}_{name} {value}")
    return lines


def prometheus_text(requests: RequestCounter, engine: dict | None, loading: bool) -> str:
    """All metrics; the engine's are left out while the model loads (``engine`` None)."""
    lines = metric("http_requests_total", "counter", "HTTP requests answered, by path and status.",
                   [({"path": path, "status": str(status)}, count) for (path, status), count in
                    sorted(requests.counts.items())])
    lines += metric("model_loading", "gauge", "1 while the model loads, then 0.", [({}, int(loading))])
    if engine is not None:
        lines += engine_metrics(engine)
    return "\n".join(lines) + "\n"


def engine_metrics(engine: dict) -> list[str]:
    by_reason = sorted((engine.get("requests_total") or {}).items())
    return [
        *metric("engine_requests_total", "counter", "Engine requests finished, by finish reason.",
                [({"finish_reason": reason}, count) for reason, count in by_reason]),
        *metric("prompt_tokens_total", "counter", "Prompt tokens submitted.", [({}, engine["prompt_tokens_total"])]),
        *metric("generation_tokens_total", "counter", "Tokens generated.", [({}, engine["generation_tokens_total"])]),
        *metric("generation_tokens_per_second", "gauge", "Recent aggregate generation speed.",
                [({}, round(float(engine["generation_tps"]), 3))]),
        *metric("requests_running", "gauge", "Requests in the running batch.", [({}, engine["running"])]),
        *metric("requests_waiting", "gauge", "Requests waiting for a row.", [({}, engine["waiting"])]),
        *metric("prompt_cache_hits_total", "counter", "Prompts that reused a cached prefix.",
                [({}, engine["prompt_cache_hits"])]),
        *metric("prompt_cache_misses_total", "counter", "Prompts with no cached prefix.",
                [({}, engine["prompt_cache_misses"])]),
        *metric("prompt_cache_bytes", "gauge", "Bytes held by the prefix cache.", [({}, engine["prompt_cache_bytes"])]),
    ]

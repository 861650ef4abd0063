"""What the servers show while the load is on: each process's RSS and their Prometheus gauges.

Every endpoint is optional: a server without /metrics, or without a gauge, is simply left out.
"""
from __future__ import annotations

import threading

import httpx

# families worth reading from an engine's /metrics (ours, e.g. hybridserve_engine_kv_cache_usage_ratio,
# hybridserve_engine_num_requests_running; and llama-server's, e.g. llamacpp:requests_processing)
ENGINE_GAUGE_WORDS = ("kv_cache", "kv_arena", "num_requests", "preempt", "queue_depth", "requests_processing",
                      "requests_deferred", "prefix_cache")


def scrape(url: str, words=ENGINE_GAUGE_WORDS) -> dict[str, float]:
    """The gauge and counter samples of one endpoint whose family names contain one of `words`;
    {} when the endpoint does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url, timeout=2, trust_env=False).text
        out = {}
        for fam in text_string_to_metric_families(text):
            if fam.type in ("gauge", "counter", "untyped") and any(w in fam.name for w in words):
                for s in fam.samples:
                    labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                    out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out
    except (httpx.HTTPError, ValueError):
        return {}  # an engine without a metrics endpoint, or one that is busy: tolerate it


class Periodic:
    """Calls `sample()` every `interval_s` in a thread while the `with` block runs (the load is on)."""

    interval_s = 0.5

    def __enter__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def sample(self) -> None:
        raise NotImplementedError


class Sampler(Periodic):
    """While the load is on: peak RSS of named processes and peak engine gauges, every 0.5 s, in a thread."""

    def __init__(self, pids: dict[str, int], metrics: dict[str, str]):
        self.pids, self.metrics = pids, metrics
        self.rss_mb: dict[str, float] = {}
        self.gauges: dict[str, dict[str, float]] = {}

    def sample(self) -> None:
        import psutil

        for name, pid in self.pids.items():
            try:
                mb = psutil.Process(pid).memory_info().rss / 2**20
                self.rss_mb[name] = max(mb, self.rss_mb.get(name, 0.0))
            except psutil.Error:
                pass
        for source, url in self.metrics.items():
            g = self.gauges.setdefault(source, {})
            for name, value in scrape(url).items():
                g[name] = max(value, g.get(name, float("-inf")))


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """Each process's user + system CPU seconds so far (children included); missing processes left out."""
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return out


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before[name], 3) for name in after if name in before}


def stack_children(pid: int) -> dict[str, int]:
    """The engine and gateway processes under `hybridserve up`, by service name."""
    import psutil

    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        cmd = " ".join(child.cmdline())
        for name in ("prefill_gpu", "decode_fpga", "gateway"):
            if f"services.{name}" in cmd:
                found[name] = child.pid
    return found

"""A real Prometheus (Debian's package) scrapes the three processes; every dashboard query returns data."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import API_KEY, MODEL
from tests.services_harness import free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/hybridserve.json"


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def test_dashboard_json_is_what_the_generator_writes():
    import runpy

    assert json.loads(DASHBOARD.read_text()) == runpy.run_path(str(ROOT / "deploy/grafana/make_dashboard.py"))[
        "dashboard"]()


@pytest.fixture
def prometheus(stack, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("Debian's prometheus is not installed: `make test` installs it as root (apt-get install prometheus)")
    targets = {"gateway": stack["gateway"].port, "prefill_gpu": stack["prefill"].metrics_port,
               "decode_fpga": stack["decode"].metrics_port}
    # the stack's gateway has an API key, so its /metrics needs it: Prometheus reads it from a file
    (tmp_path / "gateway-api-key").write_text(API_KEY)
    auth = {"gateway": {"authorization": {"type": "Bearer", "credentials_file": str(tmp_path / "gateway-api-key")}}}
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
                               **auth.get(job, {})}
                              for job, port in targets.items()]}
    (tmp_path / "prometheus.yml").write_text(json.dumps(cfg))  # JSON is YAML
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # every target scraped at least once
            try:
                # Prometheus answers 503 "Service Unavailable" (plain text) until its TSDB is open.
                r = httpx.get(url + "/api/v1/targets", timeout=2)
                if r.status_code == 200:
                    active = r.json()["data"]["activeTargets"]
                    if len(active) == 3 and all(t["health"] == "up" for t in active):
                        break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("prometheus never scraped all three targets: " + (tmp_path / "prometheus.log").read_text()[-2000:])
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def query(url: str, expr: str) -> list:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]


@pytest.mark.slow
def test_every_dashboard_query_returns_data(stack, prometheus):
    for mode in ("gpu", "fpga", "hybrid", "auto"):  # traffic after the first scrape, so rates move
        body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 6, "temperature": 0, "mode": mode,
                "stream": True}
        with httpx.stream("POST", stack["url"] + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            assert r.status_code == 200
            list(r.iter_lines())
    missing = dashboard_queries()
    deadline = time.monotonic() + 30
    while missing and time.monotonic() < deadline:
        time.sleep(1)
        missing = [e for e in missing
                   if not any(math.isfinite(float(s["value"][1])) for s in query(prometheus, e))]
    assert not missing, f"no data for: {missing}"

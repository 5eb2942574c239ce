"""The joins docs/monitoring.md gives between the guard's series and Triton's own ``nv_*`` series
(issue 43 item 3), run as the page writes them on a real ``prometheus`` scraping one metrics page
laid out as a tritonserver's: Triton's per-model-version series beside a guard's."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.processes import stop_process
from tests.unit.exporter.rollout.test_prometheus import Page  # the same page of Prometheus text
from tritonguard.ops.server import free_port

PROMETHEUS = shutil.which("prometheus")
DOC = Path(__file__).resolve().parents[2] / "docs" / "monitoring.md"
SECTION = "## Joining with Triton's series"


def documented_queries() -> list[str]:
    """The ```promql blocks of the section, in order."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(SECTION)
    section = text[start:text.index("\n## ", start + len(SECTION))]
    return re.findall(r"```promql\n(.*?)```", section, re.DOTALL)


def page(n: int) -> bytes:
    """Round ``n`` of a tritonserver's /metrics: model ``digits`` is a guard over ``digits_raw``
    (versions 1-3, answering from 2 and 3, and some ``default`` answers); ``other`` is not guarded.
    Counters start high, so that rate()'s extrapolation is the same for every series."""
    lines = ["# HELP nv_inference_request_success Number of successful inference requests, all batch sizes",
             "# TYPE nv_inference_request_success counter",
             f'nv_inference_request_success{{model="digits",version="1"}} {1000 + 100 * n}',
             f'nv_inference_request_success{{model="minilm",version="1"}} {1000 + 20 * n}',  # the ensemble
             f'nv_inference_request_success{{model="minilm_guard",version="1"}} {1000 + 20 * n}',
             f'nv_inference_request_success{{model="other",version="1"}} {1000 + 40 * n}',
             "# HELP nv_inference_request_duration_us Cumulative inference request duration in microseconds",
             "# TYPE nv_inference_request_duration_us counter",
             f'nv_inference_request_duration_us{{model="digits",version="1"}} {500000 + 50000 * n}',  # 500 us
             f'nv_inference_request_duration_us{{model="minilm",version="1"}} {10 ** 6 + 80000 * n}',  # 4000 us
             f'nv_inference_request_duration_us{{model="minilm_guard",version="1"}} {10 ** 6 + 60000 * n}',
             f'nv_inference_request_duration_us{{model="other",version="1"}} {900000 + 90000 * n}',
             "# HELP nv_inference_count Number of inferences performed (does not include cached requests)",
             "# TYPE nv_inference_count counter"]
    # digits_raw version: inferences per round, compute us per inference
    raw = {"1": (50, 100), "2": (10, 500), "3": (90, 300)}
    lines += [f'nv_inference_count{{model="digits_raw",version="{v}"}} {1000 + k * n}' for v, (k, _) in raw.items()]
    lines += [f'nv_inference_count{{model="minilm_raw_v3",version="1"}} {1000 + 20 * n}']
    lines += ["# HELP nv_inference_compute_infer_duration_us Cumulative compute inference duration in microseconds",
              "# TYPE nv_inference_compute_infer_duration_us counter"]
    lines += [f'nv_inference_compute_infer_duration_us{{model="digits_raw",version="{v}"}} {10 ** 6 + k * us * n}'
              for v, (k, us) in raw.items()]
    guard = 'model="digits",version="1"'
    lines += ["# HELP tritonguard_requests_total Requests seen by the guard",
              "# TYPE tritonguard_requests_total counter",
              f"tritonguard_requests_total{{{guard}}} {1000 + 100 * n}",
              f'tritonguard_requests_total{{model="minilm",version="1"}} {1000 + 20 * n}',  # minilm_guard's
              "# HELP tritonguard_served_total Requests answered, by the model version that served them",
              "# TYPE tritonguard_served_total counter",
              f'tritonguard_served_total{{{guard},served_by="digits_raw:1"}} 700',  # served once, not now
              f'tritonguard_served_total{{{guard},served_by="digits_raw:2"}} {100 + 10 * n}',
              f'tritonguard_served_total{{{guard},served_by="digits_raw:3"}} {100 + 90 * n}',
              f'tritonguard_served_total{{{guard},served_by="default"}} {100 + 5 * n}',
              # a text guard with target_per_version: version 3 is Triton's minilm_raw_v3, version 1
              f'tritonguard_served_total{{model="minilm",version="1",served_by="minilm_raw:3"}} {100 + 20 * n}']
    return ("\n".join(lines) + "\n").encode()


def query(url: str, expr: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10) as r:
        out = json.load(r)
    assert out["status"] == "success", out
    return out["data"]["result"]


def scraped(url: str, n: int) -> bool:
    try:
        rows = query(url, "count_over_time(tritonguard_requests_total[1m])")
    except OSError:  # not up yet
        return False
    return bool(rows) and float(rows[0]["value"][1]) >= n


@pytest.fixture
def prometheus(tmp_path):
    """A real prometheus on loopback scraping one Triton-like page every second; the page's
    counters advance once, after it was scraped twice, so every rate() holds one round's increase."""
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    srv.body = page(0)  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = free_port()
    conf = tmp_path / "prometheus.yml"
    conf.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "triton", "static_configs": [
            {"targets": [f"127.0.0.1:{srv.server_address[1]}"]}]}]}))
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not scraped(url, 2):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        srv.body = page(1)  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while not scraped(url, 4):  # at least two scrapes of round 1
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield url
    finally:
        stop_process(proc, grace=10)
        srv.shutdown()
        srv.server_close()


def rows(url: str, expr: str) -> dict[tuple[str, ...], float]:
    return {tuple(v for _, v in sorted(r["metric"].items())): float(r["value"][1]) for r in query(url, expr)}


def test_the_documented_joins_on_triton_and_guard_series(prometheus):
    by_model, served, compute, per_version_models = documented_queries()
    # the model clients call (for minilm the ensemble, not the guard step): guarded models only
    assert rows(prometheus, by_model) == {("digits",): pytest.approx(500.0), ("minilm",): pytest.approx(4000.0)}
    # served_by as Triton's labels: the versions that answered, never the guard's own digits:1
    answers = rows(prometheus, served)
    assert set(answers) == {("digits_raw", "1"), ("digits_raw", "2"), ("digits_raw", "3"), ("minilm_raw", "3")}
    assert answers[("digits_raw", "1")] == 0
    assert answers[("digits_raw", "3")] / answers[("digits_raw", "2")] == pytest.approx(9.0)
    # joined: Triton's compute time per inference of each version that answered in the window
    assert rows(prometheus, compute) == {("digits_raw", "2"): pytest.approx(500.0),
                                         ("digits_raw", "3"): pytest.approx(300.0)}
    # target_per_version: Triton's own name and version of the model that answered
    per_version = rows(prometheus, per_version_models)
    assert set(per_version) == {("minilm_raw_v3", "1")}
    joined = rows(prometheus, f'{per_version_models} / on (model, version) '
                              'sum by (model, version) (rate(nv_inference_count[5m]))')
    assert joined == {("minilm_raw_v3", "1"): pytest.approx(1.0)}  # every inference of it came through the guard


def test_the_section_has_its_four_queries():
    queries = documented_queries()
    assert len(queries) == 4
    assert all("nv_inference_" in q for q in (queries[0], queries[2]))

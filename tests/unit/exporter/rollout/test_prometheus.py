"""Gates from Prometheus: the recording rules' expressions as windowed instant queries, and a
real `prometheus` process scraping two fake replicas' metrics pages: counts since the first look,
a dead replica's counts kept, and the same verdict and reason as scraping the replicas."""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from exporter.rollout.controller import RolloutController
from exporter.rollout.progress import RolloutConfig
from exporter.rollout.prometheus import PrometheusReader, queries, rule_exprs, windowed, with_model
from exporter.rollout.route import RouteChange, apply
from exporter.rollout.window import metrics_reader
from tests.processes import stop_process
from tritonguard.core.repository import write_config
from tritonguard.ops.server import free_port
from tritonguard.triton import http as triton_http

PROMETHEUS = shutil.which("prometheus")
MODEL = "promm"
GUARD = {"name": MODEL, "backend": "guard", "max_batch_size": 4,
         "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [2]}],
         "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [2]}],
         "parameters": {"target": {"string_value": "promm_raw"}}}


def test_the_rules_become_windowed_queries():
    rules = rule_exprs()
    q = queries("digits", 120, rules)
    assert q["tritonguard_served_total"] == (
        'sum by (model, served_by) (increase(tritonguard_served_total{model="digits"}[120s]))')
    assert "histogram_quantile" not in q["tritonguard_target_latency_seconds_bucket"]
    assert 'increase(tritonguard_target_latency_seconds_bucket{model="digits"}[120s])' in \
        q["tritonguard_target_latency_seconds_bucket"]
    assert q["tritonguard_breaker_state"] == 'max by (model, target_version) (tritonguard_breaker_state{model="digits"})'
    assert set(queries("digits", None, rules)) == {"tritonguard_breaker_state"}  # the anchor: gauges only
    assert with_model('x:tritonguard_y:z + tritonguard_a{result="hit"}', 'a"b') == \
        'x:tritonguard_y:z + tritonguard_a{result="hit", model="a\\"b"}'
    assert windowed("sum(rate(tritonguard_a_total[5m]))", "m", 7) == 'sum(increase(tritonguard_a_total{model="m"}[7s]))'


class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = self.server.body  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def exposition(served1: int, served2: int, errors2: int) -> bytes:
    return (f'tritonguard_requests_total{{model="{MODEL}"}} {served1 + served2}\n'
            f'tritonguard_served_total{{model="{MODEL}",served_by="promm_raw:1"}} {served1}\n'
            f'tritonguard_served_total{{model="{MODEL}",served_by="promm_raw:2"}} {served2}\n'
            f'tritonguard_target_errors_total{{model="{MODEL}",target_version="2"}} {errors2}\n'
            f'tritonguard_breaker_state{{model="{MODEL}",target_version="2"}} 0\n').encode()


@pytest.fixture
def fleet(tmp_path):
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    pages = []
    for _ in range(2):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
        srv.body = exposition(100, 10, 0)  # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        pages.append(srv)
    port = free_port()
    conf = tmp_path / "prometheus.yml"
    conf.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "triton", "static_configs": [
            {"targets": [f"127.0.0.1:{p.server_address[1]}" for p in pages]}]}]}))
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        reader = PrometheusReader(url, MODEL, target="promm_raw")
        deadline = time.monotonic() + 30
        while True:  # both targets scraped at least once
            try:
                rows = reader.query(f'count(tritonguard_served_total{{model="{MODEL}"}})')
                if rows and float(rows[0]["value"][1]) == 4:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.2)
        yield url, pages
    finally:
        stop_process(proc, grace=10)
        log.close()
        for p in pages:
            p.shutdown()
            p.server_close()


def test_counts_since_the_first_look_across_replicas_dead_or_alive(fleet):
    url, pages = fleet
    lines: list[str] = []
    read = PrometheusReader(url, MODEL, target="promm_raw", say=lines.append)
    r0 = read(1, 2)
    assert r0.replicas == 2 and r0.breaker_state == 0 and r0.errors.get(2, 0.0) == 0
    assert "gates read from Prometheus" in lines[0]
    for p in pages:
        p.body = exposition(300, 210, 20)  # type: ignore[attr-defined]  # +200, +200, +20 each
    time.sleep(3.5)
    r1 = read(1, 2)
    served, errors = r1.served[2] - r0.served.get(2, 0.0), r1.errors[2] - r0.errors.get(2, 0.0)
    # increase() extrapolates to the window's edges (one scrape interval in a few): about the
    # true counts; a loaded machine's late scrapes move them further
    assert 400 * 0.75 <= served <= 400 * 1.5, (r0, r1)
    assert 40 * 0.75 <= errors <= 40 * 1.5, (r0, r1)
    assert errors / served == pytest.approx(0.1, abs=0.03)
    # one replica dies: its counts stay in the window (a plain sum would drop them)
    pages[1].shutdown()
    pages[1].server_close()
    time.sleep(2.5)
    r2 = read(1, 2)
    assert r2.served[2] >= r1.served[2] and r2.errors[2] >= r1.errors[2]
    assert r2.replicas in (1, 2)  # the dead target's series go stale within a scrape or two


def test_same_verdict_and_reason_as_scraping(fleet, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITONGUARD_STATE_URL", raising=False)
    url, pages = fleet
    repos = {}
    for name in ("scrape", "prom"):
        repo = repos[name] = tmp_path / name
        write_config(repo / MODEL, GUARD)
        for v in (1, 2):
            (repo / "promm_raw" / str(v)).mkdir(parents=True)
        apply(repo, MODEL, RouteChange(primary=1))
    pages_urls = [f"http://127.0.0.1:{p.server_address[1]}/metrics" for p in pages]
    cfg = RolloutConfig(steps=(10, 100), dwell_s=0.0)
    ctls = {"scrape": RolloutController(MODEL, repos["scrape"], metrics_reader(pages_urls, MODEL, target="promm_raw"),
                                        config=cfg),
            "prom": RolloutController(MODEL, repos["prom"], PrometheusReader(url, MODEL, target="promm_raw"),
                                      config=cfg)}
    for ctl in ctls.values():
        ctl.start(2, primary=1)
        ctl.tick()  # the baseline
    for p in pages:
        p.body = exposition(1000, 410, 40)  # type: ignore[attr-defined]
    time.sleep(3.5)
    got = {k: ctl.tick() for k, ctl in ctls.items()}
    assert got["scrape"].status == got["prom"].status == "rolled_back", {k: p.reason for k, p in got.items()}
    for p in got.values():
        assert "gate failed at 10%" in p.reason and "error rate" in p.reason and "> limit 1.00%" in p.reason, p.reason


def test_unreachable_prometheus_holds_the_look(tmp_path):
    read = PrometheusReader("http://127.0.0.1:1", MODEL, timeout=0.5)
    with pytest.raises(Exception, match="unreachable"):
        read.query("up")
    assert isinstance(triton_http.Unreachable("u", "r"), OSError)


def test_rules_path_is_checked(tmp_path):
    bad = tmp_path / "rules.yml"
    bad.write_text("groups: []\n")
    with pytest.raises(Exception, match="no recording rule"):
        PrometheusReader("http://127.0.0.1:1", MODEL, rules_path=Path(bad))


def test_readings_of_another_source_restart_the_window():
    from exporter.rollout.gates.evaluate import evaluate
    from exporter.rollout.gates.readings import GuardReadings

    scraped = GuardReadings(model=MODEL, primary=1, candidate=2, served={1: 10_000.0, 2: 5000.0}, errors={2: 0.0})
    prom = GuardReadings(model=MODEL, primary=1, candidate=2, served={1: 10.0, 2: 5.0}, errors={2: 0.0},
                         source="prometheus:http://p@1")
    report = evaluate(prom, scraped, look=1)
    assert report.reset and "source changed" in report.gates[0].reason
    assert GuardReadings.from_dict(prom.to_dict()).source == prom.source
    assert GuardReadings.from_dict({k: v for k, v in scraped.to_dict().items() if k != "source"}).source == ""

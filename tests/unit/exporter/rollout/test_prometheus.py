"""Gates from Prometheus: the recording rules' expressions as windowed instant queries, and a
real `prometheus` process scraping two fake replicas' metrics pages: counts since the first look,
a dead replica's counts kept, and the same verdict and reason as scraping the replicas."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from exporter.rollout.controller import RolloutController
from exporter.rollout.progress import RolloutConfig
from exporter.rollout.prometheus import (
    RULE_OF,
    PrometheusError,
    PrometheusReader,
    queries,
    rule_exprs,
    selector,
    windowed,
    with_model,
)
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


class Prometheus:
    """A real ``prometheus`` on loopback scraping ``jobs`` (job name -> metrics pages) every second."""

    def __init__(self, tmp_path: Path, jobs: dict[str, list], port: int | None = None):
        self.dir, self.jobs, self.port = tmp_path, jobs, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.runs = 0

    def start(self) -> Prometheus:
        """Start it with an empty storage (a restart of it loses everything it held)."""
        self.runs += 1
        conf = self.dir / "prometheus.yml"
        conf.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": job, "static_configs": [
                {"targets": [f"127.0.0.1:{p.server_address[1]}" for p in pages]}]} for job, pages in self.jobs.items()]}))
        log = self.dir / f"prometheus.{self.runs}.log"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={conf}",
                                          f"--storage.tsdb.path={self.dir / f'data{self.runs}'}",
                                          f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                                         stdout=out, stderr=subprocess.STDOUT)
        reader = PrometheusReader(self.url, MODEL, target="promm_raw", scope="")
        want = 2 * sum(len(pages) for pages in self.jobs.values())  # served series of every target
        deadline = time.monotonic() + 30
        while True:  # every target scraped at least twice (increase() needs two samples)
            try:
                rows = reader.query(f'count(count_over_time(tritonguard_served_total{{model="{MODEL}"}}[1m]) >= 2)')
                if rows and float(rows[0]["value"][1]) == want:
                    return self
            except Exception:  # noqa: BLE001 - not up yet
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)

    def stop(self) -> None:
        stop_process(self.proc, grace=10)


def pages_serving(n: int) -> list:
    pages = []
    for _ in range(n):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
        srv.body = exposition(100, 10, 0)  # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        pages.append(srv)
    return pages


@pytest.fixture
def prometheus(tmp_path):
    """Start one with ``prometheus(jobs)``; stopped, and its pages closed, at the end."""
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    started: list[Prometheus] = []

    def start(jobs: dict[str, list]) -> Prometheus:
        started.append(Prometheus(tmp_path, jobs).start())
        return started[-1]
    yield start
    for prom in started:
        prom.stop()
        for pages in prom.jobs.values():
            for p in pages:
                p.shutdown()
                p.server_close()


@pytest.fixture
def fleet(prometheus):
    pages = pages_serving(2)
    yield prometheus({"triton": pages}).url, pages


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


# -- issue 39 item 7: a Prometheus shared by namespaces, a Prometheus that lost its samples -------
class Recorder(http.server.BaseHTTPRequestHandler):
    """A Prometheus HTTP API that answers every instant query with no series, and keeps them."""

    def do_GET(self):  # noqa: N802
        from urllib.parse import parse_qs, urlparse

        self.server.asked.append(parse_qs(urlparse(self.path).query)["query"][0])  # type: ignore[attr-defined]
        body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_selector_is_in_every_query_the_gates_send(monkeypatch):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    srv.asked = []  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("TRITONGUARD_PROMETHEUS_SELECTOR", "namespace='prod', job=~\"triton|guard\"")
    try:
        read = PrometheusReader(f"http://127.0.0.1:{srv.server_address[1]}", MODEL)
        for _ in range(3):  # the first look, then looks that also check the previous one's samples
            assert "matching {namespace='prod', job=~\"triton|guard\"}" in read(1, 2).problems[-1]
    finally:
        srv.shutdown()
        srv.server_close()
    asked = srv.asked  # type: ignore[attr-defined]
    assert len(asked) >= 3 * (len(queries(MODEL, 60, rule_exprs())) + 2)
    for q in asked:
        selectors = re.findall(r"(?<![\w:])tritonguard_[a-z0-9_]+(\{[^}]*\})?", q)
        assert selectors, q
        for braces in selectors:
            assert braces == f'{{model="{MODEL}", namespace=\'prod\', job=~"triton|guard"}}', q


@pytest.mark.parametrize("text, error", [
    ("namespace=prod", "expected label matchers"),
    ('namespace="prod" job="x"', "separated by commas"),
    ('model="other"', "'model' is set by the gates"),
    ('namespace="prod"} or vector(1', "separated by commas"),
])
def test_a_bad_selector_is_refused_in_one_line(text, error):
    with pytest.raises(PrometheusError, match=re.escape(error)) as exc:
        PrometheusReader("http://127.0.0.1:1", MODEL, scope=text)
    assert "\n" not in str(exc.value)
    assert selector('{namespace="prod",job="triton"}') == 'namespace="prod", job="triton"'
    assert selector("") == selector(None) == ""


def test_the_selector_keeps_another_namespaces_guards_out(prometheus):
    """One Prometheus scraping two fleets whose guards have the same model name (a staging
    fleet failing): scoped to the production job, the gates see production's counts only."""
    prod, staging = pages_serving(1), pages_serving(1)
    url = prometheus({"prod": prod, "staging": staging}).url
    scoped = PrometheusReader(url, MODEL, target="promm_raw", scope='job="prod"')
    everyone = PrometheusReader(url, MODEL, target="promm_raw", scope="")
    r0, e0 = scoped(1, 2), everyone(1, 2)
    assert (r0.replicas, e0.replicas) == (1, 2)
    staging[0].body = exposition(100, 410, 200)  # type: ignore[attr-defined]
    prod[0].body = exposition(100, 110, 0)  # type: ignore[attr-defined]
    time.sleep(3.5)
    r1, e1 = scoped(1, 2), everyone(1, 2)
    assert 100 * 0.75 <= r1.served[2] - r0.served[2] <= 100 * 1.5, (r0, r1)
    assert r1.errors.get(2, 0.0) - r0.errors.get(2, 0.0) == 0
    assert e1.errors[2] - e0.errors.get(2, 0.0) > 100  # unscoped, staging's failures are summed in


def test_a_prometheus_that_lost_its_samples_is_a_reset_not_a_frozen_count(prometheus):
    """Prometheus restarted without its data: its counts since the anchor start again from its
    restart. They were frozen at the old value ("never back"), so the window saw nothing new
    until they caught up and judged the evidence from before the restart; now the counts read
    before are kept and what it counts after the restart is added."""
    pages = pages_serving(2)
    prom = prometheus({"triton": pages})
    lines: list[str] = []
    read = PrometheusReader(prom.url, MODEL, target="promm_raw", say=lines.append, scope="")
    r0 = read(1, 2)
    for p in pages:
        p.body = exposition(300, 210, 2)  # type: ignore[attr-defined]  # +200 and +2 each
    time.sleep(3.5)
    r1 = read(1, 2)
    before = r1.served[2] - r0.served.get(2, 0.0)
    assert 400 * 0.75 <= before <= 400 * 1.5, (r0, r1)
    assert not any("lost samples" in x for x in lines), lines
    prom.stop()
    prom.start()  # the same address, an empty storage
    for p in pages:
        p.body = exposition(400, 310, 12)  # type: ignore[attr-defined]  # +100 and +10 each
    time.sleep(3.5)
    r2 = read(1, 2)
    served, errors = r2.served[2] - r1.served[2], r2.errors[2] - r1.errors[2]
    assert 200 * 0.75 <= served <= 200 * 1.6, (r1, r2, lines)
    assert 20 * 0.75 <= errors <= 20 * 1.6, (r1, r2, lines)
    assert any(f"Prometheus {prom.url} lost samples of the window" in x for x in lines), lines
    # and the next look is not another reset
    time.sleep(1.5)
    r3 = read(1, 2)
    assert r3.served[2] >= r2.served[2] and sum("lost samples" in x for x in lines) == 1, lines


# -- issue 39 item 9: the rules ship in the package -------------------------------------------------
ROOT = Path(__file__).resolve().parents[4]


def test_the_rules_are_package_data_and_deploy_links_to_them():
    from importlib import resources

    from exporter.rollout import prometheus as module

    packaged = resources.files("exporter.rollout") / "rules.yml"
    assert packaged.is_file() and module.RULES == packaged
    assert RULE_OF.keys() and set(RULE_OF.values()) <= set(rule_exprs())
    for link in (ROOT / "deploy" / "prometheus" / "rules.yml", ROOT / "deploy" / "helm" / "tritonguard" / "files" / "rules.yml"):
        assert link.is_symlink() and link.resolve() == Path(str(packaged)).resolve(), link


def test_a_missing_rules_file_or_a_bad_selector_is_one_line_and_exit_2(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from exporter.cli.app import app
    from exporter.rollout import prometheus as module

    gone, packaged = tmp_path / "rules.yml", module.RULES
    with pytest.raises(PrometheusError, match="cannot be read") as exc:
        PrometheusReader("http://127.0.0.1:1", MODEL, rules_path=gone)
    assert "\n" not in str(exc.value) and "reinstall" in str(exc.value)
    monkeypatch.setattr(module, "RULES", gone)
    monkeypatch.delenv("TRITONGUARD_STATE_URL", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "home"))
    repo = tmp_path / "repo"
    write_config(repo / MODEL, GUARD)
    for v in (1, 2):
        (repo / "promm_raw" / str(v)).mkdir(parents=True)
    apply(repo, MODEL, RouteChange(primary=1))
    res = CliRunner().invoke(app, ["rollout", "resume", MODEL, "-r", str(repo), "--prometheus", "http://127.0.0.1:1"])
    assert res.exit_code == 2, res.output
    assert "cannot be read" in res.output and "Traceback" not in res.output, res.output
    monkeypatch.setattr(module, "RULES", packaged)  # a malformed --prometheus-selector is one line too
    res = CliRunner().invoke(app, ["rollout", "resume", MODEL, "-r", str(repo), "--prometheus", "http://127.0.0.1:1",
                                   "--prometheus-selector", "namespace=prod"])
    assert res.exit_code == 2, res.output
    assert "Prometheus selector 'namespace=prod': expected label matchers" in res.output, res.output


def test_an_installed_wheel_finds_its_rules(tmp_path):
    """Built as pip builds it, unpacked away from the source tree: the rules are in the wheel and
    the reader finds them there (they were read from <source>/deploy/, absent from a wheel)."""
    import sys
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    for pkg in ("tritonguard", "exporter", "examples"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "whl"), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    (wheel,) = (tmp_path / "whl").glob("tritonguard-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert "exporter/rollout/rules.yml" in z.namelist()
        z.extractall(tmp_path / "site")
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import exporter.rollout.prometheus as m; "
             "assert m.__file__.startswith(sys.argv[1]), m.__file__; print(str(m.RULES)); "
             "print(sorted(m.RULE_OF.values()) == sorted(set(m.RULE_OF.values()) & set(m.rule_exprs())))")
    res = subprocess.run([sys.executable, "-I", "-c", probe, str(tmp_path / "site")], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == [str(tmp_path / "site" / "exporter" / "rollout" / "rules.yml"), "True"]

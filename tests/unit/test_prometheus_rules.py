"""deploy/: the Prometheus rules and the Grafana dashboard, checked by promtool (syntax, and the
alerts' unit tests in rules_test.yml) and against the metric families the guard declares.
tests/functional/test_monitoring.py checks the same names on a live server's metrics port."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tritonguard.core import catalogue

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "rules_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "tritonguard.json"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian/Ubuntu: "
                                    "apt-get install prometheus, which ships it)")

# a name not inside a recording rule's level:metric:operations
METRIC = re.compile(r"(?<![\w:])(?:tritonguard|nv)_[a-z0-9_]+(?![\w:])")
RECORDED = re.compile(r"(?<![\w:])[a-z_]+:[a-z0-9_]+:[a-z0-9_]+(?![\w:])")
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")
# what Grafana substitutes before a query reaches Prometheus
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$model": ".+"}
SEVERITIES = {"warning", "critical"}


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _alerts() -> list[dict]:
    return [r for r in _rules() if "alert" in r]


def dashboard_exprs() -> dict[str, str]:
    """``panel title [refId]`` -> the query as Prometheus receives it."""
    out = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(var, value)
            out[f"{panel['title']} [{target['refId']}]"] = expr
    return out


def all_exprs() -> list[str]:
    return [r["expr"] for r in _rules()] + list(dashboard_exprs().values())


def named_metrics() -> set[str]:
    """Every exported metric (``tritonguard_*``, Triton's ``nv_*``) a rule or a panel queries."""
    return {m for expr in all_exprs() for m in METRIC.findall(expr)}


def declared_families() -> set[str]:
    """The families the guard registers with Triton (each appears once it has a series), and those
    ``exporter stream`` serves on its own port (the dashboard's stream row)."""
    return catalogue.guard_families() | catalogue.consumer_families()


def family(sample: str) -> str:
    """``x_bucket`` -> ``x`` for a histogram of the catalogue; other names as they are."""
    for suffix in HISTOGRAM_SUFFIXES:
        if sample.endswith(suffix) and catalogue.families().get(sample.removesuffix(suffix)) == "histogram":
            return sample.removesuffix(suffix)
    return sample


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, check=False)


@needs_promtool
def test_rules_pass_promtool_check():
    res = _promtool("check", "rules", str(RULES))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in res.stdout, res.stdout


@needs_promtool
def test_rules_unit_tests_pass():
    res = _promtool("test", "rules", str(RULES_TEST))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout, res.stdout


def test_every_alert_is_tested_firing_and_silent():
    cases = [c for t in yaml.safe_load(RULES_TEST.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    fired = {c["alertname"] for c in cases if c.get("exp_alerts")}
    silent = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    names = {a["alert"] for a in _alerts()}
    assert names - fired == set(), "alerts never shown firing in rules_test.yml"
    assert names - silent == set(), "alerts never shown staying silent in rules_test.yml"
    assert (fired | silent) - names == set(), "rules_test.yml tests alerts that rules.yml does not define"


def test_alerts_say_how_long_how_bad_and_what_to_do():
    for a in _alerts():
        assert "for" in a, f"{a['alert']}: no for: duration"
        assert a.get("labels", {}).get("severity") in SEVERITIES, f"{a['alert']}: severity not in {SEVERITIES}"
        notes = a.get("annotations", {})
        assert notes.get("summary"), f"{a['alert']}: no summary"
        # what to do: every description names a command or a place to look
        assert "python -m exporter" in notes.get("description", "") or "check" in notes.get("description", "").lower(), \
            f"{a['alert']}: the description does not tell the operator what to do"


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path):
    exprs = dashboard_exprs()
    # promtool parses queries only inside rule files: each one becomes a recording rule
    names = {f"dashboard:query_{i}:check": where for i, where in enumerate(exprs)}
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": n, "expr": exprs[w]} for n, w in names.items()]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    res = _promtool("check", "rules", str(path))
    out = res.stdout + res.stderr
    for n, where in names.items():
        out = out.replace(n, where)
    assert res.returncode == 0, out


def test_dashboard_panels_are_wired():
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "model"}
    for p in panels:
        assert p["targets"], f"{p['title']}: no query"
        assert p["datasource"]["uid"] == "${datasource}", f"{p['title']}: not on the datasource variable"
        for t in p["targets"]:
            # every query follows the model picker, or the panel would show every model regardless
            assert 'model=~"$model"' in t["expr"], f"{p['title']} [{t['refId']}] ignores $model"
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, f"{p['title']}: wider than the grid"


def test_named_metrics_are_declared_by_the_guard():
    guard = {family(m) for m in named_metrics() if m.startswith("tritonguard_")}
    assert guard - declared_families() == set(), "queried but never exported by the guard"
    # the dashboard covers every family the guard exports (a new one needs a panel, or a reason)
    assert declared_families() - {family(m) for m in METRIC.findall(" ".join(dashboard_exprs().values()))} == set()


def test_recorded_series_are_defined():
    defined = {r["record"] for r in _rules() if "record" in r}
    used = {m for expr in all_exprs() for m in RECORDED.findall(expr)}
    assert used - defined == set(), "rules or panels query a recording rule that rules.yml does not define"

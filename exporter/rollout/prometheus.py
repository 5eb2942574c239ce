"""Gates from Prometheus: a rollout reader that asks Prometheus (PromQL instant queries over
every replica it scrapes) for the figures the gates judge, instead of scraping each replica.

The gates judge counts in a window (requests, errors, comparisons, latency buckets) as the
difference of two cumulative readings. Prometheus gives counts in a window directly and safely
across replicas that die or join: ``increase(x[w])`` keeps a dead replica's samples that fall
inside ``w`` and counts a new replica from its first sample (a plain ``sum(x)`` drops a dead
replica's series at once, measured: docs/fleet.md). So this reader fixes an anchor
(:data:`ANCHOR_S` before its first look) and answers every look with ``increase(...[now -
anchor])``: counters "since the anchor", whose differences between two looks are the counts
between them. Every look sees the same samples at the anchor's end (a window starting at the
first look itself missed an increment made between that look and the next scrape). The expressions are the recording
rules' own (``deploy/prometheus/rules.yml``, read at run time), evaluated as instant queries with
``rate`` turned into ``increase`` over that window and the model's matcher added, not their
recorded series (the recording group runs every 30 s, a look would lag by as much); families
without a rule are summed the same way by the labels the gates read. Gauges (breaker state) are
read as they are now.

The rest of the gates' code is shared: the query results become the same series a scrape gives,
parsed by :meth:`GuardReadings.from_scrapes`, so verdicts and reasons are the same; the figures
are Prometheus' (``increase`` extrapolates to the window's edges, so counts may differ from the
exact ones by up to a scrape interval's worth; they are rounded and never go back between looks).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import yaml

from exporter.errors import ExporterError
from exporter.rollout.gates.readings import BREAKER, ERRORS, LATENCY, SERVED, GuardReadings, Series
from tritonguard.core import catalogue
from tritonguard.triton import http as triton_http

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules.yml"
# gate family -> the recording rule whose expression reads it
RULE_OF = {SERVED: "model_served_by:tritonguard_served:rate5m",
           ERRORS: "model_target_version:tritonguard_target_errors:rate5m",
           LATENCY: "model_target_version:tritonguard_target_latency_seconds:p95_5m",
           BREAKER: "model_target_version:tritonguard_breaker_state:max"}
# families the gates read that no rule records: summed by the labels the gates look at
UNRECORDED = {catalogue.FUSED: ("target_version",), catalogue.LABELED: ("target_version", "correct"),
              catalogue.COMPARED: ("target_version", "kind", "verdict"), catalogue.TRIPS: ("target_version",),
              catalogue.COST: ("target_version", "part"), catalogue.COMPUTE: ("target_version", "part"),
              catalogue.CHARGED: ("target_version",)}
ANCHOR_S = 60.0  # the windows start this long before the first look (>= two scrape intervals)
_SELECTOR = re.compile(r"(?<![\w:])(tritonguard_[a-z0-9_]+)(\{[^}]*\})?")
_QUANTILE = re.compile(r"^\s*histogram_quantile\(\s*[0-9.]+\s*,(.*)\)\s*$", re.S)


class PrometheusError(ExporterError):
    """Prometheus cannot be asked, or answers an error."""


def rule_exprs(path: Path = RULES) -> dict[str, str]:
    """Recording rule name -> its expression."""
    groups = yaml.safe_load(Path(path).read_text())["groups"]
    return {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}


def _quote(value: str) -> str:
    return json.dumps(value)  # a PromQL string literal: double quotes, backslash escapes


def with_model(expr: str, model: str) -> str:
    """Every ``tritonguard_*`` selector of ``expr`` restricted to ``model="<model>"``."""
    def add(m: re.Match) -> str:
        inner = (m.group(2) or "{}")[1:-1].strip()
        return f"{m.group(1)}{{{inner + ', ' if inner else ''}model={_quote(model)}}}"
    return _SELECTOR.sub(add, expr)


def windowed(expr: str, model: str, seconds: int) -> str:
    """A recording rule's expression as counts over the last ``seconds``: ``rate`` becomes
    ``increase``, every range becomes ``[<seconds>s]``; a quantile gives its buckets."""
    if m := _QUANTILE.match(expr):
        expr = m.group(1)
    expr = re.sub(r"(?<![\w:])rate\(", "increase(", expr)
    expr = re.sub(r"\[[0-9]+[smhd]\]", f"[{int(seconds)}s]", expr)
    return with_model(expr, model)


def queries(model: str, seconds: int | None, rules: dict[str, str]) -> dict[str, str]:
    """Family -> the instant query for it; counters only with a window (``seconds``)."""
    out = {BREAKER: with_model(rules[RULE_OF[BREAKER]], model)}
    if seconds is None:
        return out
    for name in (SERVED, ERRORS, LATENCY):
        out[name] = windowed(rules[RULE_OF[name]], model, seconds)
    for name, labels in UNRECORDED.items():
        out[name] = (f"sum by (model, {', '.join(labels)}) "
                     f"(increase({name}{{model={_quote(model)}}}[{int(seconds)}s]))")
    return out


class PrometheusReader:
    """A rollout reader (``(primary, candidate) -> GuardReadings``) asking Prometheus at ``url``."""

    def __init__(self, url: str, model: str, *, target: str | None = None, timeout: float = 10.0,
                 rules_path: Path = RULES, clock: Callable[[], float] = time.time,
                 say: Callable[[str], None] | None = None):
        self.url, self.model, self.target, self.timeout, self.clock = url.rstrip("/"), model, target, timeout, clock
        self.rules = rule_exprs(rules_path)
        missing = [r for r in RULE_OF.values() if r not in self.rules]
        if missing:
            raise PrometheusError(f"{rules_path} has no recording rule {', '.join(missing)}")
        self.say = say or (lambda _msg: None)
        self.anchor: float | None = None
        self.last: Series = {}  # counters since the anchor, as of the last look: they never go back

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        url = f"{self.url}/api/v1/query?{urlencode(params)}"
        try:
            status, body = triton_http.request(url, timeout=self.timeout)
        except triton_http.Unreachable as exc:
            raise PrometheusError(f"Prometheus {self.url} unreachable: {exc.reason}") from None
        try:
            doc = json.loads(body)
        except ValueError:
            raise PrometheusError(f"Prometheus {self.url}: HTTP {status}, not JSON") from None
        if status != 200 or doc.get("status") != "success":
            raise PrometheusError(f"Prometheus {self.url}: HTTP {status}: {doc.get('error', '?')} (query {promql})")
        return doc["data"]["result"]

    def series(self, seconds: int | None, at: float | None = None) -> Series:
        out: Series = {}
        for name, promql in queries(self.model, seconds, self.rules).items():
            for row in self.query(promql, at):
                labels = {k: v for k, v in row["metric"].items() if k != "__name__"}
                labels.setdefault("model", self.model)
                value = float(row["value"][1])
                if math.isnan(value):
                    continue
                if name == BREAKER:
                    out[(name, frozenset(labels.items()))] = value
                    continue
                key = (name, frozenset(labels.items()))
                value = max(float(round(value)), self.last.get(key, 0.0))  # never back: no false reset
                self.last[key] = out[key] = value
        return out

    def replicas(self, at: float | None = None) -> int:
        rows = self.query(f"count(count by (instance) (tritonguard_requests_total{{model={_quote(self.model)}}}))", at)
        return int(float(rows[0]["value"][1])) if rows else 0

    def __call__(self, primary: int, candidate: int) -> GuardReadings:
        now = self.clock()
        if self.anchor is None:
            self.anchor = now - ANCHOR_S
            self.say(f"gates read from Prometheus {self.url}: increase() since "
                     f"{time.strftime('%H:%M:%S', time.gmtime(self.anchor))} UTC, with the recording rules' "
                     "expressions (deploy/prometheus/rules.yml)")
        series = self.series(int(math.ceil(now - self.anchor)), at=now)
        for key, value in self.last.items():  # a series gone from every replica keeps its count
            series.setdefault(key, value)
        r = GuardReadings.from_scrapes([series], self.model, primary, candidate, target=self.target)
        r.replicas = self.replicas(at=now)
        if not r.replicas:
            r.problems.append(f"Prometheus {self.url} has no tritonguard series of model '{self.model}'")
        r.taken_at = now
        r.source = f"prometheus:{self.url}@{self.anchor:.0f}"
        return r

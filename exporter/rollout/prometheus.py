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
rules' own (``rules.yml`` beside this module, shipped in the package; ``deploy/prometheus/rules.yml``
links to it), evaluated as instant queries with ``rate`` turned into ``increase`` over that window
and the model's matcher (and the operator's selector, :data:`ENV_SELECTOR`) added, not their
recorded series (the recording group runs every 30 s, a look would lag by as much); families
without a rule are summed the same way by the labels the gates read. Gauges (breaker state) are
read as they are now.

The rest of the gates' code is shared: the query results become the same series a scrape gives,
parsed by :meth:`GuardReadings.from_scrapes`, so verdicts and reasons are the same; the figures
are Prometheus' (``increase`` extrapolates to the window's edges, so counts may differ from the
exact ones by up to a scrape interval's worth; they are rounded and never go back between looks).

A Prometheus that lost samples inside the window (restarted without its data, a WAL tail lost)
answers smaller counts, which a "never back" rule alone would freeze: the window would then
judge only evidence from before the loss until the new counts caught up. So every look also
asks how many samples the window held at the previous look (``count_over_time`` at that look's
time: exact, no extrapolation; samples are only ever added unless lost). Fewer than then is a
reset: what each count lost is asked at the previous look's time, kept, and the counts
Prometheus has now are added to it (``increase()``'s own rule for a counter that went down).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import yaml

from exporter.errors import ExporterError
from exporter.rollout.gates.readings import BREAKER, ERRORS, LATENCY, SERVED, GuardReadings, Series
from tritonguard.core import catalogue
from tritonguard.triton import http as triton_http

# the recording rules, shipped as package data (one source: deploy/prometheus/rules.yml and the
# Helm chart's files/rules.yml are links to this file)
RULES: Traversable = resources.files(__package__) / "rules.yml"
ENV_SELECTOR = "TRITONGUARD_PROMETHEUS_SELECTOR"  # e.g. namespace="prod",job="triton"
PROBE = "tritonguard_requests_total"  # its samples in the window tell a Prometheus that lost some
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
_MATCHER = re.compile(r"\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*(\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*')\s*")


class PrometheusError(ExporterError):
    """Prometheus cannot be asked, or answers an error."""


def rule_exprs(path: Traversable | Path | None = None) -> dict[str, str]:
    """Recording rule name -> its expression (``path``: the packaged :data:`RULES`). A missing or
    unreadable file is one line."""
    path = RULES if path is None else path
    try:
        text = path.read_text()
    except OSError as exc:  # not installed with the package (a copy without its data), unreadable
        raise PrometheusError(f"the Prometheus rules {path} cannot be read ({exc.strerror or type(exc).__name__}): "
                              "they ship in the tritonguard package (exporter/rollout/rules.yml); "
                              "reinstall it") from None
    try:
        groups = yaml.safe_load(text)["groups"]
        return {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}
    except (yaml.YAMLError, KeyError, TypeError) as exc:
        raise PrometheusError(f"the Prometheus rules {path} are not a rules file ({type(exc).__name__})") from None


def selector(text: str | None) -> str:
    """The operator's label matchers (``namespace="prod",job="triton"``, braces optional) checked
    and written as PromQL matchers; "" for none. A Prometheus shared by several namespaces or
    fleets holds other guards of the same model name: without it their counts are summed in."""
    text = (text or "").strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    out: list[str] = []
    pos = 0
    while text.strip() and pos < len(text):
        m = _MATCHER.match(text, pos)
        if m is None:
            raise PrometheusError(f"Prometheus selector {text!r}: expected label matchers like "
                                  f'namespace="prod",job="triton" (at character {pos + 1})')
        if m.group(1) in ("model", "__name__"):
            raise PrometheusError(f"Prometheus selector {text!r}: '{m.group(1)}' is set by the gates themselves")
        out.append(f"{m.group(1)}{m.group(2)}{m.group(3)}")
        pos = m.end()
        if pos < len(text):
            if text[pos] != ",":
                raise PrometheusError(f"Prometheus selector {text!r}: matchers are separated by commas "
                                      f"(at character {pos + 1})")
            pos += 1
    return ", ".join(out)


def _quote(value: str) -> str:
    return json.dumps(value)  # a PromQL string literal: double quotes, backslash escapes


def with_model(expr: str, model: str, scope: str = "") -> str:
    """Every ``tritonguard_*`` selector of ``expr`` restricted to ``model="<model>"`` and the
    matchers of ``scope`` (:func:`selector`)."""
    extra = f"model={_quote(model)}" + (f", {scope}" if scope else "")

    def add(m: re.Match) -> str:
        inner = (m.group(2) or "{}")[1:-1].strip()
        return f"{m.group(1)}{{{inner + ', ' if inner else ''}{extra}}}"
    return _SELECTOR.sub(add, expr)


def windowed(expr: str, model: str, seconds: int, scope: str = "") -> str:
    """A recording rule's expression as counts over the last ``seconds``: ``rate`` becomes
    ``increase``, every range becomes ``[<seconds>s]``; a quantile gives its buckets."""
    if m := _QUANTILE.match(expr):
        expr = m.group(1)
    expr = re.sub(r"(?<![\w:])rate\(", "increase(", expr)
    expr = re.sub(r"\[[0-9]+[smhd]\]", f"[{int(seconds)}s]", expr)
    return with_model(expr, model, scope)


def queries(model: str, seconds: int | None, rules: dict[str, str], scope: str = "") -> dict[str, str]:
    """Family -> the instant query for it; counters only with a window (``seconds``)."""
    out = {BREAKER: with_model(rules[RULE_OF[BREAKER]], model, scope)}
    if seconds is None:
        return out
    for name in (SERVED, ERRORS, LATENCY):
        out[name] = windowed(rules[RULE_OF[name]], model, seconds, scope)
    for name, labels in UNRECORDED.items():
        out[name] = with_model(f"sum by (model, {', '.join(labels)}) (increase({name}[{int(seconds)}s]))",
                               model, scope)
    return out


class PrometheusReader:
    """A rollout reader (``(primary, candidate) -> GuardReadings``) asking Prometheus at ``url``.

    ``scope``: label matchers added to every query (:func:`selector`; default
    ``$TRITONGUARD_PROMETHEUS_SELECTOR``)."""

    def __init__(self, url: str, model: str, *, target: str | None = None, timeout: float = 10.0,
                 rules_path: Traversable | Path | None = None, clock: Callable[[], float] = time.time,
                 say: Callable[[str], None] | None = None, scope: str | None = None):
        self.url, self.model, self.target, self.timeout, self.clock = url.rstrip("/"), model, target, timeout, clock
        self.scope = selector(os.environ.get(ENV_SELECTOR, "") if scope is None else scope)
        rules_path = RULES if rules_path is None else rules_path
        self.rules = rule_exprs(rules_path)
        missing = [r for r in RULE_OF.values() if r not in self.rules]
        if missing:
            raise PrometheusError(f"{rules_path} has no recording rule {', '.join(missing)}")
        self.say = say or (lambda _msg: None)
        self.anchor: float | None = None
        self.last: Series = {}  # counters since the anchor, as of the last look: they never go back
        self.answered: Series = {}  # the counters Prometheus answered at the last look, as answered
        self.lost: Series = {}  # counts Prometheus no longer holds (samples lost), kept
        self.previous: tuple[float, int, float] | None = None  # the last look: time, window, samples

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

    def answers(self, seconds: int | None, at: float | None = None) -> Series:
        """Every family's series as Prometheus answers them (counts since ``seconds`` before ``at``)."""
        out: Series = {}
        for name, promql in queries(self.model, seconds, self.rules, self.scope).items():
            for row in self.query(promql, at):
                labels = {k: v for k, v in row["metric"].items() if k != "__name__"}
                labels.setdefault("model", self.model)
                value = float(row["value"][1])
                if not math.isnan(value):
                    out[(name, frozenset(labels.items()))] = value
        return out

    def series(self, seconds: int | None, at: float | None = None) -> Series:
        out: Series = {}
        answered = self.answers(seconds, at)
        for key, value in answered.items():
            if key[0] == BREAKER:
                out[key] = value
                continue
            # lost counts kept; never back (increase() extrapolates: a count may dip between looks)
            value = max(float(round(self.lost.get(key, 0.0) + value)), self.last.get(key, 0.0))
            self.last[key] = out[key] = value
        if seconds is not None:
            self.answered = {k: v for k, v in answered.items() if k[0] != BREAKER}
        return out

    def samples(self, seconds: int, at: float) -> float:
        """Samples of the model's requests counter in the window: only a loss makes them fewer."""
        rows = self.query(with_model(f"sum(count_over_time({PROBE}[{int(seconds)}s]))", self.model, self.scope), at)
        return float(rows[0]["value"][1]) if rows else 0.0

    def _check_loss(self) -> None:
        """Counts lost since the last look (Prometheus restarted without its data) are kept."""
        if self.previous is None:
            return
        at, seconds, held = self.previous
        if self.samples(seconds, at) >= held:
            return
        still = self.answers(seconds, at)
        for key, value in self.answered.items():
            if value > still.get(key, 0.0):
                self.lost[key] = self.lost.get(key, 0.0) + value - still.get(key, 0.0)
        self.say(f"Prometheus {self.url} lost samples of the window (restarted without its data?): "
                 "the counts read until the last look are kept, and what it counts now is added")

    def replicas(self, at: float | None = None) -> int:
        rows = self.query(with_model(f"count(count by (instance) ({PROBE}))", self.model, self.scope), at)
        return int(float(rows[0]["value"][1])) if rows else 0

    def __call__(self, primary: int, candidate: int) -> GuardReadings:
        now = self.clock()
        if self.anchor is None:
            self.anchor = now - ANCHOR_S
            self.say(f"gates read from Prometheus {self.url}"
                     + (f" ({{{self.scope}}})" if self.scope else "")
                     + f": increase() since {time.strftime('%H:%M:%S', time.gmtime(self.anchor))} UTC, "
                     "with the recording rules' expressions (exporter/rollout/rules.yml)")
        seconds = int(math.ceil(now - self.anchor))
        self._check_loss()
        series = self.series(seconds, at=now)
        self.previous = (now, seconds, self.samples(seconds, now))
        for key, value in self.last.items():  # a series gone from every replica keeps its count
            series.setdefault(key, value)
        r = GuardReadings.from_scrapes([series], self.model, primary, candidate, target=self.target)
        r.replicas = self.replicas(at=now)
        if not r.replicas:
            r.problems.append(f"Prometheus {self.url} has no tritonguard series of model '{self.model}'"
                              + (f" matching {{{self.scope}}}" if self.scope else ""))
        r.taken_at = now
        r.source = f"prometheus:{self.url}@{self.anchor:.0f}"
        return r

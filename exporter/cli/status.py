"""What a model repository holds: models, their versions, hashes and golden verdicts."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table

from exporter.records.history import stages as history_stages
from exporter.records.progress import ControllerError
from exporter.records.registry import (
    ALIASES,
    RegistryError,
    default_uri,
    open_history,
    open_registry,
    sqlite_path,
)
from exporter.rollout.controller import RolloutController
from exporter.rollout.gates.readings import scrape
from exporter.rollout.route import state_summary
from exporter.rollout.serving import server_url
from tritonguard.core import catalogue
from tritonguard.core import repository as repo_mod
from tritonguard.rollout.endpoints import EndpointError, read_endpoints
from tritonguard.rollout.state import StateError
from tritonguard.rollout.stores import open_store
from tritonguard.triton import http as triton_http

# written beside champion/challenger during their deprecation; status shows the current names
DEPRECATED_ALIASES = frozenset(names[1] for names in ALIASES.values())

# the figures worth a column, per task, in the order shown
KEY_METRICS = {
    "classifier": ("top1_agreement", "max_abs_prob_diff"),
    "embedding": ("min_cosine",),
    "regression": ("max_abs_diff",),
}


def collect(repository: Path) -> list[dict[str, Any]]:
    """One entry per model folder with a config.pbtxt, sorted by name."""
    repository = Path(repository)
    if not repository.is_dir():
        return []
    models = []
    for model_dir in sorted(p for p in repository.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if not (model_dir / repo_mod.CONFIG).exists():
            continue
        try:
            cfg = repo_mod.read_config(model_dir)
            kind = cfg.get("backend") or cfg.get("platform") or "?"
            params = {k: v.get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}
            error = None
        except Exception as exc:  # noqa: BLE001 - a broken config is itself worth reporting
            kind, params, error = "?", {}, f"unreadable config.pbtxt: {exc}"
        entry: dict[str, Any] = {"name": model_dir.name, "kind": kind, "versions": []}
        if error:
            entry["error"] = error
        if "target" in params:
            entry["target"] = params["target"]
        if params.get("serves_as"):  # the guard step of the public ensemble of that name
            entry["serves_as"] = params["serves_as"]
        if kind == "guard":  # where the target runs: the cost summary cross-checks BLS targets with Triton
            entry["placement"] = params.get("placement", "bls")
            if params.get("target_per_version"):
                entry["target_per_version"] = params["target_per_version"]
        for v in repo_mod.versions(model_dir):
            man = repo_mod.read_manifest(model_dir / str(v)) or {}
            golden = man.get("golden") or {}
            entry["versions"].append({
                "version": v, "sha256": man.get("sha256"), "task": man.get("task"),
                "verdict": golden.get("verdict"), "metrics": golden.get("metrics", {}),
                "n": golden.get("n"), "created": man.get("created"), "part_of": man.get("part_of"),
            })
        _add_endpoints(entry, model_dir)
        models.append(entry)
    return models


def _add_endpoints(entry: dict[str, Any], model_dir: Path) -> None:
    """The versions of ``model_dir`` served at a URL (``endpoints.json``,
    :mod:`tritonguard.rollout.endpoints`) among its folder versions, in number order: URL, model
    name, judge, and where the guard reads the API key (a variable's name or a file's path, never
    the key). They have no artifact, so no golden; an unreadable file is the entry's
    ``endpoints_error``."""
    try:
        endpoints = read_endpoints(model_dir)
    except EndpointError as exc:
        entry["endpoints_error"] = str(exc)
        return
    for v, e in endpoints.items():
        man = e.manifest(model_dir.name)
        served = {"url": e.url, "model": man["endpoint"]["model"], "judge": e.judge}
        if e.api_key_env:
            served["api_key_env"] = e.api_key_env
        if e.api_key_file:
            served["api_key_file"] = e.api_key_file
        entry["versions"].append({"version": v, "sha256": man["sha256"], "task": man["task"], "verdict": None,
                                  "metrics": {}, "n": None, "created": None, "part_of": None, "endpoint": served})
    entry["versions"].sort(key=lambda item: item["version"])


def _served_at(served: dict[str, Any]) -> str:
    key = (f", key ${served['api_key_env']}" if served.get("api_key_env")
           else ", key from a file" if served.get("api_key_file") else "")
    return f"at {served['url']} ({served['model']})\njudge {served['judge']}{key}"


# short labels: the table must stay readable in an 80-column terminal
_LABELS = {"top1_agreement": "top1", "max_abs_prob_diff": "Δp", "min_cosine": "cos≥", "max_abs_diff": "Δ"}


def _figures(task: str | None, metrics: dict[str, Any]) -> str:
    keys = KEY_METRICS.get(task or "", ())
    return "\n".join(f"{_LABELS.get(k, k)} {metrics[k]:.4g}" if isinstance(metrics[k], float)
                     else f"{_LABELS.get(k, k)} {metrics[k]}" for k in keys if k in metrics)


def _created(iso: str | None) -> str:
    return iso[:16].replace("T", " ") if iso else ""


_VERDICT_STYLE = {"PASS": "green", "MARGINAL": "yellow", "FAIL": "red"}


def table(models: list[dict[str, Any]], repository: Path) -> Table:
    t = Table(title=f"model repository {repository} (times UTC)", box=box.SIMPLE_HEAD, title_justify="left",
              pad_edge=False, collapse_padding=True)
    for col in ("model", "kind", "v", "sha256", "golden", "figures", "created"):
        t.add_column(col, no_wrap=col != "figures", min_width=10 if col == "figures" else None)
    for m in models:
        if "error" in m:
            t.add_row(m["name"], m["kind"], "", "", "[red]error[/]", m["error"], "")
            continue
        # a guard has no artifact of its own: show what it fronts instead
        target = f"→ {m['target']}" if "target" in m else ""
        if not m["versions"]:
            t.add_row(m["name"], m["kind"], "-", "", "", target, "")
        for i, v in enumerate(m["versions"]):
            verdict = v["verdict"] or ""
            style = _VERDICT_STYLE.get(verdict)
            golden = f"[{style}]{verdict}[/] {v['n']}" if style else ""
            if v.get("endpoint"):  # served outside Triton: no artifact, no golden
                golden, figures = "URL", escape(_served_at(v["endpoint"]))
            elif v["part_of"]:
                figures = f"in {v['part_of']}"
            else:
                figures = _figures(v["task"], v["metrics"]) or target
            t.add_row(m["name"] if i == 0 else "", m["kind"] if i == 0 else "", str(v["version"]),
                      (v["sha256"] or "")[:8], golden, figures, _created(v["created"]))
        if m.get("endpoints_error"):
            t.add_row("", "", "", "", "[red]error[/]",
                      escape(m["endpoints_error"]), "")
    return t


# -- live rollout view ----------------------------------------------------------------------------
PROBE_TIMEOUT_S = 5.0


def _get(url: str) -> str | None:
    """None when ``url`` answers 200, else why not."""

    try:
        status, _ = triton_http.request(url, timeout=PROBE_TIMEOUT_S)
    except triton_http.Unreachable as exc:
        return exc.reason
    return None if status == 200 else f"HTTP {status}"


def unreachable(servers: list[str], metrics_urls: list[str], *, explicit_metrics: bool = False) -> list[str]:
    """One line per ``--server`` that cannot be reached (Triton's ``/v2/health/live``), and per
    metrics URL that does not answer; empty when every one does. Metrics URLs derived from the
    servers (``explicit_metrics`` false: one per server, HTTP port + 2) are named with their
    server, and not probed for a server that is down (one line says it)."""

    problems = []
    down: set[int] = set()
    for i, server in enumerate(servers):
        base = server_url(server).rstrip("/")
        why = _get(f"{base}/v2/health/live")
        # any HTTP answer means something listens there; only a failed connection is "down"
        if why is not None and not why.startswith("HTTP "):
            problems.append(f"server {base} cannot be reached: {why}")
            down.add(i)
    for i, url in enumerate(metrics_urls):
        if not explicit_metrics and i in down:
            continue
        why = _get(url)
        if why is None:
            continue
        if explicit_metrics or i >= len(servers):
            problems.append(f"metrics URL {url} cannot be read: {why}")
        else:
            problems.append(f"metrics of server {server_url(servers[i]).rstrip('/')} at {url} (its HTTP port + 2) "
                            f"cannot be read: {why}; pass --metrics-url if they are elsewhere")
    return problems


def _registry_stages(repository: Path, model: str) -> tuple[dict[int, str] | None, dict[str, int]]:
    """Stages by version from the registry, or None when there is none (never creates one), and
    the registered model's MLflow aliases (``champion``, ``challenger``, the user's) by name."""

    uri = default_uri(repository)
    db = sqlite_path(uri)
    if db is not None and not db.exists() and not os.environ.get("MLFLOW_TRACKING_URI"):
        return None, {}
    try:
        reg = open_registry(repository)
        return {info.version: info.stage for info in reg.versions(model)}, reg.aliases(model)
    except Exception as exc:  # noqa: BLE001 - status must show what it can
        return {"error": f"{type(exc).__name__}: {exc}"}, {}  # type: ignore[dict-item]


# what a drift share means and what to do, beside the figure (a figure alone left users guessing)
DRIFT_HINT = (" whose live values are unlike the data the version was exported with (a benchmark replaying a "
              "few inputs does this too; from real traffic: check the source, retrain and export)")

HISTORY_SHOWN = 5  # the latest records of a model's history the text view shows


def _registry_history(repository: Path, model: str) -> dict[str, Any] | None:
    """The model's stage history, checked: for an object-store repository the store's, which every
    machine shares (a machine that never ran a promotion shows it too). None when there is none."""
    try:
        history = open_history(repository)
    except RegistryError:
        return None  # a repository at a bucket's root: no history can be kept for it
    try:
        result, records = history.load(model)
    except Exception as exc:  # noqa: BLE001 - status must show what it can
        return {"where": history.where, "error": f"{type(exc).__name__}: {exc}"}
    if not records and result.ok:
        return None
    return {"where": history.where, "ok": result.ok, "reason": "" if result.ok else result.reason,
            "records": records}


def registry_disagreement(model: str, state: Any, stages: dict[int, str] | None,
                          rollout: dict[str, Any] | None) -> str | None:
    """A line when the registry's PRODUCTION is not the version the routing serves (the state's
    primary), or None: no registry, no primary pinned yet, or a rollout moving the stages."""

    if not stages or "error" in stages or state is None or (state.primary or 0) < 1:
        return None
    if rollout and rollout.get("status") in ("running", "paused", "pending"):
        return None
    production = sorted(v for v, s in stages.items() if s == "PRODUCTION")
    if production == [state.primary]:
        return None
    said = ", ".join(f"v{v}" for v in production) or "no version"
    return (f"the registry says PRODUCTION {said}, the routing serves v{state.primary}: "
            f"`exporter reconcile {model}` records what serves")


def _scrape_guard(urls: list[str], model: str) -> dict[str, Any]:
    """Breaker states, input drift and answers per version, summed/maxed over replicas; requests,
    rejects and fallbacks (by reason) for the rates of ``status --watch``."""

    out: dict[str, Any] = {"replicas": 0, "breaker": {}, "drift": {}, "served": {}, "errors": {}, "unreachable": [],
                           "requests": 0.0, "rejects": {}, "fallbacks": {}, "cost": {}}
    for url in urls:
        try:
            series = scrape(url, timeout=PROBE_TIMEOUT_S)
        except triton_http.Unreachable as exc:
            out["unreachable"].append(f"{url}: {exc.reason}")
            continue
        seen = False
        for (name, labelset), value in series.items():
            labels = dict(labelset)
            if labels.get("model") != model:
                continue
            seen = True
            tv = labels.get("target_version", "")
            if name == catalogue.BREAKER:
                out["breaker"][tv] = max(out["breaker"].get(tv, 0), int(value))
            elif name == catalogue.DRIFT:
                out["drift"][tv] = max(out["drift"].get(tv, 0.0), value)
            elif name == catalogue.SERVED:
                who = labels.get("served_by", "?")
                out["served"][who] = out["served"].get(who, 0) + value
            elif name == catalogue.ERRORS and tv:
                out["errors"][tv] = out["errors"].get(tv, 0) + value
            elif name == catalogue.REQUESTS:
                out["requests"] += value
            elif name in (catalogue.REJECTS, catalogue.FALLBACKS):
                why, key = labels.get("reason", "?"), "rejects" if name == catalogue.REJECTS else "fallbacks"
                out[key][why] = out[key].get(why, 0) + value
            elif name in _COST_SERIES:
                # per target version and tenant: summed over replicas; the gauge is kept per replica
                c = out["cost"].setdefault(tv, {}).setdefault(labels.get("tenant", ""), {
                    "cost": 0.0, "guard_s": 0.0, "target_s": 0.0, "requests": 0.0, "recent": []})
                field = _COST_SERIES[name]
                if field == "recent":
                    c["recent"].append(value)
                elif field == "compute":
                    c["guard_s" if labels.get("part") == "guard" else "target_s"] += value
                else:
                    c[field] += value
        out["replicas"] += seen
    return out


_COST_SERIES = {catalogue.COST: "cost", catalogue.COMPUTE: "compute",
                catalogue.CHARGED: "requests", catalogue.COST_PER_1K: "recent"}


def triton_compute(servers: list[str], model: str, version: int | None) -> dict[str, Any]:
    """Triton's own statistics of one model version, summed over ``servers``
    (``GET /v2/models/<model>[/versions/<v>]/stats``): compute seconds of its executions (input,
    infer and output, from ``batch_stats``: once per execution, however many requests it fused;
    an ensemble has none, then per request), queue seconds, executions and rows. Per server that
    cannot say: ``problems``."""

    out: dict[str, Any] = {"model": model, "version": version, "compute_s": 0.0, "queue_s": 0.0,
                           "executions": 0, "rows": 0, "servers": 0, "problems": []}
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version is not None else "") + "/stats"
    for server in servers:
        url = server_url(server).rstrip("/") + path
        try:
            status, body = triton_http.request(url, timeout=PROBE_TIMEOUT_S)
            if status != 200:
                raise ValueError(f"HTTP {status}")
            stats = json.loads(body)["model_stats"]
        except (triton_http.Unreachable, ValueError, KeyError) as exc:
            out["problems"].append(f"{url}: {getattr(exc, 'reason', exc)}")
            continue
        for st in stats:
            inf = st.get("inference_stats") or {}
            parts = ("compute_input", "compute_infer", "compute_output")
            batches = st.get("batch_stats") or []
            ns = (sum(int((b.get(k) or {}).get("ns", 0)) for b in batches for k in parts) if batches
                  else sum(int((inf.get(k) or {}).get("ns", 0)) for k in parts))
            out["compute_s"] += ns / 1e9
            out["queue_s"] += int((inf.get("queue") or {}).get("ns", 0)) / 1e9
            out["executions"] += int(st.get("execution_count", 0))
            out["rows"] += int(st.get("inference_count", 0))
        out["servers"] += 1
    return out


def live(repository: Path, metrics_urls: list[str], servers: list[str] | None = None) -> list[dict[str, Any]]:
    """Per guard model: routing state, rollout progress and last gate readings, registry stages,
    and (with metrics URLs) breaker states, drift, answers and cost per version from the
    replicas; with ``servers`` (their HTTP URLs) also Triton's own compute statistics of a BLS
    guard's target versions, beside the guards' measure of them."""

    repository = Path(repository)
    guards = []
    for m in collect(repository):
        if m.get("kind") != "guard":
            continue
        name = m.get("serves_as") or m["name"]  # rollout state and metrics go by the public name
        entry: dict[str, Any] = {"model": name, "target": m.get("target")}
        st = None
        try:
            st = open_store(name, repository).load()
            entry["state"] = st.to_dict() if st else None
        except (StateError, OSError) as exc:
            entry["state"] = {"error": str(exc)}
        try:
            p = RolloutController(name, repository, reader=None).status()  # type: ignore[arg-type]
            entry["rollout"] = None if p is None else {
                "candidate": p.candidate, "primary": p.primary, "mode": p.mode, "status": p.status,
                "step": p.step_index + 1, "steps": p.steps, "share": p.share, "look": p.look,
                "reason": p.reason, "gates": (p.last_report or {}).get("gates", []),
                "arms": {v: {"weight": a["weight"], "status": a["status"], "reason": a["reason"],
                             "gates": (a.get("last_report") or {}).get("gates", [])} for v, a in p.arms.items()}}
        except ControllerError as exc:
            entry["rollout"] = {"error": str(exc)}
        entry["stages"], entry["aliases"] = _registry_stages(repository, name)
        entry["history"] = _registry_history(repository, name)
        if entry["stages"] is None and entry["history"] and entry["history"].get("records"):
            # no registry on this machine: the stages as the fleet's history tells them
            entry["stages"] = history_stages(entry["history"]["records"])
            entry["stages_from"] = "history"
        # a read changes nothing: where the registry and the routing disagree, say so
        entry["registry_disagrees"] = registry_disagreement(name, st, entry["stages"], entry.get("rollout"))
        if metrics_urls:
            entry["metrics"] = _scrape_guard(metrics_urls, name)
            if servers and m.get("placement") == "bls" and m.get("target"):
                entry["triton_stats"] = {}
                for tv in sorted(entry["metrics"]["cost"]):
                    if not tv.isdigit():
                        continue
                    per = m.get("target_per_version")
                    entry["triton_stats"][tv] = (triton_compute(servers, per.format(version=tv), None) if per
                                                 else triton_compute(servers, m["target"], int(tv)))
        guards.append(entry)
    return guards


def print_live(console: Any, guards: list[dict[str, Any]]) -> None:
    for g in guards:
        st = g.get("state") or {}
        console.print(f"\n[bold]{g['model']}[/] → {g['target']}")
        if "error" in st:
            console.print(f"  state: [red]{st['error']}[/]")
        elif not st:
            console.print("  routing: no state yet (the guard writes one when it loads)")
        else:
            head, *rest = state_summary(st)
            console.print(f"  routing {head}")
            for line in rest:
                console.print(f"  {line}")
        stages = g.get("stages")
        if isinstance(stages, dict) and "error" in stages:
            console.print(f"  registry: [red]{stages['error']}[/]")
        elif stages:
            label = "registry (from its history)" if g.get("stages_from") == "history" else "registry"
            named: dict[int, list[str]] = {}
            for alias, v in (g.get("aliases") or {}).items():
                if alias not in DEPRECATED_ALIASES:  # the old names go with champion/challenger
                    named.setdefault(v, []).append(alias)
            console.print(f"  {label}: " + ", ".join(
                f"v{v} {s}" + (f" @{' @'.join(named[v])}" if v in named else "") for v, s in sorted(stages.items())))
        print_history(console, g.get("history"))
        if g.get("registry_disagrees"):
            console.print(f"  [yellow]! {escape(g['registry_disagrees'])}[/]", soft_wrap=True)
        r = g.get("rollout")
        if r and "error" not in r:
            who = (", ".join(f"v{v}={a['weight']:g} {a['status']}" for v, a in r["arms"].items())
                   if r.get("arms") else f"v{r['candidate']}")
            console.print(f"  rollout {who} ({r['mode']}): {r['status']}, step {r['step']}/{len(r['steps'])} "
                          f"at {r['share']:.0%}, look {r['look']}: {r['reason']}")
            windows = {f"v{v} ": a["gates"] for v, a in r["arms"].items()} if r.get("arms") else {"": r["gates"]}
            for prefix, gates in windows.items():
                for gate in gates:
                    console.print(f"    {prefix}{gate['name']:<11} {gate['verdict']:<12} n={gate['samples']:<7} "
                                  f"{gate['reason']}")
        elif r:
            console.print(f"  rollout: [red]{r['error']}[/]")
        met = g.get("metrics")
        if met:
            names = {0: "closed", 1: "half-open", 2: "open"}
            if met["replicas"]:
                console.print(f"  live ({met['replicas']} replica{'s' if met['replicas'] != 1 else ''}): "
                              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(met["served"].items())))
            else:
                console.print("  live: [yellow]no replica reports this model[/]"
                              + (" (see unreachable below)" if met["unreachable"] else " (not loaded there?)"))
            for v, code in sorted(met["breaker"].items()):
                console.print(f"    breaker v{v}: {names.get(code, code)} (worst replica)")
            for v, count in sorted(met["errors"].items()):
                console.print(f"    target errors v{v}: {count:.0f}")
            for v, frac in sorted(met["drift"].items()):
                console.print(f"    input drift v{v}: {frac:.0%} of features" + (DRIFT_HINT if frac else ""),
                              soft_wrap=True)
            print_cost(console, met.get("cost") or {}, g.get("triton_stats") or {})
            for u in met["unreachable"]:
                console.print(f"    [red]unreachable[/] {u}")


def print_history(console: Any, history: dict[str, Any] | None) -> None:
    if not history:
        return
    if "error" in history:
        console.print(f"  history: [red]{escape(history['error'])}[/]", soft_wrap=True)
        return
    records = history["records"]
    check = "chain intact" if history["ok"] else f"[red]chain broken: {escape(history['reason'])}[/]"
    console.print(f"  history: {len(records)} record{'s' if len(records) != 1 else ''}, {check} "
                  f"({escape(history['where'])})", soft_wrap=True)
    for rec in records[-HISTORY_SHOWN:]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(rec.get("ts", 0))))
        if rec.get("type") == "transition":
            what = f"{rec.get('from')} → {rec.get('to')}" + (" (rollback)" if rec.get("rollback") else "")
            if rec.get("archived"):
                what += ", archived " + ", ".join(f"v{v}" for v in rec["archived"])
        else:
            what = str(rec.get("type"))
        why = f": {rec['reason']}" if rec.get("reason") else ""
        console.print(f"    #{rec.get('seq')} {when} v{rec.get('version')} {what} by {rec.get('by', '?')}"
                      f"{escape(why)}", soft_wrap=True)


def _version_key(v: str) -> tuple[int, str]:
    return (int(v), "") if v.isdigit() else (1 << 30, v)


def print_cost(console: Any, cost: dict[str, dict[str, dict[str, Any]]], triton: dict[str, dict[str, Any]]) -> None:
    """Cost per version (and per tenant where there are several) from the guards' cost meter,
    since each replica loaded; "recent" is the guards' decaying gauge (cost.window_s). Beside a
    BLS target's versions: Triton's compute seconds for that model version."""
    if not cost:
        return
    console.print("  cost (guards' meter, since each replica loaded; currency and prices of cost.*):")
    for v in sorted(cost, key=_version_key):
        tenants = cost[v]
        tot = {k: sum(t[k] for t in tenants.values()) for k in ("cost", "guard_s", "target_s", "requests")}
        recent = [x for t in tenants.values() for x in t["recent"]]
        n = tot["requests"]
        name = f"v{v}" if v.isdigit() else v
        if n:
            per = f"{1000 * tot['cost'] / n:.4g} per 1k requests" if tot["cost"] else "unpriced"
            line = (f"    {name:<8} {per} ({n:,.0f} requests; compute {tot['guard_s'] + tot['target_s']:.3f} s: "
                    f"guard {tot['guard_s']:.3f} s, target {tot['target_s']:.3f} s)")
        else:
            line = f"    {name:<8} no requests answered; target calls {tot['target_s']:.3f} s"
        if recent and n:
            line += f"; recent {sum(recent) / len(recent):.4g}"
        console.print(line)
        if len(tenants) > 1:
            console.print("      " + ", ".join(
                f"{t or '(none)'} {1000 * c['cost'] / c['requests']:.4g}" + f" ({c['requests']:,.0f})"
                for t, c in sorted(tenants.items()) if c["requests"] and c["cost"]))
        st = triton.get(v)
        if st is not None and st["servers"]:
            rows = st["rows"]
            console.print(f"      Triton {st['model']}" + (f" v{st['version']}" if st["version"] is not None else "")
                          + f": compute {st['compute_s']:.3f} s in {st['executions']:,} executions of {rows:,} rows"
                          + (f" ({1e6 * st['compute_s'] / rows:.1f} µs a row)" if rows else "")
                          + f", queue {st['queue_s']:.3f} s; guards' target calls {tot['target_s']:.3f} s "
                          "(theirs include queue and transfer; Triton's include every caller)")
        elif st is not None:
            console.print(f"      Triton {st['model']}: [yellow]no statistics[/] ({'; '.join(st['problems'])})")

"""``exporter status --watch``: one live terminal view of every guard, redrawn every few seconds
from the rollout state and the metrics port of every ``--server``: routing, rollout step and gates,
breakers (worst replica), traffic as rates between two readings, input drift, and cost per 1000
requests per version over the last interval (the guards' cost meter, ``tritonguard/observe/cost.py``)."""

from __future__ import annotations

import time
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from exporter.cli.status import live

INTERVAL_S = 2.0
_BREAKER = {0: "[green]closed[/]", 1: "[yellow]half-open[/]", 2: "[red]open[/]"}
_VERDICT = {"PASS": "green", "FAIL": "red", "INCONCLUSIVE": "yellow"}


def rates(before: dict[str, Any] | None, after: dict[str, Any], seconds: float) -> dict[str, Any]:
    """Per-second rates of one guard's counters between two readings (``_scrape_guard``'s dict).
    A series new since ``before`` counts from 0 (the guard creates it at its first count); one that
    went down restarted with its replica: its rate is unknown, not negative."""

    def per_s(old: float | None, new: float) -> float | None:
        if old is None or seconds <= 0 or new < old:
            return None
        return (new - old) / seconds

    def each(key: str) -> dict[str, float | None]:
        old = (before or {}).get(key, {})
        return {k: per_s(old.get(k, 0.0) if before else None, v) for k, v in after.get(key, {}).items()}

    return {"requests": per_s(before["requests"] if before else None, after.get("requests", 0.0)),
            "rejects": each("rejects"), "fallbacks": each("fallbacks"), "served": each("served"),
            "cost": cost_per_1k(before, after)}


def cost_per_1k(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, float | None]:
    """Per target version: priced cost of 1000 requests answered between the two readings (all
    tenants and replicas); None until two readings, or when no request was charged meanwhile or a
    replica restarted (a counter went down)."""

    def totals(reading: dict[str, Any] | None) -> dict[str, tuple[float, float]]:
        out = {}
        for v, tenants in ((reading or {}).get("cost") or {}).items():
            out[v] = (sum(t["cost"] for t in tenants.values()), sum(t["requests"] for t in tenants.values()))
        return out

    old, new = totals(before), totals(after)
    result: dict[str, float | None] = {}
    for v, (cost, n) in new.items():
        if before is None:
            result[v] = None
            continue
        c0, n0 = old.get(v, (0.0, 0.0))
        dc, dn = cost - c0, n - n0
        result[v] = 1000 * dc / dn if dn > 0 and dc >= 0 else None
    return result


def _rate(x: float | None) -> str:
    return "…" if x is None else f"{x:.1f}"


def _by(d: dict[str, float | None]) -> str:
    """``range 2.0, finite 0.5`` for the reasons with a known, non-zero rate."""
    return ", ".join(f"{escape(k)} {v:.1f}" for k, v in sorted(d.items(), key=lambda kv: -(kv[1] or 0)) if v)


def _routing(g: dict[str, Any]) -> str:
    st = g.get("state") or {}
    if "error" in st:
        return f"[red]{escape(st['error'])}[/]"
    if not st:
        return "no state yet"
    text = f"primary v{st['primary']['version']}"
    if cand := st.get("candidate"):
        text += f"\ncandidate v{cand['version']} {cand['share']:.0%}"
    for arm in st.get("arms") or []:
        text += f"\narm v{arm['version']} {arm['weight']:.0%}"
    if st.get("shadow_share"):
        text += f"\nshadow {st['shadow_share']:.0%}"
    return text


def _rollout(g: dict[str, Any]) -> str:
    r = g.get("rollout")
    if not r:
        return "[dim]none[/]"
    if "error" in r:
        return f"[red]{escape(r['error'])}[/]"
    lines = [f"{escape(r['status'])} step {r['step']}/{len(r['steps'])} {r['share']:.0%}"]
    windows = {f"v{v} ": a["gates"] for v, a in r["arms"].items()} if r.get("arms") else {"": r["gates"]}
    for prefix, gates in windows.items():
        lines += [f"{prefix}{escape(gate['name'])} [{_VERDICT.get(gate['verdict'], 'white')}]{escape(gate['verdict'])}[/] "
                  f"({gate['samples']})" for gate in gates]
    return "\n".join(lines)


def _costs(costs: dict[str, float | None]) -> str:
    def label(v: str) -> str:
        return v if v in ("cache", "default") else f"v{v}"

    return "\n".join(f"{escape(label(v))} {'…' if c is None else f'{c:.3g}'}" for v, c in sorted(costs.items()))


def _breakers(g: dict[str, Any]) -> str:
    met = g.get("metrics") or {}
    if met.get("breaker"):
        return "\n".join(f"v{v} {_BREAKER.get(code, str(code))}" for v, code in sorted(met["breaker"].items()))
    # no replica reports one: the states stored in the rollout state, if any
    stored = (g.get("state") or {}).get("breakers") or {}
    return "\n".join(f"v{v} {b.get('state', 'closed')}" for v, b in sorted(stored.items())) or "[dim]-[/]"


def _table(*columns: str) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in columns:
        t.add_column(col, no_wrap=col not in ("rollout, gates (n)", "rejects/s", "fallbacks/s"))
    return t


def view(guards: list[dict[str, Any]], guard_rates: dict[str, dict[str, Any]], *, servers: list[str],
         interval: float, taken: str, found: str = "") -> Group:
    """The whole screen for one reading: two tables, each readable in 80 columns."""
    state = _table("model", "routing", "rollout, gates (n)", "breakers")
    traffic = _table("model", "req/s", "rejects/s", "fallbacks/s", "served by /s", "drift", "cost/1k")
    unreachable: list[str] = []
    for g in guards:
        met, r = g.get("metrics") or {}, guard_rates.get(g["model"], {})
        unreachable += met.get("unreachable", [])
        name = f"[bold]{escape(g['model'])}[/]"
        state.add_row(f"{name}\n→ {escape(str(g['target']))}", _routing(g), _rollout(g), _breakers(g))
        if "metrics" in g:
            traffic.add_row(name, _rate(r.get("requests")), _by(r.get("rejects", {})), _by(r.get("fallbacks", {})),
                            "\n".join(f"{escape(k)} {_rate(v)}" for k, v in sorted(r.get("served", {}).items())),
                            "\n".join(f"v{v} {f:.0%}" for v, f in sorted(met.get("drift", {}).items())),
                            _costs(r.get("cost", {})))
    head = (f"[bold]tritonguard[/] {taken} UTC, every {interval:g} s, "
            + (f"{escape(found)}: " if found else f"{len(servers)} server{'s' if len(servers) != 1 else ''}: ")
            + f"{escape(', '.join(servers)) or 'none'}")
    parts: list[Any] = [head]
    if not guards:
        parts.append("[yellow]no guard models in this repository[/]")
    else:
        parts.append(state)
        parts.append(traffic if traffic.row_count else
                     "[yellow]no --server or --metrics-url: traffic, breakers and drift come from the replicas' metrics[/]")
    parts += [f"[red]unreachable[/] {escape(u)}" for u in dict.fromkeys(unreachable)]
    parts.append("[dim]rates over the last interval (… until two readings); breakers: worst replica; "
                 "cost/1k: priced cost of 1000 requests answered in the interval, per version (cache: "
                 "cache hits; cost.* prices). Ctrl-C to stop.[/]")
    return Group(*parts)


def watch(console: Console, repository: Path, servers: list[str], metrics_urls: list[str], *,
          interval: float = INTERVAL_S, readings: int | None = None, fleet: Any = None) -> None:
    """Redraw the view every ``interval`` seconds until Ctrl-C (or ``readings`` readings). Piped
    (a log, ``| tee``), each reading is printed below the last instead of redrawn. With ``fleet``
    (:class:`exporter.rollout.fleet.Fleet`), the replicas are re-read from its registry at each
    reading: one that stopped heartbeating drops out, one that joined is shown."""
    from rich.live import Live  # noqa: PLC0415

    before: dict[str, tuple[float, dict[str, Any]]] = {}
    n = 0
    with suppress(KeyboardInterrupt), ExitStack() as stack:
        screen = stack.enter_context(Live(console=console, auto_refresh=False)) if console.is_terminal else None
        while readings is None or n < readings:
            found = ""
            if fleet is not None:
                try:
                    reps = fleet.replicas()
                    servers, metrics_urls = [r.http for r in reps], [r.metrics for r in reps]
                    found = fleet.line(reps)
                except Exception as exc:  # noqa: BLE001 - the registry is down: keep the last list
                    found = f"replica registry unreadable ({exc}); last known"
            guards = live(repository, metrics_urls)
            now = time.monotonic()
            guard_rates = {}
            for g in guards:
                if (met := g.get("metrics")) is not None:
                    then, old = before.get(g["model"], (now, None))
                    guard_rates[g["model"]] = rates(old, met, now - then)
                    before[g["model"]] = (now, met)
            frame = view(guards, guard_rates, servers=servers, interval=interval,
                         taken=time.strftime("%H:%M:%S", time.gmtime()), found=found)
            if screen is None:
                console.print(frame)
            else:
                screen.update(frame, refresh=True)
            n += 1
            if readings is None or n < readings:
                time.sleep(interval)

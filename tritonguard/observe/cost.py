"""What serving a request costs: measured compute times configured prices, per version and tenant.

Each guard instance (its own process) keeps one :class:`CostMeter`. After every ``execute()``
batch the guard hands it the batch (:class:`tritonguard.guard.services.PrivacyBatch`), the routed result
and the router's target calls of that batch (``Router.calls``: version, request indices, start and
end ``perf_counter_ns``). Each answered request is charged

- **target**: its row share of the wall time of every target call it was part of, charged to
  the version that ran the call (a candidate whose call failed pays for it, even when the primary
  then answered), priced at ``cost.target_cores`` x ``cost.cpu_core_hour`` per hour, or
  ``cost.gpu_hour`` when the target runs on a GPU;
- **guard**: its row share of the guard's own CPU time (the serving thread's CPU clock since the
  last batch, less that thread's CPU time inside the in-process target calls), priced at one CPU
  core. Batches
  with no answered request (all rejected, all failed) hand their guard time to the next batch
  that answers something: every CPU second of the guard is paid by an answered request.

Cache hits are charged guard time only, under ``target_version="cache"``; default responses under
``"default"``. Not measured: canary re-runs and shadow calls (a background worker), golden checks,
and anything the target does for other callers. Load work is nobody's request: the guard calls
:meth:`CostMeter.loaded` once its ``initialize()`` is done, so the engine loads and start-up goldens
that ran on the serving thread before the first batch are logged, not charged to its tenant; a
version's golden check that runs later on the serving thread (a BLS guard's primary is checked in
its first batch: no BLS call in ``initialize()``) runs through :meth:`CostMeter.uncharged`.

Exported through :class:`tritonguard.triton.metrics.Metrics` (which adds the guard's ``model`` and
``version``): ``tritonguard_compute_seconds_total{target_version,tenant,part}``,
``tritonguard_cost_total{target_version,tenant,part}`` (in the prices' currency),
``tritonguard_cost_requests_total{target_version,tenant}`` (requests charged) and the gauge
``tritonguard_cost_per_1k_requests{target_version,tenant}``, an exponentially decaying average
over ``cost.window_s`` recomputed every :attr:`CostMeter.PUBLISH_S` seconds by a daemon thread of
the meter. The serving path only adds to dictionaries: a few operations per request, no I/O, one
uncontended lock per batch.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tritonguard.core.config import model_parameters

log = logging.getLogger(__name__)

CACHE = "cache"  # target_version label of cache hits
T = TypeVar("T")


@dataclass(kw_only=True)
class CostConfig:
    """``cost.*`` parameters of a guard model. Prices are per hour, in one currency of your
    choice (the defaults are rough 2025 on-demand cloud list prices in USD); 0 for both prices
    exports compute seconds only, no cost."""

    enabled: bool = True
    cpu_core_hour: float = 0.05  # one CPU core (vCPU) for an hour
    gpu_hour: float = 2.50  # one GPU for an hour
    # CPU cores a target call occupies; 0: the engine's intra-op threads where the guard knows
    # them (in-process targets, BLS targets served by the runtime backend), else 1
    target_cores: float = 0.0
    window_s: float = 300.0  # time constant of the decaying average the gauge shows

    def __post_init__(self) -> None:
        for name in ("cpu_core_hour", "gpu_hour", "target_cores"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"cost.{name} must be a finite number >= 0, got {value}")
        if not math.isfinite(self.window_s) or self.window_s <= 0:
            raise ValueError(f"cost.window_s must be > 0, got {self.window_s}")

    @property
    def priced(self) -> bool:
        return self.cpu_core_hour > 0 or self.gpu_hour > 0


def target_resource(placement: str, target_config: Mapping[str, Any] | None, params: Mapping[str, str],
                    instance_kind: str = "") -> tuple[str, float]:
    """``("gpu", 1)`` or ``("cpu", cores)``: what one target call occupies, as far as the guard's
    and the target's config.pbtxt say. In process, the guard's ``runtime.*`` overrides the
    target's own parameters (as when the engine is built); over BLS, a target whose instance
    group says KIND_GPU is a GPU target (KIND_AUTO is taken as CPU: the guard cannot tell)."""

    own = model_parameters(target_config or {})
    if placement == "inprocess":
        eng = {**own, **{k.split(".", 1)[1]: v for k, v in params.items() if k.startswith("runtime.")}}
        providers = eng.get("providers", "CPUExecutionProvider")
        if instance_kind.upper().endswith("GPU") or any(p in providers for p in ("CUDA", "Tensorrt", "TensorRT")):
            return "gpu", 1.0
    else:
        kinds = {str(g.get("kind", "KIND_AUTO")) for g in (target_config or {}).get("instance_group") or []}
        if "KIND_GPU" in kinds:
            return "gpu", 1.0
        eng = own if (target_config or {}).get("backend") == "runtime" else {}
    try:
        threads = int(str(eng.get("intra_op_threads", "1")).strip())
    except ValueError:
        threads = 1
    if threads == 0:  # the library's default: every core
        threads = os.cpu_count() or 1
    return "cpu", float(max(threads, 1))


class CostMeter:
    """Per-request compute and cost of one guard instance (see the module's docstring)."""

    PUBLISH_S = 5.0  # the gauge is recomputed this often

    def __init__(self, config: CostConfig, *, metrics: Any, label: Callable[[str], str] = str,
                 resource: str = "cpu", cores: float = 1.0, inprocess: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], int] = time.thread_time_ns, publisher: bool = False):
        self.config = config
        self.metrics = metrics
        self.label = label  # tenant -> metric label (the privacy stage's cardinality guard)
        self.resource = resource
        self.cores = config.target_cores or cores
        self.inprocess = inprocess  # target calls run on the serving thread: its CPU clock sees them
        self.clock, self.cpu_clock = clock, cpu_clock
        hourly = config.gpu_hour if resource == "gpu" else config.cpu_core_hour * self.cores
        self.target_price = hourly / 3600  # per second of a target call
        self.guard_price = config.cpu_core_hour / 3600  # per CPU second of the guard
        self.priced = config.priced
        # the serving thread's CPU clock at its last batch (a thread first seen starts there)
        self._cpu_last: dict[int, int] = {threading.get_ident(): cpu_clock()}
        self._carry = 0.0  # guard seconds of batches that answered nothing, for the next one
        self._pending: dict[tuple[str, str], list[float]] = {}  # since the last publish: [cost, requests]
        self._window: dict[tuple[str, str], list[float]] = {}  # decayed [cost, requests]
        self._published: float | None = None
        self._lock = threading.Lock()  # _pending: filled by the serving thread, taken by the publisher
        self._failed = False
        self._stop = threading.Event()
        if publisher and config.enabled and self.priced:
            threading.Thread(target=self._run, name="cost-gauge", daemon=True).start()

    @property
    def summary(self) -> str:
        unit = "GPU" if self.resource == "gpu" else f"{self.cores:g} CPU core{'s' if self.cores != 1 else ''}"
        return (f"cost: target calls priced as {unit} ({self.target_price * 3600:g}/h), guard as 1 CPU core "
                f"({self.guard_price * 3600:g}/h)")

    def loaded(self) -> float:
        """Start charging from now, and return the CPU seconds the calling (serving) thread spent
        since the meter was made: load work (engines, warm-up, start-up goldens) that the first
        batch would otherwise pay, to the tenant of whichever request came first (3.6 s of a
        text guard's load on a 2-core machine, against ~1 ms of guard time a request)."""
        now = self.cpu_clock()
        last = self._cpu_last.get(threading.get_ident())
        self._cpu_last[threading.get_ident()] = now
        self._carry = 0.0
        return max(now - last, 0) / 1e9 if last is not None else 0.0

    def uncharged(self, work: Callable[[], T]) -> T:
        """``work()``, its CPU on the calling thread charged to no tenant: one-off work of a version
        (its golden check) that the next batch would otherwise pay. A BLS guard checks its primary
        in its first batch, on the serving thread: 7-30 ms of BLS calls and comparisons that made a
        fresh server's first request cost 4-10x a later one. Other threads are not metered."""
        tid = threading.get_ident()
        start = self.cpu_clock()
        try:
            return work()
        finally:
            last = self._cpu_last.get(tid)
            if last is not None:  # the next batch is charged from here, less the work's CPU
                self._cpu_last[tid] = last + max(self.cpu_clock() - start, 0)

    def record(self, batch: Any, routed: Any, calls: Sequence[tuple[int, list[int], int, int, bool]],
               calls_cpu_ns: int | None = None) -> None:
        """Charge one execute() batch. Never raises: cost is reporting, not serving.

        ``calls_cpu_ns``: the serving thread's CPU time inside the target calls (what an
        in-process target ran on it), left out of the guard's time; without it, the calls' wall
        time is left out instead, which under load also removes the time the thread waited."""
        if not self.config.enabled:
            return
        try:
            self._record(batch, routed, calls, calls_cpu_ns)
        except Exception:  # noqa: BLE001
            if not self._failed:  # once: a bug here must not flood the server log
                log.exception("cost meter failed; cost figures are incomplete from now on")
            self._failed = True

    def _record(self, batch: Any, routed: Any, calls: Sequence[tuple[int, list[int], int, int, bool]],
                calls_cpu_ns: int | None = None) -> None:
        now_cpu = self.cpu_clock()
        tid = threading.get_ident()
        last = self._cpu_last.get(tid)
        self._cpu_last[tid] = now_cpu
        if routed is None:
            calls = ()  # nothing was routed: Router.calls still holds an earlier batch's calls
        route, sizes, tenants = batch.route, batch.sizes, batch.tenants
        labels: dict[str, str] = {}

        def tenant(i: int) -> str:
            t = tenants[i]
            lab = labels.get(t)
            if lab is None:
                lab = labels[t] = self.label(t)
            return lab

        # key (target_version, tenant) -> [guard s, target s, requests]
        acc: dict[tuple[str, str], list[float]] = {}
        target_s = 0.0
        for version, idx, t0, t1, _ok in calls:
            dt = max(t1 - t0, 0) / 1e9
            target_s += dt
            rows = sum(sizes[k] for k in idx)
            if not rows:
                continue
            v = str(version)
            for k in idx:
                key = (v, tenant(route[k]))
                a = acc.get(key)
                if a is None:
                    a = acc[key] = [0.0, 0.0, 0.0]
                a[1] += dt * sizes[k] / rows
        answered: list[tuple[tuple[str, str], int]] = []
        if routed is not None:
            for k, i in enumerate(route):
                if routed.errors[k] is None:
                    answered.append(((routed.served_by[k].rpartition(":")[2] or "default", tenant(i)), sizes[k]))
        for i, n in batch.hit_sizes.items():
            answered.append(((CACHE, tenant(i)), n))
        guard_s = self._carry
        if last is not None:
            inside = 0.0
            if self.inprocess:
                inside = target_s if calls_cpu_ns is None or routed is None else calls_cpu_ns / 1e9
            guard_s += max((now_cpu - last) / 1e9 - inside, 0.0)
        rows = sum(n for _, n in answered)
        if rows:
            self._carry = 0.0
            for key, n in answered:
                a = acc.get(key)
                if a is None:
                    a = acc[key] = [0.0, 0.0, 0.0]
                a[0] += guard_s * n / rows
                a[2] += 1
        else:
            self._carry = guard_s
        inc = self.metrics.inc
        for (v, t), (g, s, n) in acc.items():
            if g:
                inc("compute_seconds", g, target_version=v, tenant=t, part="guard")
            if s:
                inc("compute_seconds", s, target_version=v, tenant=t, part="target")
            if n:
                inc("cost_requests", n, target_version=v, tenant=t)
            if self.priced:
                cost = g * self.guard_price + s * self.target_price
                if g:
                    inc("cost", g * self.guard_price, target_version=v, tenant=t, part="guard")
                if s:
                    inc("cost", s * self.target_price, target_version=v, tenant=t, part="target")
                with self._lock:
                    p = self._pending.get((v, t))
                    if p is None:
                        self._pending[(v, t)] = [cost, n]
                    else:
                        p[0] += cost
                        p[1] += n

    def _run(self) -> None:
        while not self._stop.wait(self.PUBLISH_S):
            try:
                self.publish(self.clock())
            except Exception:  # noqa: BLE001 - the gauge is reporting: keep the thread alive
                log.exception("cost gauge update failed")

    def close(self) -> None:
        self._stop.set()

    def publish(self, now: float) -> None:
        """Fold what was charged since the last publish into the decaying window and set the
        gauge for every (version, tenant) that answered requests in it (the publisher thread)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        decay = 1.0 if self._published is None else math.exp(-(now - self._published) / self.config.window_s)
        self._published = now
        for key in self._window.keys() | pending.keys():
            w = self._window.get(key) or [0.0, 0.0]
            p = pending.get(key, (0.0, 0.0))
            w = [w[0] * decay + p[0], w[1] * decay + p[1]]
            if w[1] < 1e-6:  # no request for many windows: forget it (its gauge keeps its last value)
                self._window.pop(key, None)
                continue
            self._window[key] = w
            if key in pending:
                self.metrics.set("cost_per_1k", 1000 * w[0] / w[1], target_version=key[0], tenant=key[1])


def cost_meter(config: CostConfig, *, placement: str, target_config: Mapping[str, Any] | None,
               params: Mapping[str, str], instance_kind: str, metrics: Any,
               label: Callable[[str], str]) -> CostMeter:
    """The meter of one guard instance, its target's resource read from the configs."""
    resource, cores = target_resource(placement, target_config, params, instance_kind)
    meter = CostMeter(config, metrics=metrics, label=label, resource=resource, cores=cores,
                      inprocess=placement == "inprocess", publisher=True)
    if config.enabled:
        log.info("%s", meter.summary)
    return meter


__all__ = ["CACHE", "CostConfig", "CostMeter", "cost_meter", "target_resource"]

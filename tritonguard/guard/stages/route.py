"""Routing (``routing.*``, ``breaker.*``, ``validator.*``): the pending requests go to the
versions the rollout state names, through breakers and the fallback chain, in one call per
version (see :mod:`tritonguard.guard.routing.router`)."""

from __future__ import annotations

from typing import Any

from tritonguard.core.errors import TargetError
from tritonguard.guard.pipeline import Batch, Stage
from tritonguard.guard.routing.sticky import PRIMARY_PIN, apply_keys, has_keys


def pin_of(params: dict[str, Any]) -> int | None:
    """The version a request must be answered by (request parameter ``version``), or None;
    ``primary`` is :data:`PRIMARY_PIN` (whichever version the state names primary); any other
    value that is not a positive whole number is 0, which the router refuses with INVALID_ARGUMENT."""
    raw = params.get("version")
    if raw is None:
        return None
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw if raw > 0 else 0
    text = str(raw).strip()
    if text == "primary":
        return PRIMARY_PIN
    return int(text) if text.isascii() and text.isdigit() else 0


class NoVersion(TargetError):
    """No version of the target may answer a generation (breakers open, goldens failed)."""

    def __init__(self, target: str):
        super().__init__(f"no healthy version of '{target}' can answer (breakers open or goldens failed); "
                         "retry later", "UNAVAILABLE")


class RouteStage(Stage):
    """A batch: its requests to the versions, answered (``router.infer``). A generation: the
    version that answers it (``router.pick``: the primary, a canary's share; breakers and goldens
    keep the unhealthy out); the guard calls it, records the outcome and falls back down the
    chain (:mod:`tritonguard.guard.routing.stream`)."""

    name = "route"

    def __init__(self, router: Any):
        self.router = router

    def admit(self, gen: Any) -> None:
        version, role, draw = self.router.pick()
        if version is None:
            raise NoVersion(self.router.target)
        gen.version, gen.role, gen.draw = version, role, draw

    def run(self, b: Batch) -> None:
        if not b.valid:
            return
        router = self.router
        if b.route:
            pins = [pin_of(b.params[i]) for i in b.route]
            tb = b.trace
            traced = ({k: tb.sampled[i] for k, i in enumerate(b.route) if i in tb.sampled}
                      if tb is not None else None)
            if b.draws is None and has_keys(b.params):  # sticky routing: keys placed by their hash
                b.draws = apply_keys(b.params, router.rng.random(len(b.responses)))
            b.routed = router.infer(b.fused, b.sizes, pins if any(x is not None for x in pins) else None,
                                    traced=traced or None, draws=None if b.draws is None else b.draws[b.route])
            b.calls, b.calls_cpu_ns = router.calls, router.calls_cpu_ns
            if tb is not None:
                self._trace(b)
        router.publish()

    def _trace(self, b: Batch) -> None:
        tb, routed = b.trace, b.routed
        tb.mark("route")
        tb.calls = [(v, [b.route[k] for k in idx], s, e, ok) for v, idx, s, e, ok in self.router.calls]
        for k, i in enumerate(b.route):
            if i not in tb.sampled:
                continue
            served = routed.served_by[k]
            tb.set(i, **{"tritonguard.served_by": served,
                         "tritonguard.target_version": served.rpartition(":")[2] if ":" in served else served})
            err = routed.errors[k]
            if err is not None:
                tb.errors[i] = (err.code, str(err))


"""The cost meter (tritonguard.observe.cost) on the real Router's target calls, and the rollout's cost gate
(exporter.rollout.gates.engine) on counter readings parsed from Prometheus text."""

from __future__ import annotations

import math
import threading
import time

import pytest
from typer.testing import CliRunner

from exporter.cli.app import app
from exporter.rollout.gates.config import GateConfig, parse_increase
from exporter.rollout.gates.evaluate import evaluate
from exporter.rollout.gates.readings import GuardReadings, parse
from exporter.rollout.gates.verdict import FAIL, INCONCLUSIVE, PASS, SKIPPED
from tests.unit.guard.routing.test_router import W1, Linear, Metrics, make, rows
from tritonguard.core.errors import ConfigError
from tritonguard.guard.config import GuardConfig
from tritonguard.guard.routing.router import Routed
from tritonguard.guard.services import MAX_TENANT_LABELS, OTHER_TENANTS, PrivacyBatch
from tritonguard.observe.cost import CACHE, CostConfig, CostMeter, target_resource


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "repo" / "t").mkdir(parents=True)
    return tmp_path / "repo"


class Clock:
    """A CPU clock (ns) and a wall clock (s) the test moves by hand."""

    def __init__(self):
        self.cpu_ns, self.now = 0, 100.0

    def cpu(self) -> int:
        return self.cpu_ns

    def wall(self) -> float:
        return self.now


def meter(config: CostConfig | None = None, **kw) -> tuple[CostMeter, Metrics, Clock]:
    clock, metrics = Clock(), Metrics()
    m = CostMeter(config or CostConfig(), metrics=metrics, cpu_clock=clock.cpu, clock=clock.wall, **kw)
    return m, metrics, clock


def totals(metrics: Metrics, family: str) -> dict[tuple, float]:
    """``{(target_version, tenant[, part]): value}`` of one family."""
    out = {}
    for (fam, *labels), value in metrics.counts.items():
        if fam == family:
            d = dict(labels)
            out[(d["target_version"], d["tenant"], *([d["part"]] if "part" in d else []))] = value
    return out


def test_each_answered_request_pays_its_rows_of_the_calls_and_of_the_guard():
    m, metrics, clock = meter(inprocess=True)
    batch = PrivacyBatch(tenants=["a", "b", "a"], route=[0, 1, 2], sizes=[1, 3, 1])
    routed = Routed({}, ["t:1", "t:2", "t:1"], [None, None, None])
    clock.cpu_ns = 10_000_000  # 10 ms of the serving thread, 6 ms of it in the in-process calls
    m.record(batch, routed, [(1, [0, 2], 0, 2_000_000, True), (2, [1], 2_000_000, 6_000_000, True)])
    secs = totals(metrics, "compute_seconds")
    assert secs[("1", "a", "target")] == pytest.approx(0.002)
    assert secs[("2", "b", "target")] == pytest.approx(0.004)
    # the guard's 4 ms split by rows: 1 + 1 of 5 to v1's requests, 3 of 5 to v2's
    assert secs[("1", "a", "guard")] == pytest.approx(0.0016)
    assert secs[("2", "b", "guard")] == pytest.approx(0.0024)
    assert totals(metrics, "cost_requests") == {("1", "a"): 2, ("2", "b"): 1}
    core_s = 0.05 / 3600
    cost = totals(metrics, "cost")
    assert cost[("1", "a", "target")] == pytest.approx(0.002 * core_s)
    assert cost[("1", "a", "guard")] == pytest.approx(0.0016 * core_s)
    cost = {(v, t): cost[(v, t, "guard")] + cost[(v, t, "target")] for v, t, _ in cost}
    # the gauge (set by the publisher): cost of 1000 requests like these
    m.publish(clock.now)
    assert metrics.gauges[("cost_per_1k", ("target_version", "1"), ("tenant", "a"))] == \
        pytest.approx(1000 * cost[("1", "a")] / 2)


def test_a_bls_guard_keeps_its_cpu_and_a_gpu_target_is_priced_per_gpu_hour():
    cfg = CostConfig(cpu_core_hour=0.036, gpu_hour=3.6)
    m, metrics, clock = meter(cfg, resource="gpu")
    batch = PrivacyBatch(tenants=["a"], route=[0], sizes=[2])
    clock.cpu_ns = 1_000_000  # over BLS the serving thread waits: its CPU clock is the guard's alone
    m.record(batch, Routed({}, ["t:1"], [None]), [(1, [0], 0, 5_000_000, True)])
    secs = totals(metrics, "compute_seconds")
    assert secs[("1", "a", "guard")] == pytest.approx(0.001) and secs[("1", "a", "target")] == pytest.approx(0.005)
    cost = totals(metrics, "cost")
    assert cost[("1", "a", "guard")] == pytest.approx(0.001 * 0.036 / 3600)
    assert cost[("1", "a", "target")] == pytest.approx(0.005 * 3.6 / 3600)


def test_cache_hits_pay_guard_time_only_and_idle_batches_hand_theirs_on():
    m, metrics, clock = meter()
    stale = [(1, [0], 0, 9_000_000, True)]  # Router.calls of an earlier batch
    hits = PrivacyBatch(tenants=["a", "a"], route=[], sizes=[], hit_sizes={0: 1, 1: 3})
    clock.cpu_ns = 4_000_000
    m.record(hits, None, stale)  # nothing routed: the stale calls must not count
    secs = totals(metrics, "compute_seconds")
    assert secs == {(CACHE, "a", "guard"): pytest.approx(0.004)}
    assert totals(metrics, "cost_requests") == {(CACHE, "a"): 2}
    # a batch whose requests all failed answers nothing: its 3 ms go to the next answered batch
    failed = PrivacyBatch(tenants=["a"], route=[0], sizes=[1])
    clock.cpu_ns = 7_000_000
    m.record(failed, Routed({}, [""], [RuntimeError("x")]), [(2, [0], 0, 1_000_000, False)])
    assert totals(metrics, "compute_seconds")[("2", "a", "target")] == pytest.approx(0.001)  # v2 pays its call
    ok = PrivacyBatch(tenants=["a"], route=[0], sizes=[1])
    clock.cpu_ns = 8_000_000
    m.record(ok, Routed({}, ["t:1"], [None]), [(1, [0], 0, 0, True)])
    assert totals(metrics, "compute_seconds")[("1", "a", "guard")] == pytest.approx(0.004)


def test_the_gauge_is_a_decaying_average_of_what_was_charged_between_updates():
    m, metrics, clock = meter(CostConfig(window_s=60))
    key = ("cost_per_1k", ("target_version", "1"), ("tenant", "a"))

    def batch(cpu_ms: int) -> None:
        clock.cpu_ns += cpu_ms * 1_000_000
        m.record(PrivacyBatch(tenants=["a"], route=[0], sizes=[1]), Routed({}, ["t:1"], [None]), [])

    core_ms = 0.05 / 3600 / 1000
    batch(2)
    assert key not in metrics.gauges  # the serving path never sets it
    m.publish(clock.now)
    assert metrics.gauges[key] == pytest.approx(1000 * 2 * core_ms)
    batch(10)
    batch(10)
    clock.now += 30
    m.publish(clock.now)
    decay = math.exp(-30 / 60)
    assert metrics.gauges[key] == pytest.approx(1000 * (2 * decay + 20) / (1 * decay + 2) * core_ms)
    metrics.gauges.clear()
    clock.now += 30
    m.publish(clock.now)  # nothing charged since: the gauge keeps its value (not set again)
    assert key not in metrics.gauges


def test_load_work_is_charged_to_no_tenant_so_the_first_request_costs_what_a_later_one_does():
    """Issue 45: the guard makes its meter, then loads its engines and runs the start-up goldens
    on the serving thread; the first request paid all of it (3.57 s of guard time for two
    requests to a fresh text guard). ``loaded()`` at the end of the load starts the charging."""
    m, metrics, clock = meter(inprocess=True)
    clock.cpu_ns += 3_570_000_000  # engine loads and goldens, after the meter was made
    # a batch that answered nothing (its time would be carried to the next answered one)
    m.record(PrivacyBatch(tenants=["a"], route=[0], sizes=[1]), Routed({}, [""], [RuntimeError("x")]), [])
    clock.cpu_ns += 120_000_000  # more load work after it
    assert m.loaded() == pytest.approx(0.12)  # what the serving thread did since its last batch
    charged = []
    for _ in range(3):
        before = totals(metrics, "compute_seconds").get(("1", "default", "guard"), 0.0)
        clock.cpu_ns += 2_000_000  # each request: 2 ms of the guard, 1 ms of it in the target call
        m.record(PrivacyBatch(tenants=["default"], route=[0], sizes=[1]), Routed({}, ["t:1"], [None]),
                 [(1, [0], 0, 1_000_000, True)])
        charged.append(totals(metrics, "compute_seconds")[("1", "default", "guard")] - before)
    assert charged == pytest.approx([0.001, 0.001, 0.001])
    fresh, _, clock = meter()
    clock.cpu_ns += 2_500_000_000
    assert fresh.loaded() == pytest.approx(2.5)  # returned for the guard's log line


def test_a_golden_check_in_the_first_batch_is_charged_to_no_tenant(repo):
    """Issue 45 item 2: a BLS guard checks its primary's goldens in its first batch, on the serving
    thread (no BLS call in ``initialize()``), and that batch's request paid for them. The real
    Router and goldens checker, wired as the guard wires them; each target call takes 5 ms of the
    serving thread's (hand-moved) CPU clock, as a BLS call's marshalling does."""
    m, metrics, clock = meter()  # a BLS guard: target calls are not on the serving thread's clock

    class Cpu(Linear):
        def infer(self, inputs):
            clock.cpu_ns += 5_000_000
            return super().infer(inputs)

    target = Cpu(W1)
    router, _ = make(repo, {1: target}, goldens=rows(8))
    router.goldens.uncharged = m.uncharged  # as GuardModel.initialize does
    m.loaded()
    charged = []
    for seed in range(3):
        before = totals(metrics, "compute_seconds").get(("1", "a", "guard"), 0.0)
        calls = len(target.calls)
        routed = router.infer({"X": rows(2, seed)}, [1, 1])
        m.record(PrivacyBatch(tenants=["a", "a"], route=[0, 1], sizes=[1, 1]), routed, router.calls)
        charged.append((totals(metrics, "compute_seconds")[("1", "a", "guard")] - before, len(target.calls) - calls))
    router.close()
    assert charged[0][1] > 1 and charged[1][1] == 1  # the goldens ran in the first batch, on this thread
    assert [c for c, _ in charged] == pytest.approx([0.005] * 3)  # and that batch paid only its own call
    # a thread that is not metered (the reconciler's) runs its checks as before
    done = []
    t = threading.Thread(target=lambda: done.append(m.uncharged(lambda: "PASS")))
    t.start()
    t.join()
    assert done == ["PASS"] and threading.get_ident() in m._cpu_last and t.ident not in m._cpu_last


def test_the_publisher_thread_sets_the_gauge(monkeypatch):
    monkeypatch.setattr(CostMeter, "PUBLISH_S", 0.05)
    metrics = Metrics()
    m = CostMeter(CostConfig(), metrics=metrics, publisher=True)
    try:
        m.record(PrivacyBatch(tenants=["a"], route=[0], sizes=[1]), Routed({}, ["t:1"], [None]),
                 [(1, [0], 0, 1_000_000, True)])
        deadline = time.monotonic() + 5
        while not metrics.gauges and time.monotonic() < deadline:
            time.sleep(0.01)
        assert metrics.gauges[("cost_per_1k", ("target_version", "1"), ("tenant", "a"))] > 0
    finally:
        m.close()


def test_unpriced_exports_seconds_only_and_a_meter_error_never_reaches_serving():
    m, metrics, clock = meter(CostConfig(cpu_core_hour=0, gpu_hour=0))
    clock.cpu_ns = 1_000_000
    m.record(PrivacyBatch(tenants=["a"], route=[0], sizes=[1]), Routed({}, ["t:1"], [None]), [])
    m.publish(clock.now)
    assert totals(metrics, "compute_seconds") and not totals(metrics, "cost") and not metrics.gauges
    m.record(object(), None, [])  # not a batch at all: logged once, nothing raised
    off, metrics, _ = meter(CostConfig(enabled=False))
    off.record(PrivacyBatch(tenants=["a"], route=[0], sizes=[1]), Routed({}, ["t:1"], [None]), [])
    assert metrics.counts == {}


def test_tenant_labels_go_through_the_cardinality_guard():
    from tritonguard.privacy.tenancy.labels import TenantLabels

    m, metrics, clock = meter(label=TenantLabels())  # the guard's own labels (one per process)
    n = MAX_TENANT_LABELS + 5
    clock.cpu_ns = 1_000_000
    m.record(PrivacyBatch(tenants=[f"t{i}" for i in range(n)], route=list(range(n)), sizes=[1] * n),
             Routed({}, ["t:1"] * n, [None] * n), [])
    tenants = {t for _, t in totals(metrics, "cost_requests")}
    assert len(tenants) == MAX_TENANT_LABELS + 1 and OTHER_TENANTS in tenants
    assert totals(metrics, "cost_requests")[("1", OTHER_TENANTS)] == 5


class Slow(Linear):
    """The real classifier, ``per_row_s`` seconds slower a row."""

    def __init__(self, w, per_row_s: float, **kw):
        super().__init__(w, **kw)
        self.per_row_s = per_row_s

    def infer(self, inputs):
        time.sleep(self.per_row_s * len(inputs["X"]))
        return super().infer(inputs)


def test_the_real_router_records_its_calls_and_a_slower_version_pays_for_them(repo):
    router, _ = make(repo, {1: Slow(W1, 0.001), 2: Slow(W1, 0.003)}, candidate=2, share=0.5)
    m, metrics, _clock = meter()
    n = 0
    for seed in range(20):
        sizes = [1, 2, 1, 3, 1]
        batch = PrivacyBatch(tenants=["a"] * len(sizes), route=list(range(len(sizes))), sizes=sizes)
        routed = router.infer({"X": rows(sum(sizes), seed)}, sizes)
        assert all(e is None for e in routed.errors)
        assert sorted(i for _, idx, *_ in router.calls for i in idx) == list(range(len(sizes)))
        m.record(batch, routed, router.calls)
        n += len(sizes)
    router.close()
    secs = totals(metrics, "compute_seconds")
    reqs = totals(metrics, "cost_requests")
    assert reqs[("1", "a")] + reqs[("2", "a")] == n
    # v2 sleeps 3x as long a row: its target seconds per request are about 3x v1's
    ratio = (secs[("2", "a", "target")] / reqs[("2", "a")]) / (secs[("1", "a", "target")] / reqs[("1", "a")])
    assert 2.0 < ratio < 4.0, ratio


def _burn(cpu_s: float) -> None:
    """Spend ``cpu_s`` of this thread's CPU time (the guard's own work between target calls)."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_an_inprocess_guard_is_charged_its_cpu_even_when_the_target_call_waited(repo):
    """The guard's time is the serving thread's CPU less its CPU inside the in-process target
    calls. It was the CPU less the calls' wall time: a call that waited (for a core under load,
    here a sleep) erased the guard's own CPU, and in-process guards read 0 ms a request under load
    (issue 45 item 2, a helper's finding, 2026-11-28). With the calls' wall time it reads 0 here."""
    router, _ = make(repo, {1: Slow(W1, 0.05)})  # each call waits 50 ms a row, using no CPU
    m = CostMeter(CostConfig(), metrics=(metrics := Metrics()), inprocess=True)  # the real thread clock
    m.loaded()
    for seed in range(5):
        _burn(0.02)  # 20 ms of guard work a batch, against a 50 ms call
        routed = router.infer({"X": rows(1, seed)}, [1])
        m.record(PrivacyBatch(tenants=["a"], route=[0], sizes=[1]), routed, router.calls,
                 calls_cpu_ns=router.calls_cpu_ns)
    router.close()
    secs = totals(metrics, "compute_seconds")
    assert secs[("1", "a", "target")] >= 5 * 0.05  # the calls' wall time, as before
    # the 5 x 20 ms burnt, plus the router's own work (well under 20 ms a batch)
    assert 0.1 <= secs[("1", "a", "guard")] < 0.2, secs


def test_a_version_whose_fused_call_failed_pays_for_the_failed_call(repo):
    router, _ = make(repo, {1: Linear(W1), 2: Linear(W1, max_rows=2)}, candidate=2, share=1.0)
    m, metrics, _clock = meter()
    sizes = [1, 1, 1, 1]
    routed = router.infer({"X": rows(4)}, sizes)
    assert set(routed.served_by) == {"t:2"}  # answered one by one after the fused call failed
    assert [ok for v, _, _, _, ok in router.calls] == [False, True, True, True, True]
    m.record(PrivacyBatch(tenants=["a"] * 4, route=[0, 1, 2, 3], sizes=sizes), routed, router.calls)
    want = sum(e - s for _, _, s, e, _ in router.calls) / 1e9
    assert totals(metrics, "compute_seconds")[("2", "a", "target")] == pytest.approx(want)
    router.close()


def test_config_section_and_resource():
    cfg = GuardConfig.from_parameters({"target": "t", "cost.cpu_core_hour": "0.1", "cost.target_cores": "2"}, "g")
    assert cfg.cost.cpu_core_hour == 0.1 and cfg.cost.target_cores == 2 and cfg.cost.gpu_hour == 2.5
    with pytest.raises(ConfigError, match="cost.cpu_core_hour"):
        GuardConfig.from_parameters({"target": "t", "cost.cpu_core_hour": "-1"}, "g")
    with pytest.raises(ConfigError, match="cost.cores"):
        GuardConfig.from_parameters({"target": "t", "cost.cores": "2"}, "g")
    runtime = {"backend": "runtime", "parameters": {"intra_op_threads": {"string_value": "2"}}}
    assert target_resource("bls", runtime, {}) == ("cpu", 2.0)
    assert target_resource("bls", {"backend": "python", "instance_group": [{"kind": "KIND_GPU"}]}, {}) == ("gpu", 1.0)
    assert target_resource("inprocess", runtime, {"runtime.intra_op_threads": "3"}) == ("cpu", 3.0)
    assert target_resource("inprocess", runtime, {"runtime.providers": "CUDAExecutionProvider"}) == ("gpu", 1.0)
    assert target_resource("bls", None, {}) == ("cpu", 1.0)
    # cost.target_cores, when set, wins over what the configs say
    assert CostMeter(CostConfig(target_cores=4), metrics=Metrics(), cores=2).cores == 4


# -- the gate ----------------------------------------------------------------------------------
def exposition(cost: dict[int, dict[str, float]], compute: dict[int, dict[str, float]], charged: dict[int, float],
               tenant: str = "default") -> str:
    """Prometheus text as a guard's metrics port shows the cost families (one replica); ``cost``
    and ``compute``: version -> part (guard, target) -> value."""
    lines = ["# HELP tritonguard_cost_total x", "# TYPE tritonguard_cost_total counter"]
    for family, sums in (("tritonguard_cost_total", cost), ("tritonguard_compute_seconds_total", compute)):
        for v, parts in sums.items():
            for part, x in parts.items():
                lines.append(f'{family}{{model="m",version="1",target_version="{v}",tenant="{tenant}",'
                             f'part="{part}"}} {x!r}')
    for v, x in charged.items():
        lines.append(f'tritonguard_cost_requests_total{{model="m",version="1",target_version="{v}",tenant="{tenant}"}} {x!r}')
    lines.append('tritonguard_cost_requests_total{model="m",version="1",target_version="cache",tenant="default"} 99')
    lines.append('tritonguard_breaker_state{model="m",version="1",target_version="2"} 0')
    return "\n".join(lines) + "\n"


def readings(text: str) -> GuardReadings:
    return GuardReadings.from_scrapes([parse(text)], "m", 1, 2)


def cost_gate(before: GuardReadings, after: GuardReadings, share: float | None = 0.5, **cfg):
    report = evaluate(before, after, GateConfig(max_cost_increase=0.10, min_requests=200, latency=False,
                                                min_agreement=None, **cfg), share=share)
    return next(g for g in report.gates if g.name == "cost"), report


def gt(guard: float, target: float) -> dict[str, float]:
    return {"guard": guard, "target": target}


def test_the_gate_reads_the_window_of_the_counters():
    before = readings(exposition({1: gt(1.0, 1.0), 2: gt(1.0, 1.0)}, {1: gt(5, 5), 2: gt(5, 5)}, {1: 1000, 2: 1000}))
    # 300 requests each: guard 100e-6 a side, the candidate's calls 2x the primary's
    after = readings(exposition({1: gt(1 + 100e-6, 1 + 100e-6), 2: gt(1 + 100e-6, 1 + 200e-6)},
                                {1: gt(6, 6), 2: gt(6, 7)}, {1: 1300, 2: 1300}))
    assert after.charged == {1: 1300, 2: 1300}  # not the cache's 99
    assert after.cost[2] == {"guard": pytest.approx(1.0001), "target": pytest.approx(1.0002)}
    gate, report = cost_gate(before, after)
    assert gate.verdict == FAIL and report.verdict == FAIL
    assert gate.figures["ratio"] == pytest.approx(1.5)
    assert "+50% > limit +10%" in gate.reason
    assert "0.001 vs 0.000667 per 1k requests, of which guard 0.000333" in gate.reason
    # the guard part is pooled: a batch mix that charged the candidate's requests more guard time
    # (canary copies) does not count against it; its own calls at the primary's cost: PASS
    skewed = readings(exposition({1: gt(1 + 80e-6, 1 + 100e-6), 2: gt(1 + 120e-6, 1 + 104e-6)},
                                 {1: gt(6, 6), 2: gt(6, 6)}, {1: 1300, 2: 1300}))
    gate, _ = cost_gate(before, skewed)
    assert gate.verdict == PASS and gate.figures["ratio"] == pytest.approx(1.02)
    # round trip through the stored progress record (a resumed rollout re-reads its baseline)
    assert GuardReadings.from_dict(after.to_dict()) == after
    old = after.to_dict()
    for key in ("cost", "compute", "charged"):
        old.pop(key)
    assert GuardReadings.from_dict(old).charged == {}  # a baseline stored before the gate existed


def test_the_gate_holds_skips_and_falls_back_to_seconds():
    zero = readings(exposition({}, {}, {}))
    few = readings(exposition({1: gt(1e-6, 1e-6), 2: gt(1e-6, 1e-6)}, {1: gt(1, 1), 2: gt(1, 1)}, {1: 500, 2: 150}))
    gate, report = cost_gate(zero, few)
    assert gate.verdict == INCONCLUSIVE and "150 candidate / 500 primary" in gate.reason
    none = readings(exposition({}, {}, {}))
    assert "cost.enabled" in cost_gate(zero, none)[0].reason
    many = readings(exposition({1: gt(1e-4, 1e-4), 2: gt(1e-4, 3e-4)}, {1: gt(1, 1), 2: gt(1, 3)}, {1: 500, 2: 500}))
    assert cost_gate(zero, many)[0].verdict == FAIL
    assert cost_gate(zero, many, share=0.25)[0].verdict == SKIPPED
    assert cost_gate(zero, many, share=1.0)[0].verdict == SKIPPED
    assert cost_gate(zero, many, share=0.25)[1].verdict != FAIL
    unpriced = readings(exposition({}, {1: gt(1.0, 1.0), 2: gt(1.0, 1.1)}, {1: 500, 2: 500}))
    gate, _ = cost_gate(zero, unpriced)
    assert gate.verdict == PASS and gate.figures["basis"] == "compute seconds"
    assert gate.figures["ratio"] == pytest.approx(2.1 / 2.0)
    # no flag, no gate
    report = evaluate(zero, many, GateConfig(latency=False, min_agreement=None), share=0.5)
    assert "cost" not in {g.name for g in report.gates}
    # a counter that went backwards (a guard restarted) re-baselines, as for the other gates
    restarted = readings(exposition({1: gt(1e-6, 1e-6), 2: gt(1e-6, 1e-6)}, {1: gt(0.1, 0.1), 2: gt(0.1, 0.1)},
                                    {1: 5, 2: 5}))
    assert evaluate(many, restarted, GateConfig(max_cost_increase=0.1), share=0.5).reset


@pytest.mark.parametrize(("text", "value"), [("10%", 0.10), ("0.1", 0.1), (" 25 % ", 0.25), ("0", 0.0)])
def test_parse_increase(text, value):
    assert parse_increase(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["-5%", "-0.1", "ten", "", "%", "nan", "inf"])
def test_bad_increase_is_refused(text):
    with pytest.raises(ValueError, match="--max-cost-increase"):
        parse_increase(text)
    with pytest.raises(ValueError, match="max_cost_increase"):
        GateConfig(max_cost_increase=-0.1)


def test_promote_refuses_a_bad_flag_with_exit_2(tmp_path):
    res = CliRunner().invoke(app, ["promote", "m", "--version", "2", "--repository", str(tmp_path),
                                   "--server", "127.0.0.1:1", "--max-cost-increase", "-10%"])
    assert res.exit_code == 2, res.output
    assert "--max-cost-increase must be >= 0" in res.output

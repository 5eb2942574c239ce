"""The board through which a Ray Serve application's replicas share their counts
(:mod:`tritonguard.hosts.replica_metrics`): the sums a metrics route answers, a gone replica, a
real Redis board and an unreachable one. The route over a live two-replica application is in
tests/functional/test_ray_serve.py."""

from __future__ import annotations

from tritonguard.ops.server import free_port


def test_a_gone_replica_keeps_its_counts_and_drops_its_gauges():
    """A replica that stopped publishing: its counters stay in the sum (promote must not read a
    reset), its gauges leave once it is not fresh; gauges combine by max (an open breaker shows)."""
    from tritonguard.hosts.replica_metrics import combine  # noqa: PLC0415

    def snap(replica: str, t: float, served: float, breaker: float) -> dict:
        return {"t": t, "replica": replica, "families": [
            ["tritonguard_served", "counter", "", [["tritonguard_served_total", {"model": "m"}, served]]],
            ["tritonguard_breaker_state", "gauge", "", [["tritonguard_breaker_state", {"model": "m"}, breaker]]]]}

    def values(metrics_: list) -> dict[str, float]:
        return {s.name: s.value for m in metrics_ for s in m.samples}

    live = [snap("a", 100.0, 5, 0.0), snap("b", 100.0, 7, 2.0)]
    assert values(combine(live, 101.0)) == {"tritonguard_served_total": 12, "tritonguard_breaker_state": 2.0}
    gone = [snap("a", 160.0, 9, 0.0), snap("b", 100.0, 7, 2.0)]  # b stopped at t=100
    assert values(combine(gone, 161.0)) == {"tritonguard_served_total": 16, "tritonguard_breaker_state": 0.0}


def test_replicas_share_their_counts_through_redis_and_a_dead_store_answers_their_own(redis_server):
    """Two replicas' registries on a real Redis board: each one's page is the sum; with the store
    unreachable, a replica's page is its own counts, and the failure is counted."""
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from tritonguard.hosts.common import MODEL_FAMILIES, HostMetrics  # noqa: PLC0415
    from tritonguard.hosts.replica_metrics import ReplicaMetrics, open_board  # noqa: PLC0415

    def replica(rid: str, url: str, served: int) -> tuple[ReplicaMetrics, HostMetrics]:
        m = HostMetrics("m", CollectorRegistry(), MODEL_FAMILIES)
        m.inc("served", served, served_by="m_raw:1")
        return ReplicaMetrics(m.registry, open_board("m", "app", ".", url), rid,
                              on_error=lambda: m.inc("state_errors")), m

    a, _ = replica("a", redis_server.url, 3)
    b, _ = replica("b", redis_server.url, 4)
    assert a.publish() and b.publish()
    line = 'tritonguard_served_total{model="m",served_by="m_raw:1"}'
    assert f"{line} 7.0" in a.page().decode() and f"{line} 7.0" in b.page().decode()
    dead, m = replica("c", f"redis://127.0.0.1:{free_port()}/0", 5)
    page = dead.page().decode()
    assert f"{line} 5.0" in page and 'tritonguard_state_errors_total{model="m"} 1.0' in page

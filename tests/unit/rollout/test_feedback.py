"""tritonguard.rollout.feedback and its stage: what each version answered, kept for late labels (files
and a real redis-server), joined to a label file, and tallied for the rollout's labels gate;
labels sent with a request are scored against the version that really answered (a cache hit:
the cached answer's version, a fallback: the version down the chain)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from tests.unit.guard.routing.test_router import Metrics
from tritonguard.core.errors import TargetError
from tritonguard.guard.pipeline import Batch
from tritonguard.guard.routing.router import Routed
from tritonguard.guard.stages.feedback import FeedbackStage
from tritonguard.rollout.feedback import (
    CACHE,
    FALLBACK,
    LABEL,
    MODEL,
    PRED,
    FeedbackConfig,
    FeedbackRecorder,
    FileFeedbackLog,
    Label,
    Prediction,
    RedisFeedbackLog,
    join,
    parse_label,
    tally,
)


class Req:
    def __init__(self, rid: str):
        self.rid = rid

    def request_id(self) -> str:
        return self.rid


class MemoryLog:
    def __init__(self):
        self.records = {PRED: [], LABEL: []}

    def write(self, kind, writer, seq, records):
        self.records[kind].extend(records)

    def read(self, kind):
        return list(self.records[kind])


def probs(*classes: int) -> np.ndarray:
    out = np.full((len(classes), 4), 0.1, np.float32)
    out[np.arange(len(classes)), classes] = 0.7
    return out


def batch() -> Batch:
    """Four requests: 0 routed to v2 (id a, label 1 right), 1 a cache hit of v1 (id b), 2 a
    fallback to v1 (id c, label 0 wrong), 3 refused (id d), 4 routed, no id and no label."""
    b = Batch(requests=[Req("a"), Req("b"), Req("c"), Req("d"), Req("")],
              params=[{"label": "1"}, {}, {"label": 0, "slice": "night"}, {}, {}],
              responses=[None] * 5, tenants=["acme", "acme", "globex", "acme", "acme"])
    b.errors[3] = TargetError("quota", "UNAVAILABLE")
    b.hits[1] = {"P": probs(3)}
    b.cache_label = "cache:t_raw:1"
    b.route, b.sizes = [0, 2, 4], [1, 1, 1]
    b.routed = Routed({"P": probs(1, 2, 0)}, ["t_raw:2", "t_raw:1", "t_raw:1"], [None, None, None],
                      fallbacks=frozenset({1}))
    return b


def test_the_stage_keeps_answers_with_ids_and_scores_request_labels_on_who_answered():
    log, metrics = MemoryLog(), Metrics()
    rec = FeedbackRecorder(log, FeedbackConfig(), writer_id="w")
    FeedbackStage(rec, metrics, output="P", classifier=True).run(batch())
    rec.flush()
    preds = {p.request_id: p for p in log.read(PRED)}
    assert set(preds) == {"a", "b", "c"}  # refused and id-less requests are not kept
    assert (preds["a"].version, preds["a"].source, preds["a"].answer) == (2, MODEL, (1,))
    assert (preds["b"].version, preds["b"].source, preds["b"].answer) == (1, CACHE, (3,))
    assert (preds["c"].version, preds["c"].source, preds["c"].tenant) == (1, FALLBACK, "globex")
    labels = {lab.request_id: lab for lab in log.read(LABEL)}
    assert labels["a"].truth == (1,) and labels["a"].predicted == (1,) and labels["a"].origin == "request"
    assert labels["c"].slice == "night" and labels["c"].version == 1 and labels["c"].predicted == (2,)
    assert metrics.total("labeled", target_version="2", correct="true") == 1
    assert metrics.total("labeled", target_version="1", correct="false") == 1


def test_a_batch_without_ids_or_labels_costs_nothing_and_the_stage_never_raises():
    log = MemoryLog()
    rec = FeedbackRecorder(log, FeedbackConfig(), writer_id="w")
    b = batch()
    b.requests = [Req("")] * 5
    b.params = [{}] * 5
    FeedbackStage(rec, Metrics(), output="P", classifier=True).run(b)
    rec.flush()
    assert log.read(PRED) == [] and log.read(LABEL) == []


def test_other_tasks_keep_a_digest_not_the_output():
    log = MemoryLog()
    rec = FeedbackRecorder(log, FeedbackConfig(), writer_id="w")
    FeedbackStage(rec, Metrics(), output="P", classifier=False).run(batch())
    rec.flush()
    answers = [p.answer for p in log.read(PRED)]
    assert answers and all(isinstance(a, bytes) and len(a) == 16 for a in answers)
    assert log.read(LABEL) == []  # a class label cannot judge an embedding


def test_join_is_tenant_scoped_idempotent_and_counts_what_it_skips(tmp_path):
    log = FileFeedbackLog(tmp_path / "fb")
    t = time.time()
    log.write(PRED, "w1", 1, [Prediction("acme", "r1", t, 2, MODEL, (3,)), Prediction("acme", "r2", t, 1, CACHE, (4,)),
                              Prediction("globex", "r3", t, 2, FALLBACK, (1, 2))])
    rows = [{"request_id": "r1", "label": "3"}, {"request_id": "r2", "label": 5, "slice": "mobile"},
            {"request_id": "r3", "label": "1,2", "tenant": "globex"},
            {"request_id": "r3", "label": "1"},  # tenant acme (the default): not acme's request
            {"request_id": "nope", "label": 1}, {"request_id": "r1", "label": "3"}]
    res = join(log, rows, tenant="acme")
    assert len(res.joined) == 3 and res.unknown == 2 and res.duplicate == 1, res
    assert res.by_version == {2: (3, 3), 1: (0, 1)}
    # no tenant anywhere: the one tenant that used the id; an id two tenants used is not guessed
    log.write(PRED, "w1", 3, [Prediction("acme", "r9", t, 1, MODEL, (0,)), Prediction("globex", "r9", t, 1, MODEL, (0,)),
                              Prediction("globex", "r8", t, 1, MODEL, (0,))])
    free = join(log, [{"request_id": "r9", "label": 0}, {"request_id": "r8", "label": 0}])
    assert free.ambiguous == 1 and [lab.tenant for lab in free.joined] == ["globex"]
    again = join(log, rows[:1], tenant="acme")
    assert again.duplicate == 1 and not again.joined
    log.write(PRED, "w1", 2, [Prediction("acme", "r4", t, 2, MODEL, (1, 2))])
    mism = join(log, [{"request_id": "r4", "label": "1"}], tenant="acme")  # one label, two rows
    assert mism.mismatched == 1 and not mism.joined
    got = tally(log.read(LABEL), [1, 2], since=t - 1)
    assert got.right == {2: 3, 1: 1} and got.total == {2: 3, 1: 2}
    assert got.by_slice[1] == {"mobile": [0, 1]} and got.by_class[2] == {"3": [1, 1], "1": [1, 1], "2": [1, 1]}
    assert tally(log.read(LABEL), [1, 2], since=t + 1).total == {}  # answered before the rollout


def test_a_request_label_and_the_same_label_fed_later_count_once():
    t = time.time()
    labs = [Label("", "r1", t, 2, MODEL, (1,), (1,), "", "request"), Label("", "r1", t, 2, MODEL, (1,), (1,), "", "feedback"),
            Label("", "", t, 2, MODEL, (0,), (1,), "", "request"), Label("", "", t, 2, MODEL, (0,), (1,), "", "request")]
    got = tally(labs, [2])
    assert got.total == {2: 3} and got.right == {2: 1}  # id-less request labels are all kept


def test_file_segments_expire_and_corrupt_ones_are_skipped(tmp_path):
    now = [1000.0]
    log = FileFeedbackLog(tmp_path, ttl_s=60, clock=lambda: now[0])
    log.write(PRED, "w", 1, [Prediction("", "r", 1.0, 1, MODEL, (0,))])
    (tmp_path / PRED / "w-bad.fb").write_bytes(b"TGFB\x00\x00\x00\x01garbage!")
    assert [p.request_id for p in log.read(PRED)] == ["r"] and log.corrupt == 1
    seg = next((tmp_path / PRED).glob("w-0*.fb"))
    os.utime(seg, (900.0, 900.0))  # older than the ttl
    assert log.read(PRED) == [] and not seg.exists()


def test_the_recorder_drops_rather_than_grow_or_wait():
    class Down:
        def write(self, *a):
            raise ConnectionError("store down")

    rec = FeedbackRecorder(Down(), FeedbackConfig(capacity=3), writer_id="w")
    rec.add(PRED, [Prediction("", str(i), 0.0, 1, MODEL, (0,)) for i in range(5)])
    assert rec.dropped == 2
    assert rec.flush() is False and rec.dropped == 5 and rec.flush_errors == 1
    assert rec.flush() is True  # nothing pending: nothing to fail


def test_redis_log_round_trip(redis_server):
    log = RedisFeedbackLog(redis_server.url, "digits", ttl_s=30)
    log.write(PRED, "h:1", 1, [Prediction("acme", "x", 5.0, 3, MODEL, (7,))])
    log.write(LABEL, "h:1", 2, [Label("acme", "x", 5.0, 3, MODEL, (7,), (7,), "s", "feedback")])
    assert [p.answer for p in log.read(PRED)] == [(7,)]
    assert [lab.slice for lab in log.read(LABEL)] == ["s"]
    assert log.client.ttl("tritonguard:feedback:digits:pred") > 0


def test_labels_parse_leniently():
    assert parse_label("3") == (3,) and parse_label("1, 2") == (1, 2) and parse_label(4) == (4,)
    assert parse_label([1, 2]) == (1, 2) and parse_label(2.0) == (2,)
    assert parse_label("cat") is None and parse_label(True) is None and parse_label(None) is None


def test_feedback_config_refuses_nonsense():
    with pytest.raises(ValueError, match="feedback.sample"):
        FeedbackConfig(sample=2)
    with pytest.raises(ValueError, match="feedback.capacity"):
        FeedbackConfig(capacity=0)

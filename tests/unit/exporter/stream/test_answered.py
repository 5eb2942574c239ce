"""exporter.stream.answered: the per-version record of answered offsets stays compact (ranges,
merged, a redo after a rebalance counted once), round-trips through its file into replay spans,
and replay specs are read strictly."""

from __future__ import annotations

import json

import pytest

from exporter.stream.answered import Answered, RecordError, read_specs


def test_offsets_are_kept_as_merged_ranges_per_version_and_partition():
    a = Answered()
    for off in (0, 1, 2, 5, 6, 9):
        a.add("m:2", ("in", 0), off)
    for off in (3, 4, 7, 8):
        a.add("m:1", ("in", 0), off)
    a.add("m:2", ("in", 1), 4)
    assert a.ranges["m:2"][("in", 0)] == [[0, 2], [5, 6], [9, 9]]
    assert a.ranges["m:1"][("in", 0)] == [[3, 4], [7, 8]]
    # a redo after a rebalance (offsets again, out of order): merged, counted once
    for off in (4, 3, 1, 7, 8, 3, 10, 2):
        a.add("m:2", ("in", 0), off)
    assert a.ranges["m:2"][("in", 0)] == [[0, 10]]
    assert a.counts["m:2"] == 11 + 1 and a.counts["m:1"] == 4  # 11 offsets of in[0], one of in[1]
    assert a.summary("m:1") == "4 events in 2 ranges: in[0] 3-4, in[0] 7-8"


def test_a_record_file_reads_back_as_replay_spans(tmp_path):
    a = Answered()
    for off in (3, 4, 5, 11):
        a.add("digits_raw:2", ("events", 1), off)
    a.add("digits_raw:1", ("events", 1), 6)
    path = tmp_path / "record.json"
    a.write(path, topic="events", model="digits", group="g")
    doc = json.loads(path.read_text())
    assert doc["events"] == {"digits_raw:1": 1, "digits_raw:2": 4} and doc["topic"] == "events"
    spans = read_specs([str(path), "events:0:7-9", "events:1:20"], "events")
    assert spans == {("events", 1): [(3, 5, "digits_raw:2"), (6, 6, "digits_raw:1"), (11, 11, "digits_raw:2"),
                                     (20, 20, "")],
                     ("events", 0): [(7, 9, "")]}


@pytest.mark.parametrize(("spec", "why"), [("events:x:1-2", "TOPIC:PARTITION:START-END"),
                                            ("events", "TOPIC:PARTITION:START-END"),
                                            ("events:0:5-2", "ends before it starts"),
                                            ("other:0:1-2", "not on the input topic")])
def test_a_bad_replay_spec_is_refused(spec, why):
    with pytest.raises(RecordError, match=why):
        read_specs([spec], "events")

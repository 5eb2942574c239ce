"""exporter.batch.job without a server: planning blocks, reading and encoding them, commits."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from exporter.batch import encode, scorer
from exporter.batch import job as b

IMAGE = b.InputSpec("IMAGE", "image", "FP32", (8, 8))
TEXT = b.InputSpec("TEXT", "text", "BYTES", (1,))


def _job(*specs: b.InputSpec, block_rows: int = 3, header: str = "") -> b.Job:
    return b.Job(model="m", inputs=specs, outputs=(b.OutputSpec("OUT", "FP32", (2,)),), servers=("127.0.0.1:1",), output="o", dead_letter="d",
                 batch_rows=4, block_rows=block_rows, csv_header=header)


def test_parquet_blocks_slice_row_groups_and_number_rows_across_files(tmp_path):
    for name, n in (("a.parquet", 7), ("b.parquet", 2)):
        pq.write_table(pa.table({"text": [f"{name}{i}" for i in range(n)]}), tmp_path / name, row_group_size=5)
    blocks = b.plan_blocks(b.input_files(tmp_path), 3)
    assert [(x.rows, x.first_row, x.source_row, x.row_group) for x in blocks] == [
        (3, 0, 0, 0), (2, 3, 3, 0), (2, 5, 5, 1), (2, 7, 0, 0)]
    job = _job(TEXT, block_rows=3)
    texts = [r for x in blocks for r in encode.read_block(x, job).tensors["TEXT"][:, 0]]
    assert texts == [f"{n}{i}" for n, k in (("a.parquet", 7), ("b.parquet", 2)) for i in range(k)]
    assert b.plan_blocks(b.input_files(tmp_path), 3) == blocks  # deterministic: what resuming relies on


def test_csv_blocks_end_outside_quotes(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text('text,other\n"two\nlines",1\nplain,2\n\n"a ""quoted"" one",3\nlast,4\n')
    blocks = b.plan_blocks([path], 2)
    assert [x.rows for x in blocks] == [2, 2]
    job = _job(TEXT, block_rows=2, header=b.csv_header(path))
    rows = [r for x in blocks for r in encode.read_block(x, job).tensors["TEXT"][:, 0]]
    assert rows == [b"two\nlines", b"plain", b'a "quoted" one', b"last"]


def test_jsonl_bad_records_get_reasons_the_rest_is_encoded(tmp_path):
    path = tmp_path / "t.jsonl"
    good = [0.0] * 64
    lines = [json.dumps({"image": good}).encode(), b'{"image": [1, 2]}', b"\xff\xfe not utf-8", b"[1]",
             b"{broken", json.dumps({"image": "x"}).encode(), json.dumps({"other": 1}).encode(),
             json.dumps({"image": [[1.0] * 8] * 8}).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    (block,) = b.plan_blocks([path], 100)
    enc = encode.read_block(block, _job(IMAGE, block_rows=100))
    assert enc.rows.tolist() == [0, 7] and enc.tensors["IMAGE"].shape == (2, 8, 8)
    assert {i: r for i, (r, _) in enc.bad.items()} == {1: "shape", 2: "utf8", 3: "json", 4: "json", 5: "type",
                                                       6: "missing"}
    assert "2 values, the model takes 8×8 = 64" in enc.bad[1][1]


def test_arrow_lists_nested_fixed_and_null(tmp_path):
    rows = [[1.0] * 64, None, [2.0] * 63, [math.nan] * 64]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": pa.array(rows, pa.list_(pa.float64()))}), path)
    (block,) = b.plan_blocks([path], 10)
    enc = encode.read_block(block, _job(IMAGE, block_rows=10))
    assert enc.rows.tolist() == [0, 3]  # NaN is the guard's to reject, with its own rule
    assert enc.tensors["IMAGE"].dtype == np.float32 and enc.tensors["IMAGE"][0, 7, 7] == 1.0
    assert {i: r for i, (r, _) in enc.bad.items()} == {1: "missing", 2: "shape"}
    nested = tmp_path / "nested.parquet"
    pq.write_table(pa.table({"image": [[[float(i)] * 8] * 8 for i in range(3)]}), nested)
    (block,) = b.plan_blocks([nested], 10)
    assert encode.read_block(block, _job(IMAGE, block_rows=10)).tensors["IMAGE"][:, 0, 0].tolist() == [0.0, 1.0, 2.0]


def test_wrong_column_type_is_a_clear_error(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": ["not numbers"]}), path)
    (block,) = b.plan_blocks([path], 10)
    with pytest.raises(b.BatchError, match="column 'image' .* cannot feed input 'IMAGE' .*list of numbers"):
        encode.read_block(block, _job(IMAGE, block_rows=10))


def test_columns_resolve_by_case_and_mapping_must_exist(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": [[0.0] * 64], "words": ["a"]}), path)
    spec = b.InputSpec("IMAGE", "IMAGE", "FP32", (8, 8))
    assert b.resolve_columns([path], (spec,), "", {})[0].column == "image"
    text = b.InputSpec("TEXT", "sentence", "BYTES", (1,))
    with pytest.raises(b.BatchError, match="no column 'sentence'.*--map TEXT=COLUMN"):
        b.resolve_columns([path], (text,), "", {"TEXT": "sentence"})
    with pytest.raises(b.BatchError, match="expected INPUT=COLUMN"):
        b.parse_mapping(["TEXT"])


def test_output_holding_another_job_is_refused_and_temporaries_cleared(tmp_path):
    out, dead = tmp_path / "out", tmp_path / "out" / b.DEAD_LETTER
    b.open_output(out, dead, {"rows": 10}, restart=False)
    (out / ".part-000001.parquet.1.2.tmp").write_bytes(b"half")
    (out / b.part_name(0)).write_bytes(b"x")
    b.open_output(out, dead, {"rows": 10}, restart=False)  # the same job: resumes, keeps part 0
    assert b.committed(out) == {0} and not list(out.glob(".*.tmp"))
    with pytest.raises(b.BatchError, match="holds another job \\(different rows\\)"):
        b.open_output(out, dead, {"rows": 11}, restart=False)
    b.open_output(out, dead, {"rows": 11}, restart=True)
    assert b.committed(out) == set()


def test_version_of_and_backoff():
    assert scorer.version_of("digits_raw:2") == 2 and scorer.version_of("cache:digits_raw:1") == 1
    assert scorer.version_of("default") is None
    assert scorer._backoff(0, "tenant 'a' is over its rate limit; retry after 960 ms") >= 0.96
    assert all(0 <= scorer._backoff(20, "") <= 5.0 for _ in range(100))
    assert scorer._Rejected("input 'IMAGE' violates finite: NaN").rule == "finite"


def test_rows_answered_are_reported_coalesced_and_flushed(monkeypatch):
    """The driver's progress gets every answered row, at most one report per ROWS_REPORT_S per
    worker, the rest on flush (end of a block)."""
    from exporter.batch import run

    clock = [100.0]
    monkeypatch.setattr(run.time, "monotonic", lambda: clock[0])
    reports: list[int] = []
    rows = run.RowsAnswered(reports.append)
    for _ in range(10):
        rows.add(64)  # within the first interval: held back
    assert reports == []
    clock[0] += run.ROWS_REPORT_S
    rows.add(64)
    assert reports == [704]
    rows.add(10)
    rows.flush()
    rows.flush()  # nothing left: no empty report
    assert reports == [704, 10] and sum(reports) == 11 * 64 + 10

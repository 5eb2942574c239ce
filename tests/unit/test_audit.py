import json
import threading
import time
from itertools import pairwise

import pytest

from tritonguard.audit import (
    GENESIS,
    AuditConfig,
    AuditLog,
    digest,
    record_hash,
    rotated_files,
    verify,
)
from tritonguard.config import from_params
from tritonguard.errors import ConfigError


def open_log(path, **params):
    cfg = from_params(AuditConfig, {"path": str(path), "flush_interval_ms": "5",
                                    **{k: str(v) for k, v in params.items()}}, section="audit")
    return AuditLog(cfg)


def write(path, n, **params):
    log = open_log(path, **params)
    for i in range(n):
        assert log.record("infer", tenant="t1", model="m", request=digest(f"req-{i}"), rows=i)
    log.close()
    return log


def lines(path):
    return path.read_text().splitlines()


def test_records_chain_and_verify(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = write(path, 10)
    assert log.written == 10 and log.dropped == 0
    recs = [json.loads(x) for x in lines(path)]
    assert [r["seq"] for r in recs] == list(range(10))
    assert recs[0]["prev"] == GENESIS
    assert all(b["prev"] == a["hash"] for a, b in pairwise(recs))
    assert all(r["hash"] == record_hash(r) for r in recs)
    assert {"ts", "type", "tenant", "model", "request", "rows"} <= recs[3].keys()
    assert verify(path) == verify(str(path))
    res = verify(path)
    assert res.ok and res.records == 10 and res.first_bad is None


@pytest.mark.parametrize("field,value", [("rows", 999), ("tenant", "t2"), ("ts", 0.0), ("prev", "f" * 64)])
def test_edited_record_is_named(tmp_path, field, value):
    path = tmp_path / "audit.jsonl"
    write(path, 10)
    text = lines(path)
    rec = json.loads(text[4])  # line 5
    rec[field] = value
    text[4] = json.dumps(rec)
    path.write_text("\n".join(text) + "\n")
    res = verify(path)
    assert not res.ok and res.first_bad == 4 and res.records == 10
    assert "audit.jsonl:5" in res.reason


def test_rehashed_edit_breaks_the_next_link(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 10)
    text = lines(path)
    rec = json.loads(text[4])
    rec["rows"] = 999
    rec["hash"] = record_hash(rec)
    text[4] = json.dumps(rec)
    path.write_text("\n".join(text) + "\n")
    res = verify(path)
    assert res.first_bad == 5 and "prev" in res.reason


def test_deleted_line_is_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 10)
    text = lines(path)
    del text[4]
    path.write_text("\n".join(text) + "\n")
    res = verify(path)
    assert not res.ok and res.first_bad == 4 and res.records == 9


def test_truncated_head_is_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 5)
    path.write_text("\n".join(lines(path)[1:]) + "\n")
    assert verify(path).first_bad == 0


def test_restart_resumes_chain_and_drops_torn_tail(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 3)
    with open(path, "ab") as f:
        f.write(b'{"hash":"abc","seq":3')  # crash mid-write
    write(path, 3)
    recs = [json.loads(x) for x in lines(path)]
    assert [r["seq"] for r in recs] == list(range(6))
    assert verify(path).ok


def test_rotation_keeps_the_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 60, max_bytes=4096)
    files = rotated_files(path)
    assert len(files) >= 3 and files[-1] == path and files[-2].name == "audit.jsonl.1"
    assert all(f.stat().st_size <= 4096 for f in files)
    first_of_current = json.loads(lines(path)[0])
    last_of_previous = json.loads(lines(files[-2])[-1])
    assert first_of_current["prev"] == last_of_previous["hash"]
    res = verify(path)
    assert res.ok and res.records == 60
    # resuming after restart continues in the current file, then keeps rotating
    write(path, 20, max_bytes=4096)
    res = verify(path)
    assert res.ok and res.records == 80
    # tampering inside the oldest file is found there
    old = rotated_files(path)[0]
    text = lines(old)
    text[1] = text[1].replace('"rows":', '"rows":1')
    old.write_text("\n".join(text) + "\n")
    res = verify(path)
    assert res.first_bad == 1 and old.name in res.reason


def test_full_queue_drops_without_blocking(tmp_path):
    log = open_log(tmp_path / "audit.jsonl", queue_size=2)
    gate = threading.Event()
    real = log._write_batch

    def slow(batch):  # a writer stuck on a slow disk
        gate.wait(5)
        real(batch)

    log._write_batch = slow
    results, worst = [], 0.0
    for i in range(50):
        t0 = time.perf_counter()
        results.append(log.record("infer", n=i))
        worst = max(worst, time.perf_counter() - t0)
    assert worst < 0.02  # a blocking put would wait for the writer (seconds)
    assert results.count(True) <= 3 and log.dropped == results.count(False) >= 47
    gate.set()
    log.close()
    res = verify(log.path)
    assert res.ok and res.records == results.count(True)


def test_disabled_and_reserved_fields(tmp_path):
    off = AuditLog(AuditConfig())
    assert not off.enabled and off.record("x") is False
    off.close()
    log = open_log(tmp_path / "a.jsonl")
    with pytest.raises(ValueError, match="reserved"):
        log.record("x", seq=1)
    log.close()
    assert log.record("late") is False


def test_second_writer_on_same_file_is_refused(tmp_path):
    path = tmp_path / "audit.jsonl"
    first = open_log(path)
    with pytest.raises(ConfigError, match="own file"):
        open_log(path)
    first.close()
    open_log(path).close()  # free again once the first is closed


def test_flush_makes_records_durable_before_close(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = open_log(path, flush_interval_ms=10000)
    log.record("a")
    t0 = time.perf_counter()
    assert log.flush()
    assert time.perf_counter() - t0 < 1.0  # flush cuts the batching wait short
    assert len(lines(path)) == 1
    log.close()


def test_digest():
    assert digest("abc") == digest(b"abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert digest("abc", key=b"k") != digest("abc") and len(digest("abc", key=b"k")) == 64


def test_config_validation():
    with pytest.raises(ConfigError, match="queue_size"):
        from_params(AuditConfig, {"queue_size": "0"}, section="audit")

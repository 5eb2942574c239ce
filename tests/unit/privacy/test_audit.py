import json
import threading
import time
from itertools import pairwise

import pytest

from tritonguard.core.config import from_params
from tritonguard.core.errors import ConfigError
from tritonguard.privacy.audit import anchors as audit
from tritonguard.privacy.audit import log as audit_log
from tritonguard.privacy.audit.chain import GENESIS, digest, record_hash, rotated_files
from tritonguard.privacy.audit.log import AuditConfig, AuditLog
from tritonguard.privacy.audit.verify import verify


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
    # the drops are in the chain: one gap record, and verify does not call that intact
    res = verify(log.path)
    assert not res.ok and res.status == "gaps" and res.records == results.count(True) + 1
    assert len(res.gaps) == 1 and res.gaps[0]["lost"] == log.dropped
    assert res.gaps[0]["reasons"] == {"queue_full": log.dropped}
    assert f"gaps: {log.dropped} records lost in 1 gap" in res.reason
    assert verify(log.path, allow_gaps=True).ok


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


# -- anchors, truncation, gaps (issue 12) -----------------------------------------------------
KEY = "k" * 32


def anchor_doc(path):
    return json.loads((path.parent / (path.name + ".anchor")).read_text())


def anchored_seq(path):
    """The local anchor's seq, None before the writer's first anchor."""
    try:
        return anchor_doc(path)["seq"]
    except FileNotFoundError:
        return None


def keep_lines(path, n):
    text = lines(path)[:n]
    path.write_text("".join(x + "\n" for x in text))


def test_intact_chain_is_anchored(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 10)
    doc = anchor_doc(path)
    last = json.loads(lines(path)[-1])
    assert doc["seq"] == 10 and doc["head"] == last["hash"] and doc["name"].endswith(str(path))
    assert doc["alg"] == "sha256"  # no key configured: checksummed, not signed
    res = verify(path)
    assert res.ok and res.status == "ok" and res.records == 10 and res.reason == "ok"
    assert res.anchors and res.anchors[0]["seq"] == 10 and not res.warnings


@pytest.mark.parametrize("keep,missing,where", [(29, 1, "after seq 28"), (20, 10, "after seq 19"),
                                                 (0, 30, "the log is empty")])
def test_lost_tail_is_truncation(tmp_path, keep, missing, where):
    path = tmp_path / "audit.jsonl"
    write(path, 30)
    keep_lines(path, keep)  # delete the last record, the last 10, every record
    res = verify(path)
    assert not res.ok, "a lost tail must not verify"
    assert res.status == "truncated" and res.missing == missing and res.records == keep
    assert res.reason.startswith(f"truncated: {missing} record{'s' if missing > 1 else ''} missing")
    assert where in res.reason and res.first_bad == keep


def test_deleted_log_with_an_anchor_is_truncation(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 5)
    path.unlink()
    res = verify(path)
    assert res.status == "truncated" and res.missing == 5 and "no log files left" in res.reason
    assert verify(tmp_path / "never.jsonl").status == "missing"


def test_rewritten_tail_is_detected(tmp_path):
    """Cut the tail and append a fresh, internally valid chain of the same length: the count
    matches the anchor, the anchored head does not."""
    path = tmp_path / "audit.jsonl"
    write(path, 10)
    anchor = (tmp_path / "audit.jsonl.anchor").read_bytes()
    keep_lines(path, 7)
    (tmp_path / "audit.jsonl.anchor").unlink()
    write(path, 3)  # a writer with no anchor to compare with chains on from seq 6
    (tmp_path / "audit.jsonl.anchor").write_bytes(anchor)
    res = verify(path)
    assert res.records == 10 and res.status == "truncated"
    assert "anchored record seq 9" in res.reason and "not in the chain" in res.reason


def test_truncation_across_rotation(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 60, max_bytes=4096)
    assert len(rotated_files(path)) >= 3 and anchor_doc(path)["seq"] == 60
    assert verify(path).status == "ok"
    n_current = len(lines(path))
    path.unlink()  # the current file, with the newest records
    res = verify(path)
    assert res.status == "truncated" and res.missing == n_current
    assert f"after seq {59 - n_current}" in res.reason


def test_writer_records_a_truncation_it_finds_on_restart(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 20)
    keep_lines(path, 15)
    log = write(path, 3)  # restart: the anchor says 20, the log holds 15
    recs = [json.loads(x) for x in lines(path)]
    note = recs[15]
    assert note["type"] == "truncation" and note["missing"] == 5 and note["anchor_seq"] == 20
    assert [r["seq"] for r in recs] == list(range(19)) and log.written == 4
    assert anchor_doc(path)["seq"] == 19  # the new anchor covers the note
    res = verify(path)
    assert res.status == "truncated" and "5 records missing after seq 14" in res.reason
    assert "found when writing resumed" in res.reason


def test_restart_with_an_anchor_behind_the_log_is_clean(tmp_path):
    """A crash between the fsync of a batch and its anchor leaves the anchor behind: fine."""
    path = tmp_path / "audit.jsonl"
    write(path, 30, max_bytes=4096)
    old = (tmp_path / "audit.jsonl.anchor").read_bytes()
    write(path, 40, max_bytes=4096)
    (tmp_path / "audit.jsonl.anchor").write_bytes(old)  # anchored at 30, the log holds 70
    assert verify(path).status == "ok"
    write(path, 1, max_bytes=4096)  # the writer finds seq 29 in a rotated file: no truncation
    assert all(json.loads(x)["type"] != "truncation" for f in rotated_files(path) for x in lines(f))
    assert verify(path).status == "ok" and anchor_doc(path)["seq"] == 71


def test_disk_full_drops_are_a_gap_record(tmp_path, monkeypatch):
    path = tmp_path / "audit.jsonl"
    log = open_log(path)
    for i in range(5):
        log.record("infer", n=i)
    assert log.flush()
    real = audit_log._write_all

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(audit_log, "_write_all", full)
    t0 = time.time()
    for i in range(7):
        log.record("infer", n=i)
    assert log.flush()
    assert log.dropped == 7 and log.write_errors >= 1 and len(lines(path)) == 5
    errors = log.write_errors
    time.sleep(0.3)  # the pending gap record is retried once per anchor_interval_ms (1 s), no faster
    assert log.write_errors <= errors + 1
    assert verify(path).status == "ok"  # nothing written yet: the gap is noted when writing resumes
    monkeypatch.setattr(audit_log, "_write_all", real)
    log.record("infer", n=99)
    log.close()
    recs = [json.loads(x) for x in lines(path)]
    gap = recs[5]
    assert gap["type"] == "gap" and gap["lost"] == 7 and gap["reasons"] == {"write_error": 7}
    assert t0 <= gap["first_lost_ts"] <= gap["last_lost_ts"] <= time.time()
    assert recs[6]["n"] == 99 and len(recs) == 7
    res = verify(path)
    assert not res.ok and res.status == "gaps" and res.gaps[0]["seq"] == 5 and res.gaps[0]["lost"] == 7
    assert "gaps: 7 records lost in 1 gap" in res.reason and "write_error 7" in res.reason
    ok = verify(path, allow_gaps=True)
    assert ok.ok and ok.status == "gaps"


def test_drops_before_close_still_get_their_gap_record(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = open_log(path)
    log.record("infer", n=1)
    log.flush()
    log._lose(3, "queue_full", time.time(), time.time())  # what record() does on a full queue
    log.close()
    recs = [json.loads(x) for x in lines(path)]
    assert [r["type"] for r in recs] == ["infer", "gap"] and recs[1]["lost"] == 3
    assert verify(path).status == "gaps" and anchor_doc(path)["seq"] == 2


def test_internal_record_types_are_reserved(tmp_path):
    log = open_log(tmp_path / "a.jsonl")
    for typ in ("gap", "truncation"):
        with pytest.raises(ValueError, match="reserved"):
            log.record(typ)
    log.close()


def test_anchor_is_written_when_idle(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = open_log(path, anchor_interval_ms=50)
    log.record("a")
    deadline = time.monotonic() + 5
    while anchored_seq(path) != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert anchor_doc(path)["seq"] == 1 and log.anchored_seq == 1  # no flush, no close
    log.close()


def test_anchor_every_n_records(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = open_log(path, anchor_interval_ms=600000, anchor_records=5)
    seen = set()
    for i in range(12):
        log.record("a", n=i)
        time.sleep(0.01)  # batches of a record or two
        seen.add(anchored_seq(path))
    time.sleep(0.1)
    seen.add(anchored_seq(path))
    seen.discard(None)
    assert max(seen) >= 10 and all(s == 0 or s >= 5 for s in seen), seen
    log.close()
    assert anchor_doc(path)["seq"] == 12


def test_signed_anchor(tmp_path):
    path = tmp_path / "audit.jsonl"
    cfg = from_params(AuditConfig, {"path": str(path), "flush_interval_ms": "5"}, section="audit")
    log = AuditLog(cfg, environ={"TRITONGUARD_AUDIT_KEY": KEY})
    for i in range(10):
        log.record("a", n=i)
    log.close()
    doc = anchor_doc(path)
    assert doc["alg"] == "hmac-sha256" and doc["key_id"] == audit.key_id(KEY.encode())
    assert verify(path, key=KEY.encode()).status == "ok"
    unchecked = verify(path)  # no key: used, with a warning
    assert unchecked.status == "ok" and "not checked" in unchecked.warnings[0]
    other = verify(path, key=b"x" * 32)
    assert other.status == "tampered" and "another key" in other.reason
    # hide a truncation by lowering the anchor: the signature no longer matches
    keep_lines(path, 8)
    doc.update(seq=8, head=json.loads(lines(path)[-1])["hash"])
    (tmp_path / "audit.jsonl.anchor").write_text(json.dumps(doc))
    forged = verify(path, key=KEY.encode())
    assert not forged.ok and forged.status == "tampered" and "signature does not match" in forged.reason
    # an unsigned anchor is refused when a key is expected: anyone could have written it
    fake = audit.make_anchor(name=doc["name"], path=path, seq=8, head=doc["head"], ts=time.time())
    (tmp_path / "audit.jsonl.anchor").write_text(json.dumps(fake))
    assert verify(path).status == "ok"
    res = verify(path, key=KEY.encode())
    assert res.status == "tampered" and "not signed" in res.reason
    with pytest.raises(ConfigError, match="at least 16"):
        AuditLog(cfg, environ={"TRITONGUARD_AUDIT_KEY": "short"})


def test_key_change_keeps_the_chain_clean(tmp_path):
    """After a key change the writer compares the old anchor's counts unchecked: a log that holds
    them is fine, one that lost records gets its truncation record."""
    path = tmp_path / "audit.jsonl"
    cfg = from_params(AuditConfig, {"path": str(path), "flush_interval_ms": "5"}, section="audit")

    def session(key, n):
        log = AuditLog(cfg, environ={"TRITONGUARD_AUDIT_KEY": key})
        for i in range(n):
            log.record("a", n=i)
        log.close()

    session(KEY, 5)
    session("n" * 32, 5)
    assert verify(path, key=b"n" * 32).status == "ok" and anchor_doc(path)["seq"] == 10
    keep_lines(path, 8)
    session("m" * 32, 1)
    assert json.loads(lines(path)[8])["type"] == "truncation"
    assert verify(path, key=b"m" * 32).status == "truncated"


def test_anchor_in_the_file_store_outlives_the_local_one(tmp_path):
    path = tmp_path / "logs" / "audit.jsonl"
    store = audit.FileAnchors(tmp_path / "repo" / "guard", prefix=audit.ANCHOR_PREFIX)
    cfg = from_params(AuditConfig, {"path": str(path), "flush_interval_ms": "5"}, section="audit")
    log = AuditLog(cfg, anchors=store)
    for i in range(20):
        log.record("a", n=i)
    log.close()
    blob = json.loads(store.get(audit.anchor_name(path)))
    assert blob["seq"] == 20 and blob == anchor_doc(path)
    assert store.file_for(audit.anchor_name(path)).parent == store.directory
    assert store.file_for(audit.anchor_name(path)).name.startswith("audit_anchor.audit.jsonl.")
    # cut the tail and rewrite the local anchor to match (it is only checksummed)
    keep_lines(path, 15)
    fake = audit.make_anchor(name=blob["name"], path=path, seq=15, head=json.loads(lines(path)[-1])["hash"],
                             ts=time.time())
    (path.parent / "audit.jsonl.anchor").write_text(json.dumps(fake))
    assert verify(path).status == "ok"  # the local anchor alone is fooled
    res = verify(path, anchors=store)
    assert res.status == "truncated" and res.missing == 5 and "after seq 14" in res.reason
    assert store.where(audit.anchor_name(path)) in res.reason
    # open_anchor_store without a URL: files beside the guard's rollout state
    picked = audit.open_anchor_store("guard", tmp_path / "repo", url="")
    assert isinstance(picked, audit.FileAnchors) and picked.directory == store.directory


def test_anchor_in_redis(tmp_path, redis_server):
    hkey = f"tgtest:audit:anchors:{time.time_ns()}"
    path = tmp_path / "audit.jsonl"
    cfg = from_params(AuditConfig, {"path": str(path), "flush_interval_ms": "5"}, section="audit")
    log = AuditLog(cfg, anchors=audit.RedisAnchors(redis_server.url, key=hkey),
                   environ={"TRITONGUARD_AUDIT_KEY": KEY})
    for i in range(25):
        log.record("a", n=i)
    log.close()
    reader = audit.RedisAnchors(redis_server.url, key=hkey)
    name = audit.anchor_name(path)
    doc = json.loads(reader.get(name))
    assert doc["seq"] == 25 and doc["alg"] == "hmac-sha256"
    assert verify(path, anchors=reader, key=KEY.encode()).status == "ok"
    # the attacker cuts 5 records and deletes the anchor beside the log: Redis still knows
    keep_lines(path, 20)
    (tmp_path / "audit.jsonl.anchor").unlink()
    assert verify(path).status == "unanchored"
    res = verify(path, anchors=reader, key=KEY.encode())
    assert res.status == "truncated" and "5 records missing after seq 19" in res.reason and hkey in res.reason
    # a restarted writer finds the loss through Redis too, and writes it into the chain
    log = AuditLog(cfg, anchors=audit.RedisAnchors(redis_server.url, key=hkey), environ={"TRITONGUARD_AUDIT_KEY": KEY})
    log.close()
    assert json.loads(lines(path)[-1])["type"] == "truncation"
    assert json.loads(reader.get(name))["seq"] == 21
    assert verify(path, anchors=reader, key=KEY.encode()).status == "truncated"
    reader.client.delete(hkey)
    reader.close()


def test_unreachable_redis_never_stalls_the_writer(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = audit.RedisAnchors(f"redis://127.0.0.1:{port}/0", key="tgtest:none")
    path = tmp_path / "audit.jsonl"
    log = AuditLog(AuditConfig(path=str(path), flush_interval_ms=5, anchor_interval_ms=10), anchors=store)
    worst = 0.0
    for i in range(200):
        t0 = time.perf_counter()
        assert log.record("a", n=i)
        worst = max(worst, time.perf_counter() - t0)
        if i % 50 == 0:
            time.sleep(0.05)
    assert worst < 0.02
    log.close()
    assert log.dropped == 0 and log.anchor_errors >= 1
    assert anchor_doc(path)["seq"] == 200  # the local anchor does not wait for Redis
    res = verify(path, anchors=store)
    assert res.status == "ok" and any("could not be read" in w for w in res.warnings)


def test_unanchored_and_registry_style_chains_still_verify(tmp_path):
    """A chain written without an AuditLog (the registry's history) has no anchor: ok, with a
    warning in the result; the reason stays 'ok'."""
    path = tmp_path / "registry_history.jsonl"
    prev, out = GENESIS, []
    for seq in range(3):
        rec = {"seq": seq, "ts": 1.0, "prev": prev, "type": "transition"}
        rec["hash"] = prev = record_hash(rec)
        out.append(json.dumps(rec))
    path.write_text("\n".join(out) + "\n")
    res = verify(path)
    assert res.ok and res.status == "unanchored" and res.reason == "ok" and res.records == 3
    assert "unanchored" in res.warnings[0]


# -- the CLI ------------------------------------------------------------------------------------
def run_cli(*args, env=None):
    from typer.testing import CliRunner

    from exporter.cli.app import app

    return CliRunner().invoke(app, ["audit", "verify", *map(str, args)], env=env or {})


def test_cli_exit_codes(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 12)
    ok = run_cli(path)
    assert ok.exit_code == 0 and "ok: 12 records, chain intact (1 file)" in ok.stdout, ok.output
    assert "anchored: 12 records" in ok.stdout
    # tampered: 1
    text = lines(path)
    rec = json.loads(text[3])
    rec["rows"] = 1000
    path.write_text("\n".join([*text[:3], json.dumps(rec), *text[4:]]) + "\n")
    bad = run_cli(path)
    assert bad.exit_code == 1 and "TAMPERED: first bad record is #3" in bad.output
    path.write_text("\n".join(text) + "\n")
    # truncated: 1, named TRUNCATED
    keep_lines(path, 9)
    cut = run_cli(path)
    assert cut.exit_code == 1 and "TRUNCATED: 3 records missing after seq 8" in cut.output, cut.output
    out = json.loads(run_cli(path, "--json").stdout)
    assert out["status"] == "truncated" and out["exit_code"] == 1 and out["missing"] == 3 and not out["ok"]
    path.write_text("")
    assert (r := run_cli(path)).exit_code == 1 and "TRUNCATED" in r.output, r.output
    # no log at all: 2
    assert run_cli(tmp_path / "none.jsonl").exit_code == 2
    # unanchored: 0 with a warning, 1 (UNANCHORED) with --require-anchor
    path.write_text("\n".join(text) + "\n")
    (tmp_path / "audit.jsonl.anchor").unlink()
    un = run_cli(path)
    assert un.exit_code == 0 and "warning: unanchored" in un.output
    assert (r := run_cli(path, "--require-anchor")).exit_code == 1 and "UNANCHORED" in r.output, r.output


def test_cli_gaps_and_stores(tmp_path, redis_server):
    path = tmp_path / "audit.jsonl"
    hkey = f"tgtest:audit:cli:{time.time_ns()}"
    log = AuditLog(AuditConfig(path=str(path), flush_interval_ms=5),
                   anchors=audit.RedisAnchors(redis_server.url, key=hkey))
    log.record("a")
    log.flush()
    log._lose(4, "queue_full", time.time(), time.time())
    log.record("b")
    log.close()
    gaps = run_cli(path)
    assert gaps.exit_code == 1 and "GAPS: 4 records lost in 1 gap" in gaps.output, gaps.output
    allowed = run_cli(path, "--allow-gaps")
    assert allowed.exit_code == 0 and "ok: 3 records" in allowed.stdout
    # the Redis anchor: found with --state-url (hash key of this test) once the local one is gone
    (tmp_path / "audit.jsonl.anchor").unlink()
    keep_lines(path, 2)
    assert run_cli(path, "--allow-gaps").exit_code == 0  # unanchored: the cut is invisible
    store = audit.RedisAnchors(redis_server.url, key=hkey)
    res = verify(path, anchors=store, allow_gaps=True)
    assert res.status == "truncated" and res.missing == 1
    store.client.delete(hkey)
    store.close()
    # the file store, found under --repository
    repo = tmp_path / "repo"
    path2 = tmp_path / "b.jsonl"
    log = AuditLog(AuditConfig(path=str(path2), flush_interval_ms=5),
                   anchors=audit.FileAnchors(repo / "guard", prefix=audit.ANCHOR_PREFIX))
    for i in range(6):
        log.record("a", n=i)
    log.close()
    (tmp_path / "b.jsonl.anchor").unlink()
    keep_lines(path2, 4)
    assert run_cli(path2).exit_code == 0
    cut = run_cli(path2, "--repository", repo)
    assert cut.exit_code == 1 and "TRUNCATED: 2 records missing after seq 3" in cut.output, cut.output
    assert (r := run_cli(path2, "-r", repo, "--model", "guard")).exit_code == 1 and "TRUNCATED" in r.output, r.output


def test_cli_module_entry_point(tmp_path):
    """``python -m exporter audit verify`` as operators run it: exit 0, then 1 (TRUNCATED) once cut."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    path = tmp_path / "audit.jsonl"
    write(path, 4)
    cli = [sys.executable, "-m", "exporter", "audit", "verify", str(path)]
    ok = subprocess.run(cli, cwd=root, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "ok: 4 records, chain intact" in ok.stdout, ok.stdout + ok.stderr
    keep_lines(path, 3)
    cut = subprocess.run(cli, cwd=root, capture_output=True, text=True, timeout=120)
    assert cut.returncode == 1 and "TRUNCATED: 1 record missing after seq 2" in cut.stderr, cut.stderr

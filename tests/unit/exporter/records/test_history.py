"""The registry's stage history of an object-store repository lives in the store (issue 39 item 1):
a failed command drops only its copy of the repository, never the registry or the history, and
a second machine (another ``$TRITONGUARD_HOME``) reads the same hash-chained records. The store
is moto's S3 server (a subprocess, real HTTP; tests/conftest.py ``moto_s3``), Redis a real
redis-server."""

from __future__ import annotations

import json
import threading

import pytest
from typer.testing import CliRunner

from exporter.cli.app import app
from exporter.records.history import FileHistory, HistoryError, StoreHistory, history_prefix
from exporter.records.registry import RegistryError, open_history, open_registry
from exporter.records.remote import working_copy
from tritonguard.core import objectstore

SHA = "ab" * 32


def _seed(s3, bucket: str, prefix: str = "repo") -> None:
    put = lambda key, body: s3.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=body)  # noqa: E731
    put("digits_raw/config.pbtxt", b'name: "digits_raw"\nbackend: "runtime"\n')
    for v in (1, 2):
        put(f"digits_raw/{v}/model.onnx", f"v{v}".encode())
        put(f"digits_raw/{v}/manifest.json", json.dumps(
            {"name": "digits_raw", "version": v, "sha256": f"{v:02d}" * 32, "golden": {"verdict": "PASS"}}).encode())
    put("digits/config.pbtxt", b'name: "digits"\nbackend: "guard"\n'
                               b'parameters { key: "target" value { string_value: "digits_raw" } }\n')


def _clock():
    t = iter(range(1_000, 10_000))
    return lambda: float(next(t))


def test_a_failed_command_keeps_the_registry_and_another_machine_reads_the_history(aws_env, tmp_path, monkeypatch):
    """A promotion recorded, then the command fails (as a promote that rolls back exits 1 right
    after recording ARCHIVED): the registry and its history survive on this machine, and a
    machine that never ran a command on this store reads the same records, chain intact."""
    s3 = aws_env.client()
    bucket = aws_env.bucket("history-survives")
    _seed(s3, bucket)
    spec = f"s3://{bucket}/repo"
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "a"))
    with pytest.raises(RuntimeError), working_copy(spec) as local:
        reg = open_registry(local, clock=_clock())
        for v in (1, 2):
            reg.register("digits", v, {"sha256": f"{v:02d}" * 32, "golden": {"verdict": "PASS"}})
        reg.transition("digits", 1, "PRODUCTION", "DRAFT")
        reg.transition("digits", 2, "PRODUCTION", "DRAFT")
        reg.rollback("digits", reason="gates failed")  # v1 back, v2 ARCHIVED
        recorded = reg.history("digits")
        raise RuntimeError("the promote rolled back: exit 1")
    assert [r["type"] for r in recorded] == ["register", "register", "transition", "transition", "transition"]
    with working_copy(spec, read_only=True) as local:
        reg = open_registry(local)
        assert reg.production("digits") == 1  # this machine's registry is still there
        assert reg.history("digits") == recorded
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "b"))  # another machine
    with working_copy(spec, read_only=True) as local:
        assert open_registry(local).history("digits") == recorded
        result, records = open_history(local).load("digits")
    assert result.ok and result.records == 5 and records == recorded
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="repo.registry/")["Contents"])
    assert keys == [f"repo.registry/history/{seq:012d}.json" for seq in range(5)]
    # nothing of it inside the repository Triton reads
    assert not any("registry" in o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="repo/")["Contents"])


def test_the_cli_keeps_the_history_of_a_store_through_a_failed_command_and_shows_it_elsewhere(
        aws_env, tmp_path, monkeypatch, redis_server):
    """The same through the CLI: ``reconcile`` records v1 PRODUCTION, a command fails (exit 2),
    ``status`` on another machine shows the records and the stages they tell."""
    s3 = aws_env.client()
    bucket = aws_env.bucket("history-cli")
    _seed(s3, bucket)
    spec = f"s3://{bucket}/repo"
    monkeypatch.setenv("TRITONGUARD_STATE_URL", redis_server.url)
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "a"))
    cli = CliRunner()
    for args in (["route", "digits", "--primary", "1"], ["reconcile", "digits"]):
        res = cli.invoke(app, [*args, "-r", spec])
        assert res.exit_code == 0, res.output
    with working_copy(spec, read_only=True) as local:
        recorded = open_registry(local).history("digits")
    assert [(r["type"], r.get("to")) for r in recorded] == [("register", None), ("transition", "PRODUCTION")]
    res = cli.invoke(app, ["route", "digits", "--primary", "7", "-r", spec])  # no v7: the command fails
    assert res.exit_code != 0, res.output
    with working_copy(spec, read_only=True) as local:
        assert open_registry(local).history("digits") == recorded

    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "b"))
    res = cli.invoke(app, ["status", "--json", "-r", spec])
    assert res.exit_code == 0, res.output
    (guard,) = json.loads(res.stdout)["guards"]
    assert guard["history"]["ok"] and guard["history"]["records"] == recorded
    assert guard["history"]["where"] == f"s3://{bucket}/repo.registry/history/"
    assert guard["stages"] == {"1": "PRODUCTION"} and guard["stages_from"] == "history"
    res = cli.invoke(app, ["status", "-r", spec])
    assert res.exit_code == 0, res.output
    assert "history: 2 records, chain intact" in res.output and "DRAFT → PRODUCTION" in res.output


def test_two_writers_chain_on_one_after_the_other(atomic_aws_env, tmp_path):
    """Two machines append: one that read a stale tail finds its seq taken (a conditional put),
    re-reads and chains after the other's record; nobody's record is overwritten, no fork."""
    bucket = atomic_aws_env.bucket("history-writers")
    spec = objectstore.parse(f"s3://{bucket}/repo")
    a = StoreHistory(spec, tmp_path / "a" / "h.jsonl")
    b = StoreHistory(spec, tmp_path / "b" / "h.jsonl")
    a.append({"type": "register", "model": "m", "version": 1}, _clock())
    b.append({"type": "register", "model": "m", "version": 2}, _clock())
    real, stale = a._sync, [True]

    def sync_once_stale():  # the first read misses b's record, as if b wrote just after it
        if stale.pop() if stale else False:
            return None
        return real()

    a._sync = sync_once_stale
    a.append({"type": "register", "model": "m", "version": 3}, _clock())
    for h in (a, b):
        result, records = h.load()
        assert result.ok, result.reason
        assert [(r["seq"], r["version"]) for r in records] == [(0, 1), (1, 2), (2, 3)]

    # and at the same time, from threads: every record lands once, in one chain
    writers = [StoreHistory(spec, tmp_path / f"w{i}" / "h.jsonl") for i in range(3)]

    failed: list[str] = []

    def write(h: StoreHistory, i: int) -> None:
        try:
            for n in range(4):
                h.append({"type": "register", "model": "m", "version": 100 * i + n}, _clock())
        except Exception as exc:  # noqa: BLE001 - shown by the assertion below
            failed.append(f"writer {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=write, args=(h, i)) for i, h in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    # a writer still appending after 120 s (a loaded machine) or one that gave up is said as such,
    # not as a record missing
    assert not any(t.is_alive() for t in threads), "a writer was still appending after 120 s"
    assert not failed, failed
    result, records = writers[0].load()
    assert result.ok and len(records) == 15, result.reason
    assert sorted(r["version"] for r in records[3:]) == sorted(100 * i + n for i in range(3) for n in range(4))


def test_an_edited_or_deleted_record_in_the_store_breaks_the_chain(aws_env, tmp_path):
    s3 = aws_env.client()
    bucket = aws_env.bucket("history-tamper")
    spec = objectstore.parse(f"s3://{bucket}/repo")
    h = StoreHistory(spec, tmp_path / "h.jsonl")
    for v in range(3):
        h.append({"type": "register", "model": "m", "version": v}, _clock())
    key = h.key(1)
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=bucket, Key=key, Body=body.replace(b'"version":1', b'"version":9'))
    result, _ = h.load()  # the mirror is refreshed from the store: the edit is seen
    assert not result.ok and result.first_bad == 1
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    assert h.load()[0].ok
    s3.delete_object(Bucket=bucket, Key=key)
    result, _ = StoreHistory(spec, tmp_path / "fresh.jsonl").load()
    assert not result.ok and result.first_bad == 1


def test_a_local_history_from_before_is_moved_into_the_store(aws_env, tmp_path):
    """A history file an earlier release kept in the work folder goes up once, record by record,
    chain unchanged; one that disagrees with the store is kept aside, never deleted."""
    bucket = aws_env.bucket("history-migrate")
    spec = objectstore.parse(f"s3://{bucket}/repo")
    old = tmp_path / "a" / "registry_history.jsonl"
    for v in (1, 2):
        FileHistory(old).append({"type": "register", "model": "m", "version": v}, _clock())
    lines = old.read_bytes()
    result, records = StoreHistory(spec, old).load()
    assert result.ok and [r["version"] for r in records] == [1, 2]
    assert old.read_bytes() == lines
    result, records = StoreHistory(spec, tmp_path / "b" / "h.jsonl").load()
    assert result.ok and [r["version"] for r in records] == [1, 2]

    other = tmp_path / "c" / "registry_history.jsonl"
    FileHistory(other).append({"type": "register", "model": "m", "version": 7}, _clock())
    mine = other.read_bytes()
    result, records = StoreHistory(spec, other).load()
    assert result.ok and [r["version"] for r in records] == [1, 2]
    (aside,) = other.parent.glob("registry_history.local-*.jsonl")
    assert aside.read_bytes() == mine


def test_a_repository_at_the_root_of_a_bucket_has_no_place_for_a_history(aws_env, tmp_path, monkeypatch):
    """Every key of such a bucket is inside the repository, where Triton would take the history
    for a model: refused with a clear line, not kept where it can be lost."""
    bucket = aws_env.bucket("history-root")
    spec = objectstore.parse(f"s3://{bucket}")
    with pytest.raises(HistoryError, match="root of its bucket.*under a prefix"):
        history_prefix(spec)
    assert history_prefix(objectstore.parse(f"s3://{bucket}/a/b")) == "a/b.registry/history/"
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "home"))
    with working_copy(f"s3://{bucket}", read_only=True) as local, pytest.raises(RegistryError, match="root"):
        open_history(local)

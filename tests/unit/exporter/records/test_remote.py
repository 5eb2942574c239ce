"""exporter.records.remote: the exporter's working copy of an object-store repository and the
order it publishes in. The store is moto's S3 server (an S3 stand-in in a subprocess, real HTTP;
tests/conftest.py ``moto_s3``); the order is what boto3 actually sent, PutObject by PutObject."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from exporter.cli.app import app
from exporter.records.remote import (
    POLICY_FILE,
    RemoteRepositoryError,
    pin_complete_versions,
    working_copy,
)
from tritonguard.core import repository


def _record_puts(s3) -> list[str]:
    """The keys of every PutObject / CreateMultipartUpload the client sends, in order."""
    sent: list[str] = []
    for op in ("PutObject", "CreateMultipartUpload"):
        s3.meta.events.register(f"before-parameter-build.s3.{op}", lambda params, **_: sent.append(params["Key"]))
    return sent


def _seed(s3, bucket: str) -> None:
    put = lambda key, body: s3.put_object(Bucket=bucket, Key=f"repo/{key}", Body=body)  # noqa: E731
    put("digits_raw/config.pbtxt", b'name: "digits_raw"\nbackend: "runtime"\n')
    put("digits_raw/1/model.onnx", b"v1")
    put("digits_raw/1/manifest.json", b'{"name": "digits_raw", "version": 1}')
    put("digits/config.pbtxt", b'name: "digits"\nbackend: "guard"\n'
                               b'parameters { key: "target" value { string_value: "digits_raw" } }\n')


def _locked_store(aws_env, tmp_path, monkeypatch, redis_server, bucket: str, **periods: float):
    """A seeded store whose publishes take the Redis publish lock: ``(s3 client, bucket, spec,
    redis client, lock key)``, the key as the code names it (:func:`tritonguard.core.store.redis_prefix`);
    ``periods`` set the module's ``PUBLISH_*_S`` (``LOCK``, ``RENEW``, ``WAIT``)."""
    import redis

    from exporter.records import remote
    from tritonguard.core.store import redis_prefix

    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRITONGUARD_STATE_URL", redis_server.url)
    for name, seconds in periods.items():
        monkeypatch.setattr(remote, f"PUBLISH_{name}_S", seconds)
    s3 = aws_env.client()
    _seed(s3, aws_env.bucket(bucket))
    spec = f"s3://{bucket}/repo"
    key = redis_prefix("publish", dict(os.environ)) + remote.objectstore.parse(spec, dict(os.environ)).cache_key
    return s3, bucket, spec, redis.Redis.from_url(redis_server.url), key


def test_a_new_version_is_published_files_then_manifest_then_configs(aws_env, tmp_path, monkeypatch):
    import boto3

    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "home"))
    s3 = aws_env.client()
    bucket = aws_env.bucket("publish-order")
    _seed(s3, bucket)
    spec = f"s3://{bucket}/repo"
    client = boto3.client("s3")  # what working_copy builds: endpoint and keys from AWS_*
    sent = _record_puts(client)
    monkeypatch.setattr("tritonguard.core.objectstore.client", lambda _spec: client)
    with working_copy(spec) as local:
        assert (local / "digits_raw" / "1" / "model.onnx").read_bytes() == b"v1"
        assert not (local / "digits").joinpath("1").exists()  # S3 has no empty folder
        v2 = local / "digits_raw" / "2"
        v2.mkdir()
        (v2 / "model.onnx").write_bytes(b"v2")
        (v2 / "goldens.npz").write_bytes(b"g")
        (v2 / "manifest.json").write_text('{"name": "digits_raw", "version": 2}')
        (local / "digits_raw" / "config.pbtxt").write_text('name: "digits_raw"\nbackend: "runtime"\n# v2\n')
        (local / "digits" / "config.pbtxt").write_text('name: "digits"\nbackend: "guard"\n# v2\n')
        (local / "digits" / "1").mkdir()  # the guard's version folder, as an old exporter left it
        (local / "digits" / "rollout_state.json").write_text("{}")  # run-time files never go up
        (local / "digits" / ".latency").mkdir()
        (local / "digits" / ".latency" / "x.lat").write_bytes(b"x")
        assert sent == []  # nothing goes up before the command is done
    assert sent == [
        "repo/digits_raw/2/goldens.npz", "repo/digits_raw/2/model.onnx",
        "repo/digits/1/manifest.json", "repo/digits/version_policy.json",  # the guard's placeholder, its policy
        "repo/digits_raw/2/manifest.json", "repo/digits_raw/version_policy.json",  # v2's manifest, the policy
        "repo/digits_raw/config.pbtxt", "repo/digits/config.pbtxt",  # the target before its guard
    ]
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="repo/")["Contents"]}
    assert "repo/digits/rollout_state.json" not in keys and not any(".latency" in k for k in keys)
    placeholder = json.loads(s3.get_object(Bucket=bucket, Key="repo/digits/1/manifest.json")["Body"].read())
    assert placeholder["placeholder"] is True and placeholder["name"] == "digits"

    # unchanged: nothing is sent; a failed command publishes nothing
    sent.clear()
    with working_copy(spec) as local:
        pass
    assert sent == []
    with pytest.raises(RuntimeError), working_copy(spec) as local:
        (local / "digits_raw" / "3").mkdir()
        (local / "digits_raw" / "3" / "model.onnx").write_bytes(b"v3")
        raise RuntimeError("the export failed")
    assert sent == []
    # the next command's working copy is the store again (v3's leftovers are not published later)
    with working_copy(spec) as local:
        assert repository.versions(local / "digits_raw") == [1, 2]
    assert sent == []


def test_published_configs_name_complete_versions_only(tmp_path):
    """A version caught mid-upload (its artifact there, no manifest yet) is in no published
    config: "latest" and "all" become the complete versions they choose, the original policy is
    kept in a file beside the config for the next publish, and a model placed by hand keeps its
    policy."""
    def model(name: str, policy: dict | None, versions: dict[int, bool]) -> Path:
        cfg = {"name": name, "backend": "runtime", **({"version_policy": policy} if policy else {})}
        repository.write_config(tmp_path / name, cfg)
        for v, complete in versions.items():
            (tmp_path / name / str(v)).mkdir()
            (tmp_path / name / str(v) / "model.onnx").write_bytes(b"x")
            if complete:
                (tmp_path / name / str(v) / "manifest.json").write_text("{}")
        return tmp_path / name

    latest = model("raw", None, {1: True, 2: True, 3: False})
    every = model("bls_target", {"all": {}}, {1: True, 2: True, 3: False})
    two = model("two", {"latest": {"num_versions": 2}}, {1: True, 2: True, 3: True, 4: False})
    by_hand = model("by_hand", {"latest": {"num_versions": 1}}, {1: False, 2: False})
    assert pin_complete_versions(tmp_path) == ["bls_target", "raw", "two"]

    def policy(d: Path) -> dict:
        return repository.read_config(d)["version_policy"]

    assert policy(latest) == {"specific": {"versions": ["2"]}}
    assert policy(every) == {"specific": {"versions": ["1", "2"]}}
    assert policy(two) == {"specific": {"versions": ["2", "3"]}}
    assert policy(by_hand) == {"latest": {"num_versions": 1}}
    assert json.loads((latest / POLICY_FILE).read_text()) == {"latest": {"num_versions": 1}}
    assert "parameters" not in repository.read_config(latest)  # the guards refuse unknown parameters
    assert pin_complete_versions(tmp_path) == []  # nothing changed: nothing rewritten
    # v3's manifest lands (the upload finished): the next publish names it, by the kept policy
    (latest / "3" / "manifest.json").write_text("{}")
    (every / "3" / "manifest.json").write_text("{}")
    assert pin_complete_versions(tmp_path) == ["bls_target", "raw"]
    assert policy(latest) == {"specific": {"versions": ["3"]}}
    assert policy(every) == {"specific": {"versions": ["1", "2", "3"]}}


def test_a_publish_over_another_writers_objects_is_refused_and_nothing_goes_up(aws_env, tmp_path, monkeypatch):
    """Two exporters export "v2" of the same model from copies of the same store: the second to
    publish finds the other's v2 there and publishes nothing (it would have overwritten it). A
    change to objects it does not touch is no conflict."""
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "home"))
    s3 = aws_env.client()
    bucket = aws_env.bucket("conflicts")
    _seed(s3, bucket)
    spec = f"s3://{bucket}/repo"
    with pytest.raises(RemoteRepositoryError, match="changed while this command ran: digits_raw/2/model.onnx"), \
            working_copy(spec) as local:
        v2 = local / "digits_raw" / "2"
        v2.mkdir()
        (v2 / "model.onnx").write_bytes(b"mine")
        (v2 / "manifest.json").write_text('{"name": "digits_raw", "version": 2}')
        s3.put_object(Bucket=bucket, Key="repo/digits_raw/2/model.onnx", Body=b"theirs")  # the other exporter
    assert s3.get_object(Bucket=bucket, Key="repo/digits_raw/2/model.onnx")["Body"].read() == b"theirs"
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="repo/")["Contents"]}
    assert "repo/digits_raw/2/manifest.json" not in keys  # nothing of this command went up

    with working_copy(spec) as local:  # a fresh copy: the other's v2 is in it
        assert (local / "digits_raw" / "2" / "model.onnx").read_bytes() == b"theirs"
        (local / "digits" / "config.pbtxt").write_text('name: "digits"\nbackend: "guard"\n# edited\n')
        s3.put_object(Bucket=bucket, Key="repo/other/config.pbtxt", Body=b'name: "other"\n')
    body = s3.get_object(Bucket=bucket, Key="repo/digits/config.pbtxt")["Body"].read()
    assert b"# edited" in body


def test_publishers_take_turns_through_redis(aws_env, tmp_path, monkeypatch, redis_server):
    """With a Redis state store a publish holds ``tritonguard:publish:<store>`` while it checks and
    uploads; one that cannot get it in time publishes nothing and says who holds it."""
    s3, bucket, spec, client, key = _locked_store(aws_env, tmp_path, monkeypatch, redis_server, "turns", WAIT=0.5)
    client.set(key, "someone else", px=60_000)
    with pytest.raises(RemoteRepositoryError, match="another exporter has been publishing"), \
            working_copy(spec) as local:
        (local / "digits" / "config.pbtxt").write_text('name: "digits"\nbackend: "guard"\n# mine\n')
    assert b"# mine" not in s3.get_object(Bucket=bucket, Key="repo/digits/config.pbtxt")["Body"].read()
    client.delete(key)
    with working_copy(spec) as local:
        (local / "digits" / "config.pbtxt").write_text('name: "digits"\nbackend: "guard"\n# mine\n')
    assert b"# mine" in s3.get_object(Bucket=bucket, Key="repo/digits/config.pbtxt")["Body"].read()
    assert client.get(key) is None  # released


def test_commands_on_the_rollout_state_need_redis_with_an_object_store(aws_env, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TRITONGUARD_STATE_URL", raising=False)
    bucket = aws_env.bucket("needs-state")
    with pytest.raises(RemoteRepositoryError, match="TRITONGUARD_STATE_URL"), \
            working_copy(f"s3://{bucket}/repo", needs_state=True):
        pass
    # the CLI: one line, exit 2, repository from $TRITONGUARD_REPOSITORY
    monkeypatch.setenv("TRITONGUARD_REPOSITORY", f"s3://{bucket}/repo")
    res = CliRunner().invoke(app, ["route", "digits"])
    assert res.exit_code == 2, res.output
    assert "set TRITONGUARD_STATE_URL=redis://" in res.output
    # a missing bucket: one line naming it, exit 2
    res = CliRunner().invoke(app, ["upgrade", "-r", "s3://no-such-bucket/repo"])
    assert res.exit_code == 2 and "NoSuchBucket" in res.output and "Traceback" not in res.output
    # an endpoint nobody listens on: one line naming it and the cause, exit 2
    res = CliRunner().invoke(app, ["upgrade", "-r", "s3://http://127.0.0.1:1/b/repo"])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert len(lines) == 1 and "127.0.0.1:1" in lines[0] and "Could not connect" in lines[0], res.output


def test_route_on_an_object_store_repository_with_redis_state(aws_env, tmp_path, monkeypatch, redis_server):
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRITONGUARD_STATE_URL", redis_server.url)
    s3 = aws_env.client()
    bucket = aws_env.bucket("route-redis")
    _seed(s3, bucket)
    res = CliRunner().invoke(app, ["route", "digits", "-r", f"s3://http://127.0.0.1:{aws_env.port}/{bucket}/repo",
                                   "--json"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["route", "digits", "-r", f"s3://{bucket}/repo", "--primary", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["primary"]["version"] == 1
    # the state went to Redis, not into the store
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="repo/")["Contents"]}
    assert not any("rollout_state" in k for k in keys)


def _slow_uploads(monkeypatch, seconds: float, during=None) -> list[str]:
    """Every upload takes ``seconds`` (a large artifact on a slow link); ``during(rel)`` runs in it."""
    from tritonguard.core import objectstore

    real, done = objectstore.upload, []

    def upload(spec, src, rel, s3=None):
        import time

        time.sleep(seconds)
        if during is not None:
            during(rel)
        real(spec, src, rel, s3=s3)
        done.append(rel)

    monkeypatch.setattr(objectstore, "upload", upload)
    return done


def _new_version(local: Path, n: int = 3) -> None:
    v2 = local / "digits_raw" / "2"
    v2.mkdir()
    for i in range(n):
        (v2 / f"part{i}.bin").write_bytes(b"x" * i)
    (v2 / "manifest.json").write_text('{"name": "digits_raw", "version": 2}')
    (local / "digits_raw" / "config.pbtxt").write_text('name: "digits_raw"\nbackend: "runtime"\n# mine\n')


def test_a_publish_whose_lock_lapsed_stops_before_the_configs(aws_env, tmp_path, monkeypatch, redis_server):
    """The lease lapses mid-publish (renewal stalled past it) and another exporter takes the lock
    and publishes its config: this publish refuses before its own configs, so the other's config
    stays, and says why (issue 39 item 4)."""
    # a renewal that never comes in time
    s3, bucket, spec, client, key = _locked_store(aws_env, tmp_path, monkeypatch, redis_server, "lapsed-lease",
                                                  LOCK=0.4, RENEW=30.0)
    theirs = b'name: "digits_raw"\nbackend: "runtime"\n# theirs\n'

    def other_exporter(rel: str) -> None:  # once our lease has lapsed, the other one publishes
        if rel.endswith("part0.bin") and client.set(key, "other exporter", nx=True, px=60_000):
            s3.put_object(Bucket=bucket, Key="repo/digits_raw/config.pbtxt", Body=theirs)

    done = _slow_uploads(monkeypatch, 0.6, during=other_exporter)  # one upload outlasts the lease
    with pytest.raises(RemoteRepositoryError, match="publish lock .* lapsed while publishing.*no config overwritten"), \
            working_copy(spec) as local:
        _new_version(local)
    assert s3.get_object(Bucket=bucket, Key="repo/digits_raw/config.pbtxt")["Body"].read() == theirs
    assert not any(rel.endswith("config.pbtxt") for rel in done), done
    assert client.get(key) == b"other exporter"  # ours was not released over theirs


def test_a_slow_publish_keeps_its_lock_by_renewing_it(aws_env, tmp_path, monkeypatch, redis_server):
    """A publish that takes several leases long keeps the lock (renewed in the background):
    another exporter cannot take it meanwhile, and every file goes up."""
    s3, bucket, spec, client, key = _locked_store(aws_env, tmp_path, monkeypatch, redis_server, "renewed-lease",
                                                  LOCK=0.5, RENEW=0.1)
    taken = []
    done = _slow_uploads(monkeypatch, 0.3, during=lambda rel: taken.append(client.set(key, "other", nx=True, px=60_000)))
    with working_copy(spec) as local:
        _new_version(local)
    assert len(done) >= 6 and done[-1] == "digits_raw/config.pbtxt"  # well over the lease in all
    assert taken and not any(taken)
    assert b"versions: 2" in s3.get_object(Bucket=bucket, Key="repo/digits_raw/config.pbtxt")["Body"].read()
    assert client.get(key) is None  # released


def test_what_a_command_published_is_not_downloaded_again(aws_env, tmp_path, monkeypatch):
    """After a publish, the copy's ETag index knows the objects it uploaded: the next command on
    an unchanged store downloads nothing; an object another writer replaced is fetched (issue 39
    item 11). One file is large enough for a multipart upload (its ETag is not its MD5)."""
    from exporter.records import remote
    from tritonguard.core import objectstore

    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "home"))
    s3 = aws_env.client()
    bucket = aws_env.bucket("no-second-download")
    _seed(s3, bucket)
    spec = f"s3://{bucket}/repo"
    real, fetched = objectstore.download, []

    def download(spec_, rel, dest, s3=None, **kwargs):
        fetched.append(rel)
        return real(spec_, rel, dest, s3=s3, **kwargs)

    monkeypatch.setattr(objectstore, "download", download)
    with working_copy(spec) as local:
        _new_version(local)
        (local / "digits_raw" / "2" / "big.bin").write_bytes(os.urandom(remote.MULTIPART_THRESHOLD + 1024))
    head = s3.head_object(Bucket=bucket, Key="repo/digits_raw/2/big.bin")
    assert head["ETag"].strip('"').endswith("-2")  # went up in parts
    fetched.clear()
    with working_copy(spec) as local:
        assert (local / "digits_raw" / "2" / "big.bin").stat().st_size == remote.MULTIPART_THRESHOLD + 1024
    assert fetched == []
    s3.put_object(Bucket=bucket, Key="repo/digits_raw/2/part1.bin", Body=b"another writer's")
    with working_copy(spec) as local:
        assert (local / "digits_raw" / "2" / "part1.bin").read_bytes() == b"another writer's"
    assert fetched == ["digits_raw/2/part1.bin"]

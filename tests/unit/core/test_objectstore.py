"""tritonguard.core.objectstore: repository specs, the publish order, and the guard's cache of an
object-store repository. The store is moto's S3 server (an S3 stand-in, a real HTTP server in a
subprocess; tests/conftest.py ``moto_s3``), reached through boto3 as in production."""

from __future__ import annotations

import hashlib
import json
import logging
import os

import pytest

from tritonguard.core import objectstore
from tritonguard.core.objectstore import (
    ObjectStoreError,
    RepositoryCache,
    StoreSpec,
    is_object_store,
    parse,
)
from tritonguard.core.repository import complete_versions


def test_specs_are_parsed_in_both_forms():
    env = {}
    assert parse("s3://models/repo", env) == StoreSpec("models", "repo", None)
    assert parse("s3://models", env) == StoreSpec("models", "", None)
    assert parse("s3://models/a/b/", env) == StoreSpec("models", "a/b", None)
    # Triton's form: the endpoint inside the URL
    assert parse("s3://http://127.0.0.1:9000/models/repo", env) == StoreSpec("models", "repo", "http://127.0.0.1:9000")
    assert parse("s3://https://s3.example.com/b/p/q", env) == StoreSpec("b", "p/q", "https://s3.example.com")
    assert parse("s3://127.0.0.1:9000/models/repo", env) == StoreSpec("models", "repo", "http://127.0.0.1:9000")
    # the plain form takes the endpoint from AWS_ENDPOINT_URL; one in the URL wins
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:5000/"}
    assert parse("s3://models/repo", env).endpoint == "http://127.0.0.1:5000"
    assert parse("s3://http://10.0.0.1:1/b/p", env).endpoint == "http://10.0.0.1:1"
    spec = parse("s3://http://127.0.0.1:9000/models/repo", {})
    assert spec.url == "s3://http://127.0.0.1:9000/models/repo" and spec.key("digits/1/m") == "repo/digits/1/m"
    assert spec.rel("repo/digits/config.pbtxt") == "digits/config.pbtxt"
    assert is_object_store("s3://b/p") and not is_object_store("/srv/models") and not is_object_store(None)
    for bad in ("s3://", "s3://http:///b", "/local/path"):
        with pytest.raises(ObjectStoreError):
            parse(bad, {})


def test_publish_order_files_then_manifests_then_configs_guards_last(tmp_path):
    (tmp_path / "digits").mkdir()
    (tmp_path / "digits" / "config.pbtxt").write_text('name: "digits"\nbackend: "guard"\n')
    (tmp_path / "digits_raw").mkdir()
    (tmp_path / "digits_raw" / "config.pbtxt").write_text('name: "digits_raw"\nbackend: "runtime"\n')
    rels = ["digits/config.pbtxt", "digits/1/manifest.json", "digits_raw/config.pbtxt",
            "digits_raw/2/manifest.json", "digits_raw/2/model.onnx", "digits_raw/2/goldens.npz"]
    assert objectstore.publish_order(rels, tmp_path) == [
        "digits_raw/2/goldens.npz", "digits_raw/2/model.onnx",
        "digits/1/manifest.json", "digits_raw/2/manifest.json",
        "digits_raw/config.pbtxt", "digits/config.pbtxt"]
    assert objectstore.delete_order(["m/1/model.onnx", "m/1/manifest.json", "m/config.pbtxt"]) == [
        "m/config.pbtxt", "m/1/manifest.json", "m/1/model.onnx"]


def _put(s3, bucket, key, body: bytes):
    s3.put_object(Bucket=bucket, Key=key, Body=body)


def test_the_guard_cache_takes_complete_versions_and_checks_their_sha256(aws_env, tmp_path, caplog):
    s3 = aws_env.client()
    bucket = aws_env.bucket("cache-test")
    art = b"onnx bytes"
    _put(s3, bucket, "repo/t/config.pbtxt", b'name: "t"\n')
    _put(s3, bucket, "repo/t/1/model.onnx", art)
    _put(s3, bucket, "repo/t/1/manifest.json",
         json.dumps({"artifact": "model.onnx", "sha256": hashlib.sha256(art).hexdigest()}).encode())
    _put(s3, bucket, "repo/t/2/model.onnx", b"half uploaded")  # no manifest yet
    cache = RepositoryCache(f"s3://{bucket}/repo", cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="tritonguard.core.objectstore"):
        model_dir = cache.sync("t")
    assert (model_dir / "1" / "model.onnx").read_bytes() == art
    assert not (model_dir / "2").exists()
    assert "t version 2 has no manifest.json" in caplog.text
    # the manifest arrives: the next sync takes v2; unchanged files are not fetched again
    _put(s3, bucket, "repo/t/2/manifest.json", json.dumps({"artifact": "model.onnx", "sha256": "0" * 64}).encode())
    with pytest.raises(ObjectStoreError, match="does not match the sha256"):
        cache.sync("t")
    assert not (model_dir / "2" / "model.onnx").exists()  # the bad artifact is not left for a guard to load


def test_an_unreachable_store_and_a_missing_bucket_are_one_line(aws_env, tmp_path):
    with pytest.raises(ObjectStoreError, match="NoSuchBucket") as exc:
        RepositoryCache("s3://no-such-bucket/repo", cache_dir=tmp_path).sync("t")
    assert "\n" not in str(exc.value)
    with pytest.raises(ObjectStoreError, match="Could not connect") as exc:
        RepositoryCache("s3://http://127.0.0.1:1/b/repo", cache_dir=tmp_path).sync("t")
    assert "\n" not in str(exc.value)


def _publish_version(s3, bucket, model, version, art: bytes, *, sha: str | None = None, extra: dict | None = None):
    """A version as the exporter publishes it: its files, then its manifest."""
    for name, body in {"model.onnx": art, **(extra or {})}.items():
        _put(s3, bucket, f"repo/{model}/{version}/{name}", body)
    doc = {"artifact": "model.onnx", "sha256": sha or hashlib.sha256(art).hexdigest()}
    _put(s3, bucket, f"repo/{model}/{version}/manifest.json", json.dumps(doc).encode())


def test_a_version_lands_whole_and_checked_its_manifest_last(aws_env, tmp_path, monkeypatch):
    """Issue 39 item 2: a reader counts a version once its manifest is in the cache, so at no
    moment may the manifest be there without its artifact and the version's other files (the
    listing's order put manifest.json before model.onnx: a guard loaded a version mid-download)."""
    s3 = aws_env.client()
    bucket = aws_env.bucket("order-test")
    _put(s3, bucket, "repo/t/config.pbtxt", b'name: "t"\n')
    _publish_version(s3, bucket, "t", 1, b"artifact one" * 1000, extra={"goldens.npz": b"g1", "a_first.json": b"{}"})
    cache = RepositoryCache(f"s3://{bucket}/repo", cache_dir=tmp_path / "cache")
    renames: list[str] = []
    real_replace = objectstore.os.replace

    def watching_replace(src, dst):
        real_replace(src, dst)
        renames.append(str(dst))
        vdir = tmp_path / "cache" / "t" / "1"
        if (vdir / "manifest.json").exists():  # the version counts from here on: it must be whole
            assert (vdir / "model.onnx").read_bytes() == b"artifact one" * 1000
            assert (vdir / "goldens.npz").exists() and (vdir / "a_first.json").exists()

    monkeypatch.setattr(objectstore.os, "replace", watching_replace)
    cache.sync("t")
    in_version = [r for r in renames if r.startswith(str(tmp_path / "cache" / "t" / "1"))]
    assert in_version[-1].endswith("/t/1/manifest.json") and len(in_version) == 4
    # nothing of the download is left beside the files
    assert sorted(p.name for p in (tmp_path / "cache" / "t" / "1").iterdir()) == [
        "a_first.json", "goldens.npz", "manifest.json", "model.onnx"]


def test_a_version_failing_its_checksum_is_not_cached_and_the_others_are(aws_env, tmp_path):
    s3 = aws_env.client()
    bucket = aws_env.bucket("verify-test")
    _put(s3, bucket, "repo/t/config.pbtxt", b'name: "t"\n')
    _publish_version(s3, bucket, "t", 1, b"good")
    _publish_version(s3, bucket, "t", 2, b"tampered", sha="0" * 64)
    _publish_version(s3, bucket, "t", 3, b"also good")
    cache = RepositoryCache(f"s3://{bucket}/repo", cache_dir=tmp_path / "cache")
    with pytest.raises(ObjectStoreError, match="t v2: model.onnx does not match the sha256"):
        cache.sync("t")
    t = tmp_path / "cache" / "t"
    assert (t / "1" / "model.onnx").read_bytes() == b"good" and (t / "3" / "model.onnx").read_bytes() == b"also good"
    assert not (t / "2").exists()  # neither its manifest nor the bad bytes: a reader never counts it
    assert complete_versions(t) == [1, 3]
    # the store is fixed: the next sync takes v2
    _publish_version(s3, bucket, "t", 2, b"fixed")
    cache.sync("t")
    assert complete_versions(t) == [1, 2, 3] and (t / "2" / "model.onnx").read_bytes() == b"fixed"


def test_unchanged_versions_are_neither_fetched_nor_hashed_again(aws_env, tmp_path, monkeypatch):
    """A sync on every new state revision must not re-hash every cached artifact (gigabytes)."""
    s3 = aws_env.client()
    bucket = aws_env.bucket("fresh-test")
    _put(s3, bucket, "repo/t/config.pbtxt", b'name: "t"\n')
    _publish_version(s3, bucket, "t", 1, b"one")
    cache = RepositoryCache(f"s3://{bucket}/repo", cache_dir=tmp_path / "cache")
    cache.sync("t")
    hashed: list[str] = []
    fetched: list[str] = []
    real_digest, real_download = objectstore.file_digest, objectstore.download
    monkeypatch.setattr(objectstore, "file_digest", lambda p, *a: hashed.append(str(p)) or real_digest(p, *a))
    monkeypatch.setattr(objectstore, "download",
                        lambda spec, rel, dest, **kw: fetched.append(rel) or real_download(spec, rel, dest, **kw))
    cache.sync("t")
    assert hashed == [] and fetched == []
    _publish_version(s3, bucket, "t", 2, b"two")
    cache.sync("t")
    assert sorted(fetched) == ["t/2/manifest.json", "t/2/model.onnx"] and len(hashed) == 1


def test_a_version_gone_from_the_store_is_dropped_unless_still_routed(aws_env, tmp_path):
    """Issue 39 item 11: the cache followed additions only; a version deleted from the store
    (manifest first: exporter delete_order) stayed in every guard's cache for good."""
    s3 = aws_env.client()
    bucket = aws_env.bucket("drop-test")
    _put(s3, bucket, "repo/t/config.pbtxt", b'name: "t"\n')
    for v in (1, 2, 3):
        _publish_version(s3, bucket, "t", v, f"v{v}".encode())
    cache = RepositoryCache(f"s3://{bucket}/repo", cache_dir=tmp_path / "cache")
    t = cache.sync("t")
    assert sorted(p.name for p in t.iterdir() if p.is_dir()) == ["1", "2", "3"]
    for key in ("repo/t/1/manifest.json", "repo/t/1/model.onnx", "repo/t/2/manifest.json", "repo/t/2/model.onnx"):
        s3.delete_object(Bucket=bucket, Key=key)
    cache.sync("t", keep=[2])  # v2 is still named by the rollout state: kept until it is not
    assert sorted(p.name for p in t.iterdir() if p.is_dir()) == ["2", "3"]
    cache.sync("t")
    assert sorted(p.name for p in t.iterdir() if p.is_dir()) == ["3"]
    # a listing without the model's config (a wrong prefix, a model being deleted) drops nothing
    s3.delete_object(Bucket=bucket, Key="repo/t/config.pbtxt")
    for key in ("repo/t/3/manifest.json", "repo/t/3/model.onnx"):
        s3.delete_object(Bucket=bucket, Key=key)
    cache.sync("t")
    assert (t / "3" / "model.onnx").read_bytes() == b"v3"


def test_large_files_come_through_a_child_process_checked_like_the_others(aws_env, tmp_path, monkeypatch):
    """Issue 39 item 2: a guard's cache downloads files of ``child_min_bytes`` or more in a child
    Python process (its serving thread keeps the GIL), small ones on the calling thread; the
    artifact is checked against its manifest either way, and a child's failure is one line."""
    s3 = aws_env.client()
    bucket = aws_env.bucket("child-test")
    _put(s3, bucket, "repo/t/config.pbtxt", b'name: "t"\n')
    big = os.urandom(64 << 10)
    _publish_version(s3, bucket, "t", 1, big, extra={"goldens.npz": b"g1"})
    in_child: list[str] = []
    real = objectstore.download_in_child

    def counting(spec, rel, dest, timeout=None):
        in_child.append(rel)
        return real(spec, rel, dest, timeout)

    monkeypatch.setattr(objectstore, "download_in_child", counting)
    cache = RepositoryCache(f"s3://{bucket}/repo", cache_dir=tmp_path / "cache", child_min_bytes=32 << 10)
    model_dir = cache.sync("t")
    assert in_child == ["t/1/model.onnx"]  # only the large file; the small ones stayed in process
    assert (model_dir / "1" / "model.onnx").read_bytes() == big
    # a tampered large artifact fetched by the child still fails its checksum and is not cached
    _publish_version(s3, bucket, "t", 2, os.urandom(64 << 10), sha="0" * 64)
    with pytest.raises(ObjectStoreError, match="does not match the sha256"):
        cache.sync("t")
    assert not (model_dir / "2").exists()
    # the child cannot reach the store: one line naming the store, no traceback
    spec = objectstore.parse(f"s3://http://127.0.0.1:1/{bucket}/repo")
    with pytest.raises(ObjectStoreError, match="Could not connect") as exc:
        objectstore.download_in_child(spec, "t/1/model.onnx", tmp_path / "x" / "model.onnx")
    assert "\n" not in str(exc.value) and "Traceback" not in str(exc.value)
    assert not (tmp_path / "x" / "model.onnx").exists()

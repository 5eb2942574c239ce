"""tritonguard.core.objectstore: repository specs, the publish order, and the guard's cache of an
object-store repository. The store is moto's S3 server (an S3 stand-in, a real HTTP server in a
subprocess; tests/conftest.py ``moto_s3``), reached through boto3 as in production."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from tritonguard.core import objectstore
from tritonguard.core.objectstore import (
    ObjectStoreError,
    RepositoryCache,
    StoreSpec,
    is_object_store,
    parse,
)


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

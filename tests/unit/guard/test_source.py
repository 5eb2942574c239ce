"""tritonguard.guard.source: where a guard finds its repository, and versions without a manifest."""

from __future__ import annotations

import hashlib
import json
import logging
import threading

import pytest

from tritonguard.core import objectstore, repository
from tritonguard.core.errors import ConfigError, TargetError
from tritonguard.guard import source


def test_a_temporary_copy_is_never_taken_for_the_repository(tmp_path):
    # Triton's copy of a model from S3: /tmp/folderXXXXXX, whose parent is the shared /tmp
    with pytest.raises(ConfigError, match="temporary copy.*TRITONGUARD_REPOSITORY"):
        source.resolve("digits", tmp_path / "folderYXHB4u", {})
    # a repository folder (named after the model): its parent
    assert source.resolve("digits", tmp_path / "repo" / "digits", {}).root == tmp_path / "repo"
    # named explicitly
    assert source.resolve("digits", tmp_path / "folderYXHB4u", {"TRITONGUARD_REPOSITORY": "/srv/models"}).root \
        == __import__("pathlib").Path("/srv/models")


def test_an_object_store_repository_needs_redis_and_is_cached_under_home(tmp_path):
    env = {"TRITONGUARD_REPOSITORY": "s3://http://127.0.0.1:9/b/repo", "TRITONGUARD_HOME": str(tmp_path)}
    with pytest.raises(ConfigError, match="set TRITONGUARD_STATE_URL"):
        source.resolve("digits", tmp_path / "folderX", env)
    src = source.resolve("digits", tmp_path / "folderX", {**env, "TRITONGUARD_STATE_URL": "redis://x:1/0"})
    assert src.remote and src.root.is_relative_to(tmp_path / "cache" / "objstore")


def test_a_version_without_manifest_is_ignored_and_refused(tmp_path, caplog):
    t = tmp_path / "t"
    for v in (1, 2, 3):
        (t / str(v)).mkdir(parents=True)
        (t / str(v) / "model.onnx").write_bytes(b"x")
    (t / "config.pbtxt").write_text('name: "t"\n')
    repository.write_placeholder(t / "1", "t")
    (t / "2" / "manifest.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="tritonguard.core.repository"):
        assert repository.complete_versions(t) == [1, 2]
        assert repository.complete_versions(t) == [1, 2]
    assert caplog.text.count("t version 3 has no manifest.json") == 1  # logged once
    assert repository.versions(t) == [1, 2, 3]  # the exporter still counts it (never reuses 3)
    source.check_complete(tmp_path, "t", 2)
    with pytest.raises(TargetError, match="version 3 of 't' has no manifest"):
        source.check_complete(tmp_path, "t", 3)
    source.check_complete(tmp_path, "elsewhere", 3)  # a target outside this repository: Triton's business


def test_a_model_placed_by_hand_serves_all_its_versions(tmp_path):
    """No version has a manifest: the model was never exported (an echo model, a user's own);
    the guard serves it as Triton does, and still refuses nothing of it."""
    h = tmp_path / "h"
    for v in (1, 2):
        (h / str(v)).mkdir(parents=True)
    (h / "config.pbtxt").write_text('name: "h"\n')
    assert repository.complete_versions(h) == [1, 2]
    source.check_complete(tmp_path, "h", 2)
    (h / "3").mkdir()
    repository.write_placeholder(h / "3", "h")  # once one version is exported, the rule holds
    assert repository.complete_versions(h) == [3]
    with pytest.raises(TargetError):
        source.check_complete(tmp_path, "h", 2)


def test_the_router_view_counts_only_complete_versions(tmp_path):
    from tritonguard.guard.routing.view import RolloutView
    from tritonguard.rollout.stores import open_store

    t = tmp_path / "t"
    for v in (1, 2):
        (t / str(v)).mkdir(parents=True)
    (t / "1" / "manifest.json").write_text("{}")
    view = RolloutView(guard="g", repo=tmp_path, target="t", store=open_store("g", tmp_path, url=""),
                       poll_interval_s=0, metrics=None)
    assert view.versions_on_disk() == [1] and view.primary() == 1  # v2, half uploaded, is not the latest


def test_a_version_is_fetched_off_the_calling_thread_and_present_only_once_checked_and_prepared(aws_env, tmp_path):
    """Issue 39 item 2: the guard's hook ran the store download on whichever thread read the new
    rollout state, execute()'s included. Now it goes to the process's one fetcher thread, and a
    version is present (routable) only after it is in the cache whole and checked and the
    guard prepared it (an in-process guard loads it there)."""
    s3 = aws_env.client()
    bucket = aws_env.bucket("source-test")

    def publish(v: int, art: bytes) -> None:
        s3.put_object(Bucket=bucket, Key=f"repo/t/{v}/model.onnx", Body=art)
        s3.put_object(Bucket=bucket, Key=f"repo/t/{v}/manifest.json",
                      Body=json.dumps({"artifact": "model.onnx", "sha256": hashlib.sha256(art).hexdigest()}).encode())

    s3.put_object(Bucket=bucket, Key="repo/t/config.pbtxt", Body=b'name: "t"\n')
    publish(1, b"one")
    cache = objectstore.RepositoryCache(f"s3://{bucket}/repo", cache_dir=tmp_path / "cache")
    src = source.RepositorySource(cache.root, cache)
    src.fetch("t")
    assert src.present("t", 1) and not src.present("t", 2)
    assert src.present("elsewhere", 7)  # a target the store does not hold: Triton's, nothing to fetch
    publish(2, b"two")
    seen: list[tuple] = []
    release = threading.Event()

    def prepare(versions):
        seen.append((versions, threading.current_thread().name, src.present("t", 2),
                     (cache.root / "t" / "2" / "model.onnx").read_bytes()))
        release.wait(10)

    caller = threading.current_thread().name
    assert src.fetch_later("t", prepare=prepare) is True
    for _ in range(500):  # bounded: up to 10 s for the fetcher to reach prepare()
        if seen:
            break
        release.wait(0.02)
    assert seen == [([2], "tritonguard-fetch", False, b"two")] and caller != "tritonguard-fetch"
    assert not src.present("t", 2)  # in the cache, checked, not prepared yet: not routed to
    assert src.fetch_later("t") is False  # one fetch of a model at a time: a second is refused
    release.set()
    assert src.idle(10)
    assert src.present("t", 2)
    src.close()
    # a local repository: everything is present, nothing is ever fetched
    local = source.RepositorySource(tmp_path / "local")
    assert local.present("t", 9) and local.fetch_later("t") is False


def test_a_fetch_that_fails_leaves_the_version_absent_and_the_thread_alive(aws_env, tmp_path, caplog):
    s3 = aws_env.client()
    bucket = aws_env.bucket("source-fail")
    s3.put_object(Bucket=bucket, Key="repo/t/config.pbtxt", Body=b'name: "t"\n')
    s3.put_object(Bucket=bucket, Key="repo/t/1/model.onnx", Body=b"one")
    s3.put_object(Bucket=bucket, Key="repo/t/1/manifest.json",
                  Body=json.dumps({"artifact": "model.onnx", "sha256": "0" * 64}).encode())
    cache = objectstore.RepositoryCache(f"s3://{bucket}/repo", cache_dir=tmp_path / "cache")
    src = source.RepositorySource(cache.root, cache)
    done: list[str] = []
    with caplog.at_level(logging.WARNING):
        assert src.fetch_later("t", done=done.append)
        assert src.idle(10)
    assert done == ["t"] and not src.present("t", 1)
    assert "does not match the sha256" in caplog.text
    s3.put_object(Bucket=bucket, Key="repo/t/1/manifest.json",
                  Body=json.dumps({"artifact": "model.onnx", "sha256": hashlib.sha256(b"one").hexdigest()}).encode())
    assert src.fetch_later("t") and src.idle(10) and src.present("t", 1)
    src.close()


def test_a_stream_guard_fed_from_a_store_fetches_a_url_version_the_state_names(aws_env, tmp_path):
    """A version served at a URL is declared in the target's endpoints.json, which `exporter
    endpoint` publishes to the store. A stream guard fed from the store loaded with the copy of
    its start: the version the rollout state named after it was, at most, routed to by a
    declaration it never saw. Now the guard's rollout poll finds the named version missing and
    fetches the target in the background; the version is present (routable) once the new
    endpoints.json is here. Real S3 (moto), the real cache, rollout view and file store."""
    from types import SimpleNamespace

    from tritonguard.guard.routing.view import RolloutView
    from tritonguard.guard.stream.model import StreamGuardModel
    from tritonguard.guard.stream.openai_target import VersionTargets
    from tritonguard.rollout.endpoints import Endpoint, declare
    from tritonguard.rollout.state import Candidate
    from tritonguard.rollout.stores import open_store

    s3 = aws_env.client()
    bucket = aws_env.bucket("stream-source")
    art = b"weights"
    s3.put_object(Bucket=bucket, Key="repo/t/config.pbtxt", Body=b'name: "t"\n')
    s3.put_object(Bucket=bucket, Key="repo/t/1/model.onnx", Body=art)
    s3.put_object(Bucket=bucket, Key="repo/t/1/manifest.json",
                  Body=json.dumps({"artifact": "model.onnx", "sha256": hashlib.sha256(art).hexdigest()}).encode())
    cache = objectstore.RepositoryCache(f"s3://{bucket}/repo", cache_dir=tmp_path / "cache")
    src = source.RepositorySource(cache.root, cache)
    src.fetch("t")  # the guard's initialize()
    guard = SimpleNamespace(source=src, target="t",
                            remote=VersionTargets(cache.root / "t", guard="g", target="t", timeout_s=5))
    guard.remote.view.check_s = 0.0  # re-read at every look (the guard's: once a second)
    present = lambda v: StreamGuardModel._present(guard, v)  # noqa: E731 - the guard's own check
    assert present(1) and not present(3)

    # `exporter endpoint t 3 --url …` on the store: endpoints.json beside the config
    (tmp_path / "work").mkdir()
    declare(tmp_path / "work", Endpoint(3, "http://127.0.0.1:9/v1", model="m"))
    s3.put_object(Bucket=bucket, Key="repo/t/endpoints.json", Body=(tmp_path / "work" / "endpoints.json").read_bytes())
    store = open_store("g", tmp_path / "state", url="")
    view = RolloutView(guard="g", repo=cache.root, target="t", store=store, poll_interval_s=0, metrics=None)
    source.follow_rollout(src, view, "t", present, guard="g")
    store.update(lambda s: setattr(s, "candidate", Candidate(3, 0.5)), by="cli")
    assert not present(3)
    view.refresh(1.0, wait=True)  # the poll that reads the new state
    assert src.idle(10)
    assert present(3) and guard.remote.view.get(3).url == "http://127.0.0.1:9/v1"
    assert (cache.root / "t" / "endpoints.json").is_file()
    src.close()

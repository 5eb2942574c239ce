"""A guarded model served by a real tritonserver from an object store: the exported digits guard
and its target, published to moto's S3 server (an S3 stand-in in a subprocess, real HTTP; see
tests/conftest.py ``moto_s3``) by the exporter's publisher, served from
``--model-repository=s3://http://127.0.0.1:PORT/bucket/repo`` with the rollout state in Redis."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest

from exporter.records.history import StoreHistory
from exporter.records.remote import is_runtime, publish
from tritonguard.core import objectstore
from tritonguard.ops.server import Server

pytestmark = pytest.mark.functional


def _copy_models(src, dest, models):
    for m in models:
        shutil.copytree(src / m, dest / m, ignore=lambda d, names: [n for n in names if is_runtime(n)])


def test_the_digits_guard_serves_from_an_object_store(exported_repo, moto_s3, redis_server, tmp_path):
    bucket = moto_s3.bucket("fleet-models")
    url = f"s3://http://127.0.0.1:{moto_s3.port}/{bucket}/repo"
    local = tmp_path / "publish"
    _copy_models(exported_repo, local, ("digits", "digits_raw"))
    # a half-uploaded v2 of the target: its artifact, no manifest. With the exported "latest"
    # policy Triton would load it; the published config names v1 only, and the guard ignores v2
    shutil.copy(local / "digits_raw" / "1" / "model.onnx", (local / "digits_raw" / "2").mkdir() or
                local / "digits_raw" / "2" / "model.onnx")
    env = {**os.environ, **moto_s3.env, "AWS_ENDPOINT_URL": moto_s3.endpoint}
    spec = objectstore.parse(url, env)
    s3 = moto_s3.client()
    uploaded, _ = publish(spec, local, {}, s3=s3)
    assert uploaded[-1] == "digits/config.pbtxt" and "digits/1/manifest.json" in uploaded
    assert uploaded.index("digits_raw/1/model.onnx") < uploaded.index("digits_raw/1/manifest.json") \
        < uploaded.index("digits_raw/config.pbtxt")

    # the registry history sits beside the repository (issue 39 item 1): Triton must not see it
    StoreHistory(spec, tmp_path / "history.jsonl", s3=s3).append(
        {"type": "register", "model": "digits", "version": 1}, time.time)

    home = tmp_path / "home"
    server_env = {**env, "TRITONGUARD_STATE_URL": redis_server.url, "TRITONGUARD_HOME": str(home)}
    server_env.pop("TRITONGUARD_REPOSITORY", None)  # the launcher sets it from --model-repository
    srv = Server(repository=url, log_path=tmp_path / "tritonserver.log", env=server_env,
                 extra_args=["--model-control-mode=explicit", "--load-model=digits_raw", "--load-model=digits",
                             "--exit-timeout-secs=5"])
    srv.start(wait_models=("digits_raw", "digits"), timeout=150)
    try:
        import tritonclient.http as httpclient

        x = np.zeros((2, 8, 8), np.float32)
        with httpclient.InferenceServerClient(srv.http_url) as c:
            inp = httpclient.InferInput("IMAGE", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            r = c.infer("digits", [inp])
            assert r.as_numpy("PROBS").shape == (2, 10)
            assert c.is_model_ready("digits_raw", "1") and not c.is_model_ready("digits_raw", "2")
            assert {m["name"] for m in c.get_model_repository_index()} == {"digits", "digits_raw"}
            assert [s[0] for s in r.as_numpy("SERVED_BY").tolist()] == [b"digits_raw:1", b"digits_raw:1"]
            bad = httpclient.InferInput("IMAGE", list(x.shape), "FP32")
            bad.set_data_from_numpy(x + 99)
            with pytest.raises(Exception, match="violates range"):
                c.infer("digits", [bad])
        log = (tmp_path / "tritonserver.log").read_text(errors="replace")
        assert "digits_raw version 2 has no manifest.json" in log
        # the guard's files came from the store into its cache, under TRITONGUARD_HOME
        cached = home / "cache" / "objstore" / spec.cache_key / "digits_raw"
        assert (cached / "1" / "manifest.json").exists() and not (cached / "2").exists()
        # nothing the guard wrote went into the store, nor into the shared /tmp
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="repo/")["Contents"]}
        assert keys == {f"repo/{k}" for k in uploaded}
        assert not os.path.exists("/tmp/digits/rollout_state.json")
        # the rollout state is in Redis: primary v1, the latest version with a manifest
        from tritonguard.rollout.stores import open_store

        assert open_store("digits", tmp_path, url=redis_server.url).load().primary == 1
    finally:
        srv.stop()

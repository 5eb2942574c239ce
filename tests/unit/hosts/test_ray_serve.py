"""The guarded Ray Serve deployment on a real Ray (started in-process, once for the module) and
Ray Serve's HTTP proxy on a loopback port, serving the exported digits model from a repository
laid out as the exporter writes it (the guard ``digits`` fronting the versions of ``digits_raw``),
spoken to over HTTP (issue 44 item 2)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tritonguard.core.errors import ConfigError
from tritonguard.core.tensors import ModelSignature, TensorSpec
from tritonguard.ops.server import free_port
from tritonguard.rollout.state import Candidate
from tritonguard.rollout.stores import open_store

ROOT = Path(__file__).resolve().parents[3]
SOURCE = ROOT / "model_repository" / "digits_raw"
GUARD_SOURCE = ROOT / "model_repository" / "digits"
MODEL = "digits"  # the guard: its rollout state, its keys, the metrics' model label
TARGET = "digits_raw"  # its versions: served-by names them
PREFIX = "/digits"

pytestmark = pytest.mark.skipif(not (SOURCE / "1" / "model.onnx").is_file(),
                                reason="the example models are exported by `make models`")


def broken_candidate(inputs):
    """A candidate version that fails every call."""
    raise RuntimeError("candidate down")


EMAIL = "jane.doe@example.com"


def echo(inputs):
    """A text model of the user's own (no repository): says what it was sent, and an e-mail."""
    return {"TEXT": np.array([[b"seen: " + x + f" from {EMAIL}".encode()] for x in inputs["TEXT"][:, 0]], dtype=object)}


def images(n: int = 6) -> np.ndarray:
    from sklearn.datasets import load_digits  # noqa: PLC0415

    return load_digits().images[:n].astype(np.float32)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The exported guard's config.pbtxt, digits_raw v1 and v2 (the same export, copied as the
    exporter lays a version out) and v3, a candidate that raises, behind the guard in one Ray
    Serve application; the guard's rollout state written first with v1 as primary."""
    ray = pytest.importorskip("ray")
    from ray import serve  # noqa: PLC0415

    from tritonguard.hosts.ray_serve import guarded  # noqa: PLC0415

    repo = tmp_path_factory.mktemp("ray_repo")
    (repo / MODEL).mkdir()
    shutil.copy(GUARD_SOURCE / "config.pbtxt", repo / MODEL / "config.pbtxt")
    (repo / TARGET).mkdir()
    shutil.copy(SOURCE / "config.pbtxt", repo / TARGET / "config.pbtxt")
    for v in (1, 2):
        (repo / TARGET / str(v)).mkdir()
        for name in ("model.onnx", "manifest.json"):
            shutil.copy(SOURCE / "1" / name, repo / TARGET / str(v) / name)
    store = open_store(MODEL, repo)

    def primary_v1(st):
        st.primary = 1
        return st

    store.update(primary_v1, by="test")
    audit = repo / "audit.jsonl"
    # validation.range.IMAGE (0,16) comes from the guard's own config.pbtxt
    config = {"routing.poll_interval_s": 0, "breaker.min_requests": 4, "audit.path": str(audit)}
    port = free_port()
    # the workers import this module (v3 is one of its functions) from the checkout: they inherit
    # the raylet's environment (a runtime_env with env_vars doubled the start-up here)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", path)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = guarded(MODEL, repository=repo, config=config, versions={3: broken_candidate})
        serve.run(app, name=MODEL, route_prefix=PREFIX, blocking=False)
        text = TensorSpec("TEXT", np.dtype(object), (1,))
        serve.run(guarded("echo", versions={1: echo}, signature=ModelSignature((text,), (text,), 8),
                          config={"redaction.redact_outputs": True}), name="echo", route_prefix="/echo", blocking=False)
        yield {"port": port, "repo": repo, "store": store, "audit": audit}
    finally:
        serve.shutdown()
        ray.shutdown()


def infer(port: int, body: object, headers: dict[str, str] | None = None,
          prefix: str = PREFIX) -> tuple[int, dict[str, str], dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", f"{prefix}/infer", body=json.dumps(body).encode(),
                     headers={"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def v2_body(x: np.ndarray) -> dict:
    return {"inputs": [{"name": "IMAGE", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}


def probs(doc: dict) -> np.ndarray:
    (out,) = doc["outputs"]
    assert out["name"] == "PROBS" and out["datatype"] == "FP32"
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def metrics(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", f"{PREFIX}/metrics")
        r = conn.getresponse()
        assert r.status == 200
        return r.read().decode()
    finally:
        conn.close()


def route(store, version: int | None, share: float = 0.0) -> None:
    def fn(st):
        st.candidate = None if version is None else Candidate(version, share)
        return st

    store.update(fn, by="test")


def test_predictions_equal_onnxruntime_and_name_who_served(served):
    import onnxruntime as ort  # noqa: PLC0415

    x = images(6)
    want = ort.InferenceSession(str(SOURCE / "1" / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        ["PROBS"], {"IMAGE": x})[0]
    status, headers, doc = infer(served["port"], v2_body(x))
    assert status == 200, doc
    assert headers["x-tritonguard-served-by"] == f"{TARGET}:1" and doc["model_version"] == "1"
    np.testing.assert_allclose(probs(doc), want, rtol=0, atol=1e-6)
    assert probs(doc).argmax(axis=1).tolist() == want.argmax(axis=1).tolist()


def test_routing_follows_the_rollout_state_in_the_store(served):
    port, store = served["port"], served["store"]
    x = images(1)
    try:
        route(store, 2, 1.0)
        got = {infer(port, v2_body(x))[1]["x-tritonguard-served-by"] for _ in range(5)}
        assert got == {f"{TARGET}:2"}
        route(store, 2, 0.0)
        got = {infer(port, v2_body(x))[1]["x-tritonguard-served-by"] for _ in range(5)}
        assert got == {f"{TARGET}:1"}
    finally:
        route(store, None)
    text = metrics(port)
    assert f'tritonguard_served_total{{model="{MODEL}",served_by="{TARGET}:2"}} 5.0' in text
    assert f'tritonguard_route_share{{model="{MODEL}",role="primary",target_version="1"}} 1.0' in text


@pytest.mark.parametrize(("body", "rule"), [
    ({"inputs": [{"name": "IMAGE", "shape": [1, 8, 8], "datatype": "FP32", "data": [float("nan")] + [0.0] * 63}]},
     "finite"),
    ({"inputs": [{"name": "IMAGE", "shape": [1, 8, 8], "datatype": "FP32", "data": [99.0] * 64}]}, "range"),
    ({"inputs": [{"name": "IMAGE", "shape": [1, 4, 16], "datatype": "FP32", "data": [0.0] * 64}]}, "shape"),
    ({"inputs": [{"name": "IMAGE", "shape": [1, 8, 8], "datatype": "INT32", "data": [0] * 64}]}, "dtype"),
])
def test_a_bad_input_is_a_400_naming_the_input_and_rule(served, body, rule):
    status, headers, doc = infer(served["port"], body)
    assert status == 400, doc
    assert doc["rule"] == rule and "IMAGE" in doc["error"]


def test_a_failing_candidate_falls_back_to_the_primary_and_trips_its_breaker(served):
    port, store = served["port"], served["store"]
    x = images(2)
    try:
        route(store, 3, 1.0)
        answers = [infer(port, v2_body(x)) for _ in range(6)]
    finally:
        route(store, None)
    # no client error: every request answered by the primary, with its predictions
    assert [(s, h["x-tritonguard-served-by"]) for s, h, _ in answers] == [(200, f"{TARGET}:1")] * 6
    text = metrics(port)
    # the first 4 reached v3 and failed; the 4th filled the window (breaker.min_requests=4) and
    # tripped it, so the last 2 went to the primary without calling v3
    assert f'tritonguard_target_errors_total{{code="INTERNAL",model="{MODEL}",target_version="3"}} 4.0' in text
    assert f'tritonguard_fallbacks_total{{model="{MODEL}",reason="error"}} 4.0' in text
    assert f'tritonguard_breaker_trips_total{{model="{MODEL}",reason="error_rate",target_version="3"}} 1.0' in text
    assert f'tritonguard_breaker_state{{model="{MODEL}",target_version="3"}} 2.0' in text
    # the trip is shared through the rollout state, as the Triton guard's
    assert store.load().breakers["3"]["state"] == "open"


def test_an_unknown_guard_key_fails_at_build_naming_it():
    from tritonguard.hosts.ray_serve import ServeConfig  # noqa: PLC0415

    with pytest.raises(ConfigError, match="cache.l1_entries"):
        ServeConfig.from_parameters({"cache.l1_entries": "8"}, "m")
    with pytest.raises(ConfigError, match="routing.canary_compare"):
        ServeConfig.from_parameters({"routing.canary_compare": "false"}, "m")


def test_answers_and_refusals_are_audited(served):
    import time  # noqa: PLC0415

    port, path = served["port"], served["audit"]
    assert infer(port, v2_body(images(1)), {"x-tenant-id": "acme"})[0] == 200
    bad = {"inputs": [{"name": "IMAGE", "shape": [1, 8, 8], "datatype": "FP32", "data": [-1.0] * 64}]}
    assert infer(port, bad, {"x-tenant-id": "acme"})[0] == 400
    deadline = time.monotonic() + 15  # the replica's audit writer is a background thread
    while True:
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        kinds = {(r["type"], r.get("tenant")) for r in recs}
        if {("inference", "acme"), ("reject", "acme")} <= kinds or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {("inference", "acme"), ("reject", "acme")} <= kinds, kinds
    assert any(r["type"] == "guard_start" and r["model"] == MODEL and r.get("target") == TARGET for r in recs)
    inference = [r for r in recs if r["type"] == "inference" and r["tenant"] == "acme"]
    assert inference[-1]["served_by"] == f"{TARGET}:1" and inference[-1]["status"] == "200"
    assert [r["rule"] for r in recs if r["type"] == "reject" and r["tenant"] == "acme"] == ["range"]


def test_a_callable_without_a_repository_gets_its_text_redacted_both_ways(served):
    body = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [f"mail {EMAIL} now"]}]}
    status, headers, doc = infer(served["port"], body, prefix="/echo")
    assert status == 200, doc
    assert headers["x-tritonguard-served-by"] == "echo:1"
    (out,) = doc["outputs"]
    # the model saw the redacted text, and the e-mail it answered with left redacted
    assert out["datatype"] == "BYTES" and out["data"] == ["seen: mail [EMAIL] now from [EMAIL]"]

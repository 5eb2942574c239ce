import asyncio
import json
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from tritonguard.core.config import from_params
from tritonguard.core.errors import ConfigError
from tritonguard.rollout.validators import (
    FAIL,
    MARGINAL,
    PASS,
    AlertDispatcher,
    ValidatorConfig,
    ValidatorRegistry,
    Verdict,
    load_callable,
    run_validator,
)

CFG = ValidatorConfig()


def check(workload, cand, ref, **cfg):
    return ValidatorRegistry().validate(cand, ref, ValidatorConfig(workload=workload, **cfg))


def softmax(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def test_config():
    cfg = from_params(ValidatorConfig, {"workload": "embedding", "cosine_pass": "0.995"}, section="validator")
    assert cfg.cosine_pass == 0.995
    with pytest.raises(ConfigError, match="validator.workload"):
        from_params(ValidatorConfig, {"workload": "vision"}, section="validator")
    with pytest.raises(ConfigError, match="validator.custom"):
        from_params(ValidatorConfig, {"workload": "vision", "custom": "nocolon"}, section="validator")
    with pytest.raises(ConfigError, match="cosine_marginal"):
        from_params(ValidatorConfig, {"cosine_marginal": "0.9999"}, section="validator")
    assert CFG.tolerance(np.float32) == (1e-4, 1e-4)
    assert CFG.tolerance(np.float32, np.float16) == (1e-2, 1e-2)  # the looser of the two
    assert CFG.tolerance("bfloat16") == (3e-2, 3e-2)
    assert CFG.tolerance(np.int64) == (0.0, 0.0)
    assert ValidatorConfig(atol=0.5).tolerance(np.float32) == (0.5, 1e-4)


def test_classifier():
    rng = np.random.default_rng(0)
    ref = softmax(rng.normal(size=(4, 10)) * 3)
    cand = ref.copy()
    cand[1] += 5e-4 * (np.arange(10) == ref[1].argmin())  # agrees, small diff: MARGINAL
    cand[2] = np.roll(ref[2], 1)  # disagrees: FAIL
    cand[3] += 5e-3 * (np.arange(10) == ref[3].argmin())  # agrees, diff > 10 atol: FAIL
    v = check("classifier", cand, ref)
    assert v.per_row.tolist() == [PASS, MARGINAL, FAIL, FAIL]
    assert v.status == FAIL and v.metrics["agreement"] == 0.75 and v.metrics["rows"] == 4
    assert v.metrics["max_abs_diff"] > 5e-3 * 0.9
    assert check("classifier", ref, ref).status == PASS
    assert check("classifier", cand[:2], ref[:2]).status == MARGINAL


def test_embedding():
    rng = np.random.default_rng(1)
    ref = rng.normal(size=(4, 384)).astype(np.float32)
    noise = rng.normal(size=ref.shape).astype(np.float32)
    cand = np.stack([ref[0] * 2.0,  # same direction: cosine 1
                     ref[1] + 0.07 * noise[1],  # cosine ~0.9975
                     ref[2] + 0.5 * noise[2],  # cosine ~0.89
                     np.zeros(384, np.float32)])
    v = check("embedding", cand, ref)
    assert v.per_row.tolist() == [PASS, MARGINAL, FAIL, FAIL]
    assert v.metrics["min_cosine"] == 0.0
    zeros = np.zeros((2, 3), np.float32)
    assert check("embedding", zeros, zeros).status == PASS


@pytest.mark.parametrize("dtype, eps, expect", [
    (np.float32, 5e-5, PASS), (np.float32, 5e-4, MARGINAL), (np.float32, 5e-2, FAIL),
    (np.float16, 5e-3, PASS), (np.float16, 5e-2, MARGINAL), (np.float16, 0.5, FAIL),
])
def test_regression_dtype_aware(dtype, eps, expect):
    ref = np.zeros((3, 5), dtype=dtype)
    cand = ref.copy()
    cand[1, 2] = eps
    v = check("regression", cand, ref)
    assert v.per_row.tolist() == [PASS, expect, PASS]
    assert v.status == expect


def test_regression_relative_ints_and_nan():
    ref = np.array([[1000.0, 2000.0]], np.float32)
    assert check("encoder", ref * (1 + 5e-5), ref).status == PASS  # within rtol
    ints = np.array([[1, 2], [3, 4]], np.int64)
    other = ints.copy()
    other[1, 1] = 5
    assert check("regression", other, ints).per_row.tolist() == [PASS, FAIL]
    nan = np.array([[np.nan, 1.0], [1.0, 1.0]], np.float32)
    assert check("regression", nan, nan).status == PASS  # NaN where the reference has NaN
    assert check("regression", nan, np.ones((2, 2), np.float32)).per_row.tolist() == [FAIL, PASS]
    assert check("regression", np.ones((2, 3)), np.ones((2, 2))).status == FAIL


def test_reranker():
    ref = np.array([[0.9, 0.5, 0.3, 0.1, 0.0, -0.2, -0.5, -0.7, -0.9, -1.0]] * 4)
    cand = ref.copy()
    cand[0] *= 2  # same order
    cand[1, [4, 5]] = cand[1, [5, 4]]  # one adjacent swap: rho ~0.988
    cand[2] = cand[2][::-1]
    cand[3] = 0.0  # constant: no ranking
    v = check("reranker", cand, ref)
    assert v.per_row.tolist() == [PASS, MARGINAL, FAIL, FAIL]
    assert v.metrics["min_spearman"] == pytest.approx(-1.0)
    from scipy.stats import spearmanr
    assert v.metrics["mean_spearman"] == pytest.approx(
        np.mean([1.0, spearmanr(cand[1], ref[1]).statistic, -1.0, 0.0]))


def test_generation():
    ref = np.array([[b"the cat sat on the mat"], [b"hello world"], [b"abc"], [b""]], dtype=object)
    cand = np.array([[b"the cat sat on the mat"], [b"hello worl!"], [b"xyz"], [b""]], dtype=object)
    v = check("generation", cand, ref)
    assert v.per_row.tolist() == [PASS, MARGINAL, FAIL, PASS]
    assert v.metrics["exact_match_rate"] == 0.5
    assert 0.5 < v.metrics["prefix_match_rate"] < 1
    assert check("generation", ["a", "b"], np.array(["a", "b"])).status == PASS


def test_dict_outputs_select_one():
    ref = {"PROBS": softmax(np.eye(3)), "OTHER": np.zeros((3, 1))}
    cand = {"PROBS": softmax(np.eye(3)[::-1]), "OTHER": np.zeros((3, 1))}
    assert check("classifier", cand, ref).per_row.tolist() == [FAIL, PASS, FAIL]
    assert check("regression", cand, ref, output="OTHER").status == PASS


# -- registry and custom validators ----------------------------------------------------------
def test_registry_override_and_unregister():
    reg = ValidatorRegistry()
    cfg = ValidatorConfig(workload="classifier")
    ref = softmax(np.eye(3))
    reg.register("classifier", lambda c, r, config: (MARGINAL, {"custom": True}))
    v = reg.validate(ref, ref, cfg)
    assert v.status == MARGINAL and v.metrics == {"custom": True} and v.per_row.tolist() == [MARGINAL] * 3
    reg.unregister("classifier")
    assert reg.validate(ref, ref, cfg).status == PASS
    reg.register("vision", lambda c, r, config: Verdict.from_rows(np.array([PASS, FAIL]), {}))
    assert reg.validate(ref, ref, ValidatorConfig(workload="vision", custom="x:y")).status == FAIL
    assert "vision" in reg.workloads()
    assert reg.validate(ref, ref, ValidatorConfig(workload="other", custom="x:y")).metrics["error"].startswith("KeyError")


async def _async_validator(c, r, config):
    await asyncio.sleep(0)
    return PASS, {"async": True}


def test_async_custom_validator():
    reg = ValidatorRegistry()
    reg.register("classifier", _async_validator)
    ref = np.zeros((2, 3))
    assert reg.validate(ref, ref, CFG).metrics == {"async": True}
    assert reg.validate(ref, ref, CFG).status == PASS  # the private loop is reused

    async def inside_a_loop():  # e.g. an async execute(): the running loop can't be re-entered
        return reg.validate(ref, ref, CFG)

    assert asyncio.run(inside_a_loop()).metrics == {"async": True}


def test_raising_or_malformed_validator_is_a_fail():
    def boom(c, r, config):
        raise RuntimeError("kaput")

    ref = np.zeros((3, 2))
    v = run_validator(boom, ref, ref, CFG)
    assert v.status == FAIL and v.metrics == {"error": "RuntimeError: kaput"} and v.per_row.tolist() == [FAIL] * 3
    assert run_validator(lambda *a: 42, ref, ref, CFG).metrics["error"].startswith("TypeError")
    assert run_validator(lambda *a: ("OK", {}), ref, ref, CFG).status == FAIL


def test_load_callable(monkeypatch):
    mod = types.ModuleType("tg_custom_validators")
    mod.check = lambda c, r, config: (PASS, {})
    mod.not_callable = 3
    monkeypatch.setitem(sys.modules, "tg_custom_validators", mod)
    assert load_callable("tg_custom_validators:check") is mod.check
    reg = ValidatorRegistry.from_config(ValidatorConfig(workload="vision", custom="tg_custom_validators:check"))
    assert reg.get("vision") is mod.check
    for bad, msg in [("tg_custom_validators", "package.module:callable"),
                     ("no_such_module_xyz:f", "cannot import"),
                     ("tg_custom_validators:missing", "no attribute"),
                     ("tg_custom_validators:not_callable", "not a callable")]:
        with pytest.raises(ConfigError, match=msg):
            load_callable(bad)


# -- alerts --------------------------------------------------------------------------------
def test_alert_callable_receives_event_and_failures_are_counted():
    got = []

    def bad(event):
        raise ValueError("nope")

    async def also(event):
        got.append(("async", event["reason"]))

    d = AlertDispatcher([got.append, bad, also])
    t0 = time.perf_counter()
    assert d.fire({"reason": "drift", "version": 2})
    assert time.perf_counter() - t0 < 0.05
    assert d.flush(5)
    assert got == [{"reason": "drift", "version": 2}, ("async", "drift")]
    assert d.failures == 1


def test_alert_queue_is_bounded():
    gate = threading.Event()
    d = AlertDispatcher([lambda e: gate.wait(5)], queue_size=2)
    results = [d.fire({"i": i}) for i in range(10)]
    gate.set()
    assert d.flush(5)
    assert results.count(False) == d.dropped and 7 <= d.dropped <= 8  # 2 queued, maybe 1 taken by the worker


class _Hook(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((self.headers["Content-Type"], json.loads(body)))
        self.send_response(204 if self.path == "/ok" else 500)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook():
    _Hook.received = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", _Hook.received
    srv.shutdown()
    srv.server_close()
    t.join(5)


def test_webhook_posts_json(webhook):
    url, received = webhook
    d = AlertDispatcher(webhook_url=f"{url}/ok")
    d.fire({"reason": "non_finite", "figures": {"rate": 0.5}, "arr": np.float32(1.5)})
    assert d.flush(5)
    assert received == [("application/json", {"reason": "non_finite", "figures": {"rate": 0.5}, "arr": "1.5"})]
    assert d.failures == 0 and d.sent == 1
    bad = AlertDispatcher(webhook_url=f"{url}/fail")
    bad.fire({"reason": "x"})
    assert bad.flush(5) and bad.failures == 1


def test_webhook_unreachable_is_counted():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = AlertDispatcher(webhook_url=f"http://127.0.0.1:{port}/")
    d.fire({"reason": "x"})
    assert d.flush(5) and d.failures == 1

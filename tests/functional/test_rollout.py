"""Seeded faults against a real tritonserver: a bad candidate must be caught (golden rejection or
breaker trip) within a bounded number of requests while the fallback chain answers every
request; a good candidate must never trip.

One server serves a private repository: the base digits model is v1 (primary) and each seeded
fault of :mod:`examples.faults` a later version, routed to as candidate in turn through
``exporter route`` (the same store the guards poll every 0.2 s).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from exporter.build.export import export
from exporter.rollout.route import RouteChange, apply
from tritonguard.core.repository import read_config, write_config
from tritonguard.ops.server import Server

pytestmark = pytest.mark.functional

FAULTS = ["good", "nan_subset", "accuracy_drop", "raises", "slow", "loose"]
MAX_REQUESTS = 900  # a fault not caught within this many requests fails its test
REPORT: dict[str, dict] = {}


def _latency_budget_ms(faults) -> float:
    """Between the base's and the slow fault's per-batch time at batch 8, measured here."""
    import onnxruntime as ort

    def p(model_path: Path, q: float) -> float:
        o = ort.SessionOptions()
        o.intra_op_num_threads = 1
        s = ort.InferenceSession(str(model_path), o, providers=["CPUExecutionProvider"])
        x = {"IMAGE": faults.load_all()[0][:8]}
        s.run(None, x)
        t = []
        for _ in range(200):
            t0 = time.perf_counter()
            s.run(None, x)
            t.append(time.perf_counter() - t0)
        return float(np.percentile(t, q)) * 1000

    return p


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    from examples import faults

    repo = tmp_path_factory.mktemp("rollout_repo")
    versions = {"base": export(faults.base(), name="digits", repository=repo, source="examples.faults:base").version}
    for name in FAULTS:
        versions[name] = export(getattr(faults, name)(), name="digits", repository=repo,
                                source=f"examples.faults:{name}").version
    # a version whose artifact was swapped after export: its goldens must fail on this server
    tampered = export(faults.good(), name="digits", repository=repo, source="examples.faults:good",
                      force=True).version  # the same artifact as "good" until it is swapped below
    shutil.copy(repo / "digits_raw" / str(versions["accuracy_drop"]) / "model.onnx",
                repo / "digits_raw" / str(tampered) / "model.onnx")
    versions["tampered"] = tampered

    measure = _latency_budget_ms(faults)
    base_ms = measure(repo / "digits_raw" / str(versions["base"]) / "model.onnx", 95)
    slow_ms = measure(repo / "digits_raw" / str(versions["slow"]) / "model.onnx", 50)
    assert slow_ms >= 2 * base_ms, f"slow fault is not 2x slower here: {slow_ms:.3f} vs {base_ms:.3f} ms"
    budget = float(np.sqrt(base_ms * slow_ms))

    cfg = read_config(repo / "digits")
    params = {k: v["string_value"] for k, v in cfg["parameters"].items()}
    params.update({
        "target_version": str(versions["base"]),
        "routing.poll_interval_s": "0.2", "routing.input_drift_interval_s": "1",
        "breaker.window": "200", "breaker.min_requests": "20", "breaker.min_compared": "60",
        "breaker.max_fail_rate": "0.015", "breaker.max_error_rate": "0.05", "breaker.max_nan_rate": "0.0",
        # the slow fault is ~5x slower alone, but served p95s (per-call overhead and GIL waits in
        # both versions) compress that to ~2.0-2.4x: a 2.0 trip sat at its edge and missed it in
        # 1,800 requests, twice in CI. Versions as fast as the primary stay near 1.0.
        "routing.latency_ratio": "1.5",
        # nan_subset answers NaN on 23 % of the rows sent below: it passes 20 probe rows in a
        # row 0.5 % of the time (it did once in CI), 60 about 1.6e-7 of the time
        "breaker.min_off_s": "3", "breaker.probes_to_close": "60", "breaker.min_on_s": "1",
    })
    cfg["parameters"] = {k: {"string_value": v} for k, v in params.items()}
    write_config(repo / "digits", cfg)

    log = tmp_path_factory.mktemp("rollout_logs") / "tritonserver.log"
    server = Server(repository=repo, log_path=log)
    server.start(wait_models=["digits", "digits_raw"])
    client = httpclient.InferenceServerClient(server.http_url, concurrency=8)
    yield {"repo": repo, "versions": versions, "server": server, "client": client, "budget_ms": budget,
           "base_ms": base_ms, "slow_ms": slow_ms, "faults": faults}
    client.close()
    server.stop()
    if REPORT:
        print("\nseeded-fault report:\n" + json.dumps(REPORT, indent=1))


def state(ctx) -> dict:
    return json.loads((ctx["repo"] / "digits" / "rollout_state.json").read_text())


def send(ctx, images: np.ndarray, chunk: int = 32):
    """Requests of one image each, ``chunk`` in flight; yields (sent, results) per chunk."""
    client = ctx["client"]
    sent = 0
    for i in range(0, len(images), chunk):
        futures = []
        for img in images[i:i + chunk]:
            inp = httpclient.InferInput("IMAGE", [1, 8, 8], "FP32")
            inp.set_data_from_numpy(img[None].astype(np.float32))
            futures.append(client.async_infer("digits", [inp], outputs=[
                httpclient.InferRequestedOutput("PROBS"), httpclient.InferRequestedOutput("SERVED_BY")]))
        results = []
        for f in futures:
            try:
                r = f.get_result()
                results.append((r.as_numpy("PROBS")[0], r.as_numpy("SERVED_BY")[0, 0].decode()))
            except InferenceServerException as exc:
                results.append((exc, None))
        sent += len(results)
        yield sent, results


def run_candidate(ctx, fault: str, *, share: float = 0.5, shadow: float = 0.5, limit: int = MAX_REQUESTS):
    v = ctx["versions"][fault]
    apply(ctx["repo"], "digits", RouteChange(candidate=v, share=share, shadow=shadow))
    time.sleep(0.5)  # > routing.poll_interval_s: every instance has the new state
    images, labels = ctx["faults"].load_all()
    order = np.random.default_rng(hash(fault) % 2**32).permutation(len(images))
    reps = int(np.ceil(limit / len(images)))
    order = np.tile(order, reps)[:limit]
    errors, non_finite, served_by_cand, detected_at, wrong = 0, 0, 0, None, 0
    for sent, results in send(ctx, images[order]):
        for k, (probs, served) in enumerate(results):
            if isinstance(probs, Exception):
                errors += 1
                continue
            non_finite += int(not np.isfinite(probs).all())
            served_by_cand += served == f"digits_raw:{v}"
            wrong += int(probs.argmax() != labels[order[sent - len(results) + k]])
        b = state(ctx).get("breakers", {}).get(str(v), {})
        if detected_at is None and b.get("state") in ("open", "half_open"):
            detected_at = sent
            if fault != "good":
                break
    apply(ctx["repo"], "digits", RouteChange(candidate=0, shadow=0.0))
    time.sleep(0.5)
    b = state(ctx).get("breakers", {}).get(str(v), {})
    REPORT[fault] = {"version": v, "requests_until_detection": detected_at, "user_visible_errors": errors,
                     "non_finite_answers": non_finite, "served_by_candidate": served_by_cand,
                     "wrong_top1": wrong, "trip": (b.get("last_trip") or {}).get("reason")}
    return REPORT[fault]


def test_primary_passed_goldens_on_this_server(rollout):
    st = state(rollout)
    base = str(rollout["versions"]["base"])
    assert st["primary"]["version"] == rollout["versions"]["base"]
    assert st["goldens"][base]["verdict"] == "PASS"


def test_good_candidate_never_trips(rollout):
    for _ in range(2):  # repeated runs: no false trip
        r = run_candidate(rollout, "good", limit=600)
        assert r["requests_until_detection"] is None, r
        assert r["user_visible_errors"] == 0 and r["non_finite_answers"] == 0, r
        assert r["served_by_candidate"] > 150, r  # it really served its share


def test_abn_split_follows_its_weights_and_skips_an_arm_failing_goldens(rollout):
    """A/B/n through the CLI: the good version takes its weight of live traffic, the tampered one
    (goldens FAIL on this server) takes none (its band goes to the primary); nobody sees an
    error, and the good arm's answers are compared against the primary's."""
    import subprocess
    import sys

    v = rollout["versions"]
    good, tampered, base = v["good"], v["tampered"], v["base"]
    route = [sys.executable, "-m", "exporter", "route", "digits", "-r", str(rollout["repo"])]

    def run(*args):
        r = subprocess.run([*route, *args], capture_output=True, text=True, timeout=60)
        return r.returncode, " ".join((r.stdout + r.stderr).split())  # rich wraps long lines

    try:
        rc, text = run("--arms", f"{good}=0.3,{tampered}=0.2")
        assert rc == 0 and f"A/B/n: v{good} 30%, v{tampered} 20%, primary v{base} 50%" in text, text
        rc, text = run("--candidate", str(good), "--share", "0.1")  # not beside the split
        assert rc == 2 and "end it with --arms none" in text, text
        time.sleep(0.5)  # > routing.poll_interval_s
        images = rollout["faults"].load_all()[0]
        n = 800
        order = np.random.default_rng(7).integers(0, len(images), n)
        served = []
        for _, results in send(rollout, images[order]):
            served += [s for _, s in results]
    finally:
        rc, text = run("--arms", "none")
    assert rc == 0 and "A/B/n" not in text, text
    assert None not in served, "a user saw an error"
    counts = {s: served.count(s) for s in set(served)}
    REPORT["abn"] = {"weights": {good: 0.3, tampered: 0.2}, "served": counts}
    assert counts.get(f"digits_raw:{tampered}", 0) == 0, counts
    got = counts.get(f"digits_raw:{good}", 0)
    sd = (n * 0.3 * 0.7) ** 0.5
    assert abs(got - 0.3 * n) < 5 * sd, counts  # binomial(800, 0.3): 240 +- 65
    assert got + counts.get(f"digits_raw:{base}", 0) == n, counts
    assert state(rollout)["goldens"][str(tampered)]["verdict"] == "FAIL"
    time.sleep(1.5)  # canary comparisons run on the worker; metrics are pushed every second
    text = urllib.request.urlopen(rollout["server"].metrics_url, timeout=10).read().decode()
    compared = [ln for ln in text.splitlines() if ln.startswith("tritonguard_compared_total")
                and 'kind="canary"' in ln and f'target_version="{good}"' in ln]
    assert compared and sum(float(ln.split()[-1]) for ln in compared) > 0, compared


@pytest.mark.parametrize("fault,reasons", [
    ("nan_subset", {"non_finite"}),
    # wrong answers show as validator FAILs on canary/shadow rows, or first as output drift. Both
    # wrapping faults also carry extra ops (argmax + a class-swap mask; topk + where), and they are slower for it:
    # onnxruntime alone, one thread, p50 at batch 1 (4): base 46 (88) us, accuracy_drop 66 (112),
    # loose 72 (121) -- 1.4-1.6x, past this server's routing.latency_ratio of 1.5 at small batches.
    # A latency trip is a true catch for them (CI caught loose by latency once, at 128 requests).
    ("accuracy_drop", {"validator_fail", "drift", "latency"}),
    ("raises", {"error_rate"}),
    ("slow", {"latency"}),  # same answers: only its latency can give it away
    ("loose", {"validator_fail", "drift", "latency"}),
])
def test_bad_candidate_is_caught_and_fallback_serves_everyone(rollout, fault, reasons):
    # latency is judged on p95s of >= 50 candidate calls (batches): under load the batches grow,
    # so the slow fault needs more requests than the others (160-640 here, 50 % share)
    limit = 2 * MAX_REQUESTS if fault == "slow" else MAX_REQUESTS
    r = run_candidate(rollout, fault, limit=limit)
    assert r["requests_until_detection"] is not None, f"{fault} not caught within {limit} requests: {r}"
    assert r["trip"] in reasons, r
    assert r["user_visible_errors"] == 0, r
    assert r["non_finite_answers"] == 0, r


def test_tampered_version_fails_goldens_and_gets_no_traffic(rollout):
    v = rollout["versions"]["tampered"]
    apply(rollout["repo"], "digits", RouteChange(candidate=v, share=1.0))
    time.sleep(0.5)
    images = rollout["faults"].load_all()[0][:64]
    served = [s for _, results in send(rollout, images) for _, s in results]
    apply(rollout["repo"], "digits", RouteChange(candidate=0))
    assert all(s == f"digits_raw:{rollout['versions']['base']}" for s in served), set(served)
    g = state(rollout)["goldens"][str(v)]
    assert g["verdict"] == "FAIL", g
    REPORT["tampered"] = {"version": v, "golden": g["verdict"], "served_by_candidate": 0}


def test_hysteresis_keeps_a_tripped_candidate_off(rollout):
    """After a trip, the candidate gets no live traffic before min_off_s, and a candidate that
    still fails its probes does not come back."""
    v = rollout["versions"]["nan_subset"]
    apply(rollout["repo"], "digits", RouteChange(candidate=v, share=0.5, shadow=0.5))
    time.sleep(0.5)
    images = rollout["faults"].load_all()[0]
    # tripped by an earlier test or now (the file may run alone): wait for the trip, bounded
    for _, _results in send(rollout, images[:MAX_REQUESTS]):
        if state(rollout).get("breakers", {}).get(str(v), {}).get("state") in ("open", "half_open"):
            break
    assert state(rollout)["breakers"][str(v)]["state"] in ("open", "half_open")
    time.sleep(0.5)  # > routing.poll_interval_s: every instance has adopted the trip
    for _ in range(3):  # across the 3 s off time and the probes after it
        served = [s for _, results in send(rollout, images[:200]) for _, s in results]
        assert f"digits_raw:{v}" not in served
        time.sleep(1.0)
    apply(rollout["repo"], "digits", RouteChange(candidate=0, shadow=0.0))
    assert state(rollout)["breakers"][str(v)]["state"] in ("open", "half_open")


def test_reset_breaker_lets_the_candidate_serve_again_in_every_instance(rollout):
    """`route --reset-breaker` closes a tripped breaker in the store and in every guard process:
    the candidate answers again at once (its finite answers), until its NaNs trip it anew."""
    v = rollout["versions"]["nan_subset"]
    assert state(rollout)["breakers"][str(v)]["state"] in ("open", "half_open")
    apply(rollout["repo"], "digits", RouteChange(candidate=v, share=1.0, reset_breaker=v))
    time.sleep(0.5)  # > routing.poll_interval_s
    images = rollout["faults"].load_all()[0][:64]
    results = [x for _, chunk in send(rollout, images, chunk=8) for x in chunk]
    apply(rollout["repo"], "digits", RouteChange(candidate=0))
    served = [s for _, s in results]
    assert None not in served, "a user saw an error"
    assert f"digits_raw:{v}" in served, set(served)
    assert all(np.isfinite(p).all() for p, _ in results)


def test_input_drift_is_measured(rollout):
    drifted = rollout["faults"].drifted_inputs(300)
    for _ in send(rollout, drifted):
        pass
    time.sleep(2.5)  # scored every routing.input_drift_interval_s, pushed to metrics every 1 s
    text = urllib.request.urlopen(rollout["server"].metrics_url, timeout=10).read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("tritonguard_input_drift_fraction")]
    assert lines, "no drift gauge"
    assert max(float(ln.split()[-1]) for ln in lines) >= 0.5, lines


def test_metrics_report_fallbacks_and_trips(rollout):
    text = urllib.request.urlopen(rollout["server"].metrics_url, timeout=10).read().decode()
    assert "tritonguard_breaker_trips_total" in text
    assert "tritonguard_fallbacks_total" in text
    assert 'tritonguard_served_total{model="digits",served_by="digits_raw:' in text
    assert "tritonguard_breaker_state" in text

    def gauges(name: str) -> list[tuple[str, float]]:
        return [(ln.split()[0], float(ln.split()[-1])) for ln in text.splitlines() if ln.startswith(name + "{")]

    # validator figures and the output-drift EWMA of the compared candidates (the accuracy-dropping
    # one included: its FAIL share shows), per target version
    v = rollout["versions"]
    scores = gauges("tritonguard_validator_score")
    assert any(f'target_version="{v["good"]}"' in k and 'figure="agreement"' in k and 0.9 <= x <= 1
               for k, x in scores), scores
    ewma = dict(gauges("tritonguard_output_drift_ewma"))
    if REPORT.get("accuracy_drop", {}).get("trip") != "latency":
        # caught by a validator or drift, it was compared first; caught by its latency (it is
        # 1.4x slower at batch 1, see the parametrize above), too few rows may have been compared
        assert any(f'target_version="{v["accuracy_drop"]}"' in k and x > 0 for k, x in ewma.items()), ewma
    # per-feature input drift of the primary, after the drifted traffic of test_input_drift_is_measured
    for name in ("tritonguard_input_drift_psi", "tritonguard_input_drift_ks"):
        per_feature = gauges(name)
        assert len(per_feature) >= 10 and all('feature="' in k for k, _ in per_feature), per_feature[:3]
        assert max(x for _, x in per_feature) > 0.1, name


def test_corrupt_state_keeps_the_last_good_state(rollout):
    """A corrupt rollout_state.json never stops serving: every guard instance keeps the last good
    state, counts the failed read on the metrics port, and takes a good document again."""
    path = rollout["repo"] / "digits" / "rollout_state.json"
    good = path.read_bytes()
    base = rollout["versions"]["base"]

    def replace(data: bytes) -> None:  # the store's own way: write aside, rename over
        tmp = path.with_name(".corrupt-test.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def state_errors() -> float:
        text = urllib.request.urlopen(rollout["server"].metrics_url, timeout=10).read().decode()
        return sum(float(ln.split()[-1]) for ln in text.splitlines()
                   if ln.startswith('tritonguard_state_errors_total{model="digits"'))

    before = state_errors()
    images = rollout["faults"].load_all()[0][:64]
    try:
        replace(b'{"model": "digits", "revision": ')  # truncated JSON
        time.sleep(0.5)  # > routing.poll_interval_s
        served = [s for _, results in send(rollout, images, chunk=8) for _, s in results]
        assert served == [f"digits_raw:{base}"] * len(images), set(served)
        deadline = time.monotonic() + 10  # counters are pushed once a second
        while state_errors() <= before and time.monotonic() < deadline:
            time.sleep(0.5)
        assert state_errors() > before
    finally:
        replace(good)
    time.sleep(0.5)
    served = [s for _, results in send(rollout, images[:16]) for _, s in results]
    assert served == [f"digits_raw:{base}"] * 16, set(served)
    assert state(rollout)["primary"]["version"] == base


def test_primary_failing_its_goldens_is_not_ready(rollout, tmp_path):
    """A guard pinned to a primary whose artifact fails its goldens on this server never serves
    its answers. In process, the guard refuses to load: Triton reports it not ready, with the
    golden figures as the reason. Over BLS (no BLS call is allowed in initialize(), and a loaded
    Python model cannot mark itself not ready), the guard loads and answers 503 instead."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "digits_raw").symlink_to((rollout["repo"] / "digits_raw").resolve())
    tampered = rollout["versions"]["tampered"]
    for name, placement in (("digits_badprimary", "inprocess"), ("digits_bls_badprimary", "bls")):
        cfg = read_config(rollout["repo"] / "digits")
        cfg["name"] = name
        cfg["parameters"] = {**cfg["parameters"], "target_version": {"string_value": str(tampered)},
                             "placement": {"string_value": placement}}
        write_config(repo / name, cfg)
        (repo / name / "1").mkdir()
    server = Server(repository=repo, log_path=tmp_path / "tritonserver.log")
    try:
        server.start(wait_models=["digits_raw", "digits_bls_badprimary"], timeout=120)
        deadline = time.monotonic() + 60  # the in-process guard checks its goldens while loading
        while True:
            req = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", data=b"{}", method="POST")
            with urllib.request.urlopen(req, timeout=10) as r:
                index = {m["name"]: m for m in json.loads(r.read())}
            if index["digits_badprimary"].get("state") == "UNAVAILABLE" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        bad = index["digits_badprimary"]
        assert bad.get("state") == "UNAVAILABLE", bad
        assert "failed its goldens on this server" in bad["reason"] and "agreement" in bad["reason"], bad
        client = httpclient.InferenceServerClient(server.http_url)
        try:
            assert not client.is_model_ready("digits_badprimary")
            images = rollout["faults"].load_all()[0][:4]
            for img in images:
                inp = httpclient.InferInput("IMAGE", [1, 8, 8], "FP32")
                inp.set_data_from_numpy(img[None].astype(np.float32))
                with pytest.raises(InferenceServerException) as err:
                    client.infer("digits_bls_badprimary", [inp])
                assert err.value.status() == "503", err.value
                assert "retry later" in err.value.message(), err.value
        finally:
            client.close()
        goldens = json.loads((repo / "digits_bls_badprimary" / "rollout_state.json").read_text())["goldens"]
        assert goldens[str(tampered)]["verdict"] == "FAIL", goldens
    finally:
        server.stop()

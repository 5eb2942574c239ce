"""Cost against a real tritonserver: the guards' cost meter on varied load_digits traffic from two
tenants (in process and over BLS), ``exporter status --server`` with Triton's own statistics
beside it, and the rollout's cost gate judging a genuinely slower candidate and an identical one
on the counters the server exports.

One private server: ``digits`` (in process) with three versions of ``digits_raw`` — v1 as
exported, v2 = v1 plus an input-dependent tanh chain added at 1e-30 (the same answers, about 7-20x
the model time a call here), v3 = a copy of v1 — and ``digits_bls`` (BLS) in front of v1.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from typer.testing import CliRunner

from exporter.build.layout import target_version_policy
from exporter.cli.app import app
from exporter.rollout.gates.config import GateConfig
from exporter.rollout.gates.evaluate import evaluate
from exporter.rollout.gates.readings import GuardReadings, parse
from exporter.rollout.gates.verdict import FAIL, PASS
from exporter.rollout.route import RouteChange, apply
from tritonguard.core.repository import read_config, read_manifest, write_config
from tritonguard.ops.server import Server

pytestmark = pytest.mark.functional

SLOW, SAME = 2, 3
TENANTS = ("acme", "beta")
REPORT: dict[str, object] = {}
FIRST: dict[tuple[str, str], int] = {}  # (model, tenant) -> requests the first-request test sent


def slow_onnx(src: Path, dst: Path, width: int = 1024, steps: int = 2) -> None:
    """v1's graph plus mean(tanh chain of the input) x 1e-30 added to PROBS: no optimiser can
    fold the chain (it depends on the input), and 1e-30 is below float32 resolution at the
    probabilities' scale, so the answers (and the goldens) are v1's."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(str(src))
    g = m.graph
    g.node[-1].output[0] = "PROBS_base"  # the Softmax that wrote PROBS
    rng = np.random.default_rng(0)
    g.initializer.extend([numpy_helper.from_array(np.array([-1, 64], np.int64), "slow_shape"),
                          numpy_helper.from_array((rng.normal(size=(64, width)) / 8).astype(np.float32), "slow_w0"),
                          numpy_helper.from_array(np.full((width, 1), 1.0 / width, np.float32), "slow_mean"),
                          numpy_helper.from_array(np.array(1e-30, np.float32), "slow_scale")])
    nodes = [helper.make_node("Reshape", ["IMAGE", "slow_shape"], ["slow_x"]),
             helper.make_node("MatMul", ["slow_x", "slow_w0"], ["slow_h0"]),
             helper.make_node("Tanh", ["slow_h0"], ["slow_t0"])]
    for k in range(1, steps + 1):
        w = (rng.normal(size=(width, width)) / width ** 0.5).astype(np.float32)
        g.initializer.append(numpy_helper.from_array(w, f"slow_w{k}"))
        nodes += [helper.make_node("MatMul", [f"slow_t{k - 1}", f"slow_w{k}"], [f"slow_h{k}"]),
                  helper.make_node("Tanh", [f"slow_h{k}"], [f"slow_t{k}"])]
    nodes += [helper.make_node("MatMul", [f"slow_t{steps}", "slow_mean"], ["slow_m"]),
              helper.make_node("Mul", ["slow_m", "slow_scale"], ["slow_s"]),
              helper.make_node("Add", ["PROBS_base", "slow_s"], ["PROBS"])]
    g.node.extend(nodes)
    onnx.checker.check_model(m)
    onnx.save(m, str(dst))


def add_version(raw: Path, version: int, artifact: Path | None = None) -> None:
    """A copy of v1's folder (goldens, evaluation set, manifest) as ``version``, with another
    artifact if given (its sha256 in the manifest, as an export records it)."""
    dest = raw / str(version)
    shutil.copytree(raw / "1", dest)
    if artifact is not None:
        shutil.copy(artifact, dest / "model.onnx")
    manifest = read_manifest(dest)
    manifest["sha256"] = hashlib.sha256((dest / "model.onnx").read_bytes()).hexdigest()
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2))


@pytest.fixture(scope="module")
def env(exported_repo, tmp_path_factory):
    repo = tmp_path_factory.mktemp("cost_repo")
    for name in ("digits", "digits_raw"):
        shutil.copytree(exported_repo / name, repo / name, ignore=shutil.ignore_patterns(
            "rollout_state.json*", ".rollout_state*", ".latency", "rollout_controller.json*"))
    slow_onnx(repo / "digits_raw" / "1" / "model.onnx", repo / "slow.onnx")
    add_version(repo / "digits_raw", SLOW, repo / "slow.onnx")
    add_version(repo / "digits_raw", SAME)
    raw = read_config(repo / "digits_raw")
    # digits_bls, added by hand below, reaches digits_raw over BLS: the target gets the policy an
    # export writes for a BLS target (every version loaded: it calls v1 while v2 and v3 are on
    # disk); the export of digits (in process) wrote latest 1 and knows nothing of digits_bls
    raw["version_policy"] = target_version_policy("bls")
    write_config(repo / "digits_raw", raw)
    cfg = read_config(repo / "digits")
    params = {k: v["string_value"] for k, v in cfg["parameters"].items()}
    params.update({"target_version": "1", "routing.poll_interval_s": "0.2"})
    cfg["parameters"] = {k: {"string_value": v} for k, v in params.items()}
    write_config(repo / "digits", cfg)
    bls = {**cfg, "name": "digits_bls", "parameters": {k: {"string_value": v} for k, v in
                                                        {**params, "placement": "bls"}.items()}}
    write_config(repo / "digits_bls", bls)
    (repo / "digits_bls" / "1").mkdir()

    log = tmp_path_factory.mktemp("cost_logs") / "tritonserver.log"
    server = Server(repository=repo, log_path=log)
    server.start(wait_models=["digits", "digits_raw", "digits_bls"])
    client = httpclient.InferenceServerClient(server.http_url, concurrency=8)
    from sklearn.datasets import load_digits

    yield {"repo": repo, "server": server, "client": client, "images": load_digits().images.astype(np.float32)}
    client.close()
    server.stop()
    if REPORT:
        print("\ncost report:\n" + json.dumps(REPORT, indent=1))


def send(env, model: str, n: int, seed: int = 0) -> int:
    """``n`` requests of 1-3 load_digits images each, 8 in flight, alternating tenants; returns
    how many were answered."""
    client, images = env["client"], env["images"]
    rng = np.random.default_rng(seed)
    answered = 0
    for start in range(0, n, 16):
        futures = []
        for k in range(start, min(start + 16, n)):
            rows = images[rng.integers(0, len(images), size=int(rng.integers(1, 4)))]
            inp = httpclient.InferInput("IMAGE", list(rows.shape), "FP32")
            inp.set_data_from_numpy(rows)
            futures.append(client.async_infer(model, [inp], parameters={"tenant": TENANTS[k % 2]}))
        for f in futures:
            f.get_result()
            answered += 1
    return answered


def series(env) -> dict:
    return parse(urllib.request.urlopen(env["server"].metrics_url, timeout=10).read().decode())


def cost_series(env, model: str) -> dict[tuple[str, str, str, str], float]:
    """``{(family, target_version, tenant, part): value}`` of the cost families of ``model``."""
    out = {}
    for (name, labelset), value in series(env).items():
        labels = dict(labelset)
        if labels.get("model") == model and (name.startswith("tritonguard_cost") or "compute_seconds" in name):
            out[(name, labels.get("target_version", ""), labels.get("tenant", ""), labels.get("part", ""))] = value
    return out


def wait_for(env, model: str, requests: float, timeout: float = 15.0) -> dict:
    """Cost series once the counters show ``requests`` charged and v1's gauges are there (the guard
    flushes every second; the gauge is recomputed at most every 5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        got = cost_series(env, model)
        charged = sum(v for k, v in got.items() if k[0] == "tritonguard_cost_requests_total")
        # every tenant's gauge: one that had requests earlier (the first-request test) has its
        # gauge a publish before the other's
        gauge = all(("tritonguard_cost_per_1k_requests", "1", t, "") in got for t in TENANTS)
        if (charged >= requests and gauge) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


LATER = 10  # requests after the first one, their guard times the noise the first one is judged by


@pytest.mark.parametrize("model", ["digits", "digits_bls"])
def test_a_fresh_servers_first_request_costs_what_a_later_one_does(env, model):
    """Issue 45 item 2: no request pays for load work. A BLS guard checks its primary's goldens in
    its first batch, on the serving thread (no BLS call in ``initialize()``): that batch's request
    was charged 12-30 ms of guard time against ~2 ms for each later one. The first of this module
    (so of a fresh server), one request at a time, each charge read from the server's counters.

    Noise bound, measured on the 2-core machine at load average 9-13 (fixed code): a later
    request's guard time is 1.3-3.1 ms (digits_bls) and 0.3-1.2 ms (digits), the first one's at
    most 1.5x the median of the later ones; the goldens add 4-30 ms of CPU to an unfixed first
    request. Judged: first <= 2 x the median of the later ones + 1.5 ms."""
    client, images = env["client"], env["images"]
    tenant = TENANTS[0]
    key = ("tritonguard_compute_seconds_total", "1", tenant, "guard")
    requests = ("tritonguard_cost_requests_total", "1", tenant, "")
    charges, before = [], 0.0
    for k in range(LATER + 1):
        inp = httpclient.InferInput("IMAGE", [1, 8, 8], "FP32")
        inp.set_data_from_numpy(images[k:k + 1])
        client.infer(model, [inp], parameters={"tenant": tenant})
        FIRST[(model, tenant)] = k + 1  # the next test counts these too
        deadline = time.monotonic() + 15
        while True:  # the guard pushes its counters right after a request
            got = cost_series(env, model)
            if got.get(requests, 0) >= k + 1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert got.get(requests) == k + 1, got
        charges.append(got.get(key, 0.0) - before)
        before = got.get(key, 0.0)
    first, later = charges[0], sorted(charges[1:])
    median = later[len(later) // 2]
    REPORT[f"first request {model}"] = {"first_ms": round(1e3 * first, 3),
                                        "later_ms": [round(1e3 * c, 3) for c in charges[1:]]}
    assert first <= 2 * median + 0.0015, (first, charges[1:])


@pytest.mark.parametrize("model", ["digits", "digits_bls"])
def test_the_meter_charges_every_answered_request(env, model):
    n = send(env, model, 300, seed=1)
    got = wait_for(env, model, n + sum(v for (m, _), v in FIRST.items() if m == model))
    charged = {k[2]: v for k, v in got.items() if k[0] == "tritonguard_cost_requests_total" and k[1] == "1"}
    assert charged == {t: 150 + FIRST.get((model, t), 0) for t in TENANTS}, got
    for tenant in TENANTS:
        guard = got[("tritonguard_compute_seconds_total", "1", tenant, "guard")]
        target = got[("tritonguard_compute_seconds_total", "1", tenant, "target")]
        # sane: more than nothing, less than the whole test's wall time per request
        assert 0 < guard / 150 < 0.05 and 0 < target / 150 < 0.05, (guard, target)
        # default prices: guard at 1 core, the target at 1 core (digits_raw: intra_op_threads 1)
        assert got[("tritonguard_cost_total", "1", tenant, "guard")] == pytest.approx(guard * 0.05 / 3600, rel=1e-6)
        assert got[("tritonguard_cost_total", "1", tenant, "target")] == pytest.approx(target * 0.05 / 3600, rel=1e-6)
        per_1k = got[("tritonguard_cost_per_1k_requests", "1", tenant, "")]
        assert 0 < per_1k < 1000 * 0.05 * 0.05 / 3600  # under 50 ms of a core a request
    REPORT[model] = {"per_1k_requests_usd": {t: got[("tritonguard_cost_per_1k_requests", "1", t, "")] for t in TENANTS},
                     "guard_s_per_request": sum(got[("tritonguard_compute_seconds_total", "1", t, "guard")]
                                                for t in TENANTS) / n,
                     "target_s_per_request": sum(got[("tritonguard_compute_seconds_total", "1", t, "target")]
                                                 for t in TENANTS) / n}


def test_status_prints_the_cost_beside_tritons_statistics(env):
    send(env, "digits_bls", 50, seed=2)
    wait_for(env, "digits_bls", 1)
    where = ["--server", env["server"].http_url, "--metrics-url", env["server"].metrics_url, "--repository", str(env["repo"])]
    res = CliRunner().invoke(app, ["status", *where])
    assert res.exit_code == 0, res.output
    text = res.output
    REPORT["status"] = text[text.index("digits →"):]
    for model in ("digits", "digits_bls"):
        block = text[text.index(f"\n{model} →"):]
        assert "cost (guards' meter" in block
        line = next(ln for ln in block.splitlines() if ln.strip().startswith("v1 "))
        assert "per 1k requests" in line and "guard" in line and "target" in line and "recent" in line
    bls = text[text.index("\ndigits_bls →"):]
    triton = next(ln for ln in bls.splitlines() if "Triton digits_raw v1" in ln)
    computed = float(triton.split("compute ")[1].split(" s")[0])
    assert computed > 0, triton  # Triton's compute for the version beside the guards' call time
    as_json = json.loads(CliRunner().invoke(app, ["status", "--json", *where]).output)
    guard = next(g for g in as_json["guards"] if g["model"] == "digits_bls")
    assert guard["triton_stats"]["1"]["executions"] > 0
    assert set(guard["metrics"]["cost"]["1"]) == set(TENANTS)


def charged(env) -> float:
    """Requests the digits guard charged so far, every version and tenant."""
    return sum(v for k, v in cost_series(env, "digits").items() if k[0] == "tritonguard_cost_requests_total")


def readings(env, candidate: int, requests: float, timeout: float = 15.0) -> GuardReadings:
    """The gates' reading of digits once the counters show ``requests`` charged in all."""
    deadline = time.monotonic() + timeout
    while charged(env) < requests and time.monotonic() < deadline:
        time.sleep(0.3)
    return GuardReadings.from_scrapes([series(env)], "digits", 1, candidate, target="digits_raw")


@pytest.mark.parametrize(("candidate", "verdict"), [(SLOW, FAIL), (SAME, PASS)])
def test_the_cost_gate_judges_a_candidate_at_half_the_traffic(env, candidate, verdict):
    apply(env["repo"], "digits", RouteChange(candidate=candidate, share=0.5))
    try:
        time.sleep(1.0)  # > routing.poll_interval_s, and the version's goldens run first
        start = charged(env)
        warm = send(env, "digits", 64, seed=candidate)  # both versions warm
        before = readings(env, candidate, start + warm)
        parts0 = cost_series(env, "digits")
        n = send(env, "digits", 800, seed=10 + candidate)
        after = readings(env, candidate, start + warm + n)
        parts1 = cost_series(env, "digits")
    finally:
        apply(env["repo"], "digits", RouteChange(candidate=0))
    report = evaluate(before, after, GateConfig(max_cost_increase=0.10, min_requests=200, latency=False,
                                                min_agreement=None), share=0.5)
    gate = next(g for g in report.gates if g.name == "cost")
    # per request and part, each version: where a difference comes from
    split = {}
    for v in ("1", str(candidate)):
        reqs = sum(parts1.get(k, 0) - parts0.get(k, 0) for k in parts1
                   if k[0] == "tritonguard_cost_requests_total" and k[1] == v)
        for part in ("guard", "target"):
            secs = sum(parts1.get(k, 0) - parts0.get(k, 0) for k in parts1
                       if k[0] == "tritonguard_compute_seconds_total" and k[1] == v and k[3] == part)
            split[f"v{v} {part} ms/request"] = round(1000 * secs / reqs, 4) if reqs else None
    REPORT[f"gate v{candidate}"] = {"verdict": gate.verdict, "reason": gate.reason, "figures": gate.figures,
                                    "split": split}
    assert gate.figures["candidate_requests"] + gate.figures["primary_requests"] == n, gate.figures
    assert gate.verdict == verdict, gate

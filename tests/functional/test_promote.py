"""``exporter promote`` / ``rollback`` / ``rollout`` against a real tritonserver under live traffic.

One server serves a private repository: digits v1 (the base model, primary), a good v2, seeded
faults (NaN, accuracy drop, 2x slower) and two more good versions. The digits guard runs with the
tiered cache (L1 + encrypted L2 SQLite) so that purging is observable. Every rollout runs as a
subprocess (`python -m exporter …`, as a user runs it) while a traffic thread keeps requests in
flight; the gates read the guard's metrics from the server's metrics port. Dwell times, sample
minimums and the error-rate bound (5 %: SPRT needs ~90 clean requests per step instead of ~460
at 1 %) are shortened so that a rollout takes seconds, not the production default of 30 minutes.

The tests run in file order and share the server: each one starts from the state the previous
left (noted in each).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from exporter.build.export import export
from tritonguard.core.repository import read_config, write_config
from tritonguard.ops.server import Server

pytestmark = pytest.mark.functional

ROOT = Path(__file__).resolve().parents[2]
KEY_HEX = "5e" * 32
GATES = ["--dwell-s", "2", "--interval-s", "1", "--min-requests", "60", "--max-error-rate", "0.05",
         "--min-compared", "40", "--min-latency-samples", "30", "--max-step-s", "90"]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    from examples import faults

    base = tmp_path_factory.mktemp("promote")
    repo = base / "repo"
    v = {"base": export(faults.base(), name="digits", repository=repo, source="examples.faults:base").version}
    v["good"] = export(faults.good(), name="digits", repository=repo, source="examples.faults:good").version
    for name in ("nan_subset", "accuracy_drop", "slow"):
        v[name] = export(getattr(faults, name)(), name="digits", repository=repo,
                         source=f"examples.faults:{name}").version
    # further copies of "good" on purpose (force: the same artifact as v["good"])
    v["good_b"] = export(faults.good(), name="digits", repository=repo, source="examples.faults:good",
                         force=True).version
    v["good_c"] = export(faults.good(), name="digits", repository=repo, source="examples.faults:good",
                         force=True).version

    cfg = read_config(repo / "digits")
    params = {k: x["string_value"] for k, x in cfg["parameters"].items()}
    l2 = base / "cache" / "l2.sqlite"
    params.update({
        "target_version": str(v["base"]),
        "routing.poll_interval_s": "0.2",
        "breaker.window": "200", "breaker.min_requests": "20", "breaker.min_compared": "40",
        "breaker.max_fail_rate": "0.015", "breaker.max_error_rate": "0.05", "breaker.max_nan_rate": "0.0",
        "routing.latency_ratio": "2.0", "breaker.min_off_s": "300",
        "cache.enabled": "true", "cache.privacy": "persisted_encrypted", "cache.l2_path": str(l2),
    })
    cfg["parameters"] = {k: {"string_value": x} for k, x in params.items()}
    write_config(repo / "digits", cfg)

    server = Server(repository=repo, log_path=base / "logs" / "tritonserver.log",
                    env={**os.environ, "TRITONGUARD_L2_ENCRYPTION_KEY": KEY_HEX})
    server.start(wait_models=["digits", "digits_raw"])
    client = httpclient.InferenceServerClient(server.http_url, concurrency=8)
    images, labels = faults.load_all()
    yield {"repo": repo, "v": v, "server": server, "client": client, "images": images, "labels": labels,
           "l2": l2, "base": base}
    client.close()
    server.stop()


def cli(ctx, *args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", *args, "--repository", str(ctx["repo"])],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)


def server_args(ctx) -> list[str]:
    return ["--server", ctx["server"].http_url, "--metrics-url", ctx["server"].metrics_url]


def state(ctx) -> dict:
    return json.loads((ctx["repo"] / "digits" / "rollout_state.json").read_text())


def progress(ctx) -> dict:
    return json.loads((ctx["repo"] / "digits" / "rollout_controller.json").read_text())


def registry(ctx):
    from exporter.records.registry import Registry, default_uri

    return Registry(default_uri(ctx["repo"]))


def infer(ctx, x: np.ndarray) -> tuple[np.ndarray, str]:
    inp = httpclient.InferInput("IMAGE", [1, 8, 8], "FP32")
    inp.set_data_from_numpy(x[None].astype(np.float32))
    r = ctx["client"].infer("digits", [inp], outputs=[httpclient.InferRequestedOutput("PROBS"),
                                                       httpclient.InferRequestedOutput("SERVED_BY")])
    return r.as_numpy("PROBS")[0], r.as_numpy("SERVED_BY")[0, 0].decode()


class Traffic:
    """Requests of one noisy image each (so every one misses the cache), 8 in flight, until
    stopped or ``max_s`` passed. Counts answers, errors, and who served."""

    def __init__(self, ctx, max_s: float = 240.0, seed: int = 0):
        self.ctx, self.max_s = ctx, max_s
        self.rng = np.random.default_rng(seed)
        self.sent = self.ok = 0
        self.errors: list[str] = []
        self.served: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "traffic thread did not stop"

    def _run(self) -> None:
        # a client of its own: geventhttpclient's connections belong to the thread that made them
        client = httpclient.InferenceServerClient(self.ctx["server"].http_url, concurrency=8)
        try:
            self._loop(client)
        finally:
            client.close()

    def _loop(self, client) -> None:
        images = self.ctx["images"]
        deadline = time.monotonic() + self.max_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            idx = self.rng.integers(0, len(images), 8)
            futures = []
            for i in idx:
                x = np.clip(images[i] + self.rng.normal(0, 0.05, (8, 8)), 0, 16).astype(np.float32)
                inp = httpclient.InferInput("IMAGE", [1, 8, 8], "FP32")
                inp.set_data_from_numpy(x[None])
                futures.append(client.async_infer("digits", [inp], outputs=[
                    httpclient.InferRequestedOutput("PROBS"), httpclient.InferRequestedOutput("SERVED_BY")]))
            for f in futures:
                self.sent += 1
                try:
                    r = f.get_result(timeout=30)
                    who = r.as_numpy("SERVED_BY")[0, 0].decode()
                    self.served[who] = self.served.get(who, 0) + 1
                    self.ok += 1
                except InferenceServerException as exc:
                    self.errors.append(str(exc))

    def report(self) -> dict:
        return {"sent": self.sent, "ok": self.ok, "errors": len(self.errors), "served": self.served,
                "first_errors": self.errors[:3]}


def l2_rows(ctx, model: str = "digits") -> int:
    if not ctx["l2"].exists():
        return 0
    with sqlite3.connect(ctx["l2"]) as db:
        return db.execute("SELECT count(*) FROM entries WHERE model = ?", (model,)).fetchone()[0]


# -- tests (in order) -------------------------------------------------------------------------------
def test_good_version_reaches_production_through_every_step(ctx):
    """v1 primary -> the good v2 walks 10 -> 50 -> 100 % and becomes PRODUCTION; no user sees an error."""
    v1, v2 = ctx["v"]["base"], ctx["v"]["good"]
    t0 = time.monotonic()
    with Traffic(ctx) as traffic:
        r = cli(ctx, "promote", "digits", "--version", str(v2), "--steps", "10,50,100", *GATES, *server_args(ctx))
    took = time.monotonic() - t0
    print(f"good rollout: {took:.1f} s, traffic {traffic.report()}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done" in r.stdout
    for step in ("step 2: 50%", "step 3: 100%"):
        assert step in r.stderr, r.stderr
    st = state(ctx)
    assert st["primary"]["version"] == v2 and st["candidate"] is None
    assert st["previous_primary"] == v1
    assert progress(ctx)["status"] == "done"
    reg = registry(ctx)
    assert reg.stage("digits", v2) == "PRODUCTION"
    assert reg.stage("digits", v1) == "ARCHIVED"
    assert reg.production("digits") == v2
    assert not traffic.errors, traffic.report()
    assert traffic.served.get(f"digits_raw:{v2}", 0) > 0 and traffic.served.get(f"digits_raw:{v1}", 0) > 0
    assert traffic.sent == traffic.ok
    # every registration and transition is on the chained history
    assert reg.verify_history().ok
    assert [h["to"] for h in reg.history("digits") if h["type"] == "transition"][-1] == "PRODUCTION"


def test_rollback_restores_answers_and_purges_the_cache(ctx):
    """From v2 primary: `rollback` makes v1 primary and PRODUCTION again, and the cache forgets v2."""
    v1, v2 = ctx["v"]["base"], ctx["v"]["good"]
    x = ctx["images"][:12]
    for _ in range(2):  # the second pass is answered from the cache
        served = [infer(ctx, img)[1] for img in x]
    assert served == [f"cache:digits_raw:{v2}"] * len(x)
    assert l2_rows(ctx) >= len(x)
    epoch = state(ctx).get("cache_epoch", 0)

    r = cli(ctx, "rollback", "digits", "--reason", "test rollback")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"v{v1} is primary and PRODUCTION again" in r.stdout
    st = state(ctx)
    assert st["primary"]["version"] == v1 and st["cache_epoch"] == epoch + 1
    assert registry(ctx).production("digits") == v1
    assert registry(ctx).stage("digits", v2) == "ARCHIVED"
    assert l2_rows(ctx) == 0, "rollback left the model's L2 rows"
    time.sleep(0.6)  # > routing.poll_interval_s

    import onnxruntime as ort

    sess = ort.InferenceSession(str(ctx["repo"] / "digits_raw" / str(v1) / "model.onnx"),
                                providers=["CPUExecutionProvider"])
    expected = sess.run(["PROBS"], {"IMAGE": x.astype(np.float32)})[0]
    got = [infer(ctx, img) for img in x]
    assert [s for _, s in got] == [f"digits_raw:{v1}"] * len(x), "answers did not come from v1 (or came from a stale cache)"
    np.testing.assert_allclose(np.stack([p for p, _ in got]), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fault", ["nan_subset", "accuracy_drop", "slow"])
def test_bad_version_is_rolled_back_automatically(ctx, fault):
    """From v1 primary: each seeded fault is rolled back and ARCHIVED — NaN and accuracy drop by the
    offline judgement on the evaluation set, before any traffic; slow by a live gate — users see
    <= 1 % errors and every request is answered."""
    v1, bad = ctx["v"]["base"], ctx["v"][fault]
    t0 = time.monotonic()
    with Traffic(ctx, seed=bad) as traffic:
        r = cli(ctx, "promote", "digits", "--version", str(bad), "--steps", "10,50,100", *GATES, *server_args(ctx))
    print(f"{fault}: rolled back after {time.monotonic() - t0:.1f} s at {progress(ctx)['steps'][progress(ctx)['step_index']]} %"
          f" ({progress(ctx)['reason']}); traffic {traffic.report()}")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "rolled_back" in r.stdout
    st = state(ctx)
    assert st["primary"]["version"] == v1 and st["candidate"] is None
    assert registry(ctx).stage("digits", bad) == "ARCHIVED"
    assert registry(ctx).production("digits") == v1
    assert traffic.sent == traffic.ok + len(traffic.errors) and traffic.sent > 0
    assert len(traffic.errors) <= 0.01 * traffic.sent, traffic.report()


def test_concurrent_promotes_one_wins(ctx):
    """Two promotes started at the same moment: exactly one starts a rollout, the other is refused."""
    vb, vc = ctx["v"]["good_b"], ctx["v"]["good_c"]
    env = {**os.environ}
    procs = [subprocess.Popen([sys.executable, "-m", "exporter", "promote", "digits", "--version", str(v),
                               "--detach", *GATES, *server_args(ctx), "--repository", str(ctx["repo"])],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for v in (vb, vc)]
    outs = [p.communicate(timeout=120) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], (codes, outs)
    loser = outs[codes.index(2)]
    assert "abort it first" in loser[1] or "another process" in loser[1], loser
    winner = (vb, vc)[codes.index(0)]
    assert state(ctx)["candidate"]["version"] == winner
    r = cli(ctx, "rollout", "abort", "digits")
    assert r.returncode == 0, r.stdout + r.stderr
    assert state(ctx)["candidate"] is None and progress(ctx)["status"] == "aborted"


def test_killed_controller_resumes_where_it_stopped(ctx):
    """A controller SIGKILLed after its first step: `rollout resume` continues at that step and
    finishes; the good version ends PRODUCTION."""
    v = ctx["v"]["good_b"]
    with Traffic(ctx, seed=7) as traffic:
        r = cli(ctx, "promote", "digits", "--version", str(v), "--detach", "--steps", "10,50,100", *GATES,
                *server_args(ctx))
        assert r.returncode == 0, r.stdout + r.stderr
        assert state(ctx)["candidate"] == {"version": v, "share": 0.1}
        driver = subprocess.Popen([sys.executable, "-m", "exporter", "rollout", "resume", "digits",
                                   *server_args(ctx), "--repository", str(ctx["repo"])], cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 150
        while progress(ctx)["step_index"] < 1 and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        killed_at = progress(ctx)
        assert killed_at["status"] == "running" and killed_at["step_index"] == 1, killed_at
        assert state(ctx)["candidate"] == {"version": v, "share": 0.5}
        r = cli(ctx, "rollout", "status", "digits")
        assert "running" in r.stdout and "step 2/3" in r.stdout, r.stdout
        r = cli(ctx, "rollout", "resume", "digits", *server_args(ctx))
    assert r.returncode == 0, r.stdout + r.stderr
    assert progress(ctx)["status"] == "done"
    assert state(ctx)["primary"]["version"] == v
    assert registry(ctx).production("digits") == v
    assert not traffic.errors, traffic.report()


def test_bad_input_gets_a_clear_error(ctx):
    r = cli(ctx, "promote", "digits", "--version", "99", *server_args(ctx))
    assert r.returncode == 2 and "v99" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli(ctx, "promote", "nosuch", "--version", "1", *server_args(ctx))
    assert r.returncode == 2 and "nosuch" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli(ctx, "promote", "digits", "--version", str(ctx["v"]["good_c"]), "--to", "prod")
    assert r.returncode == 2 and "--to must be staging or production" in r.stderr, r.stderr


def test_status_shows_stages_rollout_gates_and_live_breakers(ctx):
    """After the rollouts above: `status --json` has the registry stages, the last rollout with its
    gate readings and sample counts, and the live breaker states of the server."""
    r = cli(ctx, "status", *server_args(ctx), "--json")
    assert r.returncode == 0, r.stderr
    g = next(x for x in json.loads(r.stdout)["guards"] if x["model"] == "digits")
    v = ctx["v"]
    stages = {int(k): s for k, s in g["stages"].items()}
    assert stages[v["good_b"]] == "PRODUCTION"
    assert all(stages[v[f]] == "ARCHIVED" for f in ("nan_subset", "accuracy_drop", "slow"))
    assert g["state"]["primary"]["version"] == v["good_b"]
    assert g["rollout"]["status"] == "done" and g["rollout"]["candidate"] == v["good_b"]
    gates = {x["name"]: x for x in g["rollout"]["gates"]}
    assert {"error_rate", "breaker", "latency"} <= set(gates) and gates["error_rate"]["samples"] >= 60
    live = g["metrics"]
    assert live["replicas"] == 1 and live["served"].get(f"digits_raw:{v['good_b']}", 0) > 0
    # the breakers of every version the guard routed to, as the metrics port reports them: slow
    # was routed (and tripped); nan_subset and accuracy_drop were rolled back by the offline
    # judgement before any traffic, so the guard never routed them and has no breaker for them
    with urllib.request.urlopen(ctx["server"].metrics_url, timeout=5) as resp:
        raw = resp.read().decode()
    gauges = [(dict(re.findall(r'(\w+)="([^"]*)"', labels)), int(float(value))) for labels, value
              in re.findall(r"^tritonguard_breaker_state\{([^}]*)\} (\S+)$", raw, re.MULTILINE)]
    for f in ("nan_subset", "accuracy_drop", "slow"):
        codes = [c for lab, c in gauges if lab.get("model") == "digits" and lab.get("target_version") == str(v[f])]
        if f == "slow":
            assert codes, f"no breaker gauge for {f} v{v[f]}"
            assert live["breaker"].get(str(v[f])) == max(codes), (f, live["breaker"], codes)
        else:
            assert not codes and str(v[f]) not in live["breaker"], (f, codes, live["breaker"])
    r = cli(ctx, "status", *server_args(ctx))
    assert r.returncode == 0 and "rollout v" in r.stdout and "breaker v" in r.stdout, r.stdout


def test_abn_rollout_gates_each_arm_and_drops_only_the_bad_one(ctx):
    """From good_b primary: `promote --arms good_c=0.3,nan_subset=0.2` walks both arms through the
    steps; the NaN arm fails its own gates and leaves (ARCHIVED), the good one ends at its full
    weight (STAGING: an A/B/n split promotes nobody); users see <= 1 % errors, all answered."""
    v = ctx["v"]
    good, bad = v["good_c"], v["nan_subset"]
    with Traffic(ctx, seed=11) as traffic:
        r = cli(ctx, "promote", "digits", "--arms", f"{good}=0.3,{bad}=0.2", "--steps", "50,100", *GATES,
                *server_args(ctx))
    print(f"abn: {progress(ctx)['reason']}; traffic {traffic.report()}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done" in r.stdout and f"v{bad}=0.2 (rolled_back)" in r.stdout, r.stdout
    p = progress(ctx)
    assert p["mode"] == "abn" and p["status"] == "done"
    assert p["arms"][str(bad)]["status"] == "rolled_back" and p["arms"][str(good)]["status"] == "running"
    st = state(ctx)
    assert st["arms"] == [{"version": good, "weight": 0.3}] and st["candidate"] is None
    assert st["primary"]["version"] == v["good_b"]
    reg = registry(ctx)
    assert reg.stage("digits", bad) == "ARCHIVED" and reg.stage("digits", good) == "STAGING"
    assert reg.production("digits") == v["good_b"]
    assert traffic.served.get(f"digits_raw:{good}", 0) > 0
    assert traffic.sent == traffic.ok + len(traffic.errors) and traffic.sent > 0
    assert len(traffic.errors) <= 0.01 * traffic.sent, traffic.report()
    r = cli(ctx, "status", *server_args(ctx))
    assert r.returncode == 0 and f"v{good}=0.3 running" in r.stdout, r.stdout
    # the experiment ends by hand: no arms, good_b answers everything again
    r = cli(ctx, "route", "digits", "--arms", "none")
    assert r.returncode == 0 and state(ctx)["arms"] == [], r.stdout + r.stderr

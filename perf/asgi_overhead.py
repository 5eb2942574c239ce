"""What GuardMiddleware costs a FastAPI service: the same app bare and guarded, each under its own
uvicorn on a loopback port, measured in turn by one closed-loop client at the same concurrency.

The client: ``concurrency`` threads, each with a keep-alive ``http.client`` connection, POSTing a
small JSON body (with an e-mail in it, so redaction has work) to ``/predict`` for ``--seconds``.
The guarded app runs the middleware with its defaults plus a per-tenant quota far above the load
(admission is exercised, never refused), output redaction and an audit log. Read the ratio
(guarded / bare requests per second): on a shared 2-core machine the client shares the cores
with the server, so absolute figures drift between runs.

``--topology process`` (the default) runs uvicorn in a process of its own, as a service is
deployed; ``--topology thread`` runs it in a thread of the client's process (the setup of the
first measurement), where the client's 8 threads share the server's GIL. With a process, the
server's CPU time per request is read too (``/proc``, Linux): bare / guarded CPU per request
is the throughput ratio a CPU-bound server reaches (it moves with the machine's load too).

``--handler sklearn`` gives ``/predict`` a scikit-learn pipeline to run (what a scoring
service's handler does) instead of a sum: the middleware's cost against a handler that does work.

    .venv/bin/python -m perf.asgi_overhead [--concurrency 8] [--seconds 5] [--rounds 2] [--topology process]
                                           [--handler echo|sklearn]
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request

from tritonguard.hosts.asgi import GuardMiddleware
from tritonguard.ops.server import free_port

BODY = json.dumps({"text": "please score this for jane.doe@example.com", "features": [0.1, 0.2, 0.3]}).encode()


FEATURES = ("quota", "redaction", "audit")


HANDLERS = ("echo", "sklearn")


def scorer() -> Any:
    """What a scoring service's handler runs per request for ``--handler sklearn``: a
    scikit-learn pipeline (scaler, logistic regression) fitted here on 3 features, seed 0."""
    import numpy as np  # noqa: PLC0415
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415
    from sklearn.pipeline import make_pipeline  # noqa: PLC0415
    from sklearn.preprocessing import StandardScaler  # noqa: PLC0415

    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 3))
    y = (x @ np.array([1.0, -2.0, 0.5]) + rng.normal(scale=0.5, size=500) > 0).astype(int)
    return make_pipeline(StandardScaler(), LogisticRegression()).fit(x, y)


def make_app(guarded: bool, workdir: Path, without: tuple[str, ...] = (), handler: str = "echo") -> FastAPI:
    """The service: ``/predict`` sums the features (``echo``: the handler costs next to nothing,
    so the middleware's share is the largest it can be) or scores them with a scikit-learn
    pipeline (``sklearn``: what a scoring service's handler does)."""
    app = FastAPI()
    model = scorer() if handler == "sklearn" else None

    @app.post("/predict")
    async def predict(request: Request):
        got = await request.json()
        if model is None:
            return {"score": sum(got["features"]), "echo": got["text"]}
        return {"score": float(model.predict_proba([got["features"]])[0, 1]), "echo": got["text"]}

    if guarded:
        config: dict[str, object] = {"target": "bench"}
        if "quota" not in without:
            config["tenancy.quotas"] = {"*": {"rps": 1e6, "burst": 1000000}}
        config.update({"redaction.enabled": False} if "redaction" in without else {"redaction.redact_outputs": True})
        if "audit" not in without:
            config["audit.path"] = str(workdir / "audit.jsonl")
        app.add_middleware(GuardMiddleware, config=config, repository=workdir)
    return app


def _run_server(guarded: bool, workdir: str, port: int, without: tuple[str, ...], handler: str) -> None:
    """The child process of ``--topology process``: one uvicorn, until it is terminated."""
    uvicorn.run(make_app(guarded, Path(workdir), without, handler), host="127.0.0.1", port=port, lifespan="on",
                log_level="warning", access_log=False)


class ServedProcess:
    """The app under uvicorn in a process of its own (spawned: nothing of the client's state)."""

    def __init__(self, guarded: bool, workdir: Path, without: tuple[str, ...] = (), handler: str = "echo"):
        self.port = free_port()
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=_run_server, args=(guarded, str(workdir), self.port, without, handler),
                                daemon=True)

    def __enter__(self) -> ServedProcess:
        self.proc.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if not self.proc.is_alive() or time.monotonic() > deadline:
                    self.proc.kill()
                    raise SystemExit("uvicorn did not start") from None
                time.sleep(0.05)

    def cpu_s(self) -> float | None:
        """The server process's CPU seconds so far (user + system), None where /proc has none."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()  # SIGTERM: uvicorn's graceful shutdown, the lifespan closes the guard
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class Served:
    """The app under uvicorn in a thread of this process (``--topology thread``)."""

    def __init__(self, app: FastAPI):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, lifespan="on",
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise SystemExit("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def load(port: int, concurrency: int, seconds: float) -> tuple[float, int, int]:
    """Requests per second over ``seconds``, how many answers were not 200, and how many in all."""
    stop = time.monotonic() + seconds
    counts = [0] * concurrency
    errors = [0] * concurrency

    def worker(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while time.monotonic() < stop:
            conn.request("POST", "/predict", body=BODY, headers={"content-type": "application/json",
                                                                  "x-tenant-id": f"t{k % 4}"})
            r = conn.getresponse()
            r.read()
            counts[k] += 1
            errors[k] += r.status != 200
        conn.close()

    start = time.monotonic()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - start), sum(errors), sum(counts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--topology", choices=("process", "thread"), default="process",
                    help="uvicorn in a process of its own (default) or in a thread of the client's process")
    ap.add_argument("--without", default="", metavar="FEATURES",
                    help=f"guarded app without these (comma-separated: {', '.join(FEATURES)}), to see each one's share")
    ap.add_argument("--handler", choices=HANDLERS, default="echo",
                    help="what /predict does: sum the features (echo) or score them with a scikit-learn pipeline")
    args = ap.parse_args(argv)
    without = tuple(f for f in args.without.split(",") if f)
    unknown = [f for f in without if f not in FEATURES]
    if unknown:
        ap.error(f"--without: unknown feature {unknown[0]!r} (known: {', '.join(FEATURES)})")
    with tempfile.TemporaryDirectory() as tmp:
        results: dict[str, list[float]] = {"bare": [], "guarded": []}
        cpu: dict[str, list[float]] = {"bare": [], "guarded": []}
        for _ in range(args.rounds):
            for name in ("bare", "guarded"):
                guarded = name == "guarded"
                served = (ServedProcess(guarded, Path(tmp), without, args.handler) if args.topology == "process"
                          else Served(make_app(guarded, Path(tmp), without, args.handler)))
                with served as s:
                    load(s.port, args.concurrency, 1.0)  # warm-up
                    before = s.cpu_s() if isinstance(s, ServedProcess) else None
                    rps, errors, n = load(s.port, args.concurrency, args.seconds)
                    after = s.cpu_s() if isinstance(s, ServedProcess) else None
                if errors:
                    raise SystemExit(f"{name}: {errors} answers were not 200")
                results[name].append(rps)
                per = ""
                if before is not None and after is not None and n:
                    cpu[name].append((after - before) / n)
                    per = f", server CPU {cpu[name][-1] * 1e6:6.0f} us/request"
                sys.stdout.write(f"{name:8s} {rps:9.1f} req/s  (concurrency {args.concurrency}{per})\n")
                sys.stdout.flush()
    bare, guarded = max(results["bare"]), max(results["guarded"])
    sys.stdout.write(f"guarded / bare: {guarded / bare:.2f}  (best of {args.rounds} rounds each, "
                     f"server in a {args.topology}, handler {args.handler})\n")
    if cpu["bare"] and cpu["guarded"]:
        b, g = min(cpu["bare"]), min(cpu["guarded"])
        sys.stdout.write(f"server CPU per request: bare {b * 1e6:.0f} us, guarded {g * 1e6:.0f} us, "
                         f"bare / guarded {b / g:.2f}  (least of {args.rounds} rounds each)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What GuardMiddleware costs a FastAPI service: the same app bare and guarded, each under its own
uvicorn on a loopback port, measured in turn by one closed-loop client at the same concurrency.

The client: ``concurrency`` threads, each with a keep-alive ``http.client`` connection, POSTing a
small JSON body (with an e-mail in it, so redaction has work) to ``/predict`` for ``--seconds``.
The guarded app runs the middleware with its defaults plus a per-tenant quota far above the load
(admission is exercised, never refused), output redaction and an audit log. Read the ratio
(guarded / bare requests per second): on a shared 2-core machine the client shares the cores
with the server, so absolute figures drift between runs.

    .venv/bin/python -m perf.asgi_overhead [--concurrency 8] [--seconds 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request

from tritonguard.hosts.asgi import GuardMiddleware
from tritonguard.ops.server import free_port

BODY = json.dumps({"text": "please score this for jane.doe@example.com", "features": [0.1, 0.2, 0.3]}).encode()


def make_app(guarded: bool, workdir: Path) -> FastAPI:
    app = FastAPI()

    @app.post("/predict")
    async def predict(request: Request):
        got = await request.json()
        return {"score": sum(got["features"]), "echo": got["text"]}

    if guarded:
        app.add_middleware(GuardMiddleware, config={
            "target": "bench", "tenancy.quotas": {"*": {"rps": 1e6, "burst": 1000000}},
            "redaction.redact_outputs": True, "audit.path": str(workdir / "audit.jsonl")}, repository=workdir)
    return app


class Served:
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


def load(port: int, concurrency: int, seconds: float) -> tuple[float, int]:
    """Requests per second over ``seconds`` and how many answers were not 200."""
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
    return sum(counts) / (time.monotonic() - start), sum(errors)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results: dict[str, list[float]] = {"bare": [], "guarded": []}
        for _ in range(args.rounds):
            for name in ("bare", "guarded"):
                with Served(make_app(name == "guarded", Path(tmp))) as s:
                    load(s.port, args.concurrency, 1.0)  # warm-up
                    rps, errors = load(s.port, args.concurrency, args.seconds)
                if errors:
                    raise SystemExit(f"{name}: {errors} answers were not 200")
                results[name].append(rps)
                sys.stdout.write(f"{name:8s} {rps:9.1f} req/s  (concurrency {args.concurrency})\n")
                sys.stdout.flush()
    bare, guarded = max(results["bare"]), max(results["guarded"])
    sys.stdout.write(f"guarded / bare: {guarded / bare:.2f}  (best of {args.rounds} rounds each)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

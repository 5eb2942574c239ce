"""What the guard costs a Ray Serve application: the exported digits model served by a plain Ray
Serve deployment and by :func:`tritonguard.hosts.ray_serve.guarded`, side by side in one
in-process Ray, measured in turn by one closed-loop client at the same concurrency.

Both deployments load the same ``model.onnx`` (digits_raw v1, copied with its config into a
scratch repository so the rollout state and audit log land there, not in the exported one), use
``@serve.batch`` with the same limits (the model config's ``max_batch_size`` 64 and 500 µs wait)
and ``max_ongoing_requests=64``, and parse / answer the same KServe v2 JSON. The guarded one also
runs its defaults plus a per-tenant quota far above the load (admission runs, never refuses), the
input range check and an audit log.

The client: ``concurrency`` threads, each with a keep-alive ``http.client`` connection to Ray
Serve's HTTP proxy on 127.0.0.1, POSTing one 8x8 image per request for ``--seconds``. Read the
ratio (guarded / plain requests per second; the best of each, and the median of the ratios of
back-to-back rounds): client, proxy and replicas share the machine's cores, so absolute figures
drift between runs.

    .venv/bin/python -m perf.ray_serve_overhead [--concurrency 8] [--seconds 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tritonguard.ops.server import free_port

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "model_repository" / "digits_raw"
MODEL = "digits_raw"


def body() -> bytes:
    from sklearn.datasets import load_digits  # noqa: PLC0415

    x = load_digits().images[:1].astype(np.float32)
    return json.dumps({"inputs": [{"name": "IMAGE", "shape": [1, 8, 8], "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()


def plain_app(model_path: str):
    """The same model in a plain Ray Serve deployment: KServe v2 JSON in and out, @serve.batch."""
    from ray import serve  # noqa: PLC0415
    from starlette.requests import Request  # noqa: PLC0415
    from starlette.responses import JSONResponse  # noqa: PLC0415

    @serve.deployment(name="plain_digits", max_ongoing_requests=64)
    class PlainDigits:
        def __init__(self, path: str):
            import onnxruntime as ort  # noqa: PLC0415

            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            opts.inter_op_num_threads = 1
            self.session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])

        async def __call__(self, request: Request):
            doc = json.loads(await request.body())
            (t,) = doc["inputs"]
            x = np.asarray(t["data"], dtype=np.float32).reshape(t["shape"])
            y = await self.run(x)
            return JSONResponse({"model_name": MODEL, "model_version": "1", "outputs": [
                {"name": "PROBS", "datatype": "FP32", "shape": list(y.shape), "data": y.ravel().tolist()}]})

        @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.0005)
        async def run(self, xs: list[np.ndarray]) -> list[np.ndarray]:
            fused = np.concatenate(xs)
            (probs,) = self.session.run(["PROBS"], {"IMAGE": fused})
            starts = np.cumsum([0] + [len(x) for x in xs])
            return [probs[starts[i]:starts[i + 1]] for i in range(len(xs))]

    return PlainDigits.bind(model_path)


def load(port: int, path: str, payload: bytes, concurrency: int, seconds: float) -> tuple[float, int]:
    """Requests per second over ``seconds`` and how many answers were not 200."""
    stop = time.monotonic() + seconds
    counts = [0] * concurrency
    errors = [0] * concurrency

    def worker(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while time.monotonic() < stop:
            conn.request("POST", path, body=payload, headers={"content-type": "application/json",
                                                                "x-tenant-id": f"t{k % 4}"})
            r = conn.getresponse()
            r.read()
            if r.status == 200:
                counts[k] += 1
            else:
                errors[k] += 1
        conn.close()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - t0), sum(errors)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    if not (SOURCE / "1" / "model.onnx").is_file():
        sys.stderr.write(f"no exported {MODEL} (run `make models` first)\n")
        return 2

    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    from tritonguard.hosts.ray_serve import guarded  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="ray_serve_bench_") as tmp:
        repo = Path(tmp)
        (repo / MODEL / "1").mkdir(parents=True)
        shutil.copy(SOURCE / "config.pbtxt", repo / MODEL / "config.pbtxt")
        for name in ("model.onnx", "manifest.json"):
            shutil.copy(SOURCE / "1" / name, repo / MODEL / "1" / name)
        port = free_port()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(plain_app(str(repo / MODEL / "1" / "model.onnx")), name="plain", route_prefix="/plain")
            serve.run(guarded(MODEL, repository=repo, config={
                "tenancy.quotas": {"*": {"rps": 1e6, "burst": 1000000}}, "validation.range.IMAGE": "0,16",
                "audit.path": str(repo / "audit.jsonl")}), name="guarded", route_prefix="/guarded")
            payload = body()
            for path in ("/plain/infer", "/guarded/infer"):  # warm both: first calls pay for imports
                load(port, path, payload, args.concurrency, 1.0)
            best: dict[str, float] = {"plain": 0.0, "guarded": 0.0}
            ratios: list[float] = []
            for _ in range(args.rounds):
                got: dict[str, float] = {}
                for name in ("plain", "guarded"):
                    rps, errors = load(port, f"/{name}/infer", payload, args.concurrency, args.seconds)
                    if errors:
                        raise SystemExit(f"{name}: {errors} answers were not 200")
                    best[name] = max(best[name], rps)
                    got[name] = rps
                    sys.stdout.write(f"{name:<8} {rps:7.1f} req/s  (concurrency {args.concurrency})\n")
                    sys.stdout.flush()
                ratios.append(got["guarded"] / got["plain"])
        finally:
            serve.shutdown()
            ray.shutdown()
    sys.stdout.write(f"guarded / plain: {best['guarded'] / best['plain']:.2f}  (best of {args.rounds} rounds each); "
                     f"median of the rounds' ratios {float(np.median(ratios)):.2f}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

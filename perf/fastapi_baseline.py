"""minilm served three ways, measured from outside with one HTTP client: a FastAPI + uvicorn
micro-batching server (the same ONNX encoder and tokenizer files, what a team would write
without Triton), Triton's guarded ``minilm`` and its raw ``minilm_raw``.

The client is the one issue 33 used: closed loop, ``concurrency`` threads, each with its own
keep-alive HTTP connection, one sentence per KServe v2 JSON request, for ``--seconds`` per
measurement. The three servers are measured in turn, ``--rounds`` times, on one machine in one
run; read the ratios (a shared 2-core machine drifts in absolute figures, and the client's JSON
work shares those cores with every server alike).

The FastAPI server (``serve``) batches like Triton's dynamic batcher: requests that arrive
while a batch runs, or within ``--delay-ms`` of the first, go in the next batch (at most
``--max-batch`` rows); one worker thread tokenises (padding to the batch's longest sentence, as
the ``tokenizer`` backend does) and runs onnxruntime with the encoder's thread count from its
config.

    .venv/bin/python -m perf.fastapi_baseline [--concurrency 16] [--sentences 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

# at module level: FastAPI reads the endpoint's annotations (strings here) from this module's names
from fastapi import Request

from tritonguard.core.repository import read_config
from tritonguard.ops.server import Server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"
MODEL = "minilm"  # the model name the FastAPI server answers to, as Triton's guarded one


# -- the FastAPI server ----------------------------------------------------------------------
def _latest(folder: Path) -> Path:
    versions = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())
    if not versions:
        raise SystemExit(f"no version folder in {folder}: run `make setup` first")
    return folder / str(versions[-1])


def app(repo: Path, max_batch: int, delay_ms: float) -> Any:
    import onnxruntime as ort  # noqa: PLC0415
    from fastapi import FastAPI, HTTPException  # noqa: PLC0415
    from fastapi.responses import Response  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    enc_cfg = read_config(repo / "minilm_encoder")
    tok_cfg = read_config(repo / "minilm_tokenizer")
    params = {k: v["string_value"] for k, v in enc_cfg.get("parameters", {}).items()}
    tparams = {k: v["string_value"] for k, v in tok_cfg.get("parameters", {}).items()}
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = int(params.get("intra_op_threads", "1"))
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(_latest(repo / "minilm_encoder") / "model.onnx"), opts,
                                   providers=["CPUExecutionProvider"])
    tokenizer = AutoTokenizer.from_pretrained(str(_latest(repo / "minilm_tokenizer") / tparams.get("tokenizer_dir",
                                                                                                   "tokenizer")))
    max_length = int(tparams.get("max_length", "256"))
    out_name = session.get_outputs()[0].name
    queue: asyncio.Queue[tuple[list[str], asyncio.Future]] = asyncio.Queue()

    def run(texts: list[str]) -> np.ndarray:
        enc = tokenizer(texts, padding="longest", truncation=True, max_length=max_length, return_tensors="np")
        feed = {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}
        return session.run([out_name], feed)[0]

    async def batcher() -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await queue.get()]
            rows = len(items[0][0])
            deadline = loop.time() + delay_ms / 1000
            while rows < max_batch:
                timeout = deadline - loop.time()
                try:
                    item = queue.get_nowait() if timeout <= 0 else await asyncio.wait_for(queue.get(), timeout)
                except (asyncio.QueueEmpty, TimeoutError):
                    break
                items.append(item)
                rows += len(item[0])
            texts = [t for ts, _ in items for t in ts]
            try:
                out = await loop.run_in_executor(None, run, texts)
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the error
                for _, fut in items:
                    fut.set_exception(exc)
                continue
            k = 0
            for ts, fut in items:
                fut.set_result(out[k:k + len(ts)])
                k += len(ts)

    @contextlib.asynccontextmanager
    async def lifespan(_api: Any) -> Any:
        # one worker thread runs the batches in turn, like one encoder instance
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))
        task = asyncio.create_task(batcher())
        yield
        task.cancel()

    api = FastAPI(lifespan=lifespan)

    @api.get("/v2/health/ready")
    async def ready() -> dict:
        return {}

    @api.post(f"/v2/models/{MODEL}/infer")
    async def infer(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            tensor = next(t for t in body["inputs"] if t["name"] == "TEXT")
            texts = [str(x) for x in tensor["data"]]
        except (ValueError, KeyError, StopIteration, TypeError) as exc:
            raise HTTPException(400, f"input 'TEXT': expected a KServe v2 BYTES tensor ({exc})") from None
        if not texts or len(texts) > max_batch:
            raise HTTPException(400, f"input 'TEXT': 1..{max_batch} sentences per request")
        fut = asyncio.get_running_loop().create_future()
        await queue.put((texts, fut))
        emb = await fut
        return Response(json.dumps({"model_name": MODEL, "outputs": [
            {"name": "EMBEDDING", "datatype": "FP32", "shape": list(emb.shape), "data": emb.ravel().tolist()}]}),
            media_type="application/json")

    return api


def serve(repo: Path, port: int, max_batch: int, delay_ms: float) -> None:
    import uvicorn  # noqa: PLC0415

    uvicorn.run(app(repo, max_batch, delay_ms), host="127.0.0.1", port=port, log_level="warning",
                access_log=False)


# -- the client ------------------------------------------------------------------------------
def load(port: int, model: str, texts: list[str], concurrency: int, seconds: float) -> dict[str, float]:
    """Closed loop: ``concurrency`` threads, each sending one sentence per request in turn over
    its own keep-alive connection for ``seconds``. Any failed request fails the measurement."""
    bodies = [json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [t]}]}).encode()
              for t in texts]
    path = f"/v2/models/{model}/infer"
    lat: list[list[float]] = [[] for _ in range(concurrency)]
    errors: list[str] = []
    stop = time.perf_counter() + seconds

    def worker(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        j = k
        try:
            while time.perf_counter() < stop and not errors:
                t0 = time.perf_counter()
                conn.request("POST", path, body=bodies[j % len(bodies)], headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 200:
                    errors.append(f"{model}: HTTP {resp.status} {data[:200]!r}")
                    return
                lat[k].append(time.perf_counter() - t0)
                j += concurrency
        except (OSError, http.client.HTTPException) as exc:
            errors.append(f"{model}: {type(exc).__name__}: {exc}")
        finally:
            conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(errors[0])
    all_lat = np.array([x for xs in lat for x in xs]) * 1000
    return {"req_s": len(all_lat) / elapsed, "p50_ms": float(np.percentile(all_lat, 50)),
            "p99_ms": float(np.percentile(all_lat, 99)), "requests": len(all_lat)}


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the FastAPI server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v2/health/ready")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the FastAPI server was not ready within {timeout:.0f} s")


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.fastapi_baseline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--sentences", type=int, default=64, help="varied sentences sent in turn (1: one repeated)")
    ap.add_argument("--seconds", type=float, default=15.0, help="per measurement")
    ap.add_argument("--rounds", type=int, default=2, help="each server this many times, in turn")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--delay-ms", type=float, default=0.5, help="the FastAPI batcher's wait (Triton's queue delay)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the server subprocess
    args = ap.parse_args(argv)
    repo = args.repository.resolve()
    if args.serve:
        serve(repo, args.serve, args.max_batch, args.delay_ms)
        return 0
    from perf.bench import sentences  # noqa: PLC0415

    texts = sentences(args.sentences)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "perf.fastapi_baseline", "--repository", str(repo),
                             "--max-batch", str(args.max_batch), "--delay-ms", str(args.delay_ms), "--serve", str(port)],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows: dict[str, list[dict[str, float]]] = {"fastapi": [], "guarded": [], "raw": []}
    workdir = Path(tempfile.mkdtemp(prefix="fastapi-baseline-"))
    try:
        _wait_ready(port, proc)
        with Server(repository=repo, log_path=workdir / "tritonserver.log") as server:
            server.start(wait_models=["minilm", "minilm_raw"])
            targets = {"fastapi": (port, MODEL), "guarded": (server.http_port, "minilm"),
                       "raw": (server.http_port, "minilm_raw")}
            for p, model in targets.values():  # warm-up: first batches, caches, allocator
                load(p, model, texts, args.concurrency, 3)
            for r in range(args.rounds):
                for name, (p, model) in targets.items():
                    m = load(p, model, texts, args.concurrency, args.seconds)
                    rows[name].append(m)
                    say(f"round {r + 1} {name:8s} {m['req_s']:7.1f} req/s  p50 {m['p50_ms']:6.1f} ms  "
                        f"p99 {m['p99_ms']:6.1f} ms")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    med = {k: {f: float(np.median([m[f] for m in v])) for f in ("req_s", "p50_ms", "p99_ms")} for k, v in rows.items()}
    say(f"\nminilm, c={args.concurrency}, {args.sentences} sentence(s), median of {args.rounds} round(s)")
    say(f"{'server':10s} {'req/s':>8s} {'p99 ms':>8s}")
    for k, m in med.items():
        say(f"{k:10s} {m['req_s']:8.1f} {m['p99_ms']:8.1f}")
    ratios = {"guarded_over_fastapi": med["guarded"]["req_s"] / med["fastapi"]["req_s"],
              "guarded_over_raw": med["guarded"]["req_s"] / med["raw"]["req_s"],
              "raw_over_fastapi": med["raw"]["req_s"] / med["fastapi"]["req_s"],
              "p99_added_over_raw_ms": med["guarded"]["p99_ms"] - med["raw"]["p99_ms"]}
    say("  ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"fastapi-{stamp}.json"
    path.write_text(json.dumps({"concurrency": args.concurrency, "sentences": args.sentences, "seconds": args.seconds,
                                "rounds": rows, "median": med, "ratios": ratios}, indent=2))
    say(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

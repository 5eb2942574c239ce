"""`make soak`: saturate a real tritonserver with mixed traffic for a long time and report what
drifts: failed requests, p99 latency per window, RSS growth per process.

A private server (through the launcher, so under the supervisor) serves a copy of the
repository on free loopback ports. Client threads send, until the deadline, varied real inputs:
``digits`` (load_digits images, 1-4 rows a request) and ``minilm`` (sentences drawn from the
standard library's docstrings), half over HTTP and half over gRPC. Every ``--interval-s`` the RSS
of the server and of each stub (by instance name) is sampled. Growth is measured from the end of
the warm-up (``--warmup-s``) to the last sample. Results go to ``perf/results/soak-<time>.json``.

Goals (exit 1 when missed): 0 failed requests, RSS growth < ``--max-growth`` (5 %) per process.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from examples.texts import stdlib_sentences
from tritonguard.core.repository import mirror
from tritonguard.ops.server import Server
from tritonguard.ops.supervisor.stubs import scan_stubs

RESULTS = Path(__file__).resolve().parent / "results"


def private_copy(src: Path, dest: Path) -> Path:
    """Guards copied (they write state beside their config), everything else linked."""
    return mirror(src, dest)


class Window:
    """Per-window latencies and failures of one model (threads append; the sampler swaps)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lat: dict[str, list[float]] = {}
        self.failed: Counter[str] = Counter()
        self.ok: Counter[str] = Counter()

    def add(self, model: str, seconds: float, error: str | None) -> None:
        with self.lock:
            if error is None:
                self.lat.setdefault(model, []).append(seconds)
                self.ok[model] += 1
            else:
                self.failed[f"{model}: {error[:160]}"] += 1

    def swap(self) -> tuple[dict[str, list[float]], Counter[str], Counter[str]]:
        with self.lock:
            out = (self.lat, self.failed, self.ok)
            self.lat, self.failed, self.ok = {}, Counter(), Counter()
        return out


def client_loop(server: Server, model: str, protocol: str, deadline: float, window: Window, seed: int,
                images: np.ndarray, texts: list[str]) -> None:
    if protocol == "grpc":
        import tritonclient.grpc as mod  # noqa: PLC0415

        client = mod.InferenceServerClient(server.grpc_url)
    else:
        import tritonclient.http as mod  # noqa: PLC0415

        client = mod.InferenceServerClient(server.http_url, connection_timeout=60, network_timeout=60)
    rng = np.random.default_rng(seed)
    try:
        while time.monotonic() < deadline:
            rows = int(rng.integers(1, 5))
            if model == "digits":
                x = images[rng.integers(0, len(images), rows)]
                inp = mod.InferInput("IMAGE", list(x.shape), "FP32")
            else:
                x = np.array([[texts[i].encode()] for i in rng.integers(0, len(texts), rows)], dtype=object)
                inp = mod.InferInput("TEXT", list(x.shape), "BYTES")
            inp.set_data_from_numpy(x)
            t0 = time.perf_counter()
            try:
                client.infer(model, [inp], client_timeout=60) if protocol == "grpc" else client.infer(model, [inp])
                window.add(model, time.perf_counter() - t0, None)
            except Exception as exc:  # noqa: BLE001 - every failure is counted, by message
                window.add(model, time.perf_counter() - t0, f"{protocol} {type(exc).__name__}: {exc}")
                time.sleep(0.05)
    finally:
        client.close()


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def triton_pid(server: Server) -> int | None:
    sup = server.proc.pid
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat[stat.rfind(")") + 2:].split()[1]) != sup:
                continue
            if Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0].endswith(b"bin/tritonserver"):
                return int(entry)
        except (OSError, ValueError):
            continue
    return None


def sample_rss(server: Server) -> dict[str, int]:
    out: dict[str, int] = {}
    pid = triton_pid(server)
    if pid is None:
        return out
    for name, p in (("supervisor", server.proc.pid), ("tritonserver", pid)):
        kb = rss_kb(p)
        if kb is not None:
            out[name] = kb
    for p, stub in scan_stubs({pid}).items():
        kb = rss_kb(p)
        if kb is not None:
            out[stub.instance] = kb
    return out


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q) * 1000) if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repository", type=Path, default=Path("model_repository"))
    ap.add_argument("--duration-s", type=float, default=1800.0)
    ap.add_argument("--interval-s", type=float, default=30.0)
    ap.add_argument("--warmup-s", type=float, default=120.0)
    ap.add_argument("--digits-threads", type=int, default=6)
    ap.add_argument("--minilm-threads", type=int, default=4)
    ap.add_argument("--max-growth", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from sklearn.datasets import load_digits  # noqa: PLC0415

    images = load_digits().images.astype(np.float32)
    texts = stdlib_sentences(2000)
    with tempfile.TemporaryDirectory(prefix="tritonguard-soak-") as tmp:
        repo = private_copy(args.repository.resolve(), Path(tmp) / "repo")
        log = Path(tmp) / "tritonserver.log"
        with Server(repository=repo, log_path=log) as server:
            server.start(wait_models=["digits", "minilm"])
            t_start = time.monotonic()
            deadline = t_start + args.duration_s
            window = Window()
            threads = [threading.Thread(target=client_loop, daemon=True, args=(
                server, model, "grpc" if i % 2 else "http", deadline, window, 1000 * (m + 1) + i, images, texts))
                for m, (model, n) in enumerate((("digits", args.digits_threads), ("minilm", args.minilm_threads)))
                for i in range(n)]
            for t in threads:
                t.start()
            windows: list[dict[str, Any]] = []
            failures: Counter[str] = Counter()
            while time.monotonic() < deadline:
                time.sleep(min(args.interval_s, max(0.0, deadline - time.monotonic())))
                lat, failed, ok = window.swap()
                failures.update(failed)
                w = {"t_s": round(time.monotonic() - t_start, 1), "rss_kb": sample_rss(server),
                     "ok": dict(ok), "failed": sum(failed.values()),
                     "p50_ms": {m: percentile(v, 50) for m, v in lat.items()},
                     "p99_ms": {m: percentile(v, 99) for m, v in lat.items()}}
                windows.append(w)
                say(f"[{w['t_s']:>7.0f} s] ok {dict(ok)} failed {w['failed']} p99 "
                    + " ".join(f"{m}={p:.1f}ms" for m, p in w["p99_ms"].items() if p is not None))
            for t in threads:
                t.join(timeout=90)
            lat, failed, ok = window.swap()
            failures.update(failed)
            server_log_tail = server.tail(40)
    report = summarize(windows, failures, args)
    report["server_log_tail"] = server_log_tail
    out = args.out or RESULTS / f"soak-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print_report(report)
    say(f"results: {out}")
    return 0 if report["goals_met"] else 1


def summarize(windows: list[dict[str, Any]], failures: Counter[str], args: argparse.Namespace) -> dict[str, Any]:
    after = [w for w in windows if w["t_s"] >= args.warmup_s] or windows[-1:]
    first, last = after[0], windows[-1]
    growth = {}
    for name, kb in sorted(last["rss_kb"].items()):
        base = first["rss_kb"].get(name)
        if base:
            growth[name] = {"from_kb": base, "to_kb": kb, "growth": (kb - base) / base}
    drift = {}
    for model in sorted({m for w in after for m in w["p99_ms"]}):
        series = [w["p99_ms"].get(model) for w in after if w["p99_ms"].get(model) is not None]
        if len(series) >= 2:
            k = max(1, len(series) // 4)  # first and last quarter, so one noisy window does not decide
            drift[model] = {"p99_first_ms": float(np.median(series[:k])), "p99_last_ms": float(np.median(series[-k:])),
                            "ratio": float(np.median(series[-k:]) / np.median(series[:k]))}
    total_ok = sum(sum(w["ok"].values()) for w in windows)
    total_failed = sum(failures.values())
    worst = max((g["growth"] for g in growth.values()), default=0.0)
    return {"duration_s": args.duration_s, "requests_ok": total_ok, "requests_failed": total_failed,
            "failures": dict(failures.most_common(20)), "rss_growth": growth, "p99_drift": drift,
            "worst_rss_growth": worst, "windows": windows,
            "goals_met": total_failed == 0 and worst < args.max_growth}


def print_report(r: dict[str, Any]) -> None:
    say(f"\nsoak {r['duration_s']:.0f} s: {r['requests_ok']} requests served, {r['requests_failed']} failed")
    for msg, n in r["failures"].items():
        say(f"  {n:>6}  {msg}")
    say("p99 drift (median of the first vs the last quarter of windows after warm-up):")
    for m, d in r["p99_drift"].items():
        say(f"  {m:<8} {d['p99_first_ms']:8.1f} ms -> {d['p99_last_ms']:8.1f} ms  ({d['ratio']:.2f}x)")
    say("RSS after warm-up -> end:")
    for name, g in r["rss_growth"].items():
        say(f"  {name:<22} {g['from_kb'] / 1024:8.1f} MB -> {g['to_kb'] / 1024:8.1f} MB  ({g['growth']:+.1%})")
    say("goals (0 failed, RSS growth < 5 % per process): " + ("MET" if r["goals_met"] else "MISSED"))


if __name__ == "__main__":
    sys.exit(main())

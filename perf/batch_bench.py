"""``exporter batch`` against perf_analyzer, in one run on one server (digits only).

perf_analyzer measures the guarded model over gRPC at ``--concurrency`` with requests of
``--batch-rows`` rows; then the batch job scores a generated Parquet table of ``--rows`` rows at
the same concurrency and request size. Reported: the job's scoring rate (its rows over the time
from the first block's start to the last block's commit: Ray's start-up is not scoring), its
overall rate, and the peak memory of the job's processes (driver and every
Ray process of its session), RSS summed and PSS summed (RSS counts shared libraries once per
process). Results go to ``perf/results/batch-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from examples.batch_tables import write_digits
from tritonguard.core import repository
from tritonguard.ops.launcher import resolve_perf_analyzer
from tritonguard.ops.server import Server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"


def perf_analyzer_grpc(url: str, model: str, concurrency: int, batch: int) -> float:
    """Inferences (rows) per second of ``model`` at ``concurrency`` requests of ``batch`` rows."""
    binary, _, env = resolve_perf_analyzer([])
    cmd = [binary, "-m", model, "-u", url, "-i", "grpc", "-b", str(batch), "--input-data", "zero",
           "--concurrency-range", str(concurrency), "-p", "5000", "--max-trials", "10", "-s", "30"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=300)
    m = re.search(r"Throughput: ([\d.]+) infer/sec", proc.stdout)
    if not m:
        raise RuntimeError(f"perf_analyzer failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return float(m.group(1))


def _session_memory(sid: int) -> tuple[int, int]:
    rss = pss = 0
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getsid(int(pid)) != sid:
                continue
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except (OSError, ProcessLookupError):
            continue
    return rss, pss


def run_job(grpc_url: str, table: Path, out: Path, concurrency: int, batch: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "exporter", "batch", "digits", "--input", str(table), "--output", str(out),
           "--server", grpc_url, "--concurrency", str(concurrency), "--batch-rows", str(batch), "--json"]
    peak = {"rss": 0, "pss": 0, "driver_rss": 0}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            rss, pss = _session_memory(proc.pid)
            driver = 0
            try:
                driver = int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{proc.pid}/status").read_text()).group(1)) * 1024
            except (OSError, AttributeError):
                pass
            peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)
            peak["driver_rss"] = max(peak["driver_rss"], driver)
            time.sleep(0.5)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    stdout, _ = proc.communicate(timeout=3600)
    done.set()
    t.join()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"batch job failed (rc {proc.returncode})")
    summary = json.loads(stdout)
    return {"rows": summary["rows"], "wall_s": round(wall, 1), "overall_rows_s": round(summary["rows"] / wall, 1),
            "scoring_s": summary["scoring_s"], "scoring_rows_s": summary["scoring_rows_s"],
            "exactly_once": summary["exactly_once"], "peak_rss_mb": round(peak["rss"] / 2**20),
            "peak_pss_mb": round(peak["pss"] / 2**20), "peak_driver_rss_mb": round(peak["driver_rss"] / 2**20)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1_000_000])
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--batch-rows", type=int, default=64)
    p.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    repo = repository.mirror(a.repository, work / "repo")
    for m in repo.iterdir():
        if m.name not in ("digits", "digits_raw"):
            shutil.rmtree(m) if m.is_dir() and not m.is_symlink() else m.unlink()
    result: dict[str, Any] = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "concurrency": a.concurrency, "batch_rows": a.batch_rows, "jobs": []}
    with Server(repository=repo, log_path=work / "tritonserver.log") as srv:
        srv.start(wait_models=("digits",))
        try:
            perf_analyzer_grpc(srv.grpc_url, "digits", a.concurrency, a.batch_rows)  # warm-up
        except RuntimeError:
            pass  # unstable while the server warms up: the measurement below counts
        result["perf_analyzer_rows_s"] = perf_analyzer_grpc(srv.grpc_url, "digits", a.concurrency, a.batch_rows)
        sys.stdout.write(f"perf_analyzer: {result['perf_analyzer_rows_s']:,.0f} rows/s\n")
        for rows in a.rows:
            table = write_digits(work / f"digits-{rows}.parquet", rows)
            job = run_job(srv.grpc_url, table, work / f"out-{rows}", a.concurrency, a.batch_rows)
            job["scoring_vs_perf_analyzer"] = round(job["scoring_rows_s"] / result["perf_analyzer_rows_s"], 3)
            result["jobs"].append(job)
            sys.stdout.write(json.dumps(job) + "\n")
            shutil.rmtree(work / f"out-{rows}")
            table.unlink()
        result["perf_analyzer_after_rows_s"] = perf_analyzer_grpc(srv.grpc_url, "digits", a.concurrency, a.batch_rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"batch-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}.json"
    path.write_text(json.dumps(result, indent=2))
    sys.stdout.write(f"perf_analyzer after: {result['perf_analyzer_after_rows_s']:,.0f} rows/s; results: {path}\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

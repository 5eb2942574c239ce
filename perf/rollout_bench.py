"""The rollout section of `make bench`: one gated rollout of a good digits v2 under perf_analyzer load.

On a private copy of the repository (configs copied, version folders linked; the candidate it
exports never reaches the user's repository), one server, the digits guard pinned to its current
version. perf_analyzer keeps 16 requests in flight the whole time. Measured from Triton's own
counters (``nv_inference_request_success`` / ``_failure`` of the guard), so every request counts:

- throughput before the rollout (a fixed window with no candidate) and during it (from the
  promote command's start to its end), and their ratio;
- user-visible errors during the rollout (failed requests / all requests);
- time from ``exporter promote`` to the candidate being primary at 100 %.

The rollout uses the production gate settings (SPRT at 1 % error rate, 200 requests minimum,
agreement 0.98, rank test on latency) and the default steps 1-5-10-25-50-100 %, with the dwell
shortened from 300 s to 5 s so that the run takes minutes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from exporter.build.export import export
from tritonguard.core import repository
from tritonguard.ops.launcher import resolve_perf_analyzer
from tritonguard.ops.server import Server

from .canary import private_repo

ROOT = Path(__file__).resolve().parents[1]
BEFORE_S = 20.0
DWELL_S = 5
ROLLOUT_TIMEOUT_S = 480


def _counters(server: Server, model: str) -> tuple[float, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()  # noqa: S310 - loopback

    def total(name: str) -> float:
        pat = re.compile(rf'^{name}{{[^}}]*model="{re.escape(model)}"[^}}]*}} ([0-9.e+]+)$', re.M)
        return sum(float(x) for x in pat.findall(text))

    return total("nv_inference_request_success"), total("nv_inference_request_failure")


def _load(server: Server, model: str, data: Path, concurrency: int, log: Path) -> subprocess.Popen:
    """perf_analyzer as a load generator: long windows, never 'stable', stopped by PID."""
    binary, _, env = resolve_perf_analyzer([])
    cmd = [binary, "-m", model, "-u", server.http_url, "-i", "http", "--input-data", str(data),
           "--concurrency-range", str(concurrency), "-p", "10000", "--max-trials", "100", "-s", "0.01"]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115


def run(src_repo: Path, workdir: Path, data: Path, concurrency: int = 16) -> dict:
    repo = private_repo(src_repo, workdir / "rollout_repo")
    primary = repository.latest_version(repo / "digits_raw")
    from examples import faults

    candidate = export(faults.good(), name="digits", repository=repo, source="examples.faults:good").version
    # export rewrote the guard's config: pin the primary after it, or the guard would start on v2
    cfg = repository.read_config(repo / "digits")
    cfg.setdefault("parameters", {})["target_version"] = {"string_value": str(primary)}
    repository.write_config(repo / "digits", cfg)
    result: dict = {"model": "digits", "primary": primary, "candidate": candidate, "concurrency": concurrency,
                    "dwell_s": DWELL_S}
    with Server(repository=repo, log_path=workdir / "rollout-tritonserver.log") as server:
        server.start(wait_models=["digits"])
        load = _load(server, "digits", data, concurrency, workdir / "rollout-perf_analyzer.log")
        try:
            time.sleep(3)  # warm-up
            s0, _, t0 = *_counters(server, "digits"), time.monotonic()
            time.sleep(BEFORE_S)
            s1, f1, t1 = *_counters(server, "digits"), time.monotonic()
            cmd = [sys.executable, "-m", "exporter", "promote", "digits", "--version", str(candidate),
                   "--repository", str(repo), "--server", server.http_url, "--metrics-url", server.metrics_url,
                   "--dwell-s", str(DWELL_S), "--interval-s", "1", "--max-step-s", "240"]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=ROLLOUT_TIMEOUT_S,
                                  env={**os.environ, "MLFLOW_TRACKING_URI": ""})
            s2, f2, t2 = *_counters(server, "digits"), time.monotonic()
            alive = load.poll() is None
        finally:
            load.terminate()
            try:
                load.wait(timeout=30)
            except subprocess.TimeoutExpired:
                load.kill()
    before = (s1 - s0) / (t1 - t0)
    during = (s2 - s1) / (t2 - t1)
    total = (s2 - s1) + (f2 - f1)
    result.update({
        "outcome": "promoted" if proc.returncode == 0 else f"exit {proc.returncode}",
        "time_to_full_promotion_s": round(t2 - t1, 1) if proc.returncode == 0 else None,
        "requests_during": int(total), "failed_during": int(f2 - f1),
        "user_visible_error_rate": (f2 - f1) / total if total else None,
        "throughput_before_ips": round(before, 1), "throughput_during_ips": round(during, 1),
        "during_over_before": round(during / before, 3) if before else None,
        "load_generator_alive": alive, "steps": proc.stderr.count("→ step"),
    })
    if proc.returncode != 0:
        result["promote_output"] = (proc.stdout + proc.stderr)[-2000:]
    return result


def print_rollout(r: dict) -> None:
    from rich.console import Console

    c = Console()
    c.print(f"[bold]rollout under load[/] (digits v{r['primary']} → v{r['candidate']}, c={r['concurrency']}, "
            f"dwell {r['dwell_s']} s per step): {r['outcome']}")
    if r.get("time_to_full_promotion_s") is not None:
        c.print(f"  time to full promotion  {r['time_to_full_promotion_s']} s ({r['steps']} steps)")
    rate = r["user_visible_error_rate"]
    c.print(f"  user-visible errors     {r['failed_during']} of {r['requests_during']}"
            + (f" ({rate:.3%})" if rate is not None else ""))
    c.print(f"  throughput during/before {r['throughput_during_ips']:.0f} / {r['throughput_before_ips']:.0f} inf/s"
            f" = {r['during_over_before']}")
    if not r["load_generator_alive"]:
        c.print("  [yellow]perf_analyzer stopped before the rollout ended: 'during' is understated[/]")
    if "promote_output" in r:
        c.print(r["promote_output"])

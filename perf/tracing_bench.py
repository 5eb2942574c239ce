"""The tracing section of `make bench`: what the guard's OpenTelemetry spans cost.

Three ``digits`` guards (in-process placement, as exported) in one server, over the same
``digits_raw``: tracing off; tracing on at ``tracing.sample_ratio = 0.01`` (the guard samples on
its own: Triton's tracing stays off, so the figure is the guard's cost alone); and tracing on at
ratio 0 (every batch still makes the per-request sampling decision, none is traced). Spans go to
an OTLP/HTTP receiver in this process (tests/otlp.py), on loopback. perf_analyzer at c=16 with
the bench's 16 images, the variants alternating and the order rotating each round; the median of
the rounds is compared. Target: 1 % sampling keeps >= 0.97 of the throughput with tracing off.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core import repository
from tritonguard.ops.server import Server

TARGET = 0.97  # guarded throughput, tracing at 1 % / tracing off, c=16
VARIANTS = {"digits_trace_off": None, "digits_trace_1pct": "0.01", "digits_trace_0": "0"}


def _repo(src: Path, dest: Path, endpoint: str) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "digits_raw").symlink_to((src / "digits_raw").resolve())
    base = repository.read_config(src / "digits")
    for name, ratio in VARIANTS.items():
        shutil.copytree(src / "digits", dest / name,
                        ignore=shutil.ignore_patterns("rollout_state.json*", ".rollout_state*", "*.jsonl*", "*.sqlite*"))
        cfg = {**base, "name": name, "parameters": dict(base.get("parameters") or {})}
        if ratio is not None:
            cfg["parameters"].update({"tracing.endpoint": {"string_value": endpoint},
                                      "tracing.sample_ratio": {"string_value": ratio}})
        repository.write_config(dest / name, cfg)
    return list(VARIANTS)


def run(src_repo: Path, workdir: Path, measure: Callable[..., Any], digits_data: Path, rounds: int = 3) -> dict:
    """``measure(server, model, concurrency, data_path)`` -> a bench Measurement."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.otlp import Receiver  # noqa: PLC0415 - the test receiver is the collector here

    with Receiver() as receiver:
        repo = workdir / "tracing_repo"
        names = _repo(src_repo, repo, receiver.url)
        runs: dict[str, list] = {n: [] for n in names}
        with Server(repository=repo, log_path=workdir / "tracing-tritonserver.log") as server:
            server.start(wait_models=[*names, "digits_raw"])
            for r in range(rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    m = measure(server, name, 16, digits_data)
                    runs[name].append(m)
                    sys.stderr.write(f"tracing {name:18s} c=16 {m.throughput:8.1f} inf/s  p99 {m.p99_ms:7.2f} ms\n")
        spans = receiver.snapshot()
    med = {n: float(np.median([m.throughput for m in ms])) for n, ms in runs.items()}
    p99 = {n: float(np.median([m.p99_ms for m in ms])) for n, ms in runs.items()}
    off = med["digits_trace_off"]
    guards = [s for s in spans if s["name"] == "tritonguard.guard"]
    return {
        "model": "digits", "concurrency": 16, "rounds": rounds,
        "off_ips": round(off, 1), "ratio_1pct_ips": round(med["digits_trace_1pct"], 1),
        "ratio_0_ips": round(med["digits_trace_0"], 1),
        "p99_ms": {n: round(v, 2) for n, v in p99.items()},
        "on_1pct_over_off": round(med["digits_trace_1pct"] / off, 3),
        "on_0_over_off": round(med["digits_trace_0"] / off, 3),
        "per_round": {n: [round(m.throughput, 1) for m in ms] for n, ms in runs.items()},
        "traces_received": len(guards), "spans_received": len(spans),
        "target": TARGET, "meets_target": med["digits_trace_1pct"] / off >= TARGET,
    }


def print_tracing(result: dict) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    table = Table(title="tracing cost (digits guard, c=16, median of rounds; Triton's own tracing off)")
    for col in ("variant", "inf/s", "vs off", "p99 ms", "rounds inf/s"):
        table.add_column(col, justify="right")
    off = result["off_ips"]
    for name, ips in (("digits_trace_off", off), ("digits_trace_1pct", result["ratio_1pct_ips"]),
                      ("digits_trace_0", result["ratio_0_ips"])):
        table.add_row(name, f"{ips:.1f}", f"{ips / off:.3f}", f"{result['p99_ms'][name]:.2f}",
                      ", ".join(f"{x:.0f}" for x in result["per_round"][name]))
    console = Console(width=200)
    console.print(table)
    console.print(f"traces received: {result['traces_received']} ({result['spans_received']} spans); "
          f"1 % / off = {result['on_1pct_over_off']:.3f} (target >= {result['target']}): "
          f"{'met' if result['meets_target'] else 'MISSED'}")

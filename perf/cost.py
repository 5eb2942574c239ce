"""The price of guarding in numbers that hold still on a shared machine.

Throughput on a busy 2-core box swings by tens of percent from one run to the next; the CPU a
request costs does not. Around each perf_analyzer run :func:`snapshot` reads, from ``/proc``,
the CPU seconds of every process of the server (the tritonserver core, and each Python backend
stub by the backend its model runs: ``guard``, ``intake``, ``tokenizer``, ``runtime`` …) and,
from Triton's statistics, how many requests each model completed and in how many executions.
:func:`price` turns two snapshots into CPU milliseconds per request (all of the server, and the
guard's own stubs alone) and the target's mean batch size (the encoder for minilm,
``digits_raw`` for digits), which is what the dynamic batcher managed to form.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tritonguard.ops.supervisor.stubs import cpu_seconds, read_stub

GUARD_BACKENDS = ("guard", "intake")  # the stubs guarding adds; everything else serves the raw path too
BATCHED = {"digits": "digits_raw", "minilm": "minilm_encoder"}  # the model whose batches decide throughput
_BACKEND = re.compile(r'^backend\s*:\s*"([^"]+)"', re.M)


@dataclass
class Snapshot:
    cpu: dict[str, float] = field(default_factory=dict)  # "core" or "stub:<backend>" -> CPU s
    stats: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # model -> (success, inferences, executions)


def _group(pgid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _backend(version_dir: str) -> str:
    try:
        m = _BACKEND.search((Path(version_dir).parent / "config.pbtxt").read_text(errors="replace"))
    except OSError:
        return "python"
    return m.group(1) if m else "python"


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _stats(http_url: str) -> dict[str, tuple[int, int, int]]:
    base = http_url if "://" in http_url else f"http://{http_url}"
    with urllib.request.urlopen(f"{base}/v2/models/stats", timeout=10) as resp:
        body = json.load(resp)
    out: dict[str, tuple[int, int, int]] = {}
    for s in body.get("model_stats", []):
        ok, inf, ex = out.get(s["name"], (0, 0, 0))
        out[s["name"]] = (ok + int(s["inference_stats"]["success"]["count"]),
                          inf + int(s.get("inference_count", 0)), ex + int(s.get("execution_count", 0)))
    return out


def snapshot(server_pid: int, http_url: str) -> Snapshot:
    """CPU per process kind of the server's process group, and Triton's counters per model."""
    snap = Snapshot(stats=_stats(http_url))
    for pid in _group(os.getpgid(server_pid)):
        stub = read_stub(pid)
        if stub is not None:
            key = f"stub:{_backend(stub.version_dir)}"
        elif _comm(pid) == "tritonserver":
            key = "core"
        else:
            continue  # the supervising launcher: the same whether guarded or raw
        cpu = cpu_seconds(pid)
        if cpu is not None:
            snap.cpu[key] = snap.cpu.get(key, 0.0) + cpu
    return snap


def price(before: Snapshot, after: Snapshot, model: str) -> dict[str, float | None]:
    """CPU ms per completed request of ``model`` (the one perf_analyzer drove) between two
    snapshots, and the batched target's mean batch over the same span."""
    def delta(name: str) -> tuple[int, int, int]:
        a, b = after.stats.get(name, (0, 0, 0)), before.stats.get(name, (0, 0, 0))
        return a[0] - b[0], a[1] - b[1], a[2] - b[2]

    requests = delta(model)[0]
    cpu = {k: after.cpu.get(k, 0.0) - before.cpu.get(k, 0.0) for k in after.cpu}
    base = model.removesuffix("_raw")
    _, inferences, executions = delta(BATCHED[base])
    # a guard that runs the target in process (digits; minilm with placement inprocess) forms the
    # target's batches itself: its own batches, the guard step's for a public ensemble (minilm)
    for name in (f"{base}_guard", model):
        if executions > 0:
            break
        _, inferences, executions = delta(name)
    per = (lambda s: round(1000 * s / requests, 3)) if requests > 0 else (lambda s: None)
    return {
        "requests": requests,
        "cpu_ms_per_request": per(sum(v for v in cpu.values() if v > 0)),
        "guard_cpu_ms_per_request": per(sum(v for k, v in cpu.items() if k.removeprefix("stub:") in GUARD_BACKENDS)),
        "core_cpu_ms_per_request": per(cpu.get("core", 0.0)),
        "target_mean_batch": round(inferences / executions, 2) if executions > 0 else None,
    }


__all__ = ["BATCHED", "GUARD_BACKENDS", "Snapshot", "price", "snapshot"]

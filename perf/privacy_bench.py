"""The privacy section of `make bench`: what a cache hit adds per tier, and what redaction costs.

1. Cache hits, per tier: guard variants of ``digits`` (in-process placement, as exported) whose
   cache is L1 only, L2 only (SQLite, encrypted) or L3 only (Redis on loopback, encrypted), driven
   by perf_analyzer at c=1 with the bench's 16 images repeated, so every request after the first
   16 is a hit. Reported: p50 of each variant, and p50 minus the raw model's p50 (what a client
   sees added by answering from that tier instead of asking the model directly). The time the
   guard spends in the privacy stage for a hit (tenant, key, lookup, audit bookkeeping) is also
   measured in this process, per tier, without the server's noise.
2. Redaction: ``minilm`` guards with redaction on and off at c=16, alternating (the order flips
   each round), median of 3 rounds; 4 of the 8 input sentences hold PII (the redacted ones are a
   few tokens shorter for the model), the others are scanned and left as they are.
3. Tenant quotas: ``digits`` guards (two instances each, no cache) with and without a quota
   that never refuses, at c=16, alternating, median of the rounds: the cost of the host-shared
   token buckets (a memory-mapped file under ``flock``, taken twice per batch).

Everything runs on a private repository (version folders linked) with its own server and its own
redis-server on a free port, so the user's repository and Redis are never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core import repository
from tritonguard.ops.server import Server

TIER_TARGETS_MS = {"l1": 0.1, "l2": 1.0, "l3": 2.0}  # added p50 per hit
REDACTION_TARGET = 0.95  # minilm throughput, redaction on / off, c=16
QUOTA_TARGET = 0.95  # digits throughput, shared quotas on / off, c=16
KEY_HEX = "6b" * 32
REDIS = shutil.which("redis-server") or "/usr/bin/redis-server"
SENTENCES = [
    "Canary releases send a small share of traffic to a new model version first.",
    "Please call me back at +44 20 7946 0958 about the invoice.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Send the receipt to jane.roe@example.com before Friday, thanks.",
    "Order 4471 shipped on 2024-05-01 at 10:30 from warehouse 12.",
    "My card 4111 1111 1111 1111 was charged twice for the same order.",
    "Circuit breakers trip when a candidate starts returning NaN outputs.",
    "The server at 203.0.113.77 stopped answering health checks overnight.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Redis:
    """A throw-away redis-server on a free loopback port (no persistence)."""

    def __init__(self, workdir: Path):
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)


def _params(**kv: Any) -> dict[str, Any]:
    return {k: {"string_value": str(v)} for k, v in kv.items()}


def _repo(src: Path, dest: Path, redis_url: str | None, l2: Path) -> dict[str, str]:
    """Links to every non-guard model of ``src``, plus the guard variants; returns name -> role."""
    dest.mkdir(parents=True)
    for model in src.iterdir():
        if (model / repository.CONFIG).exists() and not repository.holds_state(model):
            (dest / model.name).symlink_to(model.resolve())
    variants: dict[str, str] = {}

    def variant(name: str, base: str, role: str, config: dict[str, Any] | None = None, **params: Any) -> None:
        cfg = repository.guard_dir(src, base)[1]  # minilm's guard is a step of the ensemble minilm
        old = {k: v["string_value"] for k, v in (cfg.get("parameters") or {}).items()}
        old.pop("serves_as", None)  # each variant keeps its own state and metrics
        cfg = {**cfg, **(config or {}), "name": name, "parameters": _params(**{**old, **params})}
        repository.write_config(dest / name, cfg)
        (dest / name / "1").mkdir()
        variants[name] = role

    persisted = {"cache.enabled": "true", "cache.privacy": "persisted_encrypted", "cache.l1_entries": 0}
    variant("digits_nocache", "digits", "guard, no cache")
    variant("digits_l1", "digits", "l1", **{"cache.enabled": "true"})
    variant("digits_l2", "digits", "l2", **persisted, **{"cache.l2_path": str(l2)})
    if redis_url:
        variant("digits_l3", "digits", "l3", **persisted, **{"cache.l3_url": redis_url})
    variant("minilm_redact_on", "minilm", "redaction on", **{"redaction.enabled": "true"})
    variant("minilm_redact_off", "minilm", "redaction off", **{"redaction.enabled": "false"})
    two = {"instance_group": [{"kind": "KIND_CPU", "count": 2}]}
    variant("digits_quota_on", "digits", "quotas on", config=two,
            **{"tenancy.quotas": json.dumps({"*": {"rps": 1e9, "burst": 10**9, "max_in_flight": 10**6}})})
    variant("digits_quota_off", "digits", "quotas off", config=two)
    return variants


def _text_data(path: Path) -> Path:
    path.write_text(json.dumps({"data": [{"TEXT": {"content": [s], "shape": [1]}} for s in SENTENCES]}))
    return path


def stage_hit_us(src: Path, tier: str, redis_url: str | None, workdir: Path, n: int = 2000) -> float | None:
    """p50 µs of PrivacyStage.before() + after() for a one-image request that hits ``tier``."""
    from sklearn.datasets import load_digits

    from tritonguard.core.config import model_parameters
    from tritonguard.core.tensors import ModelSignature
    from tritonguard.guard.config import GuardConfig
    from tritonguard.guard.routing.router import Routed
    from tritonguard.guard.services import PrivacyStage
    from tritonguard.guard.validation import BatchValidator

    if tier == "l3" and not redis_url:
        return None
    cfg_pb = repository.read_config(src / "digits")
    params = {**model_parameters(cfg_pb), "cache.enabled": "true"}
    if tier != "l1":
        params.update({"cache.privacy": "persisted_encrypted", "cache.l1_entries": "0"})
        params["cache.l2_path" if tier == "l2" else "cache.l3_url"] = (
            str(workdir / f"stage-{tier}.sqlite") if tier == "l2" else redis_url)
        params["cache.l3_prefix"] = "bench-stage:"
    config = GuardConfig.from_parameters(params, "digits")
    sig = ModelSignature.from_config(cfg_pb)
    outputs = [s.name for s in sig.outputs if s.name != "SERVED_BY"]
    target = config.target.target

    primary = repository.latest_version(src / target) or 1

    class Router:  # what the stage asks of the guard's router; primary() is a field read there too
        state = type("S", (), {"revision": 1, "candidate": None, "updated_by": ""})()

        def primary(self) -> int:
            return primary

        def refresh(self, now: float) -> None:
            pass

    class Metrics:
        def inc(self, *a: Any, **k: Any) -> None:
            pass

        set = inc

    stage = PrivacyStage(guard="digits", target=target, signature=sig, output_names=outputs, config=config,
                         repo=src, metrics=Metrics(), environ={"TRITONGUARD_L2_ENCRYPTION_KEY": KEY_HEX})
    router = Router()
    stage.attach(router)
    x = load_digits().images[:1].astype(np.float32)
    verdict = BatchValidator(sig, config.validation).validate([{"IMAGE": x}])
    batch = stage.before([{}], verdict)
    probs = np.full((1, 10), 0.1, np.float32)
    stage.after(batch, Routed({outputs[0]: probs}, [f"{target}:{router.primary()}"], [None]))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        b = stage.before([{}], verdict)
        stage.after(b, None)
        times.append(time.perf_counter() - t0)
        assert b.cache_state == {0: "hit"}, b.cache_state
    stage.close()
    return float(np.percentile(np.array(times) * 1e6, 50))


def run(src_repo: Path, workdir: Path, measure: Callable[..., Any], digits_data: Path, rounds: int = 3) -> dict:
    """``measure(server, model, concurrency, data_path)`` -> a bench Measurement."""
    redis = _Redis(workdir) if Path(REDIS).exists() else None
    out: dict[str, Any] = {"tiers": [], "redaction": None}
    try:
        l2 = workdir / "privacy-l2" / "cache.sqlite"
        repo = workdir / "privacy_repo"
        variants = _repo(src_repo, repo, redis.url if redis else None, l2)
        text = _text_data(workdir / "privacy-text.json")
        env = {**os.environ, "TRITONGUARD_L2_ENCRYPTION_KEY": KEY_HEX}
        with Server(repository=repo, log_path=workdir / "privacy-tritonserver.log", env=env) as server:
            server.start(wait_models=[*variants, "digits_raw", "minilm_raw"])
            # tiers: c=1, the 16 images repeated (hits after the first 16 requests)
            p50: dict[str, list[float]] = {}
            # the raw model first and last: its p50 is the mean of both (drift on a shared box)
            tiers = [v for v, role in variants.items() if role in TIER_TARGETS_MS or v == "digits_nocache"]
            for name in ("digits_raw", *tiers, "digits_raw"):
                m = measure(server, name, 1, digits_data)
                p50.setdefault(name, []).append(m.p50_ms)
                sys.stderr.write(f"privacy {name:16s} c=1  p50 {m.p50_ms:6.3f} ms  {m.throughput:8.1f} inf/s\n")
            p50 = {k: float(np.mean(v)) for k, v in p50.items()}
            for name, role in variants.items():
                if role not in TIER_TARGETS_MS:
                    continue
                added = p50[name] - p50["digits_raw"]
                out["tiers"].append({
                    "tier": role, "model": name, "p50_ms": round(p50[name], 3),
                    "p50_raw_ms": round(p50["digits_raw"], 3), "p50_guard_nocache_ms": round(p50["digits_nocache"], 3),
                    "added_vs_raw_ms": round(added, 3), "added_vs_guard_nocache_ms": round(p50[name] - p50["digits_nocache"], 3),
                    "target_ms": TIER_TARGETS_MS[role], "meets_target": added <= TIER_TARGETS_MS[role]})
            # redaction on vs off, and shared quotas on vs off: c=16, alternating (and which goes
            # first), median of the rounds
            for key, model, on_name, off_name, data, target in (
                    ("redaction", "minilm", "minilm_redact_on", "minilm_redact_off", text, REDACTION_TARGET),
                    ("quotas", "digits", "digits_quota_on", "digits_quota_off", digits_data, QUOTA_TARGET)):
                runs: dict[str, list] = {on_name: [], off_name: []}
                for r in range(rounds):
                    for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                        m = measure(server, name, 16, data)
                        runs[name].append(m)
                        sys.stderr.write(f"privacy {name:18s} c=16 {m.throughput:8.1f} inf/s  p99 {m.p99_ms:7.2f} ms\n")
                on = float(np.median([m.throughput for m in runs[on_name]]))
                off = float(np.median([m.throughput for m in runs[off_name]]))
                out[key] = {"model": model, "concurrency": 16, "on_ips": round(on, 1), "off_ips": round(off, 1),
                            "on_over_off": round(on / off, 3), "target": target, "meets_target": on / off >= target}
        # the stage alone, in this process: the guard's own cost of a hit per tier
        stage_dir = Path(tempfile.mkdtemp(prefix="stage-", dir=workdir))
        for row in out["tiers"]:
            us = stage_hit_us(src_repo, row["tier"], redis.url if redis else None, stage_dir)
            row["stage_p50_us"] = None if us is None else round(us, 1)
    finally:
        if redis is not None:
            redis.stop()
    return out


def print_privacy(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="cache hits per tier (digits, c=1, same inputs repeated) — added p50 vs the raw model")
    for col in ("tier", "p50 ms", "raw p50 ms", "added vs raw", "added vs guard", "stage p50 µs", "target"):
        table.add_column(col, justify="right")
    for r in result.get("tiers", []):
        table.add_row(r["tier"], f"{r['p50_ms']:.3f}", f"{r['p50_raw_ms']:.3f}", f"{r['added_vs_raw_ms']:+.3f}",
                      f"{r['added_vs_guard_nocache_ms']:+.3f}",
                      "" if r.get("stage_p50_us") is None else f"{r['stage_p50_us']:.0f}",
                      f"≤{r['target_ms']} ms " + ("ok" if r["meets_target"] else "SHORT"))
    Console().print(table)
    for key, what in (("redaction", "redaction"), ("quotas", "shared tenant quotas (2 instances)")):
        r = result.get(key)
        if r:
            Console().print(f"{what} on/off throughput, {r['model']} c=16: {r['on_ips']:.0f} / {r['off_ips']:.0f} "
                            f"inf/s = {r['on_over_off']:.3f} (target ≥ {r['target']}: "
                            f"{'ok' if r['meets_target'] else 'SHORT'})")

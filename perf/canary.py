"""The rollout scenario of `make bench`: guarded throughput and p99 with a candidate version
taking 10 % of live traffic and 10 % shadow, against the same guard with no candidate, and the
raw model, measured back to back on one server.

It runs on a private copy of the repository (configs copied, version folders linked) so the
good candidate it exports (``examples.faults:good`` for digits, ``examples.minilm:build`` again
for minilm) never lands in the user's repository.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from exporter.build.export import export
from exporter.rollout.route import RouteChange, apply
from tritonguard.core import repository
from tritonguard.ops.server import Server

CANDIDATES = {"digits": "examples.faults:good", "minilm": "examples.minilm:build"}


def private_repo(src: Path, dest: Path) -> Path:
    """Model dirs with their own config.pbtxt and links to the source's version folders."""
    dest.mkdir(parents=True, exist_ok=True)
    for model in src.iterdir():
        if not (model / repository.CONFIG).exists():
            continue
        (dest / model.name).mkdir()
        shutil.copy(model / repository.CONFIG, dest / model.name / repository.CONFIG)
        for v in model.iterdir():
            if v.is_dir() and v.name.isdigit():
                (dest / model.name / v.name).symlink_to(v.resolve())
    return dest


def _source(spec: str):
    module, func = spec.split(":")
    return getattr(__import__(module, fromlist=[func]), func)()


def run(src_repo: Path, workdir: Path, models: list[str], measure, concurrency: int = 16) -> list:
    """``measure(server, model_name, c)`` is the bench's perf_analyzer call; returns rows."""
    repo = private_repo(src_repo, workdir / "canary_repo")
    candidates = {}
    for model in models:
        t0 = time.perf_counter()
        # force: the minilm candidate is the served weights again, on purpose (same artifact)
        res = export(_source(CANDIDATES[model]), name=model, repository=repo, source=CANDIDATES[model],
                     force=True)
        candidates[model] = res.version
        sys.stderr.write(f"canary: exported {model} v{res.version} in {time.perf_counter() - t0:.0f} s\n")
    rows = []
    wait = [m for model in models for m in (model, f"{model}_raw")]
    with Server(repository=repo, log_path=workdir / "canary-tritonserver.log") as server:
        server.start(wait_models=wait)
        for model in models:
            runs = {}
            for phase in ("no candidate", "canary 10% + shadow 10%"):
                if phase != "no candidate":
                    apply(repo, model, RouteChange(candidate=candidates[model], share=0.1, shadow=0.1))
                    time.sleep(2)  # guards poll the state every second
                runs[phase] = (measure(server, f"{model}_raw", concurrency), measure(server, model, concurrency))
            for phase, (raw, guarded) in runs.items():
                rows.append({"model": model, "phase": phase, "concurrency": concurrency,
                             "guarded_ips": round(guarded.throughput, 1), "raw_ips": round(raw.throughput, 1),
                             "guarded_over_raw": round(guarded.throughput / raw.throughput, 3),
                             "p99_guarded_ms": round(guarded.p99_ms, 2), "p99_raw_ms": round(raw.p99_ms, 2)})
    return rows

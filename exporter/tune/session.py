"""Measuring a point: one private tritonserver over a copy of the pipeline's folders
(:class:`Session`: trial configs written into the copy and loaded with a config override),
realistic varied inputs, and perf_analyzer runs. The only part of tune that needs a server.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from exporter.tune.knobs import Pipeline, TuneError
from exporter.tune.search import Stat
from tritonguard.core import repository
from tritonguard.ops.launcher import perf_analyzer_run
from tritonguard.ops.server import Server
from tritonguard.triton import http as triton_http


# -- measuring -------------------------------------------------------------------------------
def input_data(pipe: Pipeline, configs: dict[str, dict[str, Any]], path: Path) -> Path:
    """perf_analyzer ``--input-data``: varied realistic requests (load_digits images, sentences)."""
    inputs = configs[pipe.guard].get("input") or []
    if pipe.text:
        name = inputs[0]["name"] if inputs else "TEXT"
        # deferred: examples.texts imports pydoc (heavy); only text pipelines need it
        from examples.texts import stdlib_sentences  # noqa: PLC0415

        data = [{name: {"content": [s], "shape": [1]}} for s in stdlib_sentences(48)]
    else:
        import numpy as np  # noqa: PLC0415 - defers a heavy import
        from sklearn.datasets import load_digits  # noqa: PLC0415 - defers a heavy import

        if len(inputs) != 1:
            raise TuneError(f"tune drives tensor models with one input; '{pipe.public}' has {len(inputs)}")
        dims = [int(d) for d in inputs[0].get("dims") or []]
        images = load_digits().images[:64].astype(np.float32)
        if int(np.prod(dims)) != 64:
            raise TuneError(f"no realistic inputs for '{pipe.public}' (input dims {dims}); tune knows digits-shaped images and text")
        data = [{inputs[0]["name"]: {"content": img.ravel().tolist(), "shape": dims}} for img in images]
    path.write_text(json.dumps({"data": data}))
    return path


def perf_analyzer(url: str, model: str, concurrency: int, data: Path, *, window_ms: int, trials: int,
                  stability_pct: float) -> Stat:
    """One perf_analyzer run. A window that never settles within ``stability_pct`` is measured
    again with no stability bound (the machine is noisy, not the point broken); a window in
    which no request completed (a freshly loaded model's first requests on a busy machine) is
    measured again with a window four times as long, up to 8 s."""

    out = ""
    stability, window = stability_pct, window_ms
    for _ in range(4):  # at most: the window x4, x4 again, then no stability bound
        try:
            row, out = perf_analyzer_run(url, model, concurrency, data, window_ms=window, trials=trials,
                                         stability_pct=stability, timeout=60 + window * trials * 3 / 1000)
        except subprocess.TimeoutExpired:
            raise TuneError(f"perf_analyzer timed out on {model} c={concurrency}") from None
        if row is not None:
            return Stat(float(row["Inferences/Second"]), float(row["p50 latency"]) / 1000,
                        float(row["p99 latency"]) / 1000)
        text = out.lower()
        if "larger time window" in text:
            if window >= 8000:
                break
            window = min(window * 4, 8000)
        elif "stable" in text and stability < 1000:
            stability = 1000
        else:
            break
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    errors = [ln for ln in lines if any(w in ln.lower() for w in ("error", "failed", "no valid"))]
    raise TuneError(f"perf_analyzer failed on {model} c={concurrency}: {(errors or lines or ['no output'])[-1][:300]}")


class Session:
    """One private tritonserver over a copy of the pipeline's folders; trial configs go into
    the copy and are loaded with a config override. Use as a context manager: the server is
    stopped by PID on every way out."""

    def __init__(self, repo: Path, pipe: Pipeline, configs: dict[str, dict[str, Any]], workdir: Path,
                 log_path: Path):
        self.src, self.pipe, self.workdir, self.log_path = Path(repo), pipe, Path(workdir), log_path
        self.loaded = {name: configs[name] for name in pipe.managed}
        self.server = None
        self.copy = self.workdir / "repository"

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def prepare(self) -> Path:
        """The copy: mirror (guard folders copied, others linked), the public model's rollout
        state kept (a canaried version keeps its share), each managed model a real folder whose
        config.pbtxt is its own and whose versions link to the user's."""
        repository.mirror(self.src, self.copy)
        for name in {self.pipe.public, self.pipe.guard}:
            state = self.src / name / "rollout_state.json"
            if state.exists():
                shutil.copy2(state, self.copy / name / "rollout_state.json")
        for name in self.pipe.managed:
            dest = self.copy / name
            if dest.is_symlink():
                dest.unlink()
                dest.mkdir()
                for entry in (self.src / name).iterdir():
                    if entry.name == repository.CONFIG:
                        shutil.copy2(entry, dest / entry.name)
                    elif not entry.name.startswith(("rollout_state", ".rollout_state")):
                        (dest / entry.name).symlink_to(entry.resolve())
        return self.copy

    def start(self, timeout: float = 240.0) -> None:
        self.prepare()
        args = ["--model-control-mode=explicit", *(f"--load-model={m}" for m in self.pipe.load_order)]
        # unsupervised: the supervisor takes the stubs a reload retires for dead ones and
        # reloads the model again, in the middle of the next measurement
        env = {**os.environ, "TRITONGUARD_SUPERVISE": "0"}
        self.server = Server(repository=self.copy, log_path=self.log_path, extra_args=args, env=env)
        try:
            self.server.start(wait_models=[self.pipe.public], timeout=timeout)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if "\\n" in first:  # a load error's python traceback, escaped inside the reason
                first = first.split("\\n")[0] + "…"
            raise TuneError(f"tritonserver could not start: {first}") from None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.http_url

    def _post_load(self, name: str, config: dict[str, Any] | None, timeout: float = 180.0) -> None:
        body = {"parameters": {"config": json.dumps(config)}} if config is not None else {}
        try:
            status, raw = triton_http.request(f"http://{self.url}/v2/repository/models/{name}/load", "POST",
                                              json.dumps(body).encode(), timeout=timeout)
        except triton_http.Unreachable as exc:
            raise TuneError(f"load of {name} failed: {exc.reason}") from None
        if status != 200:
            try:
                msg = json.loads(raw).get("error", "") or f"HTTP {status}"
            except ValueError:
                msg = f"HTTP {status}"
            raise TuneError(f"load of {name} failed: {msg.splitlines()[0]}")

    def load(self, new: dict[str, dict[str, Any]], *, force: bool = False) -> list[str]:
        """Write the changed managed configs into the copy and reload them (target first, then
        the guard, then the ensembles over them); returns the models reloaded."""
        changed = [n for n in self.pipe.load_order if n in new and (force or new[n] != self.loaded.get(n))]
        if not changed:
            return []
        if self.pipe.placement == "inprocess" and self.pipe.target in changed and self.pipe.guard not in changed:
            changed.append(self.pipe.guard)  # the guard reads the target's runtime settings at load
        for name in changed:
            repository.write_config(self.copy / name, new[name])
            self._post_load(name, new[name])
            self.loaded[name] = new[name]
        for name in self.pipe.ensembles:
            self._post_load(name, None)
        deadline = time.monotonic() + 60
        assert self.server is not None
        while not self.server._ok(f"/v2/models/{self.pipe.public}/ready"):
            if time.monotonic() > deadline:
                raise TuneError(f"{self.pipe.public} not ready after reloading {', '.join(changed)}")
            time.sleep(0.3)
        return changed

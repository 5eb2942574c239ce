"""A ``--native`` export canaries on a real tritonserver: both versions a rollout names stay loaded.

A native target (``exporter export --native``: Triton's onnxruntime backend in the NGC image)
is reached by the guard over BLS, so Triton itself must keep every version the routing names
loaded. Exports used to write ``version_policy { latest { num_versions: 1 } }`` for it: the
load of v2 that ``promote`` makes through the repository API unloaded v1, and the primary's
traffic failed (issue 39 item 10).

The bundled tritonserver (2.51 from nvidia-pytriton) has no onnxruntime backend, so in the
server's copy of the repository our Python ``runtime`` backend stands in for the native one:
the test rewrites the target's ``platform: "onnxruntime_onnx"`` to ``backend: "runtime"`` (both
run the same ``model.onnx``) and keeps every other field the export wrote, the version_policy
first. What is tested is the control path (the policy the export writes, ``promote``'s load
through the repository API, the routing, the guard's BLS calls), not the onnxruntime backend.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from torch import nn
from tritonclient.utils import InferenceServerException
from typer.testing import CliRunner

from exporter.build.sources.spec import ExportSpec, TensorDef
from exporter.cli.app import app
from exporter.rollout.serving import ready
from tritonguard.core.repository import CONFIG, read_config, write_config
from tritonguard.ops.server import Server

pytestmark = pytest.mark.functional

MODEL, TARGET = "tiny", "tiny_raw"


class Tiny(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc(x), dim=-1)


def _spec(seed: int) -> ExportSpec:
    x = np.random.default_rng(1).uniform(0, 1, size=(32, 4)).astype(np.float32)
    return ExportSpec(module=Tiny(seed).eval(), inputs=[TensorDef(name="X", dtype="float32", dims=(4,))],
                      outputs=[TensorDef(name="P", dtype="float32", dims=(3,))], golden_inputs={"X": x},
                      task="classifier", max_batch_size=8, input_ranges={"X": (0.0, 1.0)})


def v1() -> ExportSpec:
    """``--source tests.functional.test_native:v1``: a tiny classifier (milliseconds to export)."""
    return _spec(0)


def v2() -> ExportSpec:
    """Other weights, so v2 is a new version (not a duplicate artifact)."""
    return _spec(1)


def export_native(repo: Path, source: str) -> None:
    res = CliRunner().invoke(app, ["export", "--source", f"tests.functional.test_native:{source}",
                                   "--name", MODEL, "--repository", str(repo), "--native"])
    assert res.exit_code == 0, res.output


def runtime_stands_in(repo: Path) -> dict:
    """The target's config with ``backend: runtime`` in place of the native platform; every
    other field as the export wrote it. Returns the export's config."""
    native = read_config(repo / TARGET)
    assert native["platform"] == "onnxruntime_onnx", native
    write_config(repo / TARGET, {**{k: v for k, v in native.items() if k != "platform"}, "backend": "runtime"})
    return native


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("native")
    repo = base / "repo"
    export_native(repo, "v1")
    native = runtime_stands_in(repo)
    server = Server(repository=repo, log_path=base / "logs" / "tritonserver.log")
    server.start(wait_models=[MODEL, TARGET])
    client = httpclient.InferenceServerClient(server.http_url)
    yield {"repo": repo, "server": server, "client": client, "native": native}
    client.close()
    server.stop()


def served_by(env, n: int, client: httpclient.InferenceServerClient | None = None) -> set[str]:
    """Which target versions answered ``n`` requests (the guard's SERVED_BY output)."""
    x = np.random.default_rng(2).uniform(0, 1, size=(1, 4)).astype(np.float32)
    seen = set()
    for _ in range(n):
        inp = httpclient.InferInput("X", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        r = (client or env["client"]).infer(MODEL, [inp], outputs=[httpclient.InferRequestedOutput("P"),
                                                       httpclient.InferRequestedOutput("SERVED_BY")])
        seen.add(r.as_numpy("SERVED_BY")[0, 0].decode())
    return seen


def test_native_canary_keeps_both_versions_loaded_and_serves_both(env):
    repo, server = env["repo"], env["server"]
    assert env["native"]["version_policy"] == {"all": {}}  # what the export wrote, not the test
    assert served_by(env, 5) == {f"{TARGET}:1"}

    # v2 exported into the live repository, as an operator does (the native config back in place
    # for the export, then the stand-in again), then made loadable by `promote` (the repository
    # API load a new version gets) and routed as a canary
    write_config(repo / TARGET, env["native"])
    export_native(repo, "v2")
    assert runtime_stands_in(repo)["version_policy"] == {"all": {}}
    assert (repo / TARGET / "2" / "model.onnx").is_file() and (repo / TARGET / CONFIG).is_file()
    # the primary's traffic goes on while the load happens: no request may fail
    stop, answers, errors = threading.Event(), [], []

    def traffic() -> None:
        with httpclient.InferenceServerClient(server.http_url) as client:
            for _ in range(10_000):  # bounded; stopped once the promote is done
                if stop.is_set():
                    return
                try:
                    answers.append(served_by(env, 1, client))
                except InferenceServerException as exc:
                    errors.append(str(exc))

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    try:
        res = CliRunner().invoke(app, ["promote", MODEL, "--version", "2", "--to", "staging",
                                       "--server", server.http_url, "--repository", str(repo)])
    finally:
        stop.set()
        worker.join(timeout=30)
    assert res.exit_code == 0, res.output
    assert answers and not errors, (len(answers), errors[:3])
    assert ready(server.http_url, TARGET, 2)
    assert ready(server.http_url, TARGET, 1), "loading v2 unloaded the primary v1"
    res = CliRunner().invoke(app, ["route", MODEL, "--candidate", "2", "--share", "0.5", "--repository", str(repo)])
    assert res.exit_code == 0, res.output

    deadline = time.monotonic() + 20  # the guard polls its routing state (about a second)
    seen: set[str] = set()
    while time.monotonic() < deadline and seen != {f"{TARGET}:1", f"{TARGET}:2"}:
        seen |= served_by(env, 20)
    assert seen == {f"{TARGET}:1", f"{TARGET}:2"}, seen
    assert ready(server.http_url, TARGET, 1) and ready(server.http_url, TARGET, 2)

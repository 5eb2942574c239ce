"""Functional tier: a real tritonserver, started through the project's launcher on free
loopback ports, serving the exported example models plus a few test-only models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tritonguard.core.repository import mirror, read_config, write_config
from tritonguard.ops.server import Server

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("digits", "digits_raw", "minilm", "minilm_raw")


def _export(repo: Path, name: str) -> None:
    subprocess.run([sys.executable, "-m", "exporter", "export", "--source", f"examples.{name}:build",
                    "--name", name, "--repository", str(repo)], cwd=ROOT, check=True)


@pytest.fixture(scope="session")
def exported_repo(tmp_path_factory) -> Path:
    """The example models: ``$TRITONGUARD_TEST_REPOSITORY``, ``model_repository/``, or a fresh export."""
    repo = Path(os.environ.get("TRITONGUARD_TEST_REPOSITORY", ROOT / "model_repository"))
    # (minilm_intake: the current layout; `make models` upgrades an older one in place)
    if all((repo / m / "config.pbtxt").exists() for m in ("digits_raw", "minilm_raw", "minilm_intake")):
        return repo
    repo = tmp_path_factory.mktemp("exported")
    _export(repo, "digits")
    _export(repo, "minilm")
    return repo


@pytest.fixture(scope="session")
def test_repo(exported_repo, tmp_path_factory) -> Path:
    """Links to the example models, plus test-only models that exercise failure paths."""
    # guards write their rollout state beside their config: copied, the source stays clean
    repo = mirror(exported_repo, tmp_path_factory.mktemp("repo"))
    digits = read_config(exported_repo / "digits")

    def guard_variant(name: str, **params: str) -> None:
        cfg = {**digits, "name": name, "parameters": {k: {"string_value": v} for k, v in params.items()}}
        write_config(repo / name, cfg)
        (repo / name / "1").mkdir()

    # a guard whose target is not served: BLS errors must reach the client with a clear message
    guard_variant("orphan", target="no_such_model", placement="bls")
    # an unknown parameter must fail the load, naming the key
    guard_variant("misspelt", target="digits_raw", placement="inprocess", **{"validation.max_paylod_bytes": "10"})
    # the BLS placement of the digits guard, to test both placements of one pipeline
    guard_variant("digits_bls", target="digits_raw", placement="bls", **{"validation.range.IMAGE": "0,16"})
    # in process, a text guard runs a tokenizer -> runtime ensemble itself; the public minilm
    # ensemble (intake -> guard) is not one: the load must fail naming the step
    text = read_config(exported_repo / "minilm_guard")
    params = {k: v for k, v in text["parameters"].items() if k not in ("serves_as", "target_per_version")}
    write_config(repo / "minilm_wrongstep", {**text, "name": "minilm_wrongstep", "parameters": {
        **params, "target": {"string_value": "minilm"}, "placement": {"string_value": "inprocess"}}})
    (repo / "minilm_wrongstep" / "1").mkdir()
    return repo


@pytest.fixture(scope="session")
def server(test_repo, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    srv = Server(repository=test_repo, log_path=log)
    srv.start(wait_models=(*MODELS, "orphan", "digits_bls"))
    yield srv
    srv.stop()
    print(f"server log: {log}")


@pytest.fixture(scope="session")
def http(server):
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(server.http_url, concurrency=8) as c:
        yield c


@pytest.fixture(scope="session")
def grpc(server):
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


# -- what a failing functional test leaves behind (issue 40 item 3) ------------------------------
# A test that fails against a real server is understood from the server's log: its tail goes into
# pytest's report, for every tritonserver the test held (fixtures of any scope), with the rollout
# state files of the repositories those servers serve.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    seen: set[int] = set()
    for name, value in getattr(item, "funcargs", {}).items():
        for srv in _servers_in(value):
            if id(srv) in seen:
                continue
            seen.add(id(srv))
            report.sections.append((f"tritonserver log tail ({name}: {srv.log_path.name})", srv.tail(60)))
            for state in _state_files(srv.repository):
                try:
                    report.sections.append((f"rollout state {state.parent.name}", state.read_text()[-4000:]))
                except OSError:
                    pass


def _servers_in(value) -> list[Server]:
    if isinstance(value, Server):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, Server)]
    found = [getattr(value, a) for a in ("server", "srv") if isinstance(getattr(value, a, None), Server)]
    return found


def _state_files(repository) -> list[Path]:
    if not isinstance(repository, Path) or not repository.is_dir():
        return []
    return sorted(repository.glob("*/rollout_state.json"))[:6]

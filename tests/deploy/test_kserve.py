"""deploy/kserve: the ServingRuntime and the InferenceService fit together and start tritonguard's
launcher the way the image does (their CRD validation is in test_validate.py). The runtime's
start script runs here with a stand-in launcher that records its flags: served in place when the
repository is writable, from a copy when it is not."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import KSERVE
from tests.deploy.test_chart import _dockerfile_cmd


def _load(name: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all((KSERVE / name).read_text()) if d]
    return doc


def test_inference_service_uses_the_runtime():
    runtime, isvc = _load("servingruntime.yaml"), _load("inferenceservice.yaml")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {(f["name"], f.get("version")) for f in runtime["spec"]["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"]["version"]) in formats
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert isvc["metadata"]["name"] == "digits"
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
    assert isvc["metadata"]["annotations"]["storage.kserve.io/readonly"] == "false"
    (c,) = runtime["spec"]["containers"]
    assert c["name"] == "kserve-container"
    for probe, path in (("startupProbe", "/v2/health/ready"), ("livenessProbe", "/v2/health/live"),
                        ("readinessProbe", "/v2/health/ready")):
        assert c[probe]["httpGet"] == {"path": path, "port": 8080}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in runtime["spec"]["volumes"]}
    assert volumes[[n for n, p in mounts.items() if p == "/dev/shm"][0]]["emptyDir"]["medium"] == "Memory"


def _run_runtime_script(tmp_path: Path, repo: Path, as_nobody: bool) -> tuple[subprocess.CompletedProcess, list[str]]:
    (c,) = _load("servingruntime.yaml")["spec"]["containers"]
    assert c["command"] == ["/bin/sh", "-c"]
    script = c["args"][0]
    for path in ("/usr/local/bin/tritonserver", "/mnt/models", "/tmp/models"):
        assert path in script
    record = tmp_path / "argv"
    launcher = tmp_path / "launcher"  # records its argv, one per line (no flag holds a newline)
    launcher.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{record}"\n')
    launcher.chmod(0o755)
    copy = tmp_path / "copy"
    script = (script.replace("/usr/local/bin/tritonserver", str(launcher)).replace("/mnt/models", str(repo))
              .replace("/tmp/models", str(copy)))
    env = {"PATH": os.environ["PATH"], "TRITONGUARD_ADMIN_KEY": "admin-0123456789abcdef"}
    cmd = ["/bin/sh", "-c", script]
    if as_nobody:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
    return proc, record.read_text().splitlines() if record.exists() else []


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "mnt-models"
    (repo / "digits" / "1").mkdir(parents=True)
    (repo / "digits" / "config.pbtxt").write_text('backend: "guard"\n')
    return repo


def test_runtime_serves_a_writable_repository_in_place(tmp_path):
    from tritonguard.ops.supervisor.control import (
        control_mode,
        http_base,
        metrics_url,
        repository_headers,
    )

    repo = _repo(tmp_path)
    proc, argv = _run_runtime_script(tmp_path, repo, as_nobody=False)
    assert proc.returncode == 0, proc.stderr
    assert argv[0] == f"--model-repository={repo}"
    assert not (repo / ".tritonguard-writable").exists()
    # the image's CMD flags (header forwarding, explicit mode with every model loaded) ...
    for flag in _dockerfile_cmd()[1:]:
        if not flag.startswith("--model-repository="):
            assert flag in argv, flag
    # ... on KServe's ports, read back by the supervisor as it will read them
    assert control_mode(argv) == "explicit"
    assert http_base(argv) == "http://127.0.0.1:8080"
    assert metrics_url(argv) == "http://127.0.0.1:8002/metrics"
    assert repository_headers(argv) == {"x-tritonguard-admin-key": "admin-0123456789abcdef"}
    assert "--grpc-port=9000" in argv
    # every API that changes the server is behind the key on both frontends (issue 39 item 6):
    # the launcher, which refuses an exposed server with any of them open, has nothing to add
    from tritonguard.ops import launcher as tg_launcher

    for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
        assert tg_launcher.restricted_apis(argv, flag) == set(tg_launcher.ADMIN_APIS), flag
    assert tg_launcher.restrict_admin_apis(argv, {"TRITONGUARD_ADMIN_KEY": "admin-0123456789abcdef"}) == argv


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to run as another user")
def test_runtime_serves_a_copy_of_a_read_only_repository():
    # a folder uid 65534 can reach (pytest's tmp_path is under a root-only folder)
    where = Path(tempfile.mkdtemp(prefix="tg-kserve-"))
    try:
        where.chmod(0o777)  # the unprivileged user writes the copy and the record here
        repo = _repo(where)
        for folder in (repo, repo / "digits", repo / "digits" / "1"):
            folder.chmod(0o555)  # root-owned, not writable by uid 65534
        proc, argv = _run_runtime_script(where, repo, as_nobody=True)
        assert proc.returncode == 0, proc.stderr
        assert "is read-only: serving a copy" in proc.stderr
        assert argv[0] == f"--model-repository={where / 'copy'}"
        assert (where / "copy" / "digits" / "config.pbtxt").read_text() == 'backend: "guard"\n'
        assert (where / "copy" / "digits" / "1").is_dir()
        # the copy belongs to the server's user: the supervisor can touch its version folders
        assert (where / "copy" / "digits" / "1").stat().st_uid == 65534
    finally:
        shutil.rmtree(where)

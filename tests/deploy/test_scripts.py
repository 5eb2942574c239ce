"""The shell the manifests run, run here: the bundled Redis' command against a real redis-server
(password, AOF persistence across a restart), the model-copying init container, the rollout Job's
wrapper (its exit code is promote's), and the admin key from the Job's environment arriving as the
header the server's restricted-API flag asks for. No container engine here: the same scripts, this
machine's /bin/sh, redis-server and the project's Python."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import KSERVE, RELEASE, one

FULL = f"{RELEASE}-tritonguard"
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def _containers(docs) -> list[tuple[str, dict]]:
    out = []
    for label, d in docs.items():
        for _, obj in d:
            if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
                pod = obj["spec"]["template"]["spec"]
                for c in pod.get("initContainers", []) + pod["containers"]:
                    out.append((f"{label}: {obj['kind']}/{obj['metadata']['name']}/{c['name']}", c))
    for path in KSERVE.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] == "ServingRuntime":
                out += [(f"{path.name}: {c['name']}", c) for c in doc["spec"]["containers"]]
    return out


def test_every_shell_script_parses(docs):
    scripts = [(where, c["args"][0]) for where, c in _containers(docs) if c.get("command") == ["/bin/sh", "-c"]]
    assert len(scripts) >= 4
    for where, script in scripts:
        proc = subprocess.run(["/bin/sh", "-n", "-c", script], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"{where}: {proc.stderr}"


def _redis_script(docs) -> tuple[str, list[str]]:
    redis = one(docs["default"], "StatefulSet", f"{FULL}-redis")
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["/bin/sh", "-c"]
    return c["args"][0], c["startupProbe"]["exec"]["command"]


def _raw(port: int, command: bytes) -> bytes:
    """One command on a fresh connection, no client library (and so no retries)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(command + b"\r\n")
        return conn.recv(256)


def _start(script: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(["/bin/sh", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_ping(client, proc, timeout: float = 10.0) -> None:
    import redis

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if client.ping():
                return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise AssertionError("redis-server did not answer")


@pytest.mark.skipif(not Path(REDIS_SERVER).exists(), reason="redis-server not installed (make setup installs it)")
def test_bundled_redis_command_wants_its_password_and_keeps_its_data(docs, tmp_path):
    import redis

    from tritonguard.ops.server import free_port

    script, probe = _redis_script(docs)
    port = free_port()
    # the container's script as rendered; only where it listens and writes is this machine's
    assert "--dir /data " in script
    script = script.replace("--dir /data ", f"--dir {tmp_path} --port {port} --bind 127.0.0.1 ", 1)
    password = "Pw-0123456789abcdef"
    env = {"PATH": os.environ["PATH"], "REDIS_PASSWORD": password, "TMPDIR": str(tmp_path)}
    proc = _start(script, env)
    try:
        client = redis.Redis(port=port, password=password, socket_timeout=2)
        _wait_ping(client, proc)
        # the password is not on the command line (a stdin config line instead)
        assert password not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
        assert _raw(port, b"PING").startswith(b"-NOAUTH")
        assert _raw(port, b"AUTH wrong-password").startswith(b"-WRONGPASS")
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert client.config_get("save") == {"save": ""}
        # the probe: redis-cli with the password from REDISCLI_AUTH, as the container sets it
        ping = subprocess.run([probe[0], "-p", str(port), *probe[1:]], env={**env, "REDISCLI_AUTH": password},
                              capture_output=True, text=True, timeout=10, check=False)
        assert ping.stdout.strip() == "PONG"
        client.hset("tritonguard:state:digits", "primary", "2")
        # exec: the shell became redis-server, so the kubelet's SIGTERM reaches it
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        proc = _start(script, env)
        _wait_ping(client, proc)
        assert client.hget("tritonguard:state:digits", "primary") == b"2", "AOF did not keep the state"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_init_container_copies_the_image_models_once(docs, tmp_path):
    pod = one(docs["default"], "Deployment", FULL)["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    script = init["args"][0]
    models = tmp_path / "image-models"
    (models / "digits" / "1").mkdir(parents=True)
    (models / "digits" / "config.pbtxt").write_text('backend: "guard"\n')
    (models / "digits_raw" / "1").mkdir(parents=True)
    (models / "digits_raw" / "1" / "model.onnx").write_bytes(b"onnx")
    repo = tmp_path / "data" / "models"
    env = {"PATH": os.environ["PATH"], "REPOSITORY": str(repo), "IMAGE_MODELS": str(models)}
    first = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, check=False)
    assert first.returncode == 0, first.stderr
    assert "copied 2 models" in first.stdout
    assert (repo / "digits" / "config.pbtxt").read_text() == 'backend: "guard"\n'
    assert (repo / "digits" / "1").is_dir(), "an empty version folder (a guard's) must be copied too"
    # a restarted pod keeps what the repository holds (versions exported since, state files)
    (repo / "digits_raw" / "2").mkdir()
    again = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, check=False)
    assert again.returncode == 0 and "left as it is" in again.stdout
    assert (repo / "digits_raw" / "2").is_dir()


def _job(docs) -> tuple[dict, dict]:
    job = one(docs["examples/pvc.yaml"], "Job")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e and "$(" not in e["value"]}
    return c, env


def _bin_with(tmp_path: Path, python3: str) -> str:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text(python3)
    (bindir / "python3").chmod(0o755)
    return f"{bindir}:{os.environ['PATH']}"


def test_rollout_job_exits_with_promotes_exit_code(docs, tmp_path):
    """The real exporter behind the Job's wrapper: a rollout of a model the repository does not
    hold is bad input (2), and the pod exits with that code."""
    from exporter.cli.rollout_common import EXIT_HOLDING, EXIT_ROLLED_BACK
    from exporter.errors import EXIT_BAD_INPUT

    # the codes the chart, its NOTES and docs/kubernetes.md promise
    assert (EXIT_ROLLED_BACK, EXIT_BAD_INPUT, EXIT_HOLDING) == (1, 2, 3)
    c, env = _job(docs)
    path = _bin_with(tmp_path, f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    run_env = {**env, "PATH": path, "HOME": str(tmp_path), "TRITONGUARD_REPLICAS": "localhost",
               "REPOSITORY": str(tmp_path / "models"), "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.run([*c["command"], *c["args"]], env=run_env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "promote digits v2 to production on: --server=http://127.0.0.1:8000" in proc.stderr
    assert "no model 'digits'" in proc.stderr


def test_rollout_job_passes_every_replica_and_the_extra_flags(docs, tmp_path):
    """The wrapper names each address behind the headless Service with --server, appends
    rollout.args, and hands the exit code through unchanged (here a stand-in promote that
    records its argv and says 3, holding)."""
    c, env = _job(docs)
    record = tmp_path / "argv.json"
    stand_in = (f'#!/bin/sh\nif [ "$1" = "-c" ]; then exec "{sys.executable}" "$@"; fi\n'
                f'"{sys.executable}" -c \'import json, sys; json.dump(sys.argv[1:], open("{record}", "w"))\' "$@"\n'
                "exit 3\n")
    run_env = {**env, "PATH": _bin_with(tmp_path, stand_in), "TRITONGUARD_REPLICAS": "localhost"}
    proc = subprocess.run([*c["command"], *c["args"]], env=run_env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 3, proc.stderr
    argv = json.loads(record.read_text())
    servers = [a for a in argv if a.startswith("--server=")]
    assert "--server=http://127.0.0.1:8000" in servers
    assert all(s in ("--server=http://127.0.0.1:8000", "--server=http://[::1]:8000") for s in servers)
    rest = [a for a in argv if not a.startswith("--server=")]
    assert rest == ["-m", "exporter", "promote", "digits", "--version", "2", "--to", "production",
                    "--repository", "/var/lib/tritonguard/models",
                    "--steps=5,25,50,100", "--dwell-s=300", "--max-cost-increase=10%"]
    # no replica to roll out on: bad input, and promote is not started
    record.unlink()
    none = subprocess.run([*c["command"], *c["args"]], env={**run_env, "TRITONGUARD_REPLICAS": ""},
                          capture_output=True, text=True, timeout=60, check=False)
    assert none.returncode == 2 and "no ready server" in none.stderr
    assert not record.exists()


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[dict] = []

    def do_GET(self):  # noqa: N802 - http.server's naming
        _Recorder.seen.append(dict(self.headers))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_the_jobs_admin_key_is_the_header_the_server_demands(docs, monkeypatch):
    from exporter.rollout import serving
    from tritonguard.ops.supervisor.control import repository_headers

    pvc = docs["examples/pvc.yaml"]
    server_args = one(pvc, "Deployment", FULL)["spec"]["template"]["spec"]["containers"][0]["args"]
    job_env = {e["name"]: e for e in one(pvc, "Job")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert job_env["TRITONGUARD_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "admin-key"
    key = "admin-0123456789abcdef"
    demanded = repository_headers([a.replace("$(TRITONGUARD_ADMIN_KEY)", key) for a in server_args])
    assert job_env["TRITONGUARD_ADMIN_HEADER"]["value"] == serving.ADMIN_HEADER == next(iter(demanded))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("TRITONGUARD_ADMIN_KEY", key)
        _Recorder.seen.clear()
        status, _ = serving._request(f"http://127.0.0.1:{server.server_port}/v2/repository/index")
        assert status == 200
        sent = {k.lower(): v for k, v in _Recorder.seen[-1].items()}
        assert {k: sent.get(k) for k in demanded} == demanded
    finally:
        server.shutdown()
        server.server_close()

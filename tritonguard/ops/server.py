"""Start a real tritonserver (through the launcher) on free loopback ports, and stop it by PID.

Used by the functional tests and by ``perf/``; nothing here is on the serving path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tritonguard.triton import http as triton_http

_HANDED_OUT: set[int] = set()  # ports this process has handed out (each server takes three)
# Several processes picking ports at once (the test suite's lanes: tests/lanes.py) would each
# only know their own hand-outs: a port picked by one, not yet bound by its server (a
# tritonserver binds seconds later), could be picked by the other. TRITONGUARD_PORT_LANE="k/n"
# gives this process the ports whose bit 1 and up, modulo n, is k (bit 0 is left out: Linux
# hands odd ports to bind(0) first), so lanes never pick the same port.
ENV_PORT_LANE = "TRITONGUARD_PORT_LANE"


def _port_lane() -> tuple[int, int] | None:
    spec = os.environ.get(ENV_PORT_LANE, "")
    if not spec:
        return None
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"{ENV_PORT_LANE}={spec!r}: expected k/n, e.g. 0/2") from None
    if not 0 <= k < n:
        raise ValueError(f"{ENV_PORT_LANE}={spec!r}: k must be in 0..n-1")
    return k, n


def free_port() -> int:
    """A loopback port free now and not handed out before by this process: the kernel may give
    a port just closed to the next bind(0), and two servers set up back to back (replicas) then
    got the same port and one of them could never start (seen in CI: "already in use")."""
    lane = _port_lane()
    for _ in range(400):
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if lane is not None and (port >> 1) % lane[1] != lane[0]:
            continue
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no loopback port left that this process has not handed out already")


def tritonserver_command() -> list[str]:
    exe = Path(sys.executable).parent / "tritonserver"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "import sys; from tritonguard.ops.launcher import tritonserver_main as m; sys.exit(m())"]


@dataclass
class Server:
    repository: str | Path  # a folder, or an object-store URL kept whole (Path() would fold s3:// into s3:/)
    log_path: Path
    extra_args: Sequence[str] = ()
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, wait_models: Sequence[str] = (), timeout: float = 180.0) -> Server:
        args = [
            *tritonserver_command(),
            f"--model-repository={self.repository}",
            "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
            f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false", "--exit-on-error=false", "--strict-readiness=false",
            *self.extra_args,
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        pending = list(wait_models)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}; log: {self.log_path}\n{self.tail()}")
            if self._ok("/v2/health/live"):
                pending = [m for m in pending if not self._ok(f"/v2/models/{m}/ready")]
                if not pending:
                    return self
                failed = self._failed(pending)
                if failed:
                    self.stop()
                    raise RuntimeError(f"models failed to load: {failed}; log: {self.log_path}")
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"models {pending} not ready after {timeout:.0f}s; log: {self.log_path}\n{self.tail()}")

    def _ok(self, path: str) -> bool:
        try:
            return triton_http.request(f"http://{self.http_url}{path}", timeout=2)[0] == 200
        except triton_http.Unreachable:
            return False

    def _failed(self, models: Sequence[str]) -> dict[str, str]:
        """Models of ``models`` that Triton reports UNAVAILABLE with a reason (a failed load)."""
        import json  # noqa: PLC0415

        try:
            status, body = triton_http.request(f"http://{self.http_url}/v2/repository/index", "POST", b"{}", timeout=2)
            index = json.loads(body) if status == 200 else []
        except (triton_http.Unreachable, ValueError):
            return {}
        return {m["name"]: m.get("reason", "") for m in index
                if m["name"] in models and m.get("state") == "UNAVAILABLE" and m.get("reason")}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self._ok("/v2/health/live")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group (its stubs too), by PID; SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

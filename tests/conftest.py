"""Shared fixtures: a real, throw-away redis-server on a free loopback port; the root logger's
handlers put back after each test."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.processes import stop_process
from tritonguard.ops.server import free_port


@pytest.fixture(autouse=True)
def _root_log_handlers():
    """`exporter`'s CLI (run in process by CliRunner) points the root logger at CliRunner's
    stderr, which is closed once the invoke returns: a later test that logs through the root
    (matplotlib's first-run "generated new fontManager" in test_tune) then printed a logging
    traceback. Each test gets the root handlers it started with."""
    root = logging.getLogger()
    _drop_closed_stream_handlers(root)
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _drop_closed_stream_handlers(root: logging.Logger) -> None:
    """A module- or session-scoped fixture that ran the CLI through CliRunner did so before the
    snapshot above (wider fixtures set up first), so its handler, on a stream CliRunner has since
    closed, was in every later test's snapshot and put back after it: test_tune's `tune` (no
    logging setup of its own) then logged matplotlib's first-run line into it, on a fresh machine
    only (CI, 2026-11-28). Such a handler can never write again: it goes."""
    for h in list(root.handlers):
        if isinstance(h, logging.StreamHandler) and getattr(h.stream, "closed", False):
            root.removeHandler(h)


REDIS_SERVER = "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else shutil.which("redis-server")


_free_port = free_port  # one picker per process: its ports never collide with the servers'


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process; ``stop()``/``start()`` keep the port for outage tests."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not _ping(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} on port {self.port}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    if not REDIS_SERVER:
        pytest.skip("redis-server is not installed (/usr/bin/redis-server; apt-get install redis-server)")
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


# moto_server's own app, answering one request at a time (moto_server runs it threaded). moto
# checks a put's If-None-Match and stores the object in two steps, so two threads putting one key
# at once can both succeed: the second overwrites the first. S3 (since 2024-11) and MinIO make
# the check and the write one step; one request at a time makes moto do the same
MOTO_SERIAL = ("import sys; from werkzeug.serving import run_simple; "
               "from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app; "
               "run_simple(sys.argv[1], int(sys.argv[2]), DomainDispatcherApplication(create_backend_app), "
               "threaded=False)")


class MotoS3:
    """moto's S3 server (``moto_server``), an S3 stand-in, as a subprocess on a free loopback
    port: the object-store tests talk real HTTP to it through boto3, as Triton would."""

    def __init__(self, serial: bool = False):
        self.serial = serial
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self, timeout: float = 30.0) -> None:
        import sys  # noqa: PLC0415
        import urllib.request  # noqa: PLC0415

        binary = Path(sys.executable).parent / "moto_server"
        cmd = [str(binary), "-H", "127.0.0.1", "-p", str(self.port)]
        if self.serial:
            cmd = [sys.executable, "-c", MOTO_SERIAL, "127.0.0.1", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=0.5):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"moto_server exited with {self.proc.returncode}") from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto_server did not answer") from None
                time.sleep(0.1)

    def client(self):
        import boto3  # noqa: PLC0415

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="session")
def moto_s3():
    if not (Path(__import__("sys").executable).parent / "moto_server").exists():
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    srv = MotoS3()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _point_aws_at(srv: MotoS3, monkeypatch) -> MotoS3:
    for k, v in srv.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", srv.endpoint)
    return srv


@pytest.fixture
def aws_env(moto_s3, monkeypatch):
    """The AWS_* variables boto3 (and Triton) read, pointing at the moto server."""
    return _point_aws_at(moto_s3, monkeypatch)


@pytest.fixture
def atomic_aws_env(monkeypatch):
    """:func:`aws_env` on a moto of its own that answers one request at a time (:data:`MOTO_SERIAL`),
    so that a conditional put is atomic as on S3: for writers that race on one key. On the shared,
    threaded moto, three history writers at once left 14 records of 15 (2026-11-29, and run 34 on
    2026-11-30): two puts of one key both passed moto's If-None-Match check."""
    pytest.importorskip("moto.moto_server.werkzeug_app", reason="moto's server is not installed (pip install 'moto[server]')")
    srv = MotoS3(serial=True)
    srv.start()
    try:
        yield _point_aws_at(srv, monkeypatch)
    finally:
        srv.stop()


# -- the wall time of each module, printed at the end of every run (issue 40) -------------------
# A module that grows is seen in the next review: pytest's --durations lists tests, not modules,
# and the cost of a module's fixtures (a tritonserver start, exports) lands on its first test.
# Beside the wall time, the CPU seconds the module used: this process's and its children's
# (a tritonserver and its Python stubs count once the server is stopped and reaped, so a server
# of session scope counts against the module that ran last). On two cores the suite is bound by
# CPU, not by waiting: the CPU column says where making a module faster would pay.
_MODULE_SECONDS: dict[str, float] = {}
_MODULE_CPU: dict[str, float] = {}
_CPU_AT_START: dict[str, float] = {}


def _cpu_seconds() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def pytest_runtest_logstart(nodeid, location):
    _CPU_AT_START[nodeid] = _cpu_seconds()


def pytest_runtest_logfinish(nodeid, location):
    start = _CPU_AT_START.pop(nodeid, None)
    if start is not None:
        module = nodeid.split("::", 1)[0]
        _MODULE_CPU[module] = _MODULE_CPU.get(module, 0.0) + _cpu_seconds() - start


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _MODULE_SECONDS:
        return
    total = sum(_MODULE_SECONDS.values())
    terminalreporter.section("wall time per module (setup + call + teardown), and CPU seconds used")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1]):
        if seconds >= 1.0:
            cpu = _MODULE_CPU.get(module, 0.0)
            terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:5.1f} %  cpu {cpu:7.1f} s  {module}")
    fast = [s for s in _MODULE_SECONDS.values() if s < 1.0]
    if fast:
        terminalreporter.write_line(f"{sum(fast):8.1f} s          {len(fast)} modules under 1 s each")
    terminalreporter.write_line(f"{total:8.1f} s  in all, over {len(_MODULE_SECONDS)} modules; "
                                f"cpu {sum(_MODULE_CPU.values()):.1f} s")

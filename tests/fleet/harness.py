"""The whole fleet on one machine (issue 30): a real Triton fleet on loopback, for `make fleet`
and tests/functional/test_fleet.py.

Each part is a real server, started as a child process on free 127.0.0.1 ports, waited for with a
bounded readiness check, and stopped by its PID (its process group for tritonserver):

- :class:`MotoS3`     an S3-compatible object store (``moto[server]``) and a bucket; the models are
                      published into ``s3://http://127.0.0.1:PORT/bucket/prefix`` by the exporter's
                      publisher (:func:`publish_models`);
- :class:`Redis`      ``redis-server``: the fleet's rollout state, breakers, quotas and replica
                      registry (``TRITONGUARD_STATE_URL``);
- :class:`Replica`    one tritonserver, started through the project's launcher exactly as
                      ``tritonguard.ops.server.Server`` starts it, with ``--model-repository`` the
                      ``s3://http://…`` URL, heartbeating into Redis;
- :class:`Nginx`      a load balancer in front of the replicas: an HTTP upstream and a gRPC
                      (HTTP/2, ``grpc_pass``) upstream, passive health (``max_fails`` /
                      ``fail_timeout``) and ``proxy_next_upstream … non_idempotent``;
- :class:`Prometheus` Debian's Prometheus scraping every replica's metrics port every second, with
                      the project's recording rules and alerts loaded;
- :class:`Fleet`      all of them together (``python -m tests.fleet.harness`` = ``make fleet``
                      serves one until SIGINT (Ctrl-C) or SIGTERM and prints the URLs as JSON;
                      its work folder is removed at the end unless ``--keep``).

Dependencies, and exactly what is used from the project:

- Run it with the project's interpreter (``.venv/bin/python``): :class:`Replica` wraps
  ``tritonguard.ops.server.Server`` (its ``start(wait_models, timeout)``, ``stop()``, ``proc``,
  ``http_url`` / ``grpc_url`` / ``metrics_url``, ``tail()``), which runs
  ``<sys.executable's bin>/tritonserver``, the console entry ``tritonguard.ops.launcher:tritonserver_main``
  (backend dir composed, PATH / LD_LIBRARY_PATH set, server run under ``tritonguard.ops.supervisor``).
  ``tritonguard.ops.server.free_port`` hands out every port here. The models are published with
  ``exporter.records.remote.publish`` and ``tritonguard.core.objectstore.parse`` (the exporter's
  own path to a store).
- ``boto3`` (uploads, bucket creation): imported lazily, only by :meth:`MotoS3.client`.
- ``redis-server`` (Debian ``redis-server``) as an executable.
- ``moto_server`` (from ``moto[server]``), ``/usr/sbin/nginx`` (Debian ``nginx``),
  ``/usr/bin/prometheus`` and ``/usr/bin/promtool`` (Debian ``prometheus``) as executables. Where
  each is looked for: the ``find_*`` helpers below (environment variables override).

Processes: every child is started with ``start_new_session=True`` (its own process group), so a
stop or a SIGKILL reaches the whole tree (tritonserver's Python stubs, nginx's workers) and
nothing else. Only 127.0.0.1 is ever bound or contacted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tritonguard.ops.server import Server, free_port

LOOPBACK = "127.0.0.1"
# moto accepts any credentials; Triton's S3 client and boto3 both read these standard variables.
FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------
def wait_until(check: Callable[[], bool], timeout: float, what: str, *, interval: float = 0.2,
               proc: subprocess.Popen | None = None, log: Path | None = None) -> float:
    """Poll ``check`` until it is true; return the seconds waited. Raise TimeoutError after
    ``timeout`` seconds, or RuntimeError at once if ``proc`` exits meanwhile (with its log's tail)."""
    start = time.monotonic()
    while True:
        if check():
            return time.monotonic() - start
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}{_tail(log)}")
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{what}: not ready after {timeout:.0f}s{_tail(log)}")
        time.sleep(interval)


def _tail(log: Path | None, n: int = 20) -> str:
    if log is None:
        return ""
    try:
        lines = log.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return ""
    return "\n--- " + str(log) + "\n" + "\n".join(lines)


def http(url: str, method: str = "GET", body: bytes | dict | None = None, timeout: float = 5.0,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One HTTP request with the standard library: (status, body); status 0 when unreachable."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def port_open(port: int, host: str = LOOPBACK) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _find(env_var: str, names: Sequence[str]) -> str:
    """An executable: ``$env_var``, else the first of ``names`` next to this interpreter or on
    PATH (absolute names are taken as they are)."""
    explicit = os.environ.get(env_var)
    if explicit:
        return explicit
    for name in names:
        if os.path.isabs(name) and os.access(name, os.X_OK):
            return name
        beside = Path(sys.executable).parent / name
        if beside.exists():
            return str(beside)
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(f"none of {list(names)} found (set {env_var})")


def find_moto_server() -> str:
    return _find("FLEET_MOTO_SERVER", ["moto_server"])


def find_nginx() -> str:
    return _find("FLEET_NGINX", ["/usr/sbin/nginx", "nginx"])


def find_prometheus() -> str:
    return _find("FLEET_PROMETHEUS", ["/usr/bin/prometheus", "prometheus"])


def find_promtool() -> str:
    return _find("FLEET_PROMTOOL", ["/usr/bin/promtool", "promtool"])


def _state(stat: str) -> tuple[str, int]:
    """(state, process group) from the text of a ``/proc/<pid>/stat`` file."""
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[0], int(fields[2])


def _group_alive(pgid: int) -> bool:
    """Any thread left running in the process group ``pgid``.

    Every thread, not each process's main thread: after SIGKILL the main thread of a process with
    many threads (tritonserver runs ~117) can be a zombie while its other threads are still
    exiting, and a process's sockets close only with its last thread (tests/unit/
    test_fleet_harness.py: such a process still accepts connections). With the main threads
    alone, 4 of 45 kills of a replica under gRPC load through nginx (a kill loop on this machine,
    2026-12-01) had a failed call sent 1-16 ms after the check said gone, each with nginx's
    "reset while reading response header". Counting every thread, the group was gone 100-200 ms
    after the kill (the stubs' threads end last), and no failed call was sent after that."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            state, group = _state(Path(f"/proc/{entry.name}/stat").read_text())
            if group != pgid:
                continue
            if state not in "ZX":
                return True
            for task in os.scandir(f"/proc/{entry.name}/task"):  # threads still exiting
                if _state(Path(f"/proc/{entry.name}/task/{task.name}/stat").read_text())[0] not in "ZX":
                    return True
        except (OSError, ValueError, IndexError):
            continue  # gone while read
    return False


class Child:
    """A child process in its own process group, with its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None):
        self.name, self.argv, self.log, self.env, self.cwd = name, list(argv), log, env, cwd
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> Child:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.cwd, stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, sig: int) -> None:
        """Send ``sig`` to the child's PID only (nginx and Prometheus handle their own workers)."""
        if self.running():
            os.kill(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """``sig`` to the child's PID, then SIGKILL to its process group if it lingers."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # pgid == pid (new session)
                self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, 0)  # anything left in the group (a worker)? then end it
            os.killpg(self.proc.pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------
# the object store
# --------------------------------------------------------------------------------------------
class MotoS3:
    """``moto_server`` on a free loopback port: an in-memory S3 (state dies with the process)."""

    def __init__(self, workdir: Path, port: int | None = None, executable: str | None = None):
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.child = Child("moto", [executable or find_moto_server(), "-H", LOOPBACK, "-p", str(self.port)],
                           self.workdir / "moto.log", env={**os.environ, **FAKE_AWS})
        self._client = None

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def env(self) -> dict[str, str]:
        """The variables a client of this store needs: the fake keys, the region and
        ``AWS_ENDPOINT_URL`` (read by boto3/botocore >= 1.31; Triton takes the endpoint from
        the URL instead, see :meth:`triton_url`)."""
        return {**FAKE_AWS, "AWS_ENDPOINT_URL": self.endpoint}

    def triton_url(self, bucket: str, prefix: str = "") -> str:
        """The ``--model-repository`` form Triton 2.51 takes for an S3-compatible endpoint:
        ``s3://http://host:port/bucket/prefix`` (the scheme after ``s3://`` picks plain HTTP)."""
        return f"s3://{self.endpoint}/{bucket}" + (f"/{prefix.strip('/')}" if prefix.strip("/") else "")

    def start(self, timeout: float = 30.0) -> MotoS3:
        self.child.start()
        wait_until(lambda: http(self.endpoint + "/", timeout=1)[0] == 200, timeout, "moto_server",
                   proc=self.child.proc, log=self.child.log)
        return self

    def stop(self) -> None:
        self.child.stop()

    def client(self):
        """A boto3 S3 client for this store (path-style addressing: a loopback IP has no
        virtual-host names)."""
        if self._client is None:
            import boto3  # noqa: PLC0415 - only the store needs it
            from botocore.config import Config  # noqa: PLC0415

            self._client = boto3.client("s3", endpoint_url=self.endpoint, region_name=FAKE_AWS["AWS_DEFAULT_REGION"],
                                        aws_access_key_id=FAKE_AWS["AWS_ACCESS_KEY_ID"],
                                        aws_secret_access_key=FAKE_AWS["AWS_SECRET_ACCESS_KEY"],
                                        config=Config(s3={"addressing_style": "path"},
                                                      retries={"max_attempts": 2},
                                                      connect_timeout=2, read_timeout=10))
        return self._client

    def create_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)

    def upload_tree(self, local: Path, bucket: str, prefix: str = "", *, placeholder: str | None = None,
                    skip: Callable[[Path], bool] | None = None, last: Iterable[str] = ("manifest.json",),
                    ) -> list[str]:
        """Copy the folder ``local`` to ``s3://bucket/prefix/`` and return the keys written, in order.

        - ``placeholder``: a file name (e.g. ``.keep``) written into every empty folder, which an
          object store cannot otherwise hold (Triton then sees no version folder at all);
        - ``skip(relative_path)``: leave a file out (to simulate an interrupted upload);
        - ``last``: file names uploaded after every other file (the manifest that makes a
          version visible to readers goes last).
        """
        local = Path(local)
        prefix = prefix.strip("/")
        files: list[tuple[Path, str]] = []
        for path in sorted(local.rglob("*")):
            rel = path.relative_to(local)
            if path.is_dir():
                if placeholder and not any(path.iterdir()):
                    files.append((None, f"{rel.as_posix()}/{placeholder}"))  # type: ignore[arg-type]
                continue
            if skip and skip(rel):
                continue
            files.append((path, rel.as_posix()))
        last = set(last)
        files.sort(key=lambda f: Path(f[1]).name in last)  # stable: `last` files at the end
        keys = []
        s3 = self.client()
        for path, rel in files:
            key = f"{prefix}/{rel}" if prefix else rel
            if path is None:
                s3.put_object(Bucket=bucket, Key=key, Body=b"")
            else:
                s3.upload_file(str(path), bucket, key)
            keys.append(key)
        return keys

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        out: list[str] = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out.extend(o["Key"] for o in page.get("Contents", []))
        return out


# --------------------------------------------------------------------------------------------
# tritonserver replicas
# --------------------------------------------------------------------------------------------
@dataclass
class Replica:
    """One tritonserver through the project's launcher (``tritonguard.ops.server.Server``).

    ``repository`` is passed to ``--model-repository`` verbatim: keep an ``s3://http://…`` URL a
    ``str`` (``pathlib.Path`` would fold its ``//``). ``env`` is added to this process's
    environment; ``TRITONGUARD_HOME`` is set to ``workdir/home`` so the launcher composes its
    backend directory there rather than under the venv.
    """

    name: str
    repository: str
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    extra_args: Sequence[str] = ()
    server: Server | None = None
    started_s: float | None = None  # seconds from start() to ready, last start
    # Triton's /tmp/folderXXXXXX copies of this replica's models, as seen in its stubs' argv
    # (remembered: a dead stub no longer shows its copy, and Triton leaves that copy behind)
    copies: set[Path] = field(default_factory=set)
    killed_at: float | None = None  # time.monotonic() of the last kill()'s SIGKILL
    dead_at: float | None = None  # ... and when its process group was gone (or 5 s later)

    def _new_server(self) -> Server:
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
               "TRITONGUARD_HOME": str(self.workdir / self.name / "home"), **self.env}
        env.pop("TRITONGUARD_REPOSITORY", None)  # the launcher sets it from --model-repository
        old = self.server
        kwargs = {}
        if old is not None:  # a restart keeps its ports, as a restarted pod keeps its Service
            kwargs = {"http_port": old.http_port, "grpc_port": old.grpc_port, "metrics_port": old.metrics_port}
        return Server(repository=self.repository,  # type: ignore[arg-type] - str on purpose (see above)
                      log_path=self.workdir / self.name / "tritonserver.log", extra_args=list(self.extra_args), env=env,
                      **kwargs)

    def start(self, wait_models: Sequence[str] = (), timeout: float = 180.0) -> Replica:
        """Start and wait until live and every model of ``wait_models`` is ready (the server's
        own check: a model that Triton reports UNAVAILABLE with a reason fails at once)."""
        self.server = self._new_server()
        t0 = time.monotonic()
        self.server.start(wait_models=wait_models, timeout=timeout)
        self.started_s = time.monotonic() - t0
        self.stubs()  # note the copies of the models loaded at start
        return self

    @property
    def http_url(self) -> str:
        return f"http://{self.server.http_url}"

    @property
    def grpc_target(self) -> str:
        return self.server.grpc_url

    @property
    def metrics_target(self) -> str:
        return f"{LOOPBACK}:{self.server.metrics_port}"

    @property
    def pid(self) -> int | None:
        return self.server.proc.pid if self.server and self.server.proc else None

    def running(self) -> bool:
        return bool(self.server and self.server.proc and self.server.proc.poll() is None)

    def stubs(self) -> list[dict]:
        """This replica's Python backend stubs, from ``/proc`` (members of its process group):
        ``pid``, ``model_py`` (the model.py path Triton gave it: under a temp folder when the
        repository is in an object store), ``shm`` (its shared-memory region), ``instance``."""
        if not self.running():
            return []
        out = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if _state(Path(f"/proc/{entry.name}/stat").read_text())[1] != self.pid:
                    continue
                argv = [a.decode(errors="replace")
                        for a in Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")]
            except (OSError, ValueError, IndexError):
                continue
            if argv and argv[0].endswith("triton_python_backend_stub") and len(argv) > 8:
                out.append({"pid": int(entry.name), "model_py": argv[1], "shm": argv[2], "instance": argv[8]})
        self.copies |= {Path(s["model_py"]).parents[1] for s in out if s["model_py"].startswith("/tmp/folder")}
        return out

    def _leftovers(self) -> tuple[list[str], set[Path]]:
        """What a killed server leaves behind and cannot remove itself: its stubs' shared-memory
        regions (``/dev/shm``), and the ``/tmp/folderXXXXXX`` copies Triton downloaded its models
        from the object store into (the template is hard-coded in Triton; TMPDIR is not read).
        Read from the live stubs, so call it before the kill."""
        stubs = self.stubs()
        regions = [s["shm"] for s in stubs if s["shm"] and "/" not in s["shm"]]
        copies, self.copies = set(self.copies), set()
        return regions, copies

    @staticmethod
    def _clean(regions: list[str], copies: set[Path]) -> None:
        for region in regions:
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{region}")
        for copy in copies:  # gone already after a clean exit (Triton deletes its copies)
            shutil.rmtree(copy, ignore_errors=True)

    def kill(self) -> float:
        """SIGKILL the replica's whole process group (launcher, supervisor's tritonserver, stubs):
        a crashed machine. Cleans what the dead server leaves (:meth:`_leftovers`); returns the
        time.monotonic() of the kill."""
        regions, copies = self._leftovers()
        pid = self.pid
        when = time.monotonic()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            self.server.proc.wait(timeout=10)
            # the group's other members (tritonserver, stubs) are reaped by init: until they are
            # gone their sockets may still take a request (which then fails: in flight at the kill)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and _group_alive(pid):
                time.sleep(0.02)
        self.killed_at, self.dead_at = when, time.monotonic()
        self._clean(regions, copies)
        return when

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL after 30 s (``Server.stop``); then the same cleaning as
        :meth:`kill`, for a server that had to be killed. Pass ``--exit-timeout-secs`` below 30
        in ``extra_args`` (Triton waits that long for models that will not unload, e.g. one
        with a dead stub) so that Triton ends before the SIGKILL."""
        if self.server is not None:
            regions, copies = self._leftovers()
            self.server.stop()
            self._clean(regions, copies)


# --------------------------------------------------------------------------------------------
# the load balancer
# --------------------------------------------------------------------------------------------
NGINX_CONF = """\
# generated by harness.Nginx: one master in the foreground (stopped by its PID), own prefix, loopback only
daemon off;
master_process on;
worker_processes 1;
{user_line}
pid {dir}/nginx.pid;
error_log {dir}/error.log {error_level};
events {{ worker_connections 1024; }}

http {{
    log_format upstreams '$time_iso8601 $remote_addr "$request" $status $request_time '
                         'upstream=[$upstream_addr] upstream_status=[$upstream_status] '
                         'upstream_time=[$upstream_response_time]';
    access_log {dir}/access.log upstreams;
    client_body_temp_path {dir}/tmp/client_body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    client_max_body_size 64m;

    # passive health: after max_fails failed attempts within fail_timeout a server is left out
    # for fail_timeout, then tried again with one request
    upstream triton_http {{
{http_servers}
        keepalive 16;
    }}
    upstream triton_grpc {{
{grpc_servers}
        keepalive 16;
    }}

    server {{  # KServe v2 over HTTP/1.1
        listen {host}:{http_port};
        location = /lb-health {{ access_log off; return 200 "ok\\n"; }}
        location / {{
            proxy_pass http://triton_http;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_connect_timeout {connect_timeout};
            proxy_read_timeout {read_timeout};
            proxy_next_upstream {next_upstream};
            proxy_next_upstream_tries {tries};
            proxy_next_upstream_timeout {next_upstream_timeout};
        }}
    }}

    server {{  # KServe v2 over gRPC: HTTP/2 without TLS (clients use prior knowledge)
        listen {host}:{grpc_port} http2;
        location / {{
            grpc_pass grpc://triton_grpc;
            grpc_connect_timeout {connect_timeout};
            grpc_read_timeout {read_timeout};
            grpc_next_upstream {grpc_next_upstream};
            grpc_next_upstream_tries {tries};
            grpc_next_upstream_timeout {next_upstream_timeout};
        }}
    }}
}}
"""


@dataclass
class Nginx:
    """nginx (non-daemon, own prefix under ``workdir``) balancing HTTP and gRPC over the replicas.

    ``retry_non_idempotent``: an infer is a POST, which nginx does not pass to the next server
    once it was sent to one (a replica killed mid-request; a kept-alive connection found dead)
    unless ``non_idempotent`` is in ``proxy_next_upstream``. Inference is a pure function here,
    so the harness retries by default; a guard with side effects (quota, audit) may count twice.
    """

    workdir: Path
    http_upstreams: Sequence[str]  # host:port of each replica's HTTP endpoint
    grpc_upstreams: Sequence[str]
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    max_fails: int = 1
    fail_timeout_s: int = 5
    retry_non_idempotent: bool = True
    connect_timeout: str = "1s"
    read_timeout: str = "60s"
    tries: int = 3
    child: Child | None = None

    @property
    def dir(self) -> Path:
        return Path(self.workdir) / "nginx"

    @property
    def http_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    @property
    def access_log(self) -> Path:
        return self.dir / "access.log"

    def render(self) -> str:
        def servers(targets: Sequence[str]) -> str:
            return "\n".join(f"        server {t} max_fails={self.max_fails} fail_timeout={self.fail_timeout_s}s;"
                             for t in targets)

        extra = " non_idempotent" if self.retry_non_idempotent else ""
        # root starts workers as another user; Debian has no group "nobody", so name it
        user_line = "user nobody nogroup;" if os.geteuid() == 0 else ""
        return NGINX_CONF.format(
            user_line=user_line, dir=self.dir, error_level="warn", host=LOOPBACK,
            http_port=self.http_port, grpc_port=self.grpc_port,
            http_servers=servers(self.http_upstreams), grpc_servers=servers(self.grpc_upstreams),
            connect_timeout=self.connect_timeout, read_timeout=self.read_timeout, tries=self.tries,
            next_upstream_timeout="10s",
            next_upstream="error timeout http_502 http_504" + extra,
            grpc_next_upstream="error timeout http_502 http_504" + extra,  # gRPC errors ride in trailers (HTTP 200)
        )

    def write_config(self) -> Path:
        (self.dir / "tmp").mkdir(parents=True, exist_ok=True)
        conf = self.dir / "nginx.conf"
        conf.write_text(self.render())
        return conf

    def _argv(self, *extra: str) -> list[str]:
        # -e: the error log before the config is read (else /var/log/nginx/error.log)
        return [find_nginx(), "-p", str(self.dir), "-c", str(self.dir / "nginx.conf"),
                "-e", str(self.dir / "error.log"), *extra]

    def check(self) -> None:
        """``nginx -t`` on the written config; raises with its output on an error."""
        out = subprocess.run(self._argv("-t"), capture_output=True, text=True, timeout=30, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"nginx -t failed:\n{out.stdout}{out.stderr}")

    def start(self, timeout: float = 15.0) -> Nginx:
        self.write_config()
        self.check()
        self.child = Child("nginx", self._argv(), self.dir / "stdout.log").start()
        wait_until(lambda: http(self.http_url + "/lb-health", timeout=1)[0] == 200 and port_open(self.grpc_port),
                   timeout, "nginx", proc=self.child.proc, log=self.dir / "error.log")
        return self

    def reload(self, **changes) -> None:
        """Change settings (e.g. ``retry_non_idempotent=False``), rewrite, check, SIGHUP the
        master: new workers take the new config; the old ones finish their requests."""
        for k, v in changes.items():
            setattr(self, k, v)
        self.write_config()
        self.check()
        self.child.send(signal.SIGHUP)
        time.sleep(1.0)  # the master starts new workers and retires the old ones

    def stop(self) -> None:
        if self.child:
            self.child.stop(signal.SIGQUIT)  # graceful: workers finish their requests


# --------------------------------------------------------------------------------------------
# Prometheus
# --------------------------------------------------------------------------------------------
def default_rule_files() -> list[Path]:
    """The project's recording rules and alerts (``deploy/prometheus/rules.yml``), found next to
    the ``tritonguard`` package that is imported."""
    import tritonguard  # noqa: PLC0415

    return [Path(tritonguard.__file__).resolve().parents[1] / "deploy" / "prometheus" / "rules.yml"]


@dataclass
class Prometheus:
    """``/usr/bin/prometheus`` scraping ``targets`` (host:port of metrics endpoints; a dict
    gives each a ``replica`` label), storage in a temp dir, web on a free loopback port."""

    workdir: Path
    targets: Sequence[str] | dict[str, str]
    rule_files: Sequence[Path] = field(default_factory=default_rule_files)
    port: int = field(default_factory=free_port)
    scrape_interval: str = "1s"
    evaluation_interval: str = "1s"  # groups with their own `interval` (rules.yml: 30s) keep it
    child: Child | None = None

    @property
    def dir(self) -> Path:
        return Path(self.workdir) / "prometheus"

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def render(self) -> str:
        # JSON is valid YAML: no YAML library needed to write it
        targets = self.targets if isinstance(self.targets, dict) else {f"r{i}": t for i, t in enumerate(self.targets)}
        return json.dumps({
            "global": {"scrape_interval": self.scrape_interval, "scrape_timeout": self.scrape_interval,
                       "evaluation_interval": self.evaluation_interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [{
                "job_name": "triton",
                "static_configs": [{"targets": [t], "labels": {"replica": name}} for name, t in targets.items()],
            }],
        }, indent=2)

    def start(self, timeout: float = 30.0) -> Prometheus:
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "prometheus.yml"
        conf.write_text(self.render())
        check = subprocess.run([find_promtool(), "check", "config", str(conf)], capture_output=True, text=True,
                               timeout=60, check=False)
        if check.returncode != 0:
            raise RuntimeError(f"promtool check config failed:\n{check.stdout}{check.stderr}")
        self.child = Child("prometheus", [
            find_prometheus(), f"--config.file={conf}", f"--storage.tsdb.path={self.dir / 'data'}",
            f"--web.listen-address={LOOPBACK}:{self.port}", "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ], self.dir / "prometheus.log", cwd=self.dir).start()
        wait_until(lambda: http(self.url + "/-/ready", timeout=1)[0] == 200, timeout, "prometheus",
                   proc=self.child.proc, log=self.dir / "prometheus.log")
        return self

    def api(self, path: str, **params: str) -> dict | list:
        """GET ``/api/v1/<path>``; returns ``data``; raises on an error answer."""
        url = f"{self.url}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        status, body = http(url, timeout=10)
        try:
            doc = json.loads(body)
        except ValueError:
            raise RuntimeError(f"prometheus {path}: HTTP {status} {body[:200]!r}") from None
        if doc.get("status") != "success":
            raise RuntimeError(f"prometheus {path}: {doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, promql: str) -> list[dict]:
        """An instant query: the result vector (``[{"metric": {...}, "value": [t, "v"]}, …]``)."""
        data = self.api("query", query=promql)
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def scalar(self, promql: str) -> float | None:
        """An instant query expected to give one number (None for an empty result)."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def rules(self) -> list[dict]:
        """Every loaded rule (recording and alerting) with its group, ``health`` and ``lastError``."""
        out = []
        for group in self.api("rules")["groups"]:
            for rule in group["rules"]:
                out.append({"group": group["name"], "file": group["file"], **rule})
        return out

    def targets_health(self) -> dict[str, str]:
        """scrape URL -> up / down / unknown."""
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def stop(self) -> None:
        if self.child:
            self.child.stop(signal.SIGTERM, timeout=30)



# --------------------------------------------------------------------------------------------
# the shared state
# --------------------------------------------------------------------------------------------
def find_redis_server() -> str:
    return _find("FLEET_REDIS_SERVER", ["/usr/bin/redis-server", "redis-server"])


def _redis_ping(port: int, password: str = "") -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.5) as s:
            if password:  # RESP, so that any password (spaces, quotes) goes as one argument
                pw = password.encode()
                s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
                if not s.recv(16).startswith(b"+OK"):
                    return False
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class Redis:
    """``redis-server`` on a free loopback port, no persistence: the fleet's rollout state,
    breakers, quotas and replica registry (``TRITONGUARD_STATE_URL``). With ``password`` it
    requires it (``--requirepass``, given in the config file, never on a command line that
    ``ps`` shows) and :attr:`url` carries it as the chart's does (``redis://:PASSWORD@…``);
    ``extra_args`` go to redis-server as they are (e.g. ``--cluster-enabled yes``)."""

    workdir: Path
    port: int = field(default_factory=free_port)
    password: str = ""
    extra_args: Sequence[str] = ()
    name: str = "redis"
    child: Child | None = None

    @property
    def url(self) -> str:
        auth = f":{urllib.parse.quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{LOOPBACK}:{self.port}/0"

    @property
    def dir(self) -> Path:
        return Path(self.workdir) / self.name

    def start(self, timeout: float = 15.0) -> Redis:
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)
        conf = d / "redis.conf"
        conf.write_text(f"requirepass \"{self.password}\"\n" if self.password else "")
        conf.chmod(0o600)
        self.child = Child("redis", [find_redis_server(), str(conf), "--port", str(self.port), "--bind", LOOPBACK,
                                     "--save", "", "--appendonly", "no", "--dir", str(d), *self.extra_args],
                           d / "redis.log").start()
        wait_until(lambda: _redis_ping(self.port, self.password), timeout, "redis-server", interval=0.05,
                   proc=self.child.proc, log=d / "redis.log")
        return self

    def stop(self) -> None:
        if self.child:
            self.child.stop(signal.SIGTERM, timeout=10)


# --------------------------------------------------------------------------------------------
# the whole fleet
# --------------------------------------------------------------------------------------------
def publish_models(s3: MotoS3, url: str, repo: Path, models: Sequence[str], workdir: Path) -> list[str]:
    """Publish ``models`` of the local repository ``repo`` to ``url`` with the exporter's own
    publisher (``exporter.records.remote.publish``: every file of a version, then its manifest,
    then configs, guards last; empty version folders get a placeholder manifest). Run-time files
    (rollout state, locks, hidden folders) are left out. Returns the keys written, in order."""
    from exporter.records.remote import is_runtime, publish  # noqa: PLC0415
    from tritonguard.core import objectstore  # noqa: PLC0415

    local = Path(workdir) / "publish"
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    for m in models:
        shutil.copytree(Path(repo) / m, local / m, ignore=lambda d, names: [n for n in names if is_runtime(n)])
    spec = objectstore.parse(url, {**os.environ, **s3.env()})
    uploaded, _ = publish(spec, local, {}, s3=s3.client())
    return uploaded


@dataclass
class Fleet:
    """Object store + Redis + ``replicas`` tritonservers reading the store + nginx + Prometheus.

    The ``models`` of the local repository ``repo`` are published to
    ``s3://http://127.0.0.1:PORT/<bucket>/<prefix>`` with the exporter's publisher; every replica
    serves that URL through the project's launcher, with ``TRITONGUARD_STATE_URL`` (Redis) and
    ``TRITONGUARD_HEARTBEAT_S`` in its environment, explicit model control loading ``models``.
    ``namespace`` is the fleet's ``TRITONGUARD_NAMESPACE`` (replicas and :meth:`env` alike: every
    Redis key under ``tritonguard:{<namespace>}:``); ``redis_password`` makes Redis require one,
    carried in the URL as the chart does (``redis://:PASSWORD@…``).

    Without ``workdir`` the fleet makes its own (``/tmp/fleet-XXXX``: logs, Redis and replica
    homes, the published copy, a few MB) and :meth:`stop` removes it unless ``keep``; a
    ``workdir`` given is the caller's and is never removed."""

    repo: Path
    workdir: Path | None = None
    replicas: int = 3
    models: Sequence[str] = ("digits_raw", "digits")
    bucket: str = "models"
    prefix: str = "repo"
    heartbeat_s: float = 1.0
    namespace: str = ""
    redis_password: str = ""
    server_args: Sequence[str] | None = None
    moto_server: str | None = None
    s3: MotoS3 | None = None
    redis: Redis | None = None
    servers: list[Replica] = field(default_factory=list)
    lb: Nginx | None = None
    prom: Prometheus | None = None
    published: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    keep: bool = False
    made_workdir: bool = False  # the folder is this fleet's own (mkdtemp), removed by stop()

    @property
    def url(self) -> str:
        return self.s3.triton_url(self.bucket, self.prefix)

    def make_workdir(self) -> Path:
        """The work folder: the one given, or a new ``/tmp/fleet-XXXX`` of this fleet's own."""
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="fleet-"))
            self.made_workdir = True
        return self.workdir

    def env(self) -> dict[str, str]:
        """What a client of this fleet (``python -m exporter …``) needs: the store's AWS_*
        variables, the Redis URL and the fleet's namespace."""
        return {**self.s3.env(), "TRITONGUARD_STATE_URL": self.redis.url, **self.namespace_env()}

    def namespace_env(self) -> dict[str, str]:
        return {"TRITONGUARD_NAMESPACE": self.namespace} if self.namespace else {}

    def replica_env(self) -> dict[str, str]:
        env = {**FAKE_AWS, "TRITONGUARD_STATE_URL": self.redis.url,
               "TRITONGUARD_HEARTBEAT_S": str(self.heartbeat_s), **self.namespace_env()}
        return env

    def start(self, timeout: float = 180.0) -> Fleet:
        self.make_workdir()
        t = time.monotonic()
        try:
            self.s3 = MotoS3(self.workdir, executable=self.moto_server).start()
            self.s3.create_bucket(self.bucket)
            self.redis = Redis(self.workdir, password=self.redis_password).start()
            self.published = publish_models(self.s3, self.url, self.repo, self.models, self.workdir)
            self.timings["store_s"] = time.monotonic() - t
            args = self.server_args
            if args is None:
                args = ["--model-control-mode=explicit", *(f"--load-model={m}" for m in self.models),
                        "--exit-timeout-secs=5"]
            for i in range(self.replicas):  # one at a time: they may share two cores
                r = Replica(f"replica{i}", self.url, self.workdir, env=self.replica_env(), extra_args=args)
                self.servers.append(r)
                r.start(wait_models=self.models, timeout=timeout)
            self.lb = Nginx(self.workdir, [r.server.http_url for r in self.servers],
                            [r.server.grpc_url for r in self.servers]).start()
            self.prom = Prometheus(self.workdir, {r.name: r.metrics_target for r in self.servers}).start()
            self.timings["start_s"] = time.monotonic() - t
        except BaseException:
            self.stop()
            raise
        return self

    def urls(self) -> dict[str, object]:
        return {
            "s3": self.s3.endpoint if self.s3 else None,
            "repository": self.url if self.s3 else None,
            "state_url": self.redis.url if self.redis else None,
            "http": self.lb.http_url if self.lb else None,
            "grpc": self.lb.grpc_target if self.lb else None,
            "prometheus": self.prom.url if self.prom else None,
            "replicas": [{"name": r.name, "pid": r.pid, "http": r.http_url, "grpc": r.grpc_target,
                          "metrics": r.server.metrics_url, "ready_s": round(r.started_s or 0, 1)}
                         for r in self.servers if r.server],
            "env": {k: v for k, v in (self.env() if self.s3 and self.redis else {}).items()},
            "workdir": str(self.workdir),
        }

    def stop(self) -> None:
        """Everything this fleet started, in reverse order, each by its PID; then its own work
        folder, unless ``keep``. An interrupt (a second Ctrl-C) while one part stops does not
        skip the others: it is raised once every part is stopped."""
        interrupted: BaseException | None = None
        for part in (self.prom, self.lb, *reversed(self.servers), self.redis, self.s3):
            if part is not None:
                try:
                    part.stop()
                except Exception:  # noqa: BLE001, S110 - the next part must be stopped all the same
                    pass
                except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt: finish first
                    interrupted = interrupted or exc
        if self.made_workdir and not self.keep and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if interrupted is not None:
            raise interrupted

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM reached :func:`serve`: leave what is running (a start in progress
    too); the ``with`` around the fleet stops what was started."""


class StopSignals:
    """SIGINT and SIGTERM alike, for as long as the ``with`` lasts. Python's own SIGINT handler
    is not enough: a process started with ``&`` from a script inherits SIGINT ignored, and
    Python then installs none (the fleet ran on after ``kill -INT``). The first signal raises
    :class:`Stopped` in the main thread; later ones are only recorded, so the stop they
    interrupt (children by PID, the work folder) runs to its end. The previous handlers come
    back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.received.append(signum)
        if len(self.received) == 1:
            raise Stopped(signal.Signals(signum).name)

    def __enter__(self) -> StopSignals:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def serve(fleet: Fleet, out=sys.stdout, err=sys.stderr, poll_s: float = 0.5) -> list[int]:
    """Start ``fleet``, print its URLs as JSON, serve until SIGINT or SIGTERM, stop it (every
    child by its PID, its own work folder unless ``keep``). Returns the signals received."""
    with StopSignals() as signals:
        try:
            with fleet as f:
                print(json.dumps(f.urls(), indent=2), file=out, flush=True)
                print("serving; Ctrl-C (SIGINT) or SIGTERM stops every process above by its PID",
                      file=err, flush=True)
                while True:
                    time.sleep(poll_s)
        except Stopped:
            pass
    if fleet.workdir is not None and fleet.workdir.exists():
        print(f"fleet stopped; its work folder (logs, replica homes) is kept: {fleet.workdir}", file=err, flush=True)
    else:
        print("fleet stopped; its work folder is removed (--keep keeps it)", file=err, flush=True)
    return signals.received


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.fleet.harness [--repository REPO] [--replicas N] [--keep]``: serve a
    fleet until SIGINT (Ctrl-C) or SIGTERM, printing its URLs as JSON once it is up."""
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(description="A Triton fleet on loopback: moto S3, Redis, N replicas, nginx, Prometheus")
    ap.add_argument("--repository", "-r", type=Path, default=Path("model_repository"),
                    help="local model repository whose models are published to the store")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--model", action="append", dest="models", help="model to publish and load (repeat); "
                    "default digits_raw and digits")
    ap.add_argument("--workdir", type=Path, help="work folder (kept); default a new /tmp/fleet-XXXX, "
                    "removed on exit")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, replica homes) on exit")
    ap.add_argument("--moto-server", help="moto_server executable (default: $FLEET_MOTO_SERVER, beside python, PATH)")
    ns = ap.parse_args(argv)
    serve(Fleet(ns.repository, ns.workdir, ns.replicas, tuple(ns.models or ("digits_raw", "digits")),
                moto_server=ns.moto_server, keep=ns.keep))
    return 0


if __name__ == "__main__":
    sys.exit(main())

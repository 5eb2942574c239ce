"""Keep a tritonserver serving: the supervisor that the ``tritonserver`` launcher runs beside it.

Triton 2.51 has three failure modes that its own health endpoints do not show (measured, see
shared notes): a Python stub that dies is never replaced while ``/v2/health/ready`` and
``/v2/models/<m>/ready`` keep answering 200; a malformed request can abort the whole server
(``std::bad_alloc`` on a JSON shape of 2^31); and stubs of a dead server linger (ppid 1,
ignoring SIGTERM, holding their shared memory). The supervisor:

- runs tritonserver as its child, with ``PR_SET_PDEATHSIG`` so the server never outlives it,
  and makes itself a child subreaper so stubs orphaned by a dying server become its children;
- every ``poll_s`` lists the server's stub processes from ``/proc`` (``triton_python_backend_stub
  <repo>/<model>/<version>/model.py <shm region> … <instance>``); a stub that is gone or a zombie
  while its model is still loaded and no stub of the same instance replaced it (a reload starts
  the new one first) is dead: the model is reloaded through the repository API with its own
  config as override (new instances start, then the old ones are released; ensembles over it
  follow). That needs ``--model-control-mode=explicit`` (the launcher's default); in
  ``none``/``poll`` mode the whole server is restarted instead. Readiness is wrong only between
  the death and the end of the reload (detection ≤ ``poll_s`` + ``grace_s``);
- when the server dies after having been live (a signal, an abort), kills its leftover stubs,
  removes their shared-memory regions and starts it again (backoff 1 s doubling to 30 s, reset
  after 60 s up); a server that dies before it was ever live exits the supervisor with its code
  (a bad flag or repository is not retried forever);
- forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT to the server, waits for it, kills its leftover stubs,
  and exits with its code.

One line per event goes to stderr (``tritonguard supervisor: …``), beside Triton's log.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tritonguard import triton_http

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STUB_NAME = "triton_python_backend_stub"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


@dataclass(frozen=True)
class Stub:
    pid: int
    model: str  # the model's folder name, which Triton requires to be its name
    instance: str  # e.g. digits_0_0
    shm_region: str


def _stat(pid: int) -> tuple[int, str] | None:
    """(ppid, state) of a process, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    return int(rest[1]), rest[0]


def _unlink_shm(region: str) -> None:
    if region and "/" not in region:
        try:
            os.unlink(f"/dev/shm/{region}")
        except OSError:
            pass


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] not in ("Z", "X")


def parse_stub(pid: int, argv: Sequence[str]) -> Stub | None:
    """A Python backend stub from its argv, or None for any other process."""
    if not argv or Path(argv[0]).name != STUB_NAME or len(argv) < 9:
        return None
    model_py = Path(argv[1])
    return Stub(pid=pid, model=model_py.parent.parent.name, instance=argv[8], shm_region=argv[2])


def _read_stub(pid: int) -> Stub | None:
    if not _alive(pid):
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return parse_stub(pid, [a.decode(errors="replace") for a in argv if a])


def scan_stubs(parents: set[int]) -> dict[int, Stub]:
    """Live (not zombie) stub processes whose parent is one of ``parents``."""
    found: dict[int, Stub] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        st = _stat(pid)
        if st is None or st[0] not in parents:
            continue
        stub = _read_stub(pid)
        if stub is not None:
            found[pid] = stub
    return found


def _flag(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name=value`` or ``--name value`` (the last one wins, as in Triton)."""
    value = None
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
        elif a == name and i + 1 < len(args):
            value = args[i + 1]
    return value


def control_mode(args: Sequence[str]) -> str:
    return (_flag(args, "--model-control-mode") or "none").lower()


def with_default_control(args: Sequence[str]) -> list[str]:
    """Explicit model control with every model loaded at start (what ``none`` serves), so that
    a dead stub can be brought back through the repository API; the user's choice wins."""
    args = list(args)
    if _flag(args, "--model-control-mode") is None and _flag(args, "--load-model") is None:
        args += ["--model-control-mode=explicit", "--load-model=*"]
    return args


def repository_headers(args: Sequence[str]) -> dict[str, str]:
    """The header a ``--http-restricted-api=…model-repository…:<header>=<key>`` flag asks for."""
    spec = _flag(args, "--http-restricted-api")
    if not spec or ":" not in spec:
        return {}
    apis, _, kv = spec.rpartition(":")
    if "model-repository" not in apis.split(",") or "=" not in kv:
        return {}
    header, value = kv.split("=", 1)
    return {header: value}


def http_base(args: Sequence[str]) -> str | None:
    if (_flag(args, "--allow-http") or "true").lower() in ("false", "0", "no"):
        return None
    host = _flag(args, "--http-address") or "127.0.0.1"
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = "127.0.0.1"
    return f"http://{host}:{_flag(args, '--http-port') or '8000'}"


class Control:
    """The supervised server's HTTP API: liveness, the repository index, configs, loads."""

    def __init__(self, base: str, headers: dict[str, str] | None = None, timeout: float = 10.0):
        self.base, self.headers, self.timeout = base, headers or {}, timeout

    def _call(self, path: str, body: dict | None = None, timeout: float | None = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        try:
            return triton_http.request(self.base + path, "GET" if body is None else "POST", data,
                                       headers=self.headers, timeout=timeout or self.timeout)
        except triton_http.Unreachable:
            return 0, b""

    def live(self) -> bool:
        return self._call("/v2/health/live")[0] == 200

    def states(self) -> dict[str, str]:
        """Model name -> state (READY, UNAVAILABLE, LOADING, UNLOADING) of every versioned entry."""
        code, body = self._call("/v2/repository/index", {})
        if code != 200:
            return {}
        try:
            return {m["name"]: m.get("state", "") for m in json.loads(body)}
        except (ValueError, KeyError, TypeError):
            return {}

    def config(self, model: str) -> str | None:
        code, body = self._call(f"/v2/models/{model}/config")
        return body.decode() if code == 200 else None

    def load(self, model: str, config: str | None = None) -> tuple[bool, str]:
        body = {"parameters": {"config": config}} if config is not None else {}
        code, out = self._call(f"/v2/repository/models/{model}/load", body, timeout=300)
        return code == 200, out.decode(errors="replace")[:300]


@dataclass
class Supervisor:
    binary: str
    argv: Sequence[str]  # argv[0] is the binary
    env: dict[str, str]
    poll_s: float = 0.5
    grace_s: float = 1.0
    min_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0
    log: Callable[[str], None] = field(default=lambda m: sys.stderr.write(f"tritonguard supervisor: {m}\n"))

    def __post_init__(self) -> None:
        args = list(self.argv[1:])
        self.mode = control_mode(args)
        base = http_base(args)
        self.control = Control(base, repository_headers(args)) if base else None
        self.proc: subprocess.Popen | None = None
        self.stubs: dict[int, Stub] = {}
        self.pending: dict[str, tuple[Stub, float]] = {}  # instance -> (its dead stub, when seen gone)
        self.stopping: int | None = None  # the signal that asked us to stop
        self.restarts = 0

    # -- process management -------------------------------------------------------
    def _spawn(self) -> None:
        self.proc = subprocess.Popen(list(self.argv), executable=self.binary, env=self.env,
                                     preexec_fn=_die_with_parent)
        self.stubs = {}
        self.pending = {}
        self.started = time.monotonic()
        self.was_live = False

    def _forward(self, signum: int, _frame: object) -> None:
        if self.stopping is None:
            self.stopping = signum
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def _reap(self) -> None:
        """Collect exited children: the server (its status kept for us) and adopted orphans."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.proc is not None and pid == self.proc.pid and self.proc.returncode is None:
                self.proc.returncode = os.waitstatus_to_exitcode(status)

    def _kill_leftovers(self) -> int:
        """SIGKILL stubs that outlived their server (adopted by us, or last seen under it) and
        remove their shared-memory regions."""
        # only processes we started or saw under our server: adopted orphans, last seen stubs
        known = {**{p: s for p, s in self.stubs.items() if _read_stub(p) == s}, **scan_stubs({os.getpid()})}
        for pid, stub in known.items():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _unlink_shm(stub.shm_region)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in known):
            time.sleep(0.05)
        self._reap()
        if known:
            self.log(f"killed {len(known)} stub(s) left by the server: "
                     + ", ".join(sorted({s.instance for s in known.values()})))
        self.stubs = {}
        return len(known)

    # -- dead stubs -------------------------------------------------------------------
    def _check_stubs(self) -> None:
        """Note stubs that are gone; once ``grace_s`` has passed, reload the models of those that
        were not replaced while their model stayed READY. A stub stays pending until the
        repository index can be read (a busy server may not answer at once)."""
        assert self.proc is not None
        now = scan_stubs({self.proc.pid})
        t = time.monotonic()
        for pid, stub in self.stubs.items():
            if pid not in now:
                self.pending.setdefault(stub.instance, (stub, t))
        self.stubs = now
        due = [stub for stub, since in self.pending.values() if t - since >= self.grace_s]
        if not due:
            return
        states = self.control.states() if self.control is not None else {}
        if self.control is not None and not states:
            return  # unreadable now: the stubs stay pending for the next poll
        live = {s.instance for s in now.values()}
        dead: dict[str, list[Stub]] = {}
        for stub in due:
            del self.pending[stub.instance]
            if stub.instance in live:
                continue  # replaced: a reload or a new version starts the new instance first
            state = states.get(stub.model, "READY" if self.control is None else "absent")
            if state != "READY":
                self.log(f"stub {stub.instance} (pid {stub.pid}) exited while '{stub.model}' is {state}: left alone")
                continue
            dead.setdefault(stub.model, []).append(stub)
        for model, stubs in dead.items():
            if self.stopping is None:
                self._recover(model, stubs)

    def _recover(self, model: str, stubs: list[Stub]) -> None:
        names = ", ".join(f"{s.instance} (pid {s.pid})" for s in stubs)
        if self.control is None or self.mode != "explicit":
            self.log(f"stub {names} of model '{model}' died; model control mode '{self.mode}' cannot "
                     "reload one model: restarting the server")
            self._restart_server()
            return
        t0 = time.monotonic()
        self.log(f"stub {names} of model '{model}' died; reloading '{model}'")
        # A load of unchanged files is a no-op and an unload waits on the dead instance (over a
        # minute, measured): a load with the model's own config as override always reloads, the
        # new instances start, then the old ones are released (ensembles over it follow).
        config = self.control.config(model)
        ok, msg = (self.control.load(model, config) if config is not None
                   else (False, "its config could not be read"))
        for stub in stubs:  # the dead stub's region: Triton does not remove it
            _unlink_shm(stub.shm_region)
        took = time.monotonic() - t0
        if ok:
            self.log(f"reloaded '{model}' in {took:.1f} s")
        elif self.stopping is None:
            self.log(f"reload of '{model}' failed after {took:.1f} s: {msg}")
        if self.proc is not None:
            self.stubs = scan_stubs({self.proc.pid})

    def _restart_server(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 45
        while self.proc.returncode is None and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.1)
        if self.proc.returncode is None:
            self.proc.kill()
            self.proc.wait()
        self._kill_leftovers()
        self.restarts += 1
        self._spawn()

    # -- main loop --------------------------------------------------------------------
    def run(self) -> int:
        if not _prctl(PR_SET_CHILD_SUBREAPER, 1):
            self.log("cannot become a child subreaper: stubs orphaned by a crash are found by name")
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        backoff = self.min_backoff_s
        self._spawn()
        while True:
            assert self.proc is not None
            self._reap()
            code = self.proc.returncode
            if code is not None:
                self._kill_leftovers()
                if self.stopping is not None:
                    return code
                if not self.was_live:
                    self.log(f"tritonserver exited with {code} before it was live: not restarting")
                    return code if code != 0 else 1
                if time.monotonic() - self.started >= self.stable_s:
                    backoff = self.min_backoff_s
                self.log(f"tritonserver died ({_describe(code)}); restarting in {backoff:.0f} s")
                if self._sleep(backoff):
                    return 128 + int(self.stopping or signal.SIGTERM)
                backoff = min(backoff * 2, self.max_backoff_s)
                self.restarts += 1
                self._spawn()
                continue
            if self.stopping is not None:
                time.sleep(0.1)  # the server is shutting down: wait for it
                continue
            if not self.was_live:
                # Stubs are known from the start: Triton's HTTP endpoint (and so "live") only opens
                # once every model has loaded, and a stub killed just then would otherwise never
                # have been seen. Exits before live (a failed load) are the load's business.
                self.stubs = scan_stubs({self.proc.pid})
                self.was_live = self.control.live() if self.control is not None else True
            if self.was_live:
                self._check_stubs()
            self._sleep(self.poll_s)

    def _sleep(self, seconds: float) -> bool:
        """Sleep in small steps; True when a stop was asked meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stopping is not None:
                return True
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            self._reap()
            if self.proc is not None and self.proc.returncode is not None:
                return self.stopping is not None
        return self.stopping is not None


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def supervise(binary: str, argv: Sequence[str], env: dict[str, str]) -> int:
    return Supervisor(binary, argv, env).run()


__all__ = ["Supervisor", "Stub", "scan_stubs", "parse_stub", "supervise", "with_default_control",
           "repository_headers", "http_base", "control_mode"]

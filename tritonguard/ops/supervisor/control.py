"""Control: the supervise loop beside tritonserver.

The server's flags as the supervisor reads them (control mode, HTTP and metrics endpoints,
the repository API's header), the server's HTTP API (:class:`Control`: liveness, the
repository index, configs, loads) and :class:`Supervisor`: it runs the server as its child,
reloads a model whose stub died or froze through the repository API (or restarts the whole
server where model control is not explicit), restarts a server that died, and forwards
signals. :func:`supervise` and :func:`with_default_control` are what the launcher calls.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tritonguard.ops.supervisor.stall import (
    STALL_S,
    StallWatch,
    called_models,
    parse_progress,
    stall_seconds,
)
from tritonguard.ops.supervisor.stubs import Stub, alive, read_stub, scan_stubs, unlink_shm
from tritonguard.triton import http as triton_http

# the start time the guards advertise in the replica registry (``tritonguard.rollout.replicas.
# ENV_STARTED``, named here: the supervisor imports only the standard library and triton.http)
ADVERTISED_START = "TRITONGUARD_ADVERTISE_STARTED"
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
NO_ANSWER = "the server did not answer (connection refused or dropped)"
# how long a reload whose call got no answer waits for the server's exit before it reports the
# reload failed: the server may be dying (its connection goes first)
DYING_S = 5.0


def _prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _log(message: str) -> None:
    sys.stderr.write(f"tritonguard supervisor: {message}\n")


# The server is started through this shim, which asks the kernel to SIGTERM it when the
# supervisor dies (PR_SET_PDEATHSIG survives the exec) and then execs the server in place (the
# same pid). Not a ``preexec_fn``: with one, CPython forks and runs the at-fork hooks in the child,
# and a process that holds a gRPC channel (a test process, a user's own service embedding the
# supervisor) has gRPC restart its poller there, which aborts once the child closes its fds:
# 8 of 300 such children died of SIGABRT (2026-11-30; 0 of 300 without the preexec_fn), and a
# CI run logged a restart its test did not expect. argv: the signal, the supervisor's pid (a
# parent gone before the prctl is seen), the binary, the server's argv.
_SHIM = (f"import ctypes, os, sys; ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, int(sys.argv[1]), 0, 0, 0); "
         "os.getppid() == int(sys.argv[2]) or os._exit(70); os.execv(sys.argv[3], sys.argv[4:])")


def shim_argv(binary: str, argv: Sequence[str]) -> list[str]:
    """The command that runs ``binary`` with ``argv`` (its argv[0] included) as a child that dies
    with this process."""
    return [sys.executable, "-I", "-S", "-c", _SHIM, str(int(signal.SIGTERM)), str(os.getpid()), binary, *argv]


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name=value`` or ``--name value`` (the last one wins, as in Triton)."""
    value = None
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
        elif a == name and i + 1 < len(args):
            value = args[i + 1]
    return value


def control_mode(args: Sequence[str]) -> str:
    return (flag_value(args, "--model-control-mode") or "none").lower()


def with_default_control(args: Sequence[str]) -> list[str]:
    """Explicit model control with every model loaded at start (what ``none`` serves), so that
    a dead stub can be brought back through the repository API; the user's choice wins."""
    args = list(args)
    if flag_value(args, "--model-control-mode") is None and flag_value(args, "--load-model") is None:
        args += ["--model-control-mode=explicit", "--load-model=*"]
    return args


def repository_headers(args: Sequence[str]) -> dict[str, str]:
    """The header a ``--http-restricted-api=…model-repository…:<header>=<key>`` flag asks for."""
    spec = flag_value(args, "--http-restricted-api")
    if not spec or ":" not in spec:
        return {}
    apis, _, kv = spec.rpartition(":")
    if "model-repository" not in apis.split(",") or "=" not in kv:
        return {}
    header, value = kv.split("=", 1)
    return {header: value}


def _endpoint(args: Sequence[str], service: str, port: str) -> str | None:
    """``http://host:port`` of Triton's ``service`` (http, metrics) from its flags; None when off.
    A wildcard address is reached on loopback."""
    if (flag_value(args, f"--allow-{service}") or "true").lower() in ("false", "0", "no"):
        return None
    host = flag_value(args, f"--{service}-address") or "127.0.0.1"
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = "127.0.0.1"
    return f"http://{host}:{flag_value(args, f'--{service}-port') or port}"


def http_base(args: Sequence[str]) -> str | None:
    return _endpoint(args, "http", "8000")


def metrics_url(args: Sequence[str]) -> str | None:
    base = _endpoint(args, "metrics", "8002")
    return None if base is None else base + "/metrics"


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
        if code == 0:
            return False, NO_ANSWER
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
    stall_s: float = STALL_S  # 0: no frozen-stub detection
    log: Callable[[str], None] = field(default=_log)

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
        self.metrics = metrics_url(args) if self.stall_s > 0 else None
        self.stalls = StallWatch(self.stall_s)
        self.stall_poll_s = min(5.0, self.stall_s / 4)
        self.next_stall_check = 0.0

    # -- process management -------------------------------------------------------
    def _spawn(self) -> None:
        if self.restarts and ADVERTISED_START in self.env:
            # a restarted server's counters start from zero: its replica record says so with a
            # new start time (the launcher's would hide the restart from the exporter's readers)
            self.env = {**self.env, ADVERTISED_START: f"{time.time():.3f}"}
        self.proc = subprocess.Popen(shim_argv(self.binary, self.argv), env=self.env)
        self.stubs = {}
        self.pending = {}
        self.stalls.reset()
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
        known = {**{p: s for p, s in self.stubs.items() if read_stub(p) == s}, **scan_stubs({os.getpid()})}
        self._kill(list(known.values()))
        for stub in known.values():
            unlink_shm(stub.shm_region)
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

    # -- frozen stubs -----------------------------------------------------------------
    def _check_stalls(self) -> None:
        """Read the metrics every ``stall_poll_s``; kill the idle stubs of a stalled model and
        reload it (one model per reading: a frozen guard stalls its targets behind it, and they
        get a fresh clock once it is back)."""
        t = time.monotonic()
        if self.metrics is None or self.proc is None or t < self.next_stall_check:
            return
        self.next_stall_check = t + self.stall_poll_s
        try:
            progress = parse_progress(triton_http.get_text(self.metrics, timeout=5))
        except triton_http.Unreachable:
            return  # a busy server: the next reading
        for stall in self.stalls.observe(t, progress, scan_stubs({self.proc.pid})):
            if not stall.idle:  # judged again after another stall_s, and logged again
                self.log(f"model '{stall.model}': {stall.waiting} request(s) waiting and no execution for "
                         f"{stall.seconds:.0f} s, but its stubs are using CPU (up to {stall.busiest:.0%} of "
                         "one; a long execution?): left alone")
                continue
            states = self.control.states() if self.control is not None else {}
            if self.control is not None and states.get(stall.model) != "READY":
                continue
            config = self.control.config(stall.model) if self.control is not None else None
            self._kill(stall.idle)
            self._recover(stall.model, stall.idle,
                          f"frozen ({stall.waiting} request(s) waiting, no execution for {stall.seconds:.0f} s, "
                          f"{stall.busiest:.0%} of one CPU); killed")
            # The models it called are stuck too: a target stub's response send to the killed
            # caller never returns (measured: a frozen BLS stream guard left tinylm's decode
            # thread in send() for good; raw tinylm requests hung until tinylm was reloaded).
            for target in called_models(config, {m for m, st in states.items() if st == "READY"}):
                stubs = [s for s in scan_stubs({self.proc.pid}).values() if s.model == target]
                if stubs and self.stopping is None and self.mode == "explicit":
                    self._kill(stubs)
                    self._recover(target, stubs, f"serves the frozen '{stall.model}'; killed")
            self.stalls.reset()
            return

    @staticmethod
    def _kill(stubs: list[Stub]) -> None:
        """SIGKILL ``stubs`` and wait (at most 5 s) until they are gone."""
        for stub in stubs:
            try:
                os.kill(stub.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(s.pid) for s in stubs):
            time.sleep(0.05)

    def _recover(self, model: str, stubs: list[Stub], what: str = "died") -> None:
        if self.proc is not None and self.proc.returncode is not None:
            return  # the server itself died: the main loop restarts it
        names = ", ".join(f"{s.instance} (pid {s.pid})" for s in stubs)
        if self.control is None or self.mode != "explicit":
            self.log(f"stub {names} of model '{model}' {what}; model control mode '{self.mode}' cannot "
                     "reload one model: restarting the server")
            self._restart_server()
            return
        t0 = time.monotonic()
        self.log(f"stub {names} of model '{model}' {what}; reloading '{model}'")
        # An unload waits on the dead instance (over a minute, measured), and a load of unchanged
        # files with an unchanged config is a no-op: Triton 2.51 keeps the instances it has
        # (the dead one too). With the version folder's mtime moved on, a load with the model's
        # own config as override is a full reload: the new instances start, then the old ones
        # are released (ensembles over it follow). The folder's contents are not changed.
        for folder in sorted({s.version_dir for s in stubs if s.version_dir}):
            try:
                os.utime(folder)
            except OSError as exc:
                self.log(f"cannot touch {folder} ({exc.strerror}): Triton may keep the dead instance")
        config = self.control.config(model)
        result = self._load(model, config) if config is not None else (False, "its config could not be read")
        for stub in stubs:  # the dead stub's region: Triton does not remove it
            unlink_shm(stub.shm_region)
        took = time.monotonic() - t0
        if result is None:  # the main loop restarts it, or ends when a stop was asked
            if self.stopping is None:
                self.log(f"tritonserver died during the reload of '{model}' ({took:.1f} s in)")
            return
        ok, msg = result
        if ok:
            self.log(f"reloaded '{model}' in {took:.1f} s")
        elif self.stopping is None:
            self.log(f"reload of '{model}' failed after {took:.1f} s: {msg}")
        if self.proc is not None:
            self.stubs = scan_stubs({self.proc.pid})

    def _load(self, model: str, config: str) -> tuple[bool, str] | None:
        """Load ``model`` while watching the server: None when the server died first. The load
        call itself can outlive the server: measured, a SIGABRT during a reload left the call
        waiting (up to its 300 s timeout) and the dead server unreaped, its stubs alive."""
        assert self.control is not None and self.proc is not None
        done: list[tuple[bool, str]] = []
        call = threading.Thread(target=lambda: done.append(self.control.load(model, config)),
                                name=f"load-{model}", daemon=True)
        call.start()
        while call.is_alive():
            call.join(0.1)
            self._reap()
            if self.proc.returncode is not None:
                return None
        result = done[0] if done else (False, "the load call failed")
        if result == (False, NO_ANSWER):
            # the other order: the dying server dropped the connection first and exits a moment
            # later (a SIGABRT runs its handlers before the process ends; a CI run logged "reload
            # failed after 0.6 s" with no reason, then the death)
            deadline = time.monotonic() + DYING_S
            while time.monotonic() < deadline:
                self._reap()
                if self.proc.returncode is not None:
                    return None
                time.sleep(0.05)
        return result

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
                self._check_stalls()
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
    return Supervisor(binary, argv, env, stall_s=stall_seconds(env, _log)).run()


__all__ = ["Control", "Supervisor", "control_mode", "http_base", "metrics_url", "repository_headers",
           "supervise", "with_default_control"]

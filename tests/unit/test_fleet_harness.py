"""``make fleet``'s lifetime (tests/fleet/harness.py: ``serve``, ``StopSignals``, ``Fleet.stop``)
without its servers: a fleet whose parts are real child processes (``sleep``), stopped by SIGINT or
SIGTERM sent to this process, as ``kill`` or Ctrl-C would. The real fleet (3 tritonservers) runs
in tests/functional/test_fleet.py; what is checked here is what issue 45 found: SIGINT ignored
when the harness is started with ``&`` from a script, and ``/tmp/fleet-XXXX`` left behind."""

from __future__ import annotations

import io
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.fleet.harness import Child, Fleet, StopSignals, serve


class Interrupting:
    """A part whose stop is interrupted by a second signal (an impatient second Ctrl-C)."""

    def __init__(self, sig: int):
        self.sig = sig

    def stop(self) -> None:
        os.kill(os.getpid(), self.sig)
        time.sleep(0.2)  # the handler runs here, in the main thread


class SleepFleet(Fleet):
    """A Fleet whose parts are ``sleep`` children in its work folder, each stopped by its PID."""

    def start(self, timeout: float = 180.0) -> SleepFleet:
        work = self.make_workdir()
        work.mkdir(parents=True, exist_ok=True)
        (work / "replica0.log").write_text("a log the fleet wrote\n")
        self.s3 = Child("s3", ["sleep", "60"], work / "s3.log").start()
        self.redis = Child("redis", ["sleep", "60"], work / "redis.log").start()
        return self

    def urls(self) -> dict[str, object]:
        return {"workdir": str(self.workdir), "pids": [self.s3.pid, self.redis.pid]}


@pytest.fixture
def sigint_ignored():
    """As a process started with ``&`` from a non-interactive shell finds it."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    term = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGINT, before)
    signal.signal(signal.SIGTERM, term)


def signal_when_up(out: io.StringIO, sig: int) -> threading.Thread:
    """Send ``sig`` to this process once the fleet printed its URLs (bounded wait)."""

    def run() -> None:
        deadline = time.monotonic() + 20
        while '"workdir"' not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), sig)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_alike_stop_every_child_and_remove_the_work_folder(sigint_ignored, sig):
    fleet = SleepFleet(Path("unused-repo"))
    out, err = io.StringIO(), io.StringIO()
    sender = signal_when_up(out, sig)
    received = serve(fleet, out=out, err=err, poll_s=0.05)
    sender.join(timeout=5)
    assert received == [sig]
    assert fleet.made_workdir and fleet.workdir.name.startswith("fleet-")
    assert not fleet.workdir.exists(), sorted(p.name for p in fleet.workdir.iterdir())
    assert fleet.s3.proc.poll() is not None and fleet.redis.proc.poll() is not None
    assert "work folder is removed" in err.getvalue()
    # the handlers the process had come back (SIGINT ignored, as it started)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_keep_keeps_the_work_folder_and_says_where_it_is(sigint_ignored):
    fleet = SleepFleet(Path("unused-repo"), keep=True)
    out, err = io.StringIO(), io.StringIO()
    sender = signal_when_up(out, signal.SIGTERM)
    try:
        serve(fleet, out=out, err=err, poll_s=0.05)
        sender.join(timeout=5)
        assert (fleet.workdir / "replica0.log").read_text() == "a log the fleet wrote\n"
        assert f"kept: {fleet.workdir}" in err.getvalue()
        assert fleet.s3.proc.poll() is not None and fleet.redis.proc.poll() is not None
    finally:
        shutil.rmtree(fleet.workdir, ignore_errors=True)


def test_a_workdir_named_by_the_caller_is_never_removed(tmp_path):
    fleet = SleepFleet(Path("unused-repo"), tmp_path / "mine").start()
    fleet.stop()
    assert not fleet.made_workdir and (tmp_path / "mine" / "replica0.log").exists()
    assert fleet.s3.proc.poll() is not None


def test_a_second_signal_during_the_stop_does_not_leave_children_behind(sigint_ignored):
    """The first signal leaves serving; the second arrives while the first part stops: every
    other part is still stopped by its PID and the folder removed, nothing raised."""
    fleet = SleepFleet(Path("unused-repo"))
    out, err = io.StringIO(), io.StringIO()
    original_start = fleet.start

    def start(timeout: float = 180.0) -> SleepFleet:
        original_start(timeout)
        fleet.prom = Interrupting(signal.SIGINT)  # stopped first
        return fleet

    fleet.start = start
    sender = signal_when_up(out, signal.SIGTERM)
    received = serve(fleet, out=out, err=err, poll_s=0.05)
    sender.join(timeout=5)
    assert received == [signal.SIGTERM, signal.SIGINT]
    assert fleet.s3.proc.poll() is not None and fleet.redis.proc.poll() is not None
    assert not fleet.workdir.exists()


def test_an_interrupt_inside_one_part_s_stop_is_raised_after_the_rest_stopped(tmp_path):
    """Outside :func:`serve` (a ``with Fleet(...)`` in a test): KeyboardInterrupt in one part's
    stop still stops the parts after it, then reaches the caller."""
    fleet = SleepFleet(Path("unused-repo")).start()

    class Raising:
        def stop(self) -> None:
            raise KeyboardInterrupt

    fleet.lb = Raising()
    with pytest.raises(KeyboardInterrupt):
        fleet.stop()
    assert fleet.s3.proc.poll() is not None and fleet.redis.proc.poll() is not None
    assert not fleet.workdir.exists()


def test_stop_signals_restore_what_was_there():
    before = {s: signal.getsignal(s) for s in StopSignals.SIGNALS}
    with StopSignals():
        assert all(signal.getsignal(s) is not before[s] for s in StopSignals.SIGNALS)
    assert {s: signal.getsignal(s) for s in StopSignals.SIGNALS} == before


# a process whose main thread exits (a zombie: state Z) while another thread still runs and its
# socket still listens, as a killed tritonserver (~117 threads) can be while its threads exit;
# the other thread ends when its stdin is closed
HALF_DEAD = """
import ctypes, socket, sys, threading
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(8)
print(s.getsockname()[1], flush=True)
threading.Thread(target=sys.stdin.read).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_process_is_alive_while_any_of_its_threads_is_even_when_its_main_thread_is_a_zombie():
    """The fleet test allows a failed request only when it was sent before the killed replica's
    process group was gone (``Replica.kill``'s ``dead_at``). The check looked at each process's
    main thread only, and called a process gone while its socket still took connections."""
    import socket
    import subprocess
    import sys

    from tests.fleet.harness import _group_alive

    proc = subprocess.Popen([sys.executable, "-c", HALF_DEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        port = int(proc.stdout.readline())
        deadline = time.monotonic() + 30
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the main thread never exited"
            time.sleep(0.01)
        # the main thread is a zombie; the other thread runs and the socket takes a connection
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
        assert _group_alive(proc.pid)
        proc.stdin.close()  # the last thread ends
        proc.wait(timeout=30)
        assert not _group_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()

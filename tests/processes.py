"""Processes the tests start themselves (redis-server, moto_server, prometheus), stopped by the
PID we hold, never by name."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen | None, grace: float = 5.0) -> None:
    """SIGTERM to our own PID, SIGKILL if it is still there after ``grace`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)

"""The supervisor beside tritonserver, against the real server: a SIGKILLed stub is brought
back (digits' in-process guard, one of minilm's two guard instances, minilm's encoder behind an
ensemble), a server killed by SIGABRT (what the 2^31-shape JSON request does to Triton 2.51),
also during such a reload, is restarted with no stub of the dead server left, and a stop
leaves no process behind.

Without the supervisor (Triton alone) each of these stays broken: every request to a dead
stub answers 500 "Stub process ... is not healthy" while readiness says 200, forever.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tritonguard.core.repository import mirror, read_config, write_config
from tritonguard.ops.server import Server
from tritonguard.ops.supervisor.stubs import scan_stubs

pytestmark = pytest.mark.functional

RECOVERY_S = 60.0  # a dead stub must be serving again within this (measured: 3-9 s)


@pytest.fixture(scope="module")
def supervised(exported_repo, tmp_path_factory):
    base = tmp_path_factory.mktemp("supervised")
    repo = mirror(exported_repo, base / "repo")  # guards write state beside their config
    # the text guard ships with one instance; two here, to test losing one of several
    guard = read_config(repo / "minilm_guard")
    guard["instance_group"] = [{"kind": "KIND_CPU", "count": 2}]
    write_config(repo / "minilm_guard", guard)
    srv = Server(repository=repo, log_path=base / "tritonserver.log",
                 extra_args=("--strict-readiness=true",))
    srv.start(wait_models=["digits", "minilm"])
    yield srv
    srv.stop()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
                out.append(int(entry))
    return out


def _triton_pid(srv: Server) -> int:
    """The tritonserver under the supervisor (the launcher's process)."""
    for pid in _children(srv.proc.pid):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"bin/tritonserver"):
                return pid
        except OSError:
            continue
    raise AssertionError("no tritonserver under the supervisor")


def _status(srv: Server, path: str, body: dict | None = None, timeout: float = 10.0) -> int:
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://{srv.http_url}{path}", data=data),
                                    timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


IMAGE = {"inputs": [{"name": "IMAGE", "shape": [1, 8, 8], "datatype": "FP32",
                     "data": np.random.default_rng(0).integers(0, 17, 64).astype(float).tolist()}]}
TEXT = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["supervised sentence"]}]}


def _infer(srv: Server, model: str) -> int:
    if model == "freezer":
        return _say(srv, "ping")[0]
    return _status(srv, f"/v2/models/{model}/infer", IMAGE if model == "digits" else TEXT)


def _kill_stub(srv: Server, instance: str) -> int:
    stubs = scan_stubs({_triton_pid(srv)})
    pid = next(p for p, s in stubs.items() if s.instance == instance)
    os.kill(pid, signal.SIGKILL)
    return pid


def _until_serving(srv: Server, model: str, n_ok: int = 20, since: float | None = None) -> float:
    """Seconds (from ``since``, else from now) until ``n_ok`` requests in a row succeed."""
    t0 = time.monotonic() if since is None else since
    streak = 0
    while time.monotonic() - t0 < RECOVERY_S:
        streak = streak + 1 if _infer(srv, model) == 200 else 0
        if streak >= n_ok:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{model} not serving {RECOVERY_S:.0f} s after its stub died; log:\n{srv.tail(30)}")


def test_a_killed_inprocess_guard_stub_is_reloaded(supervised):
    assert _infer(supervised, "digits") == 200
    # A stub that dies within its first poll (0.5 s) of life is a failed load, not a death: give
    # the supervisor one poll after the server opened (it lists stubs from the first second on)
    time.sleep(1.0)
    _kill_stub(supervised, "digits_0_0")
    took = _until_serving(supervised, "digits")
    assert _status(supervised, "/v2/models/digits/ready") == 200
    assert _status(supervised, "/v2/health/ready") == 200
    assert "stub digits_0_0" in supervised.tail(200) and "reloaded 'digits'" in supervised.tail(200)
    print(f"digits serving again {took:.1f} s after its guard's stub was killed")


def test_one_of_two_guard_instances_killed_every_request_is_served_again(supervised):
    assert sorted(s.instance for s in scan_stubs({_triton_pid(supervised)}).values()
                  if s.model == "minilm_guard") == ["minilm_guard_0_0", "minilm_guard_0_1"]
    _kill_stub(supervised, "minilm_guard_0_1")
    took = _until_serving(supervised, "minilm", n_ok=40)  # Triton alternates instances: 40 in a row
    statuses = [_infer(supervised, "minilm") for _ in range(100)]
    assert statuses.count(200) == 100, statuses
    print(f"minilm serving again {took:.1f} s after one guard instance was killed")


def test_a_killed_encoder_behind_the_ensemble_is_reloaded(supervised):
    # minilm_raw is the ensemble that runs the encoder stub (minilm's guard runs its own copy
    # in process, so minilm itself would serve on through a dead encoder)
    _kill_stub(supervised, "minilm_encoder_0_0")
    took = _until_serving(supervised, "minilm_raw")
    # throughput is back too (a dead encoder left ~2.5 req/s): 50 requests well under 10 s
    t0 = time.monotonic()
    assert all(_infer(supervised, "minilm_raw") == 200 for _ in range(50))
    assert time.monotonic() - t0 < 10
    assert _until_serving(supervised, "minilm") < RECOVERY_S
    print(f"minilm_raw serving again {took:.1f} s after its encoder's stub was killed")


def test_a_server_that_crashes_during_a_reload_is_restarted(supervised):
    """The server dies while the supervisor waits on a model load it asked for: the supervisor
    must see the death at once, not when the load call gives up (300 s). Measured before the
    fix: the dead server stayed a zombie, its stubs alive, and nothing restarted it."""
    reloads = supervised.log_path.read_text(errors="replace").count("reloading 'minilm_encoder'")
    old = _triton_pid(supervised)
    assert _until_serving(supervised, "minilm_raw") < RECOVERY_S  # its encoder's stub is up
    _kill_stub(supervised, "minilm_encoder_0_0")
    deadline = time.monotonic() + 20
    while supervised.log_path.read_text(errors="replace").count("reloading 'minilm_encoder'") == reloads:
        assert time.monotonic() < deadline, supervised.tail(20)
        time.sleep(0.02)
    os.kill(old, signal.SIGABRT)  # the load has been asked for and is under way
    t0 = time.monotonic()
    time.sleep(1.0)
    took = _until_serving(supervised, "digits", since=t0)
    assert _triton_pid(supervised) != old
    assert "died during the reload of 'minilm_encoder'" in supervised.tail(400), supervised.tail(40)
    assert _until_serving(supervised, "minilm") < RECOVERY_S
    print(f"server restarted, digits serving {took:.1f} s after a SIGABRT during a reload")


def test_a_crashed_server_is_restarted_and_its_stubs_reaped(supervised):
    old = _triton_pid(supervised)
    old_stubs = scan_stubs({old})
    assert old_stubs
    t0 = time.monotonic()
    os.kill(old, signal.SIGABRT)  # as Triton's HTTP frontend does on a 2^31 shape (std::bad_alloc)
    time.sleep(1.0)
    took = _until_serving(supervised, "digits")
    assert _triton_pid(supervised) != old
    alive = [p for p, s in old_stubs.items() if scan_stubs({os.getpid(), supervised.proc.pid, 1}).get(p) == s]
    assert not alive, f"stubs of the dead server still alive: {alive}"
    assert not [s.shm_region for s in old_stubs.values() if Path(f"/dev/shm/{s.shm_region}").exists()]
    assert _until_serving(supervised, "minilm") < RECOVERY_S
    print(f"server restarted, digits serving {time.monotonic() - t0:.1f} s after SIGABRT ({took:.1f} s)")


def test_the_crash_request_itself_is_survived(supervised):
    """The real thing, not a stand-in signal: Triton 2.51 aborts on this unauthenticated request."""
    old = _triton_pid(supervised)
    body = {"inputs": [{"name": "IMAGE", "shape": [2147483648, 8, 8], "datatype": "FP32", "data": [1.0]}]}
    _status(supervised, "/v2/models/digits/infer", body, timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{old}").exists() and _status(supervised, "/v2/health/live"):
        time.sleep(0.1)
    took = _until_serving(supervised, "digits")
    assert _triton_pid(supervised) != old, "the request did not crash this Triton: update the notes"
    print(f"digits serving again {took:.1f} s after the crash request")


def test_stop_leaves_nothing_behind(supervised):
    triton = _triton_pid(supervised)
    stubs = scan_stubs({triton})
    supervised.stop()
    time.sleep(0.5)
    for pid in (supervised.proc.pid, triton, *stubs):
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


# -- frozen stubs ---------------------------------------------------------------------------
# python_backend 24.10 can deadlock a stub with the GIL held (docs/stream-guard.md); its health
# thread is native and keeps answering, so Triton calls it healthy and queues requests for it
# forever. This test-only model freezes the same way on demand: a native call that never returns
# and never releases the GIL (ctypes.PyDLL keeps it). "spin:<s>" is a long execution that works.
FREEZER = '''
import ctypes, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            text = pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy().reshape(-1)[0].decode()
            if text == "freeze":
                ctypes.PyDLL(None).sleep(3600)
            elif text.startswith("spin:"):
                end = time.monotonic() + float(text[5:])
                while time.monotonic() < end:
                    pass
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([text.encode()], dtype=object))]))
        return out
'''
FREEZER_CONFIG = '''name: "freezer"
backend: "python"
max_batch_size: 0
input [{ name: "TEXT" data_type: TYPE_STRING dims: [1] }]
output [{ name: "OUT" data_type: TYPE_STRING dims: [1] }]
instance_group [{ kind: KIND_CPU count: 1 }]
'''
STALL_S = 4.0


@pytest.fixture(scope="module")
def freezer(tmp_path_factory):
    base = tmp_path_factory.mktemp("freezer")
    (base / "repo" / "freezer" / "1").mkdir(parents=True)
    (base / "repo" / "freezer" / "config.pbtxt").write_text(FREEZER_CONFIG)
    (base / "repo" / "freezer" / "1" / "model.py").write_text(FREEZER)
    srv = Server(repository=base / "repo", log_path=base / "tritonserver.log",
                 env={**os.environ, "TRITONGUARD_STALL_S": str(STALL_S)})
    srv.start(wait_models=["freezer"])
    yield srv
    # the freezer is built to hang in execute(): Triton's graceful stop would wait its whole
    # exit timeout (30 s) for it, which tests nothing; SIGKILL the group after 5 s
    srv.stop(timeout=5)


def _say(srv: Server, text: str, timeout: float = 10.0) -> tuple[int, str]:
    body = {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/freezer/infer", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())["outputs"][0]["data"][0]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, repr(e)


def _supervisor_lines(srv: Server) -> list[str]:
    return [line for line in srv.tail(400).splitlines() if line.startswith("tritonguard supervisor:")]


def test_a_long_execution_is_not_taken_for_a_freeze(freezer):
    """Requests wait behind a 3-stall-long execution that burns CPU: left alone, all answered."""
    import concurrent.futures as cf

    assert _say(freezer, "ping") == (200, "ping")
    with cf.ThreadPoolExecutor(4) as pool:
        long = pool.submit(_say, freezer, f"spin:{3 * STALL_S}", 60)
        time.sleep(0.5)
        behind = [pool.submit(_say, freezer, f"q{i}", 60) for i in range(3)]
        assert long.result()[0] == 200
        assert [f.result() for f in behind] == [(200, f"q{i}") for i in range(3)]
    lines = _supervisor_lines(freezer)
    assert any("'freezer'" in line and "left alone" in line for line in lines), lines
    assert not any("frozen" in line for line in lines), lines


def test_a_frozen_stub_is_killed_and_its_model_reloaded(freezer):
    import concurrent.futures as cf

    assert _say(freezer, "ping") == (200, "ping")
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(5) as pool:
        frozen = pool.submit(_say, freezer, "freeze", 120)
        time.sleep(0.5)
        behind = [pool.submit(_say, freezer, f"q{i}", 120) for i in range(3)]
        time.sleep(1.0)
        # the failure the supervisor covers: Triton still calls the model ready
        assert _status(freezer, "/v2/models/freezer/ready") == 200
        # no request hangs for ever: the stuck ones fail once the stub is killed
        answers = [frozen.result(), *(f.result() for f in behind)]
    unstuck = time.monotonic() - t0
    assert unstuck < STALL_S + 30, unstuck
    assert all(code == 500 and "not healthy" in body for code, body in answers), answers
    took = _until_serving(freezer, "freezer", n_ok=10, since=t0)
    lines = _supervisor_lines(freezer)
    assert any("freezer_0_0" in line and "frozen" in line and "killed" in line for line in lines), lines
    assert "reloaded 'freezer'" in lines[-1], lines
    print(f"frozen stub: stuck requests answered {unstuck:.1f} s after the freeze, serving again at {took:.1f} s")


def test_a_killed_stub_of_a_model_that_writes_no_files_is_reloaded(freezer):
    """Triton 2.51 keeps the instances of a model whose files and config are unchanged: the
    reload must be a real one (the guards write their state beside their config, which hid it)."""
    assert _say(freezer, "ping") == (200, "ping")
    time.sleep(1.0)
    pid = next(p for p, s in scan_stubs({_triton_pid(freezer)}).items() if s.model == "freezer")
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    took = _until_serving(freezer, "freezer", n_ok=10, since=t0)
    assert pid not in scan_stubs({_triton_pid(freezer)})
    print(f"freezer serving again {took:.1f} s after its stub was killed")

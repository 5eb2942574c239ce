"""The supervisor's pure parts: reading stubs from argv, the flags it reads, its defaults.
The behaviour (dead stubs reloaded, a crashed server restarted) is tested against the real
server in tests/functional/test_supervisor.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tritonguard.ops.supervisor.control import (
    NO_ANSWER,
    Supervisor,
    control_mode,
    http_base,
    metrics_url,
    repository_headers,
    with_default_control,
)
from tritonguard.ops.supervisor.stall import (
    STALL_S,
    StallWatch,
    called_models,
    parse_progress,
    stall_seconds,
)
from tritonguard.ops.supervisor.stubs import Stub, parse_stub, scan_stubs

STUB_ARGV = ["/x/backends/python/triton_python_backend_stub", "model_repository/minilm/1/model.py",
             "triton_guard_backend_shm_region_6f77", "1048576", "1048576", "2775", "/x/backends/python",
             "336", "minilm_0_1", "/x/backends/guard"]


def test_a_stub_is_read_from_its_argv():
    stub = parse_stub(42, STUB_ARGV)
    assert (stub.pid, stub.model, stub.instance, stub.shm_region, stub.version_dir) == (
        42, "minilm", "minilm_0_1", "triton_guard_backend_shm_region_6f77", "model_repository/minilm/1")
    assert parse_stub(1, ["/usr/bin/python3", "x.py"]) is None
    assert parse_stub(1, STUB_ARGV[:5]) is None  # a stub of another layout is not guessed at


def test_a_stub_of_a_model_loaded_from_an_object_store_is_named_by_its_config(tmp_path):
    """Under S3, Triton loads each model from a copy /tmp/folderXXXXXX: the name comes from the
    copy's config.pbtxt, not from the folder (a dead stub was 'left alone' before)."""
    copy = tmp_path / "folderYXHB4u"
    (copy / "1").mkdir(parents=True)
    (copy / "config.pbtxt").write_text('name: "digits_raw"\nbackend: "runtime"\n')
    argv = [*STUB_ARGV[:1], str(copy / "1" / "model.py"), *STUB_ARGV[2:8], "digits_raw_0_0", STUB_ARGV[9]]
    assert parse_stub(7, argv).model == "digits_raw"
    (copy / "config.pbtxt").write_text('backend: "runtime"\n')  # no name: the folder's
    assert parse_stub(7, argv).model == "folderYXHB4u"


def test_explicit_control_is_the_default_and_the_users_choice_wins():
    assert with_default_control(["--model-repository=r"]) == [
        "--model-repository=r", "--model-control-mode=explicit", "--load-model=*"]
    for given in (["--model-control-mode=poll"], ["--model-control-mode", "none"], ["--load-model=digits"]):
        assert with_default_control(given) == given
    assert control_mode(["--model-control-mode", "POLL"]) == "poll"
    assert control_mode([]) == "none"


def test_the_http_endpoint_and_the_admin_header_come_from_the_servers_flags():
    assert http_base(["--http-port=18000", "--http-address=0.0.0.0"]) == "http://127.0.0.1:18000"
    assert http_base(["--http-address", "127.0.0.2"]) == "http://127.0.0.2:8000"
    assert http_base(["--allow-http=false"]) is None
    assert repository_headers(["--http-restricted-api=model-repository,model-config:x-key=s3cr=t"]) == {
        "x-key": "s3cr=t"}
    assert repository_headers(["--http-restricted-api=model-config:x-key=s"]) == {}
    assert repository_headers([]) == {}


def test_scan_finds_only_stub_children_of_the_given_parents(tmp_path):
    # a process whose argv reads as a stub's: argv[0] is only a name to the kernel
    argv = [str(tmp_path / "triton_python_backend_stub"), "-c", "import time; time.sleep(30)",
            "shm", "1", "1", "1", "/x", "minilm_0_1"]
    proc = subprocess.Popen(argv, executable=sys.executable)
    try:
        time.sleep(0.2)
        found = scan_stubs({os.getpid()})
        assert proc.pid in found and found[proc.pid].instance == "minilm_0_1"
        assert scan_stubs({proc.pid}) == {}
    finally:
        proc.kill()
        proc.wait()
    assert proc.pid not in scan_stubs({os.getpid()})


def test_a_server_that_never_became_live_is_not_restarted(tmp_path):
    """A bad flag or repository must not be retried forever: the supervisor exits with its code."""
    sup = Supervisor(sys.executable, [sys.executable, "-c", "import sys; sys.exit(3)", "--http-port=1"],
                     dict(os.environ), poll_s=0.05, log=lambda m: None)
    t0 = time.monotonic()
    assert sup.run() == 3
    assert time.monotonic() - t0 < 10 and sup.restarts == 0


@pytest.mark.parametrize("stopping", [False, True])
def test_a_server_that_dies_while_a_reload_waits_is_seen_at_once(stopping):
    """A load call can outlive the server it went to (measured against Triton: a SIGABRT during a
    reload left the call waiting): the reload gives up as soon as the server is gone. A server
    that exits because a stop was asked is not reported as died."""
    logs: list[str] = []
    sup = Supervisor(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "--http-port=1"],
                     dict(os.environ), poll_s=0.05, log=logs.append)
    release = threading.Event()

    class HangingControl:
        def config(self, model: str) -> str:
            return "{}"

        def load(self, model: str, config: str) -> tuple[bool, str]:
            release.wait(60)  # a call whose connection outlived the server
            return True, ""

    sup.control, sup.mode = HangingControl(), "explicit"
    sup._spawn()
    if stopping:
        sup.stopping = signal.SIGTERM
    try:
        threading.Timer(0.5, sup.proc.kill).start()
        t0 = time.monotonic()
        sup._recover("encoder", [])
        assert time.monotonic() - t0 < 10
        assert sup.proc.returncode is not None
        assert any("died during the reload of 'encoder'" in line for line in logs) is not stopping, logs
        assert not any("reloaded" in line for line in logs), logs
    finally:
        release.set()
        if sup.proc.poll() is None:
            sup.proc.kill()


def test_the_server_starts_clean_in_a_process_holding_a_grpc_channel():
    """CI run 41 (2026-11-30): the restart test below saw a start die of SIGABRT in a lane that
    had used gRPC. A ``preexec_fn`` made CPython run gRPC's at-fork hook in the child, whose
    restarted poller aborted once the child closed its fds (8 of 300 children). The shim starts
    the server without one: every start runs its program (with the preexec_fn this test failed in
    both of two runs, one start of 300 each time)."""
    import grpc

    channel = grpc.insecure_channel("127.0.0.1:1")  # a live channel: gRPC's poller runs
    try:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channel).result(timeout=0.2)
        sup = Supervisor("/bin/false", ["false"], dict(os.environ), log=lambda _line: None)
        codes = []
        for _ in range(300):
            sup._spawn()
            codes.append(sup.proc.wait())
    finally:
        channel.close()
    assert codes == [1] * 300, {c: codes.count(c) for c in set(codes)}


def test_the_server_dies_with_its_supervisor(tmp_path):
    """The shim's PR_SET_PDEATHSIG: a supervisor killed with SIGKILL (no handler runs) takes its
    server with it."""
    pidfile = tmp_path / "server.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time; from tritonguard.ops.supervisor.control import shim_argv; "
        f"p = subprocess.Popen(shim_argv('/bin/sleep', ['sleep', '60'])); open({str(pidfile)!r}, 'w').write(str(p.pid)); "
        "time.sleep(60)")])
    try:
        deadline = time.monotonic() + 20
        while not (pidfile.exists() and pidfile.read_text()):
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.05)
        child = int(pidfile.read_text())
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":  # exec'd
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while True:
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split()[2] == "Z":
                    break  # dead, not reaped yet
        except FileNotFoundError:
            break  # dead and reaped
        assert time.monotonic() < deadline, "the server outlived its supervisor"
        time.sleep(0.05)


def test_a_restarted_server_advertises_a_new_start_time(tmp_path):
    """Issue 39 item 7: the guards of a restarted server advertise when it started, not when the
    launcher did, so the exporter's readers see the restart (its counters start from zero)."""
    from tritonguard.rollout.replicas import ENV_STARTED

    seen = tmp_path / "started"
    # each start writes the start time it was given; the first dies after 0.5 s (a crash once
    # live: no HTTP, so live at once), the second asks the supervisor to stop
    script = (f"import os, signal, time; f = open({str(seen)!r}, 'a'); f.write(os.environ[{ENV_STARTED!r}] + '\\n');"
              "f.close(); n = len(open(f.name).readlines()); time.sleep(0.5);"
              "n == 1 and os._exit(1); os.kill(os.getppid(), signal.SIGTERM); time.sleep(30)")
    env = {**os.environ, ENV_STARTED: "12.500"}
    logs: list[str] = []
    sup = Supervisor(sys.executable, [sys.executable, "-c", script, "--allow-http=false"], env, poll_s=0.05,
                     min_backoff_s=0.05, stall_s=0, log=logs.append)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    t0 = time.time()
    try:
        assert sup.run() == -signal.SIGTERM, logs
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    first, second = (float(x) for x in seen.read_text().split())
    assert sup.restarts == 1 and first == 12.5, logs
    assert t0 <= second <= time.time()
    assert env[ENV_STARTED] == "12.500"  # the caller's environment is not changed


METRICS = """# HELP nv_inference_pending_request_count Instantaneous number of pending requests
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="tinylm_guard",version="1"} 3
nv_inference_pending_request_count{model="digits",version="1"} 0
nv_inference_exec_count{model="tinylm_guard",version="1"} 41
nv_inference_exec_count{model="digits",version="1"} 7
nv_inference_exec_count{model="digits",version="2"} 5
nv_inference_request_success{model="digits",version="1"} 99
nv_inference_exec_count{model="odd",version="1"} not-a-number
"""


def test_progress_is_read_from_the_metrics_page_and_summed_over_versions():
    assert parse_progress(METRICS) == {"tinylm_guard": (3, 41), "digits": (0, 12)}
    assert parse_progress("") == {}


def test_the_metrics_endpoint_comes_from_the_servers_flags():
    assert metrics_url(["--metrics-port=18002", "--metrics-address=0.0.0.0"]) == "http://127.0.0.1:18002/metrics"
    assert metrics_url([]) == "http://127.0.0.1:8002/metrics"
    assert metrics_url(["--allow-metrics=false"]) is None


def test_stall_seconds_come_from_the_environment():
    logged: list[str] = []
    assert stall_seconds({}, logged.append) == STALL_S
    assert stall_seconds({"TRITONGUARD_STALL_S": "0"}, logged.append) == 0
    assert stall_seconds({"TRITONGUARD_STALL_S": " 12.5 "}, logged.append) == 12.5
    assert not logged
    for bad in ("soon", "-1", "nan", "inf"):
        assert stall_seconds({"TRITONGUARD_STALL_S": bad}, logged.append) == STALL_S
    assert len(logged) == 4 and "TRITONGUARD_STALL_S='soon'" in logged[0]


class Clock:
    """CPU seconds per pid, set by the test (a stub's /proc figures)."""

    def __init__(self) -> None:
        self.cpu: dict[int, float] = {}

    def __call__(self, pid: int) -> float | None:
        return self.cpu.get(pid)


def _stub(pid: int, model: str, k: int = 0) -> Stub:
    return Stub(pid=pid, model=model, instance=f"{model}_0_{k}", shm_region=f"r{pid}")


def test_a_model_with_waiting_requests_no_execution_and_idle_stubs_is_stalled():
    cpu = Clock()
    watch = StallWatch(10.0, cpu=cpu)
    stubs = {1: _stub(1, "g"), 2: _stub(2, "g", 1), 3: _stub(3, "t")}
    cpu.cpu = {1: 5.0, 2: 7.0, 3: 1.0}
    assert watch.observe(0.0, {"g": (0, 10), "t": (0, 3)}, stubs) == []
    assert watch.observe(5.0, {"g": (2, 10), "t": (0, 3)}, stubs) == []  # the clock starts here
    cpu.cpu = {1: 5.3, 2: 10.0, 3: 1.0}  # stub 2 works (a long execution); stub 1 wakes, waiting on the GIL
    assert watch.observe(14.9, {"g": (4, 10), "t": (0, 3)}, stubs) == []  # 9.9 s: not yet
    (stall,) = watch.observe(15.0, {"g": (4, 10), "t": (0, 3)}, stubs)
    assert (stall.model, stall.waiting, stall.seconds, stall.idle) == ("g", 4, 10.0, [stubs[1]])
    assert abs(stall.busiest - 0.3) < 1e-9  # stub 2: 3 s of CPU in 10 s
    # judged: a fresh clock, not a stall at every reading after
    assert watch.observe(16.0, {"g": (4, 10)}, stubs) == []


def test_an_execution_or_an_empty_queue_restarts_the_clock():
    cpu = Clock()
    cpu.cpu = {1: 0.0}
    stubs = {1: _stub(1, "g")}
    watch = StallWatch(10.0, cpu=cpu)
    watch.observe(0.0, {"g": (2, 10)}, stubs)
    watch.observe(1.0, {"g": (2, 10)}, stubs)  # clock from 1.0
    watch.observe(8.0, {"g": (2, 11)}, stubs)  # an execution: cleared
    watch.observe(9.0, {"g": (2, 11)}, stubs)  # clock from 9.0
    assert watch.observe(18.0, {"g": (2, 11)}, stubs) == []
    watch.observe(18.5, {"g": (0, 11)}, stubs)  # nothing waits: cleared
    watch.observe(19.0, {"g": (1, 11)}, stubs)  # clock from 19.0
    assert watch.observe(28.0, {"g": (1, 11)}, stubs) == []
    (stall,) = watch.observe(29.0, {"g": (1, 11)}, stubs)
    assert stall.idle == [stubs[1]]


def test_busy_stubs_and_models_without_stubs_are_not_frozen():
    cpu = Clock()
    cpu.cpu = {1: 0.0}
    stubs = {1: _stub(1, "g")}
    watch = StallWatch(10.0, cpu=cpu)
    for t in (0.0, 1.0):
        watch.observe(t, {"g": (1, 5), "onnx_model": (9, 5)}, stubs)
    cpu.cpu = {1: 3.0}  # 30 % of one CPU over the 10 s: working
    (stall,) = watch.observe(11.0, {"g": (1, 5), "onnx_model": (9, 5)}, stubs)
    assert stall.model == "g" and stall.idle == [] and abs(stall.busiest - 0.3) < 1e-9
    # a stub that appeared during the stall (a reload) is not judged on a baseline it lacks
    watch.reset()
    for t in (0.0, 1.0):
        watch.observe(t, {"g": (1, 5)}, stubs)
    (stall,) = watch.observe(11.0, {"g": (1, 5)}, {7: _stub(7, "g")})
    assert stall.idle == []


def test_the_models_a_guard_calls_come_from_its_config():
    import json

    config = json.dumps({"name": "minilm_guard", "parameters": {
        "target": {"string_value": "minilm_raw"},
        "target_per_version": {"string_value": "minilm_raw_v{version}"},
        "similarity.model": {"string_value": "minilm_raw"},
        "semantic_cache.model": {"string_value": "not_loaded"},
        "placement": {"string_value": "bls"}}})
    loaded = {"minilm_raw", "minilm_raw_v1", "minilm_raw_v12", "minilm_raw_vx", "minilm_guard", "digits"}
    assert called_models(config, loaded) == ["minilm_raw", "minilm_raw_v1", "minilm_raw_v12"]
    assert called_models(json.dumps({"name": "freezer"}), loaded) == []
    assert called_models(None, loaded) == [] and called_models("not json", loaded) == []


def test_a_server_that_drops_the_load_call_then_dies_is_seen_as_died():
    """The other order: the dying server drops the load call's connection first (the call fails
    at once, no answer) and exits a moment later. A CI run logged "reload of 'minilm_encoder'
    failed after 0.6 s: " (no reason) for that, where the server had died during the reload."""
    logs: list[str] = []
    sup = Supervisor(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "--http-port=1"],
                     dict(os.environ), poll_s=0.05, log=logs.append)

    class DroppedControl:
        def config(self, model: str) -> str:
            return "{}"

        def load(self, model: str, config: str) -> tuple[bool, str]:
            threading.Timer(0.5, sup.proc.kill).start()  # it dies after the connection dropped
            return False, NO_ANSWER

    sup.control, sup.mode = DroppedControl(), "explicit"
    sup._spawn()
    try:
        sup._recover("encoder", [])
        assert sup.proc.returncode is not None
        assert any("died during the reload of 'encoder'" in line for line in logs), logs
        assert not any("failed after" in line for line in logs), logs
    finally:
        if sup.proc.poll() is None:
            sup.proc.kill()

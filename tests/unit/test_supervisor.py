"""The supervisor's pure parts: reading stubs from argv, the flags it reads, its defaults.
The behaviour (dead stubs reloaded, a crashed server restarted) is tested against the real
server in tests/functional/test_supervisor.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tritonguard.supervisor import (
    Supervisor,
    control_mode,
    http_base,
    parse_stub,
    repository_headers,
    scan_stubs,
    with_default_control,
)

STUB_ARGV = ["/x/backends/python/triton_python_backend_stub", "model_repository/minilm/1/model.py",
             "triton_guard_backend_shm_region_6f77", "1048576", "1048576", "2775", "/x/backends/python",
             "336", "minilm_0_1", "/x/backends/guard"]


def test_a_stub_is_read_from_its_argv():
    stub = parse_stub(42, STUB_ARGV)
    assert (stub.pid, stub.model, stub.instance, stub.shm_region) == (
        42, "minilm", "minilm_0_1", "triton_guard_backend_shm_region_6f77")
    assert parse_stub(1, ["/usr/bin/python3", "x.py"]) is None
    assert parse_stub(1, STUB_ARGV[:5]) is None  # a stub of another layout is not guessed at


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

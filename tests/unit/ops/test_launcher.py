import os
from pathlib import Path

import pytest

from tritonguard.ops import launcher


def test_python_backends_found():
    found = launcher.python_backends()
    assert {"guard", "runtime", "tokenizer"} <= set(found)
    assert all((p / "model.py").exists() for p in found.values())


def test_compose_backend_dir(tmp_path):
    root = launcher._pytriton_root()
    assert root is not None, "nvidia-pytriton is a dependency of the project"
    dest = launcher.compose_backend_dir(root, tmp_path / "backends")
    py = dest / "python"
    # real files (Triton rejects backend libraries whose realpath leaves the directory)
    for name in ("libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"):
        assert (py / name).is_file() and not (py / name).is_symlink(), name
    assert os.access(py / "triton_python_backend_stub", os.X_OK)
    assert (dest / "guard" / "model.py").exists()
    # idempotent, and stale backend links are removed
    (dest / "gone").symlink_to(tmp_path)
    launcher.compose_backend_dir(root, dest)
    assert not (dest / "gone").exists()


def test_resolve_bundled_tritonserver(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITONSERVER_BIN", raising=False)
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path))
    monkeypatch.setattr(launcher, "NGC_TRITONSERVER", tmp_path / "absent")
    monkeypatch.setenv("TRITONGUARD_ADMIN_KEY", "admin-key-for-the-test")  # Triton's default 0.0.0.0
    binary, argv, env = launcher.resolve_tritonserver(["--model-repository=x", "--http-port=1"])
    assert binary.endswith("tritonserver/bin/tritonserver")
    assert f"--backend-directory={tmp_path / 'backends'}" in argv
    assert argv[-4:-2] == ["--model-repository=x", "--http-port=1"]
    assert env["PATH"].split(os.pathsep)[0] == str(Path(__import__("sys").executable).parent)
    assert "nvidia_pytriton.libs" in env["LD_LIBRARY_PATH"]
    # a user-given backend directory is respected
    _, argv, _ = launcher.resolve_tritonserver(["--backend-directory=/b"])
    assert sum(a.startswith("--backend-directory") for a in argv) == 1


def test_missing_explicit_binary_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITONSERVER_BIN", "/nonexistent/tritonserver")
    with pytest.raises(launcher.LaunchError, match="TRITONSERVER_BIN=/nonexistent/tritonserver does not exist"):
        launcher.resolve_tritonserver([])
    assert launcher._exec(launcher.resolve_tritonserver, []) == 2


def test_no_tritonserver_anywhere(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITONSERVER_BIN", raising=False)
    monkeypatch.setattr(launcher, "NGC_TRITONSERVER", tmp_path / "absent")
    monkeypatch.setattr(launcher, "_pytriton_root", lambda: None)
    with pytest.raises(launcher.LaunchError, match="pip install nvidia-pytriton"):
        launcher.resolve_tritonserver([])


def test_perf_analyzer_resolves_binary_and_libraries(monkeypatch):
    monkeypatch.delenv("PERF_ANALYZER_BIN", raising=False)
    binary, argv, env = launcher.resolve_perf_analyzer(["--help"])
    assert launcher._is_elf(Path(binary))
    assert argv[1:] == ["--help"]
    assert "cuda_runtime" in env["LD_LIBRARY_PATH"]


def test_perf_analyzer_names_missing_libraries(monkeypatch):
    monkeypatch.setattr(launcher, "_missing_shared_libs", lambda b, e: ["libb64.so.0d"])
    with pytest.raises(launcher.LaunchError, match="libb64.so.0d: apt-get install libb64-0d"):
        launcher.resolve_perf_analyzer([])


def test_advertise_env_from_the_port_flags():
    from tritonguard.ops.launcher import advertise_env

    env = advertise_env(["--model-repository=r", "--http-port=9000", "--grpc-port", "9001",
                         "--metrics-port=9002"], {"TRITONGUARD_ADVERTISE_HOST": "10.1.2.3"})
    assert env["TRITONGUARD_ADVERTISE_HTTP"] == "http://10.1.2.3:9000"
    assert env["TRITONGUARD_ADVERTISE_GRPC"] == "10.1.2.3:9001"
    assert env["TRITONGUARD_ADVERTISE_METRICS"] == "http://10.1.2.3:9002/metrics"
    assert float(env["TRITONGUARD_ADVERTISE_STARTED"]) > 0
    # Triton's defaults and loopback; an operator's own value is kept
    env = advertise_env([], {"TRITONGUARD_ADVERTISE_HTTP": "http://lb:80"})
    assert env["TRITONGUARD_ADVERTISE_HTTP"] == "http://lb:80"
    assert env["TRITONGUARD_ADVERTISE_GRPC"] == "127.0.0.1:8001"
    assert env["TRITONGUARD_ADVERTISE_METRICS"] == "http://127.0.0.1:8002/metrics"


def test_an_object_store_repository_needs_redis_state(monkeypatch, tmp_path):
    """One line on stderr and exit 2: with the repository in S3, nothing the guards write may go
    into the store (and the file store would land in the shared /tmp)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITONGUARD_STATE_URL", "TRITONGUARD_REPOSITORY")}
    env["TRITONGUARD_HOME"] = str(tmp_path)
    env["PYTHONPATH"] = str(Path(launcher.__file__).resolve().parents[2])
    code = "import sys; from tritonguard.ops.launcher import tritonserver_main; sys.exit(tritonserver_main())"
    res = subprocess.run([sys.executable, "-c", code, "--model-repository=s3://http://127.0.0.1:9/b/repo"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: the model repository s3://http://127.0.0.1:9/b/repo is in an object store: set "
        "TRITONGUARD_STATE_URL=redis://… (rollout state, breakers and latency samples cannot live in the store)"]
    # with Redis named, the guards are told where the repository is
    monkeypatch.delenv("TRITONGUARD_REPOSITORY", raising=False)
    monkeypatch.setenv("TRITONGUARD_STATE_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path))
    monkeypatch.setattr(launcher, "NGC_TRITONSERVER", tmp_path / "absent")
    monkeypatch.setenv("TRITONGUARD_ADMIN_KEY", "admin-key-for-the-test")  # Triton's default 0.0.0.0
    _, _, env = launcher.resolve_tritonserver(["--model-repository", "s3://http://127.0.0.1:9/b/repo"])
    assert env["TRITONGUARD_REPOSITORY"] == "s3://http://127.0.0.1:9/b/repo"
    _, _, env = launcher.resolve_tritonserver(["--model-repository=/srv/models"])
    assert "TRITONGUARD_REPOSITORY" not in env


ADMIN_APIS = {"shared-memory", "model-repository", "model-config", "trace", "logging"}
KEY = "k3y-0123456789abcdef"


def _groups(argv, flag):
    """{api: "header=key"} over every ``flag`` group of argv."""
    out = {}
    for spec in launcher._flag_values(argv, flag):
        apis, _, kv = spec.partition(":")
        for api in apis.split(","):
            assert api not in out, f"{api} in two groups: Triton refuses to start"
            out[api] = kv
    return out


def _bundled(monkeypatch, tmp_path, key=None):
    monkeypatch.delenv("TRITONSERVER_BIN", raising=False)
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path))
    monkeypatch.setattr(launcher, "NGC_TRITONSERVER", tmp_path / "absent")
    monkeypatch.delenv("TRITONGUARD_ADMIN_HEADER", raising=False)
    if key is None:
        monkeypatch.delenv("TRITONGUARD_ADMIN_KEY", raising=False)
    else:
        monkeypatch.setenv("TRITONGUARD_ADMIN_KEY", key)


@pytest.mark.parametrize("addresses", [
    ["--http-address=127.0.0.1", "--grpc-address=127.0.0.1"],
    ["--http-address", "::1", "--grpc-address=localhost"],
    ["--http-address=127.0.0.2", "--allow-grpc=false"],
])
def test_a_loopback_server_needs_no_admin_key(monkeypatch, tmp_path, addresses):
    _bundled(monkeypatch, tmp_path)
    args = ["--model-repository=r", *addresses]
    _, argv, _ = launcher.resolve_tritonserver(args)
    assert argv[-len(args):] == args  # nothing added, nothing refused
    assert not any("restricted" in a for a in argv)


@pytest.mark.parametrize("addresses, frontend", [
    ([], "HTTP"),  # Triton's default: both frontends on 0.0.0.0
    (["--http-address=0.0.0.0", "--grpc-address=127.0.0.1"], "HTTP"),
    (["--http-address=127.0.0.1"], "GRPC"),
    (["--http-address=10.0.0.7", "--allow-grpc=false"], "HTTP"),
    (["--allow-http=false", "--grpc-address", "[::]"], "GRPC"),
])
def test_beyond_loopback_without_a_key_the_launcher_refuses(monkeypatch, tmp_path, capsys, addresses, frontend):
    """One line on stderr, exit 2, naming the variable: never a server whose load/unload and
    shared-memory registration are open to the network."""
    _bundled(monkeypatch, tmp_path)
    with pytest.raises(launcher.LaunchError, match=f"Triton's {frontend} frontend would listen on .* set TRITONGUARD_ADMIN_KEY"):
        launcher.resolve_tritonserver(["--model-repository=r", *addresses])
    assert launcher._exec(launcher.resolve_tritonserver, ["--model-repository=r", *addresses]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "TRITONGUARD_ADMIN_KEY" in err and "shared-memory" in err


def test_beyond_loopback_with_a_key_every_admin_api_is_restricted(monkeypatch, tmp_path, capsys):
    from tritonguard.ops.supervisor.control import repository_headers

    _bundled(monkeypatch, tmp_path, key=KEY)
    _, argv, _ = launcher.resolve_tritonserver(["--model-repository=r", "--http-port=8000"])
    for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
        groups = _groups(argv, flag)
        assert set(groups) == ADMIN_APIS, flag
        assert set(groups.values()) == {f"x-tritonguard-admin-key={KEY}"}
    # inference, health, metadata and statistics stay open: clients and probes need no key
    assert not {"inference", "health", "metadata", "statistics"} & set(_groups(argv, "--http-restricted-api"))
    # the supervisor (its reloads) and exporter (TRITONGUARD_ADMIN_KEY) send what Triton demands
    assert repository_headers(argv) == {"x-tritonguard-admin-key": KEY}
    # the header is the operator's when set
    monkeypatch.setenv("TRITONGUARD_ADMIN_HEADER", "x-ops-key")
    _, argv, _ = launcher.resolve_tritonserver(["--model-repository=r"])
    assert set(_groups(argv, "--grpc-restricted-protocol").values()) == {f"x-ops-key={KEY}"}
    monkeypatch.setenv("TRITONGUARD_ADMIN_HEADER", "x bad:header")
    with pytest.raises(launcher.LaunchError, match="TRITONGUARD_ADMIN_HEADER") as bad:
        launcher.resolve_tritonserver(["--model-repository=r"])
    # the key is in Triton's argv (the only way Triton takes it), never in what the launcher says
    assert KEY not in str(bad.value) and KEY not in capsys.readouterr().err


@pytest.mark.parametrize("given, added", [
    # the chart's and KServe's flags: every category already restricted, nothing added
    (["--http-restricted-api=shared-memory,model-repository,model-config,trace,logging:x-h=own",
      "--grpc-restricted-protocol=shared-memory,model-repository,model-config,trace,logging:x-h=own"], 0),
    # the old flags (repository and config only): the rest joins them, under the env key
    (["--http-restricted-api=model-repository,model-config:x-h=own",
      "--grpc-restricted-protocol", "model-repository,model-config:x-h=own"], 2),
    # an operator's group without the repository API
    (["--http-restricted-api=trace:x-h=own"], 2),
])
def test_an_operators_own_groups_are_completed_never_duplicated(monkeypatch, tmp_path, given, added):
    from tritonguard.ops.supervisor.control import repository_headers

    _bundled(monkeypatch, tmp_path, key=KEY)
    args = ["--model-repository=r", *given]
    _, argv, _ = launcher.resolve_tritonserver(args)
    assert sum("restricted" in a for a in argv) - sum("restricted" in a for a in args) == added
    for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
        spec = launcher.restricted_apis(argv, flag)
        assert spec == ADMIN_APIS, flag
        _groups(argv, flag)  # each category in one group
    expected = "own" if "model-repository" in launcher.restricted_apis(args, "--http-restricted-api") else KEY
    assert next(iter(repository_headers(argv).values())) == expected


def test_operators_groups_without_a_key_are_refused_when_incomplete(monkeypatch, tmp_path):
    _bundled(monkeypatch, tmp_path)
    full = "shared-memory,model-repository,model-config,trace,logging:x-h=own"
    _, argv, _ = launcher.resolve_tritonserver(
        ["--model-repository=r", f"--http-restricted-api={full}", f"--grpc-restricted-protocol={full}"])
    assert argv[-2:] == [f"--http-restricted-api={full}", f"--grpc-restricted-protocol={full}"]
    with pytest.raises(launcher.LaunchError, match=r"\(shared-memory, trace, logging\)"):
        launcher.resolve_tritonserver(["--model-repository=r", "--http-restricted-api=model-repository,model-config:x-h=own",
                                       f"--grpc-restricted-protocol={full}"])


def test_the_console_entry_refuses_in_one_line_and_never_prints_the_key(tmp_path):
    """The console entry as the image runs it: no key on 0.0.0.0 is one line and exit 2; with a
    key the refusal is gone and nothing the launcher printed before exec holds it."""
    import subprocess
    import sys

    fake = tmp_path / "tritonserver"  # records its argv; exits at once
    record = tmp_path / "argv"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{record}"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITONGUARD_")}
    env.update(TRITONGUARD_HOME=str(tmp_path), TRITONSERVER_BIN=str(fake), TRITONGUARD_SUPERVISE="0",
               PYTHONPATH=str(Path(launcher.__file__).resolve().parents[2]))
    code = "import sys; from tritonguard.ops.launcher import tritonserver_main; sys.exit(tritonserver_main())"
    res = subprocess.run([sys.executable, "-c", code, "--model-repository=/models"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: Triton's HTTP frontend would listen on 0.0.0.0") and "TRITONGUARD_ADMIN_KEY" in line
    assert not record.exists()
    env["TRITONGUARD_ADMIN_KEY"] = KEY
    res = subprocess.run([sys.executable, "-c", code, "--model-repository=/models"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    argv = record.read_text().splitlines()
    assert launcher.restricted_apis(argv, "--http-restricted-api") == ADMIN_APIS
    assert launcher.restricted_apis(argv, "--grpc-restricted-protocol") == ADMIN_APIS
    assert KEY not in res.stdout + res.stderr


def test_advertise_env_brackets_an_ipv6_pod_ip():
    from tritonguard.ops.launcher import advertise_env
    from tritonguard.rollout.replicas import replica_id

    env = advertise_env(["--http-port=8000"], {"TRITONGUARD_ADVERTISE_HOST": "fd00::12"})
    assert env["TRITONGUARD_ADVERTISE_HTTP"] == "http://[fd00::12]:8000"
    assert env["TRITONGUARD_ADVERTISE_GRPC"] == "[fd00::12]:8001"
    assert replica_id({"http": env["TRITONGUARD_ADVERTISE_HTTP"]}) == "fd00::12:8000"

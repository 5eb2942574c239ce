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
    binary, argv, env = launcher.resolve_tritonserver(["--model-repository=x", "--http-port=1"])
    assert binary.endswith("tritonserver/bin/tritonserver")
    assert f"--backend-directory={tmp_path / 'backends'}" in argv
    assert argv[-2:] == ["--model-repository=x", "--http-port=1"]
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
    _, _, env = launcher.resolve_tritonserver(["--model-repository", "s3://http://127.0.0.1:9/b/repo"])
    assert env["TRITONGUARD_REPOSITORY"] == "s3://http://127.0.0.1:9/b/repo"
    _, _, env = launcher.resolve_tritonserver(["--model-repository=/srv/models"])
    assert "TRITONGUARD_REPOSITORY" not in env
